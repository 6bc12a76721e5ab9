"""Run inside the cgroup-v2 VM (tests/test_sim_cgroup_v2_vm.py boots it): the cgroup backend and the sim
driver called directly, in this one Python process, against the kernel's own v2 files; prints one JSON
document of what it found, which the host's tests judge. Then, given `--quickstart MODEL`, the quickstart
job goes end to end through `farm submit` (the CLI's own main(argv), its run in a real harness process under
the cgroup backend) in this same process: under TCG every guest Python start costs a minute at load (numpy,
pydantic and the rest imported again), so the guest starts one Python, not three (issue 34)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from farm.agents.sim.contention import parse_pressure_some_us
from farm.agents.sandbox import choose_backend
from farm.agents.sandbox.base import Budget
from farm.agents.sandbox.cgroup import CgroupBackend
from farm.agents.sim.driver import SimDriver
from farm.proto.tasks import TaskPlan, TaskSpec

MiB = 1 << 20
# The quickstart job as shipped, made short for an emulated CPU by --set (one small model, one thread, 3 runs
# after 1 warm-up: an iteration takes a second or two under TCG, and what is judged is the run's limits, its
# peak and its contention evidence, not its latency). The sampler reads once a second, not every 50 ms: under
# TCG its readings took 81 % of a guest CPU through a 73 s run (821 samples), and the peak judged here is the
# kernel's memory.peak, the contention evidence the pressure files, neither sampled.
QUICKSTART = ["submit", "quickstart.yaml", "--json",
              "--set", "models=[{path: models/mobilenetv2_w0.35_r96.tflite, family: mobilenetv2}]",
              "--set", "workload.iterations=3", "--set", "workload.warmup=1", "--set", "matrix.threads=[1]",
              "--set", "sim.memory=512m", "--set", "sim.sample_interval_ms=1000", "--set", "sim.backend=cgroup", "--set", "sim.on_contention=flag"]
ALLOCATE_400MB = "b = bytearray(400 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('survived')\n"
SPIN_1S = "import time\nend = time.monotonic() + 1\nwhile time.monotonic() < end: pass\n"


def _files(sandbox) -> dict[str, str]:
    d = sandbox.dirs[""]  # v2: one directory holds every controller's files
    return {name: (d / name).read_text().strip() for name in ("memory.max", "cpu.max", "cpuset.cpus", "memory.swap.max")}


def checks() -> None:
    found: dict = {"auto_backend": choose_backend("auto").name}
    backend = CgroupBackend()
    found["layout_version"] = backend.layout.version
    env = {"PATH": "/usr/bin:/bin"}
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        # the limits reach the kernel's files
        sandbox = backend.start(["sleep", "30"], Budget(cpus=1, cpuset="0", memory_bytes=96 * MiB), env=env, cwd=cwd,
                                mounts=[])
        try:
            found["files"] = _files(sandbox)
        finally:
            sandbox.kill()
            sandbox.close()
        # an exclusive cpuset: a v2 partition root, or why not
        sandbox = backend.start(["sleep", "30"], Budget(cpus=1, cpuset="1", exclusive=True), env=env, cwd=cwd, mounts=[])
        try:
            found["exclusive"] = sandbox.exclusive
        finally:
            sandbox.kill()
            sandbox.close()
        # past memory.max: the kernel's OOM killer, seen in memory.events, and the driver's verdict on it
        budget = Budget(cpus=1, memory_bytes=128 * MiB)
        sandbox = backend.start([sys.executable, "-S", "-c", ALLOCATE_400MB], budget, env=env, cwd=cwd, mounts=[])
        try:
            exit_info = sandbox.wait(120)
            found["oom"] = {"oom_killed": exit_info.oom_killed, "oom_kills": sandbox.oom_kills(),
                            "peak_mb": (exit_info.peak_memory_bytes or 0) / MiB,
                            "peak_source": exit_info.peak_memory_source, "returncode": exit_info.returncode}
        finally:
            sandbox.close()
        task = TaskSpec(task_id=1, job_id=1, attempt=1, target="sim", model_name="m", model_path="/m.tflite",
                        model_sha256="ab" * 32, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                        plan=TaskPlan(workload={"type": "script", "script": "hog.py"}, run_timeout_s=120, base_dir="/", sim={}))
        verdict = SimDriver(cwd / "work", run_as=None)._classify(task, budget, exit_info, None)
        found["oom"]["failure_class"] = verdict.failure_class.value if verdict.failure_class else None
        found["oom"]["message"] = verdict.message
        # two spinners on one core: the run's own cpu.pressure records the wait, and its quota the throttling
        spin = Budget(cpus=0.5, cpuset="0")
        sandboxes = [backend.start([sys.executable, "-S", "-c", SPIN_1S], spin, env=env, cwd=cwd, mounts=[]) for _ in range(2)]
        try:
            started = time.monotonic()
            for s in sandboxes:
                s.wait(60)
            accounting = [s.cpu_accounting() for s in sandboxes]
            found["pressure"] = {"wall_s": time.monotonic() - started,
                                 "cgroup_some_us": [a.pressure_some_us for a in accounting],
                                 "throttled_ns": [a.throttled_ns for a in accounting],
                                 "cpu_ns": [a.cpu_ns for a in accounting],
                                 "host_some_us": parse_pressure_some_us(Path("/proc/pressure/cpu").read_text())}
        finally:
            for s in sandboxes:
                s.close()
    print("@@checks")
    print(json.dumps(found), flush=True)


def quickstart(model: Path, root: Path) -> int:
    """`farm submit` of examples/quickstart.yaml (made short) in /tmp/jobs, with `model` (generated on the host)
    as its one model; prints its JSON between @@quick and @@end."""
    from farm.cli.main import main as farm_main
    jobs = Path("/tmp/jobs")
    (jobs / "models").mkdir(parents=True, exist_ok=True)
    shutil.copy(root / "examples" / "quickstart.yaml", jobs)
    shutil.copy(model, jobs / "models" / model.name)
    os.environ["FARM_DB"] = "/tmp/vm.db"
    os.chdir(jobs)
    print("@@quick", flush=True)
    try:
        status = farm_main(QUICKSTART)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    sys.stdout.flush()
    print(f"\n@@end {status}", flush=True)
    return status


def uptime(stage: str) -> None:
    """The guest's clock at the end of a stage, for the breakdown the host prints (@@t lines end no section)."""
    print(f"@@t {stage} {Path('/proc/uptime').read_text().split()[0]}", flush=True)


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parents[1]
    uptime("python-started")
    try:
        checks()
        uptime("checks")
    finally:  # the quickstart runs even when a check failed: each test judges its own section
        if argv[:1] == ["--quickstart"] and len(argv) == 2:
            quickstart(Path(argv[1]), root)
            uptime("quickstart")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
