"""AgentService: one agent's bidirectional stream (Connect) on the server's loop, and the artifacts an agent
fetches (FetchArtifact).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
from concurrent import futures
from typing import AsyncIterator, Iterator

import grpc

from farm.version import __version__
from farm.controller.scheduling.artifacts import ArtifactError
from farm.controller.async_calls import next_request
from farm.controller.auth import Identity, identity_of, peer_address
from farm.controller.scheduling.sessions import AgentSession, DeviceTaken
from farm.controller.store import StoreError
from farm.proto.batching import BATCH_CAPABILITY, MAX_BATCH_MESSAGES, gathered
from farm.proto.escape import bounded_message, printable
from farm.proto.names import valid_agent_name
from farm.proto.generated import agent_pb2, agent_pb2_grpc, common_pb2
from farm.controller.rpc.limits import (
    ACK_HOLD_S, ARTIFACT_CHUNK_BYTES, MAX_ARTIFACT_BYTES, MAX_DEVICES_PER_AGENT, PROTOCOL_VERSION,
    task_ref,
)
from farm.controller.rpc.farm_server import FarmServer

log = logging.getLogger("farm.controller")


_EMPTY = object()  # nothing came within the wait


class _Outbox:
    """A session's outbox, read on the server's loop: whoever queues a message (the dispatcher, the result
    writer, a handler thread) wakes the reader through the loop, so a waiting stream holds no thread. Wake-ups
    queued while one is already on its way to the loop are folded into it (each is a callback and a write to
    the loop's self-pipe): the message is queued before the wake, and the reader drains the whole outbox."""

    def __init__(self, session: AgentSession, loop: asyncio.AbstractEventLoop) -> None:
        self.session, self.loop = session, loop
        self.ready = asyncio.Event()
        self._waking = False  # a wake-up is queued on the loop and has not run yet
        session.wake = self._wake

    def _wake(self) -> None:
        if self._waking:
            return  # the queued wake-up runs after this message was queued: it is seen
        self._waking = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
            self.loop.call_soon_threadsafe(self._woken)

    def _woken(self) -> None:
        self._waking = False  # before set(): a message queued from here on wakes again
        self.ready.set()

    async def get(self, timeout_s: float | None = None) -> agent_pb2.ControllerMessage | None | object:
        """The next message (None: the stream ends), or _EMPTY when `timeout_s` passed first."""
        while True:
            with contextlib.suppress(queue.Empty):
                return self.session.outbox.get_nowait()
            self.ready.clear()  # a wake-up queued before this runs after it: none is lost
            if not self.session.outbox.empty():
                continue
            if timeout_s is None:  # no timer: wait_for would wrap the wait in a Task and a timer
                await self.ready.wait()
                continue
            try:
                async with asyncio.timeout(timeout_s):  # a timer on this task; wait_for adds a Task per wait
                    await self.ready.wait()
            except TimeoutError:
                return _EMPTY


class _IdleWatch:
    """The --agent-idle-timeout of one stream's reader, without a timer per message: one timer per stream, moved
    on when it fires, cancels the reader when it has waited for the next message for `idle_s`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_s: float) -> None:
        self.loop, self.idle_s = loop, idle_s
        self.reader = asyncio.current_task()
        self.waiting_since: float | None = None  # when the reader began to wait for a message; None: not waiting
        self.fired = False
        self._timer = loop.call_later(idle_s, self._check)

    def _check(self) -> None:
        due = self.loop.time() + self.idle_s if self.waiting_since is None else self.waiting_since + self.idle_s
        if due <= self.loop.time() and self.reader is not None:
            self.fired = True
            self.reader.cancel()
            return
        self._timer = self.loop.call_at(due, self._check)

    def stop(self) -> None:
        self._timer.cancel()


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
        session, released = await self._open(hello, context)
        log.info("agent %s connected from %s (farm %s, host %s, %d device(s))", hello.agent_name, context.peer(),
                 printable(hello.farm_version), printable(hello.hostname), len(hello.devices))
        outbox = _Outbox(session, loop)
        reader = asyncio.create_task(self._read(session, request_iterator), name=f"agent-{session.name}")
        cut: str | None = None
        try:
            yield agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(
                session_id=session.session_id, controller_version=__version__, protocol_version=PROTOCOL_VERSION,
                lease_ttl_s=self.server.controller.lease_ttl_s, heartbeat_interval_s=self.server.heartbeat_interval_s,
                released=[task_ref(t, a) for t, a in released], capabilities=[BATCH_CAPABILITY]))
            batches = BATCH_CAPABILITY in hello.capabilities  # an older agent reads one message at a time
            while True:
                message = await outbox.get()
                if message is None:
                    break
                assert isinstance(message, agent_pb2.ControllerMessage)
                if not batches:
                    yield message
                    continue
                write, ending = await self._batch(outbox, session, message)
                yield write
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

    async def _open(self, hello: agent_pb2.Hello,
                    context: grpc.aio.ServicerContext) -> tuple[AgentSession, list[tuple[int, int]]]:
        """The agent's session and the leases it released, or the stream aborted (a device another agent holds,
        the lab's store out of reach)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self.server.open_session, hello,
                                                                    context.peer())
        except DeviceTaken as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, bounded_message(str(e)))
        except Exception as e:
            if not self.server.controller.outage.failed(e, f"registering agent {printable(hello.agent_name)}"):
                raise
            # the agent dials again (this controller or the next of its list) and resends what it keeps
            await context.abort(grpc.StatusCode.UNAVAILABLE, bounded_message(self.server.controller.outage.message(e)))
        raise AssertionError("not reached: abort() raised")

    async def _batch(self, outbox: _Outbox, session: AgentSession,
                     message: agent_pb2.ControllerMessage) -> tuple[agent_pb2.ControllerMessage, bool]:
        """`message` with what is queued behind it, as one write to an agent that reads batches, and whether the
        stream ends after it."""
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
        batch = agent_pb2.ControllerMessage(batch=agent_pb2.ControllerBatch(messages=parts)) if len(parts) > 1 \
            else parts[0]
        return batch, ending

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
        watch = _IdleWatch(loop, idle_s)
        try:
            while True:
                watch.waiting_since = loop.time()
                message = await next_request(request_iterator)
                watch.waiting_since = None
                if message is None or session.closed.is_set():
                    break
                # one at a time, in order: a result before the work request that rides behind it
                await loop.run_in_executor(self.pool, self.server.on_agent_message, session, message)
        except grpc.RpcError:
            pass  # the agent went away; its leases run out unless it comes back
        except asyncio.CancelledError:
            if watch.fired:
                log.warning("agent %s sent nothing for %g s; its stream is cut (--agent-idle-timeout)",
                            session.name, idle_s)
                return (f"agent {session.name!r} sent nothing for {idle_s:g} s (not even a heartbeat); its stream "
                        "was cut (--agent-idle-timeout). Connect again.")
            # else the stream's writer ended first (the session closed, or the call was cut)
        except Exception:
            log.exception("agent %s: handling a message failed", session.name)
        finally:
            watch.stop()
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
