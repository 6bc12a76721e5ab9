"""Moving from Auptimizer: `farm import auptimizer` turns its env.template into a job, and the job's
`sim.build` image is built through the Engine API, cached by content hash, and used by the run.

The env files in tests/fixtures/auptimizer/ are shaped like the published benchmark and MNIST
examples. Nothing can be pulled here, so images start from farm's own imported base image (or,
for a Dockerfile with RUN, from a base the test imports with the host's dash and libc); pip
installs come from a wheel the test writes (--no-index). apt (it needs the network to fetch
packages) is not run here.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import uuid
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import require_backend

FIXTURES = Path(__file__).parent / "fixtures" / "auptimizer"


def write_wheel(folder: Path, name: str = "benchhelper", version: str = "1.0", source: str = "ITERATIONS = 20\n") -> Path:
    """A pure-Python wheel made by hand, so pip can install it with --no-index (no network, no build backend)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": source.encode(),
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: farm-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
              for p, d in files.items()]
    files[f"{dist}/RECORD"] = ("\n".join([*record, f"{dist}/RECORD,,"]) + "\n").encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
    return path


@pytest.fixture
def bench_dir(tmp_path: Path, tiny_models: dict[str, Path]) -> Path:
    """The benchmark example's folder, its wheel, and two models beside it, as a user would have them."""
    folder = tmp_path / "bench"
    shutil.copytree(FIXTURES / "benchmark", folder)
    write_wheel(folder / "wheels")
    (folder / "nonce.txt").write_text(uuid.uuid4().hex)  # a folder no earlier test built from: a fresh cache key
    for name in ("a.tflite", "b.tflite"):
        shutil.copy(tiny_models["tflite"], tmp_path / name)
    return folder


def submit_json(farm, job: Path) -> tuple[int, dict]:
    run = farm("submit", str(job), "--json", timeout=900)
    try:
        return run.returncode, run.json()
    except json.JSONDecodeError:
        raise AssertionError(f"submit printed no JSON (exit {run.returncode}): {run.stderr[-2000:]}") from None


def notes_by_variable(result) -> dict[str, list[str]]:
    notes: dict[str, list[str]] = {}
    for note in result.json()["notes"]:
        notes.setdefault(note["field"], []).append(note["message"])
    return notes


# --- conversion ------------------------------------------------------------------------------


def test_benchmark_env_maps_every_variable_and_notes_what_it_cannot_carry(farm, bench_dir: Path, tmp_path: Path) -> None:
    r = farm("import", "auptimizer", str(bench_dir / "env.template"), "-m", "a.tflite,b.tflite",
             "-o", str(bench_dir / "job.yaml"), "--pip-wheels", "wheels", "--json")
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load((bench_dir / "job.yaml").read_text())
    assert job["models"] == ["../a.tflite", "../b.tflite"]
    assert job["workload"] == {"type": "script", "command": "python", "script": "bench.py", "args": ["{model}"], "dir": "."}
    assert job["sim"] == {"backend": "docker", "cpus": 1.0, "memory": "1g", "cpuset": "0",
                          "build": {"pip": ["benchhelper==1.0"], "pip_wheels": "wheels",
                                    "run": ["mkdir -p /opt/bench && echo ready > /opt/bench/prerun.txt"]},
                          "image": "tensorflow/tensorflow:2.3.0"}
    notes = notes_by_variable(r)
    assert "becomes sim.image" in notes["IMAGEREPO"][0] and "into a venv" in notes["IMAGEREPO"][0]
    for dropped in ("SAMPLETIME", "OUTPUTFILE"):
        assert any("not carried" in m for m in notes[dropped]), notes
    assert "sim.cpuset" in notes["DOCK_ARGS"][0]
    assert "once when the image is built" in notes["PRERUN"][0]
    lines = {n["field"]: n["line"] for n in r.json()["notes"]}
    assert lines["IMAGEREPO"] == 3 and lines["OUTPUTFILE"] == 11  # file:line of each variable
    assert "# note: " + str(bench_dir / "env.template") + ":3: IMAGEREPO: becomes sim.image" in (bench_dir / "job.yaml").read_text()
    r = farm("import", "auptimizer", str(bench_dir / "env.template"), "-m", "a.tflite", "--host-python", "--force",
             "-o", str(bench_dir / "job.yaml"), "--pip-wheels", "wheels", "--json")
    assert "image" not in yaml.safe_load((bench_dir / "job.yaml").read_text())["sim"]
    assert "not carried (--host-python)" in notes_by_variable(r)["IMAGEREPO"][0]


