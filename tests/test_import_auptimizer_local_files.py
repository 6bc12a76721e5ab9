"""Low (issue 33): an Auptimizer env file's requirements reach no file on the building host. A `file:///etc/shadow`
line (alone, with a name in front, in a requirements file beside the env file) or a path is refused naming the
variable, as any job's sim.build.pip is: files come only from workload.dir (sim.build.pip_wheels). The real CLI."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from farm.proto.spec import SimBuild

FIXTURES = Path(__file__).parent / "fixtures" / "auptimizer"


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "bench"
    shutil.copytree(FIXTURES / "benchmark", folder)
    (folder / "reqs.txt").write_text("numpy\nfile:///etc/shadow\n")
    return folder


@pytest.mark.parametrize("value", ["'numpy file:///etc/shadow'", "'x @ file:///etc/shadow'", "'numpy /etc/shadow'",
                                   "reqs.txt", "'-r reqs.txt'", "'numpy FILE:/etc/shadow'"])
def test_a_requirement_naming_a_host_file_is_refused_naming_the_variable(farm, bench_dir: Path, value: str) -> None:
    env = bench_dir / "hostile.template"
    env.write_text(f"DIR=.\nSCRIPT=bench.py\nPIPREQUIREMENTS={value}\n")
    r = farm("import", "auptimizer", str(env), "-o", str(bench_dir / "out.yaml"), "--json")
    assert r.returncode == 2, (r.stdout, r.stderr)
    problem = r.json()["problems"][0]
    assert "names a file on the building host" in problem["message"], problem
    assert problem["line"] == 3 and problem["field"] == "PIPREQUIREMENTS", problem
    assert not (bench_dir / "out.yaml").exists()


def test_a_jobs_build_takes_packages_by_name_only() -> None:
    assert SimBuild(pip=["numpy==1.26.4", "torch>=2; python_version>'3.8'", "pkg[extra]"]).pip
    for bad in ("file:///etc/shadow", "pkg @ file:///etc/shadow", "/etc/shadow", "./wheel.whl", "~/x", "pkg@/x"):
        with pytest.raises(ValueError, match="names a file on the building host"):
            SimBuild(pip=[bad])
