"""TensorRT through its native tool `trtexec` on a Jetson or an NVIDIA host (issue 29): the `tensorrt` and `dla`
units of a benchmark job on an .onnx model.

The engine is built from the .onnx once per board and kept by model hash, unit, precision and shapes
(`<remote_dir>/engines/`); a later run loads it. trtexec writes a new engine under a temporary name that
becomes the engine only when trtexec passed, so a build that crashed never leaves a half engine; an engine a
newer TensorRT refuses is removed, so the retry builds it again. The figures are trtexec's own: each timed
inference from `--exportTimes` (H2D + GPU compute + D2H), the summary's GPU compute time and transfers apart,
the engine's build or load time, and what fell back from the DLA to the GPU.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.agents.boards.ssh_transport import file_sha256
from farm.agents.boards.workload import BoardJobError
from farm.agents.harness.stats import latency_stats, throughput_per_s
from farm.agents.parsers.trtexec import TrtexecOutput, parse_export_times, parse_trtexec, summary_problem
from farm.proto.op_profile import NODE, OpProfileRow, bounded
from farm.proto.results import FailureClass, LatencyStats, RunResult, RunStatus
from farm.proto.spec import BenchmarkWorkload
from farm.proto.tasks import TaskSpec

TRTEXEC_UNITS = ("tensorrt", "dla")
LOG_TAIL_CHARS = 4000
MAX_TIMES_BYTES = 16 << 20
# Where JetPack puts trtexec (it is not on PATH there); a PATH one wins
FIND_TRTEXEC = 'T=$(command -v trtexec || echo /usr/src/tensorrt/bin/trtexec)'


def runs_with_trtexec(task: TaskSpec) -> bool:
    return (task.plan.accelerator in TRTEXEC_UNITS and isinstance(task.plan.workload, BenchmarkWorkload)
            and task.model_path.lower().endswith(".onnx"))


@dataclass
class StagedTrtexec:
    run_dir: str
    command: str
    ssh_timeout_s: float
    engine: str
    cached: bool


def trtexec_flags(task: TaskSpec, model: str, engine: str, cached: bool, run_dir: str) -> list[str]:
    w = task.plan.workload
    assert isinstance(w, BenchmarkWorkload)
    flags = [f"--loadEngine={engine}"] if cached else [f"--onnx={model}", f"--saveEngine={engine}.part"]
    if not cached:
        if task.plan.precision in ("fp16", "int8"):  # trtexec ≤ 10.x; 11.x builds strongly typed and refuses them
            flags.append(f"--{task.plan.precision}")
        if task.plan.accelerator == "dla":
            flags += ["--useDLACore=0", "--allowGPUFallback"]
        shapes = w.shape_overrides()
        if shapes:
            flags.append("--shapes=" + ",".join(f"{name}:{'x'.join(map(str, dims))}" for name, dims in sorted(shapes.items())))
    flags += [f"--iterations={w.iterations}", "--duration=0", f"--warmUp={200 if w.warmup else 0}",
              f"--exportTimes={run_dir}/times.json"]
    if w.op_profiling:
        flags += ["--dumpProfile", "--separateProfileRun"]
    return flags


def engine_name(task: TaskSpec, model_sha256: str) -> str:
    """The cache key: the model, the unit and precision, the shapes it was built for."""
    w = task.plan.workload
    assert isinstance(w, BenchmarkWorkload)
    shapes = hashlib.sha256(json.dumps(w.shape_overrides(), sort_keys=True).encode()).hexdigest()[:12]
    return f"{model_sha256}-{task.plan.accelerator}-{task.plan.precision}-{shapes}.engine"


def stage_trtexec(ssh: Any, task: TaskSpec, remote_dir: str) -> StagedTrtexec:
    """Send the model (by hash), find the engine in the board's cache, and write the command."""
    model = Path(task.model_path)
    sha = file_sha256(model)
    sent = ssh.upload_by_hash(model, remote_dir)
    engine = f"{remote_dir}/engines/{engine_name(task, sha)}"
    run_dir = f"{remote_dir}/runs/t{task.task_id}-a{task.attempt}-{uuid.uuid4().hex[:12]}"
    q = shlex.quote
    status, out, err = ssh.run(f"mkdir -p {q(run_dir)} {q(remote_dir + '/engines')} && {FIND_TRTEXEC} && "
                               f"[ -x \"$T\" ] && echo \"$T\" && {{ [ -s {q(engine)} ] && echo cached || true; }}", 60)
    if status != 0:
        raise BoardJobError(f"no trtexec on the board (not on PATH, nor /usr/src/tensorrt/bin): install TensorRT "
                            f"there, or ask for accelerators: [cuda] ({err.strip()[-200:]})")
    lines = out.split()
    cached = "cached" in lines
    flags = trtexec_flags(task, sent.remote_path, engine, cached, run_dir)
    # a new engine becomes the cached one only when trtexec passed: a crash never leaves a half engine behind
    command = (f"cd {q(run_dir)} && {FIND_TRTEXEC} && \"$T\" {' '.join(map(q, flags))}; s=$?; "
               f"if [ $s -eq 0 ] && [ -s {q(engine)}.part ]; then mv -f {q(engine)}.part {q(engine)}; "
               f"else rm -f {q(engine)}.part; fi; exit $s")
    timeout_s = task.plan.run_timeout_s + (0 if cached else 1800)  # an engine build takes minutes on a Jetson
    return StagedTrtexec(run_dir, command, timeout_s, engine, cached)


