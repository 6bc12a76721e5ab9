"""The four template shapes Auptimizer's profiler shipped (benchmark, MNIST, ONNX conversion, TFLite),
written here from how its own scripts (aup/profiler/profiler.sh and statscript.sh in the
auptimizer==2.0 wheel) treat each variable, convert with `farm import auptimizer` as shipped:

- statscript.sh `source`s the env file in the folder the profiler runs from, writes $DOCFILE there
  when it is missing (`FROM $IMAGEREPO`, apt lines, `RUN mkdir /app`, `WORKDIR /app`, `copy $DIR .`,
  `RUN $PRERUN`, `RUN pip install $PIPREQUIREMENTS`, `CMD ["$COMMAND", "$SCRIPT", model]`) and runs
  `docker build -f $DOCFILE .` from that folder;
- profiler.sh passes each -m name (or each line of the -f file) to the script as its last argument,
  so the script, running in /app (DIR's files), opens it inside DIR;
- `docker run $DOCKER_ARGS` added the user's own options, `-v` mounts among them.

And hostile env files (issue 18, N10): nothing outside the env file's folder is read or sent, the
importer's environment is never expanded into the job, and an existing -o file is kept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from farm.model_generators.generate import write_tiny_tflite


def _notes(run) -> dict[str, list[str]]:
    notes: dict[str, list[str]] = {}
    for note in run.json()["notes"]:
        notes.setdefault(note["field"] or "", []).append(note["message"])
    return notes


def _write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def test_benchmark_shape_generates_its_dockerfile_and_finds_models_in_dir(farm, tmp_path: Path) -> None:
    """DOCFILE names a file that is not there (the normal case: the profiler writes it); -m names are in DIR."""
    folder = _write(tmp_path / "bench", {
        "env_bench.template": 'IMAGEREPO="tensorflow/tensorflow:2.3.0"\nAPTREQUIREMENTS=""\n'
                              'PIPREQUIREMENTS="numpy"\nPRERUN=""\nDIR="./code"\nSCRIPT="bench.py"\n'
                              'COMMAND="python"\nSAMPLETIME=1\nOUTPUTFILE="out.txt"\nDOCFILE="Dockerfile"\n'
                              'DOCKCPUS="1"\nDOCKMEMORY="1g"\n',
        "code/bench.py": "import sys\nprint(sys.argv[-1])\n"})
    for name in ("a.tflite", "b.tflite"):
        write_tiny_tflite(folder / "code" / name)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    r = farm("import", "auptimizer", str(folder / "env_bench.template"), "-m", "a.tflite,b.tflite",
             "-o", str(folder / "job.yaml"), "--json", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load((folder / "job.yaml").read_text())
    assert job["models"] == ["code/a.tflite", "code/b.tflite"]  # inside DIR, not the cwd
    assert job["workload"] == {"type": "script", "command": "python", "script": "bench.py", "args": ["{model}"],
                               "dir": "code"}
    assert job["sim"]["build"] == {"pip": ["numpy"]}
    assert "does not exist: Auptimizer's profiler writes it" in _notes(r)["DOCFILE"][0]
    assert not (folder / "Dockerfile").exists()  # farm writes nothing into the user's folder


def test_mnist_shape_builds_from_the_env_files_folder_with_the_dockerfile_beside_it(farm, tmp_path: Path) -> None:
    """A Dockerfile next to the env file, DIR a subfolder: the profiler's `docker build .` context is the env
    file's folder, so it is accepted (it was refused as "outside DIR")."""
    folder = _write(tmp_path / "mnist", {
        "env_mnist.template": 'DIR="mnist"\nSCRIPT="train.py"\nCOMMAND="python"\nDOCFILE="Dockerfile"\n'
                              'DOCKCPUS="1"\nDOCKMEMORY="1g"\nOUTPUTFILE="mnist_out.txt"\nSAMPLETIME=2\n',
        "Dockerfile": "FROM farm-sim-base:1\nCOPY mnist/classes.txt /opt/classes.txt\n",
        "mnist/train.py": "print('trained')\n", "mnist/classes.txt": "0\n1\n"})
    r = farm("import", "auptimizer", str(folder / "env_mnist.template"), "-o", str(folder / "job.yaml"), "--json")
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load((folder / "job.yaml").read_text())
    assert job["workload"]["dir"] == "." and job["workload"]["script"] == "mnist/train.py"
    assert job["sim"]["build"] == {"dockerfile": "Dockerfile"}
    assert any("the env file's folder is the build context" in m for m in _notes(r)["DOCFILE"])