def test_mnist_env_with_export_expansion_bare_bytes_and_the_docker_args_alias(farm, tmp_path: Path) -> None:
    folder = tmp_path / "mnist"
    shutil.copytree(FIXTURES / "mnist", folder)
    r = farm("import", "auptimizer", str(folder / "env.template"), "-o", str(folder / "job.yaml"))
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load((folder / "job.yaml").read_text())
    assert job["workload"] == {"type": "script", "command": "python", "args": ["-u", "mnist.py"], "dir": "mnist_code"}
    assert job["models"] == ["mnist_code/mnist.py"]  # no -m: the script stands as the one model
    assert job["sim"] == {"backend": "docker", "cpus": 1.0, "memory": "536870912b", "build": {"dockerfile": "Dockerfile"}}
    assert "DOCKER_ARGS: read as DOCK_ARGS" in r.stderr
    assert "'--memory-swap=1g' is not carried" in r.stderr and "'--rm' is not carried" in r.stderr
    assert "./mnist_code/out.txt" in r.stderr  # OUTPUTFILE=$DIR/out.txt, expanded from the file's own DIR


def test_models_from_a_list_file_are_relative_to_it(farm, bench_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "list.txt").write_text("# the benchmark's models\na.tflite\n\nb.tflite\n")
    r = farm("import", "auptimizer", str(bench_dir / "env.template"), "-f", str(tmp_path / "list.txt"),
             "-o", str(tmp_path / "job.yaml"), cwd=bench_dir)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load((tmp_path / "job.yaml").read_text())["models"] == ["a.tflite", "b.tflite"]


