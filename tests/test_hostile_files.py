"""A lab handed to a team: hostile clients written with the generated stubs try to make the
controller or an agent read files they have no business reading, and a script tries to read
what its user cannot. Real controller and agent processes on loopback, tokens on.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import grpc
import pytest

from farm.agents.sandbox.isolation import run_uid_range
from farm.proto.generated import agent_pb2_grpc, common_pb2, farm_pb2, farm_pb2_grpc
from grpc_processes import Cluster, wait_for

pytestmark = pytest.mark.timeout(240)

CLIENT = "client-hostile-0123456789"
SCRIPTER = "scripter-hostile-0123456789"
AGENT = "agent-hostile-0123456789abcdef"
ADMIN = "admin-hostile-0123456789"
ROOT_ONLY = os.geteuid() == 0


def _metadata(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def lab(tmp_path: Path, tiny_models):
    """A controller with a models root, tokens with roles, and --scripts-need-permission."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"client {CLIENT}\nclient+script {SCRIPTER}\nagent {AGENT}\nadmin {ADMIN}\n")
    tokens.chmod(0o600)
    root = tmp_path / "models-root"
    root.mkdir()
    shutil.copy(tiny_models["onnx"], root / "good.onnx")
    os.symlink("/etc/passwd", root / "escape.onnx")          # a link out of the root
    os.symlink(tokens, root / "tokens.onnx")                 # ... to the tokens file
    os.mkfifo(root / "fifo.onnx")                            # an endless read
    if ROOT_ONLY:
        os.mknod(root / "zero.onnx", stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero, inside the root
    # the controller and agents are processes (what they may read is the point); the `farm` client calls run in this
    # process (issue 34: each results poll was a process start), unless pytest --farm-subprocess
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_TLS_CA": ""}, cli_in_process=True)
    cluster.start_controller("--tokens", str(tokens), "--models-root", str(root), "--scripts-need-permission",
                             "--max-model-bytes", str(4 << 20))
    yield cluster, root, tokens
    cluster.stop_all()


def _submit(cluster: Cluster, text: str, base_dir: str, token: str = CLIENT, **fields) -> farm_pb2.SubmitJobResponse:
    with grpc.insecure_channel(cluster.address) as channel:
        return farm_pb2_grpc.FarmServiceStub(channel).SubmitJob(
            farm_pb2.SubmitJobRequest(job_yaml=text, base_dir=base_dir, file_name="hostile.yaml", **fields),
            metadata=_metadata(token), timeout=30)


def _fetch(cluster: Cluster, sha256: str) -> bytes:
    with grpc.insecure_channel(cluster.address) as channel:
        chunks = agent_pb2_grpc.AgentServiceStub(channel).FetchArtifact(
            common_pb2.ArtifactRequest(sha256=sha256), metadata=_metadata(AGENT), timeout=30)
        return b"".join(c.data for c in chunks)


def test_a_job_naming_files_on_the_controller_is_refused_and_nothing_leaks_through_fetch(lab, tmp_path: Path) -> None:
    cluster, root, tokens = lab
    hostile = {
        "/etc/shadow": "outside this controller's models roots",
        "~/.bashrc": "`~` is not expanded",
        "/proc/self/environ": "outside this controller's models roots",
        str(tokens): "outside this controller's models roots",
        "/dev/zero": "outside this controller's models roots",
        "escape.onnx": "outside this controller's models roots",
        "tokens.onnx": "outside this controller's models roots",
        "../tokens": "outside this controller's models roots",
        "fifo.onnx": "not a regular file",
        "/etc/*": "outside this controller's models roots",
    }
    if ROOT_ONLY:
        hostile["zero.onnx"] = "not a regular file"
    for name, reason in hostile.items():
        with pytest.raises(grpc.RpcError) as refused:
            _submit(cluster, f"models: [{json.dumps(name)}]\n", str(root))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert reason in refused.value.details() and "models[0]" in refused.value.details(), refused.value.details()
    # base_dir from the wire grants nothing: `/` plus a relative name is still outside the root
    with pytest.raises(grpc.RpcError) as refused:
        _submit(cluster, "models: [etc/shadow]\n", "/")
    assert "outside this controller's models roots" in refused.value.details()
    # a script folder on the controller's host: also only under a root
    with pytest.raises(grpc.RpcError) as refused:
        _submit(cluster, "models: [good.onnx]\nworkload: {type: script, script: passwd, dir: /etc}\n", str(root),
                token=SCRIPTER)
    assert "workload.dir" in refused.value.details() and "outside" in refused.value.details()

    # nothing was stored or can be fetched: not the files above, not the tokens file
    for path in (Path("/etc/passwd"), tokens, Path("/etc/hostname")):
        with pytest.raises(grpc.RpcError) as missing:
            _fetch(cluster, _sha(path))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    store = tmp_path / "controller-artifacts"
    assert stat.S_IMODE(store.stat().st_mode) == 0o700 and list(store.iterdir()) == []

    # the controller still serves, and a file under the root is taken (copied into the store, served from there)
    accepted = _submit(cluster, "models: [good.onnx]\n", str(root))
    assert accepted.tasks == 1
    assert _fetch(cluster, _sha(root / "good.onnx")) == (root / "good.onnx").read_bytes()
    stored = list(store.iterdir())
    assert len(stored) == 1 and stat.S_IMODE(stored[0].stat().st_mode) == 0o600
    jobs = cluster.farm("jobs", "--json", "--controller", cluster.address, "--token", CLIENT)
    assert jobs.returncode == 0 and len(json.loads(jobs.stdout)) == 1


def test_uploads_are_checked_size_hash_and_script_archive_entries(lab, tmp_path: Path, tiny_models) -> None:
    cluster, root, _ = lab
    data = tiny_models["onnx"].read_bytes()
    good = hashlib.sha256(data).hexdigest()
    with grpc.insecure_channel(cluster.address) as channel:
        stub = farm_pb2_grpc.FarmServiceStub(channel)

        def upload(sha256: str, size: int, name: str, payload: bytes) -> farm_pb2.UploadArtifactResponse:
            return stub.UploadArtifact(iter([farm_pb2.ArtifactUpload(sha256=sha256, size=size, name=name, data=payload)]),
                                       metadata=_metadata(CLIENT), timeout=30)

        for sha256, size, payload, reason in (
            ("0" * 64, len(data), data, "hash to"),                     # bytes that are not what they claim
            (good, len(data) - 1, data, "more than"),                   # more bytes than announced
            (good, 5 << 20, data, "over this controller's"),            # over --max-model-bytes (4 MiB)
            ("../../etc/passwd", len(data), data, "not a sha256"),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                upload(sha256, size, "m.onnx", payload)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in refused.value.details()
        assert list(stub.MissingArtifacts(farm_pb2.MissingArtifactsRequest(sha256=[good]),
                                          metadata=_metadata(CLIENT)).missing) == [good]
        assert not upload(good, len(data), "tiny.onnx", data).already_stored
        assert upload(good, len(data), "tiny.onnx", data).already_stored  # deduplicated by sha256
        assert list(stub.MissingArtifacts(farm_pb2.MissingArtifactsRequest(sha256=[good]),
                                          metadata=_metadata(CLIENT)).missing) == []

        # a script archive whose entries leave the run directory is refused at submit
        for member in (tarfile.TarInfo("../escape.py"), tarfile.TarInfo("/abs.py"), _symlink("run.py", "/etc/shadow")):
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w") as tar:
                tar.addfile(member, io.BytesIO(b"") if member.isreg() else None)
            archive = buffer.getvalue()
            sha = hashlib.sha256(archive).hexdigest()
            upload(sha, len(archive), "dir.tar", archive)
            with pytest.raises(grpc.RpcError) as refused:
                _submit(cluster, "models: [tiny.onnx]\nworkload: {type: script, script: run.py}\n", "/", token=SCRIPTER,
                        models=[farm_pb2.JobModel(entry=0, name="tiny", sha256=good, source="/home/u/tiny.onnx")],
                        script_archive_sha256=sha)
            assert "workload.dir" in refused.value.details() and (
                "outside its own folder" in refused.value.details() or "link" in refused.value.details()), \
                refused.value.details()
        # a model named by a hash nobody uploaded
        with pytest.raises(grpc.RpcError) as refused:
            _submit(cluster, "models: [x.onnx]\n", "/", models=[farm_pb2.JobModel(entry=0, name="x", sha256=_sha(Path("/etc/passwd")))])
        assert "no uploaded file with sha256" in refused.value.details()


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def test_a_remote_submit_uploads_from_a_folder_the_controller_never_sees(lab, tmp_path: Path, tiny_models) -> None:
    cluster, _, _ = lab
    folder = Path(tempfile.mkdtemp(prefix="client-only-"))
    shutil.copy(tiny_models["onnx"], folder / "mine.onnx")
    (folder / "job.yaml").write_text("models: [mine.onnx]\nworkload: {type: benchmark, iterations: 3, warmup: 1}\n"
                                     "sim: {backend: process, memory: 512m}\n")
    env = {"FARM_TOKEN": CLIENT}
    run = cluster.farm("submit", str(folder / "job.yaml"), "--controller", cluster.address, "--detach", "--json", env=env)
    assert run.returncode == 0, run.stderr
    job = json.loads(run.stdout)["job"]
    again = cluster.farm("submit", str(folder / "job.yaml"), "--controller", cluster.address, "--detach", env=env)
    assert again.returncode == 0, again.stderr
    shutil.rmtree(folder)  # gone before any agent looks: the controller has its own copy
    assert len(re.findall(r"artifact [0-9a-f]{12} stored", cluster.processes[0].output())) == 1  # then deduplicated
    token_file = tmp_path / "agent.token"
    token_file.write_text(AGENT)
    token_file.chmod(0o600)
    cluster.start_agent("rack1", "--token-file", str(token_file), "--backend", "process")
    results = cluster.farm("results", str(job), "--format", "json", "--controller", cluster.address, env=env)
    wait_for(lambda: json.loads(cluster.farm("results", str(job), "--format", "json", "--controller", cluster.address,
                                             env=env).stdout)[0]["status"] == "completed", 120, "the uploaded job to run")
    records = json.loads(cluster.farm("results", str(job), "--format", "json", "--controller", cluster.address,
                                      env=env).stdout)
    assert results.returncode == 0
    assert records[0]["model"]["path"] == str(folder / "mine.onnx")  # shown as the user has it
    assert records[0]["model"]["sha256"] == _sha(tiny_models["onnx"])


SNOOP = r"""
import glob, json, os, sys
found = []
def grab(path):
    try:
        with open(path, "rb") as f:
            found.append(f"{path}: " + f.read(4096).decode("utf-8", "replace").replace("\0", " "))
    except Exception as e:
        found.append(f"{path}: {type(e).__name__}")
for path in sorted(glob.glob("/proc/[0-9]*/cmdline") + glob.glob("/proc/[0-9]*/environ")):
    grab(path)
grab(sys.argv[2])
grab(sys.argv[1])
print("pids seen:", len(glob.glob("/proc/[0-9]*")), "uid:", os.getuid(), "env:", json.dumps(dict(os.environ)))
for line in found:
    print(line)
sys.exit(3)
"""


@pytest.mark.skipif(not ROOT_ONLY, reason="running jobs as another user needs root")
def test_a_script_cannot_read_a_0600_file_or_the_agent_token(lab, tmp_path: Path, tiny_models) -> None:
    cluster, _, _ = lab
    secret_dir = Path(tempfile.mkdtemp(prefix="farm-secret-", dir="/var/lib"))
    try:
        secret_dir.chmod(0o755)  # only the file's own mode protects it
        secret = secret_dir / "secret.txt"
        secret.write_text("TOP-SECRET-0600-CONTENTS")
        secret.chmod(0o600)
        token_file = secret_dir / "agent.token"
        token_file.write_text(AGENT)
        token_file.chmod(0o600)
        job_dir = tmp_path / "snoop"
        (job_dir / "script").mkdir(parents=True)
        shutil.copy(tiny_models["onnx"], job_dir / "tiny.onnx")
        (job_dir / "script" / "snoop.py").write_text(SNOOP)
        (job_dir / "job.yaml").write_text(
            f"models: [tiny.onnx]\nworkload: {{type: script, script: snoop.py, dir: script, "
            f"args: [{json.dumps(str(secret))}, {json.dumps(str(token_file))}]}}\nsim: {{backend: process}}\n")
        # the plain client role may not submit scripts on this controller; client+script may
        refused = cluster.farm("submit", str(job_dir / "job.yaml"), "--controller", cluster.address, "--detach",
                               env={"FARM_TOKEN": CLIENT})
        assert refused.returncode == 2 and "`script` permission" in refused.stderr, refused.stderr
        # one agent with its token in the environment (read, then removed), one with a token file
        cluster.spawn("agent-env", "agent", "--controller", cluster.address, "--name", "env-agent", "--work-dir",
                      str(tmp_path / "work-env"), "--backend", "process", env={"FARM_TOKEN": AGENT})
        run = cluster.farm("submit", str(job_dir / "job.yaml"), "--controller", cluster.address, "--json",
                           env={"FARM_TOKEN": SCRIPTER}, timeout=180)
        assert run.returncode == 1, run.stderr  # the script exits 3: a job failure
        record = json.loads(run.stdout)["results"][0]
        assert record["failure_class"] == "job" and "exited with status 3" in record["message"]
        with cluster.db() as db:
            stored = json.dumps(db.execute("SELECT * FROM runs").fetchall())
        # it ran, as a uid of its own from the agent's run range, and was refused
        first, count = run_uid_range()
        uid = re.search(r"uid: (\d+)", stored)
        assert uid is not None and first <= int(uid.group(1)) < first + count and "PermissionError" in stored
        for leak in ("TOP-SECRET-0600-CONTENTS", AGENT):
            assert leak not in stored and leak not in run.stdout and leak not in run.stderr
        assert "pids seen: 2" in stored or "pids seen: 1" in stored  # its own PID namespace: no agent to look at
    finally:
        shutil.rmtree(secret_dir)


@pytest.fixture
def unprivileged_user():
    name = f"farmu{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)


@pytest.mark.skipif(not ROOT_ONLY, reason="needs root to create a user")
def test_an_unprivileged_client_cannot_make_the_controller_or_an_agent_read_its_files(lab, unprivileged_user) -> None:
    cluster, root, _ = lab
    user = unprivileged_user
    home = Path(tempfile.mkdtemp(prefix="farm-user-"))
    try:
        os.chown(home, user.pw_uid, user.pw_gid)
        secret = Path(tempfile.mkdtemp(prefix="farm-root-", dir="/var/lib")) / "root-only.onnx"
        secret.parent.chmod(0o755)
        shutil.copy(root / "good.onnx", secret)
        secret.chmod(0o600)
        job = home / "job.yaml"
        job.write_text(f"models: [{secret}]\n")
        os.chown(job, user.pw_uid, user.pw_gid)
        as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
        env = {**os.environ, **cluster.env, "FARM_TOKEN": CLIENT, "HOME": str(home), "FARM_CONFIG": str(home / "c.toml")}
        # the CLI, as that user: it resolves the model on its side, where it cannot read it
        run = subprocess.run([*as_user, sys.executable, "-m", "farm.cli.main", "submit", str(job), "--controller",
                              cluster.address, "--detach"], capture_output=True, text=True, env=env, cwd=home, timeout=120)
        assert run.returncode == 2 and "cannot be read" in run.stderr, run.stderr
        # a raw stub, as that user: naming the path, or its hash, gets nothing read on the controller's side
        probe = f"""
import grpc, hashlib
from farm.proto.generated import farm_pb2, farm_pb2_grpc
stub = farm_pb2_grpc.FarmServiceStub(grpc.insecure_channel({cluster.address!r}))
md = [("authorization", "Bearer {CLIENT}")]
for request in (farm_pb2.SubmitJobRequest(job_yaml="models: [{secret}]\\n", base_dir="/"),
                farm_pb2.SubmitJobRequest(job_yaml="models: [x.onnx]\\n", base_dir="/", models=[farm_pb2.JobModel(
                    entry=0, name="x", sha256="{_sha(secret)}", source="{secret}")])):
    try:
        stub.SubmitJob(request, metadata=md, timeout=30)
        print("ACCEPTED")
    except grpc.RpcError as e:
        print(e.code().name, e.details())
"""
        answer = subprocess.run([*as_user, sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                                cwd=home, timeout=120)
        assert "ACCEPTED" not in answer.stdout, answer.stdout
        assert "outside this controller's models roots" in answer.stdout, answer.stdout + answer.stderr
        assert "no uploaded file with sha256" in answer.stdout, answer.stdout
        assert list((cluster.root / "controller-artifacts").iterdir()) == []
        shutil.rmtree(secret.parent)
    finally:
        shutil.rmtree(home)


def test_a_model_replaced_after_submit_fails_the_run_naming_both_hashes(lab, tmp_path: Path, tiny_models) -> None:
    """The agent hashes what it is about to run: its cache (or a shared path) changed -> a `job` failure."""
    cluster, _, _ = lab
    folder = tmp_path / "replaced"
    folder.mkdir()
    shutil.copy(tiny_models["onnx"], folder / "m.onnx")
    (folder / "job.yaml").write_text("models: [m.onnx]\nworkload: {type: benchmark, iterations: 3, warmup: 1}\n"
                                     "sim: {backend: process, memory: 512m}\n")
    run = cluster.farm("submit", str(folder / "job.yaml"), "--controller", cluster.address, "--detach", "--json",
                       env={"FARM_TOKEN": CLIENT})
    assert run.returncode == 0, run.stderr
    job = json.loads(run.stdout)["job"]
    submitted = _sha(tiny_models["onnx"])
    cache = tmp_path / "work-rack2" / "artifacts"
    cache.mkdir(parents=True)
    shutil.copy(tiny_models["tflite"], cache / f"{submitted}.onnx")  # someone swapped the file under the agent
    token_file = tmp_path / "agent.token"
    token_file.write_text(AGENT)
    cluster.start_agent("rack2", "--token-file", str(token_file), "--backend", "process")

    def finished() -> dict | None:
        out = cluster.farm("results", str(job), "--format", "json", "--controller", cluster.address,
                           env={"FARM_TOKEN": CLIENT})
        records = json.loads(out.stdout) if out.returncode == 0 else []
        return records[0] if records and records[0]["status"] == "failed" else None

    record = wait_for(finished, 120, "the run to fail")
    assert record["failure_class"] == "job"
    assert submitted in record["message"] and _sha(tiny_models["tflite"]) in record["message"], record["message"]
    assert record["attempts"] == 1  # a job failure is never retried


def test_embedded_a_model_replaced_between_submit_and_run_is_not_measured(tmp_path: Path, tiny_models) -> None:
    """The same check where the file is read in place (embedded mode, a device run): both hashes named."""
    from farm.client.runner import run_job_embedded
    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import load_job
    from farm.controller.store import SQLiteStore as Store

    shutil.copy(tiny_models["onnx"], tmp_path / "m.onnx")
    job_file = tmp_path / "job.yaml"
    job_file.write_text("models: [m.onnx]\nworkload: {type: benchmark, iterations: 3, warmup: 1}\n"
                        "sim: {backend: process}\n")
    store = Store(tmp_path / "farm.db")
    job_id = Controller(store).submit(load_job(job_file))
    submitted = _sha(tmp_path / "m.onnx")
    (tmp_path / "m.onnx").write_bytes(tiny_models["onnx"].read_bytes() + b"\0tampered")
    run_job_embedded(store, job_id)
    run = store.query("SELECT status, failure_class, message FROM runs WHERE job_id = ?", [job_id])
    assert len(run) == 1 and run[0]["status"] == "failed" and run[0]["failure_class"] == "job"
    assert submitted in run[0]["message"] and _sha(tmp_path / "m.onnx") in run[0]["message"], run[0]["message"]
    store.close()


def test_script_folders_pack_plain_files_and_unpack_only_inside(tmp_path: Path) -> None:
    from farm.proto.script_archive import ScriptArchiveError, pack_dir, unpack

    folder = tmp_path / "script"
    (folder / "lib").mkdir(parents=True)
    (folder / "run.py").write_text("print(1)\n")
    (folder / "lib" / "util.py").write_text("X = 1\n")
    (tmp_path / "outside.txt").write_text("the packer's own file\n")
    os.symlink(tmp_path / "outside.txt", folder / "data.txt")  # a link to a file: packed as that file
    archive = tmp_path / "a.tar"
    archive.write_bytes(pack_dir(folder))
    assert pack_dir(folder) == archive.read_bytes()  # deterministic: the same folder, the same sha256
    out = tmp_path / "out"
    out.mkdir()
    unpack(archive, out)
    assert (out / "data.txt").read_text() == "the packer's own file\n" and not (out / "data.txt").is_symlink()
    assert (out / "lib" / "util.py").read_text() == "X = 1\n"

    os.mkfifo(folder / "pipe")
    with pytest.raises(ScriptArchiveError, match="not a regular file or folder"):
        pack_dir(folder)
    (folder / "pipe").unlink()
    with pytest.raises(ScriptArchiveError, match="over 0 MiB"):
        pack_dir(folder, max_bytes=1000)

    # an archive made elsewhere, with a hard link out of the run directory: refused as the agent unpacks
    hostile = tmp_path / "hostile.tar"
    with tarfile.open(hostile, "w") as tar:
        link = tarfile.TarInfo("shadow")
        link.type, link.linkname = tarfile.LNKTYPE, "/etc/shadow"
        tar.addfile(link)
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(ScriptArchiveError, match="link, device or pipe"):
        unpack(hostile, target)
    assert list(target.iterdir()) == []


@pytest.mark.skipif(not ROOT_ONLY, reason="running jobs as another user needs root")
def test_a_script_that_swaps_its_output_file_for_a_link_gets_only_its_own_output(tmp_path: Path, farm) -> None:
    """The agent reads the run's output through the file it opened, never by a path the run could replace."""
    import sqlite3

    from farm.model_generators.generate import write_tiny_onnx

    write_tiny_onnx(tmp_path / "tiny.onnx")
    (tmp_path / "script").mkdir()
    (tmp_path / "script" / "swap.py").write_text(
        "import os\n"
        "print('swapped the log for a link', flush=True)\n"
        "os.unlink('../sandbox-output.log')\n"
        "os.symlink('/etc/shadow', '../sandbox-output.log')\n"
        "os.symlink('/etc/shadow', '../out.json.tmp')\n"
        "raise SystemExit(1)\n")
    (tmp_path / "job.yaml").write_text("models: [tiny.onnx]\nworkload: {type: script, script: swap.py, dir: script}\n"
                                       "sim: {backend: process}\n")
    run = farm("submit", str(tmp_path / "job.yaml"), "--json")
    assert run.returncode == 1, run.stderr
    with sqlite3.connect(tmp_path / "farm.db") as db:
        message, log_tail = db.execute("SELECT message, log_tail FROM runs").fetchone()
    assert "swapped the log for a link" in log_tail
    shadow_head = Path("/etc/shadow").read_text().split(":", 1)[0] + ":"
    for text in (message, log_tail, run.stdout):
        assert shadow_head not in text and "$y$" not in text and "$6$" not in text
