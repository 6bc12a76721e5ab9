"""A task as the controller hands it to an agent: everything a driver needs, nothing more.

The workload and the sim budget are the job spec's own models (proto/spec.py): a task is
validated into them wherever it is built — from the store, from the wire, from JSON — so a
driver reads `task.workload.warmup`, never a dict with a default of its own.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from farm.proto.spec import SimBudget, Workload

from farm.proto.task_limits import DEFAULT_MAX_TASKS  # noqa: F401  (here too, where it always was)


def sim_budget(data: dict[str, Any] | SimBudget) -> SimBudget:
    """A sim budget as the store and the wire carry it (memory and disk in bytes), validated into the spec's model.

    A job file must write memory with a unit (a bare number is refused there); once parsed it travels
    as bytes, which parse_memory reads back with the `b` unit."""
    if isinstance(data, SimBudget):
        return data
    for field in ("memory", "disk"):
        size = data.get(field)
        if isinstance(size, int) and not isinstance(size, bool):
            data = {**data, field: f"{size}b"}
    return SimBudget.model_validate(data)


class TaskPlan(BaseModel):
    """What every task of a job carries from its spec, as the store keeps it (tasks.spec_json)."""

    model_config = ConfigDict(extra="ignore")  # rows written by another version keep loading

    workload: Workload
    sim: SimBudget
    run_timeout_s: float
    base_dir: str
    script_archive: str | None = None  # sha256 of the uploaded workload.dir (script workloads)

    @field_validator("sim", mode="before")
    @classmethod
    def _sim(cls, v: Any) -> Any:
        return sim_budget(v) if isinstance(v, dict) else v


class TaskSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

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
    workload: Workload
    sim: SimBudget  # the job's budget, or a device type's for a device's sim twin
    run_timeout_s: float
    base_dir: str  # where the job file lives: relative script dirs resolve from here
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("sim", mode="before")
    @classmethod
    def _sim(cls, v: Any) -> Any:
        return sim_budget(v) if isinstance(v, dict) else v

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> "TaskSpec":
        return cls.model_validate_json(text)
