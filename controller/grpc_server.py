"""The controller behind gRPC: the same Controller, with agents and clients on the wire.

Each agent holds one bidirectional stream (AgentService.Connect), a coroutine on the server's asyncio
loop (async_calls.py): a waiting stream holds no thread. An idle agent slot sends a WorkRequest; one
dispatcher thread (dispatch.py) matches waiting requests to pending tasks, one writer thread
(result_writer.py) applies results in batches, acknowledging each after its commit, and one renewer
thread (lease_renewer.py) renews the leases heartbeats name, many per transaction; sessions.py keeps
who is connected. This module holds the servicers. Leases are renewed by the
agent's heartbeats; when a stream breaks nothing is dropped at once: the agent may be back
in a moment (it takes over its own session), and if it is not, the lease runs out and the
task goes back to the queue with attempt + 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import re
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar, cast, get_args

import grpc
from google.protobuf.message_factory import GetMessageClass
from pydantic import ValidationError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from farm.version import __version__
from farm.controller.scheduling.artifacts import (
    ArtifactError, ArtifactStore, ControllerFiles, ModelRoots, SharedArtifactStore)
from farm.controller.store.artifacts_db import ArtifactChunks
from farm.controller.store.postgres import PostgresStore
from farm.controller.store.presence import Presence
from farm.controller.store.leader import LabDuties, SweepLeader
from farm.controller.async_calls import Aborted, CallGate, ServerLoop, ThreadContext, next_request
from farm.controller.auth import (
    BudgetSettings, CallBudget, Identity, IdleUploads, TlsFiles, TokenGuard, TokenTable, UploadIdle,
    check_server_certificate,
    identity_of, is_loopback, peer_address,
    server_credentials,
)
from farm.proto.device_types import load_device_types
from farm.controller.scheduling.controller import TERMINAL_JOB, Controller
from farm.controller.scheduling.dispatch import Dispatcher, StepTimings
from farm.controller.scheduling.jobfile import DEFAULT_MAX_TASKS, DeviceTarget, JobFileError, parse_job_text
from farm.controller.operations.metrics import MetricsServer, parse_listen, serve_metrics
from farm.controller.scheduling.lease_renewer import LeaseRenewer, QueuedHeartbeat
from farm.controller.scheduling.result_writer import RESULT_BATCH, QueuedResult, ResultWriter
from farm.controller.scheduling.sessions import AgentSession, DeviceTaken, Sessions
from farm.controller import service as answers
from farm.controller.service import ServiceError
from farm.controller.store import Store, StoreError
from farm.controller.store.rows import plain
from farm.controller.scheduling.submission import load_submitted_job
from farm.proto.questions import QUESTIONS, Question, explain
from farm.proto.wire import answer_to_message, model_from_message
from farm.proto.batching import BATCH_CAPABILITY, MAX_BATCH_MESSAGES, gathered
from farm.proto.escape import bounded_message, printable
from farm.proto.names import SHA256_HEX, valid_agent_name
from farm.proto.accuracy import DATASET_ARTIFACT_NAME, MAX_PACKED_BYTES
from farm.proto.script_archive import MAX_SCRIPT_ARCHIVE_BYTES
from farm.proto.spec import Priority, ScriptWorkload
from farm.proto.generated import agent_pb2, agent_pb2_grpc, common_pb2, farm_pb2, farm_pb2_grpc

log = logging.getLogger("farm.controller")
T = TypeVar("T")

# Bump when a message changes meaning; agents with another number are refused with a clear error.
PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 16 << 20  # a RunResult with every sample of a long run fits well under this
MAX_JOB_FILE_BYTES = 1 << 20
SUBMIT_KEY = re.compile(r"[0-9a-f]{32}")  # a client's submit key (client/remote.py: uuid4().hex)
MAX_ANSWER_BYTES = MAX_MESSAGE_BYTES - (1 << 20)  # a rendered report travels in one answer
MAX_ARTIFACT_BYTES = 4 << 30
MAX_MODEL_BYTES = 2 << 30  # one model file, uploaded or under a models root (--max-model-bytes)
ARTIFACT_CHUNK_BYTES = 1 << 20
FARM_SERVICE = "farm.v1.FarmService"
AGENT_SERVICE = "farm.v1.AgentService"
# Calls open at once: 1,000 agents (one Connect each) and a watcher apiece, plus room for the short calls.
DEFAULT_MAX_STREAMS = 2500
DEFAULT_MAX_WATCHES = 64  # WatchJob streams per caller (token, or peer host without tokens)
DEFAULT_UPLOAD_QUOTA = 20 << 30  # bytes one client token's uploads may hold in the store (--upload-quota)
MAX_DEVICES_PER_AGENT = 10_000
MAX_OPEN_REQUESTS = MAX_DEVICES_PER_AGENT + 256  # idle slots one agent may have waiting: a slot per device, plus sim slots
AGENT_MESSAGE_THREADS = 8  # threads applying agent messages (store writes); the streams themselves wait on the loop
ACK_HOLD_S = 0.25  # how long an acknowledgement waits for a message to share its write (agents that read batches)
MAX_CANCELS_PER_HEARTBEAT = 64  # answers to refs that are not the session's own: bounded, so a forged list amplifies nothing


def _ref(task_id: int, attempt: int) -> common_pb2.TaskRef:
    return common_pb2.TaskRef(task_id=task_id, attempt=attempt)


class FarmServer:
    """What the servicers call: the Controller, the agent sessions, the dispatcher and the result writer,
    each its own object (sessions.py, dispatch.py, result_writer.py); this one routes agent messages."""

    max_tasks: int = DEFAULT_MAX_TASKS  # per submitted job (`farm controller serve --max-tasks`)

    def __init__(self, store: Store, *, lease_ttl_s: float = 30.0, heartbeat_interval_s: float | None = None,
                 tokens: TokenTable | None = None, max_watches: int = DEFAULT_MAX_WATCHES,
                 files: ControllerFiles | None = None, scripts_need_permission: bool = False,
                 result_batch: int = RESULT_BATCH, upload_idle_s: float = BudgetSettings.upload_idle_s,
                 job_sharing: str = "shared", upload_quota: int | None = DEFAULT_UPLOAD_QUOTA,
                 budget: CallBudget | None = None, hello_timeout_s: float = BudgetSettings.hello_timeout_s,
                 agent_idle_s: float | None = BudgetSettings.agent_idle_s, clock: Callable[[], float] = time.time,
                 hooks: Any = None) -> None:
        self.store = store
        self.files = files or controller_files(store)
        self.scripts_need_permission = scripts_need_permission
        self.job_sharing = job_sharing  # may clients read other teams' jobs (service.Viewer); cancel never
        self.upload_quota = upload_quota  # bytes one client token's stored uploads may hold (None: no quota)
        self._uploading: dict[str, int] = {}  # bytes reserved by uploads in flight, per owner (reserve_upload)
        self._uploads_lock = threading.Lock()
        self.refresh_suite: Path | None = None  # the reference suite `farm refresh` submits (None: farm's own)
        self.nightly: Any = None  # controller.nightly.NightlyRefresh with --refresh-cron: it leaves clients' refreshes alone
        # clock: when leases, heartbeats and deadlines expire; hooks: this controller's own (scheduling/hooks.py)
        self.controller = Controller(store, lease_ttl_s=lease_ttl_s, clock=clock, hooks=hooks)
        # the dispatcher's sweep (expire_leases) ends jobs past timeouts.job; their running tasks stop at once
        self.controller.on_deadline = lambda job_id: self._stop_runs(
            job_id, f"job {job_id} passed its deadline (timeouts.job)")
        self.heartbeat_interval_s = heartbeat_interval_s or max(0.2, lease_ttl_s / 4)
        # An agent stream's deadlines (issue 33, H2): its hello, then a message at least every agent_idle_s.
        self.budget = budget  # the per-caller budgets (None without tokens): also caps streams awaiting a hello
        self.hello_timeout_s = hello_timeout_s
        self.agent_idle_s = agent_idle_s if agent_idle_s is not None else max(60.0, 4 * self.heartbeat_interval_s)
        self.tokens = tokens
        self.agents = Sessions(store, self.controller)
        self.sessions = self.agents.by_name
        self.device_owner = self.agents.device_owner
        self._lock = self.agents.lock  # sessions, the device index and the watch counts
        self.max_watches = max_watches
        self.watches: dict[str, int] = {}  # open WatchJob streams per caller
        self.timings = StepTimings()
        self.dispatcher = Dispatcher(self.controller, self.agents, self.timings)
        self.results = ResultWriter(self.controller, max_batch=result_batch, timed=self.timings.add)
        self.renewer = LeaseRenewer(self.controller, timed=self.timings.add)
        self.idle_uploads = IdleUploads(upload_idle_s)

    @property
    def dispatch_count(self) -> int:
        return self.dispatcher.count

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        # After a restart: this process owns the open jobs, and running leases get a full TTL
        # so their agents have time to reconnect before anything is re-queued.
        # Agents seen within a TTL are another controller's on the same database (it keeps them fresh): left online.
        now = self.controller.clock()
        self.store.leases.adopt_unfinished(os.getpid(), socket.gethostname(), now + self.controller.lease_ttl_s,
                                           seen_before=now - self.controller.lease_ttl_s)
        self.results.start()
        self.renewer.start()
        self.dispatcher.start()
        # work queued through another controller on the same database wakes this one's dispatcher
        self.store.on_queue_change(lambda: self.wake(queue_changed=True))

    def stop(self) -> None:
        self.dispatcher.stop()
        with self._lock:
            for session in list(self.sessions.values()):
                session.close()
        self.results.stop()
        self.renewer.stop()

    def wake(self, queue_changed: bool = False) -> None:
        self.dispatcher.wake(queue_changed)

    def dispatch_once(self) -> int:
        return self.dispatcher.dispatch_once()

    # --- agent sessions -------------------------------------------------------------------
    def open_session(self, hello: agent_pb2.Hello, peer: str) -> tuple[AgentSession, list[tuple[int, int]]]:
        """Sessions.open, then the dispatcher looks again (released leases are pending once more)."""
        session, released = self.agents.open(hello, peer)
        self.wake(queue_changed=bool(released))
        return session, released

    def close_session(self, session: AgentSession) -> None:
        self.agents.close(session)

    def on_agent_message(self, session: AgentSession, message: agent_pb2.AgentMessage) -> None:
        session.last_seen = time.time()
        kind = message.WhichOneof("kind")
        if kind == "work_request":
            if self._take_request(session, message.work_request):
                self.wake()
        elif kind == "heartbeat":
            with self._lock:  # only this session's own leases are renewed; the rest is refused without a query
                held = set(session.running) if self.agents.current(session) else set()
            refs = [(ref.task_id, ref.attempt) for ref in message.heartbeat.running]
            foreign = [ref for ref in refs if ref not in held]
            if foreign:
                log.warning("agent %s heartbeat for %d task attempt(s) not leased to its session (task %d attempt %d, "
                            "...); refused", session.name, len(foreign), foreign[0][0], foreign[0][1])
                self._stop_attempts(session, foreign[:MAX_CANCELS_PER_HEARTBEAT], still_running=False)
            own = [ref for ref in refs if ref in held]
            if own:  # renewed with the other agents' in one transaction (lease_renewer.py)
                self.renewer.put(QueuedHeartbeat(session.name, own, partial(self._stop_attempts, session)))
        elif kind == "result":
            self._take_result(session, message.result, [])
        elif kind == "drain":
            with self._lock:
                session.state = "draining"
                session.requests.clear()
                self.agents.record(session, "draining")
        elif kind == "progress":
            pass  # progress is informational; the stored state changes with results
        elif kind == "batch":
            inner = message.batch.messages
            if len(inner) > MAX_BATCH_MESSAGES:
                log.warning("agent %s sent a batch of %d messages (at most %d); its stream is closed", session.name,
                            len(inner), MAX_BATCH_MESSAGES)
                session.close()
                return
            index = 0
            while index < len(inner):  # in order
                one = inner[index]
                index += 1
                if one.WhichOneof("kind") in ("batch", "hello", None):
                    log.warning("agent %s: a %s inside a batch is not allowed; ignored", session.name,
                                one.WhichOneof("kind") or "message of no known kind")
                elif one.WhichOneof("kind") == "result":
                    # The work requests riding with a result count from its acknowledgement, so the offer they
                    # bring follows the ack (and shares its write) instead of racing ahead of the commit.
                    riders = []
                    while index < len(inner) and inner[index].WhichOneof("kind") == "work_request":
                        riders.append(inner[index].work_request)
                        index += 1
                    self._take_result(session, one.result, riders)
                else:
                    self.on_agent_message(session, one)

    def _stop_attempts(self, session: AgentSession, attempts: list[tuple[int, int]], still_running: bool = True) -> None:
        """Tell the agent to stop these attempts; `still_running`: only those its session still runs (a result
        acknowledged since the heartbeat needs no cancel)."""
        if still_running:
            with self._lock:
                attempts = [ref for ref in attempts if ref in session.running]
        for task_id, attempt in attempts:
            session.send(agent_pb2.ControllerMessage(cancel=agent_pb2.CancelTask(
                task=_ref(task_id, attempt), reason="the job was canceled, or this agent holds no lease on this "
                                                    "attempt (it ran out and the task went elsewhere)")))

    def _take_request(self, session: AgentSession, request: agent_pb2.WorkRequest) -> bool:
        """Note an idle slot of the session's; False when refused (named in the log) or the agent is draining."""
        targets = frozenset(request.targets)
        if not targets or not targets <= session.targets:
            # Another agent's device would hand this one its tasks, and with them the right to report their results.
            log.warning("agent %s asked for work on %s, which it did not register; ignored", session.name,
                        printable(",".join(sorted(targets - session.targets)[:5])))
        elif len(session.requests) >= MAX_OPEN_REQUESTS:
            log.warning("agent %s has %d idle slots waiting already; request ignored", session.name, len(session.requests))
        elif session.state == "online":
            with self._lock:
                session.requests[request.request_id] = targets
            return True
        return False

    def _take_result(self, session: AgentSession, result: agent_pb2.TaskResult,
                     riders: list[agent_pb2.WorkRequest]) -> None:
        if self.agents.current(session):  # queued: the writer acks it once it is committed
            self.results.put(QueuedResult(session.name, result, partial(self._acknowledge, session, riders=riders),
                                          failed=session.close))
        else:
            self._acknowledge(session, agent_pb2.ResultAck(
                task=result.task, note="refused: this session was taken over; do not resend"), False)

    def _acknowledge(self, session: AgentSession, ack: agent_pb2.ResultAck, requeued: bool, *,
                     riders: list[agent_pb2.WorkRequest] | None = None) -> None:
        for request in riders or []:  # before the ack is queued, so its stream sees a request to wait for
            self._take_request(session, request)
        session.send(agent_pb2.ControllerMessage(ack=ack))
        with self._lock:
            session.running.discard((ack.task.task_id, ack.task.attempt))
        self.wake(queue_changed=requeued)  # a retry is queued, or a slot that rode on the result is free

    def apply_result(self, agent: str, message: agent_pb2.TaskResult) -> agent_pb2.ResultAck:
        """Apply one result now, in the caller's thread (the stream's results go through the writer's queue).

        Only the agent holding that attempt's lease stores anything; anything else is acknowledged with
        a note saying why (so a real agent stops resending it)."""
        acks: list[agent_pb2.ResultAck] = []
        self.results.write([QueuedResult(agent, message, lambda ack, requeued: acks.append(ack))])
        if not acks:
            raise RuntimeError(f"the result for task {message.task.task_id} could not be applied; see the log")
        return acks[0]

    def cancel_job(self, job_id: int) -> int:
        """Cancel in the store, then tell the agents running its tasks now rather than at their next heartbeat."""
        n = self.controller.cancel_job(job_id)
        self._stop_runs(job_id, f"job {job_id} was canceled")
        return n

    def _stop_runs(self, job_id: int, reason: str) -> None:
        rows = self.store.leases.running_attempts(job_id=job_id)
        with self._lock:
            for row in rows:
                session = self.sessions.get(row["leased_by"] or "")
                if session is not None:
                    session.send(agent_pb2.ControllerMessage(cancel=agent_pb2.CancelTask(
                        task=_ref(row["id"], row["attempts"]), reason=reason)))

    def forget_device(self, name: str) -> str:
        return self.agents.forget_device(name)

    def reserve_upload(self, owner: str, size: int) -> tuple[int, int | None]:
        """Reserve `size` bytes of owner's --upload-quota for an upload about to be read: (bytes held, the
        reservation), the reservation None when it does not fit. Release it with release_upload, stored or not.
        The reservations are this controller's: controllers sharing one database each reserve their own."""
        with self._uploads_lock:
            used = self.store.artifacts.upload_usage(owner) + self._uploading.get(owner, 0)
            if self.upload_quota is not None and used + size > self.upload_quota:
                return used, None
            self._uploading[owner] = self._uploading.get(owner, 0) + size
            return used, size

    def release_upload(self, owner: str, size: int) -> None:
        with self._uploads_lock:
            left = self._uploading.get(owner, 0) - size
            if left > 0:
                self._uploading[owner] = left
            else:
                self._uploading.pop(owner, None)

    def open_watch(self, caller: str) -> bool:
        """Count one more WatchJob stream for `caller`; False when it already has its share."""
        with self._lock:
            if self.watches.get(caller, 0) >= self.max_watches:
                return False
            self.watches[caller] = self.watches.get(caller, 0) + 1
            return True

    def close_watch(self, caller: str) -> None:
        with self._lock:
            self.watches[caller] -= 1
            if not self.watches[caller]:
                del self.watches[caller]

    def device_targets(self) -> list[Any]:
        """The devices a job can target: every non-sim device an agent has registered (online or not)."""
        types = load_device_types()
        return [DeviceTarget(r["name"], types.get(r["device_type"] or ""), json.loads(r["tags_json"] or "[]"))
                for r in self.store.devices.all(sim=False)]

    def artifact_path(self, sha256: str) -> Path | None:
        """The stored artifact with this content hash: uploaded, or copied in from a models root at submit."""
        return self.files.store.path(sha256)