def test_onnx_conversion_shape_reads_requirements_and_a_model_list_inside_dir(farm, tmp_path: Path) -> None:
    """`PIPREQUIREMENTS="-r requirements.txt"` (the profiler's `pip install $PIPREQUIREMENTS` takes it) and
    -f with names inside DIR."""
    folder = _write(tmp_path / "onnx", {
        "env_onnx.template": 'IMAGEREPO="python:3.8"\nPIPREQUIREMENTS="-r requirements.txt"\n'
                             'PRERUN="mkdir -p /opt/out"\nDIR="."\nSCRIPT="convert.py"\nCOMMAND="python"\n'
                             'DOCFILE="Dockerfile"\nOUTPUTFILE="onnx_out.txt"\nSAMPLETIME=1\n',
        "requirements.txt": "# conversion\nonnx==1.16.0\nnumpy\n--extra-index-url https://example.org\n",
        "convert.py": "import sys\nprint(sys.argv[-1])\n",
        "models.txt": "m1.tflite\nm2.tflite\n"})
    for name in ("m1.tflite", "m2.tflite"):
        write_tiny_tflite(folder / name)
    list_elsewhere = tmp_path / "lists"
    list_elsewhere.mkdir()
    (list_elsewhere / "models.txt").write_text("m1.tflite\nm2.tflite\n")
    r = farm("import", "auptimizer", str(folder / "env_onnx.template"), "-f", str(list_elsewhere / "models.txt"),
             "-o", str(folder / "job.yaml"), "--json")
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load((folder / "job.yaml").read_text())
    assert job["models"] == ["m1.tflite", "m2.tflite"]
    assert job["sim"]["build"]["pip"] == ["onnx==1.16.0", "numpy"]
    assert job["sim"]["build"]["run"] == ["mkdir -p /opt/out"]
    assert any("--extra-index-url" in m and "not carried" in m for m in _notes(r)["PIPREQUIREMENTS"])


def test_tflite_shape_with_an_interpreter_from_a_dropped_mount_gets_a_note_and_a_working_command(
        farm, tmp_path: Path) -> None:
    folder = _write(tmp_path / "tflite", {
        "env_tflite.template": 'IMAGEREPO="python:3.8-slim"\nPIPREQUIREMENTS="tflite-runtime"\nDIR="."\n'
                               'SCRIPT="run_tflite.py"\nCOMMAND="/opt/venv/bin/python3"\n'
                               'DOCKER_ARGS="-v /home/me/venv:/opt/venv --cpus 1"\nDOCFILE="Dockerfile"\n',
        "run_tflite.py": "import sys\nprint(sys.argv[-1])\n"})
    write_tiny_tflite(folder / "model.tflite")
    r = farm("import", "auptimizer", str(folder / "env_tflite.template"), "-m", "model.tflite",
             "-o", str(folder / "job.yaml"), "--json")
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load((folder / "job.yaml").read_text())
    assert job["workload"]["command"] == "python" and job["sim"]["cpus"] == 1.0
    [note] = _notes(r)["COMMAND"][-1:]
    assert "/opt/venv/bin/python3 existed only through the mount '-v /home/me/venv:/opt/venv'" in note
    assert "farm runs `python` instead" in note


# --- hostile env files (issue 18, N10) ----------------------------------------------------------


