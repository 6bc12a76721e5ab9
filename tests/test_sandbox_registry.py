"""The sandbox backends are a registry (issue #35): one list of names (farm.proto.names.SANDBOX_BACKENDS) that the
job file, the CLI's --backend and the agents' registry all read, and backends asked for what they can do."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import get_args

import pytest

from farm.agents import sandbox
from farm.agents.sandbox.isolation import INNER_RUN_DIR, RunAs
from farm.cli.main import build_parser
from farm.proto.names import BACKEND_CHOICES, SANDBOX_BACKENDS
from farm.proto.spec import SimBudget

ROOT = Path(__file__).resolve().parents[1]


def test_one_list_of_backends() -> None:
    assert tuple(sandbox.BACKENDS) == SANDBOX_BACKENDS == ("cgroup", "docker", "process")
    assert get_args(SimBudget.model_fields["backend"].annotation) == BACKEND_CHOICES
    run = build_parser().parse_args(["submit", "job.yaml", "--backend", "docker"])
    assert run.backend == "docker"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["submit", "job.yaml", "--backend", "chroot"])
    with pytest.raises(ValueError, match="unknown sandbox backend 'chroot'; choose one of auto, cgroup, docker, process"):
        sandbox.backend_class("chroot")


def test_backends_are_asked_for_capabilities_not_names() -> None:
    found = {name: sandbox.backend_class(name) for name in SANDBOX_BACKENDS}
    assert {n for n, cls in found.items() if cls.own_root} == {"docker"}  # a container: its own root and user
    assert {n for n, cls in found.items() if cls.takes_images} == {"docker"}
    assert {n for n, cls in found.items() if cls.approximate} == {"process"}
    assert sandbox.takes_images("docker") and not sandbox.takes_images("auto") and not sandbox.takes_images("cgroup")


def _backend(name: str) -> sandbox.SandboxBackend:
    """The backend's object without starting its engine or probing the host: the run set-up methods read no state."""
    cls = sandbox.backend_class(name)
    return cls.__new__(cls)


def test_each_backend_answers_the_run_set_up_its_own_way(tmp_path: Path) -> None:
    """What differs between a container and a command on the host is a method of the backend (issue #35), the same
    answer for every host backend, the container's own for docker."""
    run_dir, inner, alice = tmp_path / "run", INNER_RUN_DIR, RunAs("alice", 2_000_123, 2_000_123)
    for name in SANDBOX_BACKENDS:
        backend = _backend(name)
        contained = name == "docker"
        assert (backend.own_isolation("alice") is not None) == backend.own_root == contained, name
        fd = backend.result_channel()
        if fd is not None:
            os.close(fd)
        assert (fd is None) == contained, name  # a container cannot be handed a descriptor
        mount = backend.run_dir_mount(run_dir, inner)
        assert (mount.path, mount.read_only, mount.target) == (run_dir, False, inner if contained else None), name
        assert backend.run_cwd(run_dir, inner) == (inner if contained else run_dir), name
        assert backend.open_run_dir_mode(True) == (0o777 if contained else 0o700), name
        assert backend.open_run_dir_mode(False) == 0o700, name
        argv, env = backend.command_as(["python", "-m", "x"], {"A": "1"}, alice, {"ISOLATE": "{}"})
        if contained:  # the container starts as the run's user: nothing to drop
            assert (argv, env) == (["python", "-m", "x"], {"A": "1"})
        else:
            assert argv[:3] == ["unshare", "--pid", "--fork"] and env == {"A": "1", "ISOLATE": "{}"}
            argv, env = backend.command_as(["python"], {"A": "1"}, alice, None)
            assert argv[0] == "setpriv" and "--reuid=2000123" in argv and argv[-1] == "python" and env == {"A": "1"}
    assert _backend("docker").own_isolation("alice") == (INNER_RUN_DIR, "container, user alice (a uid of its own)")
    assert _backend("docker").own_isolation(None) == (INNER_RUN_DIR, "container, user the agent's own")
    assert _backend("process").image_path_env() is None


def test_the_sim_driver_never_asks_which_backend_it_has() -> None:
    """The driver's run asks the backend (its methods and capabilities), never its name or its kind."""
    tree = ast.parse((ROOT / "agents" / "sim" / "driver.py").read_text())
    asked = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "own_root":
            asked.append(f"line {node.lineno}: .own_root")
        if isinstance(node, ast.Compare) and any(isinstance(side, ast.Attribute) and side.attr == "name"
                                                 for side in (node.left, *node.comparators)):
            asked.append(f"line {node.lineno}: a comparison with a .name")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "isinstance") \
                and "backend" in ast.unparse(node).lower():
            asked.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):  # the interface is the one backend class it may know
            kinds = [a.name for a in node.names if a.name.endswith("Backend") and a.name != "SandboxBackend"]
            if kinds:
                asked.append(f"line {node.lineno}: imports {', '.join(kinds)}")
    assert asked == []
