"""Name rules both sides check: what a name from the wire may look like before it becomes a
path, a device name or a log line."""

from __future__ import annotations

import re
from typing import Literal, get_args

# The sandbox backends, named once: the job file's sim.backend (with "auto"), every `--backend` of the CLI and the
# agents' registry (farm.agents.sandbox.BACKENDS, which must hold exactly these) read this.
SandboxBackendName = Literal["cgroup", "docker", "process"]
SANDBOX_BACKENDS: tuple[str, ...] = get_args(SandboxBackendName)
BACKEND_CHOICES: tuple[str, ...] = ("auto", *SANDBOX_BACKENDS)  # `auto`: the best one that can run here

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")  # content addresses: the only names artifacts have
SAFE_SUFFIX = re.compile(r"^\.[A-Za-z0-9]{1,10}$")  # a file extension kept on a cached artifact
AGENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def is_sha256(text: str) -> bool:
    return bool(SHA256_HEX.match(text))


def safe_suffix(suffix: str) -> str:
    """A file extension as given when it is plain (runtimes pick the format by it), else ''."""
    return suffix if SAFE_SUFFIX.match(suffix) else ""


def valid_agent_name(name: str) -> bool:
    """Names from the wire end up in device names and log lines; keep them plain."""
    return bool(AGENT_NAME.match(name))
