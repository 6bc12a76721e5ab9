"""The controller behind gRPC: the same Controller, with agents and clients on the wire.

Each agent holds one bidirectional stream (AgentService.Connect). An idle agent slot sends a
WorkRequest; one dispatcher thread matches waiting requests to pending tasks through
Controller.lease, so the SQLite store sees one writer for leases. Leases are renewed by the
agent's heartbeats; when a stream breaks nothing is dropped at once: the agent may be back
in a moment (it takes over its own session), and if it is not, the lease runs out and the
task goes back to the queue with attempt + 1.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from farm import __version__
from farm.controller.auth import Identity, TlsFiles, TokenInterceptor, TokenTable, identity_of, server_credentials, valid_agent_name
from farm.controller.controller import TERMINAL_JOB, Controller
from farm.controller.jobfile import DEFAULT_MAX_TASKS, JobFileError, load_job_text
from farm.controller.metrics import MetricsServer, serve_metrics
from farm.controller.results import run_records
from farm.controller.store import Store
from farm.proto import strict_json
from farm.proto.generated import agent_pb2, agent_pb2_grpc, common_pb2, farm_pb2, farm_pb2_grpc
from farm.proto.wire import result_from_message, task_to_message

log = logging.getLogger("farm.controller")

# Bump when a message changes meaning; agents with another number are refused with a clear error.
PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 16 << 20  # a RunResult with every sample of a long run fits well under this
MAX_JOB_FILE_BYTES = 1 << 20
MAX_ARTIFACT_BYTES = 4 << 30
ARTIFACT_CHUNK_BYTES = 1 << 20
DISPATCH_BATCH = 16  # slots leased per transaction: fewer commits, yet offers still leave in small bursts
DISPATCH_IDLE_S = 0.5  # how often the dispatcher looks again when nothing woke it (expired leases)
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
FARM_SERVICE = "farm.v1.FarmService"
AGENT_SERVICE = "farm.v1.AgentService"


def _ref(task_id: int, attempt: int) -> common_pb2.TaskRef:
    return common_pb2.TaskRef(task_id=task_id, attempt=attempt)


@dataclass
class AgentSession:
    """One connected agent stream."""

    name: str
    session_id: str
    peer: str
    hello: agent_pb2.Hello
    connected_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)
    state: str = "online"
    outbox: "queue.Queue[agent_pb2.ControllerMessage | None]" = field(default_factory=queue.Queue)
    requests: dict[int, frozenset[str]] = field(default_factory=dict)  # idle slots: request id -> targets
    running: set[tuple[int, int]] = field(default_factory=set)
    closed: threading.Event = field(default_factory=threading.Event)
    taken_over_by: str | None = None  # peer of the newer connection under the same name

    def send(self, message: agent_pb2.ControllerMessage) -> None:
        if not self.closed.is_set():
            self.outbox.put(message)

    def close(self) -> None:
        self.closed.set()
        self.outbox.put(None)  # wakes the response generator so the stream ends


class FarmServer:
    """Owns the Controller, the agent sessions and the dispatcher; the servicers call into it."""

    max_tasks: int = DEFAULT_MAX_TASKS  # per submitted job (`farm controller serve --max-tasks`)

    def __init__(self, store: Store, *, lease_ttl_s: float = 30.0, heartbeat_interval_s: float | None = None,
                 tokens: TokenTable | None = None) -> None:
        self.store = store
        self.controller = Controller(store, lease_ttl_s=lease_ttl_s)
        self.heartbeat_interval_s = heartbeat_interval_s or max(0.2, lease_ttl_s / 4)
        self.tokens = tokens
        self.sessions: dict[str, AgentSession] = {}
        self._lock = threading.RLock()  # sessions and result application
        self._wake = threading.Event()
        # Targets known to have no pending task, so idle slots are not asked about again and again;
        # forgotten whenever tasks may have become pending (submit, retry, expiry, release, idle round).
        self._empty_targets: set[str] = set()
        self._queue_changed = True
        self._stopping = threading.Event()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="dispatcher", daemon=True)
        self.dispatch_count = 0
        # Seconds spent and calls made per step, so a benchmark can say where the time goes.
        self.timings: dict[str, list[float]] = {"lease": [0.0, 0], "complete": [0.0, 0], "heartbeat": [0.0, 0],
                                                "expire": [0.0, 0]}

    def _timed(self, step: str, started: float) -> None:
        entry = self.timings[step]
        entry[0] += time.perf_counter() - started
        entry[1] += 1

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._adopt_unfinished_jobs()
        self._dispatcher.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        with self._lock:
            for session in list(self.sessions.values()):
                session.close()

    def _adopt_unfinished_jobs(self) -> None:
        """After a restart: this process owns the open jobs, and running leases get a full TTL
        so their agents have time to reconnect before anything is re-queued."""
        now = time.time()
        with self.store.transaction():
            self.store.db.execute(
                "UPDATE jobs SET owner_pid = ?, owner_host = ? WHERE status IN ('queued', 'running')",
                [os.getpid(), socket.gethostname()])
            self.store.db.execute("UPDATE tasks SET lease_expires_at = ? WHERE status = 'running'",
                                  [now + self.controller.lease_ttl_s])
            self.store.db.execute("UPDATE agents SET state = 'offline'")
            self.store.db.execute("UPDATE devices SET state = 'offline'")

    def wake(self, queue_changed: bool = False) -> None:
        if queue_changed:
            self._queue_changed = True
        self._wake.set()

    # --- dispatch ----------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        while not self._stopping.is_set():
            if not self._wake.wait(DISPATCH_IDLE_S):
                self._queue_changed = True  # an idle round looks at everything again
            self._wake.clear()
            try:
                self.dispatch_once()
            except Exception:  # a bad round must not stop dispatching for good
                log.exception("dispatch round failed")

    def dispatch_once(self) -> int:
        """Offer pending tasks to the waiting slots; returns how many were offered."""
        started = time.perf_counter()
        if self.controller.expire_leases():
            self._queue_changed = True
        self._timed("expire", started)
        if self._queue_changed:
            self._queue_changed = False
            self._empty_targets.clear()
        with self._lock:
            waiting = [(s, rid, targets) for s in self.sessions.values() if s.state == "online"
                       for rid, targets in list(s.requests.items())]
        waiting = [w for w in waiting if not w[2] <= self._empty_targets and not w[0].closed.is_set()]
        if not waiting:
            return 0
        offered = 0
        for first in range(0, len(waiting), DISPATCH_BATCH):
            offered += self._dispatch_batch(waiting[first:first + DISPATCH_BATCH])
        return offered

    def _dispatch_batch(self, waiting: list[tuple[AgentSession, int, frozenset[str]]]) -> int:
        waiting = [w for w in waiting if not w[2] <= self._empty_targets]  # an earlier batch may have found none
        if not waiting:
            return 0
        started = time.perf_counter()
        # One transaction for several slots; a slot it could not serve asks on its own.
        leased, exhausted = self.controller.lease_batch([(session.name, targets) for session, _, targets in waiting])
        self._timed("lease", started)
        offered = 0
        for (session, request_id, targets), task in zip(waiting, leased):
            if task is None and not exhausted:
                started = time.perf_counter()
                task = self.controller.lease(session.name, set(targets))
                self._timed("lease", started)
            if task is None:
                self._empty_targets |= targets
                continue
            if session.closed.is_set():  # the stream broke meanwhile: the task goes straight back
                self.release(task.task_id, f"released: agent {session.name} went away as it was offered")
                continue
            now = time.time()
            with self._lock:
                session.requests.pop(request_id, None)
                session.running.add((task.task_id, task.attempt))
            offer = agent_pb2.TaskOffer(request_id=request_id, lease_expires_at=now + self.controller.lease_ttl_s,
                                        offered_at=now)
            task_to_message(task, offer.task)
            session.send(agent_pb2.ControllerMessage(offer=offer))
            offered += 1
            self.dispatch_count += 1
        return offered

    # --- agent sessions -------------------------------------------------------------------
    def open_session(self, hello: agent_pb2.Hello, peer: str) -> tuple[AgentSession, list[tuple[int, int]]]:
        """Register a (re)connecting agent; it takes over its own stale session.

        Returns the session and the leases held for this agent that it no longer runs
        (offered while the stream was breaking): those go straight back to the queue.
        """
        session = AgentSession(name=hello.agent_name, session_id=uuid.uuid4().hex, peer=peer, hello=hello)
        still_running = {(r.task_id, r.attempt) for r in hello.running}
        with self._lock:
            old = self.sessions.get(hello.agent_name)
            if old is not None:
                log.info("agent %s reconnected from %s; its old session %s is closed", hello.agent_name, peer, old.session_id)
                old.taken_over_by = peer
                old.close()
            self.sessions[hello.agent_name] = session
            released = []
            with self.store.transaction():
                rows = self.store.db.execute(
                    "SELECT id, attempts FROM tasks WHERE status = 'running' AND leased_by = ?", [hello.agent_name]).fetchall()
                for task_id, attempt in rows:
                    if (task_id, attempt) in still_running:
                        session.running.add((task_id, attempt))
                    else:
                        released.append((task_id, attempt))
                        self.store.db.execute(
                            "UPDATE tasks SET status = 'pending', leased_by = NULL, message = ? WHERE id = ?",
                            [f"released: agent {hello.agent_name} reconnected without it", task_id])
                self._record_agent(session, "online")
            if released:
                self._queue_changed = True
        for task_id, attempt in session.running:
            if not self.controller.heartbeat(task_id, attempt):
                session.send(agent_pb2.ControllerMessage(cancel=agent_pb2.CancelTask(
                    task=_ref(task_id, attempt), reason="the task was canceled or re-leased while the agent was away")))
        self.wake()
        return session, released

    def release(self, task_id: int, reason: str) -> None:
        with self.store.transaction():
            self.store.db.execute("UPDATE tasks SET status = 'pending', leased_by = NULL, message = ? "
                                  "WHERE id = ? AND status = 'running'", [reason, task_id])
        self._queue_changed = True

    def close_session(self, session: AgentSession) -> None:
        session.close()
        with self._lock:
            if self.sessions.get(session.name) is session:
                del self.sessions[session.name]
                with self.store.transaction():
                    self._record_agent(session, "offline")
        log.info("agent %s disconnected (session %s)", session.name, session.session_id)

    def _record_agent(self, session: AgentSession, state: str) -> None:
        hello, now = session.hello, time.time()
        self.store.db["agents"].upsert({
            "name": session.name, "session_id": session.session_id, "state": state,
            "farm_version": hello.farm_version, "capabilities_json": json.dumps(list(hello.capabilities)),
            "hostname": hello.hostname, "peer": session.peer, "connected_at": session.connected_at, "last_seen": now,
        }, pk="name")
        for device in hello.devices:
            self.store.db["devices"].upsert({
                "name": device.name, "agent": session.name, "driver": device.driver,
                "device_type": device.device_type, "tags_json": json.dumps(list(device.tags)),
                "facts_json": device.facts_json or "{}", "slots": device.slots, "state": state, "last_seen": now,
            }, pk="name")

    def on_agent_message(self, session: AgentSession, message: agent_pb2.AgentMessage) -> None:
        session.last_seen = time.time()
        kind = message.WhichOneof("kind")
        if kind == "work_request":
            if session.state == "online":
                with self._lock:
                    session.requests[message.work_request.request_id] = frozenset(message.work_request.targets)
                self.wake()
        elif kind == "heartbeat":
            for ref in message.heartbeat.running:
                started = time.perf_counter()
                alive = self.controller.heartbeat(ref.task_id, ref.attempt)
                self._timed("heartbeat", started)
                if not alive:
                    session.send(agent_pb2.ControllerMessage(cancel=agent_pb2.CancelTask(
                        task=ref, reason="the job was canceled, or the lease ran out and the task went elsewhere")))
        elif kind == "result":
            session.send(agent_pb2.ControllerMessage(ack=self.apply_result(session.name, message.result)))
            with self._lock:
                session.running.discard((message.result.task.task_id, message.result.task.attempt))
            task = self.store.task(message.result.task.task_id)
            self.wake(queue_changed=task is not None and task["status"] == "pending")  # a retry is queued
        elif kind == "drain":
            with self._lock:
                session.state = "draining"
                session.requests.clear()
                with self.store.transaction():
                    self._record_agent(session, "draining")
        elif kind == "progress":
            pass  # progress is informational; the stored state changes with results

    def apply_result(self, agent: str, message: agent_pb2.TaskResult) -> agent_pb2.ResultAck:
        """Apply a result once: a duplicate or a superseded attempt is acknowledged, not stored again."""
        task_id, attempt = message.task.task_id, message.task.attempt
        ack = agent_pb2.ResultAck(task=message.task)
        with self._lock:
            task = self.store.task(task_id)
            if task is None:
                ack.note = f"no task {task_id} in this controller's store"
                return ack
            if task["attempts"] != attempt:
                ack.note = f"attempt {attempt} was superseded by attempt {task['attempts']} (its lease ran out)"
                return ack
            started = time.perf_counter()
            run_id = self.controller.complete(task_id, attempt, agent, message.started_at,
                                              result_from_message(message.result))
            self._timed("complete", started)
        ack.applied = run_id is not None
        ack.run_id = run_id or 0
        ack.note = "" if ack.applied else "already applied"
        return ack

    def cancel_job(self, job_id: int) -> int:
        """Cancel in the store, then tell the agents running its tasks now rather than at their next heartbeat."""
        n = self.controller.cancel_job(job_id)
        rows = self.store.query("SELECT id, attempts, leased_by FROM tasks WHERE job_id = ? AND status = 'running'", [job_id])
        with self._lock:
            for row in rows:
                session = self.sessions.get(row["leased_by"] or "")
                if session is not None:
                    session.send(agent_pb2.ControllerMessage(cancel=agent_pb2.CancelTask(
                        task=_ref(row["id"], row["attempts"]), reason=f"job {job_id} was canceled")))
        return n

    def device_holder(self, device: str) -> str | None:
        """The online agent that registered this device, if any."""
        with self._lock:
            for session in self.sessions.values():
                if any(d.name == device for d in session.hello.devices):
                    return session.name
        return None

    def device_targets(self) -> list[Any]:
        """The devices a job can target: every non-sim device an agent has registered (online or not)."""
        from farm.agents.device_types import load_device_types
        from farm.controller.jobfile import DeviceTarget

        types = load_device_types()
        return [DeviceTarget(r["name"], types.get(r["device_type"] or ""), json.loads(r["tags_json"] or "[]"))
                for r in self.store.query("SELECT name, device_type, tags_json FROM devices WHERE driver != 'sim'")]

    def artifact_path(self, sha256: str) -> Path | None:
        """The model file with this content hash, as a task of some job names it (never a path from the wire)."""
        if not SHA256_HEX.match(sha256):
            return None
        rows = self.store.query("SELECT model_path FROM tasks WHERE model_sha256 = ? ORDER BY id DESC LIMIT 1", [sha256])
        return Path(rows[0]["model_path"]) if rows else None


def _job_message(server: FarmServer, job: dict[str, Any]) -> farm_pb2.Job:
    p = server.controller.progress(job["id"])
    message = farm_pb2.Job(
        id=job["id"], name=job["name"] or "", status=server.controller.job_status(job["id"]),
        priority=job["priority"] or "", total=p.total, pending=p.pending, running=p.running,
        completed=p.completed, failed=p.failed, canceled=p.canceled, created_at=job["created_at"] or 0.0,
        message=job["message"] or "")
    if job["started_at"] is not None:
        message.started_at = job["started_at"]
    if job["finished_at"] is not None:
        message.finished_at = job["finished_at"]
    return message


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, server: FarmServer) -> None:
        self.server = server

    def Connect(self, request_iterator: Iterator[agent_pb2.AgentMessage], context: grpc.ServicerContext) -> Iterator[agent_pb2.ControllerMessage]:
        identity = identity_of(context, self.server.tokens)
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message on the agent stream must be a hello")
        hello = first.hello
        self._check_hello(hello, identity, context)
        session, released = self.server.open_session(hello, context.peer())
        log.info("agent %s connected from %s (farm %s, %d device(s))", hello.agent_name, context.peer(),
                 hello.farm_version, len(hello.devices))
        reader = threading.Thread(target=self._read, args=(session, request_iterator), name=f"agent-{session.name}", daemon=True)
        reader.start()
        try:
            yield agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(
                session_id=session.session_id, controller_version=__version__, protocol_version=PROTOCOL_VERSION,
                lease_ttl_s=self.server.controller.lease_ttl_s, heartbeat_interval_s=self.server.heartbeat_interval_s,
                released=[_ref(t, a) for t, a in released]))
            while context.is_active():
                try:
                    message = session.outbox.get(timeout=1.0)
                except queue.Empty:
                    continue
                if message is None:
                    break
                yield message
        finally:
            self.server.close_session(session)
        if session.taken_over_by:
            # A reconnect's old stream is dead and never sees this; a second live process with the same name does.
            context.abort(grpc.StatusCode.ABORTED,
                          f"agent {session.name!r} connected again from {session.taken_over_by}, which took over this "
                          "session. Give every agent process its own --name.")

    def _check_hello(self, hello: agent_pb2.Hello, identity: Identity, context: grpc.ServicerContext) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"version mismatch: agent {hello.agent_name!r} runs farm {hello.farm_version} (protocol "
                          f"{hello.protocol_version}), this controller runs farm {__version__} (protocol {PROTOCOL_VERSION}). "
                          "Install the same farm version on the agent and the controller.")
        if not valid_agent_name(hello.agent_name):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"agent name {hello.agent_name!r} is not allowed: use letters, digits, '.', '_' and '-' (at most 64)")
        if identity.agent_name and identity.agent_name != hello.agent_name:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"this agent token belongs to agent {identity.agent_name!r}; it cannot connect as "
                          f"{hello.agent_name!r}. Start the agent with --name {identity.agent_name} or use its own token.")
        for device in hello.devices:
            owner, _, local = device.name.partition("/")
            plain = not local and valid_agent_name(device.name)
            if not plain and not (owner == hello.agent_name and valid_agent_name(local)):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"device name {device.name!r} is not allowed: use letters, digits, '.', '_' and '-', "
                              f"or {hello.agent_name}/NAME for this agent's own")
            if device.name == "sim" or device.name.startswith(("type:", "tag:")):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"device name {device.name!r} is reserved")
            holder = self.server.device_holder(device.name)
            if holder is not None and holder != hello.agent_name:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"device {device.name!r} is already registered by agent {holder!r}, which is online. "
                              "One device, one agent: remove it from one of the two device lists.")

    def _read(self, session: AgentSession, request_iterator: Iterator[agent_pb2.AgentMessage]) -> None:
        try:
            for message in request_iterator:
                if session.closed.is_set():
                    break
                self.server.on_agent_message(session, message)
        except grpc.RpcError:
            pass  # the agent went away; its leases run out unless it comes back
        except Exception:
            log.exception("agent %s: handling a message failed", session.name)
        finally:
            session.close()

    def FetchArtifact(self, request: common_pb2.ArtifactRequest, context: grpc.ServicerContext) -> Iterator[common_pb2.ArtifactChunk]:
        path = self.server.artifact_path(request.sha256)
        if path is None or not path.is_file():
            context.abort(grpc.StatusCode.NOT_FOUND, f"no artifact with sha256 {request.sha256[:64]!r} on this controller")
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
    def __init__(self, server: FarmServer) -> None:
        self.server = server

    def _job(self, job_id: int, context: grpc.ServicerContext) -> dict[str, Any]:
        job = self.server.store.job(job_id)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id} on this controller; `farm jobs` lists its jobs")
        return job

    def SubmitJob(self, request: farm_pb2.SubmitJobRequest, context: grpc.ServicerContext) -> farm_pb2.SubmitJobResponse:
        if len(request.job_yaml.encode()) > MAX_JOB_FILE_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the job file is over {MAX_JOB_FILE_BYTES} bytes")
        base_dir = Path(request.base_dir or ".")
        if not base_dir.is_absolute():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "base_dir must be an absolute path on the controller's host")
        try:
            job = load_job_text(request.job_yaml, request.file_name or "job.yaml", base_dir,
                                devices=self.server.device_targets(), max_tasks=self.server.max_tasks)
        except JobFileError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.priority:
            job.spec.priority = request.priority
        job_id = self.server.controller.submit(job)
        self.server.wake(queue_changed=True)
        total = self.server.controller.progress(job_id).total
        log.info("job %d submitted: %d task(s)", job_id, total)
        return farm_pb2.SubmitJobResponse(job_id=job_id, tasks=total, models=len(job.models))

    def GetJob(self, request: farm_pb2.JobRequest, context: grpc.ServicerContext) -> farm_pb2.Job:
        return _job_message(self.server, self._job(request.job_id, context))

    def WatchJob(self, request: farm_pb2.JobRequest, context: grpc.ServicerContext) -> Iterator[farm_pb2.Job]:
        self._job(request.job_id, context)
        last = None
        while context.is_active():
            message = _job_message(self.server, self.server.store.job(request.job_id))
            if message != last:
                yield message
                last = message
            if message.status in TERMINAL_JOB:
                return
            time.sleep(0.2)

    def CancelJob(self, request: farm_pb2.JobRequest, context: grpc.ServicerContext) -> farm_pb2.CancelJobResponse:
        self._job(request.job_id, context)
        return farm_pb2.CancelJobResponse(job_id=request.job_id, canceled_tasks=self.server.cancel_job(request.job_id))

    def ListJobs(self, request: farm_pb2.ListJobsRequest, context: grpc.ServicerContext) -> farm_pb2.ListJobsResponse:
        jobs = [self.server.store.job(j["id"]) for j in self.server.controller.jobs(request.limit or 50)]
        return farm_pb2.ListJobsResponse(jobs=[_job_message(self.server, j) for j in jobs])

    def ListDevices(self, request: farm_pb2.ListDevicesRequest, context: grpc.ServicerContext) -> farm_pb2.ListDevicesResponse:
        rows = self.server.store.query("SELECT * FROM devices ORDER BY name")
        return farm_pb2.ListDevicesResponse(devices=[common_pb2.Device(
            name=r["name"], driver=r["driver"] or "", device_type=r["device_type"] or "",
            tags=json.loads(r["tags_json"] or "[]"), facts_json=r["facts_json"] or "{}", slots=r["slots"] or 0,
            state=r["state"] or "", agent=r["agent"] or "", last_seen=r["last_seen"] or 0.0) for r in rows])

    def ListAgents(self, request: farm_pb2.ListAgentsRequest, context: grpc.ServicerContext) -> farm_pb2.ListAgentsResponse:
        rows = self.server.store.query("SELECT * FROM agents ORDER BY name")
        agents = []
        for r in rows:
            session = self.server.sessions.get(r["name"])
            agents.append(farm_pb2.AgentInfo(
                name=r["name"], session_id=r["session_id"] or "", state=r["state"] or "",
                farm_version=r["farm_version"] or "", capabilities=json.loads(r["capabilities_json"] or "[]"),
                hostname=r["hostname"] or "", peer=r["peer"] or "", connected_at=r["connected_at"] or 0.0,
                last_seen=session.last_seen if session else (r["last_seen"] or 0.0),
                running=len(session.running) if session else 0))
        return farm_pb2.ListAgentsResponse(agents=agents)

    def GetResults(self, request: farm_pb2.JobRequest, context: grpc.ServicerContext) -> farm_pb2.GetResultsResponse:
        self._job(request.job_id, context)
        return farm_pb2.GetResultsResponse(records_json=strict_json.dumps(run_records(self.server.store, request.job_id)))


@dataclass
class RunningServer:
    grpc_server: grpc.Server
    farm: FarmServer
    port: int
    health: health.HealthServicer
    metrics: MetricsServer | None = None  # the Prometheus endpoint, when --metrics-listen was given
    nightly: Any = None  # controller.nightly.NightlyRefresh, when --refresh-cron was given

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
        self.grpc_server.stop(grace_s).wait(grace_s + 1)


DEFAULT_REFRESH_SUITE = Path(__file__).resolve().parent.parent / "examples" / "reference-suite.yaml"


def serve(store: Store, listen: str, *, tokens: TokenTable | None, tls: TlsFiles | None = None,
          lease_ttl_s: float = 30.0, heartbeat_interval_s: float | None = None, max_workers: int = 256,
          metrics_listen: str | None = None, refresh_cron: str | None = None,
          refresh_suite: Path | None = None) -> RunningServer:
    """Start the controller's gRPC server (not blocking); the port is the bound one (for :0).

    With metrics_listen (HOST:PORT), Prometheus metrics are served at http://HOST:PORT/metrics too.
    """
    # WAL + NORMAL survives a killed process intact; only a power cut can drop the last commits, and
    # then their tasks re-run when the leases run out. It saves an fsync per lease and per result.
    store.db.execute("PRAGMA synchronous = NORMAL")
    farm = FarmServer(store, lease_ttl_s=lease_ttl_s, heartbeat_interval_s=heartbeat_interval_s, tokens=tokens)
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               # A dead agent's half-open TCP connection is noticed within a minute.
               ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
               ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
               ("grpc.keepalive_permit_without_calls", 1)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
                         interceptors=[TokenInterceptor(tokens)] if tokens else [], options=options,
                         maximum_concurrent_rpcs=max_workers - 8)
    agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentServicer(farm), server)
    farm_pb2_grpc.add_FarmServiceServicer_to_server(FarmServicer(farm), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (FARM_SERVICE, AGENT_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_secure_port(listen, server_credentials(tls)) if tls else server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}: the address is in use or not local")
    # Bound before anything starts, so a busy metrics port fails the start instead of half-serving.
    metrics = serve_metrics(store, metrics_listen) if metrics_listen else None
    nightly = None
    if refresh_cron:
        from farm.controller.alerts import alerts_from_environment
        from farm.controller.nightly import Cron, NightlyRefresh
        hook = alerts_from_environment()
        nightly = NightlyRefresh(store, refresh_suite or DEFAULT_REFRESH_SUITE, Cron.parse(refresh_cron),
                                 farm.device_targets, alert=hook.send if hook else None)
    farm.start()
    server.start()
    if nightly:
        nightly.start()
    for service in ("", FARM_SERVICE, AGENT_SERVICE):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, farm, port, health_servicer, metrics, nightly)
