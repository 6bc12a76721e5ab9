"""A task as the controller hands it to an agent: everything a driver needs, nothing more.

The workload and the sim budget are the job spec's own models (proto/spec.py): a task is
validated into them wherever it is built — from the store, from the wire, from JSON — so a
driver reads `task.plan.workload.warmup`, never a dict with a default of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from farm.proto.names import SHA256_HEX
from farm.proto.spec import SimBudget, Workload

from farm.proto.task_limits import DEFAULT_MAX_TASKS  # noqa: F401  (here too, where it always was)


# The content address of an uploaded artifact (a script folder's tar): what the wire and the store carry.
Sha256 = Annotated[str, StringConstraints(pattern=SHA256_HEX.pattern)]


class TaskPlan(BaseModel):
    """What every task of a job carries from its spec, as the store keeps it (tasks.spec_json)."""

    model_config = ConfigDict(extra="ignore", defer_build=True)  # rows written by another version keep loading

    workload: Workload
    sim: SimBudget  # the job's budget, or a device type's for a device's sim twin
    run_timeout_s: float
    base_dir: str  # where the job file lives: relative script dirs resolve from here
    script_archive: Sha256 | None = None  # sha256 of the uploaded workload.dir (script workloads)
    # The compute unit this task runs on, resolved for its device (proto/accelerators.py), and the precision the
    # unit may use; a sim task is always cpu (a gpu cell's sim twin too: its pair key names the device's unit).
    accelerator: str = "cpu"
    precision: str = "fp32"


class TaskSpec(BaseModel):
    """One leased task: which run of which model where, and its job's plan (embedded, never copied)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    task_id: int
    job_id: int
    attempt: int
    target: str  # "sim", or a device name
    model_name: str
    model_path: str
    model_sha256: str
    model_family: str | None
    threads: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    input_size: int | None
    repeat: int
    plan: TaskPlan
    # This agent's copy of plan.script_archive (its artifact cache); set where the agent fetched it, never on
    # the wire. None: the job's own folder on this host is packed (embedded runs).
    script_archive_path: Path | None = None

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> "TaskSpec":
        return cls.model_validate_json(text)
