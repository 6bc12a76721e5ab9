"""What the servicers call: FarmServer routes agent messages to the sessions, the dispatcher, the result writer
and the lease renewer, and keeps the per-caller counts (uploads, watches); controller_files is its artifact store.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable


from farm.controller.scheduling.artifacts import ArtifactStore, ControllerFiles, ModelRoots, SharedArtifactStore
from farm.controller.store.artifacts_db import ArtifactChunks
from farm.controller.store.postgres import PostgresStore
from farm.controller.auth import BudgetSettings, CallBudget, IdleUploads, TokenTable
from farm.proto.device_types import load_device_types
from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.dispatch import Dispatcher, StepTimings
from farm.controller.scheduling.jobfile import DEFAULT_MAX_TASKS, DeviceTarget
from farm.controller.scheduling.lease_renewer import LeaseRenewer, QueuedHeartbeat
from farm.controller.scheduling.result_writer import RESULT_BATCH, QueuedResult, ResultWriter
from farm.controller.scheduling.sessions import AgentSession, Sessions
from farm.controller.store import Store
from farm.proto.batching import MAX_BATCH_MESSAGES
from farm.proto.escape import printable
from farm.proto.generated import agent_pb2
from farm.controller.rpc.limits import (
    DEFAULT_MAX_WATCHES,
    DEFAULT_UPLOAD_QUOTA, MAX_CANCELS_PER_HEARTBEAT,
    MAX_MODEL_BYTES, MAX_OPEN_REQUESTS, task_ref,
)

log = logging.getLogger("farm.controller")


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
        """One message of an agent's stream, handled by its kind (a hello after the first, or a message of no kind
        this controller knows: ignored)."""
        session.last_seen = time.time()
        handle = self._ON_KIND.get(message.WhichOneof("kind") or "")
        if handle is not None:
            handle(self, session, message)

    def _on_work_request(self, session: AgentSession, message: agent_pb2.AgentMessage) -> None:
        if self._take_request(session, message.work_request):
            self.wake()

    def _on_heartbeat(self, session: AgentSession, message: agent_pb2.AgentMessage) -> None:
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

    def _on_result(self, session: AgentSession, message: agent_pb2.AgentMessage) -> None:
        self._take_result(session, message.result, [])

    def _on_drain(self, session: AgentSession, message: agent_pb2.AgentMessage) -> None:
        with self._lock:
            session.state = "draining"
            session.requests.clear()
            self.agents.record(session, "draining")

    def _on_progress(self, session: AgentSession, message: agent_pb2.AgentMessage) -> None:
        pass  # progress is informational; the stored state changes with results

    def _on_batch(self, session: AgentSession, message: agent_pb2.AgentMessage) -> None:
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

    # an agent message's kind (its oneof field) -> its handler; any other kind is ignored
    _ON_KIND: dict[str, Callable[["FarmServer", AgentSession, agent_pb2.AgentMessage], None]] = {
        "work_request": _on_work_request, "heartbeat": _on_heartbeat, "result": _on_result, "drain": _on_drain,
        "progress": _on_progress, "batch": _on_batch,
    }

    def _stop_attempts(self, session: AgentSession, attempts: list[tuple[int, int]], still_running: bool = True) -> None:
        """Tell the agent to stop these attempts; `still_running`: only those its session still runs (a result
        acknowledged since the heartbeat needs no cancel)."""
        if still_running:
            with self._lock:
                attempts = [ref for ref in attempts if ref in session.running]
        for task_id, attempt in attempts:
            session.send(agent_pb2.ControllerMessage(cancel=agent_pb2.CancelTask(
                task=task_ref(task_id, attempt), reason="the job was canceled, or this agent holds no lease on this "
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
                        task=task_ref(row["id"], row["attempts"]), reason=reason)))

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
