"""A question is defined once (issue 21): no `dict[str, Any]` crosses the client interface, and the table
of farm.proto.questions drives the gRPC servicer and the remote client. Each line names a service function
that takes the request model and returns the answer model, a FarmService method whose messages carry
both, and every answer survives the trip over the wire as it left."""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest
from pydantic import BaseModel, JsonValue, ValidationError

from farm.client.api import Farm
from farm.controller import service
from farm.controller.grpc_server import FarmServicer
from farm.proto import questions, strict_json
from farm.proto.generated import farm_pb2
from farm.proto.spec import Priority
from farm.proto.questions import QUESTIONS
from farm.proto.wire import answer_to_message, fill_message, model_from_message

FARM_SERVICE = farm_pb2.DESCRIPTOR.services_by_name["FarmService"]


def _untyped(annotation: Any, where: str, seen: set[Any]) -> list[str]:
    """Where `annotation` (recursively, into pydantic models' fields) is Any or a dict of Any."""
    if annotation is Any:
        return [f"{where}: Any"]
    if isinstance(annotation, list):  # a Callable's parameters
        return [p for a in annotation for p in _untyped(a, where, seen)]
    if annotation is JsonValue or annotation in seen:  # JSON, typed as JSON: a model input's shapes, a fit's choice
        return []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        seen.add(annotation)
        hints = get_type_hints(annotation)
        return [p for name in annotation.model_fields for p in _untyped(hints[name], f"{annotation.__name__}.{name}", seen)]
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):  # Submitted, Progress, PredictAsk
        seen.add(annotation)
        hints = get_type_hints(annotation)
        return [p for f in dataclasses.fields(annotation) for p in _untyped(hints[f.name], f"{annotation.__name__}.{f.name}", seen)]
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is typing.Annotated:
        return _untyped(args[0], where, seen)
    if origin in (dict, typing.Mapping) and args and args[1] is Any:
        return [f"{where}: {annotation}"]
    if origin in (list, tuple, dict, set, frozenset, Union, types.UnionType, typing.Sequence, typing.Callable) \
            or origin is not None:
        return [p for a in args if a is not Ellipsis for p in _untyped(a, where, seen)]
    return []


def test_no_dict_of_any_crosses_the_client_interface() -> None:
    import farm.client.api as api

    problems: list[str] = []
    seen: set[Any] = set()
    for name, method in inspect.getmembers(Farm, inspect.isfunction):
        if name.startswith("_") and name not in ("__enter__",):
            continue
        hints = get_type_hints(method, {**vars(api), "Priority": Priority})
        for param, annotation in hints.items():
            problems += _untyped(annotation, f"Farm.{name}({param})", seen)
    assert problems == []


def test_the_check_sees_a_dict_of_any() -> None:
    # the probe on a signature that has one: it must say so, or the test above proves nothing
    class Leaky(BaseModel):
        rows: list[dict[str, Any]]

    assert _untyped(Leaky, "x", set()) == ["Leaky.rows: dict[str, typing.Any]"]
    assert _untyped(dict[str, Any] | None, "y", set()) == ["y: dict[str, typing.Any]"]


@pytest.mark.parametrize("question", QUESTIONS, ids=lambda q: q.rpc)
def test_each_table_line_is_one_service_function_and_one_rpc(question: questions.Question[Any, Any]) -> None:
    function = getattr(service, question.service)
    hints = get_type_hints(function)
    parameters = list(inspect.signature(function).parameters)
    assert parameters == ["scope", "ask"] and hints["scope"] is service.Scope
    assert hints["ask"] is question.ask and hints["return"] is question.answer
    method = FARM_SERVICE.methods_by_name[question.rpc]
    assert not method.client_streaming and not method.server_streaming
    assert getattr(FarmServicer, question.rpc).__name__ == question.rpc  # made from the table, not by hand
    # every request field has its field on the wire (by name or alias)
    wire = method.input_type.fields_by_name
    for name, info in question.ask.model_fields.items():
        assert (info.alias or name) in wire, (question.rpc, name)


def _round_trip(answer: BaseModel, rpc: str) -> BaseModel:
    method = FARM_SERVICE.methods_by_name[rpc]
    from google.protobuf.message_factory import GetMessageClass
    message = GetMessageClass(method.output_type).FromString(
        answer_to_message(answer, GetMessageClass(method.output_type)()).SerializeToString())
    return model_from_message(message, type(answer))