def controller_files(store: Store, *, models_roots: list[Path] | None = None,
                     max_model_bytes: int | None = None) -> ControllerFiles:
    """The artifact store next to the SQLite store (`farm.db` -> `farm-artifacts/`) and the models roots; on
    PostgreSQL the artifacts live in the database, that folder being this controller's cache of them."""
    limit = max_model_bytes or MAX_MODEL_BYTES
    folder = store.path.with_name(store.path.stem + "-artifacts")
    artifacts = ArtifactStore(folder, max_bytes=limit)
    if isinstance(store, PostgresStore):
        artifacts = SharedArtifactStore(folder, ArtifactChunks(store), max_bytes=limit)
    return ControllerFiles(artifacts, ModelRoots(models_roots or [], max_bytes=limit))


def _job_message(server: FarmServer, job: dict[str, Any]) -> farm_pb2.Job:
    info = answers.job_info(server.controller, job["id"])  # what `farm status` shows embedded, too
    if info is None:  # `job` is the row just read: it cannot be gone unless forgotten in between
        raise LookupError(f"job {job['id']} is not in the store")
    return answer_to_message(info, farm_pb2.Job())


_EMPTY = object()  # nothing came within the wait
# how long a watch waits for the lab's store to answer again before it tells its client (UNAVAILABLE)
WATCH_STORE_WAIT_S = 120.0