def test_the_importers_environment_is_never_expanded_nor_printed(farm, tmp_path: Path) -> None:
    folder = _write(tmp_path / "t", {"env.template": 'DIR=.\nSCRIPT=run.py\nPRERUN="curl -H ${FARM_TOKEN} x"\n'
                                                     'OUTPUTFILE=$HOME/out.txt\n', "run.py": "print(1)\n"})
    secret = "s3cr3t-token-value"
    r = farm("import", "auptimizer", str(folder / "env.template"), "-o", str(folder / "job.yaml"), "--json",
             env={"FARM_TOKEN": secret, "HOME": "/home/someone-else"})
    assert r.returncode == 0, r.stderr
    written = (folder / "job.yaml").read_text()
    for text in (r.stdout, r.stderr, written):
        assert secret not in text and "someone-else" not in text
    assert yaml.safe_load(written)["sim"]["build"]["run"] == ["curl -H ${FARM_TOKEN} x"]  # literal
    assert any("${FARM_TOKEN} is not set earlier in the file; kept as written" in m for m in _notes(r)["PRERUN"])


def test_an_existing_output_file_is_kept_without_force(farm, tmp_path: Path) -> None:
    folder = _write(tmp_path / "t", {"env.template": "DIR=.\nSCRIPT=run.py\n", "run.py": "print(1)\n",
                                     "job.yaml": "precious: true\n"})
    r = farm("import", "auptimizer", str(folder / "env.template"), "-o", str(folder / "job.yaml"))
    assert r.returncode == 2 and "exists" in r.stderr and "--force" in r.stderr, r.stderr
    assert (folder / "job.yaml").read_text() == "precious: true\n"
    r = farm("import", "auptimizer", str(folder / "env.template"), "-o", str(folder / "job.yaml"), "--force")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load((folder / "job.yaml").read_text())["workload"]["script"] == "run.py"


def test_a_symlink_in_dir_to_a_file_outside_is_not_read(farm, tmp_path: Path) -> None:
    outside = tmp_path / "private.txt"
    outside.write_text("hunter2\n")
    folder = _write(tmp_path / "t", {"env.template": 'DIR=.\nSCRIPT=run.py\nPIPREQUIREMENTS="reqs.txt"\n',
                                     "run.py": "print(1)\n"})
    (folder / "reqs.txt").symlink_to(outside)
    r = farm("import", "auptimizer", str(folder / "env.template"), "-o", str(folder / "job.yaml"), "--json")
    assert r.returncode == 2, r.stdout
    assert "outside the env file's folder" in r.json()["problems"][0]["message"]
    assert "hunter2" not in r.stdout + r.stderr and not (folder / "job.yaml").exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_a_fifo_as_env_file_or_requirements_is_refused_without_blocking(farm, tmp_path: Path) -> None:
    folder = _write(tmp_path / "t", {"env.template": 'DIR=.\nSCRIPT=run.py\nPIPREQUIREMENTS="reqs.txt"\n',
                                     "run.py": "print(1)\n"})
    os.mkfifo(folder / "reqs.txt")
    os.mkfifo(folder / "fifo.template")
    for env in ("env.template", "fifo.template"):
        r = farm("import", "auptimizer", str(folder / env), "-o", str(folder / "job.yaml"), "--json", timeout=60)
        assert r.returncode == 2 and "not a regular file" in json.dumps(r.json()), r.stdout


def test_a_dir_that_is_a_symlink_out_of_the_env_files_folder_is_refused(farm, tmp_path: Path) -> None:
    home = _write(tmp_path / "home", {"run.py": "print(1)\n", ".ssh/id_rsa": "PRIVATE\n"})
    folder = _write(tmp_path / "t", {"env.template": "DIR=code\nSCRIPT=run.py\n"})
    (folder / "code").symlink_to(home)
    r = farm("import", "auptimizer", str(folder / "env.template"), "-o", str(folder / "job.yaml"), "--json")
    assert r.returncode == 2, r.stdout
    problem = r.json()["problems"][0]
    assert problem["field"] == "DIR" and "outside the env file's folder" in problem["message"]
    assert not (folder / "job.yaml").exists()
