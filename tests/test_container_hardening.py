"""A job's container holds no root (issue 18, N3): an image's ENTRYPOINT never runs, the job's code
starts as the run user with no capabilities and no way to gain privileges, on a read-only root, and
a set-uid binary it writes into its run directory is neither usable nor kept.

Runs a real job through the sim driver on the real Docker engine (started by the tests when none
runs), with a user's image (its own Python) on farm's tiny root filesystem, as an agent would."""

from __future__ import annotations

import io
import json
import os
import tarfile
import stat
from pathlib import Path

import pytest

from conftest import require_backend
from farm.agents.sandbox.docker import DockerBackend
from farm.agents.sandbox.docker_build import BuildPolicy
from farm.agents.sandbox.isolation import run_uid_range
from farm.agents.sim.driver import SimDriver
from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import load_job_text
from farm.controller.store import SQLiteStore as Store
from farm.proto.results import FailureClass, RunStatus
from farm.proto.tasks import TaskSpec
from user_python_image import ensure_user_python_image

HOSTILE_IMAGE = "farm-test-hostile-entrypoint:2"
# What a hostile image does first, as root if it could: mark that it ran, plant a set-uid shell, skip farm.
ENTRYPOINT = '["/bin/sh", "-c", "id -u > $HOME/entrypoint-ran; cp /bin/sh $HOME/rootsh; chmod 4755 $HOME/rootsh"]'
# The job's own code: what it is, what it can do, and a set-uid copy of the shell left in the run directory.
PROBE = r"""
import json, os, shutil
home = os.environ["HOME"]
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
report = {"uid": os.getuid(), "euid": os.geteuid(), "cap_eff": status["CapEff"].strip(),
          "no_new_privs": status["NoNewPrivs"].strip(), "pid1": open("/proc/1/cmdline").read().replace("\0", " "),
          "mounts": [l for l in open("/proc/self/mountinfo").read().splitlines() if " /tmp" in l]}
for probe, path in (("root_write", "/etc/farm-was-here"), ("usr_write", "/usr/farm-was-here")):
    try:
        open(path, "w").write("x")
        report[probe] = "written"
    except OSError as e:
        report[probe] = e.strerror
try:
    os.setuid(0)
    report["setuid0"] = "became root"
except OSError as e:
    report["setuid0"] = e.strerror
shutil.copy("/bin/sh", os.path.join(home, "mysh"))
os.chmod(os.path.join(home, "mysh"), 0o4755)
json.dump(report, open(os.path.join(home, "report.json"), "w"))
"""


@pytest.fixture(scope="module")
def hostile_image() -> str:
    """A user's image with its own Python (sim.image runs the job's `python` from the image) whose
    ENTRYPOINT would run first, as root."""
    require_backend("docker")
    import docker

    base = ensure_user_python_image()
    dockerfile = f"FROM {base}\nENTRYPOINT {ENTRYPOINT}\nUSER 0:0\n".encode()
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
    client = docker.from_env(timeout=600)
    try:
        client.images.build(fileobj=io.BytesIO(context.getvalue()), custom_context=True, tag=HOSTILE_IMAGE, rm=True,
                            network_mode="none")
    finally:
        client.close()
    return HOSTILE_IMAGE


def _task(tmp_path: Path, tiny_models, sim: str, files: dict[str, str] | None = None) -> TaskSpec:
    tmp_path.mkdir(exist_ok=True)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    for name, text in (files or {}).items():
        (job_dir / name).write_text(text)
    os.symlink(tiny_models["tflite"], job_dir / "tiny.tflite")
    (job_dir / "probe.py").write_text(PROBE)
    job = load_job_text(f"models: [tiny.tflite]\nworkload: {{type: script, script: probe.py}}\nsim: {sim}\n",
                        "job.yaml", job_dir)
    controller = Controller(Store(tmp_path / "farm.db"))
    controller.submit(job)
    task = controller.lease("agent-1", {"sim"})
    assert task is not None
    return task