class _Outbox:
    """A session's outbox, read on the server's loop: whoever queues a message (the dispatcher, the result
    writer, a handler thread) wakes the reader through the loop, so a waiting stream holds no thread."""

    def __init__(self, session: AgentSession, loop: asyncio.AbstractEventLoop) -> None:
        self.session, self.loop = session, loop
        self.ready = asyncio.Event()
        session.wake = self._wake

    def _wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
            self.loop.call_soon_threadsafe(self.ready.set)

    async def get(self, timeout_s: float | None = None) -> agent_pb2.ControllerMessage | None | object:
        """The next message (None: the stream ends), or _EMPTY when `timeout_s` passed first."""
        while True:
            with contextlib.suppress(queue.Empty):
                return self.session.outbox.get_nowait()
            self.ready.clear()  # a wake-up queued before this runs after it: none is lost
            if not self.session.outbox.empty():
                continue
            try:
                await asyncio.wait_for(self.ready.wait(), timeout_s)
            except TimeoutError:
                return _EMPTY


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    """The agent stream lives on the server's loop (a waiting agent holds no thread); what touches the store
    runs on `pool`, one message of a stream after the other."""

    def __init__(self, server: FarmServer, pool: futures.Executor | None = None) -> None:
        self.server = server
        self.pool = pool

    async def Connect(self, request_iterator: AsyncIterator[agent_pb2.AgentMessage],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[agent_pb2.ControllerMessage]:
        loop = asyncio.get_running_loop()
        identity = identity_of(context, self.server.tokens)
        first = await self._hello(request_iterator, context, identity)
        if first is None or first.WhichOneof("kind") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message on the agent stream must be a hello")
        assert first is not None  # abort() raised otherwise (grpc is untyped: mypy cannot tell)
        hello = first.hello
        refusal = self._hello_refusal(hello, identity)
        if refusal is not None:
            await context.abort(*refusal)
        try:
            session, released = await loop.run_in_executor(self.pool, self.server.open_session, hello, context.peer())
        except DeviceTaken as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, bounded_message(str(e)))
        except Exception as e:
            if not self.server.controller.outage.failed(e, f"registering agent {printable(hello.agent_name)}"):
                raise
            # the agent dials again (this controller or the next of its list) and resends what it keeps
            await context.abort(grpc.StatusCode.UNAVAILABLE, bounded_message(self.server.controller.outage.message(e)))
        log.info("agent %s connected from %s (farm %s, host %s, %d device(s))", hello.agent_name, context.peer(),
                 printable(hello.farm_version), printable(hello.hostname), len(hello.devices))
        outbox = _Outbox(session, loop)
        reader = asyncio.create_task(self._read(session, request_iterator), name=f"agent-{session.name}")
        cut: str | None = None
        try:
            yield agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(
                session_id=session.session_id, controller_version=__version__, protocol_version=PROTOCOL_VERSION,
                lease_ttl_s=self.server.controller.lease_ttl_s, heartbeat_interval_s=self.server.heartbeat_interval_s,
                released=[_ref(t, a) for t, a in released], capabilities=[BATCH_CAPABILITY]))
            batches = BATCH_CAPABILITY in hello.capabilities  # an older agent reads one message at a time
            while True:
                message = await outbox.get()
                if message is None:
                    break
                assert isinstance(message, agent_pb2.ControllerMessage)
                if not batches:
                    yield message
                    continue
                parts, ending = gathered(message, session.outbox)
                if len(parts) == 1 and not ending and message.WhichOneof("kind") == "ack" and session.requests \
                        and session.state == "online":
                    # Nothing waits on an ack (the agent only forgets a result it keeps): hold it a moment for
                    # the offer its slot's waiting request may bring, so the two leave in one write.
                    follower = await outbox.get(ACK_HOLD_S)
                    if follower is None:
                        ending = True
                    elif isinstance(follower, agent_pb2.ControllerMessage):
                        later, ending = gathered(follower, session.outbox)
                        parts += later[:MAX_BATCH_MESSAGES - 1]
                # the messages queued meanwhile (an ack and the offer behind it) leave in one write
                yield agent_pb2.ControllerMessage(batch=agent_pb2.ControllerBatch(messages=parts)) if len(parts) > 1 \
                    else parts[0]
                if ending:
                    break
        finally:
            if reader.done() and not reader.cancelled():
                cut = reader.result()  # why the reader ended the stream, when it was the idle deadline
            reader.cancel()
            session.wake = None
            closing = loop.run_in_executor(self.pool, self.server.close_session, session)
        await closing
        if cut is not None:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, cut)
        if session.taken_over_by:
            # A reconnect's old stream is dead and never sees this; a second live process with the same name does.
            await context.abort(grpc.StatusCode.ABORTED,
                                f"agent {session.name!r} connected again from {session.taken_over_by}, which took over "
                                "this session. Give every agent process its own --name.")

    async def _hello(self, request_iterator: AsyncIterator[agent_pb2.AgentMessage], context: grpc.aio.ServicerContext,
                     identity: Identity) -> agent_pb2.AgentMessage | None:
        """The stream's first message, within --agent-hello-timeout; while it is awaited the stream counts against
        the hello-less caps (auth.CallBudget.await_hello), so streams that never say hello cannot hold the server."""
        budget = self.server.budget
        keys, refusal = budget.await_hello(identity, peer_address(context)) if budget else ([], None)
        if refusal is not None:
            log.warning("an agent stream from %s was refused: %s", context.peer(), refusal)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        try:
            return await asyncio.wait_for(next_request(request_iterator), self.server.hello_timeout_s)
        except TimeoutError:
            log.warning("an agent stream from %s sent no hello within %g s; cut (--agent-hello-timeout)",
                        context.peer(), self.server.hello_timeout_s)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no hello within {self.server.hello_timeout_s:g} s of opening the agent stream; it "
                                "was cut (--agent-hello-timeout). An agent's first message is its hello.")
            raise  # not reached: abort() raised
        finally:
            if budget is not None:
                budget.release(keys)

    def _hello_refusal(self, hello: agent_pb2.Hello, identity: Identity) -> tuple[grpc.StatusCode, str] | None:
        """Why this hello is refused (a status and a message a person can act on), or None."""
        if hello.protocol_version != PROTOCOL_VERSION:
            return (grpc.StatusCode.FAILED_PRECONDITION,
                    f"version mismatch: agent {hello.agent_name!r} runs farm {hello.farm_version} (protocol "
                    f"{hello.protocol_version}), this controller runs farm {__version__} (protocol {PROTOCOL_VERSION}). "
                    "Install the same farm version on the agent and the controller.")
        if not valid_agent_name(hello.agent_name):
            return (grpc.StatusCode.INVALID_ARGUMENT,
                    f"agent name {hello.agent_name!r} is not allowed: use letters, digits, '.', '_' and '-' (at most 64)")
        if identity.agent_name and identity.agent_name != hello.agent_name:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"this agent token belongs to agent {identity.agent_name!r}; it cannot connect as "
                    f"{hello.agent_name!r}. Start the agent with --name {identity.agent_name} or use its own token.")
        if identity.role == "agent" and not identity.agent_name and self.server.tokens is not None \
                and hello.agent_name in self.server.tokens.pinned_names():
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"agent name {hello.agent_name!r} belongs to a token pinned to it in the tokens file; this "
                    "agent token is not that one. Give this agent another --name, or use its own token.")
        if len(hello.devices) > MAX_DEVICES_PER_AGENT:
            return (grpc.StatusCode.INVALID_ARGUMENT, f"agent {hello.agent_name!r} registers {len(hello.devices)} "
                    f"devices; one agent may register at most {MAX_DEVICES_PER_AGENT}")
        seen: set[str] = set()
        for device in hello.devices:
            owner, _, local = device.name.partition("/")
            plain = not local and valid_agent_name(device.name)
            if not plain and not (owner == hello.agent_name and valid_agent_name(local)):
                return (grpc.StatusCode.INVALID_ARGUMENT,
                        f"device name {printable(device.name)!r} is not allowed: use letters, digits, '.', '_' "
                        f"and '-', or {hello.agent_name}/NAME for this agent's own")
            if device.name == "sim" or device.name.startswith(("type:", "tag:")):
                return grpc.StatusCode.INVALID_ARGUMENT, f"device name {device.name!r} is reserved"
            if device.name in seen:
                return grpc.StatusCode.INVALID_ARGUMENT, f"device {device.name!r} appears twice in the hello"
            seen.add(device.name)
        return None

    async def _read(self, session: AgentSession, request_iterator: AsyncIterator[agent_pb2.AgentMessage]) -> str | None:
        """Hand the agent's messages over in order; returns why the stream is cut when the agent fell silent for
        --agent-idle-timeout (agents heartbeat on a clock, so a live one never does), else None."""
        loop = asyncio.get_running_loop()
        idle_s = self.server.agent_idle_s
        try:
            while True:
                try:
                    message = await asyncio.wait_for(next_request(request_iterator), idle_s)
                except TimeoutError:
                    log.warning("agent %s sent nothing for %g s; its stream is cut (--agent-idle-timeout)",
                                session.name, idle_s)
                    return (f"agent {session.name!r} sent nothing for {idle_s:g} s (not even a heartbeat); its stream "
                            "was cut (--agent-idle-timeout). Connect again.")
                if message is None or session.closed.is_set():
                    break
                # one at a time, in order: a result before the work request that rides behind it
                await loop.run_in_executor(self.pool, self.server.on_agent_message, session, message)
        except grpc.RpcError:
            pass  # the agent went away; its leases run out unless it comes back
        except asyncio.CancelledError:
            pass  # the stream's writer ended first (the session closed, or the call was cut)
        except Exception:
            log.exception("agent %s: handling a message failed", session.name)
        finally:
            session.close()
        return None

    def FetchArtifact(self, request: common_pb2.ArtifactRequest, context: grpc.ServicerContext) -> Iterator[common_pb2.ArtifactChunk]:
        try:  # on PostgreSQL, one another controller received is streamed in from the database first
            path = self.server.artifact_path(request.sha256)
        except (StoreError, ArtifactError) as e:
            log.warning("artifact %s could not be read from the lab's store: %s", request.sha256[:12], e)
            context.abort(grpc.StatusCode.UNAVAILABLE, bounded_message(f"artifact {request.sha256[:64]!r} could not "
                                                                       f"be read from the lab's store: {e}"))
        if path is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no artifact with sha256 {request.sha256[:64]!r} on this "
                          "controller or in its lab's store")
        assert path is not None  # abort() raised otherwise
        size = path.stat().st_size
        if size > MAX_ARTIFACT_BYTES:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"artifact {request.sha256} is {size} bytes, over the {MAX_ARTIFACT_BYTES} byte limit")
        with path.open("rb") as f:
            offset = 0
            while chunk := f.read(ARTIFACT_CHUNK_BYTES):
                yield common_pb2.ArtifactChunk(sha256=request.sha256, size=size, offset=offset, data=chunk)
                offset += len(chunk)


