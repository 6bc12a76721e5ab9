"""The sim's budget is real: memory past the limit ends as `resource` naming the limit,
half a CPU takes twice as long as one, and a short allocation spike is in the peak.

Each behaviour runs through `farm submit` for every backend that can run here; the
cgroup tests need root (CI runs as root), the docker ones an engine, which the tests
start when Debian's dockerd is installed (tests/docker_engine.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from conftest import require_backend, write_job
from farm.agents.sandbox import backend_class
from farm.agents.sandbox.base import Budget
from farm.agents.sim.telemetry import TelemetrySampler

MiB = 1 << 20
ALLOCATE_400MB = "b = bytearray(400 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('survived')\n"
# Fixed work, not fixed time: the wall time then shows how much CPU the budget allowed. ~0.4 s of one core here
# (12 million, ~1.4 s, until issue 34): at half a CPU that is still ~8 of the quota's and the duty cycle's 100 ms
# periods, so the budget, not where a period ends, sets the wall time; the retry-and-judge rule below is unchanged.
CPU_BOUND = "x = 0\nfor i in range(4_000_000): x += i * i\n"
CPU_BOUND_SHORT = CPU_BOUND


def _script_job(tmp_path: Path, tiny_models, script: str, sim: str, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    os.symlink(tiny_models["tflite"], d / "tiny.tflite")
    (d / "work.py").write_text(script)
    return write_job(d, f"models: [tiny.tflite]\nworkload: {{type: script, script: work.py}}\nsim: {sim}\n")


@pytest.mark.parametrize("backend", ["cgroup", "docker", "process"])
def test_allocation_past_the_limit_is_a_resource_failure_naming_it(backend: str, tmp_path: Path, tiny_models, farm) -> None:
    require_backend(backend)
    job = _script_job(tmp_path, tiny_models, ALLOCATE_400MB, "{memory: 128m}", "oom")
    run = farm("submit", str(job), "--backend", backend, "--json")
    assert run.returncode == 1, run.stderr
    r = run.json()["results"][0]
    assert r["failure_class"] == "resource", r
    assert "128 MiB limit" in r["message"] and "peak reached" in r["message"]
    assert r["attempts"] == 1  # out of memory is the model's size, not bad luck: never retried
    if backend == "process":
        assert r["peak_memory_mb"] > 100  # the watchdog's sample just above the limit
    else:
        assert 100 < r["peak_memory_mb"] <= 128 * 1.01  # the kernel held it at the limit


@pytest.mark.parametrize("backend", ["cgroup", "docker", "process"])
def test_half_a_cpu_takes_twice_as_long_as_one(backend: str, tmp_path: Path, tiny_models, farm) -> None:
    require_backend(backend)
    walls: dict[float, list[float]] = {0.5: [], 1.0: []}
    spoiled: list[list[str]] = []
    # Side by side in one test, in a balanced order, so the shared machine's drift hits both alike;
    # only runs farm judged uncontended count (other work on the run's core is not the budget),
    # and rounds repeat, within a bound, until each budget has two of them.
    order = (1.0, 0.5, 0.5, 1.0)
    for i in range(3 * len(order)):
        if min(len(v) for v in walls.values()) >= 2:
            break
        cpus = order[i % len(order)]
        job = _script_job(tmp_path, tiny_models, CPU_BOUND, f"{{cpus: {cpus}, quiet_wait: 2, on_contention: flag}}", f"cpu{i}")
        run = farm("submit", str(job), "--backend", backend, "--json")
        assert run.returncode == 0, run.stderr
        r = run.json()["results"][0]
        assert r["limits"]["cpus"] == cpus and r["backend"] == backend
        # the quota is a cap on the share of a core the run got, as farm's sampler saw it (a busy
        # machine can give it less, never more)
        slack = 1.25 if backend == "process" else 1.15  # the process backend's duty cycle is approximate
        assert r["cpu_percent"]["avg"] <= 100 * cpus * slack, r["cpu_percent"]
        if not r["contention"]["contended"]:
            # it had its budget: nearly all of it used over its wall time, so wall ≈ CPU work / cpus
            assert r["contention"]["cpu_of_budget"] > 0.85, r["contention"]
            walls[cpus].append(r["whole_run_s"])
        else:
            spoiled.append(r["contention"]["reasons"])
    if min(len(v) for v in walls.values()) < 2:
        # not a pass: the claim cannot be checked where no run had its core (the evidence is printed)
        print(f"uncontended runs {walls}; contended: {spoiled}")
        pytest.skip(f"{backend}: other work took the runs' cores in {len(spoiled)} of {i + 1} runs: "
                    f"{spoiled[-1][0] if spoiled else ''}")
    ratio = sum(walls[0.5][:2]) / sum(walls[1.0][:2])
    # Uncontended runs only. This VM's per-core speed still drifts between identical runs by up to
    # ±35 % (seen: 1.17 s and 1.53 s, both uncontended, with busy loops on the other vCPU, likely its
    # SMT sibling on the host): no counter inside the guest shows it, so the wall ratio keeps a band
    # that excludes "no limit" (1.0); the CPU-share checks above are the exact part.
    assert 1.4 < ratio < 3.0, walls


def test_the_process_backend_kills_a_child_started_late_that_goes_past_the_limit() -> None:
    """The process backend finds the run's tree again every TREE_RESCAN_S, not every watchdog tick: a child started
    after the run began, growing past the memory limit, is still found and the run killed as out of memory."""
    script = ("import subprocess, sys, time\ntime.sleep(0.5)\n"
              "child = 'b = bytearray(600 << 20)\\nfor i in range(0, len(b), 4096): b[i] = 1\\nimport time; time.sleep(20)'\n"
              "subprocess.run([sys.executable, '-c', child])\n")
    with tempfile.TemporaryDirectory() as d:
        sandbox = backend_class("process")().start([sys.executable, "-c", script], Budget(memory_bytes=300 * MiB),
                                                   env={"PATH": os.environ["PATH"]}, cwd=Path(d), mounts=[])
        exit_info = sandbox.wait(30)
        sandbox.close()
    assert exit_info.oom_killed and not exit_info.timed_out, exit_info


@pytest.mark.parametrize("backend", ["cgroup", "process"])
def test_a_100ms_allocation_spike_is_in_the_peak(backend: str) -> None:
    """200 MB held for 100 ms between long quiet phases: 3 s sampling would miss it."""
    require_backend(backend)
    sandbox_backend = backend_class(backend)()
    script = ("import time\ntime.sleep(0.6)\nb = bytearray(200 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
              "time.sleep(0.1)\ndel b\ntime.sleep(0.6)\n")
    with tempfile.TemporaryDirectory() as d:
        sandbox = sandbox_backend.start([sys.executable, "-c", script], Budget(memory_bytes=1 << 30),
                                        env={"PATH": os.environ["PATH"]}, cwd=Path(d), mounts=[])
        sampler = TelemetrySampler(sandbox, interval_ms=50).start()
        exit_info = sandbox.wait(30)
        sampler.stop()
        if backend == "cgroup":
            # the kernel's own counter, read here independently of farm's summary
            kernel_peak = int((sandbox.dirs["memory"] / "memory.max_usage_in_bytes").read_text()) \
                if sandbox.layout.version == 1 else int((sandbox.dirs[""] / "memory.peak").read_text())
        sandbox.close()
    summary = sampler.summary(exit_info)
    assert exit_info.returncode == 0
    assert summary.memory_peak_bytes >= 200 * MiB
    if backend == "cgroup":
        assert summary.memory_peak_source == "kernel"
        assert abs(summary.memory_peak_bytes - kernel_peak) <= 0.01 * kernel_peak
    # memory at the end is back near the start: the spike came and went
    assert summary.samples[-1].memory_bytes < 100 * MiB
    # the sampler really ran at about its period and measured its own cost
    assert len(summary.samples) >= 15
    assert summary.sampler_cpu_percent is not None and summary.sampler_cpu_percent < 20


def test_auto_prefers_kernel_accounting_and_reports_the_backend(farm) -> None:
    rows = {r["backend"]: r for r in farm("backends", "--json").json()}
    assert rows["process"]["available"] and rows["process"]["approximate"]
    if rows["cgroup"]["available"]:
        from farm.agents.sandbox import choose_backend
        assert choose_backend("auto").name == "cgroup"
    else:
        assert rows["cgroup"]["reason"]


def test_process_backend_results_are_marked_approximate(tmp_path: Path, tiny_models, farm) -> None:
    job = _script_job(tmp_path, tiny_models, "print('hi')\n", "{cpus: 1}", "approx")
    run = farm("submit", str(job), "--backend", "process", "--wide")  # the backend column is a --wide one
    assert run.returncode == 0, run.stderr
    assert "process*" in run.stdout and "approximate" in run.stdout
    r = farm("results", "1", "--json").json()[0]
    assert r["approximate"] is True and r["backend"] == "process"


@pytest.mark.parametrize("backend", ["process", "cgroup"])
def test_cpu_rates_beside_two_hogs_never_exceed_the_runs_cores(backend: str) -> None:
    """Issue 32: two threads spinning on one core, beside a hog on each core, sampled every 20 ms (a busy host
    stalls the sampler's reads, and its catch-up ticks come back to back): no rate above the one core the run may
    use (peaks of 225,084 % were shown before the reading's time was taken with its counters)."""
    from cpu_hog import cpu_hog

    require_backend(backend)
    # each thread spins for 0.75 s of its own CPU (a wall-clock 1.5 s left a starved sampler < 5 reads at load 13)
    script = ("import threading, time\nlast = time.monotonic() + 30\n"
              "def spin():\n    while time.thread_time() < 0.75 and time.monotonic() < last: pass\n"
              "threads = [threading.Thread(target=spin) for _ in range(2)]\n"
              "[t.start() for t in threads]\n[t.join() for t in threads]\n")
    with cpu_hog(0, weighted=False), cpu_hog(1, weighted=False), tempfile.TemporaryDirectory() as d:
        sandbox = backend_class(backend)().start([sys.executable, "-c", script], Budget(cpuset="0", memory_bytes=1 << 30),
                                                 env={"PATH": os.environ["PATH"]}, cwd=Path(d), mounts=[])
        sampler = TelemetrySampler(sandbox, interval_ms=20, max_cores=1).start()
        sandbox.wait(60)
        sampler.stop()
        sandbox.close()
    summary = sampler.summary()
    assert len(summary.samples) >= 5  # a starved sampler reads less often; what it reads must still hold
    assert max(s.cpu_percent for s in summary.samples) <= 100.0
    assert summary.cpu_peak_percent is not None and summary.cpu_peak_percent <= 100.0
    assert 5 <= summary.cpu_avg_percent <= 100.0  # it ran: its share of the hogged core, whatever the load


@contextlib.contextmanager
def _a_run_at_farms_weight(core: int) -> Iterator[None]:
    """A busy loop on `core` at the priority farm's runs take as root (nice -20): what another agent's run on this
    host, or the emulated boards' sim twins beside this worker, is to a run's sampler and watchdog on that core."""
    def setup() -> None:
        os.sched_setaffinity(0, {core})
        os.setpriority(os.PRIO_PROCESS, 0, -20)

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=setup)
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def test_a_process_run_beside_a_run_at_its_weight_is_still_sampled_and_paced(tmp_path: Path, tiny_models, farm) -> None:
    """Issue 34: beside the emulated boards (their sim twins at farm's weight), process-backend runs came back with no
    telemetry at all (cpu_percent None). The sampler and the duty-cycle watchdog run off the run's cores (here core
    1) at default priority, where a nice -20 loop left them ~1 % of the core; they, and the thread waiting for the
    run (whose lock they need), now take the runs' weight."""
    cores = sorted(os.sched_getaffinity(0))
    if os.geteuid() != 0 or len(cores) < 2:
        pytest.skip("needs root (a nice -20 loop, as farm's runs take) and two cores")
    job = _script_job(tmp_path, tiny_models, CPU_BOUND_SHORT,
                      f"{{cpus: 0.5, cpuset: '{cores[0]}', quiet_wait: 0, on_contention: flag}}", "beside")
    with _a_run_at_farms_weight(cores[1]):
        run = farm("submit", str(job), "--backend", "process", "--json")
    assert run.returncode == 0, run.stderr
    r = run.json()["results"][0]
    assert r["limits"]["cpuset"] == str(cores[0]), r["limits"]
    assert r["cpu_percent"]["avg"] is not None, r  # sampled at all: it was None before
    assert r["cpu_percent"]["avg"] <= 100 * 0.5 * 1.25, r["cpu_percent"]  # and the duty cycle still held it