def test_answers_cross_the_wire_as_they_left() -> None:
    job = questions.JobInfo(job=7, name="n", status="running", priority="normal", total=4, pending=1, running=1,
                            completed=1, failed=1, canceled=0, created_at=1.5, started_at=2.5, finished_at=None,
                            message=None, owner_pid=123, owner_host="here")
    back = _round_trip(job, "GetJob")
    assert back == job.model_copy(update={"owner_pid": None, "owner_host": None})  # only the embedded side has them
    assert _round_trip(questions.JobsAnswer(jobs=[job, job]), "ListJobs").jobs[1].job == 7  # type: ignore[attr-defined]
    forgot = questions.ForgetDeviceAnswer(device="rack1/phone", agent="rack1")
    assert _round_trip(forgot, "ForgetDevice").model_dump() == {"device": "rack1/phone", "agent": "rack1",
                                                                "action": "forget"}
    device = questions.DeviceInfo(name="rack1/sim", driver="sim", device_type="", tags=["a"], facts={"cores": 2},
                                  slots=1, state="online", agent="rack1", last_seen=3.0)
    assert _round_trip(questions.DevicesAnswer(devices=[device]), "ListDevices") == \
        questions.DevicesAnswer(devices=[device])
    # a JSON document: a power law has no `a`, and a non-finite figure survives to be flagged on output
    fits = questions.CalibrationsAnswer(calibrations=[questions.CalibrationVersion(
        id=1, device="d", metric="latency", threads=1, runtime=None, batch_size=1, input_size=None, precision=None,
        family=None, version=1, created_at=1.0, kind="log", n=4, r2=math.inf, loo_mape=None, within_10=None,
        kendall_tau=None, spearman_rho=None, source=None, warnings=[], formula="y = a x^b", features_used=[],
        unsafe=False, prior_weight=None, prior_source=None, exponent=0.9, factor=1.1)])
    back_fits = _round_trip(fits, "ListCalibrations")
    row = back_fits.model_dump()["calibrations"][0]
    assert "a" not in row and row["exponent"] == 0.9 and math.isinf(row["r2"])
    assert '"nonfinite": ["r2"]' in strict_json.dumps(back_fits.calibrations)  # type: ignore[attr-defined]
    report = questions.ReportAnswer(files=[questions.ReportFile(name="report.html", data=b"<html>\x00")], warnings=["w"])
    assert _round_trip(report, "Report") == report


def test_hostile_answers_and_requests_are_refused_by_their_models() -> None:
    # a report file's name from the wire becomes a file on the client: a plain name only
    for name in ("../x.png", "/etc/passwd.html", ".hidden.png", "a\x1b[2J.png", "x.sh"):
        with pytest.raises(ValidationError):
            questions.ReportFile(name=name, data=b"")
    # a terminal escape in a report's warning is shown, never sent to the terminal
    assert questions.ReportAnswer(files=[], warnings=["\x1b[2J"]).warnings == ["\\x1b[2J"]
    # a request from the wire is its model: bounded lists, known actions, the wire's 0 and "" as not given
    too_many = fill_message(farm_pb2.CalibrateRequest(), {"metrics": ["latency"] * 300})
    with pytest.raises(ValidationError) as e:
        model_from_message(too_many, questions.CalibrateAsk)
    assert questions.explain(e.value).startswith("metrics: List should have at most 256 items")
    with pytest.raises(ValidationError):
        model_from_message(farm_pb2.SetDeviceHealthRequest(device="d", action="explode"), questions.SetDeviceHealthAsk)
    ask = model_from_message(farm_pb2.CalibrateRequest(sim_job=1, device_job=2), questions.CalibrateAsk)
    assert (ask.job, ask.device, ask.metrics, ask.min_pairs) == (None, None, ["latency"], 4)
    with pytest.raises(ValidationError):
        model_from_message(farm_pb2.DriftRequest(device="d" * 201), questions.DriftAsk)


def test_a_typed_run_record_keeps_every_figure_of_the_stored_one(tmp_path, tiny_models) -> None:
    # the typed record is what both modes print: it must be the store's record exactly, none dropped, none added
    from conftest import write_job
    from farm.client.embedded import EmbeddedFarm
    from farm.controller.analysis.results import run_records

    job_file = write_job(tmp_path, f"""
name: typed
models: [{tiny_models['onnx']}, {tiny_models['tflite']}]
workload: {{type: benchmark, iterations: 2, warmup: 1, op_profiling: true}}
sim: {{memory: 256m, on_contention: flag}}
""")
    with EmbeddedFarm(tmp_path / "farm.db", backend="process", lab=lambda: []) as farm:
        submitted = farm.submit(job_file, skip_invalid=True)
        assert farm.wait(submitted.job)
        for ops in (False, True):
            typed = [r.model_dump() for r in farm.results(submitted.job, ops=ops)]
            assert typed == [r.model_dump() for r in run_records(farm.store, submitted.job, ops=ops)]
            assert strict_json.dumps(farm.results(submitted.job, ops=ops)) == strict_json.dumps(typed)
        assert farm.job(submitted.job).status in ("completed", "failed")