class FarmServicer(farm_pb2_grpc.FarmServiceServicer):
    """Plain handlers, run on worker threads (async_calls.CallGate), and the watcher, which waits on the loop."""

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
        job = plain(self.server.store.jobs.get(job_id))
        if job is None or not self._viewer(context).may_read(job, self.server.job_sharing):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id} on this controller; `farm jobs` lists its jobs")
        assert job is not None  # abort() raised otherwise
        return job

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

    def MissingArtifacts(self, request: farm_pb2.MissingArtifactsRequest,
                         context: grpc.ServicerContext) -> farm_pb2.MissingArtifactsResponse:
        if len(request.sha256) > 10_000:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ask about at most 10,000 artifacts at once")
        for sha256 in request.sha256:
            if not SHA256_HEX.match(sha256):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{sha256[:80]!r} is not a sha256")
        return farm_pb2.MissingArtifactsResponse(missing=self.server.files.store.missing(request.sha256),
                                                 max_model_bytes=self.server.files.store.max_bytes,
                                                 max_script_archive_bytes=MAX_SCRIPT_ARCHIVE_BYTES,
                                                 max_dataset_bytes=MAX_PACKED_BYTES)

    def UploadArtifact(self, request_iterator: Iterator[farm_pb2.ArtifactUpload],
                       context: grpc.ServicerContext) -> farm_pb2.UploadArtifactResponse:
        # a stream that stops sending, from its first message on, is cut (auth.IdleUploads)
        messages = self.server.idle_uploads.paced(request_iterator)
        try:
            return self._upload(messages, context)
        finally:
            messages.close()  # its reader thread stops too, whatever way the call ended

    def _upload(self, messages: Iterator[farm_pb2.ArtifactUpload],
                context: grpc.ServicerContext) -> farm_pb2.UploadArtifactResponse:
        idle = self.server.idle_uploads
        try:
            first = next(messages, None)
        except UploadIdle as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        if first is None or not first.sha256:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first upload message must name sha256 and size")
        assert first is not None  # abort() raised otherwise
        store = self.server.files.store
        if store.path(first.sha256) is not None:  # content-addressed: already here, nothing more to read
            return farm_pb2.UploadArtifactResponse(sha256=first.sha256, size=first.size, already_stored=True)
        # a packed dataset (what `farm submit` names dataset.npz) is held to its own, smaller limit; one sent under
        # another name is refused at submit, where its stored size is checked again
        limit = MAX_SCRIPT_ARCHIVE_BYTES if first.name.endswith(".tar") else \
            MAX_PACKED_BYTES if first.name == DATASET_ARTIFACT_NAME else store.max_bytes
        identity = identity_of(context, self.server.tokens)
        owner = identity.owner if self.server.tokens is not None and identity.role == "client" else None
        quota = self.server.upload_quota if owner is not None else None
        if owner is not None and quota is not None:
            # Reserved before a byte is accepted, under one lock with the token's other uploads (issue 33, M3):
            # concurrent uploads each see the others' announced sizes, not only what is stored already.
            used, held = self.server.reserve_upload(owner, max(0, first.size))
            if held is None:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"this token's uploads hold {used:,} bytes of its {quota:,} byte quota (stored, or being "
                              f"uploaded now), and this one is {first.size:,} more; the controller's operator frees "
                              "what no job names with `farm artifacts gc`, or raises --upload-quota")

        def chunks() -> Iterator[bytes]:
            yield first.data
            for message in messages:
                yield message.data

        try:
            try:
                store.receive(first.sha256, first.size, first.name, chunks(), max_bytes=limit)
            except ArtifactError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded_message(str(e)))
            except StoreError as e:  # the lab's database (PostgreSQL) did not take it: nothing half-stored
                context.abort(grpc.StatusCode.UNAVAILABLE, bounded_message(f"{first.name or first.sha256}: {e}"))
            except UploadIdle as e:
                log.warning("an upload sent nothing for %g s; cut (--upload-idle-timeout)", idle.idle_s)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            if owner is not None:
                self.server.store.artifacts.record_upload(first.sha256, owner, first.size, time.time())
        finally:  # stored and recorded (it counts from the store now), or failed: the reservation goes
            if owner is not None and quota is not None:
                self.server.release_upload(owner, max(0, first.size))
        log.info("artifact %s stored (%d bytes)", first.sha256[:12], first.size)
        return farm_pb2.UploadArtifactResponse(sha256=first.sha256, size=first.size)

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
        caller = _caller(threaded, self.server.tokens)
        if not self.server.open_watch(caller):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this caller already watches {self.server.max_watches} jobs, the most one token (or "
                                "host) may; stop some watchers (`farm status JOB` polls instead) or raise --max-watches")
        try:
            last = None
            while True:
                message = await on_thread(lambda: _job_message(self.server, self._job(request.job_id, threaded)))
                if message != last:
                    yield message
                    last = message
                if message.status in TERMINAL_JOB:
                    return
                await asyncio.sleep(0.2)
        finally:
            self.server.close_watch(caller)

    # --- what a user can ask beyond the table's questions (the rest are made from it, below) ------------
    def _scope(self, context: grpc.ServicerContext) -> answers.Scope:
        from farm.controller.operations.alerts import alerts_from_environment

        hook = alerts_from_environment()
        viewer = self._viewer(context)

        def submit(job: Any) -> int:  # a prediction's measuring job: this caller's, run by the agents
            job_id = self.server.controller.submit(job, owner=viewer.owner, team=viewer.team)
            self.server.wake(queue_changed=True)
            return job_id

        return answers.Scope(self.server.controller, viewer, self.server.job_sharing, cancel=self.server.cancel_job,
                             agents=self.server.agents, artifact=self.server.artifact_path, submit=submit,
                             alert=hook.send_async if hook else None)

    def _answer(self, context: grpc.ServicerContext, function: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except ServiceError as e:
            context.abort(_STATUS.get(type(e), grpc.StatusCode.INVALID_ARGUMENT), bounded_message(str(e)))

    def StartRefresh(self, request: farm_pb2.StartRefreshRequest, context: grpc.ServicerContext) -> farm_pb2.SubmitJobResponse:
        from farm.controller.operations.reference_suite import SuiteError, submit_reference_suite

        devices = self.server.device_targets()
        if not devices:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no device is registered with this controller: "
                          "start an agent with --devices lab.yaml first")
        try:
            job_id = submit_reference_suite(self.server.store, devices, self.server.refresh_suite, priority="low",
                                            artifacts=self.server.files.store)
        except (JobFileError, SuiteError) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, bounded_message(str(e)))
        if self.server.nightly is not None:  # the client's FinishRefresh checks this one, not the nightly as well
            self.server.nightly.checked.add(job_id)
        self.server.wake(queue_changed=True)
        log.info("refresh: reference suite submitted as job %d for %d device(s) by a client", job_id, len(devices))
        return farm_pb2.SubmitJobResponse(job_id=job_id, tasks=self.server.controller.progress(job_id).total)


