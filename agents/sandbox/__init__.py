"""Sandbox backends: the same command under a CPU and memory budget, three ways."""

from __future__ import annotations

from farm.agents.sandbox.base import Budget, SandboxBackend, SandboxError

BACKEND_NAMES = ("cgroup", "docker", "process")
# `auto` prefers exact kernel accounting, then a container, then the approximate fallback.
AUTO_ORDER = ("cgroup", "docker", "process")


def backend_class(name: str) -> type[SandboxBackend]:
    if name == "cgroup":
        from farm.agents.sandbox.cgroup import CgroupBackend
        return CgroupBackend
    if name == "docker":
        from farm.agents.sandbox.docker import DockerBackend
        return DockerBackend
    if name == "process":
        from farm.agents.sandbox.process import ProcessBackend
        return ProcessBackend
    raise ValueError(f"unknown sandbox backend {name!r}; choose one of auto, {', '.join(BACKEND_NAMES)}")


def choose_backend(name: str, *, image: str | None = None, user_image: bool = False) -> SandboxBackend:
    """The backend named, or for 'auto' the best one that can run here.

    Raises SandboxError with the reason when the named backend cannot run.
    """
    names = AUTO_ORDER if name == "auto" else (name,)
    reasons = []
    for candidate in names:
        cls = backend_class(candidate)
        reason = cls.unavailable_reason()
        if reason is None:
            if candidate == "docker":  # only docker takes an image
                return cls(image=image, user_image=user_image)  # type: ignore[call-arg]
            return cls()
        reasons.append(f"{candidate}: {reason}")
    raise SandboxError("no sandbox backend can run here — " + "; ".join(reasons))


__all__ = ["Budget", "SandboxBackend", "SandboxError", "backend_class", "choose_backend", "BACKEND_NAMES"]