@pytest.mark.docker
def test_an_images_entrypoint_never_runs_and_nothing_runs_as_root(tmp_path: Path, tiny_models, hostile_image) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the agent's run user and the run directory's nosuid mount")
    task = _task(tmp_path, tiny_models, f"{{backend: docker, image: {hostile_image}, memory: 256m}}")
    driver = SimDriver(tmp_path / "work", keep_run_dirs=True)  # kept, to look for what the run left
    result = driver.run(task, lambda: False)
    assert result.status == RunStatus.COMPLETED, (result.message, result.log_tail)
    (run_dir,) = (tmp_path / "work" / "runs").iterdir()
    assert not (run_dir / "entrypoint-ran").exists()  # farm's harness is the entrypoint: the image's never ran
    assert not (run_dir / "rootsh").exists()
    report = json.loads((run_dir / "report.json").read_text())
    first, count = run_uid_range()  # the run's own uid, from the agent's range
    assert report["uid"] == report["euid"] and first <= report["uid"] < first + count, report
    assert int(report["cap_eff"], 16) == 0, report  # every capability dropped
    assert report["no_new_privs"] == "1", report
    assert report["setuid0"] == "Operation not permitted", report
    assert report["root_write"] == "Read-only file system", report
    assert report["usr_write"] == "Read-only file system", report
    # every writable mount the run has is nosuid,nodev: its temp mounts and its run directory
    writable = [line for line in report["mounts"] if line.split()[5].startswith("rw")]
    assert {line.split()[4] for line in writable} >= {"/tmp", "/tmp/run"}, report["mounts"]
    assert all("nosuid" in line.split()[5] and "nodev" in line.split()[5] for line in writable), writable
    # the host's run path is in no command line (the host's ps shows the container's processes)
    assert str(run_dir) not in report["pid1"] and "/tmp/run/task.json" in report["pid1"], report["pid1"]
    # nothing of the run's is set-uid any more, and nothing in it belongs to root
    for path in [run_dir, *run_dir.rglob("*")]:
        info = path.lstat()
        assert not info.st_mode & (stat.S_ISUID | stat.S_ISGID), path
        assert info.st_uid != 0, path
    assert (run_dir / "mysh").exists()


@pytest.mark.docker
def test_the_container_is_created_hardened_whatever_the_image_says(hostile_image) -> None:
    """What the engine recorded: the run user, farm's entrypoint, no capabilities, no new privileges,
    a read-only root, nosuid,nodev temp mounts sized from the budget, a pids limit."""
    from farm.agents.sandbox.base import Budget

    backend = DockerBackend(image=hostile_image, run_user="65534:65534")
    sandbox = backend.start(["/bin/true"], Budget(memory_bytes=64 << 20, pids=50), env={}, cwd=Path("/tmp"), mounts=[])
    try:
        sandbox.wait(30)
        config, host = sandbox.container.attrs["Config"], sandbox.container.attrs["HostConfig"]
    finally:
        sandbox.close()
        backend.client.close()
    assert config["User"] == "65534:65534"
    assert config["Entrypoint"] == ["/bin/true"] and not config["Cmd"]
    assert host["CapDrop"] == ["ALL"] and host["SecurityOpt"] == ["no-new-privileges"]
    assert host["ReadonlyRootfs"] is True and host["PidsLimit"] == 50
    assert host["Tmpfs"]["/tmp"] == f"rw,exec,nosuid,nodev,mode=1777,size={64 << 20}"


def _build_task(tmp_path: Path, tiny_models, build: str, files: dict[str, str] | None = None) -> TaskSpec:
    return _task(tmp_path, tiny_models, f"{{backend: docker, build: {build}}}", files)


@pytest.mark.docker
def test_a_build_from_a_base_image_not_on_the_agents_list_is_refused_naming_the_flag(
        tmp_path: Path, tiny_models, hostile_image) -> None:
    task = _build_task(tmp_path, tiny_models, f"{{base: {hostile_image}, run: ['true']}}")
    lab_agent = SimDriver(tmp_path / "work", run_as=None, build_policy=BuildPolicy.lab(False, []))
    result = lab_agent.run(task, lambda: False)
    assert result.status == RunStatus.FAILED and result.failure_class == FailureClass.JOB, result.message
    assert f"sim.build.base {hostile_image!r} is not on this agent's allow-list" in result.message
    assert f"farm agent --allow-build-base {hostile_image}" in result.message
    # a Dockerfile's FROM is held to the same list (its own stage names and scratch are not images)
    dockerfile = f"FROM scratch AS empty\nFROM {hostile_image} AS base\nFROM base\n"
    task = _build_task(tmp_path / "dockerfile", tiny_models, "{dockerfile: Dockerfile}", {"Dockerfile": dockerfile})
    result = lab_agent.run(task, lambda: False)
    assert result.failure_class == FailureClass.JOB, result.message
    assert f"FROM {hostile_image!r} is not on this agent's allow-list" in result.message, result.message
    assert "--allow-build-base" in result.message


