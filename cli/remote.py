"""`farm` against a remote controller: `farm controller serve`, `farm agent`, `farm devices`,
`farm agents`, and the client side of submit / results / jobs / status / cancel.

The controller address comes from --controller, else $FARM_CONTROLLER, else `controller = ...`
in the config file ($FARM_CONFIG, default ~/.config/farm/config.toml); the same goes for the
token and the TLS files. With none configured, the commands run embedded, as before.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from farm.proto.tasks import DEFAULT_MAX_TASKS

if TYPE_CHECKING:
    import grpc

    from farm.controller.auth import TlsFiles

# The sandboxes fork; gRPC's fork handlers are not needed (children exec at once) and only log noise.
# grpc itself is imported only by the commands that talk to a controller: embedded mode starts faster.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

EXIT_OK, EXIT_RUNS_FAILED, EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
DEFAULT_PORT = 7443


class RemoteError(Exception):
    """A refusal or an unreachable controller, said so a person can act on it."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --- configuration --------------------------------------------------------------------
def config_path() -> Path:
    if os.environ.get("FARM_CONFIG"):
        return Path(os.environ["FARM_CONFIG"])
    from platformdirs import user_config_dir
    return Path(user_config_dir("farm", appauthor=False)) / "config.toml"


def _config() -> dict[str, Any]:
    path = config_path()
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise RemoteError(f"{path}: cannot read the farm config file: {e}") from None


def _setting(args: argparse.Namespace, name: str, env: str) -> str | None:
    """--flag, else $ENV, else the config file's key."""
    value = getattr(args, name, None) or os.environ.get(env)
    return value or _config().get(name)


def controller_address(args: argparse.Namespace) -> str | None:
    address = _setting(args, "controller", "FARM_CONTROLLER")
    if address and ":" not in address:
        address = f"{address}:{DEFAULT_PORT}"
    return address


def client_tls(args: argparse.Namespace) -> TlsFiles | None:
    from farm.controller.auth import TlsFiles

    ca = _setting(args, "tls_ca", "FARM_TLS_CA")
    if not ca:
        return None
    cert, key = _setting(args, "tls_cert", "FARM_TLS_CERT"), _setting(args, "tls_key", "FARM_TLS_KEY")
    return TlsFiles(ca=Path(ca), cert=Path(cert) if cert else None, key=Path(key) if key else None)


def add_client_options(parser: argparse.ArgumentParser) -> None:
    """--controller and its credentials, for every command that can talk to a controller."""
    g = parser.add_argument_group("remote controller")
    g.add_argument("--controller", metavar="HOST:PORT", default=None,
                   help="talk to this controller (default: $FARM_CONTROLLER, the config file, else embedded)")
    g.add_argument("--token", default=None, help="client token (default: $FARM_TOKEN)")
    g.add_argument("--tls-ca", default=None, help="CA certificate that signed the controller's (enables TLS)")
    g.add_argument("--tls-cert", default=None, help="client certificate, for mutual TLS")
    g.add_argument("--tls-key", default=None, help="client key, for mutual TLS")


