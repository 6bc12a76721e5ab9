"""The android driver: one task on one phone with TFLite's `benchmark_model`, as a RunResult.

Composes the adb transport (agents/android/adb.py), the device type (flags, taskset mask) and
the output parser (agents/parsers/benchmark_model.py). Every way it can fail is mapped to
a failure class: the phone gone → infrastructure, the model refused → job (raw output kept).
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field

from farm.agents.android.adb import (
    AdbTarget, AndroidCommandTimeout, AndroidDevice, AndroidFacts, AndroidInfrastructureError, ShellResult,
)
from farm.agents.android.dataset import PhoneDatasetError, phone_dataset_pass
from farm.agents.android.script import phone_script_problem, run_script_on_phone
from farm.agents.drivers import DeviceEntry, register
from farm.agents.harness.stats import startup_ms, throughput_per_s
from farm.agents.parsers.benchmark_model import (
    BenchmarkModelOutput, BenchmarkOutputError, UnsupportedOperatorError, parse_benchmark_model,
)
from farm.proto.accuracy import judge_accuracy
from farm.proto.device_types import DeviceType
from farm.proto.op_profile import NODE, OP_TYPE, OpProfileRow, bounded
from farm.proto.results import FailureClass, Limits, RunResult, RunStatus, Telemetry
from farm.proto.spec import BenchmarkWorkload, ScriptWorkload
from farm.proto.tasks import TaskSpec
from farm.agents.parsers.tflite_delegates import parse_delegation

# Where Qualcomm's QNN TFLite delegate usually lies once pushed (its SDK's examples use /data/local/tmp)
QNN_DELEGATE = "/data/local/tmp/qnn_delegate/libQnnTFLiteDelegate.so"

MiB = 1 << 20
RAW_OUTPUT_CHARS = 8000


@dataclass
class AndroidDeviceConfig:
    """One phone in the lab's device list."""

    name: str
    host: str
    key_path: Path
    port: int = 5555
    benchmark_model: dict[str, Path] = field(default_factory=dict)  # ABI -> the lab's build of the tool
    qnn_delegate: str = QNN_DELEGATE  # where Qualcomm's QNN delegate library lies on the phone (unit qnn)
    thermal_limit_c: float = 45.0  # start only below this; a run that ends above it is flagged
    cooldown_timeout_s: float = 300.0
    cooldown_poll_s: float = 5.0


def _hottest(facts: AndroidFacts) -> float | None:
    # the battery zone lags the SoC by minutes: the guard looks at the SoC's own sensors
    temps = [t for zone, t in facts.thermal_c.items() if "battery" not in zone.lower()]
    return max(temps) if temps else None


def _wants_op_profile(task: TaskSpec) -> bool:
    return isinstance(task.plan.workload, BenchmarkWorkload) and task.plan.workload.op_profiling


def delegate_flags(unit: str, precision: str, qnn_delegate: str = QNN_DELEGATE) -> list[str]:
    """benchmark_model's flags for a compute unit (LiteRT's delegate providers); ValueError for a unit it lacks."""
    fp16 = "true" if precision == "fp16" else "false"
    if unit == "cpu":
        return []
    if unit == "gpu":
        return ["--use_gpu=true", f"--gpu_precision_loss_allowed={fp16}"]
    if unit == "nnapi":
        return ["--use_nnapi=true", f"--nnapi_allow_fp16={fp16}"]
    if unit == "hexagon":
        return ["--use_hexagon=true"]
    if unit == "qnn":  # Qualcomm's delegate is an external one: its library and its backend (HTP: the NPU)
        return [f"--external_delegate_path={qnn_delegate}", "--external_delegate_options=backend_type:htp"]
    raise ValueError(f"benchmark_model on a phone drives cpu, gpu, nnapi, hexagon and qnn, not {unit}")


BENCHMARK_APP = "org.tensorflow.lite.benchmark"  # TensorFlow's benchmark APK (tflite/tools/benchmark/android)
# what ends the app's run in logcat: its timings line (the memory and profile lines follow within a poll or two), or
# the tool's failure
_APP_DONE = ("Inference timings in us", "Benchmarking failed", "Failed to")
APP_POLL_S = 0.5


