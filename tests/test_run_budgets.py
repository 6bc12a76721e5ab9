"""A script's budget holds on every backend (issue 18, N5): its temp folders are memory counted within
sim.memory, and a pids limit stops a loop that starts threads without end; the failure says which limit.

Each runs through `farm submit` as a user would, for every backend that can run here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import require_backend, write_job
from farm.agents.sandbox.base import RUN_PIDS_LIMIT
from farm.controller.store import SQLiteStore as Store

# 3 GB in 1 MiB writes to /tmp, from a 512m job: it must be stopped long before the end.
WRITE_3GB_TO_TMP = ("chunk = b'x' * (1 << 20)\n"
                    "with open('/tmp/fill', 'wb') as f:\n"
                    "    for i in range(3 * 1024):\n"
                    "        f.write(chunk)\n"
                    "        f.flush()\n"
                    "print('wrote 3 GB')\n")
# Fork-bomb-ish but bounded: threads that only sleep, up to a count past the limit, then all end.
MANY_THREADS = ("import threading, time\n"
                "stop = threading.Event()\n"
                f"threads = [threading.Thread(target=stop.wait, args=(20,), daemon=True) for _ in range({RUN_PIDS_LIMIT + 300})]\n"
                "try:\n"
                "    for t in threads:\n"
                "        t.start()\n"
                "finally:\n"
                "    stop.set()\n"
                "print('started them all')\n")


def _script_job(tmp_path: Path, tiny_models, script: str, sim: str) -> Path:
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    (tmp_path / "work.py").write_text(script)
    return write_job(tmp_path, f"models: [tiny.tflite]\nworkload: {{type: script, script: work.py}}\nsim: {sim}\n")


@pytest.mark.parametrize("backend", ["cgroup", "docker", "process"])
def test_a_512m_job_writing_3gb_to_tmp_is_stopped_as_resource(backend: str, tmp_path: Path, tiny_models, farm) -> None:
    require_backend(backend)
    run = farm("submit", str(_script_job(tmp_path, tiny_models, WRITE_3GB_TO_TMP, "{memory: 512m}")),
               "--backend", backend, "--json")
    assert run.returncode == 1, run.stderr
    r = run.json()["results"][0]
    assert r["failure_class"] == "resource", r
    assert "sim.memory" in r["message"] and "512 MiB" in r["message"], r["message"]
    assert r["attempts"] == 1


@pytest.mark.parametrize("backend", ["cgroup", "docker", "process"])
def test_a_script_starting_threads_without_end_is_stopped_by_the_pids_limit(backend: str, tmp_path: Path,
                                                                           tiny_models, farm) -> None:
    require_backend(backend)
    run = farm("submit", str(_script_job(tmp_path, tiny_models, MANY_THREADS, "{memory: 1g}")),
               "--backend", backend, "--json")
    assert run.returncode == 1, run.stderr
    r = run.json()["results"][0]
    assert r["failure_class"] == "resource", r
    assert f"pids limit ({RUN_PIDS_LIMIT} processes and threads" in r["message"], r["message"]


# 200 MB in 1 MiB writes into the run directory ($HOME), from a job whose quota there is 64m.
WRITE_200MB_TO_RUN_DIR = ("import os\n"
                          "chunk = b'x' * (1 << 20)\n"
                          "with open(os.path.join(os.environ['HOME'], 'fill'), 'wb') as f:\n"
                          "    for i in range(200):\n"
                          "        f.write(chunk)\n"
                          "        f.flush()\n"
                          "print('wrote 200 MB')\n")


@pytest.mark.parametrize("backend", ["cgroup", "docker", "process"])
def test_a_job_writing_past_its_disk_quota_is_stopped_as_resource(backend: str, tmp_path: Path, tiny_models,
                                                                  farm) -> None:
    require_backend(backend)
    if os.geteuid() != 0:
        pytest.skip("the run directory's quota is a tmpfs, which only a root agent can mount")
    run = farm("submit", str(_script_job(tmp_path, tiny_models, WRITE_200MB_TO_RUN_DIR, "{memory: 1g, disk: 64m}")),
               "--backend", backend, "--json")
    assert run.returncode == 1, run.stderr
    r = run.json()["results"][0]
    assert r["failure_class"] == "resource", r
    assert "run directory" in r["message"] and "64 MiB (sim.disk)" in r["message"], r["message"]
    assert r["attempts"] == 1


@pytest.mark.parametrize("backend", ["cgroup", "process"])
def test_a_job_within_its_disk_quota_runs_and_says_its_quota(backend: str, tmp_path: Path, tiny_models, farm,
                                                            farm_db: Path) -> None:
    require_backend(backend)
    script = WRITE_200MB_TO_RUN_DIR.replace("range(200)", "range(20)")
    run = farm("submit", str(_script_job(tmp_path, tiny_models, script, "{memory: 256m}")), "--backend", backend,
               "--json")
    assert run.returncode == 0, run.stderr
    [row] = Store(farm_db).runs.results(1)  # the store's first and only job
    assert row.run_status == "completed", row
    expected = "256 MiB (sim.disk)" if os.geteuid() == 0 else "not bounded"
    assert expected in json.loads(row.environment_json)["disk"], row.environment_json


@pytest.mark.parametrize("value, said", [("nan", "not a memory size"), ("inf", "not a memory size"),
                                         ("64", "no unit"), ("-1g", "not a memory size"), (True, "boolean"),
                                         ("99t", "over 16 TiB"), ("1k", "below 1 MiB")])
def test_a_bad_sim_disk_is_refused_naming_the_field(value, said: str) -> None:
    from pydantic import ValidationError

    from farm.proto.spec import SimBudget
    with pytest.raises(ValidationError) as refused:
        SimBudget(disk=value)
    assert "disk" in str(refused.value) and said in str(refused.value)


def test_sim_disk_travels_as_bytes_and_defaults_to_memory() -> None:
    from farm.proto.spec import DEFAULT_RUN_DISK, SimBudget
    assert SimBudget.model_validate({"disk": 64 << 20}).disk == 64 << 20
    assert SimBudget(memory="512m").disk_quota() == 512 << 20
    assert SimBudget().disk_quota() == DEFAULT_RUN_DISK