# --- the client ------------------------------------------------------------------------------
class FarmClient:
    """FarmService calls with the token attached and errors turned into RemoteError."""

    def __init__(self, address: str, token: str | None, tls: TlsFiles | None) -> None:
        from farm.agents.remote_controller import open_channel, token_metadata
        from farm.proto.generated import farm_pb2_grpc

        self.address = address
        self.channel = open_channel(address, tls=tls)
        self.stub = farm_pb2_grpc.FarmServiceStub(self.channel)
        self.metadata = token_metadata(token)
        self.tls = tls

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FarmClient":
        address = controller_address(args)
        if not address:
            raise RemoteError(f"`farm {args.command}` needs a controller: pass --controller HOST:PORT, set "
                              f"FARM_CONTROLLER, or put `controller = \"HOST:PORT\"` in {config_path()}")
        return cls(address, _setting(args, "token", "FARM_TOKEN"), client_tls(args))

    def call(self, method: str, request: Any, timeout: float = 30) -> Any:
        import grpc

        try:
            return getattr(self.stub, method)(request, metadata=self.metadata, timeout=timeout)
        except grpc.RpcError as e:
            raise self.explain(e) from None

    def explain(self, e: "grpc.RpcError") -> RemoteError:
        import grpc

        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            if self.tls is None:
                hint = "if it serves TLS, pass --tls-ca (or FARM_TLS_CA)"
            elif self.tls.cert is None:
                hint = ("check that it serves TLS with a certificate signed by --tls-ca for this host name; if it "
                        "requires client certificates (mutual TLS), pass --tls-cert and --tls-key")
            else:
                hint = "check that it serves TLS with a certificate signed by --tls-ca for this host name, and accepts yours"
            return RemoteError(f"cannot reach the controller at {self.address}: {details}. Is `farm controller serve` "
                               f"running there? {hint[0].upper()}{hint[1:]}.", EXIT_ENVIRONMENT)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RemoteError(f"the controller at {self.address} did not answer in time", EXIT_ENVIRONMENT)
        return RemoteError(f"the controller at {self.address} refused: {details}")

    def close(self) -> None:
        self.channel.close()


# --- client commands -------------------------------------------------------------------------
def _out() -> Any:
    from farm.cli.main import out
    return out


def _err() -> Any:
    from farm.cli.main import err
    return err


def _job_dict(job: Any) -> dict[str, Any]:
    return {"job": job.id, "name": job.name, "status": job.status, "priority": job.priority, "total": job.total,
            "pending": job.pending, "running": job.running, "completed": job.completed, "failed": job.failed,
            "canceled": job.canceled, "created_at": job.created_at,
            "started_at": job.started_at if job.HasField("started_at") else None,
            "finished_at": job.finished_at if job.HasField("finished_at") else None, "message": job.message}


UPLOAD_CHUNK_BYTES = 1 << 20


def _upload_chunks(sha256: str, name: str, size: int, read: Callable[[int], bytes]) -> Any:
    """ArtifactUpload messages: the first names the artifact, every one carries up to 1 MiB."""
    from farm.proto.generated import farm_pb2

    data = read(UPLOAD_CHUNK_BYTES)
    yield farm_pb2.ArtifactUpload(sha256=sha256, size=size, name=name, data=data)
    while data := read(UPLOAD_CHUNK_BYTES):
        yield farm_pb2.ArtifactUpload(data=data)


def upload_job_files(client: FarmClient, path: Path, text: str) -> tuple[list[Any], str]:
    """Resolve the job's models (and script folder) here, on the client, and upload what the controller lacks.

    Returns the JobModel list and the script archive's sha256 ('' for a benchmark job). The
    controller never opens a path of ours: it gets the bytes, and names them by sha256.
    """
    import hashlib
    import io

    import grpc

    from farm.controller.jobfile import JobFileError, check_benchmark_models, check_script, parse_job_text, resolve_models
    from farm.proto.generated import farm_pb2
    from farm.proto.script_archive import ScriptArchiveError, pack_dir
    from farm.proto.spec import BenchmarkWorkload

    base_dir = path.resolve().parent
    try:
        spec, root = parse_job_text(text, str(path))
        models, invalid = resolve_models(spec, root, base_dir, str(path))
        archive = b""
        if isinstance(spec.workload, BenchmarkWorkload):
            invalid += check_benchmark_models(spec, models, root, str(path))
            if invalid:  # every bad model at once, before anything is uploaded
                raise JobFileError([m.problem for m in sorted(invalid, key=lambda m: (m.problem.line or 0, m.entry_index))])
        else:
            if invalid:
                raise JobFileError([m.problem for m in invalid])
            script_dir, _ = check_script(spec, base_dir, root, str(path))
            try:
                archive = pack_dir(script_dir)
            except ScriptArchiveError as e:
                raise JobFileError(f"{path}: workload.dir: {e}") from None
    except JobFileError as e:
        raise RemoteError(str(e)) from None
    archive_sha = hashlib.sha256(archive).hexdigest() if archive else ""
    wanted = [m.facts.sha256 for m in models] + ([archive_sha] if archive else [])
    answer = client.call("MissingArtifacts", farm_pb2.MissingArtifactsRequest(sha256=wanted))
    missing = set(answer.missing)
    for model in models:
        if model.facts.sha256 not in missing:
            continue
        missing.discard(model.facts.sha256)
        if answer.max_model_bytes and model.facts.size_bytes > answer.max_model_bytes:
            raise RemoteError(f"{model.path}: {model.facts.size_bytes} bytes is over the controller's limit of "
                              f"{answer.max_model_bytes} bytes per model file (its --max-model-bytes)")
        with model.path.open("rb") as f:
            try:
                client.stub.UploadArtifact(_upload_chunks(model.facts.sha256, model.path.name, model.facts.size_bytes,
                                                          f.read), metadata=client.metadata, timeout=3600)
            except grpc.RpcError as e:
                raise client.explain(e) from None
    if archive_sha in missing:
        if answer.max_script_archive_bytes and len(archive) > answer.max_script_archive_bytes:
            raise RemoteError(f"{path}: workload.dir packs to {len(archive)} bytes, over the controller's limit of "
                              f"{answer.max_script_archive_bytes}; give the script a folder of its own")
        try:
            client.stub.UploadArtifact(_upload_chunks(archive_sha, "dir.tar", len(archive), io.BytesIO(archive).read),
                                       metadata=client.metadata, timeout=3600)
        except grpc.RpcError as e:
            raise client.explain(e) from None
    job_models = [farm_pb2.JobModel(entry=m.entry_index, name=m.name, sha256=m.facts.sha256, source=str(m.path))
                  for m in models]
    return job_models, archive_sha