HOSTILE = {
    "unterminated quote": ('DIR="."\nSCRIPT="bench.py\nCOMMAND=python\n', 2, "SCRIPT", "never closed"),
    "command substitution": ("DIR=.\nSCRIPT=$(rm -rf /tmp/x)\n", 2, "SCRIPT", "not run by farm"),
    "backticks": ("DIR=.\nCOMMAND=`id`\n", 2, "COMMAND", "not run by farm"),
    "an unquoted second word": ("DIR=.\nCOMMAND=python bench.py\n", 2, "COMMAND", "quote the whole value"),
    "a pipe": ("DIR=.\nPRERUN=hi|sh\n", 2, "PRERUN", "would make a shell run something"),
    "not an assignment": ("DIR=.\nrm -rf /\n", 2, "", "not an assignment"),
    "an unset variable": ("DIR=$FARM_SURELY_UNSET_42\n", 1, "DIR", "'${FARM_SURELY_UNSET_42}' is not a folder"),
    "a default expansion": ("DIR=${X:-.}\n", 1, "DIR", "only $NAME and ${NAME}"),
    "a missing DIR": ('DIR="no/such/folder"\nSCRIPT=bench.py\n', 1, "DIR", "is not a folder"),
    "a missing SCRIPT": ("DIR=.\nSCRIPT=nope.py\nCOMMAND=python\n", 2, "SCRIPT", "is not a file in DIR"),
    "a SCRIPT outside DIR": ("DIR=.\nSCRIPT=../a.tflite\n", 2, "SCRIPT", "outside DIR"),
    "memory without a unit that is too small": ("DIR=.\nSCRIPT=bench.py\nDOCKMEMORY=512\n", 3, "DOCKMEMORY", "below 1 MiB"),
    "memory that is not a size": ("DIR=.\nSCRIPT=bench.py\nDOCKMEMORY=lots\n", 3, "DOCKMEMORY", "not a memory size"),
    "cpus that are not a number": ("DIR=.\nSCRIPT=bench.py\nDOCKCPUS=two\n", 3, "DOCKCPUS", "not a number"),
    "a Dockerfile outside the env file's folder": ("DIR=wheels\nCOMMAND=python\nDOCFILE=../Dockerfile\n", 3, "DOCFILE",
                                                   "outside the env file's folder"),
    # N10: a hostile env file reads nothing outside its folder and packs nothing outside it
    "PIPREQUIREMENTS=/etc/shadow": ("DIR=.\nSCRIPT=bench.py\nPIPREQUIREMENTS=/etc/shadow\n", 3, "PIPREQUIREMENTS",
                                    "'/etc/shadow' is /etc/shadow, outside the env file's folder"),
    "pip -r a file outside": ("DIR=.\nSCRIPT=bench.py\nPIPREQUIREMENTS='-r ../../../etc/passwd'\n", 3,
                              "PIPREQUIREMENTS", "outside the env file's folder"),
    "pip -r a file in home": ("DIR=.\nSCRIPT=bench.py\nPIPREQUIREMENTS='-r ~/secrets.txt'\n", 3,
                              "PIPREQUIREMENTS", "outside the env file's folder"),
    "DIR=~": ("DIR=~\nSCRIPT=bench.py\n", 1, "DIR", "your home folder"),
    "DIR above the env file": ("DIR=..\nSCRIPT=bench/bench.py\n", 1, "DIR", "outside the env file's folder"),
    "DIR absolute elsewhere": ("DIR=/etc\nSCRIPT=passwd\n", 1, "DIR", "'/etc' is /etc, outside the env file's folder"),
    "a pip option smuggled in": ("DIR=.\nSCRIPT=bench.py\nPIPREQUIREMENTS='--pre numpy'\n", 3, "PIPREQUIREMENTS",
                                 "pip options are not taken"),
    "an apt name that is an option": ("DIR=.\nSCRIPT=bench.py\nAPTREQUIREMENTS='-o=x curl'\n", 3, "APTREQUIREMENTS",
                                      "not a Debian package name"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_env_files_are_refused_with_file_line_and_variable(farm, bench_dir: Path, case: str) -> None:
    text, line, variable, message = HOSTILE[case]
    env = bench_dir / "hostile.template"
    env.write_text(text)
    r = farm("import", "auptimizer", str(env), "-o", str(bench_dir / "out.yaml"), "--json")
    assert r.returncode == 2, (r.stdout, r.stderr)
    problem = r.json()["problems"][0]
    assert message in problem["message"], problem
    assert problem["file"] == str(env) and problem["line"] == line and (problem["field"] or "") == variable, problem
    assert not (bench_dir / "out.yaml").exists()  # nothing written


def test_huge_binary_and_missing_files_are_refused(farm, bench_dir: Path, tmp_path: Path) -> None:
    huge = tmp_path / "huge.template"
    huge.write_text("# padding\n" * 200_000)
    binary = tmp_path / "binary.template"
    binary.write_bytes(b"DIR=.\n\x00\x01ELF")
    for env, message in ((huge, "over 1 MiB"), (binary, "NUL byte"), (tmp_path / "absent.template", "no such env file"),
                         (tmp_path, "is a folder")):
        r = farm("import", "auptimizer", str(env), "-o", str(tmp_path / "out.yaml"))
        assert r.returncode == 2 and message in r.stderr, (env, r.stderr)
    r = farm("import", "auptimizer", str(bench_dir / "env.template"), "-m", "a.tflite,missing.tflite",
             "-o", str(tmp_path / "out.yaml"), cwd=tmp_path)
    assert r.returncode == 2 and "missing.tflite" in r.stderr and "does not exist" in r.stderr, r.stderr
    (tmp_path / "list.txt").write_text("a.tflite\ngone.tflite\n")
    r = farm("import", "auptimizer", str(bench_dir / "env.template"), "-f", str(tmp_path / "list.txt"),
             "-o", str(tmp_path / "out.yaml"))
    assert r.returncode == 2 and f"{tmp_path / 'list.txt'}:2" in r.stderr, r.stderr
    assert not (tmp_path / "out.yaml").exists()


def test_unknown_variables_and_repeats_are_notes_not_errors(farm, bench_dir: Path) -> None:
    env = bench_dir / "extra.template"
    env.write_text("DIR=.\nSCRIPT=bench.py\nGPUS=all\nSCRIPT=bench.py\nexport OTHER='x y'\n")
    r = farm("import", "auptimizer", str(env), "-m", "a.tflite", "-o", str(bench_dir / "job.yaml"), "--json")
    assert r.returncode == 0, r.stderr
    notes = {(n["field"], n["line"]): n["message"] for n in r.json()["notes"]}
    assert "not an Auptimizer profiler variable" in notes[("GPUS", 3)]
    assert "not an Auptimizer profiler variable" in notes[("OTHER", 5)]
    assert "first on line 2" in notes[("SCRIPT", 4)]


def test_control_characters_in_values_reach_neither_the_terminal_nor_the_job_file_raw(farm, bench_dir: Path) -> None:
    env = bench_dir / "escape.template"
    env.write_text("DIR=.\nSCRIPT=bench.py\nOUTPUTFILE='out\x1b[2J\u2028x: 1.txt'\n")
    r = farm("import", "auptimizer", str(env), "-m", "a.tflite", "-o", str(bench_dir / "job.yaml"))
    assert r.returncode == 0, r.stderr
    written = (bench_dir / "job.yaml").read_text()
    for text in (r.stderr, written):
        assert "\x1b" not in text and "\u2028" not in text and "out\\x1b[2J\\u2028x: 1.txt" in text
    assert yaml.safe_load(written)["models"] == ["../a.tflite"]  # the comment did not break into YAML


# --- sim.build at submit ---------------------------------------------------------------------


def test_a_build_with_a_dockerfile_outside_the_folder_is_refused_at_submit(farm, tmp_path: Path, tiny_models) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "run.py").write_text("print(1)\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"models: [{tiny_models['tflite']}]\nworkload: {{type: script, script: run.py, dir: code}}\n"
                   "sim:\n  backend: docker\n  build:\n    dockerfile: Dockerfile\n")
    r = farm("submit", str(job))
    assert r.returncode == 2 and f"{job}:6: sim.build.dockerfile" in r.stderr, r.stderr
    job.write_text(f"models: [{tiny_models['tflite']}]\nsim:\n  build:\n    run: [echo hi]\n")
    r = farm("submit", str(job))
    assert r.returncode == 2 and "backend: docker" in r.stderr, r.stderr


# --- end to end on the docker backend ---------------------------------------------------------


@pytest.mark.docker
def test_converted_benchmark_job_builds_its_image_runs_and_reuses_it(farm, bench_dir: Path) -> None:
    require_backend("docker")
    r = farm("import", "auptimizer", str(bench_dir / "env.template"), "-m", "../a.tflite,../b.tflite",
             "-o", str(bench_dir.parent / "job.yaml"), "--pip-wheels", "wheels", "--host-python", cwd=bench_dir)
    assert r.returncode == 0, r.stderr
    code, first = submit_json(farm, bench_dir.parent / "job.yaml")
    # bench.py exits non-zero unless the wheel (pip) and the PRERUN file are in the image
    assert code == 0, first
    builds = [run["image_build"] for run in first["results"]]
    assert all(run["status"] == "completed" and run["backend"] == "docker" for run in first["results"]), first
    # built once, for whichever model ran first (a run retried for contention finds it cached, so its log tells)
    assert builds[0]["image"] == builds[1]["image"] and builds[0]["image"].startswith("farm-build:")
    log = Path(builds[0]["log"]).read_text()
    assert "pip" in log and "Successfully installed benchhelper-1.0" in log and "prerun.txt" in log
    code, second = submit_json(farm, bench_dir.parent / "job.yaml")
    assert code == 0 and all(run["image_build"]["cached"] is True and run["image_build"]["image"] == builds[0]["image"]
                             for run in second["results"]), second  # the cache: no rebuild


@pytest.mark.docker
def test_converted_mnist_job_runs_in_the_image_its_dockerfile_builds(farm, tmp_path: Path) -> None:
    require_backend("docker")
    folder = tmp_path / "mnist"
    shutil.copytree(FIXTURES / "mnist", folder)
    assert farm("import", "auptimizer", str(folder / "env.template"), "-o", str(tmp_path / "job.yaml")).returncode == 0
    code, out = submit_json(farm, tmp_path / "job.yaml")
    # mnist.py reads the Dockerfile's COPY and ENV, and exits non-zero unless it learnt
    assert code == 0 and out["results"][0]["status"] == "completed", out
    assert out["results"][0]["limits"]["memory_mb"] == 512.0


def _shell_base_image() -> str:
    """An image with a shell of its own (the host's dash and the libraries it loads), so a Dockerfile's RUN can
    run at build time; it stands in for a distribution image, which cannot be pulled here."""
    import docker

    from farm.agents.sandbox.docker_image import IMAGE_PATH_ENV, build_rootfs_tar

    dash = Path(shutil.which("dash") or "/bin/dash").resolve()
    linked = [Path(word) for line in subprocess.run(["ldd", str(dash)], capture_output=True, text=True).stdout.splitlines()
              for word in line.split() if word.startswith("/")]
    files = {"usr/bin/sh": dash}
    for library in linked:  # merged-usr: /lib and /lib64 point into /usr, as in farm's base image
        files["usr" + str(library.resolve()).removeprefix("/usr")] = library.resolve()
        if library.parent.name == "lib64":
            files[f"usr/lib64/{library.name}"] = library.resolve()
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(build_rootfs_tar())) as base, tarfile.open(fileobj=out, mode="w") as tar:
        for member in base.getmembers():
            tar.addfile(member, base.extractfile(member) if member.isfile() else None)
        folders = sorted({"/".join(Path(name).parts[:i]) for name in files for i in range(2, len(Path(name).parts))})
        for folder in folders:
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, source in files.items():
            with open(source, "rb") as f:
                tar.addfile(tar.gettarinfo(str(source), arcname=name), f)
    client = docker.from_env(timeout=120)
    try:
        client.api.import_image_from_data(out.getvalue(), repository="farm-test-shell", tag="1",
                                          changes=[f"ENV PATH={IMAGE_PATH_ENV}"])
    finally:
        client.close()
    return "farm-test-shell:1"


