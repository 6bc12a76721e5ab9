"""One composition for every front end: an embedded farm, a controller server and an agent, each built
from typed settings (dataclasses) and run in this process on threads, several per process if wanted.

The CLI only maps its flags onto these settings (cli/remote.py, cli/console.py); the Python API
(farm.client.open_farm) and the tests call the same functions. Each built object owns what used to be
process-global: its controller's hooks (farm.controller.standard_hooks(), not the import-time default),
its clock (when leases, heartbeats and deadlines expire: tests pass one they move), its store. Nothing here
touches signals or the consoles: a front end that wants Ctrl+C wires it to `drain()`/`stop()` itself.

Why here, in client/: the layering tests (tests/test_import_direction.py) rank client (5) above agents and
controller (4) and below web (6) and cli (7). Composing means importing the controller and the agents, so it
cannot sit lower; the CLI and the Python API must import it, so it cannot sit higher (a `farm.compose`
module would rank with the `farm` package, 8, above the CLI). The dashboard is web's, above client: its
composition is farm.web.compose, which takes a ControllerServer built here.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Sequence

from farm.client.errors import EXIT_ENVIRONMENT, FarmError
from farm.proto.task_limits import DEFAULT_MAX_TASKS

if TYPE_CHECKING:
    from farm.agents.agent import Agent
    from farm.agents.link.remote_controller import RemoteController
    from farm.client.embedded import EmbeddedFarm
    from farm.controller.auth import BudgetSettings, TlsFiles, TokenTable
    from farm.controller.grpc_server import FarmServer, RunningServer
    from farm.controller.scheduling.hooks import Hooks
    from farm.controller.store import Store

Clock = Callable[[], float]


class _Started(ABC):
    """start()/stop() as a context manager; each built object says how it starts and stops."""

    @abstractmethod
    def start(self) -> Any: ...

    @abstractmethod
    def stop(self) -> None: ...

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


# --- embedded ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbeddedSettings:
    """A farm over a local store that runs jobs in this process (`farm submit` without a controller)."""

    db: Path | str | None = None  # a file or postgresql:// URL; None: $FARM_DB, else the user data folder
    slots: int = 1
    backend: str | None = None
    lab: Callable[[], list[Any]] | None = None  # the lab's devices, read on first use
    devices_file: Path | str | None = None
    health_check_max_age_h: float | None = None
    create: bool = False
    read_only: bool = False


def build_embedded(settings: EmbeddedSettings) -> EmbeddedFarm:
    """The embedded farm, its store open (a Farm is a context manager: leaving it closes the store)."""
    from farm.client.embedded import EmbeddedFarm

    return EmbeddedFarm(settings.db, slots=settings.slots, backend=settings.backend, lab=settings.lab,
                        devices_file=settings.devices_file, health_check_max_age_h=settings.health_check_max_age_h,
                        create=settings.create, read_only=settings.read_only)


# --- controller --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ControllerSettings:
    """`farm controller serve`'s flags, as one value."""

    db: Path | str | None = None
    listen: str = "127.0.0.1:0"
    create: bool = False
    tokens: Path | None = None  # the tokens file; None needs no_auth
    no_auth: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    lease_ttl_s: float = 30.0
    heartbeat_interval_s: float | None = None
    metrics_listen: str | None = None
    max_streams: int | None = None
    max_watches: int | None = None
    reflection: bool = False
    refresh_cron: str | None = None
    refresh_suite: Path | None = None
    refresh_include_contended: bool = False  # the nightly fits contended sim runs too
    models_roots: Sequence[Path] = ()
    max_model_bytes: int | None = None
    scripts_need_permission: bool = False
    budget: BudgetSettings | None = None
    job_sharing: str = "shared"
    upload_quota: int | None = None  # None: the default quota (controller/grpc_server.py)
    max_tasks: int = DEFAULT_MAX_TASKS


