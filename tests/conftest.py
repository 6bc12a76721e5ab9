"""Shared fixtures: a private store per test, small models, and running the real `farm` CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The fits and checks here multiply matrices of ten rows: BLAS threads spinning on them cost ~50 % more CPU than one
# thread (measured: 1.5 vs 1.0 CPU-s for ten calibrations), and `make test`'s two workers already fill both cores.
# Set before numpy loads; processes the tests start inherit it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# A worker hosts in-process controllers and agents (gRPC threads running) and starts processes beside them: with
# gRPC's fork handlers on, a child can die before exec (`epoll_wait error: Bad file descriptor`, grpc/grpc#43055; a
# controller process started so exited in a run beside two hogs). farm's own processes turn them off the same way
# (cli/remote.py, client/remote.py); here before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest

from farm.agents.sandbox import backend_class

FARM = [sys.executable, "-m", "farm.cli.main"]


@dataclass
class FarmRun:
    returncode: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


@pytest.fixture
def farm_db(tmp_path: Path) -> Path:
    return tmp_path / "farm.db"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--farm-subprocess", action="store_true", default=False,
                     help="run every `farm` fixture call as a real process (python -m farm.cli.main), not in-process")


SUBPROCESS_CLI = False  # pytest --farm-subprocess: helpers outside the `farm` fixture (grpc_processes) read it


def pytest_configure(config: pytest.Config) -> None:
    global SUBPROCESS_CLI
    SUBPROCESS_CLI = bool(config.getoption("--farm-subprocess"))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs pytest-xdist workers (-n 2)
        # a worker is started with COLUMNS=80 / LINES=24 in its environment, which a console without a terminal
        # takes as its width: tables lose the columns tests read. Without them, as under a plain pytest.
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)


# Wall seconds of the longest test files (benchmarks/results/2026-11-28-suite-session4.md; files split or cut since
# by their results files, suite-cpu-a/-b).
# `make test` hands files to its two workers in collection order (`--dist loadfile --no-loadscope-reorder`): the
# longest go first so no worker is left alone with one at the end (xdist's default order, most tests first, put the
# two-test wheel file and the five-test VM file last). Unlisted files follow, most tests first; a stale figure only
# costs balance. test_sim_budget (100 s) is left out on purpose: its budget tests judge CPU shares, and at the head
# of the queue they ran beside the emulated boards and the VM (three failed there, passed alone).
LONGEST_FILES_S = {
    "test_board_aarch64_jetson.py": 160, "test_sim_cgroup_v2_vm.py": 121, "test_contention.py": 101,
    "test_board_aarch64_family.py": 90, "test_benchmarks_run.py": 76,
    "test_board_aarch64.py": 70, "test_corpus.py": 67, "test_postgres_store.py": 65, "test_board_aarch64_wheels.py": 60,
    "test_grpc_cluster.py": 58, "test_calibration_choice.py": 53, "test_web_dashboard.py": 50,
    "test_wheel_install.py": 50, "test_jetson_experiment.py": 35, "test_hostile_files.py": 25,
}


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    per_file: dict[str, int] = {}
    for item in items:
        per_file[item.path.name] = per_file.get(item.path.name, 0) + 1
    first_seen = {name: n for n, name in enumerate(dict.fromkeys(item.path.name for item in items))}
    items.sort(key=lambda item: (-LONGEST_FILES_S.get(item.path.name, 0), -per_file[item.path.name],
                                 first_seen[item.path.name]))


def _farm_subprocess(farm_db: Path, tmp_path: Path):
    def run(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None) -> FarmRun:
        full_env = {**os.environ, "FARM_DB": str(farm_db), **(env or {})}
        p = subprocess.run([*FARM, *args], cwd=cwd or tmp_path, capture_output=True, text=True,
                           timeout=timeout, env=full_env)
        return FarmRun(p.returncode, p.stdout, p.stderr)

    return run


@pytest.fixture
def farm_process(farm_db: Path, tmp_path: Path):
    """Run the real CLI in a subprocess, as a user would, against this test's store: for tests where the
    process is the point (mark them `process`)."""
    return _farm_subprocess(farm_db, tmp_path)


@pytest.fixture
def farm(request: pytest.FixtureRequest, farm_db: Path, tmp_path: Path):
    """Run the real CLI against this test's store: `farm.cli.main.main(argv)` in this process with its own env,
    cwd and captured streams (tests/cli_inprocess.py, issue 34); a real process with `pytest --farm-subprocess`
    or in a test marked `process`. `timeout` bounds a subprocess only (pytest-timeout bounds the in-process call)."""
    if request.config.getoption("--farm-subprocess") or request.node.get_closest_marker("process"):
        return _farm_subprocess(farm_db, tmp_path)
    from cli_inprocess import run_farm_inprocess

    def run(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None) -> FarmRun:
        return run_farm_inprocess(*args, cwd=cwd or tmp_path, env={"FARM_DB": str(farm_db), **(env or {})})

    return run


@pytest.fixture
def farm_inprocess(farm):
    """The `farm` fixture under its older name (it was the in-process one before `farm` became in-process)."""
    return farm


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from farm.model_generators.generate import write_tiny_onnx, write_tiny_tflite
    from model_fixtures import write_corrupt_tflite, write_unsupported_op_onnx, write_unsupported_op_tflite
    d = tmp_path_factory.mktemp("models")
    return {
        "tflite": write_tiny_tflite(d / "tiny.tflite"),
        "onnx": write_tiny_onnx(d / "tiny.onnx"),
        "corrupt_tflite": write_corrupt_tflite(d / "corrupt.tflite"),
        "unsupported_tflite": write_unsupported_op_tflite(d / "custom_op.tflite"),
        "unsupported_onnx": write_unsupported_op_onnx(d / "custom_op.onnx"),
    }


@pytest.fixture(scope="session")
def farm_wheel(tmp_path_factory) -> Path:
    """farm built as a wheel from this checkout, once per tree (tests/wheel_cache.py: cached by the content hash of
    what goes into it, so xdist workers and later runs of an unchanged tree share one build)."""
    from wheel_cache import cached_wheel
    return cached_wheel(Path(__file__).resolve().parents[1], tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="session")
def mobilenet_models(tmp_path_factory) -> dict[str, Path]:
    """A small real family: MobileNetV2 at two widths, input 96, both formats."""
    from farm.model_generators.generate import generate_examples
    d = tmp_path_factory.mktemp("mobilenet")
    models = generate_examples(d, widths=[0.35, 1.0], input_sizes=[96], zoo=False)
    return {m.path.name: m.path for m in models}


def require_backend(name: str) -> None:
    """Skip, with the reason printed, when a backend cannot run here (docker: after trying to start the engine)."""
    if name == "docker":
        from docker_engine import ensure_engine
        reason = ensure_engine()
        if reason:
            pytest.skip(f"docker backend unavailable: {reason}")
    reason = backend_class(name).unavailable_reason()
    if reason:
        pytest.skip(f"{name} backend unavailable: {reason}")


def write_job(directory: Path, text: str, name: str = "job.yaml", on_contention: str | None = "flag") -> Path:
    """The job file; a sim job that names no contention policy gets `on_contention: flag` (a loaded test machine
    must not make a test measure its runs again): pass on_contention=None where the policy is what is tested."""
    path = directory / name
    path.write_text(with_contention_policy(text, on_contention) if on_contention else text)
    return path


def with_contention_policy(text: str, policy: str) -> str:
    """`text` with sim.on_contention set to `policy` where the job runs on the sim and sets none. Only a flow-style
    `sim: {...}` line is edited, or `sim: {on_contention: ...}` appended when there is no sim key (a device run's
    sim twin too): no other line moves, so a message naming a line still names it. Anything else (not a job,
    bad YAML, a block-style sim section) is written as given."""
    import re

    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(data, dict) or "models" not in data:  # not a job (a devices file, a bad one)
        return text
    sim = data.get("sim")
    if "sim" not in data:
        return text + ("" if text.endswith("\n") else "\n") + f"sim: {{on_contention: {policy}}}\n"
    if not isinstance(sim, dict) or "on_contention" in sim:
        return text
    edited, count = re.subn(r"^sim:[ \t]*\{[ \t]*(?=\S)", lambda m: m.group(0) + f"on_contention: {policy}" +
                            ("" if text[m.end():].startswith("}") else ", "), text, count=1, flags=re.M)
    if count != 1:
        return text
    try:
        again = yaml.safe_load(edited)
    except yaml.YAMLError:
        return text
    return edited if again == {**data, "sim": {**sim, "on_contention": policy}} else text


@pytest.fixture(scope="module")
def board():
    """A Jetson-like board: Debian's sshd on a loopback port with fake Jetson tools on its PATH."""
    from sshd_peer import SshdUnavailable, sshd_peer
    try:
        with sshd_peer() as peer:
            yield peer
    except SshdUnavailable as e:
        print(f"skipping: {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def postgres_peer():
    """One private PostgreSQL server for the whole session (tests/postgres_server.py); each test that needs a
    store makes a fresh database on it (fresh_postgres_url). Skipped with the reason when it cannot run."""
    from postgres_server import postgres_server_or_skip

    with postgres_server_or_skip() as server:
        yield server


def fresh_postgres_url(peer, name: str) -> str:
    """A new empty database on the peer (dropped first if a failed run left it), as a postgresql:// URL."""
    import re

    import psycopg

    database = "t_" + re.sub(r"[^a-z0-9_]", "_", name.lower())[-50:]
    with psycopg.connect(peer.url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{database}" TEMPLATE template0')
    return f"postgresql://{peer.user}@{peer.host}:{peer.port}/{database}"