def sustained_window(shell: ShellResult, t_s: float, facts: AndroidFacts) -> dict[str, Any]:
    """One pass of the timed loop in a sustained run: when it ended, its average latency, the SoC's temperature."""
    try:
        avg = parse_benchmark_model(shell.output).to_latency_stats().avg
    except BenchmarkOutputError:
        avg = None
    return {"t_s": round(t_s, 3), "avg_ms": avg, "temperature_c": _hottest(facts)}


def sustained_summary(windows: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Burst against sustained: the first and the last window apart, and every window (bounded)."""
    first, last = windows[0]["avg_ms"], windows[-1]["avg_ms"]
    return {"seconds": seconds, "windows": windows[:1000], "first_avg_ms": first, "last_avg_ms": last,
            "last_over_first": round(last / first, 4) if first and last else None}


class AppCanceled(Exception):
    """The run was canceled while the benchmark app ran (the app is stopped)."""


def run_in_app(device: AndroidDevice, command: str, timeout_s: float, cancel_check: Callable[[], bool]) -> ShellResult:
    """Start the benchmark app with the run's flags and read its lines from logcat until it is done: `am start`
    returns at once, the benchmark runs inside the app's process (scheduled as an app is, not as a shell binary)."""
    if BENCHMARK_APP not in device.check(f"pm list packages {BENCHMARK_APP}"):
        raise LookupError(f"{device.target.serial}: TensorFlow's benchmark app ({BENCHMARK_APP}) is not installed; "
                          "install it once with `adb install -r -d -g android_aarch64_benchmark_model.apk` (the -g "
                          "grants it /data/local/tmp), or run the job with workload.android_mode: shell")
    device.check("logcat -c")
    started = device.shell(command, 60)
    if not started.ok or "Error" in started.output:
        raise AndroidInfrastructureError(f"{device.target.serial}: `am start` refused the benchmark app: "
                                         f"{started.output.strip()[-300:]}")
    deadline = time.monotonic() + timeout_s
    seen, done_at = "", None
    while True:
        if time.monotonic() > deadline:
            device.shell(f"am force-stop {BENCHMARK_APP}", 30)
            raise AndroidCommandTimeout(f"{device.target.serial}: the benchmark app did not finish within {timeout_s:g} s")
        if cancel_check():
            device.shell(f"am force-stop {BENCHMARK_APP}", 30)
            raise AppCanceled(f"{device.target.serial}: canceled while the benchmark app ran; the app was stopped")
        text = device.check("logcat -d -s tflite:V tflite_BenchmarkModelActivity:V", 60)
        if done_at is None and any(marker in text for marker in _APP_DONE):
            done_at = len(text)
        elif done_at is not None and len(text) == len(seen):
            return ShellResult(exit_status=0 if "Inference timings in us" in text else 1, output=text)
        seen = text
        time.sleep(APP_POLL_S)


def benchmark_command(tool: str, model: str, task: TaskSpec, device_type: DeviceType | None,
                      qnn_delegate: str = QNN_DELEGATE) -> str:
    flags = benchmark_flags(model, task, device_type, qnn_delegate)
    command = " ".join([shlex.quote(tool), *map(shlex.quote, flags)])
    mask = device_type.native_tool.taskset_mask_by_threads.get(task.threads) if device_type else None
    return f"taskset {mask} {command}" if mask else command


def app_command(model: str, task: TaskSpec, device_type: DeviceType | None, qnn_delegate: str = QNN_DELEGATE) -> str:
    """The same flags for TensorFlow's benchmark APK, started as a foreground activity (its README's form: all the
    flags in one `args` string extra; -S stops an earlier instance first)."""
    flags = " ".join(benchmark_flags(model, task, device_type, qnn_delegate))
    return f"am start -S -n {BENCHMARK_APP}/.BenchmarkModelActivity --es args {shlex.quote(flags)}"


def benchmark_flags(model: str, task: TaskSpec, device_type: DeviceType | None,
                    qnn_delegate: str = QNN_DELEGATE) -> list[str]:
    w = task.plan.workload
    if not isinstance(w, BenchmarkWorkload):
        raise ValueError(f"task {task.task_id} has a {w.type} workload; benchmark_model runs benchmarks")
    flags = [f"--graph={model}", f"--num_threads={task.threads}", f"--warmup_runs={w.warmup}",
             f"--num_runs={w.iterations}", "--min_secs=0",  # the run count is ours, not the tool's
             f"--use_xnnpack={'true' if w.use_xnnpack else 'false'}",
             "--report_peak_memory_footprint=true",
             *delegate_flags(task.plan.accelerator, task.plan.precision, qnn_delegate)]
    if _wants_op_profile(task):
        flags.append("--enable_op_profiling=true")
    if device_type is not None:
        ours = {f.split("=", 1)[0] for f in flags}
        flags += [f for f in device_type.native_tool.flags if f.split("=", 1)[0] not in ours]
    return flags


def op_profile_rows(parsed: BenchmarkModelOutput) -> list[OpProfileRow]:
    """The regular runs' tables as farm's op profile: "Summary by node type" and the "Run Order" nodes."""
    rows = [OpProfileRow(kind=OP_TYPE, node_type=r.node_type, avg_ms=r.avg_ms, percent=r.percent, count=r.count,
                         times_called=r.times_called, mem_kb=r.mem_kb) for r in parsed.op_types]
    rows += [OpProfileRow(kind=NODE, node_type=r.node_type, name=r.name, avg_ms=r.avg_ms, percent=r.percent,
                          first_ms=r.first_ms, times_called=r.times_called, mem_kb=r.mem_kb) for r in parsed.run_order]
    return rows


class AndroidEntry(DeviceEntry):
    """A phone in the lab's device list (adb over TCP)."""

    driver: Literal["android"]
    host: str
    port: int = 5555
    adb_key: str = "~/.config/farm/adbkey"
    benchmark_model: dict[str, str] = Field(default_factory=dict)
    thermal_limit_c: float = 45.0
    qnn_delegate: str = Field(QNN_DELEGATE, min_length=1, max_length=500, pattern=r"^/[\w./-]+\.so$")


def _path(p: str) -> Path:
    return Path(os.path.expanduser(p))


@dataclass
class _PhoneRun:
    """What one benchmark run on the phone measured, for the steps after it."""

    before: AndroidFacts
    after: AndroidFacts
    cooled_s: float
    command: str
    shell: ShellResult
    windows: list[dict[str, Any]]
    wall: float
    accuracy: dict[str, Any] | None
    dataset_note: str


class _PhoneRunFailed(Exception):
    """A step ended the run: the result to store."""

    def __init__(self, result: RunResult) -> None:
        super().__init__(result.message)
        self.result = result


# How a failure of the measurement is stored, first match wins: (exception, failure class, message prefixed with the
# device's name). A compute unit benchmark_model cannot drive is a ValueError: the job's.
_FAILURE_TABLE: tuple[tuple[type[Exception], FailureClass, bool], ...] = (
    (AndroidCommandTimeout, FailureClass.TIMEOUT, True),
    (AppCanceled, FailureClass.CANCELED, True),
    (AndroidInfrastructureError, FailureClass.INFRASTRUCTURE, True),
    (LookupError, FailureClass.INFRASTRUCTURE, False),
    (ValueError, FailureClass.JOB, True),
)
_PHONE_FAILURES = tuple(kind for kind, _, _ in _FAILURE_TABLE)


class AndroidDriver:
    name = "android"

    def __init__(self, config: AndroidDeviceConfig, device_type: DeviceType | None = None) -> None:
        self.config = config
        self.device_type = device_type

    @classmethod
    def from_entry(cls, entry: AndroidEntry, device_type: DeviceType | None) -> "AndroidDriver":
        return cls(AndroidDeviceConfig(
            name=entry.name, host=entry.host, port=entry.port, key_path=_path(entry.adb_key),
            benchmark_model={abi: _path(p) for abi, p in entry.benchmark_model.items()},
            thermal_limit_c=entry.thermal_limit_c, qnn_delegate=entry.qnn_delegate), device_type)

    def type_probe(self, facts: AndroidFacts) -> dict[str, Any]:
        return {"os": "android", "getprop": {"ro.product.model": facts.model}}

    def _target(self) -> AdbTarget:
        return AdbTarget(host=self.config.host, port=self.config.port, key_path=self.config.key_path)

    def facts(self) -> AndroidFacts:
        with AndroidDevice(self._target()) as device:
            return device.facts()

    def _tool(self, device: AndroidDevice, abi: str) -> str:
        local = self.config.benchmark_model.get(abi)
        if local is not None:
            return device.push_by_hash(Path(local), executable=True).remote_path  # cached on the phone by hash
        if device.shell("command -v benchmark_model", idempotent=True).ok:
            return "benchmark_model"
        raise LookupError(f"no benchmark_model for ABI {abi} on {self.config.name}: set benchmark_model.{abi} "
                          "in its device entry to the lab's build of the tool")

    def _cool_down(self, device: AndroidDevice, cancel_check: Callable[[], bool], limit_c: float) -> AndroidFacts:
        deadline = time.monotonic() + self.config.cooldown_timeout_s
        facts = device.facts()
        while (_hottest(facts) or 0) >= limit_c and time.monotonic() < deadline:
            if cancel_check():
                break
            time.sleep(self.config.cooldown_poll_s)
            facts = device.facts()
        return facts

    def run(self, task: TaskSpec, cancel_check: Callable[[], bool]) -> RunResult:
        """One task as a pipeline of named steps: the script or benchmark branch, the measurement on the phone (cool
        down, push, the timed loop, the sustained windows, the dataset pass), the run's environment, the parse of
        benchmark_model's output, the delegate's verdict, the result."""
        budget = Limits()  # the phone's own: nothing is imposed
        base: dict[str, Any] = dict(backend="android", limits=budget)
        w = task.plan.workload
        if not isinstance(w, BenchmarkWorkload):
            return self._run_script(task, cancel_check, base)
        limit_c = w.cooldown_c or self.config.thermal_limit_c  # the job's cool-down, else the device entry's guard
        if not task.model_path.endswith(".tflite"):
            return RunResult.failed(FailureClass.JOB, f"{Path(task.model_path).name}: benchmark_model on Android runs "
                                    ".tflite models", **base)
        try:
            measured = self._measure(task, w, cancel_check, limit_c)
        except _PHONE_FAILURES as e:
            return self._phone_failure(e, base)
        environment = self._environment(measured, w, limit_c)
        raw = measured.shell.output[-RAW_OUTPUT_CHARS:]
        try:
            parsed = self._parsed(task, measured.shell, environment, raw, base)
            message = self._delegation(task, measured.shell, environment, raw, base)
        except _PhoneRunFailed as e:
            return e.result
        return self._completed(task, measured, parsed, message, environment, raw, base)

    def _measure(self, task: TaskSpec, w: BenchmarkWorkload, cancel_check: Callable[[], bool],
                 limit_c: float) -> _PhoneRun:
        """On the phone: cool down to limit_c, push the tool and the model, run the timed loop (again for each
        sustained window), read the facts after and run the dataset pass."""
        with AndroidDevice(self._target()) as device:
            waiting = time.monotonic()
            before = self._cool_down(device, cancel_check, limit_c)
            cooled_s = time.monotonic() - waiting
            app = w.android_mode == "app"
            tool = "" if app else self._tool(device, before.abi)  # the app carries its own benchmark
            model = device.push_by_hash(Path(task.model_path)).remote_path
            if app:
                command = app_command(model, task, self.device_type, self.config.qnn_delegate)
            else:
                command = benchmark_command(tool, model, task, self.device_type, self.config.qnn_delegate)

            def once() -> ShellResult:
                if app:
                    return run_in_app(device, command, task.plan.run_timeout_s, cancel_check)
                return device.shell(command, timeout_s=task.plan.run_timeout_s)
            started = time.monotonic()
            shell = once()
            windows = [sustained_window(shell, 0.0, before)]
            # at least two windows (a first and a last to set apart), then on until sustained_s has passed
            while w.sustained_s and (len(windows) < 2 or time.monotonic() - started < w.sustained_s) \
                    and not cancel_check():
                shell = once()  # the timed loop again, as long as the job asked: the phone heats, clocks drop
                windows.append(sustained_window(shell, time.monotonic() - started, device.facts()))
            wall = time.monotonic() - started
            after = device.facts()
            accuracy, dataset_note = self._dataset(device, tool, model, task, app)
        return _PhoneRun(before, after, cooled_s, command, shell, windows, wall, accuracy, dataset_note)

    def _phone_failure(self, e: Exception, base: dict[str, Any]) -> RunResult:
        """A failure of the measurement as its failure class (_PHONE_FAILURES' table, first match wins)."""
        for kind, failure_class, named in _FAILURE_TABLE:
            if isinstance(e, kind):
                return RunResult.failed(failure_class, f"{self.config.name}: {e}" if named else str(e), **base)
        raise e  # not in the table: _PHONE_FAILURES and _FAILURE_TABLE name the same classes

    def _environment(self, measured: _PhoneRun, w: BenchmarkWorkload, limit_c: float) -> dict[str, Any]:
        before, after = measured.before, measured.after
        environment: dict[str, Any] = {
            "device": before.to_environment(), "command": measured.command, "android_mode": w.android_mode,
            "temperature_before_c": _hottest(before), "temperature_after_c": _hottest(after),
            "thermal_throttled": (_hottest(after) or 0) >= limit_c, "cooldown_c": limit_c,
            "cooldown_waited_s": round(measured.cooled_s, 3),
            "device_type": self.device_type.name if self.device_type else None}
        if w.sustained_s:
            environment["sustained"] = sustained_summary(measured.windows, w.sustained_s)
        return environment

    def _parsed(self, task: TaskSpec, shell: ShellResult, environment: dict[str, Any], raw: str,
                base: dict[str, Any]) -> BenchmarkModelOutput:
        """benchmark_model's output parsed, or _PhoneRunFailed: an unsupported operator, the delegate's own failure, or
        no result farm can read (the raw output kept with the run either way)."""
        try:
            return parse_benchmark_model(shell.output)
        except UnsupportedOperatorError as e:
            raise _PhoneRunFailed(RunResult.failed(
                FailureClass.JOB, f"{Path(task.model_path).name}: unsupported operator {e.operator} on "
                f"{self.config.name}", environment=environment, log_tail=raw, **base)) from None
        except BenchmarkOutputError:
            failed = parse_delegation(shell.output) if task.plan.accelerator != "cpu" else None
            if failed is not None and failed.verdict == "failed":  # the delegate's own failure, said as such
                environment["accelerator"] = {"unit": task.plan.accelerator, "precision": task.plan.precision,
                                              **failed.as_environment()}
                raise _PhoneRunFailed(RunResult.failed(
                    FailureClass.JOB, f"{Path(task.model_path).name} on {self.config.name}: {failed.note()}, and "
                    "benchmark_model stopped", environment=environment, log_tail=raw, **base)) from None
            raise _PhoneRunFailed(RunResult.failed(
                FailureClass.JOB, f"benchmark_model on {self.config.name} exited with status {shell.exit_status} "
                "and printed no result farm can read; its raw output is kept with the run",
                environment=environment, log_tail=raw, **base)) from None

    def _delegation(self, task: TaskSpec, shell: ShellResult, environment: dict[str, Any], raw: str,
                    base: dict[str, Any]) -> str:
        """The accelerator block of the environment and the delegate's note, or _PhoneRunFailed where the delegate left
        the run on the CPU: a run the delegate left on the CPU is no figure of the unit."""
        unit = task.plan.accelerator
        accelerator: dict[str, Any] = {"unit": unit, "precision": task.plan.precision}
        environment["accelerator"] = accelerator
        if unit == "cpu":
            return ""
        delegation = parse_delegation(shell.output)
        accelerator.update(delegation.as_environment())
        message = delegation.note()
        if delegation.on_cpu_entirely or delegation.verdict is None:
            raise _PhoneRunFailed(RunResult.failed(
                FailureClass.JOB, f"{Path(task.model_path).name} on {self.config.name}: asked for {unit}, but "
                f"{message}; no CPU figure is reported as a {unit} one", environment=environment, log_tail=raw,
                **base))
        return message

    def _completed(self, task: TaskSpec, measured: _PhoneRun, parsed: BenchmarkModelOutput, message: str,
                   environment: dict[str, Any], raw: str, base: dict[str, Any]) -> RunResult:
        """The completed run: timings, memory, the op profile and the dataset pass's accuracy, judged."""
        peak = parsed.periodic_peak_mb if parsed.periodic_peak_mb is not None else parsed.memory_overall_mb
        telemetry = Telemetry(interval_ms=50.0, memory_peak_bytes=None if peak is None else int(peak * MiB),
                              memory_peak_source="benchmark_model")
        latency = parsed.to_latency_stats()
        if _wants_op_profile(task) and not parsed.op_types and not parsed.run_order:
            environment["op_profile_note"] = ("benchmark_model was asked for --enable_op_profiling=true and printed no "
                                              "profiling tables (a build without the profiler?)")
        if measured.dataset_note:
            environment["dataset_note"] = measured.dataset_note
            message = "; ".join(m for m in (message, measured.dataset_note) if m)
        result = RunResult(
            status=RunStatus.COMPLETED, message=message, latency=latency, telemetry=telemetry, wall_s=measured.wall,
            throughput_per_s=throughput_per_s(latency), startup_ms=startup_ms(latency),
            op_profile=bounded(op_profile_rows(parsed)),
            peak_rss_bytes=None if parsed.memory_overall_mb is None else int(parsed.memory_overall_mb * MiB),
            environment=environment, tool_versions={"benchmark_model": parsed.generation}, log_tail=raw, **base)
        if measured.accuracy is not None:
            judge_accuracy(result, measured.accuracy, task)  # the block bounded, the job's thresholds judged here
        return result

    def _dataset(self, device: AndroidDevice, tool: str, model: str, task: TaskSpec,
                 app: bool) -> tuple[dict[str, Any] | None, str]:
        """workload.dataset's samples through the phone's benchmark_model (agents/android/dataset.py): the accuracy
        block, or why there is none (the run's timings stand either way)."""
        w = task.plan.workload
        if not isinstance(w, BenchmarkWorkload) or w.dataset is None:
            return None, ""
        if app:
            return None, "the dataset pass runs in shell mode only (android_mode: shell); this run has no accuracy"
        mask = self.device_type.native_tool.taskset_mask_by_threads.get(task.threads) if self.device_type else None
        try:
            return phone_dataset_pass(device, tool, model, Path(task.model_path), task,
                                      prefix=(lambda c: f"taskset {mask} {c}") if mask else (lambda c: c)), ""
        except PhoneDatasetError as e:
            return None, f"the dataset pass did not run: {e}"

    def _run_script(self, task: TaskSpec, cancel_check: Callable[[], bool], base: dict) -> RunResult:
        """A shell-script workload (command: sh); anything else is refused saying what does run on a phone."""
        w = task.plan.workload
        if not isinstance(w, ScriptWorkload):
            return RunResult.failed(FailureClass.BUG, f"task {task.task_id}: a {w.type} workload is not a script", **base)
        problem = phone_script_problem(w, self.config.name)
        if problem:
            return RunResult.failed(FailureClass.JOB, problem, **base)
        try:
            with AndroidDevice(self._target()) as device:
                before = self._cool_down(device, cancel_check, self.config.thermal_limit_c)
                result = run_script_on_phone(device, task, w, self.config.name)
        except AndroidCommandTimeout as e:
            return RunResult.failed(FailureClass.TIMEOUT, f"{self.config.name}: {e}", **base)
        except AndroidInfrastructureError as e:
            return RunResult.failed(FailureClass.INFRASTRUCTURE, f"{self.config.name}: {e}", **base)
        result.limits = base["limits"]
        result.environment.update({"device": before.to_environment(), "temperature_before_c": _hottest(before),
                                   "device_type": self.device_type.name if self.device_type else None})
        return result

register("android", AndroidEntry, AndroidDriver.from_entry)
