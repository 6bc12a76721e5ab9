"""The contract between a driver and the harness: what to run, and what comes back.

Both sides are JSON files, so the same harness runs in a local sandbox, in a container,
or on a board over ssh.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class HarnessTask:
    kind: str  # "benchmark" | "script"
    model_path: str
    threads: int = 1
    batch_size: int = 1
    input_size: int | None = None
    iterations: int = 50
    warmup: int = 5
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    use_xnnpack: bool = True
    seed: int = 0
    op_profiling: bool = False  # after the timed loop, a profiled pass gives per-operator times
    # script mode
    command: list[str] = field(default_factory=list)  # already formatted argv
    script_dir: str | None = None

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def read(cls, path: Path) -> "HarnessTask":
        return cls(**json.loads(path.read_text()))


@dataclass
class HarnessOutput:
    ok: bool
    failure_class: str | None = None
    message: str = ""
    runtime: str = ""
    init_ms: float | None = None
    first_ms: float | None = None
    warmup_ms: list[float] = field(default_factory=list)
    iterations_ms: list[float] = field(default_factory=list)
    whole_run_s: float | None = None
    measure_wall_s: float | None = None  # from first timed iteration to last
    baseline_rss_bytes: int | None = None
    peak_rss_bytes: int | None = None
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    tool_versions: dict[str, str] = field(default_factory=dict)
    op_profile: list[dict[str, Any]] = field(default_factory=list)  # OpProfileRow fields, one dict a row
    op_profile_note: str = ""  # why a run asked for an op profile and has none

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self)))
        tmp.replace(path)  # a reader never sees half a result

    @classmethod
    def read(cls, path: Path) -> "HarnessOutput":
        data: dict[str, Any] = json.loads(path.read_text())
        return cls(**data)
