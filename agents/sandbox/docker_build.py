"""Images a job asks for (`sim.build`), built through the Engine API and cached by content hash.

Two ways, one cache: a Dockerfile from the job's folder is built by the engine's own builder;
steps (apt, pip, pre-run commands) run in one container of the base image with the same
read-only host runtime mounts a run gets (so pip and the shell are farm's own, and what the
build sees is what the run sees), then the container is committed. Files a step writes under
/usr are hidden in the run by the host's /usr, so steps install into /opt/farm-build.

The tag is farm-build:<sha256 of everything that goes in>: the build spec, the base image's
id, the job folder's bytes, and for steps the host runtime they ran with. An image with that
tag is a cache hit: nothing is rebuilt. Every build's log is kept beside the cache key.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
import re
import shlex
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.agents.sandbox.base import SandboxError
from farm.agents.sandbox.docker_image import (
    DEFAULT_IMAGE, IMAGE_PATH_ENV, IMAGE_REPOSITORY, ensure_default_image, host_runtime_mounts,
)
from farm.proto.copying import replaced
from farm.proto.escape import printable
from farm.proto.script_archive import unpack
from farm.proto.spec import SimBuild

BUILD_REPOSITORY = "farm-build"
BUILD_FORMAT = "1"  # bump when the way steps run changes, so old images are not reused
ENGINE_READ_TIMEOUT_S = 3600  # one read of the build's stream; the build's own limit is sim.build.timeout
LOG_TAIL_CHARS = 4000
MAX_LOG_BYTES = 16 << 20  # a build that prints without end is cut here, not kept whole
CONTEXT_MOUNT = "/farm-build/context"
PREFIX = "/opt/farm-build"
SITE_PACKAGES = f"{PREFIX}/site-packages"
VENV = "/opt/farm-venv"  # sim.image + steps: the image's own Python makes it, pip installs there (no PEP 668 refusal)
APT_ROOT = f"{PREFIX}/apt"
BUILD_LABEL = "farm.build"
# What apt-get download reads on the host; the run never sees these.
APT_HOST_PATHS = ("/etc/apt", "/var/lib/apt/lists", "/var/lib/dpkg")
BUILD_PIDS_LIMIT = 1024  # a build's processes at once: pip and apt need a few dozen, a fork bomb is stopped
NETWORK_FLAG = "--allow-build-network"
BASE_FLAG = "--allow-build-base"


@dataclass(frozen=True)
class BuildPolicy:
    """What an agent lets a job's build do. A lab agent runs other teams' builds: no network and only the
    base images its operator listed (farm's own always). Embedded, the job is the user's own: anything."""

    allow_network: bool = True
    bases: frozenset[str] | None = None  # None: any image on the engine

    @classmethod
    def lab(cls, allow_network: bool, bases: list[str] | None) -> "BuildPolicy":
        return cls(allow_network=allow_network, bases=frozenset(bases or ()) | {DEFAULT_IMAGE})


class BuildFailed(Exception):
    """The job's build did not succeed: a `job` failure, with the tail of its log."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(message)
        self.log_tail = log_tail


@dataclass
class BuiltImage:
    tag: str
    cached: bool
    log_path: Path
    seconds: float


def build_key(build: SimBuild, base_image_id: str | None, context: bytes | None) -> str:
    """The sha256 of all that goes into the image; equal keys mean an equal image."""
    runtime = [] if build.dockerfile else [str(m.path) for m in host_runtime_mounts()] + [sys.version]
    material = {
        "format": BUILD_FORMAT,
        "build": build.model_dump(mode="json", exclude={"timeout"}),  # a new limit makes no new image
        "base": base_image_id,
        "context": hashlib.sha256(context).hexdigest() if context is not None else None,
        "runtime": runtime,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def wants_network(build: SimBuild) -> bool:
    if build.network is not None:
        return build.network
    return bool(build.apt) or (bool(build.pip) and not build.pip_wheels)


def step_script(build: SimBuild) -> str:
    """The shell script that carries out the steps, each echoed into the log before it runs."""
    python = shlex.quote(sys.executable)
    lines = ["set -e", f"mkdir -p {PREFIX}"]
    if build.apt:
        packages = " ".join(shlex.quote(p) for p in build.apt)
        cache = "/tmp/farm-apt"
        lines += [f"mkdir -p {cache}/archives/partial {APT_ROOT}", f"cd {cache}",
                  f"apt-get -o Dir::Cache={cache} -o Debug::NoLocking=1 -o APT::Sandbox::User=root download {packages}",
                  f'for deb in {cache}/*.deb; do dpkg-deb -x "$deb" {APT_ROOT}; done']
    if build.pip:
        source = (["--no-index", "--find-links", shlex.quote(f"{CONTEXT_MOUNT}/{build.pip_wheels}")]
                  if build.pip_wheels else [])
        lines += [" ".join([python, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
                            "--target", SITE_PACKAGES, *source, *(shlex.quote(r) for r in build.pip)])]
    for command in build.run:
        lines += [f"cd {CONTEXT_MOUNT}", command]
    # each line is shown with its number before it runs, so the log says which one failed
    shown = []
    for number, line in enumerate(lines[1:], start=1):
        shown += [f"echo {shlex.quote(f'+ step {number}: {line}')}", line]
    return "\n".join([lines[0], *shown]) + "\n"


def venv_step_script(build: SimBuild) -> str:
    """The steps inside the user's image, with its own shell and Python: a venv (seeing the image's packages)
    that pip installs into, then the run commands with that venv first on PATH."""
    lines = ["set -e", 'PY="$(command -v python3 || command -v python)"',
             f'"$PY" -m venv --system-site-packages {VENV}']
    if build.pip:
        source = (["--no-index", "--find-links", shlex.quote(f"{CONTEXT_MOUNT}/{build.pip_wheels}")]
                  if build.pip_wheels else [])
        lines += [" ".join([f"{VENV}/bin/python", "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
                            *source, *(shlex.quote(r) for r in build.pip)])]
    for command in build.run:
        lines += [f"cd {CONTEXT_MOUNT}", command]
    shown = []
    for number, line in enumerate(lines[1:], start=1):
        shown += [f"echo {shlex.quote(f'+ step {number}: {line}')}", line]
    return "\n".join([lines[0], *shown]) + "\n"


def image_env(build: SimBuild) -> list[str]:
    """ENV lines the built image gets, so the run finds what the steps installed."""
    env = [f"ENV PATH={IMAGE_PATH_ENV}"]
    if build.pip:
        env.append(f"ENV PYTHONPATH={SITE_PACKAGES}")
    if build.apt:
        arch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
        env.append(f"ENV LD_LIBRARY_PATH={APT_ROOT}/usr/lib/{arch}:{APT_ROOT}/lib/{arch}:{APT_ROOT}/usr/lib")
        env.append(f"ENV FARM_BUILD_BIN={APT_ROOT}/usr/bin")
    return env


class ImageBuilder:
    """Builds and caches job images on one engine; one build per key at a time."""

    def __init__(self, work_root: Path, client: Any = None, policy: BuildPolicy = BuildPolicy()) -> None:
        self.log_dir = work_root / "builds"
        self.policy = policy
        self._client = client
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    @property
    def client(self) -> Any:
        if self._client is None:
            import docker

            try:  # a build streams nothing for minutes while a step runs: a long read timeout
                self._client = docker.from_env(timeout=ENGINE_READ_TIMEOUT_S)
            except docker.errors.DockerException as exc:
                raise SandboxError(f"no Docker engine answers for the image build: {exc}") from exc
        return self._client

    def _lock(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def check_policy(self, build: SimBuild, context: bytes | None) -> None:
        """Raise BuildFailed, naming the agent's flag, when the build needs what this agent does not allow."""
        if wants_network(build) and not self.policy.allow_network:
            why = "sim.build.network is true" if build.network else (
                "sim.build.apt needs it" if build.apt else "sim.build.pip installs from an index")
            raise BuildFailed(f"the build needs the network ({why}), and this agent builds without it; use "
                              f"sim.build.pip_wheels (offline) or ask the agent's operator to start it with "
                              f"`farm agent {NETWORK_FLAG}`", "")
        if self.policy.bases is None:
            return
        if build.dockerfile:  # every image it reads: FROM, COPY --from, RUN --mount from (issue 33, M6)
            names = [(f"sim.build.dockerfile {build.dockerfile!r} line {line}: {how}", name) for line, how, name
                     in dockerfile_references(_dockerfile_text(context, build.dockerfile))]
        else:
            names = [("sim.build.base", build.base)] if build.base else []
        for field_name, name in names:
            if not self._allowed_base(name):
                allowed = ", ".join(sorted(self.policy.bases))
                raise BuildFailed(f"{field_name} {printable(name, limit=200)!r} is not on this agent's allow-list of "
                                  f"base images ({allowed}); its operator adds one with `farm agent {BASE_FLAG} "
                                  f"{printable(name, limit=200)}`", "")

    def check_image(self, image: str) -> None:
        """sim.image with nothing to build: the image a run starts in is held to the same allow-list as a build's
        base (a lab agent's operator chooses which images other teams' code may run in)."""
        if self.policy.bases is not None and not self._allowed_base(image):
            allowed = ", ".join(sorted(self.policy.bases))
            raise BuildFailed(f"sim.image {image!r} is not on this agent's allow-list of base images ({allowed}); "
                              f"its operator adds one with `farm agent {BASE_FLAG} {image}`", "")

    def _allowed_base(self, name: str) -> bool:
        """On the list by name, or the very image (by id) a listed name points at."""
        import docker.errors

        assert self.policy.bases is not None
        if name in self.policy.bases or name.startswith(IMAGE_REPOSITORY + ":"):  # farm's own, any layout
            return True
        try:
            wanted = self.client.images.get(name).id
        except docker.errors.DockerException:
            return False
        for allowed in self.policy.bases:
            try:
                if self.client.images.get(allowed).id == wanted:
                    return True
            except docker.errors.DockerException:
                continue
        return False

    def _base_id(self, build: SimBuild, context: bytes | None, in_image: str | None = None) -> str | None:
        import docker.errors

        if in_image is not None:
            build = replaced(build, base=in_image)

        if build.dockerfile:
            ensure_default_image(self.client)  # a Dockerfile may start FROM farm's base image
            ids = []
            for name in _from_images(context, build.dockerfile):
                try:  # a FROM image retagged with new content must not hit the old cache
                    ids.append(str(self.client.images.get(name).id))
                except docker.errors.DockerException:
                    ids.append(name)  # a stage name, or missing: the build itself says so
            return ",".join(ids)
        base = build.base or ensure_default_image(self.client)
        try:
            return str(self.client.images.get(base).id)
        except docker.errors.ImageNotFound:
            raise BuildFailed(f"sim.build.base {base!r} is not on this agent's Docker engine, and farm never pulls; "
                              "load it there (docker load) or leave base out to start from farm's own image", "") from None
        except docker.errors.DockerException as exc:
            raise SandboxError(f"the Docker engine could not look up {base!r}: {exc}") from exc

    def build(self, build: SimBuild, context: bytes | None, in_image: str | None = None) -> BuiltImage:
        """The image for `build` (context: workload.dir as pack_dir made it), from the cache or built now;
        in_image: the steps run inside this user image (sim.image), into a venv of its own Python.

        Raises BuildFailed (the job's fault: a step or the Dockerfile failed) or SandboxError (the engine's)."""
        import docker.errors

        started = time.monotonic()
        # before the cache too: a cached image of a refused base is refused alike (sim.image is the base when set)
        self.check_policy(replaced(build, base=in_image) if in_image else build, context)
        base_id = self._base_id(build, context, in_image)
        key = build_key(build, f"in-image {base_id}" if in_image else base_id, context)
        tag = f"{BUILD_REPOSITORY}:{key}"
        log_path = self.log_dir / f"{key}.log"
        with self._lock(key):
            try:
                self.client.images.get(tag)
                return BuiltImage(tag, True, log_path, time.monotonic() - started)
            except docker.errors.ImageNotFound:
                pass
            except docker.errors.DockerException as exc:
                raise SandboxError(f"the Docker engine could not look up {tag}: {exc}") from exc
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = _Log(log_path)
            try:
                if build.dockerfile:
                    self._from_dockerfile(build, context, tag, key, log)
                else:
                    self._from_steps(build, context, tag, key, log, in_image)
            finally:
                log.close()
        return BuiltImage(tag, False, log_path, time.monotonic() - started)

    def _from_dockerfile(self, build: SimBuild, context: bytes | None, tag: str, key: str, log: "_Log") -> None:
        import docker.errors
        import requests  # the docker SDK's transport: a read past the request's timeout raises its error
        import urllib3

        assert build.dockerfile is not None
        if context is None or build.dockerfile not in _member_names(context):
            raise BuildFailed(f"sim.build.dockerfile {build.dockerfile!r} is not in workload.dir", "")
        log.write(f"farm: building {tag} from {build.dockerfile}\n")
        try:
            stream = self.client.api.build(
                fileobj=io.BytesIO(context), custom_context=True, dockerfile=build.dockerfile, tag=tag,
                rm=True, forcerm=True, pull=False, decode=True, labels={BUILD_LABEL: key},
                network_mode="default" if wants_network(build) else "none", timeout=int(build.timeout) + 1)
            error = None
            deadline = time.monotonic() + build.timeout
            for chunk in stream:
                if time.monotonic() > deadline:
                    raise TimeoutError
                if "stream" in chunk:
                    log.write(str(chunk["stream"]))
                if "error" in chunk:
                    error = str(chunk["error"]).strip()
                    log.write(f"error: {error}\n")
        except (TimeoutError, requests.exceptions.RequestException, urllib3.exceptions.HTTPError):  # closing the request cancels the build
            raise BuildFailed(f"building {build.dockerfile} ran over sim.build.timeout = {build.timeout:g} s and was "
                              "stopped; raise it if the build needs longer", log.tail()) from None
        except docker.errors.APIError as exc:
            # the engine refuses a bad Dockerfile up front (parse errors, unknown instruction): the job's fault
            if exc.status_code is not None and 400 <= exc.status_code < 500:
                log.write(f"error: {exc.explanation or exc}\n")
                raise BuildFailed(f"the Dockerfile {build.dockerfile} was refused: {exc.explanation or exc}", log.tail()) from None
            raise SandboxError(f"the Docker engine failed during the build: {exc}") from exc
        except docker.errors.DockerException as exc:
            raise SandboxError(f"the Docker engine failed during the build: {exc}") from exc
        if error is not None:
            hint = ("; farm's base image has no shell of its own at build time (the host's /usr is mounted only when "
                    "a run starts): use sim.build.run steps, or a FROM image with a shell") if "/bin/sh" in error else ""
            raise BuildFailed(f"building {build.dockerfile} failed: {error}{hint}", log.tail())

    def _image_path(self, image: str | None) -> str:
        return _image_path_of(self.client, image) if image else IMAGE_PATH_ENV

    def _from_steps(self, build: SimBuild, context: bytes | None, tag: str, key: str, log: "_Log",
                    in_image: str | None = None) -> None:
        import docker.errors
        import requests  # the docker SDK's transport, loaded with it: a read past the timeout raises its error
        import urllib3
        from docker.types import Mount

        base = in_image or build.base or ensure_default_image(self.client)
        script = venv_step_script(build) if in_image else step_script(build)
        path = f"{VENV}/bin:{self._image_path(in_image)}" if in_image else IMAGE_PATH_ENV
        changes = [f"ENV PATH={path}"] if in_image else image_env(build)
        log.write(f"farm: building {tag} from {base}\n")
        with tempfile.TemporaryDirectory(prefix="farm-build-") as scratch:
            context_dir = Path(scratch, "context")
            context_dir.mkdir()
            if context is not None:
                archive = Path(scratch, "context.tar")
                archive.write_bytes(context)
                unpack(archive, context_dir)
            mounts = [] if in_image else [Mount(target=str(m.path), source=str(m.path), type="bind", read_only=True)
                                          for m in host_runtime_mounts()]  # in the user's image: its own /usr
            mounts.append(Mount(target=CONTEXT_MOUNT, source=str(context_dir), type="bind", read_only=True))
            if build.apt:
                mounts += [Mount(target=p, source=p, type="bind", read_only=True) for p in APT_HOST_PATHS if Path(p).exists()]
            container = None
            try:
                container = self.client.containers.create(
                    base, entrypoint=["/bin/sh", "-c", script], command=[], user="0:0", working_dir=CONTEXT_MOUNT,
                    # root only over the image's own files: no capabilities, no set-uid gains, bounded processes
                    cap_drop=["ALL"], security_opt=["no-new-privileges"], pids_limit=BUILD_PIDS_LIMIT,
                    mounts=mounts, network_mode="bridge" if wants_network(build) else "none",
                    environment={"PATH": path, "HOME": "/root", "LANG": "C.UTF-8",
                                 "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
                    labels={BUILD_LABEL: key}, detach=True)
                container.start()
                timed_out = threading.Event()
                watchdog = threading.Timer(build.timeout, _stop, (container, timed_out))
                watchdog.start()
                decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
                try:  # streamed into the bounded log: a step that prints without end costs no memory
                    for chunk in container.logs(stdout=True, stderr=True, stream=True, follow=True):
                        log.write(decoder.decode(chunk))
                    status = container.wait(timeout=60)
                except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError):  # silent past the read timeout
                    _stop(container, timed_out)
                finally:
                    watchdog.cancel()
                if timed_out.is_set():
                    raise BuildFailed(f"sim.build ran over its timeout of {build.timeout:g} s and was stopped; "
                                      "raise sim.build.timeout if it needs longer", log.tail())
                code = int(status.get("StatusCode", -1))
                if code != 0:
                    step = next((line[2:] for line in reversed(log.tail().splitlines()) if line.startswith("+ step ")), "")
                    raise BuildFailed(f"sim.build failed with status {code}{' at ' + step if step else ''}", log.tail())
                repository, _, name = tag.partition(":")
                container.commit(repository=repository, tag=name, changes=[*changes, f"LABEL {BUILD_LABEL}={key}"])
                log.write(f"farm: built {tag}\n")
            except docker.errors.ImageNotFound:
                raise BuildFailed(f"sim.build.base {base!r} is not on this agent's Docker engine", log.tail()) from None
            except docker.errors.DockerException as exc:
                raise SandboxError(f"the Docker engine failed during the build: {exc}") from exc
            finally:
                if container is not None:
                    try:
                        container.remove(force=True)
                    except docker.errors.DockerException:
                        pass


def _image_path_of(client: Any, image: str) -> str:
    """The PATH an image sets, or the usual one."""
    env = client.images.get(image).attrs.get("Config", {}).get("Env") or []
    return next((e.split("=", 1)[1] for e in env if e.startswith("PATH=")), IMAGE_PATH_ENV)


def _stop(container: Any, timed_out: threading.Event) -> None:
    """The build's time is up: kill its container (which ends the log stream the builder is reading)."""
    timed_out.set()
    try:
        container.kill()
    except Exception:
        pass  # it exited meanwhile: the outcome is read from the stream anyway


def _dockerfile_text(context: bytes | None, dockerfile: str) -> str:
    """The Dockerfile's text from the packed workload.dir ("" when it is not there: the build says so)."""
    if context is None:
        return ""
    with tarfile.open(fileobj=io.BytesIO(context)) as tar:
        try:
            member = tar.extractfile(dockerfile)
        except KeyError:
            return ""
        return member.read(1 << 20).decode("utf-8", "replace") if member else ""


def _instructions(source: str) -> list[tuple[int, str, str]]:
    """(line, KEYWORD, the rest) for each instruction, as the builder reads them: the escape directive, lines
    continued with it, comments and blank lines inside a continuation; heredoc bodies are read as lines too,
    which can only find more references to check, never fewer."""
    escape = "\\"
    lines = source.splitlines()
    for line in lines:  # parser directives: `# key=value` lines at the very top
        directive = re.fullmatch(r"\s*#\s*(\w+)\s*=\s*(\S*)\s*", line)
        if directive is None:
            break
        if directive.group(1).lower() == "escape" and directive.group(2) in ("`", "\\"):
            escape = directive.group(2)
    found: list[tuple[int, str, str]] = []
    start, parts = 0, list[str]()  # the line the instruction began on, its pieces so far
    for number, line in enumerate(lines, 1):
        if not parts and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if parts and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction is dropped
        if not parts:
            start = number
        stripped = line.rstrip()
        if stripped.endswith(escape):
            parts.append(stripped[:-1])
            continue
        parts.append(line)
        text = " ".join(parts).strip()
        parts = []
        keyword, _, rest = text.partition(" ")
        found.append((start, keyword.upper(), rest.strip()))
    if parts:
        text = " ".join(parts).strip()
        keyword, _, rest = text.partition(" ")
        found.append((start, keyword.upper(), rest.strip()))
    return found


def _flags(rest: str) -> tuple[list[str], str]:
    """The `--name=value` flags at the start of an instruction's arguments, and what follows them."""
    flags: list[str] = []
    words = rest.split()
    while words and words[0].startswith("--"):
        flags.append(words.pop(0))
    return flags, " ".join(words)


def _flag_value(flag: str, name: str) -> str | None:
    lower = flag.lower()
    if lower.startswith(f"--{name}="):
        return flag[len(name) + 3:].strip("'\"")
    return None


def _mount_from(flag: str) -> str | None:
    """A `--mount=type=bind,from=X,...` flag's `from` (None without one)."""
    value = _flag_value(flag, "mount")
    if value is None:
        return None
    for field in next(csv.reader([value]), []):
        key, _, item = field.partition("=")
        if key.strip().lower() == "from":
            return item.strip().strip("'\"")
    return None


def dockerfile_references(source: str) -> list[tuple[int, str, str]]:
    """Every image a Dockerfile reads from, as (line, how, name): each FROM, each `COPY --from=` and each
    `RUN --mount=...,from=` (ONBUILD's too) that does not name one of its own earlier stages (by name or by
    number) or `scratch` (empty). A variable is kept as written, so it matches no image and is refused."""
    stages: list[str] = []
    found: list[tuple[int, str, str]] = []

    def stage(name: str) -> bool:
        return name.lower() in stages or (name.isascii() and name.isdigit() and int(name) < len(stages))

    def read(line: int, keyword: str, rest: str) -> None:
        flags, arguments = _flags(rest)
        if keyword == "ONBUILD":  # the trigger runs in a later build FROM this image: held to the list alike
            inner, _, inner_rest = arguments.partition(" ")
            read(line, inner.upper(), inner_rest.strip())
        elif keyword == "FROM":
            words = arguments.split()
            if words:
                if words[0].lower() != "scratch" and not stage(words[0]):
                    found.append((line, "FROM", words[0]))
                alias = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
                stages.append((alias or f"#{len(stages)}").lower())
        elif keyword in ("COPY", "ADD"):
            for flag in flags:
                source = _flag_value(flag, "from")
                if source is not None and not stage(source):
                    found.append((line, f"{keyword} --from", source))
        if keyword in ("RUN", "COPY", "ADD"):
            for flag in flags:
                mounted = _mount_from(flag)
                if mounted is not None and not stage(mounted):
                    found.append((line, f"{keyword} --mount from", mounted))

    for line, keyword, rest in _instructions(source):
        read(line, keyword, rest)
    return found


def _from_images(context: bytes | None, dockerfile: str) -> list[str]:
    """Every image the Dockerfile reads (FROM, COPY --from, RUN --mount from), to key the cache on their ids."""
    return [name for _, _, name in dockerfile_references(_dockerfile_text(context, dockerfile))]


def _member_names(context: bytes) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(context)) as tar:
        return {m.name for m in tar.getmembers() if m.isfile()}


class _Log:
    """The build's log file, bounded, and its tail for the failure message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "w", encoding="utf-8", errors="replace")
        self._written = 0
        self._tail = ""

    def write(self, text: str) -> None:
        self._tail = (self._tail + text)[-LOG_TAIL_CHARS:]
        if self._written < MAX_LOG_BYTES:
            chunk = text[: MAX_LOG_BYTES - self._written]
            self._file.write(chunk)
            self._written += len(chunk)
            if self._written >= MAX_LOG_BYTES:
                self._file.write("\n[farm: log cut here]\n")

    def tail(self) -> str:
        return self._tail

    def close(self) -> None:
        self._file.close()