@pytest.mark.docker
def test_a_listed_base_builds_offline_and_its_entrypoint_never_runs(tmp_path: Path, tiny_models, hostile_image) -> None:
    fresh = os.urandom(6).hex()  # a step no earlier test run had: built now, not taken from the engine's cache
    task = _build_task(tmp_path, tiny_models, f"{{base: {hostile_image}, run: ['test ! -e /root/entrypoint-ran', "
                                              f"'test ! -e /root/rootsh', 'echo {fresh}']}}")
    lab_agent = SimDriver(tmp_path / "work", run_as=None, build_policy=BuildPolicy.lab(False, [hostile_image]))
    result = lab_agent.run(task, lambda: False)
    assert result.status == RunStatus.COMPLETED, (result.message, result.log_tail)
    assert result.environment["build"]["cached"] is False


@pytest.mark.docker
def test_a_build_asking_for_the_network_is_refused_unless_the_agent_allows_it(tmp_path: Path, tiny_models) -> None:
    task = _build_task(tmp_path, tiny_models, "{network: true, run: ['true']}")
    result = SimDriver(tmp_path / "work", run_as=None, build_policy=BuildPolicy.lab(False, [])).run(task, lambda: False)
    assert result.failure_class == FailureClass.JOB, result.message
    assert "sim.build.network is true" in result.message and "farm agent --allow-build-network" in result.message




@pytest.mark.docker
def test_a_run_in_an_image_not_on_the_agents_list_is_refused_and_a_listed_one_runs(
        tmp_path: Path, tiny_models, hostile_image) -> None:
    """sim.image with nothing to build is held to the same allow-list as a build's base."""
    task = _task(tmp_path / "refused", tiny_models, f"{{backend: docker, image: {hostile_image}, memory: 256m}}")
    result = SimDriver(tmp_path / "work", run_as=None, build_policy=BuildPolicy.lab(False, [])).run(task, lambda: False)
    assert result.status == RunStatus.FAILED and result.failure_class == FailureClass.JOB, result.message
    assert f"sim.image {hostile_image!r} is not on this agent's allow-list" in result.message, result.message
    assert f"farm agent --allow-build-base {hostile_image}" in result.message
    task = _task(tmp_path / "listed", tiny_models, f"{{backend: docker, image: {hostile_image}, memory: 256m}}")
    listed = SimDriver(tmp_path / "work", run_as=None, build_policy=BuildPolicy.lab(False, [hostile_image]))
    result = listed.run(task, lambda: False)
    assert result.status == RunStatus.COMPLETED, (result.message, result.log_tail)


@pytest.mark.docker
def test_a_job_may_ask_for_a_writable_root_and_still_runs_as_the_run_user(tmp_path: Path, tiny_models,
                                                                         hostile_image) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the agent's run user")
    task = _task(tmp_path, tiny_models,
                 f"{{backend: docker, image: {hostile_image}, memory: 256m, writable_root: true}}")
    driver = SimDriver(tmp_path / "work", keep_run_dirs=True)
    result = driver.run(task, lambda: False)
    assert result.status == RunStatus.COMPLETED, (result.message, result.log_tail)
    (run_dir,) = (tmp_path / "work" / "runs").iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    # the root is writable now, so only its owners' rights keep the run user out of /etc: no longer EROFS
    assert report["root_write"] == "Permission denied", report
    first, count = run_uid_range()
    assert first <= report["uid"] < first + count and int(report["cap_eff"], 16) == 0, report


def test_writable_root_needs_the_docker_backend() -> None:
    from pydantic import ValidationError

    from farm.proto.spec import SimBudget
    with pytest.raises(ValidationError, match="writable_root: only a container"):
        SimBudget(writable_root=True)
    assert SimBudget(backend="docker", writable_root=True).writable_root
