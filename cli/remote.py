"""`farm controller serve`, `farm agent`, `farm devices` and `farm agents`, and the --controller options
every command shares. Which farm a command talks to is farm.client.config's rule; the client side
of every command is farm.client.remote."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.proto.names import BACKEND_CHOICES
from farm.client.errors import EXIT_ENVIRONMENT, EXIT_OK, FarmError
from farm.client.config import DEFAULT_PORT, Credentials, address_of, checked_addresses, read_config, setting
from farm.proto.task_limits import DEFAULT_MAX_TASKS

if TYPE_CHECKING:
    from farm.controller.auth import TlsFiles

# The sandboxes fork; gRPC's fork handlers are not needed (children exec at once) and only log noise.
# grpc itself is imported only by the commands that talk to a controller: embedded mode starts faster.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

RemoteError = FarmError  # a refusal or an unreachable controller, said so a person can act on it


def controller_address(args: argparse.Namespace) -> str | None:
    return address_of(getattr(args, "controller", None))


def client_tls(args: argparse.Namespace) -> TlsFiles | None:
    from farm.controller.auth import TlsFiles

    c = Credentials.resolve(None, getattr(args, "tls_ca", None), getattr(args, "tls_cert", None),
                            getattr(args, "tls_key", None))
    return TlsFiles(ca=c.tls_ca, cert=c.tls_cert, key=c.tls_key) if c.tls_ca else None


def add_client_options(parser: argparse.ArgumentParser) -> None:
    """--controller and its credentials, for every command that can talk to a controller."""
    g = parser.add_argument_group("remote controller")
    g.add_argument("--controller", metavar="HOST:PORT", default=None,
                   help="talk to this controller (default: $FARM_CONTROLLER, the config file, else embedded)")
    g.add_argument("--token", default=None, help="client token (default: $FARM_TOKEN)")
    g.add_argument("--tls-ca", default=None, help="CA certificate that signed the controller's (enables TLS)")
    g.add_argument("--tls-cert", default=None, help="client certificate, for mutual TLS")
    g.add_argument("--tls-key", default=None, help="client key, for mutual TLS")


# --- devices and agents ------------------------------------------------------------------------
def cmd_devices(args: argparse.Namespace) -> int:
    """The controller's agents' devices; embedded, the lab's device list with health, last check, calibration age."""
    from rich.table import Table
    from rich.text import Text

    from farm.cli.console import open_farm, out, when
    from farm.cli.render import to_json
    from farm.proto.escape import printable

    farm = open_farm(args)
    rows = farm.devices()
    if args.json:
        print(to_json(rows))
        return EXIT_OK
    t = Table(header_style="bold")
    if farm.embedded:
        for c in ("device", "type", "driver", "units", "tags", "health", "last check", "calibration age", "reason"):
            t.add_column(c)
        for r in rows:
            age = r.calibration_age_s
            t.add_row(Text(r.name), r.device_type or "—", r.driver, ",".join(r.units), ",".join(r.tags), r.health,
                      when(r.last_check), "—" if age is None else f"{age / 3600:.1f} h", Text(r.reason or ""))
        out.print(t)
        return EXIT_OK
    for col in ("device", "type", "driver", "units", "agent", "slots", "tags", "state", "last seen"):
        t.add_column(col)
    for r in rows:  # every cell came from an agent: escaped, and never read as markup
        t.add_row(*(Text(printable(v)) for v in (r.name, r.device_type, r.driver, ",".join(r.units), r.agent, r.slots,
                                                 ",".join(r.tags), r.state)), when(r.last_seen))
    out.print(t)
    return EXIT_OK