def remote_submit(args: argparse.Namespace) -> int:
    from farm.proto.generated import farm_pb2

    path = Path(args.job_file)
    if getattr(args, "skip_invalid", False):
        raise RemoteError("--skip-invalid runs in embedded mode only; a controller refuses a job with a bad model, "
                          "naming each one: drop them from the job file, or submit without --controller.")
    try:
        text = path.read_text()
    except OSError as e:
        raise RemoteError(f"{path}: cannot read the job file: {e}.") from None
    from farm.controller.grpc_server import MAX_JOB_FILE_BYTES

    if len(text.encode()) > MAX_JOB_FILE_BYTES:
        raise RemoteError(f"{path}: the job file is over {MAX_JOB_FILE_BYTES} bytes")
    client = FarmClient.from_args(args)
    job_models, archive_sha = upload_job_files(client, path, text)
    response = client.call("SubmitJob", farm_pb2.SubmitJobRequest(
        job_yaml=text, base_dir=str(path.resolve().parent), file_name=str(path), priority=args.priority or "",
        models=job_models, script_archive_sha256=archive_sha))
    if not args.json and not args.quiet:
        _err().print(f"job {response.job_id}: {response.tasks} run(s) on controller {client.address}")
    if args.detach:
        if args.json:
            print(json.dumps({"job": response.job_id, "status": "queued", "tasks": response.tasks}))
        return EXIT_OK
    try:
        status = _watch(client, response.job_id, quiet=args.json or args.quiet)
    except KeyboardInterrupt:
        _err().print(f"stopped watching; job {response.job_id} carries on at the controller "
                     f"(`farm cancel {response.job_id}` stops it)")
        return EXIT_INTERRUPTED
    return _print_results(args, client, response.job_id, final_status=status)


def _watch(client: FarmClient, job_id: int, *, quiet: bool) -> str:
    import grpc

    from farm.proto.generated import farm_pb2

    last_done, status = -1, "queued"
    try:
        for job in client.stub.WatchJob(farm_pb2.JobRequest(job_id=job_id), metadata=client.metadata):
            done = job.completed + job.failed + job.canceled
            if done != last_done and not quiet:
                _err().print(f"[{done}/{job.total}] {job.completed} ok, {job.failed} failed, {job.running} running")
            last_done, status = done, job.status
    except grpc.RpcError as e:
        raise client.explain(e) from None
    return status