# A refusal's kind, as a status code (a plain ServiceError is INVALID_ARGUMENT).
_STATUS = {answers.NotFound: grpc.StatusCode.NOT_FOUND, answers.NotAllowed: grpc.StatusCode.PERMISSION_DENIED,
           answers.Refused: grpc.StatusCode.FAILED_PRECONDITION}


def _handler(question: Question[Any, Any]) -> Callable[[FarmServicer, Any, grpc.ServicerContext], Any]:
    """A FarmService method made from one line of farm.proto.questions' table: the request message is
    validated as the question's request model, the service function answers, the answer model becomes
    the response message (farm.proto.wire)."""
    method = farm_pb2.DESCRIPTOR.services_by_name["FarmService"].methods_by_name[question.rpc]
    response = GetMessageClass(method.output_type)

    def handle(self: FarmServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            ask = model_from_message(request, question.ask)
        except ValidationError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded_message(explain(e)))
        answer = self._answer(context, answers.answer, question, self._scope(context), ask)  # the line's rules first
        if question.changes_devices:
            log.info("%s by a client: %s", question.rpc, printable(ask.model_dump_json()[:200]))
            self.server.wake(queue_changed=True)  # a released device takes tasks again now
        message = answer_to_message(answer, response())
        if message.ByteSize() > MAX_ANSWER_BYTES:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the answer to {question.rpc} is {message.ByteSize() >> 20} MiB, over the "
                          f"{MAX_ANSWER_BYTES >> 20} MiB one answer may carry; ask for less (a report: the HTML "
                          "without --png), or ask on the controller's host")
        return message

    handle.__name__ = handle.__qualname__ = question.rpc
    return handle


