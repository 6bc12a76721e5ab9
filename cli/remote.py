"""`farm controller serve`, `farm agent`, `farm devices` and `farm agents`, and the --controller options
every command shares. Which farm a command talks to is farm.client.config's rule; the client side
of every command is farm.client.remote."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.proto.names import BACKEND_CHOICES
from farm.client.errors import EXIT_OK, FarmError
from farm.client.config import DEFAULT_PORT, Credentials, address_of, read_config, setting
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
    """The flags mapped onto farm.client.compose's settings; the controller (and --web-listen's dashboard) run
    on threads of this process until SIGTERM or Ctrl+C."""
    from farm.client.compose import ControllerSettings, build_controller
    from farm.controller.scheduling.store_file import StoreFileWatch

    _logging(args.verbose)
    tokens_file = args.tokens or os.environ.get("FARM_TOKENS")
    settings = ControllerSettings(
        db=args.db, listen=args.listen, create=args.create, tokens=Path(tokens_file) if tokens_file else None,
        no_auth=args.no_auth, tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        tls_client_ca=Path(args.tls_client_ca) if args.tls_client_ca else None, lease_ttl_s=args.lease_ttl,
        heartbeat_interval_s=args.heartbeat_interval, metrics_listen=args.metrics_listen, max_streams=args.max_streams,
        max_watches=args.max_watches, reflection=args.reflection, refresh_cron=args.refresh_cron,
        refresh_suite=Path(args.refresh_suite) if args.refresh_suite else None,
        refresh_include_contended=args.refresh_include_contended,
        models_roots=[Path(r) for r in args.models_root or []], max_model_bytes=args.max_model_bytes,
        scripts_need_permission=args.scripts_need_permission, budget=_budget(args), job_sharing=args.job_sharing,
        upload_quota=args.upload_quota, max_tasks=args.max_tasks)
    server = build_controller(settings).start()
    try:
        web = _start_web(args, server) if args.web_listen else None
    except BaseException:
        server.stop()
        raise
    store, running, tls = server.store, server.running, server.tls
    assert store is not None and running is not None
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
    store_watch = StoreFileWatch.for_store(store)  # a store deleted or replaced under the controller is logged
    while not stop.wait(5.0):
        store_watch.check_and_log(logging.getLogger("farm.controller"))
    store_watch.close()
    logging.getLogger("farm.controller").info("stopping: agents keep their tasks and reconnect to the next controller")
    if web:
        web.stop()
    server.stop()
    return EXIT_OK


def _start_web(args: argparse.Namespace, server: Any) -> Any:
    """The dashboard in this process (farm.web.compose), beside the controller."""
    from farm.web.compose import DashboardSettings, build_dashboard

    return build_dashboard(DashboardSettings(args.web_listen), server).start()


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


def cmd_agent(args: argparse.Namespace) -> int:
    """The flags mapped onto farm.client.compose's AgentSettings; the agent's slots lease on a thread until
    SIGTERM or Ctrl+C drains it (a second Ctrl+C stops the running sandboxes too)."""
    from farm.client.compose import AgentSettings, build_agent

    _logging(args.verbose)
    given = setting(args.controller, "controller", "FARM_CONTROLLER")
    if not given:
        raise RemoteError("`farm agent` needs --controller HOST:PORT (or FARM_CONTROLLER)")
    c = Credentials.resolve(None, getattr(args, "tls_ca", None), getattr(args, "tls_cert", None),
                            getattr(args, "tls_key", None))
    settings = AgentSettings(
        controller=given, name=args.name, work_dir=Path(args.work_dir) if args.work_dir else None,
        sim_slots=args.sim_slots, tags=args.tag or [], backend=args.backend,
        devices=Path(args.devices) if args.devices else None, run_as=args.run_as, tls_ca=c.tls_ca, tls_cert=c.tls_cert,
        tls_key=c.tls_key, insecure_plaintext=args.insecure_plaintext, allow_build_network=args.allow_build_network,
        allow_build_base=args.allow_build_base, drain_timeout_s=args.drain_timeout,
        on_device_note=lambda line: print(line, file=sys.stderr, flush=True))
    runner = build_agent(settings)  # every flag checked before the token is read (and FARM_TOKEN dropped)
    runner.settings = replace(settings, token=agent_token(args))
    log = logging.getLogger("farm.agent")
    signals: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        signals.append(signum)
        if signum == signal.SIGINT and len(signals) > 1:
            runner.stop_runs()  # a second Ctrl+C: stop the running sandboxes too (recorded as canceled)
        else:
            runner.drain()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    run_as, uids = runner.run_as, runner.uids
    log.info("agent %s: %d sim slot(s), %d device(s), work dir %s, controller %s, runs as %s", args.name,
             args.sim_slots, len(runner.lab), runner.work_dir, ",".join(runner.addresses),
             f"a uid of their own each (uids {uids[0]}-{uids[0] + uids[1] - 1}; venvs installed as {run_as.name})"
             if run_as and uids else "the agent's own user")
    runner.start()
    while not runner.wait(0.5):  # the main thread stays free for the signal handlers
        pass
    if not runner.finish():
        log.warning("some results were not acknowledged; the controller re-runs those tasks when their leases run out")
    log.info("agent %s drained and stopped", args.name)
    return EXIT_OK


# --- parser ------------------------------------------------------------------------------------
def add_remote_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """controller serve, agent, devices, agents: the commands of a farm with a controller, part by part."""
    c = sub.add_parser("controller", help="run the farm controller (gRPC)")
    csub = c.add_subparsers(dest="controller_command", required=True, metavar="ACTION")
    s = csub.add_parser("serve", help="serve agents and clients until SIGTERM")
    for part in _SERVE_OPTIONS:
        part(s)
    s.set_defaults(func=cmd_controller_serve)
    _add_agent_command(sub)
    d = sub.add_parser("devices", parents=[common],
                       help="devices: the controller's agents' (remote) or the lab's device list (embedded)")
    d.add_argument("--devices", help="embedded: the lab's device list (default $FARM_DEVICES)")
    d.set_defaults(func=cmd_devices)
    g = sub.add_parser("agents", parents=[common], help="agents known to the controller")
    g.set_defaults(func=cmd_agents)


def _serve_store_options(s: argparse.ArgumentParser) -> None:
    """Where the controller listens and keeps its store."""
    s.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", help=f"HOST:PORT (default 127.0.0.1:{DEFAULT_PORT}; :0 picks a port)")
    s.add_argument("--db", default=None, help="SQLite store file, or a postgresql://user@host/db URL (a password "
                   "is better in ~/.pgpass or PGPASSWORD) (default: $FARM_DB or the user data directory)")
    s.add_argument("--create", action="store_true", help="make the folder of --db (or $FARM_DB) when it is missing; without it a missing folder is an error")


def _serve_access_options(s: argparse.ArgumentParser) -> None:
    """Who may call it (tokens, TLS), the lease's life, and what else it serves (metrics, dashboard)."""
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


def _serve_refresh_options(s: argparse.ArgumentParser) -> None:
    """The nightly reference-suite refresh."""
    s.add_argument("--refresh-cron", default=None, metavar="'M H DOM MON DOW'",
                   help="submit the reference suite to every registered device on this schedule, e.g. '30 2 * * *' or '@daily'")
    s.add_argument("--refresh-suite", default=None, help="the reference suite job file (default: the one farm ships)")
    s.add_argument("--refresh-include-contended", action="store_true",
                   help="the nightly refresh fits the suite's contended sim runs too (default: left out, and logged)")


def _serve_limit_options(s: argparse.ArgumentParser) -> None:
    """What one caller, team or stream may hold: calls, watches, timeouts, upload bytes."""
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


def _serve_job_options(s: argparse.ArgumentParser) -> None:
    """What jobs may read and run: sharing, models on this host, scripts, their size."""
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


# `farm controller serve`'s options, part by part, in the order its --help lists them.
_SERVE_OPTIONS = (_serve_store_options, _serve_access_options, _serve_refresh_options, _serve_limit_options,
                  _serve_job_options)


def _add_agent_command(sub: argparse._SubParsersAction) -> None:
    """`farm agent`: dial the controller(s), then what the agent runs and how."""
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
