"""The agent's end of the wire: ControllerApi (lease / heartbeat / complete) over one gRPC stream.

The Agent calls it exactly as it calls the in-process Controller. Underneath, one thread
holds the stream: it dials out, says hello (version, capabilities, devices, the tasks it still
runs), sends heartbeats for every running task, and reconnects with exponential backoff and
jitter when the stream breaks. Given several controllers (one lab on one PostgreSQL), it tries them in turn:
a stream that breaks moves it to the next one, with the same backoff. Tasks keep running while the controller is away; their results
wait here until the controller acknowledges them, so none is lost and (the controller being
idempotent by task and attempt) none is counted twice. A result is cut to fit one message
(wire.result_for_the_wire) before it is kept, so none can break the stream again and again.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import logging
import os
import queue
import random
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal, Sequence

import grpc
from pydantic import ValidationError

from farm.agents.artifact_cache import ArtifactCache
from farm.version import __version__
from farm.proto.addresses import DEFAULT_PORT, MAX_CONTROLLERS as MAX_CONTROLLERS, controller_addresses as controller_addresses
from farm.proto.copying import replaced
from farm.proto.generated import agent_pb2, agent_pb2_grpc, common_pb2
from farm.proto.results import FailureClass, RunResult
from farm.proto.accuracy import MAX_PACKED_BYTES
from farm.proto.spec import BenchmarkWorkload, ScriptWorkload
from farm.proto.tasks import TaskSpec
from farm.proto.batching import BATCH_CAPABILITY, MAX_BATCH_MESSAGES, gathered, opened
from farm.proto.escape import printable
from farm.proto.names import is_sha256, safe_suffix
from farm.proto.tls import TlsFiles
from farm.proto.wire import result_for_the_wire, task_from_message

log = logging.getLogger("farm.agent")

PROTOCOL_VERSION = 1  # must equal farm.controller.grpc_server.PROTOCOL_VERSION
CAPABILITIES = ("sim", "artifacts-sha256", "drain", BATCH_CAPABILITY)
MAX_MESSAGE_BYTES = 16 << 20
MAX_ARTIFACT_BYTES = 4 << 30
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.25, 10.0
# A session taken over by another connection under this name: retried, slowly (a second live process with
# the same --name would otherwise take it back and forth), and said each time.
TAKEN_BACKOFF_FIRST_S, TAKEN_BACKOFF_MAX_S = 5.0, 300.0
# These refusals will not go away by retrying the same controller: the agent tries the next of its list, and
# stops, saying why, only once every one of them refused it in a row (one controller: at the first refusal).
FATAL_CODES = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT}


class ControllerRefused(Exception):
    """The controller refused this agent for a reason retrying cannot fix."""


def open_channel(address: str, *, tls: TlsFiles | None = None) -> grpc.Channel:
    """A channel to the controller: TLS when a CA is given (mutual TLS with a cert and key too)."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
               ("grpc.keepalive_permit_without_calls", 1)]
    if tls is None or tls.ca is None:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.read("ca"), private_key=tls.read("key"),
                                               certificate_chain=tls.read("cert"))
    return grpc.secure_channel(address, credentials, options=options)


def token_metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


@dataclass
class AgentDevice:
    """A device this agent registers: the sim (one per agent) or what a driver found."""

    name: str
    driver: str
    device_type: str
    tags: list[str] = field(default_factory=list)
    facts_json: str = "{}"
    slots: int = 1


@dataclass
class _Request:
    request_id: int
    targets: frozenset[str]
    offer: TaskSpec | None = None
    answered: threading.Event = field(default_factory=threading.Event)


