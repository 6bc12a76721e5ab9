"""The controller behind gRPC: the same Controller, with agents and clients on the wire.

Each agent holds one bidirectional stream (AgentService.Connect), a coroutine on the server's asyncio
loop (async_calls.py): a waiting stream holds no thread. An idle agent slot sends a WorkRequest; one
dispatcher thread (dispatch.py) matches waiting requests to pending tasks, one writer thread
(result_writer.py) applies results in batches, acknowledging each after its commit, and one renewer
thread (lease_renewer.py) renews the leases heartbeats name, many per transaction; sessions.py keeps
who is connected. The servicers live in controller/rpc/ by role (agent_service.py: the agent stream;
farm_service.py: FarmService, composed of jobs.py, artifacts.py, questions.py and admin.py; farm_server.py: what
they call); this module composes them into one server and starts it. Leases are renewed by the
agent's heartbeats; when a stream breaks nothing is dropped at once: the agent may be back
in a moment (it takes over its own session), and if it is not, the lease runs out and the
task goes back to the queue with attempt + 1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from concurrent import futures
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from farm.controller.store.presence import Presence
from farm.controller.store.leader import LabDuties, SweepLeader
from farm.controller.async_calls import CallGate, ServerLoop
from farm.controller.auth import (
    BudgetSettings, CallBudget, TlsFiles, TokenGuard, TokenTable, check_server_certificate,
    is_loopback, server_credentials,
)
from farm.controller.operations.metrics import MetricsServer, parse_listen, serve_metrics
from farm.controller.store import Store
from farm.proto.generated import agent_pb2_grpc, farm_pb2_grpc
from farm.controller.scheduling.sessions import AgentSession
from farm.controller.rpc.limits import (
    AGENT_MESSAGE_THREADS, AGENT_SERVICE, DEFAULT_MAX_STREAMS, DEFAULT_MAX_WATCHES, DEFAULT_UPLOAD_QUOTA, FARM_SERVICE,
    MAX_JOB_FILE_BYTES, MAX_MESSAGE_BYTES, PROTOCOL_VERSION,
)
from farm.controller.rpc.agent_service import AgentServicer
from farm.controller.rpc.farm_server import FarmServer, controller_files
from farm.controller.rpc.farm_service import FarmServicer

# What callers import from here: the server, its servicers and its limits (the servicers' modules are the roles').
__all__ = ["AGENT_MESSAGE_THREADS", "DEFAULT_MAX_STREAMS", "DEFAULT_MAX_WATCHES", "DEFAULT_UPLOAD_QUOTA",
           "MAX_JOB_FILE_BYTES", "PROTOCOL_VERSION", "AgentServicer", "AgentSession", "FarmServer", "FarmServicer",
           "RunningServer", "controller_files", "serve", "startup_warnings"]

log = logging.getLogger("farm.controller")


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


# The server's channel options: messages up to MAX_MESSAGE_BYTES, and a dead agent's half-open TCP connection
# noticed within a minute.
GRPC_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1)]


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
    # Agent streams wait on the loop; a short call or a watcher runs on a thread while it runs (threads start
    # only when used), and calls over max_streams are refused (RESOURCE_EXHAUSTED) rather than left queued.
    calls = futures.ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="rpc")
    agent_messages = futures.ThreadPoolExecutor(max_workers=AGENT_MESSAGE_THREADS, thread_name_prefix="agent-msg")
    health_servicer = health.HealthServicer()
    loop = ServerLoop()
    try:
        server, port = loop.call(partial(_grpc_server, farm, listen, tls, call_budget, max_streams, reflection_on,
                                         calls, agent_messages, health_servicer))
    except BaseException:
        loop.close()
        raise
    if port == 0:
        loop.close()
        raise OSError(f"cannot listen on {listen}: the address is in use or not local")
    # Bound before anything starts, so a busy metrics port fails the start instead of half-serving.
    metrics = serve_metrics(store, metrics_listen) if metrics_listen else None
    nightly = _nightly(farm, listen, refresh_cron, refresh_suite, refresh_include_contended) if refresh_cron else None
    farm.refresh_suite = refresh_suite  # `farm refresh` against this controller submits the nightly's suite
    farm.nightly = nightly
    _join_lab(farm, listen, port)
    farm.start()
    loop.run(server.start())
    if nightly:
        nightly.start()
    for service in ("", FARM_SERVICE, AGENT_SERVICE):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, loop, farm, port, health_servicer, metrics, nightly, (calls, agent_messages))


def _grpc_server(farm: FarmServer, listen: str, tls: TlsFiles | None, call_budget: CallBudget | None,
                 max_streams: int, reflection_on: bool, calls: futures.ThreadPoolExecutor,
                 agent_messages: futures.ThreadPoolExecutor,
                 health_servicer: health.HealthServicer) -> tuple[grpc.aio.Server, int]:
    """The server with its servicers, bound to `listen` (port 0: it could not be); run on the loop's thread, as
    the server belongs to its loop."""
    tokens = farm.tokens

    def store_away(error: BaseException) -> str | None:  # a call that met the store out of reach: UNAVAILABLE
        return farm.controller.outage.message(error) if farm.controller.outage.failed(error, "answering a call") \
            else None

    gate = CallGate(calls, TokenGuard(tokens, call_budget) if tokens else None, unavailable=store_away)
    server = grpc.aio.server(interceptors=[gate], options=GRPC_OPTIONS, maximum_concurrent_rpcs=max_streams)
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


def _nightly(farm: FarmServer, listen: str, refresh_cron: str, refresh_suite: Path | None,
             include_contended: bool) -> Any:
    """The nightly reference-suite refresh (--refresh-cron), not started yet."""
    from farm.controller.operations.alerts import alerts_from_environment
    from farm.controller.operations.nightly import Cron, NightlyRefresh
    hook = alerts_from_environment()
    store = farm.store
    return NightlyRefresh(store, refresh_suite, Cron.parse(refresh_cron),  # None: the suite farm ships
                          farm.device_targets, alert=hook.send_async if hook else None,
                          artifacts=farm.files.store, duties=LabDuties(store), holder=f"{listen}/{os.getpid()}",
                          include_contended=include_contended)


def _join_lab(farm: FarmServer, listen: str, port: int) -> None:
    """This controller's address among those sharing the store, its agents' presence, and its bid for the sweeps."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    farm.agents.address = f"{socket.gethostname() if host in ('', '0.0.0.0', '::') else host}:{port}"
    farm.agents.presence = Presence(farm.store)  # which controller each agent is on, for every controller's pages
    # lease expiry and job deadlines on one controller of those sharing the store: the holder of the sweeps' lease
    farm.controller.sweeps = SweepLeader(LabDuties(farm.store), f"{farm.agents.address}/{os.getpid()}",
                                         farm.controller.lease_ttl_s, clock=farm.controller.clock)
