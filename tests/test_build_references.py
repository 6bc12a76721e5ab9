"""M6 (issue 33): every image a job's Dockerfile reads is held to the agent's base-image allow-list, not only its
FROM lines: `COPY --from=<image>`, `RUN --mount=...,from=<image>` and ONBUILD's, written over continued lines or
with another escape character. Its own stages (by name or number) and `scratch` are not images. A real run through
the sim driver on the real Docker engine, with a local image the operator did not list that holds a secret."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from conftest import require_backend
from farm.agents.sandbox.docker_build import BuildFailed, BuildPolicy, ImageBuilder, dockerfile_references
from farm.agents.sandbox.docker_image import DEFAULT_IMAGE
from farm.agents.sim.driver import SimDriver
from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import load_job_text
from farm.controller.store import SQLiteStore as Store
from farm.proto.results import FailureClass, RunStatus
from farm.proto.script_archive import pack_dir
from farm.proto.spec import SimBuild

SECRET_IMAGE = "farm-test-m6-secret:1"


@pytest.fixture(scope="module")
def secret_image() -> str:
    """A local image no operator listed, holding a file another team must not read through a build."""
    require_backend("docker")
    import docker

    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data in (("Dockerfile", b"FROM scratch\nCOPY secret /secret\n"), ("secret", b"the other team's\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    client = docker.from_env(timeout=600)
    try:
        client.images.build(fileobj=io.BytesIO(context.getvalue()), custom_context=True, tag=SECRET_IMAGE, rm=True,
                            network_mode="none")
    finally:
        client.close()
    return SECRET_IMAGE


def _run(tmp_path: Path, tiny_models, dockerfile: str):
    job_dir = tmp_path / "job"
    job_dir.mkdir(parents=True)
    (job_dir / "Dockerfile").write_text(dockerfile)
    (job_dir / "probe.py").write_text("print('{\"latency_ms\": 1.0}')\n")
    os.symlink(tiny_models["tflite"], job_dir / "tiny.tflite")
    job = load_job_text("models: [tiny.tflite]\nworkload: {type: script, script: probe.py}\n"
                        "sim: {backend: docker, build: {dockerfile: Dockerfile}}\n", "job.yaml", job_dir)
    controller = Controller(Store(tmp_path / "farm.db"))
    controller.submit(job)
    task = controller.lease("agent-1", {"sim"})
    assert task is not None
    lab_agent = SimDriver(tmp_path / "work", run_as=None, build_policy=BuildPolicy.lab(False, []))
    return lab_agent.run(task, lambda: False)


@pytest.mark.docker
@pytest.mark.parametrize(("dockerfile", "line", "how"), [
    (f"FROM {DEFAULT_IMAGE}\nCOPY --from={SECRET_IMAGE} /secret /tmp/secret\n", 2, "COPY --from"),
    (f"FROM {DEFAULT_IMAGE}\nCOPY --chown=1:1 \\\n  --from={SECRET_IMAGE} /secret /tmp/secret\n", 2, "COPY --from"),
    (f"# escape=`\nFROM {DEFAULT_IMAGE}\n\nCOPY `\n  --from={SECRET_IMAGE} /secret /tmp/secret\n", 4, "COPY --from"),
    (f"FROM {DEFAULT_IMAGE}\nRUN --mount=type=bind,from={SECRET_IMAGE},target=/m cat /m/secret\n", 2,
     "RUN --mount from"),
    (f"FROM {DEFAULT_IMAGE} AS one\nONBUILD COPY --from={SECRET_IMAGE} / /\n", 2, "COPY --from"),
])
def test_every_image_a_dockerfile_reads_is_held_to_the_allow_list(tmp_path: Path, tiny_models, secret_image: str,
                                                                  dockerfile: str, line: int, how: str) -> None:
    result = _run(tmp_path, tiny_models, dockerfile)
    assert result.status == RunStatus.FAILED and result.failure_class == FailureClass.JOB, result.message
    assert (f"sim.build.dockerfile 'Dockerfile' line {line}: {how} {secret_image!r} is not on this agent's "
            "allow-list of base images") in result.message, result.message
    assert f"farm agent --allow-build-base {secret_image}" in result.message
    assert "the other team's" not in (result.log_tail or "")


@pytest.mark.docker
def test_a_dockerfiles_own_stages_and_listed_images_pass_and_a_listed_secret_image_too(
        tmp_path: Path, secret_image: str) -> None:
    (tmp_path / "Dockerfile").write_text(
        f"FROM {DEFAULT_IMAGE} AS Build\nFROM scratch\nFROM build\nCOPY --from=BUILD / /\nCOPY --from=0 / /\n"
        f"RUN --mount=type=bind,from=1,target=/m true\n")
    context = pack_dir(tmp_path)
    build = SimBuild(dockerfile="Dockerfile")
    ImageBuilder(tmp_path / "w", policy=BuildPolicy.lab(False, [])).check_policy(build, context)
    (tmp_path / "Dockerfile").write_text(f"FROM {DEFAULT_IMAGE}\nCOPY --from={secret_image} / /\n")
    ImageBuilder(tmp_path / "w", policy=BuildPolicy.lab(False, [secret_image])).check_policy(build, pack_dir(tmp_path))
    with pytest.raises(BuildFailed):
        ImageBuilder(tmp_path / "w", policy=BuildPolicy.lab(False, [])).check_policy(build, pack_dir(tmp_path))


def test_the_references_of_a_dockerfile() -> None:
    source = ("# escape=`\nFROM base:1 AS Build\nFROM build\nCOPY --from=build /a /b\nCOPY --from=1 /a /b\n"
              "COPY --chown=1 `\n   --from=evil:1 /etc/shadow /x\nRUN --mount=type=bind,from=evil2,target=/m true\n"
              'RUN --network=none --mount=type=cache,target=/c,"from=evil3" true\nONBUILD COPY --from=evil4 / /\n'
              "FROM $BASE\nFROM scratch\nCOPY --from=3 / /\nCOPY --from=9 / /\n")
    assert dockerfile_references(source) == [
        (2, "FROM", "base:1"), (6, "COPY --from", "evil:1"), (8, "RUN --mount from", "evil2"),
        (9, "RUN --mount from", "evil3"), (10, "COPY --from", "evil4"), (11, "FROM", "$BASE"),
        (14, "COPY --from", "9")]