class RemoteController:
    """ControllerApi over gRPC; call start() first, drain() on SIGTERM, close() at the end."""

    def __init__(self, address: str | Sequence[str], *, name: str, token: str | None, devices: list[AgentDevice],
                 tls: TlsFiles | None = None, artifact_dir: Path | None = None,
                 protocol_version: int = PROTOCOL_VERSION, clock: Callable[[], float] = time.monotonic) -> None:
        # the controllers to try in turn (several share one PostgreSQL); `address` is the one in use
        given = [address] if isinstance(address, str) else list(address)
        if not given:
            raise ValueError("an agent needs at least one controller address")
        # checked here too (the CLI checked its flag already): a port out of range is never dialled with the token
        self.addresses = controller_addresses(",".join(given), DEFAULT_PORT)
        self.address = self.addresses[0]
        self.name = name
        self.token = token
        self.devices = devices
        self.tls = tls
        self.artifact_dir = artifact_dir
        self.protocol_version = protocol_version
        self._clock = clock  # when a heartbeat is due (tests pass one they move, farm.client.compose.build_agent)
        self.connected = threading.Event()
        self.draining = threading.Event()
        self.fatal: ControllerRefused | None = None
        self.reconnects = 0
        self.offered_at: dict[tuple[int, int], float] = {}  # when the controller offered each task (benchmarks)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._requests: dict[int, _Request] = {}
        self._running: dict[tuple[int, int], TaskSpec] = {}
        self._canceled: set[tuple[int, int]] = set()
        self._unacked: dict[tuple[int, int], agent_pb2.TaskResult] = {}
        self._artifacts: ArtifactCache | None = None
        self._outbox: "queue.Queue[agent_pb2.AgentMessage | None] | None" = None
        self._heartbeat_interval_s = 1.0
        self._welcomed = False  # the current stream got its welcome (it had worked)
        self._batches = False  # the current controller reads AgentBatch (its Welcome says so)
        self._slot = threading.local()  # per slot thread: what it leases, and a request sent with its last result
        self._thread = threading.Thread(target=self._connection_loop, name="controller-stream", daemon=True)

    # --- lifecycle -------------------------------------------------------------------
    def start(self) -> "RemoteController":
        self._thread.start()
        return self

    def drain(self) -> None:
        """Finish what runs, take nothing new (SIGTERM)."""
        if self.draining.is_set():
            return
        self.draining.set()
        self._send(agent_pb2.AgentMessage(drain=agent_pb2.Drain()))
        with self._lock:
            for request in self._requests.values():
                request.answered.set()

    def wait_for_acks(self, timeout_s: float) -> bool:
        """Wait until the controller has every result; False when some are still undelivered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.fatal is None:
            with self._lock:
                if not self._unacked:
                    return True
            time.sleep(0.05)
        with self._lock:
            return not self._unacked

    def close(self) -> None:
        self._closed.set()
        self.drain()
        outbox = self._outbox
        if outbox is not None:
            outbox.put(None)
        self._thread.join(5)

    # --- ControllerApi ------------------------------------------------------------------
    def lease(self, agent: str, targets: set[str], *, job_id: int | None = None) -> TaskSpec | None:
        """Block until the controller offers a task for this slot; None once draining or refused."""
        wanted = frozenset(targets)  # "sim", or one device's name: the controller resolved types and tags at submit
        self._slot.wanted, self._slot.leasing = wanted, True
        try:
            return self._lease(agent, wanted)
        finally:
            self._slot.leasing = False

    def _lease(self, agent: str, wanted: frozenset[str]) -> TaskSpec | None:
        while not self.draining.is_set() and self.fatal is None:
            request = self._sent_with_result(wanted)
            if request is None:
                request = _Request(next(self._ids), wanted)
                with self._lock:
                    self._requests[request.request_id] = request
                self._send(self._work_request(request))
            while not request.answered.wait(1.0):  # a drain that came between the check and the send ends it too
                if self.draining.is_set() or self.fatal is not None:
                    break
            with self._lock:  # answered from here on: an offer either took the request before this or never will
                request.answered.set()
                self._requests.pop(request.request_id, None)
                task = request.offer
            if task is None:
                continue
            try:  # in the slot's thread, so a download never holds up the stream
                task = replaced(  # the offer as this agent runs it: the copies in its own cache
                    task, model_path=self.local_model_path(task),
                    script_archive_path=self.local_script_archive(task)
                    if isinstance(task.plan.workload, ScriptWorkload) else None)
                task = self.with_local_dataset(task)
            except (OSError, ValueError, grpc.RpcError) as e:
                # Not the model's fault: another agent (or a later try) may have it.
                self.complete(task.task_id, task.attempt, agent, time.time(), RunResult.failed(
                    FailureClass.INFRASTRUCTURE, self.fetch_failure(task, e)))
                continue
            return task
        return None

    def _sent_with_result(self, wanted: frozenset[str]) -> _Request | None:
        """The request this slot thread sent along with its last result, if it asks for the same targets."""
        request: _Request | None = getattr(self._slot, "next_request", None)
        self._slot.next_request = None
        if request is not None and request.targets != wanted:
            with self._lock:  # not this slot's any more: an offer for it goes back as the agent's refusal
                self._requests.pop(request.request_id, None)
            request.answered.set()
            return None
        return request

    def heartbeat(self, task_id: int, attempt: int) -> bool:
        """Leases are renewed by the stream thread; here the agent only learns of a cancel."""
        with self._lock:
            return (task_id, attempt) not in self._canceled and self.fatal is None

    def complete(self, task_id: int, attempt: int, agent: str, started_at: float, result: RunResult) -> int | None:
        message = agent_pb2.TaskResult(task=common_pb2.TaskRef(task_id=task_id, attempt=attempt),
                                       started_at=started_at, agent=agent)
        result_for_the_wire(result, message.result)
        with self._lock:
            self._running.pop((task_id, attempt), None)
            self._canceled.discard((task_id, attempt))
            self.offered_at.pop((task_id, attempt), None)
            self._unacked[(task_id, attempt)] = message  # kept until acknowledged, across reconnects
        wanted = getattr(self._slot, "wanted", None)
        if wanted is None or getattr(self._slot, "leasing", False) or not self._batches or self.draining.is_set():
            self._send(agent_pb2.AgentMessage(result=message))
            return None  # the run id arrives later in the acknowledgement
        # A slot thread asks for its next task in the same write (its lease() takes this request, not a new one).
        request = _Request(next(self._ids), wanted)
        with self._lock:
            self._requests[request.request_id] = request
        self._slot.next_request = request
        self._send(agent_pb2.AgentMessage(batch=agent_pb2.AgentBatch(
            messages=[agent_pb2.AgentMessage(result=message), self._work_request(request)])))
        return None

    # --- the stream ------------------------------------------------------------------------
    def _work_request(self, request: _Request) -> agent_pb2.AgentMessage:
        return agent_pb2.AgentMessage(work_request=agent_pb2.WorkRequest(
            request_id=request.request_id, targets=sorted(request.targets)))

    def _send(self, message: agent_pb2.AgentMessage) -> None:
        outbox = self._outbox
        if outbox is not None and self.connected.is_set():
            outbox.put(message)
        # not connected: the hello of the next connection carries the state, and requests and results are re-sent

    def _hello(self) -> agent_pb2.AgentMessage:
        with self._lock:
            running = [common_pb2.TaskRef(task_id=t, attempt=a) for t, a in [*self._running, *self._unacked]]
        hello = agent_pb2.Hello(agent_name=self.name, farm_version=__version__, protocol_version=self.protocol_version,
                                capabilities=list(CAPABILITIES), running=running, hostname=socket.gethostname())
        for d in self.devices:
            hello.devices.add(name=d.name, driver=d.driver, device_type=d.device_type, tags=d.tags,
                              facts_json=d.facts_json, slots=d.slots)
        return agent_pb2.AgentMessage(hello=hello)

    def _outgoing(self, outbox: "queue.Queue[agent_pb2.AgentMessage | None]") -> Iterator[agent_pb2.AgentMessage]:
        yield self._hello()
        last_beat = float("-inf")  # the first heartbeat follows the hello at once: the hello renews no lease
        clock = self._clock
        while True:
            message: agent_pb2.AgentMessage | None | Literal[False]
            try:
                message = outbox.get(timeout=max(0.0, self._heartbeat_interval_s - (clock() - last_beat)))
            except queue.Empty:
                message = False  # time for a heartbeat, nothing else to send
            if clock() - last_beat >= self._heartbeat_interval_s:
                # On a clock, not on silence: a busy stream must still renew its leases.
                last_beat = clock()
                yield self._heartbeat()
            if message is None:
                return
            if message is not False:
                parts, ending = gathered(message, outbox) if self._batches else (opened(message), False)
                if len(parts) > 1:  # whatever queued meanwhile leaves in the same write, never a batch in a batch
                    yield agent_pb2.AgentMessage(batch=agent_pb2.AgentBatch(messages=parts))
                else:
                    yield from parts
                if ending:
                    return

    def _heartbeat(self) -> agent_pb2.AgentMessage:
        with self._lock:
            running = [common_pb2.TaskRef(task_id=t, attempt=a) for t, a in self._running]
        return agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat(running=running))

    def _connection_loop(self) -> None:
        backoff, taken = BACKOFF_FIRST_S, TAKEN_BACKOFF_FIRST_S
        refused: set[str] = set()  # the controllers that refused this agent since one last welcomed it
        while not self._closed.is_set():
            try:
                self._one_connection()
                refused.clear()
                backoff = BACKOFF_FIRST_S  # the controller closed a stream that had worked
                self._next_controller()
            except ControllerRefused as e:
                if self._welcomed:
                    refused.clear()
                refused.add(self.address)
                if len(refused) >= len(self.addresses):  # all of them: retrying cannot fix it
                    self.fatal = e if len(self.addresses) == 1 else ControllerRefused(
                        f"every controller this agent was given refused it; the last: {e}")
                    log.error("%s", printable(str(self.fatal), limit=2000))
                    with self._lock:
                        for request in self._requests.values():
                            request.answered.set()
                    return
                # One of several refused (an old or a wrong address, or something posing as a controller): the
                # others may well take this agent. Round the list, with the backoff, saying so.
                self._next_controller()
                log.warning("%s; trying the next controller, %s, in about %.1f s (%d of %d refused this agent)",
                            printable(str(e), limit=1000), self.address, backoff, len(refused), len(self.addresses))
            except grpc.RpcError as e:
                if self._welcomed:
                    refused.clear()
                if e.code() == grpc.StatusCode.ABORTED and not self._closed.is_set():
                    log.warning("the controller at %s ended this agent's session: %s; connecting again in %.0f s",
                                self.address, printable(e.details(), limit=500), taken)
                    self._closed.wait(taken)
                    taken = min(taken * 2, TAKEN_BACKOFF_MAX_S)
                    self.reconnects += 1
                    continue
                if self._welcomed:
                    backoff = BACKOFF_FIRST_S  # a stream that had worked broke: the next controller may well answer
                failed = self.address
                self._next_controller()
                if not self._closed.is_set():
                    log.warning("controller %s unreachable (%s: %s); reconnecting to %s in about %.1f s",
                                failed, e.code().name, e.details(), self.address, backoff)
            if self._closed.is_set():
                return
            # Jitter spreads a rack's reconnects after a controller restart.
            self._closed.wait(backoff * random.uniform(0.5, 1.5))
            backoff = min(backoff * 2, BACKOFF_MAX_S)
            self.reconnects += 1

    def _next_controller(self) -> None:
        """Round robin: the next of the agent's controllers (the same one when it has only one)."""
        self.address = self.addresses[(self.addresses.index(self.address) + 1) % len(self.addresses)]

    def _one_connection(self) -> None:
        self._welcomed = False  # set by the welcome: the controller took this agent
        channel = open_channel(self.address, tls=self.tls)
        outbox: "queue.Queue[agent_pb2.AgentMessage | None]" = queue.Queue()
        try:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            responses = stub.Connect(self._outgoing(outbox), metadata=token_metadata(self.token))
            for message in responses:
                if message.WhichOneof("kind") == "welcome":
                    self._on_welcome(message.welcome, outbox)
                elif message.WhichOneof("kind") == "batch":
                    if len(message.batch.messages) > MAX_BATCH_MESSAGES:
                        raise ControllerRefused(f"the controller at {self.address} sent a batch of "
                                                f"{len(message.batch.messages)} messages (at most {MAX_BATCH_MESSAGES})")
                    for one in message.batch.messages:  # in order: an acknowledgement before the offer behind it
                        if one.WhichOneof("kind") not in ("welcome", "batch"):
                            self._on_message(one)
                else:
                    self._on_message(message)
        except grpc.RpcError as e:
            if e.code() in FATAL_CODES:
                raise ControllerRefused(f"the controller at {self.address} refused this agent: {e.details()}") from None
            raise
        finally:
            self.connected.clear()
            self._outbox = None
            outbox.put(None)
            channel.close()

    def _on_message(self, message: agent_pb2.ControllerMessage) -> None:
        """An offer, a cancel or an acknowledgement (alone, or one of a batch)."""
        kind = message.WhichOneof("kind")
        if kind == "offer":
            self._on_offer(message.offer)
        elif kind == "cancel":
            with self._lock:
                self._canceled.add((message.cancel.task.task_id, message.cancel.task.attempt))
            log.info("task %d attempt %d canceled by the controller: %s", message.cancel.task.task_id,
                     message.cancel.task.attempt, printable(message.cancel.reason))
        elif kind == "ack":
            with self._lock:
                self._unacked.pop((message.ack.task.task_id, message.ack.task.attempt), None)
            if message.ack.note and message.ack.note != "already applied":
                log.warning("task %d attempt %d: the controller says: %s", message.ack.task.task_id,
                            message.ack.task.attempt, printable(message.ack.note, limit=1000))

    def _on_welcome(self, welcome: agent_pb2.Welcome, outbox: "queue.Queue[agent_pb2.AgentMessage | None]") -> None:
        self._heartbeat_interval_s = welcome.heartbeat_interval_s or 1.0
        self._batches = BATCH_CAPABILITY in welcome.capabilities
        self._welcomed = True
        self._outbox = outbox
        self.connected.set()
        log.info("connected to controller %s (farm %s, session %s)", self.address, welcome.controller_version,
                 welcome.session_id[:8])
        with self._lock:
            pending = [self._work_request(r) for r in self._requests.values() if r.offer is None and not r.answered.is_set()]
            unacked = list(self._unacked.values())
        for message in pending:
            outbox.put(message)
        for result in unacked:
            outbox.put(agent_pb2.AgentMessage(result=result))
        if self.draining.is_set():
            outbox.put(agent_pb2.AgentMessage(drain=agent_pb2.Drain()))

    def _on_offer(self, offer: agent_pb2.TaskOffer) -> None:
        try:
            task = task_from_message(offer.task)
        except ValidationError as e:  # a controller of another version, or a bug: say so instead of dying
            self.complete(offer.task.task_id, offer.task.attempt, self.name, time.time(), RunResult.failed(
                FailureClass.BUG, f"agent {self.name} cannot read the task the controller sent: "
                                  f"{e.errors()[0]['loc']}: {e.errors()[0]['msg']}"))
            with self._lock:
                request = self._requests.get(offer.request_id)
            if request is not None:
                request.answered.set()  # the slot asks again
            return
        self.offered_at[(task.task_id, task.attempt)] = offer.offered_at
        with self._lock:
            request = self._requests.get(offer.request_id)
            taken = request is not None and request.offer is None and not request.answered.is_set()
            if taken:
                self._running[(task.task_id, task.attempt)] = task
                assert request is not None  # taken says so
                request.offer = task  # under the lock: a slot giving up reads it under the same lock
        if not taken:
            # The slot gave up (draining): hand the task back as an infrastructure failure, so it runs elsewhere.
            self.complete(task.task_id, task.attempt, self.name, time.time(), RunResult.failed(
                FailureClass.INFRASTRUCTURE, f"agent {self.name} was draining when the task was offered"))
            return
        assert request is not None  # taken says so
        request.answered.set()

    # --- artifacts --------------------------------------------------------------------------
    def fetch_failure(self, task: TaskSpec, error: BaseException) -> str:
        """Why this agent could not fetch a task's model or script folder, as one paragraph: a gRPC error as its
        status and the controller's own words (its repr is a multi-line object dump with the C core's debug string)."""
        if isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call):
            why = f"the controller at {self.address} answered {error.code().name}: {error.details() or 'no details'}"
        else:
            why = str(error) or type(error).__name__
        return " ".join(f"agent {self.name} could not fetch model {task.model_sha256[:12]} (or the script folder or "
                        "dataset): "
                        f"{printable(why, limit=500)}".split())

    def local_model_path(self, task: TaskSpec) -> str:
        """The task's model in this agent's cache, fetched by sha256: a path from the wire is never opened here."""
        if self.artifact_dir is None:
            raise ValueError("this agent has no artifact cache (--work-dir) to fetch models into")
        if not is_sha256(task.model_sha256):
            raise ValueError(f"task {task.task_id}: model sha256 {task.model_sha256!r} is not a sha256")
        suffix = safe_suffix(Path(task.model_path).suffix)
        # runtimes pick the format by suffix
        return str(self._cache().get(task.model_sha256, f"{task.model_sha256}{suffix}",
                                     lambda partial: self._fetch_into(task.model_sha256, partial)))

    def local_script_archive(self, task: TaskSpec) -> Path:
        """A script task's folder, as the tar the client uploaded, in this agent's cache."""
        sha256 = task.plan.script_archive  # a sha256, checked on arrival (TaskPlan)
        if sha256 is None:
            raise ValueError(f"task {task.task_id}: a script task came without its uploaded folder (script_archive); "
                             "is the controller older than this agent?")
        if self.artifact_dir is None:
            raise ValueError("this agent has no artifact cache (--work-dir) to fetch script folders into")
        return self._cache().get(sha256, f"{sha256}.tar", lambda partial: self._fetch_into(sha256, partial))

    def with_local_dataset(self, task: TaskSpec) -> TaskSpec:
        """A dataset job's samples, fetched by sha256 into this agent's cache (once per dataset, whatever the number
        of its tasks) and handed to the driver packed, as an embedded run has them; other tasks as they came."""
        workload = task.plan.workload
        dataset = workload.dataset if isinstance(workload, BenchmarkWorkload) else None
        if dataset is None or dataset.artifact is None or dataset.packed is not None:
            return task
        if self.artifact_dir is None:
            raise ValueError("this agent has no artifact cache (--work-dir) to fetch datasets into")
        sha256 = dataset.artifact
        path = self._cache().get(sha256, f"{sha256}.npz", lambda partial: self._fetch_into(sha256, partial))
        size = path.stat().st_size
        if size > MAX_PACKED_BYTES:  # the controller checked it at submit; a cache is not trusted beyond its hash
            raise ValueError(f"task {task.task_id}: dataset {sha256[:12]} is {size} bytes, over {MAX_PACKED_BYTES}")
        packed = base64.b64encode(path.read_bytes()).decode()
        plan = replaced(task.plan, workload=replaced(workload, dataset=replaced(dataset, packed=packed)))
        return replaced(task, plan=plan)

    def _cache(self) -> ArtifactCache:
        """The one cache of this agent's slots (their fetches of one digest wait for each other)."""
        assert self.artifact_dir is not None  # the callers said why not otherwise
        with self._lock:
            if self._artifacts is None or self._artifacts.folder != self.artifact_dir:
                self._artifacts = ArtifactCache(self.artifact_dir)
            return self._artifacts

    def _fetch_into(self, sha256: str, destination: Path) -> None:
        self.fetch_artifact(sha256, destination)

    def fetch_artifact(self, sha256: str, destination: Path) -> Path:
        """Download a content-addressed artifact, check its size and hash, then move it into place (the cache
        calls it with a partial file of its own, under the digest's lock)."""
        destination.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, partial_name = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".part")
        os.close(fd)
        partial = Path(partial_name)  # this call's own: two fetches never write one file
        digest, written = hashlib.sha256(), 0
        channel = open_channel(self.address, tls=self.tls)
        try:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            with partial.open("wb") as f:
                for chunk in stub.FetchArtifact(common_pb2.ArtifactRequest(sha256=sha256),
                                                metadata=token_metadata(self.token), timeout=600):
                    if chunk.size > MAX_ARTIFACT_BYTES or written + len(chunk.data) > chunk.size or chunk.offset != written:
                        raise ValueError(f"artifact {sha256}: chunk at {chunk.offset} does not fit a {chunk.size} byte artifact")
                    digest.update(chunk.data)
                    f.write(chunk.data)
                    written += len(chunk.data)
            if digest.hexdigest() != sha256:
                raise ValueError(f"artifact {sha256}: the received bytes hash to {digest.hexdigest()}")
            os.replace(partial, destination)
        finally:
            channel.close()
            partial.unlink(missing_ok=True)
        return destination
