"""A job as `farm jobs` shows it, in plain Python: what a listing that loads no pydantic prints.

The answer model is farm.proto.questions.JobInfo; this is its JSON form (`JobInfo.to_json()`) for values that
model would keep as they are. `plain_job` says whether the values are such: a whole number where the model
has an int, text where it has a str, a moment as Unix seconds in the range pydantic reads as seconds. Anything
else (a value an older or a hand-edited store holds) is None, and the caller asks the model instead, so both
print the same bytes (tests/test_jobs_listing.py compares them).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any, Mapping

# JobInfo's fields in its order (TaskCounts' first), as model_dump() gives them
COUNT_KEYS = ("total", "pending", "running", "completed", "failed", "canceled")
JOB_KEYS = (*COUNT_KEYS, "job", "name", "status", "priority", "created_at", "started_at", "finished_at", "message",
            "owner_pid", "owner_host")
MOMENT_KEYS = ("created_at", "started_at", "finished_at")
# pydantic reads a number above 2e10 as milliseconds; below 1e10 (the year 2286) it is seconds either way
LAST_SECOND = 10_000_000_000


def iso_utc(value: datetime) -> str:
    """ISO 8601 in UTC to the millisecond, `Z` for the zone: one spelling for every JSON farm prints.
    Rounded (not cut) so a moment that crossed the wire as a double prints as it did before."""
    return (value.astimezone(UTC) + timedelta(microseconds=500)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _whole(value: Any) -> bool:
    return type(value) is int


def _moment(value: Any) -> bool:
    return value is None or (type(value) in (int, float) and math.isfinite(value) and 0 < value < LAST_SECOND)


def _text(value: Any, optional: bool = False) -> bool:
    return type(value) is str or (optional and value is None)


def plain_job(fields: Mapping[str, Any]) -> dict[str, Any] | None:
    """`fields` (farm.controller.scheduling.job_state.job_fields) in JobInfo's order, a moment of 0 read as
    none as the model reads it; None when a value is not plainly what JobInfo holds."""
    job = {key: fields[key] for key in JOB_KEYS}
    for key in MOMENT_KEYS:
        job[key] = job[key] or None  # the wire's 0 is "never", as OptionalTimestamp reads it
    if not all(_whole(job[key]) for key in (*COUNT_KEYS, "job")) or not all(_moment(job[key]) for key in MOMENT_KEYS):
        return None
    if not (all(_text(job[key]) for key in ("name", "status", "priority"))
            and _text(job["message"], optional=True) and _text(job["owner_host"], optional=True)
            and (job["owner_pid"] is None or _whole(job["owner_pid"]))):
        return None
    return job


def job_json(job: Mapping[str, Any]) -> dict[str, Any]:
    """JobInfo.to_json() of a plain_job(): moments as ISO 8601 UTC, and `id` and `tasks` as `farm jobs --json`
    has always named them."""
    out = {key: job[key] for key in JOB_KEYS}
    for key in MOMENT_KEYS:
        if out[key] is not None:
            out[key] = iso_utc(datetime.fromtimestamp(out[key], UTC))
    return {**out, "id": job["job"], "tasks": job["total"]}
