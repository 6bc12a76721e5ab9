"""A job's state from its stored row, with the standard library alone: the status every listing shows
(`interrupted` when the process running it has died) and the fields farm.proto.questions.JobInfo is made of.

farm.controller.scheduling.controller and farm.controller.service take these from here; `farm jobs` on a local
store uses them without loading either (issue 34 item 5: start-up).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # a type only: the rows' dataclasses stay unloaded
    from farm.controller.store.rows import JobRow

# farm.proto.results.JobStatus' values (tests/test_jobs_listing.py holds them to it)
TERMINAL_JOB = frozenset({"completed", "failed", "canceled"})
INTERRUPTED = "interrupted"


def pid_alive(pid: int | None, host: str | None) -> bool:
    import socket  # here: a listing of finished jobs never asks

    if not pid or host != socket.gethostname():
        return True  # another host's process: we cannot tell, so assume it lives
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_status(status: str, owner_pid: int | None, owner_host: str | None) -> str:
    """A job's stored status, or 'interrupted' when the process running it has died."""
    if status not in TERMINAL_JOB and not pid_alive(owner_pid, owner_host):
        return INTERRUPTED  # stored as interrupted (Ctrl+C), or its process died
    return status


def status_of(job: JobRow) -> str:
    """A job row's status, or 'interrupted' when the process running it has died."""
    return live_status(job.status, job.owner_pid, job.owner_host)


def job_fields(job: Mapping[str, Any], counts: Mapping[str, int] | None = None) -> dict[str, Any]:
    """What a job's JobInfo is made of, from its row's plain form (a listing's, read by sqlite3 alone in
    client/local_jobs.py, or a stored row's `as_dict()`) and its tasks by status (default: the row's `counts`, as
    a listing gives them)."""
    c = job["counts"] if counts is None else counts
    return {"total": sum(c.values()), "pending": c.get("pending", 0), "running": c.get("running", 0),
            "completed": c.get("completed", 0), "failed": c.get("failed", 0), "canceled": c.get("canceled", 0),
            "job": job["id"], "name": job["name"] or "", "status": live_status(job["status"], job["owner_pid"], job["owner_host"]), "priority": job["priority"] or "",
            "created_at": job["created_at"], "started_at": job["started_at"], "finished_at": job["finished_at"],
            "message": job["message"] or None, "owner_pid": job["owner_pid"], "owner_host": job["owner_host"]}
