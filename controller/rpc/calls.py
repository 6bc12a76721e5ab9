"""What every FarmService handler group shares: the server, the worker pool, who is asking and the jobs they
may read.
"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc

from farm.controller.auth import identity_of
from farm.controller import service as answers
from farm.controller.rpc.farm_server import FarmServer


class FarmCalls:
    """The base of FarmService's handler groups (jobs.py, artifacts.py, questions.py, admin.py)."""

    def __init__(self, server: FarmServer, pool: futures.Executor | None = None) -> None:
        self.server = server
        self.pool = pool

    def _viewer(self, context: grpc.ServicerContext) -> answers.Viewer:
        identity = identity_of(context, self.server.tokens)
        if self.server.tokens is None or identity.role == "admin":
            return answers.EVERYONE
        return answers.Viewer(identity.owner or f"line-{identity.line}", identity.team)

    def _job(self, job_id: int, context: grpc.ServicerContext) -> dict[str, Any]:
        """The job, when this caller may read it; another team's job in a `team` lab is as good as absent."""
        job = self.server.store.jobs.get(job_id)
        if job is None or not self._viewer(context).may_read(job, self.server.job_sharing):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id} on this controller; `farm jobs` lists its jobs")
        assert job is not None  # abort() raised otherwise
        return job.as_dict()