@pytest.mark.docker
def test_a_dockerfile_with_copy_env_and_run_is_built_once_and_rebuilt_when_the_folder_changes(farm, tmp_path: Path,
                                                                                             tiny_models) -> None:
    require_backend("docker")
    base = _shell_base_image()
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    (code_dir / "data.txt").write_text("payload-1\n")
    (code_dir / "nonce.txt").write_text(uuid.uuid4().hex)  # a fresh cache key for this test
    (code_dir / "Dockerfile").write_text(f"FROM {base}\nCOPY data.txt /opt/app/data.txt\nENV APP_GREETING=hello-from-env\n"
                                         'RUN echo "$APP_GREETING" > /opt/app/from-run.txt\n')
    (code_dir / "check.py").write_text(
        "import os, sys\n"
        "assert open('/opt/app/from-run.txt').read().strip() == 'hello-from-env', 'RUN did not write'\n"
        "assert os.environ['APP_GREETING'] == 'hello-from-env', 'ENV is not in the run'\n"
        "print('data', open('/opt/app/data.txt').read().strip())\n"
        "assert open('/opt/app/data.txt').read().strip() == sys.argv[1], 'COPY is stale'\n")
    job = tmp_path / "job.yaml"

    def write(expected: str) -> None:
        job.write_text(f"models: [{tiny_models['tflite']}]\n"
                       f"workload: {{type: script, script: check.py, dir: code, args: [{expected}]}}\n"
                       "sim: {backend: docker, on_contention: flag, build: {dockerfile: Dockerfile}}\n")  # one attempt

    write("payload-1")
    code, first = submit_json(farm, job)
    assert code == 0, first
    built = first["results"][0]["image_build"]
    assert built["cached"] is False
    assert "Step 4/5 : RUN" in Path(built["log"]).read_text()
    code, second = submit_json(farm, job)
    assert code == 0 and second["results"][0]["image_build"]["cached"] is True
    assert second["results"][0]["image_build"]["image"] == built["image"]
    (code_dir / "data.txt").write_text("payload-2\n")  # what goes into the image changed: a new image
    write("payload-2")
    code, third = submit_json(farm, job)
    assert code == 0, third
    assert third["results"][0]["image_build"]["cached"] is False
    assert third["results"][0]["image_build"]["image"] != built["image"]


