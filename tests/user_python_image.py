"""A user's own image for the docker tests: Debian's python3.11 (not the interpreter farm runs on) with its
standard library, and a venv at /opt/venv holding `cowsay` from a wheel pip-downloaded into the cache —
a package the host does not have. Built once from farm's imported minimal base (nothing can be pulled)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from cache_lock import cache_lock
from conftest import require_backend
from farm.agents.sandbox.docker_image import DEFAULT_IMAGE

CACHE = Path("/var/cache/farm-tests/user-image")
WHEEL = "cowsay-6.1-py3-none-any.whl"
IMAGE = "farm-test-user-python:5"  # on farm-sim-base:2 (its /root is 0755)
SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "lib2to3", "__pycache__", "pydoc_data"}


SETUP_VENV = f"""import os, zipfile
os.makedirs("/opt/venv/bin")
os.symlink("/usr/bin/python3.11", "/opt/venv/bin/python")
with open("/opt/venv/pyvenv.cfg", "w") as f:
    f.write("home = /usr/bin\\ninclude-system-site-packages = false\\n")
zipfile.ZipFile("/tmp/{WHEEL}").extractall("/opt/venv/lib/python3.11/site-packages")
"""


def _wheel() -> Path:
    path = CACHE / WHEEL
    if path.exists():
        return path
    with cache_lock(CACHE):  # one run downloads it; another waits and finds it
        if path.exists():
            return path
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
        dockerfile = (f"FROM {DEFAULT_IMAGE}\nCOPY root/ /\nCOPY {WHEEL} setup_venv.py /tmp/\n"
                      'RUN ["/usr/bin/python3.11", "/tmp/setup_venv.py"]\n'
                      "ENV PATH=/opt/venv/bin:/usr/bin:/bin\n")
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile.encode())
        tar.addfile(info, io.BytesIO(dockerfile.encode()))
    return data.getvalue()


def ensure_user_python_image() -> str:
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
