"""Who is connected: one session per agent stream, and which agent owns each device name.

A reconnecting agent takes over its own session; a device name stays the agent's that registered
it first until an admin frees it. The agents and devices tables mirror this for `farm devices`
and for a restarted controller, and are shared by several controllers on one PostgreSQL: each
keeps its own agents' last_seen fresh (keep_alive), so none marks another's agents offline.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from farm.controller.scheduling.controller import Controller
from farm.controller.store import Store
from farm.controller.store.presence import Presence, Seen
from farm.proto.escape import printable
from farm.proto.generated import agent_pb2

log = logging.getLogger("farm.controller")


class DeviceTaken(Exception):
    """A hello names a device another agent registered; the message says whose and how to free it."""


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
    # SimpleQueue: put and get_nowait in C, without queue.Queue's Condition (the stream takes ~7 a task)
    outbox: "queue.SimpleQueue[agent_pb2.ControllerMessage | None]" = field(default_factory=queue.SimpleQueue)
    requests: dict[int, frozenset[str]] = field(default_factory=dict)  # idle slots: request id -> targets
    targets: frozenset[str] = frozenset()  # what its slots may ask for: "sim" and the devices of its hello
    running: set[tuple[int, int]] = field(default_factory=set)
    closed: threading.Event = field(default_factory=threading.Event)
    taken_over_by: str | None = None  # peer of the newer connection under the same name
    wake: Callable[[], None] | None = None  # tells the stream's writer (on the server's loop) the outbox has more

    def send(self, message: agent_pb2.ControllerMessage) -> None:
        if not self.closed.is_set():
            self.outbox.put(message)
            self._wake()

    def close(self) -> None:
        self.closed.set()
        self.outbox.put(None)  # wakes the response generator so the stream ends
        self._wake()

    def _wake(self) -> None:
        wake = self.wake
        if wake is not None:
            wake()


class Sessions:
    """The connected agents by name and the device-name index; `lock` guards both (and the sessions' slots)."""

    def __init__(self, store: Store, controller: Controller) -> None:
        self.store = store
        self.controller = controller
        self.by_name: dict[str, AgentSession] = {}
        self.lock = threading.RLock()
        # Which agent registered each device (online or not): a name stays its agent's until an admin frees it.
        self.device_owner: dict[str, str] = store.devices.owners()
        self._kept_alive_at = 0.0
        # the lab's view of its agents, shared with the other controllers on this store (store/presence.py)
        self.presence: Presence | None = None
        self.address = f"{socket.gethostname()}:{os.getpid()}"  # the server sets its HOST:PORT once bound

    def open(self, hello: agent_pb2.Hello, peer: str) -> tuple[AgentSession, list[tuple[int, int]]]:
        """Register a (re)connecting agent; it takes over its own stale session.

        Returns the session and the leases held for this agent that it no longer runs
        (offered while the stream was breaking): those go straight back to the queue.
        A hello renews no lease: the agent's first heartbeat, sent right after it, renews what still
        runs, while a task whose result cannot be delivered is left to run out its lease.
        """
        session = AgentSession(name=hello.agent_name, session_id=uuid.uuid4().hex, peer=peer, hello=hello,
                               targets=frozenset({"sim", *(d.name for d in hello.devices)}))
        still_running = {(r.task_id, r.attempt) for r in hello.running}
        # The store, not this process's index, says who owns a device: another controller on the same database
        # may have registered (or an admin freed) it since this one started. One query for the hello's devices.
        stored = self.store.devices.owners([d.name for d in hello.devices]) if hello.devices else {}
        with self.lock:
            for device in hello.devices:  # a dict lookup each: registration is linear in the number of devices
                holder = stored.get(device.name)
                if holder is None:
                    self.device_owner.pop(device.name, None)  # freed through another controller
                else:
                    self.device_owner[device.name] = holder
                if holder is not None and holder != hello.agent_name:
                    state = "online" if holder in self.by_name else "offline"
                    raise DeviceTaken(
                        f"device {device.name!r} belongs to agent {holder!r} ({state}), which registered it first. "
                        "One device, one agent: remove it from one of the two device lists; if it has moved, an "
                        f"admin frees the name with `farm device forget {device.name} --controller HOST:PORT`.")
            old = self.by_name.get(hello.agent_name)
            if old is not None:
                log.info("agent %s reconnected from %s; its old session %s is closed", hello.agent_name, peer, old.session_id)
                old.taken_over_by = peer
                old.close()
            self.by_name[hello.agent_name] = session
            held = self.store.leases.running_attempts(agent=hello.agent_name)
            released = []
            for row in held:
                if (row.id, row.attempts) in still_running:
                    session.running.add((row.id, row.attempts))
                else:
                    released.append(row)
            if released:
                self.controller.lose_attempts(released, "released: agent {agent} reconnected without it")
            self.record(session, "online")
            self.publish([session], complete=False)
        return session, [(r.id, r.attempts) for r in released]

    def close(self, session: AgentSession) -> None:
        session.close()
        with self.lock:
            if self.by_name.get(session.name) is session:
                del self.by_name[session.name]
                self.record(session, "offline")
                if self.presence is not None:
                    self.presence.withdraw(self.address, session.name)
        log.info("agent %s disconnected (session %s)", session.name, session.session_id)

    def record(self, session: AgentSession, state: str) -> None:
        """Store the agent and its devices in `state` (online, draining, offline)."""
        hello, now = session.hello, time.time()
        self.store.devices.record_agent({
            "name": session.name, "session_id": session.session_id, "state": state,
            "farm_version": hello.farm_version, "capabilities_json": json.dumps(list(hello.capabilities)),
            "hostname": hello.hostname, "peer": session.peer, "connected_at": session.connected_at, "last_seen": now,
        }, [(d.name, session.name, d.driver, d.device_type, json.dumps(list(d.tags)), d.facts_json or "{}", d.slots,
             state, now) for d in hello.devices])
        with self.lock:
            self.device_owner.update((d.name, session.name) for d in hello.devices)

    def keep_alive(self, lease_ttl_s: float) -> None:
        """Every quarter TTL: the agents connected here are seen now, and those another (dead) controller held
        that no controller has seen for a TTL are offline. A starting controller leaves fresh ones alone."""
        now = time.time()
        if now - self._kept_alive_at < lease_ttl_s / 4:
            return
        self._kept_alive_at = now
        with self.lock:
            names = sorted(self.by_name)
            sessions = list(self.by_name.values())
        self.store.devices.keep_alive(names, now, now - lease_ttl_s)
        self.publish(sessions, complete=True)

    def publish(self, sessions: list[AgentSession], *, complete: bool) -> None:
        """Tell the lab (the store) which agents are on this controller, their last word and busy slots."""
        if self.presence is not None:
            self.presence.publish(self.address, [
                Seen(s.name, self.address, s.state, s.last_seen, s.connected_at, len(s.running),
                     len(s.running) + len(s.requests)) for s in sessions], complete=complete)  # idle slots ask for work

    def current(self, session: AgentSession) -> bool:
        """Whether `session` is still its agent's (not taken over by a reconnect)."""
        return self.by_name.get(session.name) is session

    def forget_device(self, name: str) -> str:
        """An admin frees a device name its agent registered; returns that agent. Raises LookupError
        when no agent registered it, ValueError while its agent is connected."""
        with self.lock:
            owner = self.device_owner.get(name)
            if owner is None:
                raise LookupError(f"no agent has registered a device named {printable(name)!r}; `farm devices` lists them")
            if owner in self.by_name:
                raise ValueError(f"device {name!r} belongs to agent {owner!r}, which is connected: remove the device "
                                 f"from that agent's device list and restart it, or stop the agent, then forget it")
            self.store.devices.forget(name)
            del self.device_owner[name]
        log.info("device %s forgotten: it no longer belongs to agent %s", name, owner)
        return owner


__all__ = ["AgentSession", "DeviceTaken", "Sessions"]