def _print_results(args: argparse.Namespace, client: FarmClient, job_id: int, final_status: str | None = None) -> int:
    from rich.text import Text

    from farm.cli.render import failures, results_csv, results_table, show, to_json
    from farm.proto.generated import farm_pb2

    job = client.call("GetJob", farm_pb2.JobRequest(job_id=job_id))
    ops = bool(getattr(args, "ops", False))
    records = json.loads(client.call("GetResults", farm_pb2.JobRequest(job_id=job_id, ops=ops), timeout=120).records_json)
    fmt = "json" if args.json else getattr(args, "format", "table")
    if args.command == "submit" and args.json:
        print(to_json({"job": job_id, "status": job.status, "results": records}))
    elif fmt == "json":
        print(to_json(records))
    elif fmt == "csv":
        sys.stdout.write(results_csv(records))
    elif ops:
        from farm.cli.op_profile_view import op_profile_tables
        _out().print(op_profile_tables(records))
    else:
        show(_out(), results_table(records, title=f"job {job_id} · {job.name} · {job.status}", wide=getattr(args, "wide", False),
                                   runs=getattr(args, "runs", False)), wide=getattr(args, "wide", False))
        if args.command == "submit":
            for line in failures(records):
                _err().print(Text.assemble(("failed ", "red"), line), highlight=False)
    if args.command == "submit":
        return EXIT_OK if job.status == "completed" else EXIT_RUNS_FAILED
    return EXIT_OK


def remote_results(args: argparse.Namespace) -> int:
    return _print_results(args, FarmClient.from_args(args), args.job)


def remote_jobs(args: argparse.Namespace) -> int:
    from rich.table import Table

    from farm.cli.main import _when
    from farm.cli.render import to_json
    from farm.proto.generated import farm_pb2

    jobs = [_job_dict(j) for j in FarmClient.from_args(args).call("ListJobs", farm_pb2.ListJobsRequest(limit=args.limit)).jobs]
    if args.json:
        print(to_json([{**j, "id": j["job"], "tasks": j["total"]} for j in jobs]))
        return EXIT_OK
    t = Table(header_style="bold")
    for col in ("job", "name", "status", "runs", "ok", "failed", "created", "finished"):
        t.add_column(col)
    for j in jobs:
        t.add_row(str(j["job"]), j["name"], j["status"], str(j["total"]), str(j["completed"]), str(j["failed"]),
                  _when(j["created_at"]), _when(j["finished_at"]))
    _out().print(t)
    return EXIT_OK


def remote_status(args: argparse.Namespace) -> int:
    from farm.cli.render import to_json
    from farm.proto.generated import farm_pb2

    job = _job_dict(FarmClient.from_args(args).call("GetJob", farm_pb2.JobRequest(job_id=args.job)))
    if args.json:
        print(to_json(job))
        return EXIT_OK
    done = job["completed"] + job["failed"] + job["canceled"]
    _out().print(f"job {job['job']} ({job['name']}): [bold]{job['status']}[/bold] — {done}/{job['total']} done: "
                 f"{job['completed']} ok, {job['failed']} failed, {job['canceled']} canceled, {job['running']} running, "
                 f"{job['pending']} pending")
    if job["message"]:
        _out().print(job["message"])
    return EXIT_OK


def remote_cancel(args: argparse.Namespace) -> int:
    from farm.cli.render import to_json
    from farm.proto.generated import farm_pb2

    response = FarmClient.from_args(args).call("CancelJob", farm_pb2.JobRequest(job_id=args.job))
    if args.json:
        print(to_json({"job": args.job, "canceled_tasks": response.canceled_tasks}))
    else:
        _out().print(f"job {args.job}: {response.canceled_tasks} unfinished run(s) canceled; runs already stored are kept.")
    return EXIT_OK


def remote_forget_device(args: argparse.Namespace) -> int:
    """`farm device forget NAME --controller ...`: an admin frees a device name an offline agent registered."""
    from farm.cli.render import to_json
    from farm.proto.generated import farm_pb2

    response = FarmClient.from_args(args).call("ForgetDevice", farm_pb2.ForgetDeviceRequest(name=args.device))
    if args.json:
        print(to_json({"device": response.name, "agent": response.agent, "action": "forget"}))
    else:
        _out().print(f"device {response.name} forgotten: it no longer belongs to agent {response.agent}; the next "
                     "agent that registers it owns it", markup=False, highlight=False)
    return EXIT_OK