def cmd_agents(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from farm.cli.console import open_farm, out, when
    from farm.cli.render import to_json
    from farm.proto.escape import printable

    rows = open_farm(args).agents()
    if args.json:
        print(to_json(rows))
        return EXIT_OK
    t = Table(header_style="bold")
    for col in ("agent", "state", "farm", "host", "running", "connected", "last seen", "controller"):
        t.add_column(col)
    for r in rows:  # every cell came from an agent: escaped, and never read as markup
        t.add_row(*(Text(printable(v)) for v in (r.name, r.state, r.farm_version, r.hostname, r.running)),
                  when(r.connected_at), when(r.last_seen), Text(printable(r.controller or "—")))
    out.print(t)
    return EXIT_OK


# --- controller serve -------------------------------------------------------------------------
def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _models_root(text: str) -> Path:
    root = Path(text)
    if not root.is_absolute() or not root.is_dir():
        raise RemoteError(f"--models-root {text}: give an absolute path to an existing folder")
    return root


def _budget(args: argparse.Namespace) -> Any:
    """Per-caller budgets from the command line (controller/auth.py has the rest of the defaults)."""
    from farm.controller.auth import BudgetSettings

    settings = BudgetSettings()
    for name, value in (("--max-calls-per-token", args.max_calls_per_token), ("--upload-idle-timeout", args.upload_idle_timeout),
                        ("--max-calls-per-team", args.max_calls_per_team),
                        ("--upload-quota", args.upload_quota and min(args.upload_quota, 1)),
                        ("--agent-hello-timeout", args.agent_hello_timeout),
                        ("--agent-idle-timeout", args.agent_idle_timeout)):
        if value is not None and not (0 < value < 1e9):  # NaN fails this too
            raise RemoteError(f"{name} must be a positive number, not {value}")
    return replace(settings, calls_per_token=args.max_calls_per_token or settings.calls_per_token,
                   calls_per_team=args.max_calls_per_team or settings.calls_per_team,
                   upload_idle_s=args.upload_idle_timeout or settings.upload_idle_s,
                   hello_timeout_s=args.agent_hello_timeout or settings.hello_timeout_s,
                   agent_idle_s=args.agent_idle_timeout or settings.agent_idle_s)


def cmd_controller_serve(args: argparse.Namespace) -> int:
    from farm.controller.auth import TlsFiles, TokenFileError, TokenTable, check_tokens_file, is_loopback
    from farm.controller.scheduling.store_file import StoreFileWatch
    from farm.controller.grpc_server import DEFAULT_MAX_STREAMS, DEFAULT_MAX_WATCHES, DEFAULT_UPLOAD_QUOTA, serve
    from farm.controller.operations.metrics import MetricsListenError
    from farm.controller.store import DB_ENV, StoreError, db_location, open_store

    _logging(args.verbose)
    tokens_file = args.tokens or os.environ.get("FARM_TOKENS")
    if not tokens_file and not args.no_auth:
        raise RemoteError("the controller needs a tokens file (--tokens PATH or FARM_TOKENS) with lines like "
                          "`client <token>` and `agent <token> <agent-name>`; --no-auth serves without (loopback only)")
    if args.no_auth and not is_loopback(args.listen):
        raise RemoteError(f"--no-auth is only allowed on a loopback address (127.0.0.1, ::1, localhost), not {args.listen}")
    try:
        if tokens_file:
            check_tokens_file(Path(tokens_file))
        tokens = TokenTable.from_file(Path(tokens_file)) if tokens_file else None
        tls = None
        if args.tls_cert or args.tls_key:
            tls = TlsFiles(ca=Path(args.tls_client_ca) if args.tls_client_ca else None,
                           cert=Path(args.tls_cert) if args.tls_cert else None, key=Path(args.tls_key) if args.tls_key else None)
        # the user data folder is farm's own to make; a path someone typed is made only with --create
        # --db is a file or a postgresql:// URL (several controllers may share one database)
        store = open_store(db_location(args.db), create_folder=args.create or not (args.db or os.environ.get(DB_ENV)))
        running = serve(store, args.listen, tokens=tokens, tls=tls, lease_ttl_s=args.lease_ttl,
                        heartbeat_interval_s=args.heartbeat_interval, metrics_listen=args.metrics_listen,
                        max_streams=args.max_streams or DEFAULT_MAX_STREAMS,
                        max_watches=args.max_watches or DEFAULT_MAX_WATCHES, reflection_on=args.reflection,
                        refresh_cron=args.refresh_cron,
                        refresh_suite=Path(args.refresh_suite) if args.refresh_suite else None,
                        models_roots=[_models_root(r) for r in args.models_root or []],
                        max_model_bytes=args.max_model_bytes, scripts_need_permission=args.scripts_need_permission,
                        budget=_budget(args), job_sharing=args.job_sharing,
                        upload_quota=args.upload_quota if args.upload_quota is not None else DEFAULT_UPLOAD_QUOTA)
    except (TokenFileError, StoreError) as e:
        raise RemoteError(str(e)) from None
    except ValueError as e:  # a --metrics-listen that is not HOST:PORT
        raise RemoteError(str(e)) from None
    except MetricsListenError as e:
        raise RemoteError(str(e), EXIT_ENVIRONMENT) from None
    except (OSError, RuntimeError) as e:
        raise RemoteError(f"cannot listen on {args.listen}: {e}", EXIT_ENVIRONMENT) from None
    running.farm.max_tasks = args.max_tasks
    web = _start_web(args, store, running, tokens, tls) if args.web_listen else None
    host = args.listen.rsplit(":", 1)[0]
    mode = "mutual TLS" if tls and tls.ca else "TLS" if tls else "plain text"
    print(f"farm controller listening on {host}:{running.port} ({mode}; store {store.location}; lease TTL "
          f"{args.lease_ttl:g} s)", file=sys.stderr, flush=True)
    files = running.farm.files
    print(f"farm controller artifact store {files.store.root}; models roots: "
          f"{files.roots.describe() if files.roots.roots else 'none (clients upload their models)'}"
          f"{'; script workloads need the `script` permission' if args.scripts_need_permission else ''}",
          file=sys.stderr, flush=True)
    if running.metrics:
        metrics_host = args.metrics_listen.rpartition(":")[0] or "127.0.0.1"
        print(f"farm controller metrics on http://{metrics_host}:{running.metrics_port}/metrics",
              file=sys.stderr, flush=True)
    if web:
        print(f"farm controller dashboard on {web.url}", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    store_watch = StoreFileWatch(store.path)  # a store deleted or replaced under the controller is logged
    while not stop.wait(5.0):
        store_watch.check_and_log(logging.getLogger("farm.controller"))
    store_watch.close()
    logging.getLogger("farm.controller").info("stopping: agents keep their tasks and reconnect to the next controller")
    if web:
        web.stop()
    running.stop()
    store.close()
    return EXIT_OK


def _start_web(args: argparse.Namespace, store: Any, running: Any, tokens: Any, tls: Any) -> Any:
    """The dashboard in this process: its buttons call the controller as the CLI and RPCs do (a cancel reaches
    the agents now, a released device gets tasks at once)."""
    from farm.controller.auth import is_loopback
    from farm.web.server import Operator, WebListenError, listen_warnings, parse_web_listen, start_dashboard
    from farm.web.views import agents_now

    def release(device: str) -> None:
        running.farm.controller.release(device)
        running.farm.wake(queue_changed=True)

    try:
        host, port = parse_web_listen(args.web_listen)
        if tokens is None and not is_loopback(f"[{host}]:{port}"):
            raise WebListenError(f"--no-auth is only allowed on loopback addresses; the dashboard's --web-listen "
                                 f"{args.web_listen} is not one")
    except WebListenError as e:
        running.stop()
        raise RemoteError(str(e)) from None
    for warning in listen_warnings(args.web_listen, tokens=tokens is not None, tls=tls is not None):
        logging.getLogger("farm.web").warning("%s", warning)
    operator = Operator(running.farm.cancel_job, lambda device, reason, health: running.farm.controller.quarantine(
        device, reason, health=health), release)
    try:
        return start_dashboard(store, args.web_listen, operator, tokens=tokens, tls=tls,
                               job_sharing=running.farm.job_sharing, live=lambda: agents_now(running.farm.agents))
    except WebListenError as e:
        running.stop()
        raise RemoteError(str(e), EXIT_ENVIRONMENT) from None


# --- agent -----------------------------------------------------------------------------------
def agent_token(args: argparse.Namespace) -> str | None:
    """--token-file, else --token (visible to every local user in the process list: a warning says so), else
    $FARM_TOKEN, else the config file. $FARM_TOKEN is removed from the environment either way: no child inherits it."""
    env_token = os.environ.pop("FARM_TOKEN", None)  # before any child is spawned
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as e:
            raise RemoteError(f"--token-file {args.token_file}: cannot read it: {e.strerror}") from None
        if not token:
            raise RemoteError(f"--token-file {args.token_file}: the file is empty")
        return token
    if args.token:
        logging.getLogger("farm.agent").warning(
            "--token puts the agent's secret on its command line, where every local user (and every job, without "
            "namespaces) can read it: use --token-file PATH or FARM_TOKEN instead")
        return args.token
    return env_token or read_config().get("token")


def _agent_tls(args: argparse.Namespace, addresses: list[str]) -> Any:
    """The agent's TLS settings; refused without them for a controller off this host (issue 33: a token only over
    TLS), unless --insecure-plaintext says the network is trusted."""
    from farm.controller.auth import is_loopback

    tls = client_tls(args)
    remote = [a for a in addresses if not is_loopback(a)]
    if tls is None and remote and not args.insecure_plaintext:
        raise RemoteError(f"--controller {remote[0]}: without --tls-ca the agent would send its token, and every task "
                          "and result, in clear to a controller not on this host; give --tls-ca CA.pem (the CA that "
                          "signed the controller's certificate), or --insecure-plaintext on a network you trust alone")
    return tls


def cmd_agent(args: argparse.Namespace) -> int:
    from farm.agents.agent import Agent, split_cores
    from farm.agents.environment import host_facts
    from farm.agents.link.remote_controller import DeviceInfo, RemoteController
    from farm.agents.sandbox.docker_build import BuildPolicy
    from farm.agents.sandbox.isolation import RunUserError, resolve_run_as, run_uid_range
    from farm.agents.sim.driver import SimDriver
    from farm.controller.auth import valid_agent_name

    _logging(args.verbose)
    given = setting(args.controller, "controller", "FARM_CONTROLLER")
    if not given:
        raise RemoteError("`farm agent` needs --controller HOST:PORT (or FARM_CONTROLLER)")
    addresses = checked_addresses(given)  # several controllers on one PostgreSQL: the agent goes round them
    address = ",".join(addresses)
    if not valid_agent_name(args.name):
        raise RemoteError(f"--name {args.name!r}: use letters, digits, '.', '_' and '-' (at most 64)")
    from farm.agents.lab import LabConfigError, discover_types, lab_from_environment, load_lab

    try:
        lab = load_lab(Path(args.devices)) if args.devices else lab_from_environment()
    except LabConfigError as e:
        raise RemoteError(str(e)) from None
    for problem in discover_types(lab):  # untyped entries get the type their facts match
        print(f"device {problem}", file=sys.stderr, flush=True)
    token = agent_token(args)
    try:
        run_as = resolve_run_as(args.run_as)
        uids = run_uid_range() if run_as is not None else None  # each run's own uid, from FARM_RUN_UIDS
    except RunUserError as e:
        raise RemoteError(str(e)) from None
    # absolute: the harness runs in its run directory, so a relative path would point nowhere
    work_dir = Path(args.work_dir or Path.home() / ".cache" / "farm" / "agent" / args.name).absolute()
    work_dir.mkdir(mode=0o711, parents=True, exist_ok=True)  # runs pass through to their own folder; nothing is listed
    try:
        split_cores(args.sim_slots)
    except ValueError as e:
        raise RemoteError(f"--sim-slots {args.sim_slots}: {e}; each sim slot gets cores of its own.") from None
    devices = [DeviceInfo(name=f"{args.name}/sim", driver="sim", device_type="sim", tags=args.tag or [],
                          facts_json=json.dumps(host_facts()), slots=args.sim_slots)]
    # The lab's phones and boards: jobs name them (or their type or tags), the controller resolves them.
    devices += [DeviceInfo(name=d.name, driver=d.entry.driver, device_type=d.device_type.name if d.device_type else "",
                           tags=d.tags) for d in lab]
    client = RemoteController(addresses, name=args.name, token=token, devices=devices,
                              tls=_agent_tls(args, addresses), artifact_dir=work_dir / "artifacts")
    driver = SimDriver(work_dir, backend_override=args.backend, run_as=run_as,
                       build_policy=BuildPolicy.lab(args.allow_build_network, args.allow_build_base))
    agent = Agent(client, driver, name=args.name, slots=args.sim_slots, devices=lab)
    log = logging.getLogger("farm.agent")
    signals: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        signals.append(signum)
        if signum == signal.SIGINT and len(signals) > 1:
            agent.stop()  # a second Ctrl+C: stop the running sandboxes too (recorded as canceled)
        else:
            client.drain()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    log.info("agent %s: %d sim slot(s), %d device(s), work dir %s, controller %s, runs as %s", args.name,
             args.sim_slots, len(lab), work_dir, address,
             f"a uid of their own each (uids {uids[0]}-{uids[0] + uids[1] - 1}; venvs installed as {run_as.name})"
             if run_as and uids else "the agent's own user")
    client.start()
    agent.run_job(None)  # each slot leases until draining
    if client.fatal is not None:
        client.close()
        raise RemoteError(str(client.fatal))
    delivered = client.wait_for_acks(args.drain_timeout)
    client.close()
    if not delivered:
        log.warning("some results were not acknowledged; the controller re-runs those tasks when their leases run out")
    log.info("agent %s drained and stopped", args.name)
    return EXIT_OK


# --- parser ------------------------------------------------------------------------------------
def add_remote_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    c = sub.add_parser("controller", help="run the farm controller (gRPC)")
    csub = c.add_subparsers(dest="controller_command", required=True, metavar="ACTION")
    s = csub.add_parser("serve", help="serve agents and clients until SIGTERM")
    s.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", help=f"HOST:PORT (default 127.0.0.1:{DEFAULT_PORT}; :0 picks a port)")
    s.add_argument("--db", default=None, help="SQLite store file, or a postgresql://user@host/db URL (a password "
                   "is better in ~/.pgpass or PGPASSWORD) (default: $FARM_DB or the user data directory)")
    s.add_argument("--create", action="store_true", help="make the folder of --db (or $FARM_DB) when it is missing; without it a missing folder is an error")
    s.add_argument("--tokens", default=None, help="tokens file: `ROLE TOKEN [AGENT_NAME]` a line (default $FARM_TOKENS)")
    s.add_argument("--no-auth", action="store_true", help="accept every caller (loopback addresses only)")
    s.add_argument("--tls-cert", default=None, help="server certificate (PEM); enables TLS")
    s.add_argument("--tls-key", default=None, help="server private key (PEM)")
    s.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA (mutual TLS)")
    s.add_argument("--lease-ttl", type=float, default=30.0, help="seconds a lease lives without a heartbeat (default 30)")
    s.add_argument("--heartbeat-interval", type=float, default=None, help="seconds between agent heartbeats (default TTL/4)")
    s.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                   help="also serve Prometheus metrics at http://HOST:PORT/metrics (no auth: loopback or a trusted network)")
    s.add_argument("--web-listen", default=None, metavar="HOST:PORT",
                   help="also serve the lab dashboard at http(s)://HOST:PORT/ (same tokens; TLS with --tls-cert)")
    s.add_argument("--refresh-cron", default=None, metavar="'M H DOM MON DOW'",
                   help="submit the reference suite to every registered device on this schedule, e.g. '30 2 * * *' or '@daily'")
    s.add_argument("--refresh-suite", default=None, help="the reference suite job file (default: the one farm ships)")
    s.add_argument("--max-streams", type=int, default=None,
                   help="calls open at once, each with its own thread: one per agent, one per watcher "
                        "(default 2500: 1,000 agents and their watchers)")
    s.add_argument("--max-watches", type=int, default=None,
                   help="WatchJob streams one token (or host, without tokens) may hold open (default 64)")
    s.add_argument("--max-calls-per-token", type=int, default=None,
                   help="calls one client token may hold open at once (default 64); all clients together hold at most "
                        "half of --max-streams, the rest is kept for agents and admins")
    s.add_argument("--max-calls-per-team", type=int, default=None,
                   help="calls the client tokens of one team (`team=NAME` in the tokens file) may hold open at once "
                        "together, from any address (default 256)")
    s.add_argument("--upload-idle-timeout", type=float, default=None, metavar="SECONDS",
                   help="cut an upload that sends nothing for this long (default 60)")
    s.add_argument("--agent-hello-timeout", type=float, default=None, metavar="SECONDS",
                   help="cut an agent stream whose hello has not come this long after it opened (default 10)")
    s.add_argument("--agent-idle-timeout", type=float, default=None, metavar="SECONDS",
                   help="cut an agent stream that sends nothing, not even a heartbeat, for this long (default 60, or "
                        "4 heartbeat intervals when longer)")
    s.add_argument("--upload-quota", type=int, default=None, metavar="BYTES",
                   help="bytes one client token's uploads may hold in the artifact store until `farm artifacts gc` "
                        "removes what no job names (default 20 GiB)")
    s.add_argument("--job-sharing", choices=["shared", "team"], default="shared",
                   help="who may read a client's jobs and results: every client (shared, the default) or only its own "
                        "token and team (`team=NAME` in the tokens file); cancelling is never shared, admins see all")
    s.add_argument("--reflection", action="store_true",
                   help="serve gRPC reflection (for grpcurl); callers need a token when tokens are on")
    s.add_argument("--models-root", action="append", metavar="DIR",
                   help="a folder on this host whose files jobs may name (repeatable); by default the controller reads "
                        "no model file from its own disk, `farm submit` uploads them")
    s.add_argument("--max-model-bytes", type=int, default=None,
                   help="largest model file accepted, uploaded or under a models root (default 2 GiB)")
    s.add_argument("--scripts-need-permission", action="store_true",
                   help="accept script workloads only from tokens with the `script` permission (`client+script`)")
    s.add_argument("--max-tasks", type=int, default=DEFAULT_MAX_TASKS,
                   help=f"refuse a submitted job that expands to more runs than this (default {DEFAULT_MAX_TASKS:,})")
    s.set_defaults(func=cmd_controller_serve)

    a = sub.add_parser("agent", help="run an agent: dial the controller, run the tasks it leases")
    a.add_argument("--controller", default=None, metavar="HOST:PORT[,HOST:PORT…]",
                   help="the controller, or several sharing one PostgreSQL: the agent connects to the first that "
                        "answers and moves to the next when its stream breaks (default $FARM_CONTROLLER)")
    a.add_argument("--name", required=True, help="this agent's name (a reconnect under the same name takes over its session)")
    a.add_argument("--token", default=None, help="agent token; prefer --token-file or $FARM_TOKEN (a command line is "
                                                 "visible to every local user)")
    a.add_argument("--token-file", default=None, metavar="PATH", help="read the agent token from this file (mode 0600)")
    a.add_argument("--run-as", default=None, metavar="USER",
                   help="the unprivileged user that installs script venvs (default when the agent is root: nobody); "
                        "each run itself gets a uid of its own from FARM_RUN_UIDS=FIRST:COUNT")
    a.add_argument("--tls-ca", default=None, help="CA that signed the controller's certificate (enables TLS; needed "
                                                  "for a controller not on this host unless --insecure-plaintext)")
    a.add_argument("--insecure-plaintext", action="store_true",
                   help="dial a controller on another host over plain TCP (token, tasks and results in clear): only on "
                        "a network you trust alone, such as a compose project's own")
    a.add_argument("--tls-cert", default=None, help="this agent's certificate, for mutual TLS")
    a.add_argument("--tls-key", default=None, help="this agent's key, for mutual TLS")
    a.add_argument("--sim-slots", type=int, default=1, help="sim runs at once, each on its own cores (default 1)")
    a.add_argument("--devices", default=None, help="the lab's device list (YAML) this agent drives; default $FARM_DEVICES")
    a.add_argument("--tag", action="append", help="a tag for this agent's sim device (repeatable)")
    a.add_argument("--backend", choices=BACKEND_CHOICES, default=None,
                   help="override sim.backend of the tasks")
    a.add_argument("--work-dir", default=None, help="run directories and the artifact cache")
    a.add_argument("--allow-build-network", action="store_true",
                   help="let a job's sim.build use the network when it asks (default: builds run offline)")
    a.add_argument("--allow-build-base", action="append", default=None, metavar="IMAGE",
                   help="an image on this host's Docker engine a job's sim.build may start from, or its sim.image "
                        "run in (repeatable; farm's own base image always may)")
    a.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to wait for result acknowledgements at exit")
    a.set_defaults(func=cmd_agent)

    d = sub.add_parser("devices", parents=[common],
                       help="devices: the controller's agents' (remote) or the lab's device list (embedded)")
    d.add_argument("--devices", help="embedded: the lab's device list (default $FARM_DEVICES)")
    d.set_defaults(func=cmd_devices)
    g = sub.add_parser("agents", parents=[common], help="agents known to the controller")
    g.set_defaults(func=cmd_agents)
