"""Sandbox backends: the same command under a CPU and memory budget, three ways.

`BACKENDS` is the registry, as farm.agents.drivers is for drivers: one line per backend, its module and class
(imported when first asked for). The names are farm.proto.names.SANDBOX_BACKENDS (the job file's sim.backend and
the CLI's --backend read the same tuple). Callers ask a backend what it can do (SandboxBackend's capabilities:
`own_root`, `takes_images`, `warm_capable`, `approximate`), never which one it is.
"""

from __future__ import annotations

import importlib

from farm.agents.sandbox.base import Budget, SandboxBackend, SandboxError
from farm.proto.names import BACKEND_CHOICES, SANDBOX_BACKENDS

BACKEND_NAMES = SANDBOX_BACKENDS
# name -> "module:Class"; `auto` tries them in this order: exact kernel accounting, a container, the fallback.
BACKENDS: dict[str, str] = {
    "cgroup": "farm.agents.sandbox.cgroup:CgroupBackend",
    "docker": "farm.agents.sandbox.docker:DockerBackend",
    "process": "farm.agents.sandbox.process:ProcessBackend",
}
AUTO_ORDER = tuple(BACKENDS)
if tuple(sorted(BACKENDS)) != tuple(sorted(SANDBOX_BACKENDS)):  # one list: the registry and the vocabulary agree
    raise ImportError(f"farm.agents.sandbox.BACKENDS ({', '.join(BACKENDS)}) is not farm.proto.names."
                      f"SANDBOX_BACKENDS ({', '.join(SANDBOX_BACKENDS)})")


def backend_class(name: str) -> type[SandboxBackend]:
    where = BACKENDS.get(name)
    if where is None:
        raise ValueError(f"unknown sandbox backend {name!r}; choose one of {', '.join(BACKEND_CHOICES)}")
    module, _, cls = where.partition(":")
    found: type[SandboxBackend] = getattr(importlib.import_module(module), cls)
    return found


def takes_images(name: str) -> bool:
    """Whether the backend named (not `auto`: it may land on any) runs a job in an image of its own."""
    return name in BACKENDS and backend_class(name).takes_images


def choose_backend(name: str, *, image: str | None = None, user_image: bool = False,
                   writable_root: bool = False) -> SandboxBackend:
    """The backend named, or for 'auto' the best one that can run here.

    Raises SandboxError with the reason when the named backend cannot run.
    """
    names = AUTO_ORDER if name == "auto" else (name,)
    reasons = []
    for candidate in names:
        cls = backend_class(candidate)
        reason = cls.unavailable_reason()
        if reason is None:
            return cls.create(image=image, user_image=user_image, writable_root=writable_root)
        reasons.append(f"{candidate}: {reason}")
    raise SandboxError("no sandbox backend can run here — " + "; ".join(reasons))


__all__ = ["Budget", "SandboxBackend", "SandboxError", "backend_class", "choose_backend", "takes_images",
           "BACKEND_NAMES", "BACKENDS"]
