"""`farm jobs` without a controller, read straight from an up-to-date SQLite store: what EmbeddedFarm.jobs()
answers, without loading the controller, the store's classes or the answer models (pydantic), which cost a
listing most of its start-up (issue 34 item 5; the figures are in BENCHMARKS.md).

Each job is the same fields (farm.controller.scheduling.job_state.job_fields) in JobInfo's plain form
(farm.proto.job_summary). None says "ask the Farm": a controller is named, the store is PostgreSQL or not
there, not up to date, not readable now, a value in it is not plainly what the model holds, or the limit is
one the request model refuses. The Farm then answers, or says what is wrong, exactly as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from farm.client.errors import FarmError

MAX_LIMIT = 100_000  # as farm.proto.questions.JobsAsk takes it (0 reads as the default, 50)
DEFAULT_LIMIT = 50


def local_jobs(controller: str | None, db: str | None, limit: int) -> list[dict[str, Any]] | None:
    """The newest `limit` jobs of the local store as plain JobInfo fields (farm.proto.job_summary.plain_job),
    or None when this cannot answer for the Farm."""
    if not 0 <= limit <= MAX_LIMIT:
        return None  # the request model says why, naming the field
    from farm.client.config import addresses_of

    try:
        if addresses_of(controller):
            return None
    except FarmError:
        return None  # a config file or address that cannot be read: opening the Farm says so
    from farm.controller.store import db_location

    path = db_location(db)
    if not isinstance(path, Path) or str(path) == ":memory:":
        return None
    from farm.controller.scheduling.job_state import job_fields
    from farm.controller.store.job_listing import read_listing
    from farm.proto.job_summary import plain_job

    rows = read_listing(path.expanduser().absolute(), limit or DEFAULT_LIMIT)
    if rows is None:
        return None
    jobs = []
    for row in rows:
        job = plain_job(job_fields(row))
        if job is None:
            return None
        jobs.append(job)
    return jobs