for _question in QUESTIONS:
    setattr(FarmServicer, _question.rpc, _handler(_question))


def _caller(context: grpc.ServicerContext, tokens: TokenTable | None) -> str:
    """Who is calling, for per-caller limits: the token's line in the tokens file, else the peer's host."""
    if tokens is not None:
        identity = identity_of(context, tokens)
        return f"{identity.role}@{identity.line}"
    return context.peer().rpartition(":")[0]


@dataclass
class RunningServer:
    grpc_server: grpc.aio.Server
    loop: ServerLoop  # the asyncio loop the server's calls run on, in its own thread
    farm: FarmServer
    port: int
    health: health.HealthServicer
    metrics: MetricsServer | None = None  # the Prometheus endpoint, when --metrics-listen was given
    nightly: Any = None  # controller.nightly.NightlyRefresh, when --refresh-cron was given
    pools: tuple[futures.ThreadPoolExecutor, ...] = ()  # the handlers' threads: stopped last

    @property
    def metrics_port(self) -> int | None:
        return self.metrics.port if self.metrics else None

    def stop(self, grace_s: float = 2.0) -> None:
        for service in ("", FARM_SERVICE, AGENT_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.metrics:
            self.metrics.shutdown()
        if self.nightly:
            self.nightly.stop()
        self.farm.stop()
        if isinstance(self.farm.controller.sweeps, SweepLeader):
            self.farm.controller.sweeps.release()  # the next controller to ask sweeps at once
        with contextlib.suppress(futures.TimeoutError, RuntimeError):  # RuntimeError: stopped already
            self.loop.run(self.grpc_server.stop(grace_s), timeout_s=grace_s + 5)
        self.loop.close()
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)