class ControllerServer(_Started):
    """A gRPC controller on its own threads and asyncio loop; `address` is 127.0.0.1:PORT once started."""

    def __init__(self, settings: ControllerSettings, *, clock: Clock = time.time) -> None:
        from farm.controller.auth import TlsFiles, TokenFileError, TokenTable, check_tokens_file, is_loopback

        if settings.tokens is None and not settings.no_auth:
            raise FarmError("the controller needs a tokens file (--tokens PATH or FARM_TOKENS) with lines like "
                            "`client <token>` and `agent <token> <agent-name>`; --no-auth serves without (loopback only)")
        if settings.no_auth and not is_loopback(settings.listen):
            raise FarmError(f"--no-auth is only allowed on a loopback address (127.0.0.1, ::1, localhost), not "
                            f"{settings.listen}")
        for root in settings.models_roots:
            if not root.is_absolute() or not root.is_dir():
                raise FarmError(f"--models-root {root}: give an absolute path to an existing folder")
        try:
            if settings.tokens is not None:
                check_tokens_file(settings.tokens)
            self.tokens: TokenTable | None = TokenTable.from_file(settings.tokens) if settings.tokens else None
        except TokenFileError as e:
            raise FarmError(str(e)) from None
        self.tls: TlsFiles | None = None
        if settings.tls_cert or settings.tls_key:
            self.tls = TlsFiles(ca=settings.tls_client_ca, cert=settings.tls_cert, key=settings.tls_key)
        self.settings = settings
        self.clock = clock
        from farm.controller import standard_hooks
        self.hooks: Hooks = standard_hooks()  # this controller's own: another in this process never calls them
        self.store: Store | None = None
        self.running: RunningServer | None = None

    @property
    def farm(self) -> FarmServer:
        if self.running is None:
            raise RuntimeError("the controller is not started")
        return self.running.farm

    @property
    def port(self) -> int:
        return self.running.port if self.running else 0

    @property
    def address(self) -> str:
        host = self.settings.listen.rsplit(":", 1)[0] or "127.0.0.1"
        return f"{host}:{self.port}"

    def start(self) -> ControllerServer:
        from farm.controller.auth import TokenFileError
        from farm.controller.grpc_server import DEFAULT_MAX_STREAMS, DEFAULT_MAX_WATCHES, DEFAULT_UPLOAD_QUOTA, serve
        from farm.controller.operations.metrics import MetricsListenError
        from farm.controller.store import DB_ENV, StoreError, db_location, open_store

        s = self.settings
        try:
            # the user data folder is farm's own to make; a path someone typed is made only with create
            self.store = open_store(db_location(str(s.db) if s.db else None),
                                    create_folder=s.create or not (s.db or os.environ.get(DB_ENV)))
        except StoreError as e:
            raise FarmError(str(e)) from None
        try:
            self.running = serve(
                self.store, s.listen, tokens=self.tokens, tls=self.tls, lease_ttl_s=s.lease_ttl_s,
                heartbeat_interval_s=s.heartbeat_interval_s, metrics_listen=s.metrics_listen,
                max_streams=s.max_streams or DEFAULT_MAX_STREAMS, max_watches=s.max_watches or DEFAULT_MAX_WATCHES,
                reflection_on=s.reflection, refresh_cron=s.refresh_cron, refresh_suite=s.refresh_suite,
                refresh_include_contended=s.refresh_include_contended,
                models_roots=list(s.models_roots), max_model_bytes=s.max_model_bytes,
                scripts_need_permission=s.scripts_need_permission, budget=s.budget, job_sharing=s.job_sharing,
                upload_quota=s.upload_quota if s.upload_quota is not None else DEFAULT_UPLOAD_QUOTA,
                clock=self.clock, hooks=self.hooks)
        except BaseException as e:
            self.store.close()
            self.store = None
            if isinstance(e, TokenFileError):  # a TLS certificate that expired or is no certificate
                raise FarmError(str(e)) from None
            if isinstance(e, MetricsListenError):
                raise FarmError(str(e), EXIT_ENVIRONMENT) from None
            if isinstance(e, ValueError):  # a --metrics-listen that is not HOST:PORT, a bad timeout
                raise FarmError(str(e)) from None
            if isinstance(e, (OSError, RuntimeError)):
                raise FarmError(f"cannot listen on {s.listen}: {e}", EXIT_ENVIRONMENT) from None
            raise
        self.running.farm.max_tasks = s.max_tasks
        return self

    def stop(self) -> None:
        """Agents keep their tasks and reconnect to the next controller; the store closes."""
        if self.running is not None:
            self.running.stop()
            self.running = None
        if self.store is not None:
            self.store.close()
            self.store = None


