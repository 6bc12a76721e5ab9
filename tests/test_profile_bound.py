"""Issue 30 item 5: an op profile never costs the measurement. ONNX Runtime's trace is bounded (one run's
trace sets how many runs the profiled pass may trace), read event by event, and a profile that cannot be
made leaves the timings and says why; a Loop's body nodes are counted once (the Loop keeps its own time)
and MACs inside control flow are marked "not counted" by `farm inspect`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from farm.model_generators.control_flow import write_loop_onnx

from farm.agents.harness.onnx_runner import run
from farm.agents.harness.onnxruntime_profile import control_flow_parents, ort_op_profile_file, parse_ort_profile
from farm.agents.harness.task import HarnessOutput, HarnessTask
from farm.models.runtimes import onnx_session

TRIPS, SIZE = 8, 16


def loop_model(path: Path, trips: int = TRIPS) -> Path:
    return write_loop_onnx(path, trips, SIZE)


@pytest.fixture
def loop_onnx(tmp_path: Path) -> Path:
    return loop_model(tmp_path / "loop.onnx")


def _task(model: Path, **kw) -> HarnessTask:
    return HarnessTask(kind="benchmark", model_path=str(model), iterations=10, warmup=1, op_profiling=True, **kw)


def test_a_loops_body_is_counted_once_and_the_loop_keeps_its_own_time(loop_onnx: Path, tmp_path: Path) -> None:
    session = onnx_session(str(loop_onnx), threads=1, profile_prefix=str(tmp_path / "trace"))
    for _ in range(3):
        session.run(None, {"x": np.ones((1, SIZE), np.float32)})
    trace = Path(session.end_profiling())
    parents = control_flow_parents(loop_onnx)
    assert parents == {"body_matmul": "the_loop", "body_relu": "the_loop", "body_cond": "the_loop"}
    spans = {r.name: r for r in ort_op_profile_file(trace) if r.kind == "node"}
    rows = {r.name: r for r in ort_op_profile_file(trace, parents) if r.kind == "node"}
    assert sorted(rows) == ["body_cond", "body_matmul", "body_relu", "outer_matmul", "the_loop"]  # one row a node
    assert rows["body_matmul"].times_called == TRIPS and rows["the_loop"].times_called == 1
    body = sum(rows[n].avg_ms for n in parents)
    # the Loop's span held its body: what is left is its own time, and the whole is counted once
    assert rows["the_loop"].avg_ms == pytest.approx(max(0.0, spans["the_loop"].avg_ms - body), abs=1e-9)
    assert sum(r.avg_ms for r in rows.values()) < sum(r.avg_ms for r in spans.values())
    assert sum(r.percent or 0 for r in rows.values()) == pytest.approx(100)
    # the streamed reader and the whole-text parser agree on the same file
    whole = {r.name: r.avg_ms for r in parse_ort_profile(trace.read_text(), parents)}
    assert whole == pytest.approx({n: r.avg_ms for n, r in rows.items()})


def test_a_body_nodes_first_run_is_every_call_in_that_run() -> None:
    """ORT logs a run's model_run event after its nodes; the cold run is all of a body node's calls in it."""
    events = []
    ts = 0
    for run_index in range(3):
        start = ts
        for _ in range(4):
            events.append({"cat": "Node", "name": "mm_kernel_time", "ts": ts, "dur": 50 if run_index == 0 else 10,
                           "args": {"op_name": "MatMul"}})
            ts += 60
        events.append({"cat": "Node", "name": "loop_kernel_time", "ts": start, "dur": ts - start + 20,
                       "args": {"op_name": "Loop"}})
        events.append({"cat": "Session", "name": "model_run", "ts": start, "dur": ts - start + 30, "args": {}})
        ts += 100
    rows = {r.name: r for r in parse_ort_profile(json.dumps(events), {"mm": "loop"})}
    assert rows["mm"].first_ms == pytest.approx(0.2) and rows["mm"].avg_ms == pytest.approx(0.04)
    assert rows["mm"].times_called == 4
    assert rows["loop"].avg_ms == pytest.approx((4 * 60 + 20) / 1000 - 0.04)  # the span less its body


def test_the_trace_is_bounded_and_says_what_it_left_out(loop_onnx: Path, tmp_path: Path) -> None:
    feeds = {"x": np.ones((1, SIZE), np.float32)}
    from farm.agents.harness.onnx_runner import profile_ops

    whole = HarnessOutput(ok=True)
    profile_ops(_task(loop_onnx), feeds, whole)
    assert whole.op_profile and whole.op_profile_note == ""
    one_run = HarnessOutput(ok=True)
    profile_ops(_task(loop_onnx), feeds, one_run, max_trace_bytes=1024)
    assert one_run.op_profile == [] and "trace of one run is" in one_run.op_profile_note
    assert "over the 1.0 KiB" in one_run.op_profile_note
    # room for a few runs: a profile of fewer runs than asked, and the note says how many
    session = onnx_session(str(loop_onnx), threads=1, profile_prefix=str(tmp_path / "one"))
    session.run(None, feeds)
    size = Path(session.end_profiling()).stat().st_size
    fewer = HarnessOutput(ok=True)
    profile_ops(_task(loop_onnx), feeds, fewer, max_trace_bytes=3 * size + size // 2)
    assert fewer.op_profile and "op profile of 3 run(s), not 10" in fewer.op_profile_note


def test_a_profile_that_cannot_be_made_leaves_the_timings(loop_onnx: Path) -> None:
    out = HarnessOutput(ok=True)
    run(_task(loop_onnx, max_trace_bytes=1024), out, lambda: 0)
    assert len(out.iterations_ms) == 10 and out.first_ms is not None and out.measure_wall_s
    assert out.op_profile == [] and "no op profile" in out.op_profile_note


def test_inspect_marks_the_macs_inside_a_loop_not_counted(loop_onnx: Path, farm) -> None:
    report = farm("inspect", str(loop_onnx), "--json").json()
    assert report["macs"] == SIZE * SIZE  # the outer MatMul; the body's are left out, and that is said
    assert report["op_count"] == 5  # every node once, the body's included
    (item,) = report["macs_not_counted"]
    assert item["name"] == "the_loop" and item["op"] == "Loop" and "1 MatMul" in item["note"]
    assert [layer["note"] for layer in report["layers"] if layer["op"] == "Loop"] == [item["note"]]
    table = farm("inspect", str(loop_onnx)).stdout
    assert "MACs not counted in Loop 'the_loop'" in table and "not counted" in table


def _snap(at: float, idle: int, steal: int = 0):
    from farm.agents.sim.contention import CoreClock, CoreTicks, HostSnapshot
    return HostSnapshot(at, {3: CoreTicks(busy=0, idle=idle, steal=steal)}, None, CoreClock(2600.0, "performance"))


def test_contention_is_judged_over_the_timed_loop_not_the_start_up() -> None:
    from farm.agents.sim.contention import judge, judge_timed_loop

    # a microsecond model's ~46 ms run: start-up sleeps while someone else's 10 ms tick lands on the core
    whole = judge(_snap(0.0, 100), _snap(0.046, 100), run_cpu_s=0.030, budget_cpus=1.0)
    assert whole.contended and whole.lost_share == pytest.approx(0.3478, abs=1e-4)
    # its 2 ms timed loop had the CPU: 10 µs of run-queue wait is 0.5 %, not contention
    figures = judge_timed_loop(whole, loop_s=0.002, loop_cpu_s=0.00198, loop_wait_s=0.00001, demand_cpus=1.0)
    assert not whole.contended and whole.reasons == [] and whole.lost_share == 0.005
    assert figures["whole_run_lost_share"] == pytest.approx(0.3478, abs=1e-4) and figures["wait_s"] == 0.00001
    # the loop queued behind other work for 30 % of it: contended, and the reason is the loop's
    queued = judge(_snap(0.0, 100), _snap(0.046, 100), run_cpu_s=0.030, budget_cpus=1.0)
    judge_timed_loop(queued, loop_s=0.01, loop_cpu_s=0.007, loop_wait_s=0.003, demand_cpus=1.0)
    assert queued.contended and queued.lost_share == 0.3 and queued.reasons[0].startswith("the timed loop waited 3 ms")
    # a half-CPU quota holds the loop back by itself: its throttled share of the loop is not contention
    quota = judge(_snap(0.0, 100), _snap(2.0, 100), run_cpu_s=1.0, budget_cpus=0.5, demand_cpus=1.0,
                  throttled_s=1.0)
    judge_timed_loop(quota, loop_s=1.0, loop_cpu_s=0.5, loop_wait_s=0.5, demand_cpus=1.0)
    assert quota.lost_share == 0.0 and not quota.contended
    # steal stays judged over the whole run (the loop's own counters cannot see it)
    stolen = judge(_snap(0.0, 100), _snap(2.0, 100, steal=30), run_cpu_s=1.7, budget_cpus=1.0)
    judge_timed_loop(stolen, loop_s=1.0, loop_cpu_s=1.0, loop_wait_s=0.0, demand_cpus=1.0)
    assert stolen.contended and [r for r in stolen.reasons if "steal" in r]


def test_a_sim_run_records_its_timed_loops_figures_and_is_judged_by_them(tmp_path: Path, loop_onnx: Path,
                                                                         farm) -> None:
    from conftest import write_job
    from farm.controller.store import SQLiteStore

    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "loop.onnx").write_bytes(loop_onnx.read_bytes())
    job = write_job(tmp_path / "job", "models: [loop.onnx]\nworkload: {type: benchmark, iterations: 200, warmup: 5}\n"
                                      "sim: {on_contention: flag}\n")
    run = farm("submit", str(job), "--json")
    assert run.returncode == 0, run.stderr + run.stdout[-2000:]
    (record,) = farm("results", "1", "--json").json()
    assert record["status"] == "completed"
    store = SQLiteStore(tmp_path / "farm.db")
    try:
        environment = json.loads(store.query("SELECT environment_json FROM runs WHERE id = ?",
                                             [record["run"]])[0]["environment_json"])
    finally:
        store.close()
    loop = environment["timed_loop"]
    # the loop's wall holds its 200 timed inferences, each at least the fastest one
    assert loop["wall_s"] >= 200 * record["latency_ms"]["min"] / 1000 * 0.999 and loop["wall_s"] < 60
    assert 0 <= loop["cpu_s"] and loop["wait_s"] >= 0 and 0 <= loop["lost_share"] <= 1
    assert record["contention"]["lost_share"] == loop["lost_share"]  # the verdict's figure is the loop's


@pytest.mark.parametrize("cpu, wait", [("0.5", 0.1), (float("nan"), 0.1), (-1.0, 0.1), (0.5, None), (True, 0.1),
                                       (0.5, float("inf"))])
def test_loop_figures_a_run_wrote_are_believed_only_as_finite_non_negative_numbers(cpu, wait) -> None:
    from farm.agents.sim.driver import _timed_loop

    assert _timed_loop(HarnessOutput(ok=True, measure_wall_s=1.0, loop_cpu_s=cpu, loop_wait_s=wait)) is None
    assert _timed_loop(HarnessOutput(ok=True, measure_wall_s=1.0, loop_cpu_s=0.5, loop_wait_s=0.1)) == (1.0, 0.5, 0.1)
    assert _timed_loop(HarnessOutput(ok=False, measure_wall_s=1.0, loop_cpu_s=0.5, loop_wait_s=0.1)) is None
