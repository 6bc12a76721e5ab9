"""A task as the controller hands it to an agent: everything a driver needs, nothing more.

Plain data (JSON-able), so the gRPC issue only has to put it on the wire.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# Tasks one job may expand to (models × matrix cells × repeats × target runs) unless the
# submitter or the controller says otherwise: a 1 MiB job file must not allocate 1e8 rows.
DEFAULT_MAX_TASKS = 10_000


@dataclass
class TaskSpec:
    task_id: int
    job_id: int
    attempt: int
    target: str  # "sim" here; a device name later
    model_name: str
    model_path: str
    model_sha256: str
    model_family: str | None
    threads: int
    batch_size: int
    input_size: int | None
    repeat: int
    workload: dict[str, Any]  # JobSpec.workload dumped; "type" says benchmark or script
    sim: dict[str, Any]  # JobSpec.sim dumped (cpus, cpuset, memory bytes, backend, image, interval)
    run_timeout_s: float
    base_dir: str  # where the job file lives: relative script dirs resolve from here
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TaskSpec":
        return cls(**json.loads(text))