def remote_resume(args: argparse.Namespace) -> int:
    raise RemoteError("a controller carries on its own jobs after a restart; `farm status JOB --controller ...` "
                      "shows where one is. `farm resume` is for embedded jobs.")


def cmd_devices(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from farm.proto.escape import printable

    from farm.cli.main import _when
    from farm.cli.render import to_json
    from farm.proto.generated import farm_pb2

    if not controller_address(args):
        from farm.cli.device_commands import cmd_lab_devices
        return cmd_lab_devices(args)  # embedded: the lab's own list, with health and calibration age
    devices = FarmClient.from_args(args).call("ListDevices", farm_pb2.ListDevicesRequest()).devices
    rows = [{"name": d.name, "agent": d.agent, "driver": d.driver, "device_type": d.device_type, "tags": list(d.tags),
             "slots": d.slots, "state": d.state, "last_seen": d.last_seen, "facts": json.loads(d.facts_json or "{}")}
            for d in devices]
    if args.json:
        print(to_json(rows))
        return EXIT_OK
    t = Table(header_style="bold")
    for col in ("device", "type", "driver", "agent", "slots", "tags", "state", "last seen"):
        t.add_column(col)
    for r in rows:  # every cell came from an agent: escaped, and never read as markup
        t.add_row(*(Text(printable(v)) for v in (r["name"], r["device_type"], r["driver"], r["agent"], r["slots"],
                                                 ",".join(r["tags"]), r["state"])), _when(r["last_seen"]))
    _out().print(t)
    return EXIT_OK


def cmd_agents(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from farm.proto.escape import printable

    from farm.cli.main import _when
    from farm.cli.render import to_json
    from farm.proto.generated import farm_pb2

    agents = FarmClient.from_args(args).call("ListAgents", farm_pb2.ListAgentsRequest()).agents
    rows = [{"name": a.name, "state": a.state, "farm_version": a.farm_version, "hostname": a.hostname, "peer": a.peer,
             "capabilities": list(a.capabilities), "running": a.running, "connected_at": a.connected_at,
             "last_seen": a.last_seen} for a in agents]
    if args.json:
        print(to_json(rows))
        return EXIT_OK
    t = Table(header_style="bold")
    for col in ("agent", "state", "farm", "host", "running", "connected", "last seen"):
        t.add_column(col)
    for r in rows:  # every cell came from an agent: escaped, and never read as markup
        t.add_row(*(Text(printable(v)) for v in (r["name"], r["state"], r["farm_version"], r["hostname"], r["running"])),
                  _when(r["connected_at"]), _when(r["last_seen"]))
    _out().print(t)
    return EXIT_OK


REMOTE_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "submit": remote_submit, "results": remote_results, "jobs": remote_jobs, "status": remote_status,
    "cancel": remote_cancel, "resume": remote_resume,
}


def remote_handler(args: argparse.Namespace) -> Callable[[argparse.Namespace], int] | None:
    """The remote variant of an embedded command when a controller is configured, else None."""
    if args.command not in REMOTE_HANDLERS or not controller_address(args):
        return None
    return REMOTE_HANDLERS[args.command]


# --- controller serve -------------------------------------------------------------------------
def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _models_root(text: str) -> Path:
    root = Path(text)
    if not root.is_absolute() or not root.is_dir():
        raise RemoteError(f"--models-root {text}: give an absolute path to an existing folder")
    return root


def cmd_controller_serve(args: argparse.Namespace) -> int:
    from farm.controller.auth import TlsFiles, TokenFileError, TokenTable, check_tokens_file, is_loopback
    from farm.controller.grpc_server import DEFAULT_MAX_STREAMS, DEFAULT_MAX_WATCHES, serve
    from farm.controller.metrics import MetricsListenError
    from farm.controller.store import Store, StoreError, default_db_path

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
        store = Store(Path(args.db) if args.db else default_db_path())
        running = serve(store, args.listen, tokens=tokens, tls=tls, lease_ttl_s=args.lease_ttl,
                        heartbeat_interval_s=args.heartbeat_interval, metrics_listen=args.metrics_listen,
                        max_streams=args.max_streams or DEFAULT_MAX_STREAMS,
                        max_watches=args.max_watches or DEFAULT_MAX_WATCHES, reflection_on=args.reflection,
                        refresh_cron=args.refresh_cron,
                        refresh_suite=Path(args.refresh_suite) if args.refresh_suite else None,
                        models_roots=[_models_root(r) for r in args.models_root or []],
                        max_model_bytes=args.max_model_bytes, scripts_need_permission=args.scripts_need_permission)
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
    print(f"farm controller listening on {host}:{running.port} ({mode}; store {store.path}; lease TTL "
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
    while not stop.wait(1.0):
        pass
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
        return start_dashboard(store, args.web_listen, operator, tokens=tokens, tls=tls)
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
    return env_token or _config().get("token")


def cmd_agent(args: argparse.Namespace) -> int:
    from farm.agents.agent import Agent, split_cores
    from farm.agents.environment import host_facts
    from farm.agents.remote_controller import DeviceInfo, RemoteController
    from farm.agents.sandbox.isolation import RunUserError, resolve_run_as
    from farm.agents.sim import SimDriver
    from farm.controller.auth import valid_agent_name

    _logging(args.verbose)
    address = controller_address(args)
    if not address:
        raise RemoteError("`farm agent` needs --controller HOST:PORT (or FARM_CONTROLLER)")
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
    client = RemoteController(address, name=args.name, token=token, devices=devices,
                              tls=client_tls(args), artifact_dir=work_dir / "artifacts")
    driver = SimDriver(work_dir, backend_override=args.backend, run_as=run_as)
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
             args.sim_slots, len(lab), work_dir, address, run_as.name if run_as else "the agent's own user")
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
    s.add_argument("--db", default=None, help="SQLite store (default: $FARM_DB or the user data directory)")
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
    s.add_argument("--verbose", action="store_true")
    s.set_defaults(func=cmd_controller_serve)

    a = sub.add_parser("agent", help="run an agent: dial the controller, run the tasks it leases")
    a.add_argument("--controller", default=None, metavar="HOST:PORT", help="the controller (default $FARM_CONTROLLER)")
    a.add_argument("--name", required=True, help="this agent's name (a reconnect under the same name takes over its session)")
    a.add_argument("--token", default=None, help="agent token; prefer --token-file or $FARM_TOKEN (a command line is "
                                                 "visible to every local user)")
    a.add_argument("--token-file", default=None, metavar="PATH", help="read the agent token from this file (mode 0600)")
    a.add_argument("--run-as", default=None, metavar="USER",
                   help="the unprivileged user jobs run as (default when the agent is root: nobody)")
    a.add_argument("--tls-ca", default=None, help="CA that signed the controller's certificate (enables TLS)")
    a.add_argument("--tls-cert", default=None, help="this agent's certificate, for mutual TLS")
    a.add_argument("--tls-key", default=None, help="this agent's key, for mutual TLS")
    a.add_argument("--sim-slots", type=int, default=1, help="sim runs at once, each on its own cores (default 1)")
    a.add_argument("--devices", default=None, help="the lab's device list (YAML) this agent drives; default $FARM_DEVICES")
    a.add_argument("--tag", action="append", help="a tag for this agent's sim device (repeatable)")
    a.add_argument("--backend", choices=["auto", "cgroup", "docker", "process"], default=None,
                   help="override sim.backend of the tasks")
    a.add_argument("--work-dir", default=None, help="run directories and the artifact cache")
    a.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to wait for result acknowledgements at exit")
    a.add_argument("--verbose", action="store_true")
    a.set_defaults(func=cmd_agent)

    d = sub.add_parser("devices", parents=[common],
                       help="devices: the controller's agents' (remote) or the lab's device list (embedded)")
    d.add_argument("--devices", help="embedded: the lab's device list (default $FARM_DEVICES)")
    d.set_defaults(func=cmd_devices)
    g = sub.add_parser("agents", parents=[common], help="agents known to the controller")
    g.set_defaults(func=cmd_agents)