@pytest.mark.docker
def test_a_failing_build_is_a_job_failure_with_the_log_tail(farm, tmp_path: Path, tiny_models) -> None:
    require_backend("docker")
    job = tmp_path / "job.yaml"
    job.write_text(f"models: [{tiny_models['tflite']}]\n"
                   "sim:\n  backend: docker\n  build:\n    run: [\"printf 'boom-%s\\\\n' marker >&2; exit 7\"]\n")
    code, out = submit_json(farm, job)
    run = out["results"][0]
    assert code == 1 and run["status"] == "failed" and run["failure_class"] == "job", run
    assert "status 7" in run["message"] and "boom-marker" in run["message"] and "step" in run["message"], run


@pytest.mark.docker
def test_a_build_over_its_timeout_is_stopped_as_a_job_failure(farm, tmp_path: Path, tiny_models) -> None:
    require_backend("docker")
    job = tmp_path / "job.yaml"
    job.write_text(f"models: [{tiny_models['tflite']}]\n"
                   f"sim:\n  backend: docker\n  build:\n    run: ['echo {uuid.uuid4().hex}; sleep 120']\n    timeout: 2s\n")
    code, out = submit_json(farm, job)
    run = out["results"][0]
    assert code == 1 and run["failure_class"] == "job" and "ran over its timeout of 2 s" in run["message"], run
    assert run["image_build"] is None  # no image was made


