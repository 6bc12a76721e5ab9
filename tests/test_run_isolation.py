"""Two tenants' runs at once on one root agent (issue 33, H1 and M2), against real namespaces, uids and processes.

A victim's benchmark (warm or cold) is caught running and held (SIGSTOP, from the test, as root) while a hostile
script runs beside it, on the same agent (two slots) or on a second agent of the same host. The script does what
the attack did: it looks for the other run in /proc/self/mountinfo, and — told the victim's real path, as if it had
found it — lists it, copies its model, reads its task.json, puts a folder named out.tmp in its way and plants an
out.json; it plants a forged out.json in its own directory too. None of it may work: the victim's stored result is
its own, and so is the attacker's. A run's /proc/self/fd and /proc/self/maps hold nothing it did not open itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import require_backend
from farm.agents.harness.run_world import mount_table
from farm.agents.sandbox.isolation import namespaces_unavailable, run_uid_range
from farm.agents.sandbox.warm import WARM_ENV
from farm.agents.sim.driver import SimDriver, SimSlot
from farm.proto.results import RunResult
from farm.proto.tasks import TaskPlan, TaskSpec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="run uids and namespaces need a root agent")

FORGED = {"ok": True, "runtime": "onnxruntime", "iterations_ms": [0.123], "tool_versions": {"forged": "yes"}}
VICTIM_ITERATIONS = 50_000  # long enough to be caught running; it is held stopped while the attack runs anyway

ATTACK = '''
import json, os, shutil, sys
FORGED = %r
report = {}
victim = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "victim.txt")).read().strip()
mounts = open("/proc/self/mountinfo").read().splitlines()
report["run_mounts"] = [l for l in mounts if "farm-run" in l.split(" - ")[1].split()[1:2] and l.split()[4] != "/tmp/run"]
report["victim_named"] = [l for l in mounts if os.path.basename(victim) in l]
def attempt(name, action):
    try:
        action()
        report[name] = "done"
    except OSError as e:
        report[name] = e.strerror
attempt("list", lambda: os.listdir(victim))
attempt("copy_model", lambda: shutil.copytree(os.path.join(victim, "model"), "stolen"))
attempt("read_task", lambda: open(os.path.join(victim, "task.json")).read())
attempt("block_tmp", lambda: os.mkdir(os.path.join(victim, "out.tmp")))
attempt("plant_out", lambda: open(os.path.join(victim, "out.json"), "w").write(json.dumps(FORGED)))
for line in mounts:  # every other mount a real attacker would try
    point = line.split()[4]
    if "/runs/" in point and point != "/tmp/run":
        attempt("via_mountinfo:" + point, lambda: os.listdir(point))
# and its own directory: a forged result where the harness once wrote its own
open("out.json", "w").write(json.dumps(FORGED))
os.mkdir("out.tmp")
print("ATTACK " + json.dumps(report), flush=True)
print(json.dumps({"latency_ms": 1.5}), flush=True)
''' % (FORGED,)

LOOK = '''
import json, os
fds = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink("/proc/self/fd/" + fd)
    except OSError:
        pass
shared = [l for l in open("/proc/self/maps").read().splitlines() if len(l.split()) > 5 and l.split()[1][3] == "s"]
print("LOOK " + json.dumps({"fds": fds, "shared": shared, "uid": os.getuid(), "gid": os.getgid()}), flush=True)
print(json.dumps({"latency_ms": 1.0}), flush=True)
'''


def _plan(workload: dict, backend: str, base_dir: Path) -> TaskPlan:
    return TaskPlan(workload=workload, sim={"backend": backend, "memory": "512m", "on_contention": "flag"},
                    run_timeout_s=300, base_dir=str(base_dir))


def _task(model: Path, workload: dict, backend: str, base_dir: Path, task_id: int) -> TaskSpec:
    return TaskSpec(task_id=task_id, job_id=task_id, attempt=1, target="sim", model_name=model.stem,
                    model_path=str(model), model_sha256=hashlib.sha256(model.read_bytes()).hexdigest(),
                    model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=_plan(workload, backend, base_dir))


def _script_task(tmp_path: Path, model: Path, text: str, backend: str, task_id: int, victim: str = "") -> TaskSpec:
    folder = tmp_path / f"script{task_id}"
    folder.mkdir()
    (folder / "probe.py").write_text(text)
    (folder / "victim.txt").write_text(victim)
    return _task(model, {"type": "script", "script": "probe.py", "dir": folder.name}, backend, tmp_path, task_id)


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if pid == ancestor:
            return True
    return False


def _catch_run(runs_root: Path, deadline_s: float = 120) -> tuple[int, Path]:
    """The victim's harness, once it runs as its own uid (one of ours, not another test's), and its directory."""
    first, count = run_uid_range()
    end = time.monotonic() + deadline_s  # a guard against a hang, not a measurement
    while time.monotonic() < end:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                uid = int(next(line.split()[1] for line in Path(f"/proc/{entry.name}/status").read_text().splitlines()
                               if line.startswith("Uid:")))
            except (OSError, StopIteration, ValueError):
                continue
            if first <= uid < first + count and _descends_from(int(entry.name), os.getpid()):
                dirs = [d for d in runs_root.iterdir() if d.stat().st_uid == uid]
                if dirs:
                    return int(entry.name), dirs[0]
        time.sleep(0.002)
    raise AssertionError("the victim's run was never seen running")


def _report(result: RunResult, tag: str) -> dict:
    line = next((line for line in result.log_tail.splitlines() if line.startswith(tag + " ")), None)
    assert line is not None, (result.status, result.message, result.log_tail)
    return json.loads(line[len(tag) + 1:])


@pytest.mark.parametrize("warm, agents, backend", [
    (True, "one-agent", "process"), (False, "one-agent", "process"), (True, "two-agents", "process"),
    (False, "two-agents", "process"), (True, "one-agent", "cgroup")],
    ids=["warm-victim-one-agent", "cold-victim-one-agent", "warm-victim-two-agents", "cold-victim-two-agents",
         "warm-victim-cgroup"])
def test_a_script_cannot_see_read_or_forge_another_tenants_concurrent_run(
        tmp_path: Path, tiny_models, monkeypatch, warm: bool, agents: str, backend: str) -> None:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    if backend == "cgroup":
        require_backend("cgroup")
    monkeypatch.setenv(WARM_ENV, "1" if warm else "0")
    victim_driver = SimDriver(tmp_path / "work")
    attacker_driver = victim_driver if agents == "one-agent" else SimDriver(tmp_path / "work-other-agent")
    model = tiny_models["onnx"]
    victim_task = _task(model, {"type": "benchmark", "iterations": VICTIM_ITERATIONS, "warmup": 2}, backend,
                        tmp_path, 1)
    results: dict[str, RunResult] = {}

    def victim() -> None:
        results["victim"] = victim_driver.in_slot(SimSlot(0)).run(victim_task, lambda: False)

    runner = threading.Thread(target=victim)
    runner.start()
    pid, victim_dir = _catch_run(victim_driver.runs_root)
    os.kill(pid, signal.SIGSTOP)  # held mid-run: the attack runs while the victim's directory is there
    try:
        attack = _script_task(tmp_path, model, ATTACK, backend, 2, victim=str(victim_dir))
        results["attacker"] = attacker_driver.in_slot(SimSlot(1)).run(attack, lambda: False)
    finally:
        os.kill(pid, signal.SIGCONT)
        runner.join()

    attacker, victim_result = results["attacker"], results["victim"]
    report = _report(attacker, "ATTACK")
    # nothing of the other run in the attacker's mount table: no run directory but its own
    assert report["run_mounts"] == [] and report["victim_named"] == [], report
    assert not any(key.startswith("via_mountinfo:") for key in report), report
    # the victim's path, even known, leads nowhere: not there in the attacker's world
    for attempt in ("list", "copy_model", "read_task", "block_tmp", "plant_out"):
        assert report[attempt] in ("No such file or directory", "Permission denied"), (attempt, report)
    # the victim's stored result is its own measurement, not the planted one
    assert victim_result.ok, (victim_result.message, victim_result.log_tail)
    assert victim_result.environment["harness"].startswith("warm" if warm else "cold")
    assert len(victim_result.iterations_ms) == VICTIM_ITERATIONS
    assert "forged" not in victim_result.tool_versions
    # and the attacker's is what its harness measured, not the out.json it left in its own directory
    assert attacker.ok, (attacker.message, attacker.log_tail)
    assert attacker.iterations_ms == [1.5] and "forged" not in attacker.tool_versions
    # two runs at once, two uids of the range
    assert attacker.environment["isolation"] != victim_result.environment["isolation"]


def test_a_runs_descriptors_and_mappings_are_its_own(tmp_path: Path, tiny_models) -> None:
    """From inside a (cold) script run: no descriptor but its standard streams and what it opened, no shared
    writable shared mapping of any file, and a uid and gid of the run range. (The warm run's are read from outside, as root, in
    tests/test_warm_harness.py: the same listing.)"""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    driver = SimDriver(tmp_path / "work")
    result = driver.run(_script_task(tmp_path, tiny_models["onnx"], LOOK, "process", 3), lambda: False)
    assert result.ok, (result.message, result.log_tail)
    look = _report(result, "LOOK")
    first, count = run_uid_range()
    assert first <= look["uid"] < first + count and look["gid"] == look["uid"], look
    fds = dict(look["fds"])
    assert set(fds) >= {"0", "1", "2"}, fds
    others = {fd: target for fd, target in fds.items() if fd not in ("0", "1", "2")}
    # the one it opened to list them; nothing of the agent's, the harness's result channel included
    assert len(others) <= 1 and all(target.startswith("/proc/") for target in others.values()), fds
    # shared mappings: only read-only ones of files every user may read, which the run mapped itself (glibc's
    # gconv cache); none writable, none of a file the run could not open
    for line in look["shared"]:
        perms, path = line.split()[1], line.split()[5]
        assert perms[1] != "w" and os.stat(path).st_mode & 0o004, line


def test_the_mount_table_lists_run_directories_as_the_namespaces_read_it(tmp_path: Path) -> None:
    """run_world's reading of /proc/self/mountinfo: a run directory's tmpfs is found by its source, escapes undone."""
    from farm.agents.sandbox.isolation import mount_run_dir, unseal_run_dir

    run_dir = tmp_path / "runs" / "task1 with space"
    run_dir.mkdir(parents=True)
    if not mount_run_dir(run_dir):
        pytest.skip("no mount rights here")
    try:
        assert (str(run_dir), "farm-run") in mount_table()
    finally:
        unseal_run_dir(run_dir)


def test_concurrent_runs_get_distinct_uids_and_a_given_back_uid_keeps_nothing_running(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    import subprocess

    from farm.agents.sandbox.isolation import RunUids, RunUserError

    uids = RunUids(2046885000, 2, locks=tmp_path / "locks")
    other_agent = RunUids(2046885000, 2, locks=tmp_path / "locks")  # a second agent on the host: the same locks
    first, second = uids.acquire(), other_agent.acquire()
    assert first.run_as.uid != second.run_as.uid and {first.run_as.uid, second.run_as.uid} == {2046885000, 2046885001}
    assert first.run_as.gid == first.run_as.uid
    with pytest.raises(RunUserError, match="FARM_RUN_UIDS=2046885000:2"):
        uids.acquire()  # every uid of the range held
    # something left running under the uid (no namespaces to end it) is killed as the uid is given back
    leftover = subprocess.Popen(["sleep", "300"], user=first.run_as.uid, group=first.run_as.gid)
    first.release()
    assert leftover.wait(timeout=60) == -signal.SIGKILL
    assert uids.acquire().run_as.uid == first.run_as.uid  # free again
    second.release()

    monkeypatch.setenv("FARM_RUN_UIDS", "12:x")
    with pytest.raises(RunUserError, match="FARM_RUN_UIDS='12:x': write FIRST:COUNT"):
        run_uid_range()
    monkeypatch.setenv("FARM_RUN_UIDS", "0:10")
    with pytest.raises(RunUserError, match="FARM_RUN_UIDS='0:10': the range must lie between 1000"):
        run_uid_range()
