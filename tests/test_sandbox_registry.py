"""The sandbox backends are a registry (issue #35): one list of names (farm.proto.names.SANDBOX_BACKENDS) that the
job file, the CLI's --backend and the agents' registry all read, and backends asked for what they can do."""

from __future__ import annotations

from typing import get_args

import pytest

from farm.agents import sandbox
from farm.cli.main import build_parser
from farm.proto.names import BACKEND_CHOICES, SANDBOX_BACKENDS
from farm.proto.spec import SimBudget


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