def build_controller(settings: ControllerSettings, *, clock: Clock = time.time) -> ControllerServer:
    """Checked now (tokens file, --no-auth off loopback, models roots); serving starts at start()."""
    return ControllerServer(settings, clock=clock)


# --- agent -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentSettings:
    """`farm agent`'s flags, as one value (the token already read: from a file, the environment or a flag)."""

    controller: str  # HOST:PORT, or several comma-separated sharing one PostgreSQL
    name: str
    token: str | None = None
    work_dir: Path | None = None  # default ~/.cache/farm/agent/NAME
    sim_slots: int = 1
    tags: Sequence[str] = ()
    backend: str | None = None
    devices: Path | None = None  # the lab's device list; None: $FARM_DEVICES
    run_as: str | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    insecure_plaintext: bool = False
    allow_build_network: bool = False
    allow_build_base: Sequence[str] | None = None
    drain_timeout_s: float = 30.0
    on_device_note: Callable[[str], None] | None = field(default=None, compare=False)  # e.g. an untyped lab entry


class AgentRunner(_Started):
    """An agent whose slots lease from the controller on a thread of this process.

    stop() drains (no new leases; running tasks finish and report), waits for the acknowledgements and
    closes the stream; stop_runs() also stops the running sandboxes (recorded as canceled). `clock` says when a
    heartbeat is due (monotonic seconds): a test that holds it still makes an agent that stops renewing its leases
    while its stream stays open, one that moves it makes the next heartbeat due at once."""

    def __init__(self, settings: AgentSettings, *, clock: Clock = time.monotonic) -> None:
        from farm.agents.agent import split_cores
        from farm.agents.lab import LabConfigError, discover_types, lab_from_environment, load_lab
        from farm.agents.sandbox.isolation import RunUserError, resolve_run_as, run_uid_range
        from farm.client.config import checked_addresses
        from farm.controller.auth import TlsFiles, is_loopback, valid_agent_name

        if not settings.controller:
            raise FarmError("`farm agent` needs --controller HOST:PORT (or FARM_CONTROLLER)")
        self.addresses = checked_addresses(settings.controller)
        if not valid_agent_name(settings.name):
            raise FarmError(f"--name {settings.name!r}: use letters, digits, '.', '_' and '-' (at most 64)")
        try:
            self.lab = load_lab(settings.devices) if settings.devices else lab_from_environment()
        except LabConfigError as e:
            raise FarmError(str(e)) from None
        for problem in discover_types(self.lab):  # untyped entries get the type their facts match
            if settings.on_device_note:
                settings.on_device_note(f"device {problem}")
        try:
            self.run_as = resolve_run_as(settings.run_as)
            self.uids = run_uid_range() if self.run_as is not None else None  # each run's own uid, FARM_RUN_UIDS
        except RunUserError as e:
            raise FarmError(str(e)) from None
        try:
            if isinstance(settings.sim_slots, bool) or not isinstance(settings.sim_slots, int) or settings.sim_slots < 1:
                raise ValueError("give a whole number, at least 1")  # 0 slots would lease nothing, silently
            split_cores(settings.sim_slots)
        except ValueError as e:
            raise FarmError(f"--sim-slots {settings.sim_slots}: {e}; each sim slot gets cores of its own.") from None
        self.tls = TlsFiles(ca=settings.tls_ca, cert=settings.tls_cert, key=settings.tls_key) if settings.tls_ca else None
        remote = [a for a in self.addresses if not is_loopback(a)]
        if self.tls is None and remote and not settings.insecure_plaintext:  # issue 33: a token only over TLS
            raise FarmError(f"--controller {remote[0]}: without --tls-ca the agent would send its token, and every "
                            "task and result, in clear to a controller not on this host; give --tls-ca CA.pem (the CA "
                            "that signed the controller's certificate), or --insecure-plaintext on a network you "
                            "trust alone")
        # absolute: the harness runs in its run directory, so a relative path would point nowhere
        self.work_dir = Path(settings.work_dir or Path.home() / ".cache" / "farm" / "agent" / settings.name).absolute()
        self.settings = settings
        self.clock = clock
        self.client: RemoteController | None = None
        self.agent: Agent | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> AgentRunner:
        import json

        from farm.agents.agent import Agent
        from farm.agents.environment import host_facts
        from farm.agents.link.remote_controller import AgentDevice, RemoteController
        from farm.agents.sandbox.docker_build import BuildPolicy
        from farm.agents.sim.driver import SimDriver

        s = self.settings
        self.work_dir.mkdir(mode=0o711, parents=True, exist_ok=True)  # runs pass through to their own folder
        devices = [AgentDevice(name=f"{s.name}/sim", driver="sim", device_type="sim", tags=list(s.tags),
                              facts_json=json.dumps(host_facts()), slots=s.sim_slots)]
        # the lab's phones and boards: jobs name them (or their type or tags), the controller resolves them
        devices += [AgentDevice(name=d.name, driver=d.entry.driver, device_type=d.device_type.name if d.device_type else "",
                               tags=d.tags) for d in self.lab]
        self.client = RemoteController(self.addresses, name=s.name, token=s.token, devices=devices, tls=self.tls,
                                       artifact_dir=self.work_dir / "artifacts", clock=self.clock)
        driver = SimDriver(self.work_dir, backend_override=s.backend, run_as=self.run_as,
                           build_policy=BuildPolicy.lab(s.allow_build_network,
                                                       list(s.allow_build_base) if s.allow_build_base else None))
        self.agent = Agent(self.client, driver, name=s.name, slots=s.sim_slots, devices=self.lab)
        self.client.start()
        self._thread = threading.Thread(target=self._run, name=f"agent-{s.name}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        assert self.agent is not None
        try:
            self.agent.run_job(None)  # each slot leases until draining
        except BaseException as e:  # said by finish(), on the caller's thread
            self._error = e

    def drain(self) -> None:
        """No new leases; the running tasks finish and report."""
        if self.client is not None:
            self.client.drain()

    def stop_runs(self) -> None:
        """Stop the running sandboxes too (their tasks are recorded as canceled)."""
        if self.agent is not None:
            self.agent.stop()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until every slot has stopped leasing (after drain(), or a controller that refused this agent)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def finish(self) -> bool:
        """After wait(): the acknowledgements awaited (drain_timeout_s), the stream closed. True when every result
        was acknowledged; a controller's refusal (a bad token, another protocol) raises FarmError."""
        client = self.client
        if client is None:
            return True
        self.client = None
        if client.fatal is not None:
            client.close()
            raise FarmError(str(client.fatal))
        delivered = client.wait_for_acks(self.settings.drain_timeout_s)
        client.close()
        if self._error is not None:
            raise self._error
        return delivered

    def stop(self) -> None:
        self.drain()
        self.wait()
        try:
            self.finish()
        except FarmError:
            pass  # a refused agent has nothing left to stop


def build_agent(settings: AgentSettings, *, clock: Clock = time.monotonic) -> AgentRunner:
    """Checked now (address, name, lab file, run-as user, slots, TLS off this host); it dials at start().
    `clock`: when its heartbeats are due (the controller's clock judges the leases they renew)."""
    return AgentRunner(settings, clock=clock)

