"""FarmService's job calls: SubmitJob and the WatchJob stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable, TypeVar, cast, get_args

import grpc

from farm.controller.async_calls import Aborted, ThreadContext
from farm.controller.auth import TokenTable, identity_of
from farm.controller.scheduling.controller import TERMINAL_JOB
from farm.controller.scheduling.jobfile import JobFileError, parse_job_text
from farm.controller import service as answers
from farm.controller.scheduling.submission import load_submitted_job
from farm.proto.wire import answer_to_message
from farm.proto.escape import bounded_message, printable
from farm.proto.spec import Priority, ScriptWorkload
from farm.proto.generated import farm_pb2
from farm.controller.rpc.limits import MAX_JOB_FILE_BYTES, SUBMIT_KEY
from farm.controller.rpc.calls import FarmCalls
from farm.controller.rpc.farm_server import FarmServer

log = logging.getLogger("farm.controller")
T = TypeVar("T")


# how long a watch waits for the lab's store to answer again before it tells its client (UNAVAILABLE)
WATCH_STORE_WAIT_S = 120.0


def job_message(server: FarmServer, job: dict[str, Any]) -> farm_pb2.Job:
    info = answers.job_info(server.controller, job["id"])  # what `farm status` shows embedded, too
    if info is None:  # `job` is the row just read: it cannot be gone unless forgotten in between
        raise LookupError(f"job {job['id']} is not in the store")
    return answer_to_message(info, farm_pb2.Job())


def caller_of(context: grpc.ServicerContext, tokens: TokenTable | None) -> str:
    """Who is calling, for per-caller limits: the token's line in the tokens file, else the peer's host."""
    if tokens is not None:
        identity = identity_of(context, tokens)
        return f"{identity.role}@{identity.line}"
    return context.peer().rpartition(":")[0]


class JobCalls(FarmCalls):
    """Jobs made and watched."""

    def SubmitJob(self, request: farm_pb2.SubmitJobRequest, context: grpc.ServicerContext) -> farm_pb2.SubmitJobResponse:
        if len(request.job_yaml.encode()) > MAX_JOB_FILE_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the job file is over {MAX_JOB_FILE_BYTES} bytes")
        identity = identity_of(context, self.server.tokens)
        key = request.submit_key
        if key and not SUBMIT_KEY.fullmatch(key):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"submit_key {printable(key[:40])!r} is not 32 hex digits")
        viewer = self._viewer(context)  # an admin's job is the lab's own
        made = self.server.controller.job_of_submit_key(key, viewer.owner) if key else None
        if made is not None:  # sent again after a lost answer: the job exists (made through this or another controller)
            log.info("job %d: a submit sent again (its first answer was lost); no second job made", made)
            return farm_pb2.SubmitJobResponse(job_id=made, tasks=self.server.controller.progress(made).total,
                                              models=0, repeated=True)
        try:
            if self.server.scripts_need_permission and not identity.may_run_scripts:
                # before anything is read for the job: a script's folder under a models root is packed by
                # load_submitted_job, which a token that may not run scripts must not get done (issue 33)
                spec, _ = parse_job_text(request.job_yaml, request.file_name or "job.yaml")
                if isinstance(spec.workload, ScriptWorkload):
                    context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                  "this controller runs script workloads only for tokens with the `script` permission, "
                                  f"and this {identity.role} token has none. Ask the operator for a `client+script` "
                                  "token, or use `workload: {type: benchmark}`.")
            job = load_submitted_job(request, self.server.files, self.server.device_targets(),
                                     max_tasks=self.server.max_tasks)
        except JobFileError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded_message(str(e)))
        if request.priority:
            if request.priority not in get_args(Priority):  # from the wire: a bad one would fail the submit later
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"priority {printable(request.priority[:40])!r} is not "
                              "one of interactive, normal, low")
            job.spec.priority = cast(Priority, request.priority)
        repeated = False
        if key:
            job_id, repeated = self.server.controller.submit_once(job, key, owner=viewer.owner, team=viewer.team)
        else:
            job_id = self.server.controller.submit(job, owner=viewer.owner, team=viewer.team)
        self.server.wake(queue_changed=True)
        total = self.server.controller.progress(job_id).total
        log.info("job %d submitted: %d task(s)%s", job_id, total, " (sent again: made before)" if repeated else "")
        return farm_pb2.SubmitJobResponse(job_id=job_id, tasks=total, models=len(job.models), repeated=repeated)

    async def WatchJob(self, request: farm_pb2.JobRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[farm_pb2.Job]:
        """The job each time it changes, until it ends; the wait between looks holds no thread."""
        loop = asyncio.get_running_loop()
        threaded = ThreadContext(context)

        async def on_thread(function: Callable[[], T]) -> T:  # the store is read on a worker thread
            away_since = None
            while True:
                try:
                    return await loop.run_in_executor(self.pool, function)
                except Aborted as e:
                    await context.abort(e.code, e.details)
                    raise  # not reached: abort() raised
                except Exception as e:  # the store out of reach: the watch waits for it a while (the job is kept)
                    outage = self.server.controller.outage
                    if not outage.failed(e, f"watching job {request.job_id}"):
                        raise
                    away_since = away_since or time.monotonic()
                    if time.monotonic() - away_since > WATCH_STORE_WAIT_S:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, bounded_message(outage.message(e)))
                    await asyncio.sleep(1.0)

        await on_thread(lambda: self._job(request.job_id, threaded))
        caller = caller_of(threaded, self.server.tokens)
        if not self.server.open_watch(caller):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this caller already watches {self.server.max_watches} jobs, the most one token (or "
                                "host) may; stop some watchers (`farm status JOB` polls instead) or raise --max-watches")
        try:
            last = None
            while True:
                message = await on_thread(lambda: job_message(self.server, self._job(request.job_id, threaded)))
                if message != last:
                    yield message
                    last = message
                if message.status in TERMINAL_JOB:
                    return
                await asyncio.sleep(0.2)
        finally:
            self.server.close_watch(caller)
