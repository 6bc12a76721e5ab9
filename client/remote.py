"""`Farm` over gRPC: every question goes to the controller's FarmService; nothing opens a local store.

Model files (a job's, or the one `predict` measures) are resolved here with the user's own
rights and uploaded by content; the controller never opens a path of ours.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence, Iterator

import grpc
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from pydantic import ValidationError

from farm.proto.spec import Priority
from farm.proto.accuracy import DATASET_ARTIFACT_NAME
from farm.client.api import (
    EXIT_ENVIRONMENT, Farm, FarmError, OnProgress, PredictAsk, Prediction, Problem, Progress, RefreshAsk,
    Submitted,
)
from farm.client.config import Credentials
from farm.proto.questions import FINISH_REFRESH, PREDICT, AnswerT, AskT, Question, RefreshAnswer, explain
from farm.proto.regular_files import FileRefused, read_regular_file
from farm.proto.generated import farm_pb2, farm_pb2_grpc
from farm.proto.wire import fill_message, model_from_message

# The sandboxes fork; gRPC's fork handlers are not needed (children exec at once) and only log noise.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

UPLOAD_CHUNK_BYTES = 1 << 20
MAX_JOB_FILE_BYTES = 1 << 20  # the controller's limit too (grpc_server.MAX_JOB_FILE_BYTES)
FARM_SERVICE = farm_pb2.DESCRIPTOR.services_by_name["FarmService"]


# Calls a client may send again, to the next controller of its list, after one was sent and its answer lost: reads,
# and writes whose second arrival changes nothing (a cancel, a health set, a forget, an upload by content, a submit
# carrying its submit key). Any other call moves on only when its controller could not be reached before sending:
# a retry, a refresh, a calibration or a prediction sent twice could be done twice.
REPEATABLE = frozenset({
    "GetJob", "ListJobs", "GetResults", "ListDevices", "ListAgents", "DeviceHealth", "ListCalibrations", "Rank",
    "Report", "Drift", "Suggest", "MissingArtifacts", "WatchJob", "CancelJob", "SetDeviceHealth", "ForgetDevice",
    "UploadArtifact", "SubmitJob"})
CONNECT_S = 5.0  # how long an unrepeatable call waits for its controller's channel before trying the next
# how a controller whose lab store is out of reach begins its UNAVAILABLE answer (controller/scheduling/outage.py)
STORE_AWAY = "the lab's store "


class Unreachable(Exception):
    """The controller could not be reached: nothing was sent to it."""


class FarmClient:
    """FarmService calls with the token attached and errors turned into FarmError, through the first controller of
    `addresses` that answers: when one is unreachable the next is asked (issue 32), saying so on stderr."""

    def __init__(self, address: str, credentials: Credentials, others: Sequence[str] = ()) -> None:
        from farm.agents.link.remote_controller import token_metadata
        from farm.controller.auth import TlsFiles

        from farm.client.config import DEFAULT_PORT
        from farm.proto.addresses import controller_address

        try:  # RemoteFarm(address) from the Python API comes here without address_of
            self.addresses = [controller_address(a, DEFAULT_PORT) for a in (address, *others)]
        except ValueError as e:
            raise FarmError(f"the controller's address: {e}") from None
        self.tls = TlsFiles(ca=credentials.tls_ca, cert=credentials.tls_cert, key=credentials.tls_key) \
            if credentials.tls_ca else None
        self.metadata = token_metadata(credentials.token)
        self.at = 0  # which of `addresses` is asked now
        self._open()

    def _open(self) -> None:
        from farm.agents.link.remote_controller import open_channel

        self.address = self.addresses[self.at]
        self.channel = open_channel(self.address, tls=self.tls)
        self.stub = farm_pb2_grpc.FarmServiceStub(self.channel)  # type: ignore[no-untyped-call]

    def next_controller(self) -> str | None:
        """The controller asked now is gone: ask the next of the list from here on; the gone one's address
        (None: the list has no next, and nothing changed)."""
        if self.at + 1 >= len(self.addresses):
            return None
        gone = self.address
        self.channel.close()
        self.at += 1
        self._open()
        return gone

    def move_on(self, why: FarmError, doing: str) -> bool:
        if self.next_controller() is None:
            return False
        sys.stderr.write(f"farm: {why} Asking the next controller of the list, {self.address}, {doing}.\n")
        return True

    def _connected(self, timeout: float) -> None:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unreachable() from None

    def call(self, method: str, request: Any, timeout: float = 30) -> Any:
        """One call, through the next controller of the list while one is unreachable (a call in REPEATABLE also
        when its controller went away after it was sent)."""
        return self.through_any(method, lambda: getattr(self.stub, method)(request, metadata=self.metadata,
                                                                           timeout=timeout))

    def through_any(self, method: str, send: Callable[[], Any]) -> Any:
        first = self.address
        while True:
            try:
                if method not in REPEATABLE:
                    self._connected(CONNECT_S)
                answer = send()
            except Unreachable:
                lost = FarmError(f"cannot reach the controller at {self.address} (no connection in {CONNECT_S:g} s); "
                                 "nothing was sent to it.", EXIT_ENVIRONMENT)
            except grpc.RpcError as e:
                lost = self.explain(e)
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise lost from None
                if method not in REPEATABLE:  # sent, then the controller went away: it may have done it
                    raise FarmError(f"{lost} It went away after {method} was sent, so it may or may not have been "
                                    "done; ask another controller of the lab (`farm jobs`, `farm status JOB`) before "
                                    "sending it again.", EXIT_ENVIRONMENT) from None
            else:
                if self.address != first:
                    sys.stderr.write(f"farm: answered by the controller at {self.address}\n")
                return answer
            if not self.move_on(lost, f"for {method}"):
                raise lost from None

    def explain(self, e: grpc.RpcError) -> FarmError:
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE and details.startswith(STORE_AWAY):  # it answered; its database did not
            return FarmError(f"the controller at {self.address} answered, but {details}.", EXIT_ENVIRONMENT)
        if code == grpc.StatusCode.UNAVAILABLE:
            if self.tls is None:
                hint = "if it serves TLS, pass --tls-ca (or FARM_TLS_CA)"
            elif self.tls.cert is None:
                hint = ("check that it serves TLS with a certificate signed by --tls-ca for this host name; if it "
                        "requires client certificates (mutual TLS), pass --tls-cert and --tls-key")
            else:
                hint = "check that it serves TLS with a certificate signed by --tls-ca for this host name, and accepts yours"
            return FarmError(f"cannot reach the controller at {self.address}: {details}. Is `farm controller serve` "
                             f"running there? {hint[0].upper()}{hint[1:]}.", EXIT_ENVIRONMENT)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return FarmError(f"the controller at {self.address} did not answer in time", EXIT_ENVIRONMENT)
        return FarmError(f"the controller at {self.address} refused: {details}")

    def close(self) -> None:
        self.channel.close()


def _packed_dataset(spec: Any, models: list[Any], root: Any, base_dir: Path, source: str) -> bytes:
    """workload.dataset read, checked against every model and packed here, as an embedded farm does, as the .npz
    bytes the controller is sent (b"" without a dataset); JobFileError names the file and the field."""
    import base64

    from farm.controller.scheduling.jobfile import check_dataset

    dataset = spec.workload.dataset
    if dataset is None or (dataset.packed is None and dataset.artifact is not None):
        return b""  # none, or one the controller already holds (the file names it by sha256)
    check_dataset(spec, models, root, base_dir, source)
    packed = spec.workload.dataset.packed
    return base64.b64decode(packed) if packed else b""


def _upload_chunks(sha256: str, name: str, size: int, read: Callable[[int], bytes]) -> Iterator[Any]:
    """ArtifactUpload messages: the first names the artifact, every one carries up to 1 MiB."""
    data = read(UPLOAD_CHUNK_BYTES)
    yield farm_pb2.ArtifactUpload(sha256=sha256, size=size, name=name, data=data)
    while data := read(UPLOAD_CHUNK_BYTES):
        yield farm_pb2.ArtifactUpload(data=data)


class RemoteFarm(Farm):
    def __init__(self, address: str, credentials: Credentials | None = None, *, others: Sequence[str] = ()) -> None:
        """others: the lab's other controllers on the same store (`--controller a:1,b:2`), in order: a call whose
        controller is unreachable, and a watch whose controller goes away, carry on through the next of them."""
        self.credentials = credentials or Credentials.resolve()
        self.client = FarmClient(address, self.credentials, others)

    @property
    def where(self) -> str:
        return f"controller {self.client.address}"

    def close(self) -> None:
        self.client.close()

    def ask(self, question: Question[AskT, AnswerT], request: AskT) -> AnswerT:
        """The controller answers: the request model becomes its message, the response message becomes the
        answer model again (farm.proto.wire); an answer that is not its model is refused, never half-read."""
        method = FARM_SERVICE.methods_by_name[question.rpc]
        message = fill_message(GetMessageClass(method.input_type)(), request)
        response = self.client.call(question.rpc, message, timeout=question.timeout_s)
        return self._answer(question.rpc, response, question.answer)

    def _answer(self, rpc: str, response: Message, model: type[AnswerT]) -> AnswerT:
        try:
            return model_from_message(response, model)
        except ValidationError as e:
            raise FarmError(f"the controller at {self.client.address} answered {rpc} with {explain(e)}; refused",
                            EXIT_ENVIRONMENT) from None

    # --- uploads ------------------------------------------------------------------------
    def _upload(self, sha256: str, name: str, size: int, reader: Callable[[], Callable[[int], bytes]]) -> None:
        """reader: a fresh read function from the artifact's first byte (an upload cut off by its controller
        going away is sent whole again to the next one; it is stored by content, so twice is once)."""
        self.client.through_any("UploadArtifact", lambda: self.client.stub.UploadArtifact(
            _upload_chunks(sha256, name, size, reader()), metadata=self.client.metadata, timeout=3600))

    def _upload_job_files(self, source: Path, text: str) -> tuple[list[Any], str, str]:
        """Resolve the job's models (and script folder, or dataset) here and upload what the controller lacks.
        Returns the JobModel list, the script archive's sha256 ('' for a benchmark job) and the packed dataset's
        ('' without one)."""
        from farm.controller.scheduling.jobfile import JobFileError, check_benchmark_models, check_script, parse_job_text, resolve_models
        from farm.proto.script_archive import ScriptArchiveError, pack_dir
        from farm.proto.spec import BenchmarkWorkload

        base_dir = source.resolve().parent
        try:
            spec, root = parse_job_text(text, str(source))
            models, invalid = resolve_models(spec, root, base_dir, str(source))
            archive = dataset = b""
            if isinstance(spec.workload, BenchmarkWorkload):
                invalid += check_benchmark_models(spec, models, root, str(source))
                if invalid:  # every bad model at once, before anything is uploaded
                    raise JobFileError([m.problem for m in sorted(invalid, key=lambda m: (m.problem.line or 0, m.entry_index))])
                dataset = _packed_dataset(spec, models, root, base_dir, str(source))
            else:
                if invalid:
                    raise JobFileError([m.problem for m in invalid])
                script_dir, _ = check_script(spec, base_dir, root, str(source))
                try:
                    archive = pack_dir(script_dir)
                except ScriptArchiveError as e:
                    raise JobFileError(f"{source}: workload.dir: {e}") from None
        except JobFileError as e:
            raise FarmError(str(e), problems=[Problem.model_validate(p.to_json()) for p in e.problems]) from None
        archive_sha = hashlib.sha256(archive).hexdigest() if archive else ""
        dataset_sha = hashlib.sha256(dataset).hexdigest() if dataset else ""
        wanted = [m.facts.sha256 for m in models] + [sha for sha in (archive_sha, dataset_sha) if sha]
        answer = self.client.call("MissingArtifacts", farm_pb2.MissingArtifactsRequest(sha256=wanted))
        missing = set(answer.missing)
        for model in models:
            if model.facts.sha256 not in missing:
                continue
            missing.discard(model.facts.sha256)
            self._upload_model(model.path, model.facts.sha256, model.facts.size_bytes, answer.max_model_bytes)
        if archive_sha in missing:
            if answer.max_script_archive_bytes and len(archive) > answer.max_script_archive_bytes:
                raise FarmError(f"{source}: workload.dir packs to {len(archive)} bytes, over the controller's limit of "
                                f"{answer.max_script_archive_bytes}; give the script a folder of its own")
            self._upload(archive_sha, "dir.tar", len(archive), lambda: io.BytesIO(archive).read)
        if dataset_sha in missing:
            limit = answer.max_dataset_bytes
            if limit and len(dataset) > limit:  # an older or stricter controller: said before a byte is sent
                raise FarmError(f"{source}: workload.dataset packs to {len(dataset):,} bytes, over the controller's "
                                f"limit of {limit:,}; use workload.dataset.limit or fewer samples")
            self._upload(dataset_sha, DATASET_ARTIFACT_NAME, len(dataset), lambda: io.BytesIO(dataset).read)
        job_models = [farm_pb2.JobModel(entry=m.entry_index, name=m.name, sha256=m.facts.sha256, source=str(m.path))
                      for m in models]
        return job_models, archive_sha, dataset_sha

    def _upload_model(self, path: Path, sha256: str, size: int, limit: int) -> None:
        if limit and size > limit:
            raise FarmError(f"{path}: {size} bytes is over the controller's limit of {limit} bytes per model file "
                            "(its --max-model-bytes)")
        with contextlib.ExitStack() as files:
            self._upload(sha256, path.name, size, lambda: files.enter_context(path.open("rb")).read)

    # --- jobs ---------------------------------------------------------------------------
    def submit(self, source: Path, text: str | None = None, *, priority: Priority | None = None,
               max_tasks: int | None = None, skip_invalid: bool = False, detach: bool = False,
               on_warning: Callable[[str, str], None] | None = None, on_progress: OnProgress | None = None,
               overrides: Sequence[str] = ()) -> Submitted:
        text = self.job_text(source, text, overrides)
        if skip_invalid:
            raise FarmError("--skip-invalid runs in embedded mode only; a controller refuses a job with a bad model, "
                            "naming each one: drop them from the job file, or submit without --controller.")
        if text is None:
            try:
                text = read_regular_file(source, "job file", MAX_JOB_FILE_BYTES).decode()
            except FileRefused as e:
                raise FarmError(str(e)) from None
            except (OSError, UnicodeDecodeError) as e:
                raise FarmError(f"{source}: cannot read the job file: {e}.") from None
        if len(text.encode()) > MAX_JOB_FILE_BYTES:
            raise FarmError(f"{source}: the job file is over {MAX_JOB_FILE_BYTES} bytes")
        job_models, archive_sha, dataset_sha = self._upload_job_files(source, text)
        # the key makes sending it again safe: a controller that dies after making the job but before answering
        # leaves the job for the next controller of the list to name, not to make twice
        response = self.client.call("SubmitJob", farm_pb2.SubmitJobRequest(
            job_yaml=text, base_dir=str(source.resolve().parent), file_name=str(source), priority=priority or "",
            models=job_models, script_archive_sha256=archive_sha, submit_key=uuid.uuid4().hex,
            dataset_sha256=dataset_sha))
        if response.repeated:
            sys.stderr.write(f"farm: job {response.job_id} was made by the submit sent before (its controller went "
                             f"away before answering); the {self.where} names it, and made no second job\n")
        return Submitted(job=response.job_id, tasks=response.tasks, models=response.models or len(job_models),
                         where=self.where)

    def wait(self, job: int, on_progress: OnProgress | None = None) -> bool:
        """Follow the job to its end; when the controller goes away, through the next one given (the job is the
        lab's, in its store: it carries on whichever controller is alive)."""
        while True:
            try:
                for message in self.client.stub.WatchJob(farm_pb2.JobRequest(job_id=job), metadata=self.client.metadata):
                    if on_progress:
                        on_progress(Progress(job, message.status, message.total, message.completed, message.failed,
                                             message.running, message.canceled))
                return True
            except grpc.RpcError as e:
                lost = self.client.explain(e)
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise lost from None
            gone = self.client.next_controller()
            if gone is None:
                raise FarmError(f"{lost} Job {job} is kept in the lab's store and carries on without this client on "
                                f"whichever controller and agents remain; follow it with `farm watch {job}` through "
                                "another controller of the lab (`--controller a:PORT,b:PORT` moves on by itself).",
                                EXIT_ENVIRONMENT)
            sys.stderr.write(f"the controller {gone} went away; job {job} carries on: following it through "
                             f"{self.client.address}\n")

    def resume(self, job: int) -> None:
        """A controller carries on its own unfinished jobs after a restart; resuming one of its finished jobs
        runs its failed or lost tasks again (`farm retry JOB --failed`)."""
        info = self.job(job)
        if not info.finished:
            raise FarmError(f"job {job} is {info.status} at the {self.where}: the controller carries it on itself "
                            f"(`farm watch {job}` follows it); resuming is for a finished job's failed or lost tasks.")
        self.retry(job, failed=True)

    # --- analysis -----------------------------------------------------------------------
    def predict(self, ask: PredictAsk, on_progress: OnProgress | None = None) -> list[Prediction]:
        from farm.models.facts import ModelError, inspect_model

        if not ask.model.is_file():
            raise FarmError(f"{ask.model}: no such model file")
        try:
            facts = inspect_model(ask.model)
        except ModelError as e:
            raise FarmError(str(e)) from None
        answer = self.client.call("MissingArtifacts", farm_pb2.MissingArtifactsRequest(sha256=[facts.sha256]))
        if answer.missing:
            self._upload_model(ask.model, facts.sha256, facts.size_bytes, answer.max_model_bytes)
        measured: list[int] = []
        while True:  # each answer is the predictions, or a sim job the controller queued to measure first
            r = self._ask(PREDICT, model_sha256=facts.sha256, model_name=ask.model.name, device=ask.device,
                          metrics=list(ask.metrics), threads=ask.threads, confidence=ask.confidence,
                          include_contended=ask.include_contended, measured_jobs=measured)
            if r.measure_job is None:
                return r.predictions
            if r.measure_job in measured:
                raise FarmError(f"the controller asked to measure job {r.measure_job} twice; `farm status "
                                f"{r.measure_job}` shows it", EXIT_ENVIRONMENT)
            measured.append(r.measure_job)
            self.wait(r.measure_job, on_progress)

    def refresh(self, ask: RefreshAsk, on_progress: OnProgress | None = None) -> RefreshAnswer | None:
        if ask.suite is not None:
            raise FarmError("--suite: a controller refreshes with its own suite (`farm controller serve "
                            "--refresh-suite`), on the devices its agents registered")
        started = self.client.call("StartRefresh", farm_pb2.StartRefreshRequest())
        self.wait(started.job_id, on_progress)
        return self._ask(FINISH_REFRESH, job=started.job_id, k=ask.k, max_slope_change=ask.max_slope_change,
                         max_prediction_shift=ask.max_prediction_shift, max_intercept_change=ask.max_intercept_change,
                         max_r2_drop=ask.max_r2_drop, include_contended=ask.include_contended)
