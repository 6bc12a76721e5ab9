"""`sim.image: NAME` runs the script with the image's own Python and packages (issue 19 item 5).

Nothing can be pulled here, so the test builds the user's image from farm's imported minimal base:
Debian's python3.11 (not the interpreter farm runs on) with its standard library, and a venv at
/opt/venv holding `cowsay` from a wheel pip-downloaded into the cache — a package the host does not
have. A converted Auptimizer template (IMAGEREPO → sim.image) whose script imports it then runs, while
farm's limits, peak memory and timing still come from the host side.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_import_auptimizer import write_wheel
from user_python_image import ensure_user_python_image

SCRIPT = """import sys
import cowsay  # only in the image's venv: the run fails without it
# the image's own interpreter (Debian's 3.11.2 in its venv), not the 3.11.7 farm runs on
if sys.prefix != "/opt/venv" or not cowsay.__file__.startswith("/opt/venv/"):
    raise SystemExit(f"not the image's Python: {sys.executable} {sys.prefix} {cowsay.__file__}")
if sys.version_info[:3] != tuple(int(p) for p in sys.argv[1].split(".")):
    raise SystemExit(f"expected Python {sys.argv[1]}, got {sys.version}")
open(sys.argv[-1], "rb").read()  # the model farm passed
"""


@pytest.fixture(scope="module")
def user_image() -> str:
    return ensure_user_python_image()


@pytest.mark.docker
def test_a_converted_template_runs_with_the_images_own_python_and_packages(farm, tmp_path: Path, user_image: str,
                                                                          tiny_models) -> None:
    folder = tmp_path / "tmpl"
    folder.mkdir()
    image_python = subprocess.run(["/usr/bin/python3.11", "-c", "import platform; print(platform.python_version())"],
                                  capture_output=True, text=True, check=True).stdout.strip()
    assert image_python != ".".join(map(str, sys.version_info[:3]))  # else the test could not tell them apart
    (folder / "env.template").write_text(f'IMAGEREPO="{user_image}"\nDIR="."\nSCRIPT="cow.py"\n'
                                         f'COMMAND="python cow.py {image_python}"\n'
                                         'DOCKCPUS="1"\nDOCKMEMORY="512m"\nDOCFILE="Dockerfile"\n')
    (folder / "cow.py").write_text(SCRIPT)
    shutil.copy(tiny_models["tflite"], folder / "m.tflite")
    r = farm("import", "auptimizer", str(folder / "env.template"), "-m", "m.tflite", "-o", str(folder / "job.yaml"),
             "--json")
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load((folder / "job.yaml").read_text())
    assert job["sim"]["image"] == user_image and "build" not in job["sim"]
    run = farm("submit", str(folder / "job.yaml"), "--json", timeout=900)
    result = run.json()["results"][0]
    assert run.returncode == 0 and result["status"] == "completed", result
    assert result["limits"]["memory_mb"] == 512.0 and result["peak_memory_mb"] > 0


def test_sim_image_on_another_backend_is_a_job_file_error(farm, tmp_path: Path, tiny_models) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(f"models: [{tiny_models['tflite']}]\nsim: {{backend: process, image: 'myimage:1'}}\n")
    r = farm("submit", str(job))
    assert r.returncode == 2 and "needs backend: docker" in r.stderr, r.stderr
    job.write_text(f"models: [{tiny_models['tflite']}]\nsim: {{backend: docker, image: 'bad image;rm'}}\n")
    r = farm("submit", str(job))
    assert r.returncode == 2 and "is not a Docker image name" in r.stderr, r.stderr


@pytest.mark.docker
def test_piprequirements_and_prerun_install_into_a_venv_of_the_images_python(farm, tmp_path: Path,
                                                                              user_image: str, tiny_models) -> None:
    """The profiler's `RUN pip install $PIPREQUIREMENTS` in IMAGEREPO: farm makes a venv of the image's own
    Python (no PEP 668 externally-managed refusal) and PRERUN runs with it first on PATH."""
    folder = tmp_path / "tmpl"
    folder.mkdir()
    write_wheel(folder / "wheels", source="ITERATIONS = 7\n")  # benchhelper, on neither the host nor the image
    (folder / "env.template").write_text(
        f'IMAGEREPO="{user_image}"\nDIR="."\nSCRIPT="use.py"\nCOMMAND="python"\nPIPREQUIREMENTS="benchhelper==1.0"\n'
        'PRERUN="python -c \'import benchhelper, sys; open(\\"/opt/prerun.txt\\", \\"w\\").write(sys.prefix)\'"\n'
        'DOCKMEMORY="512m"\n')
    (folder / "use.py").write_text(
        "import sys\nimport benchhelper\n"
        "assert benchhelper.ITERATIONS == 7 and sys.version_info[:3] == (3, 11, 2), sys.version\n"
        "assert open('/opt/prerun.txt').read() == sys.prefix == '/opt/farm-venv', open('/opt/prerun.txt').read()\n")
    shutil.copy(tiny_models["tflite"], folder / "m.tflite")
    r = farm("import", "auptimizer", str(folder / "env.template"), "-m", "m.tflite", "--pip-wheels", "wheels",
             "-o", str(folder / "job.yaml"), "--json")
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load((folder / "job.yaml").read_text())
    assert job["sim"]["image"] == user_image and job["sim"]["build"]["pip"] == ["benchhelper==1.0"]
    run = farm("submit", str(folder / "job.yaml"), "--json", timeout=900)
    result = run.json()["results"][0]
    assert run.returncode == 0 and result["status"] == "completed", result
    assert result["image_build"]["image"].startswith("farm-build:")


def test_a_backend_override_on_a_sim_image_job_fails_it_as_job(farm, tmp_path: Path, tiny_models) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(f"models: [{tiny_models['tflite']}]\nsim: {{backend: docker, image: 'my-image:1'}}\n")
    run = farm("submit", str(job), "--backend", "process", "--json", timeout=300)
    result = run.json()["results"][0]
    assert result["status"] == "failed" and result["failure_class"] == "job", result
    assert "sim.image 'my-image:1' runs in a Docker image" in result["message"] and "drop --backend" in result["message"]