def startup_warnings(listen: str, *, tokens: bool, tls: bool, metrics_listen: str | None) -> list[str]:
    """What an operator should hear about before the first agent connects."""
    warnings = []
    if tokens and not tls and not is_loopback(listen):
        warnings.append(f"tokens travel in plain text to {listen}: anyone on the network path can read them and use "
                        "them. Serve TLS (--tls-cert, --tls-key) or listen on a loopback address.")
    if metrics_listen and not is_loopback(f"[{parse_listen(metrics_listen)[0]}]:0"):  # a bare :PORT is loopback there
        warnings.append(f"the metrics endpoint on {metrics_listen} has no authentication: it shows device names, agents "
                        "and job counts to anyone who can reach it. Listen on a loopback address or keep it on a "
                        "trusted network.")
    return warnings


def serve(store: Store, listen: str, *, tokens: TokenTable | None, tls: TlsFiles | None = None,
          lease_ttl_s: float = 30.0, heartbeat_interval_s: float | None = None, max_streams: int = DEFAULT_MAX_STREAMS,
          max_watches: int = DEFAULT_MAX_WATCHES, reflection_on: bool = False,
          metrics_listen: str | None = None, refresh_cron: str | None = None,
          refresh_suite: Path | None = None, refresh_include_contended: bool = False,
          models_roots: list[Path] | None = None, max_model_bytes: int | None = None, scripts_need_permission: bool = False,
          budget: BudgetSettings | None = None, job_sharing: str = "shared",
          upload_quota: int | None = DEFAULT_UPLOAD_QUOTA, clock: Callable[[], float] = time.time,
          hooks: Any = None) -> RunningServer:
    """Start the controller's gRPC server (not blocking); the port is the bound one (for :0).

    With metrics_listen (HOST:PORT), Prometheus metrics are served at http://HOST:PORT/metrics too.
    max_streams caps the calls open at once (agent streams wait on the loop; other calls hold a thread
    while they run); reflection is served only when asked
    for, and then only to callers with a token when tokens are on. `budget` shares max_streams out per
    caller (controller/auth.py); its own max_streams is replaced by this one.
    """
    settings = replace(budget or BudgetSettings(), max_streams=max_streams)
    if tls:
        check_server_certificate(tls)  # an expired certificate fails now, not in every client later
    for warning in startup_warnings(listen, tokens=tokens is not None, tls=tls is not None, metrics_listen=metrics_listen):
        log.warning("%s", warning)
    store.sync_normal()
    files = controller_files(store, models_roots=models_roots, max_model_bytes=max_model_bytes)
    call_budget = CallBudget(settings) if tokens else None  # without tokens every caller is the operator
    farm = FarmServer(store, lease_ttl_s=lease_ttl_s, heartbeat_interval_s=heartbeat_interval_s, tokens=tokens,
                      max_watches=max_watches, files=files, scripts_need_permission=scripts_need_permission,
                      upload_idle_s=settings.upload_idle_s, job_sharing=job_sharing, upload_quota=upload_quota,
                      budget=call_budget, hello_timeout_s=settings.hello_timeout_s, agent_idle_s=settings.agent_idle_s,
                      clock=clock, hooks=hooks)
    if farm.agent_idle_s <= farm.heartbeat_interval_s:
        raise ValueError(f"--agent-idle-timeout {farm.agent_idle_s:g} s must be longer than the agents' heartbeat "
                         f"interval ({farm.heartbeat_interval_s:g} s: --heartbeat-interval, else a quarter of "
                         "--lease-ttl), or every idle agent would be cut")
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               # A dead agent's half-open TCP connection is noticed within a minute.
               ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
               ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
               ("grpc.keepalive_permit_without_calls", 1)]
    # Agent streams wait on the loop; a short call or a watcher runs on a thread while it runs (threads start
    # only when used), and calls over max_streams are refused (RESOURCE_EXHAUSTED) rather than left queued.
    calls = futures.ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="rpc")
    agent_messages = futures.ThreadPoolExecutor(max_workers=AGENT_MESSAGE_THREADS, thread_name_prefix="agent-msg")
    health_servicer = health.HealthServicer()
    loop = ServerLoop()

    def store_away(error: BaseException) -> str | None:  # a call that met the store out of reach: UNAVAILABLE
        return farm.controller.outage.message(error) if farm.controller.outage.failed(error, "answering a call") \
            else None

    def build() -> tuple[grpc.aio.Server, int]:  # on the loop's thread: the server belongs to its loop
        gate = CallGate(calls, TokenGuard(tokens, call_budget) if tokens else None, unavailable=store_away)
        server = grpc.aio.server(interceptors=[gate], options=options, maximum_concurrent_rpcs=max_streams)
        agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentServicer(farm, agent_messages), server)
        farm_pb2_grpc.add_FarmServiceServicer_to_server(FarmServicer(farm, calls), server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if reflection_on:
            reflection.enable_server_reflection((FARM_SERVICE, AGENT_SERVICE, health.SERVICE_NAME,
                                                 reflection.SERVICE_NAME), server)
        try:
            port = server.add_secure_port(listen, server_credentials(tls)) if tls else server.add_insecure_port(listen)
        except RuntimeError:  # grpc.aio says so where the sync server returned 0
            port = 0
        return server, port

    try:
        server, port = loop.call(build)
    except BaseException:
        loop.close()
        raise
    if port == 0:
        loop.close()
        raise OSError(f"cannot listen on {listen}: the address is in use or not local")
    # Bound before anything starts, so a busy metrics port fails the start instead of half-serving.
    metrics = serve_metrics(store, metrics_listen) if metrics_listen else None
    nightly = None
    if refresh_cron:
        from farm.controller.operations.alerts import alerts_from_environment
        from farm.controller.operations.nightly import Cron, NightlyRefresh
        hook = alerts_from_environment()
        nightly = NightlyRefresh(store, refresh_suite, Cron.parse(refresh_cron),  # None: the suite farm ships
                                 farm.device_targets, alert=hook.send_async if hook else None,
                                 artifacts=files.store, duties=LabDuties(store), holder=f"{listen}/{os.getpid()}",
                                 include_contended=refresh_include_contended)
    farm.refresh_suite = refresh_suite  # `farm refresh` against this controller submits the nightly's suite
    farm.nightly = nightly
    host = listen.rsplit(":", 1)[0].strip("[]")
    farm.agents.address = f"{socket.gethostname() if host in ('', '0.0.0.0', '::') else host}:{port}"
    farm.agents.presence = Presence(store)  # which controller each agent is on, for every controller's pages
    # lease expiry and job deadlines on one controller of those sharing the store: the holder of the sweeps' lease
    farm.controller.sweeps = SweepLeader(LabDuties(store), f"{farm.agents.address}/{os.getpid()}",
                                         farm.controller.lease_ttl_s, clock=farm.controller.clock)
    farm.start()
    loop.run(server.start())
    if nightly:
        nightly.start()
    for service in ("", FARM_SERVICE, AGENT_SERVICE):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, loop, farm, port, health_servicer, metrics, nightly, (calls, agent_messages))