def test_the_table_made_servicer_checks_requests_and_the_client_checks_answers(tmp_path) -> None:
    # a real controller in this process: requests from the wire are validated as their models, refusals
    # keep their kind (NOT_FOUND, INVALID_ARGUMENT), and the remote client reads typed answers
    import grpc

    from farm.client.api import FarmError
    from farm.client.config import Credentials
    from farm.client.remote import RemoteFarm
    from farm.controller.grpc_server import serve
    from farm.controller.store import SQLiteStore as Store
    from farm.proto.generated import farm_pb2_grpc

    running = serve(Store(tmp_path / "farm.db"), "127.0.0.1:0", tokens=None)
    address = f"127.0.0.1:{running.port}"
    try:
        with grpc.insecure_channel(address) as channel:
            stub = farm_pb2_grpc.FarmServiceStub(channel)
            for call, request, code, says in (
                    (stub.Calibrate, farm_pb2.CalibrateRequest(metrics=["latency"] * 300), "INVALID_ARGUMENT",
                     "metrics: List should have at most 256 items"),
                    (stub.SetDeviceHealth, farm_pb2.SetDeviceHealthRequest(device="d", action="explode"),
                     "INVALID_ARGUMENT", "action: Input should be 'quarantine', 'release' or 'maintenance'"),
                    (stub.ListCalibrations, farm_pb2.ListCalibrationsRequest(device="\x1b" * 300), "INVALID_ARGUMENT",
                     "device: String should have at most 200 characters"),
                    (stub.GetJob, farm_pb2.JobRequest(job_id=9), "NOT_FOUND", "no job 9 in this farm"),
                    (stub.Rank, farm_pb2.RankRequest(job=9), "INVALID_ARGUMENT", "no job 9 in this farm"),
                    (stub.ForgetDevice, farm_pb2.ForgetDeviceRequest(name="nobody"), "NOT_FOUND",
                     "no agent has registered a device named 'nobody'")):
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, timeout=30)
                assert refused.value.code().name == code and refused.value.details().startswith(says), \
                    (call, refused.value.details())
        with RemoteFarm(address, Credentials(token=None)) as farm:
            assert farm.jobs() == [] and farm.devices() == [] and farm.agents() == [] and farm.drift() == []
            with pytest.raises(FarmError, match="refused: no job 9 in this farm"):
                farm.job(9)
            with pytest.raises(FarmError, match="^action: Input should be 'quarantine'"):  # refused before it is sent
                farm.set_device_health("d", "explode")
    finally:
        running.stop()


def test_a_controller_answer_that_is_not_its_model_is_refused(tmp_path) -> None:
    # a hostile (or broken) controller: a report file named as a path, a job answer missing its counts
    from concurrent import futures

    import grpc

    from farm.client.api import EXIT_ENVIRONMENT, FarmError
    from farm.client.config import Credentials
    from farm.client.remote import RemoteFarm
    from farm.proto.generated import farm_pb2_grpc

    class Hostile(farm_pb2_grpc.FarmServiceServicer):
        def Report(self, request: Any, context: Any) -> Any:
            return farm_pb2.ReportResponse(files=[farm_pb2.ReportFile(name="../../.bashrc.html", data=b"x")])

        def ListJobs(self, request: Any, context: Any) -> Any:
            return farm_pb2.ListJobsResponse(jobs=[farm_pb2.Job(id=1, name="x", message="\x1b[2J")])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    farm_pb2_grpc.add_FarmServiceServicer_to_server(Hostile(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with RemoteFarm(f"127.0.0.1:{port}", Credentials(token=None)) as farm:
            with pytest.raises(FarmError, match=r"answered Report with files\.0\.name: Value error, a report file") as bad:
                farm.report(1)
            assert bad.value.exit_code == EXIT_ENVIRONMENT
            # a message that is only unusual (all counts 0, an escape in its text) is an answer: shown, escaped later
            assert farm.jobs()[0].message == "\x1b[2J"
    finally:
        server.stop(0)
