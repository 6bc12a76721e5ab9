"""`sim.image: NAME` runs the script with the image's own Python and packages (issue 19 item 5).

Nothing can be pulled here, so the test builds the user's image from farm's imported minimal base:
Debian's python3.11 (not the interpreter farm runs on) with its standard library, and a venv at
/opt/venv holding `cowsay` from a wheel pip-downloaded into the cache — a package the host does not
have. A converted Auptimizer template (IMAGEREPO → sim.image) whose script imports it then runs, while
farm's limits, peak memory and timing still come from the host side.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from conftest import require_backend
from test_import_auptimizer import write_wheel

CACHE = Path("/var/cache/farm-tests/user-image")
WHEEL = "cowsay-6.1-py3-none-any.whl"
IMAGE = "farm-test-user-python:4"
SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "lib2to3", "__pycache__", "pydoc_data"}
SCRIPT = """import sys
import cowsay  # only in the image's venv: the run fails without it
# the image's own interpreter (Debian's 3.11.2 in its venv), not the 3.11.7 farm runs on
if sys.prefix != "/opt/venv" or not cowsay.__file__.startswith("/opt/venv/"):
    raise SystemExit(f"not the image's Python: {sys.executable} {sys.prefix} {cowsay.__file__}")
if sys.version_info[:3] != tuple(int(p) for p in sys.argv[1].split(".")):
    raise SystemExit(f"expected Python {sys.argv[1]}, got {sys.version}")
open(sys.argv[-1], "rb").read()  # the model farm passed
"""


SETUP_VENV = f"""import os, zipfile
os.makedirs("/opt/venv/bin")
os.symlink("/usr/bin/python3.11", "/opt/venv/bin/python")
with open("/opt/venv/pyvenv.cfg", "w") as f:
    f.write("home = /usr/bin\\ninclude-system-site-packages = false\\n")
zipfile.ZipFile("/tmp/{WHEEL}").extractall("/opt/venv/lib/python3.11/site-packages")
"""


def _wheel() -> Path:
    path = CACHE / WHEEL
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "cowsay==6.1", "-d", str(CACHE)],
                             capture_output=True, text=True, timeout=180)
        if got.returncode != 0 or not path.exists():
            pytest.skip(f"the package index is unreachable (pip download cowsay==6.1): {got.stderr.strip()[-300:]}")
    return path


def _libraries(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    return [part for line in out.splitlines() for part in line.split() if part.startswith("/")]


def _context() -> bytes:
    """Build context: a Dockerfile FROM farm's base, the interpreter, its libraries and stdlib (with
    ensurepip, so `python -m venv` works in the image), a shell, the wheel."""
    data = io.BytesIO()
    python = os.path.realpath("/usr/bin/python3.11")
    with tarfile.open(fileobj=data, mode="w") as tar:
        def add(path: str) -> None:
            tar.add(os.path.realpath(path), arcname="root" + os.path.realpath(path), recursive=False)

        add(python)
        add("/usr/bin/dash")  # a shell of the image's own, for build steps
        for wheel in Path("/usr/share/python-wheels").glob("*.whl"):  # where Debian's ensurepip looks for them
            tar.add(wheel, arcname=f"root/usr/share/python-wheels/{wheel.name}")
        shell = tarfile.TarInfo("root/usr/bin/sh")
        shell.type, shell.linkname = tarfile.SYMTYPE, "dash"
        tar.addfile(shell)
        for path in _libraries(python):  # under the name the binary asks for (libz.so.1, not libz.so.1.2.13)
            real = os.path.realpath(path)
            tar.add(real, arcname=f"root{os.path.dirname(real)}/{os.path.basename(path)}", recursive=False)
        for current, dirs, files in os.walk("/usr/lib/python3.11"):
            dirs[:] = [d for d in dirs if d not in SKIP_STDLIB and not d.startswith("config-")]
            for name in files:
                full = os.path.join(current, name)
                if not os.path.islink(full):
                    add(full)
        loader = tarfile.TarInfo("root/usr/lib64/ld-linux-x86-64.so.2")  # where the binary's PT_INTERP points
        loader.type, loader.linkname = tarfile.SYMTYPE, "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
        tar.addfile(loader)
        tar.add(_wheel(), arcname=WHEEL)
        setup = SETUP_VENV.encode()
        info = tarfile.TarInfo("setup_venv.py")
        info.size = len(setup)
        tar.addfile(info, io.BytesIO(setup))
        dockerfile = (f"FROM farm-sim-base:1\nCOPY root/ /\nCOPY {WHEEL} setup_venv.py /tmp/\n"
                      'RUN ["/usr/bin/python3.11", "/tmp/setup_venv.py"]\n'
                      "ENV PATH=/opt/venv/bin:/usr/bin:/bin\n")
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile.encode())
        tar.addfile(info, io.BytesIO(dockerfile.encode()))
    return data.getvalue()


@pytest.fixture(scope="module")
def user_image() -> str:
    require_backend("docker")
    for needed in ("/usr/bin/python3.11", "/usr/bin/dash", "/usr/share/python-wheels"):
        if not Path(needed).exists():  # the image is made of the host's Debian python3.11, dash and pip wheels
            pytest.skip(f"{needed} is not on this host (apt-get install python3.11-venv dash)")
    import docker

    from farm.agents.sandbox.docker_image import ensure_default_image

    client = docker.from_env(timeout=600)
    try:
        ensure_default_image(client)
        try:
            client.images.get(IMAGE)
        except docker.errors.ImageNotFound:
            client.images.build(fileobj=io.BytesIO(_context()), custom_context=True, tag=IMAGE, rm=True,
                                network_mode="none")
    finally:
        client.close()
    return IMAGE


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