def read_times(ssh: Any, staged: StagedTrtexec) -> list[float]:
    status, out, _ = ssh.run(f"head -c {MAX_TIMES_BYTES} {shlex.quote(staged.run_dir + '/times.json')}", 60)
    return parse_export_times(out) if status == 0 else []


def forget_engine(ssh: Any, staged: StagedTrtexec) -> None:
    ssh.run(f"rm -f {shlex.quote(staged.engine)}", 30)


def _summary_latency(out: TrtexecOutput) -> LatencyStats | None:
    s = out.stats.get("Latency")
    if s is None or s.mean is None or s.min is None or s.max is None:
        return None
    median = s.median if s.median is not None else s.mean
    return LatencyStats(init=None, first=None, warmup_avg=None, avg=s.mean, p50=median,
                        p90=s.percentiles.get("90", median), p99=s.percentiles.get("99", s.max), std=0.0,
                        min=s.min, max=s.max, count=out.queries or 0)


def trtexec_environment(out: TrtexecOutput, staged: StagedTrtexec) -> dict[str, Any]:
    def mean(name: str) -> float | None:
        stat = out.stats.get(name)
        return stat.mean if stat else None
    return {"version": out.version, "device": out.device, "engine_cached": staged.cached,
            "engine_build_s": out.engine_build_s, "engine_load_s": out.engine_load_s,
            "engine_size_mib": out.engine_size_mib, "throughput_qps": out.throughput_qps,
            "gpu_compute_ms": mean("GPU Compute Time"), "h2d_ms": mean("H2D Latency"), "d2h_ms": mean("D2H Latency"),
            "enqueue_ms": mean("Enqueue Time"), "host_walltime_s": out.host_walltime_s,
            "gpu_compute_total_s": out.gpu_compute_total_s, "dla_fallbacks": out.dla_fallbacks[:50],
            "layers_on_dla": out.layers_on_dla, "layers_on_gpu": out.layers_on_gpu,
            "precision_not_native": out.precision_not_native, "warnings": out.warnings[:10]}


def trtexec_result(task: TaskSpec, board: str, staged: StagedTrtexec, sampled: Any, times_ms: list[float],
                   energy_mj: float | None, facts: dict, source: str, base: dict) -> RunResult:
    """trtexec's output and the board's telemetry as one RunResult; a failure keeps the tool's own words."""
    status = sampled.result.status
    text = sampled.result.stdout + "\n" + sampled.result.stderr
    log = text[-LOG_TAIL_CHARS:]
    out = parse_trtexec(text)
    unit = {"unit": task.plan.accelerator, "precision": task.plan.precision}
    environment: dict[str, Any] = {"device": facts, "command": staged.command, "telemetry_source": source,
                                   "accelerator": unit, "trtexec": trtexec_environment(out, staged)}
    name = Path(task.model_path).name
    versions = {"tensorrt": out.version} if out.version else {}
    problem = summary_problem(out)
    if problem is not None or status != 0:
        why = problem or f"trtexec exited with status {status}"
        where = "loading its cached engine" if staged.cached else "building the engine"
        return RunResult.failed(FailureClass.JOB, f"{name} on {board} ({task.plan.accelerator}, {where}): {why} "
                                f"(exit status {status}); its output is kept with the run", environment=environment,
                                log_tail=log, tool_versions=versions, runtime="tensorrt", **base)
    if out.precision_not_native:
        environment["accelerator"]["note"] = (f"{'/'.join(out.precision_not_native)} was asked for, but this GPU has no "
                                              "native support: TensorRT ran other kernels")
    latency = (latency_stats(times_ms, init_ms=(out.engine_load_s or 0) * 1000 or None) if times_ms
               else _summary_latency(out))
    if energy_mj is not None and sampled.wall_s > 0:
        environment["energy_mj"] = energy_mj
        n = len(times_ms) or out.queries or 0
        busy_s = out.host_walltime_s or 0
        if n and busy_s:
            environment["energy_per_inference_mj"] = energy_mj * min(1.0, busy_s / sampled.wall_s) / n
    profile = [OpProfileRow(kind=NODE, node_type="trt_layer", name=r.layer, avg_ms=r.avg_ms, percent=r.percent)
               for r in out.profile]
    message = "; ".join(filter(None, [
        f"{len(out.dla_fallbacks)} layer(s) fell back from the DLA to the GPU" if out.dla_fallbacks else "",
        environment["accelerator"].get("note", "")]))
    return RunResult(
        status=RunStatus.COMPLETED, message=message, iterations_ms=times_ms, latency=latency,
        throughput_per_s=out.throughput_qps if out.throughput_qps else throughput_per_s(latency),
        telemetry=sampled.telemetry(), wall_s=sampled.wall_s, environment=environment, tool_versions=versions,
        log_tail=log, runtime="tensorrt", op_profile=bounded(profile), **base)