@pytest.mark.docker
@pytest.mark.timeout(300)
def test_a_converted_job_builds_on_a_remote_agent_from_the_folder_the_controller_sent(tmp_path: Path) -> None:
    from grpc_processes import Cluster, wait_for

    require_backend("docker")
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none.toml")})
    try:
        shutil.copytree(FIXTURES / "mnist", tmp_path / "mnist")
        (tmp_path / "mnist" / "mnist_code" / "nonce.txt").write_text(uuid.uuid4().hex)  # a fresh cache key
        converted = cluster.farm("import", "auptimizer", str(tmp_path / "mnist" / "env.template"), "-o", str(tmp_path / "job.yaml"))
        assert converted.returncode == 0, converted.stderr
        cluster.start_controller("--no-auth")
        agent = cluster.start_agent("builder")
        wait_for(lambda: "connected to controller" in agent.output(), 30, "the agent to connect")
        remote = cluster.farm("submit", str(tmp_path / "job.yaml"), "--controller", str(cluster.address), "--json", timeout=240)
        assert remote.returncode == 0, (remote.stdout, remote.stderr, agent.output()[-2000:])
        run = json.loads(remote.stdout)["results"][0]
        assert run["status"] == "completed" and run["image_build"]["image"].startswith("farm-build:"), run
        assert Path(run["image_build"]["log"]).is_relative_to(tmp_path / "work-builder")  # kept on the agent
    finally:
        cluster.stop_all()


@pytest.mark.docker
def test_keep_image_starts_the_build_from_imagerepo_which_is_never_pulled(farm, bench_dir: Path) -> None:
    require_backend("docker")
    r = farm("import", "auptimizer", str(bench_dir / "env.template"), "-m", "../a.tflite", "--keep-image",
             "-o", str(bench_dir.parent / "job.yaml"), "--pip-wheels", "wheels", cwd=bench_dir)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load((bench_dir.parent / "job.yaml").read_text())["sim"]["build"]["base"] == "tensorflow/tensorflow:2.3.0"
    code, out = submit_json(farm, bench_dir.parent / "job.yaml")
    run = out["results"][0]
    assert code == 1 and run["failure_class"] == "job", run
    assert "'tensorflow/tensorflow:2.3.0' is not on this agent's Docker engine, and farm never pulls" in run["message"]
