"""Packaging: the extras in pyproject.toml and the modules cli/extras.py names for them agree, the packages
are found by setuptools' own discovery (a new sub-package ships with no list to edit), and `pip wheel .`
builds without a warning."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from farm.cli.extras import EXTRA_MODULES, MODULE_EXTRA, missing_extra_message

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# distribution -> the module it installs, where the names differ
IMPORT_NAME = {"sqlite-utils": "sqlite_utils", "grpcio-health-checking": "grpc_health",
               "grpcio-reflection": "grpc_reflection", "prometheus-client": "prometheus_client"}


def _names(requirements: list[str]) -> list[str]:
    return [re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower() for r in requirements]


def test_every_extras_module_is_the_one_cli_extras_names() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra in ("controller", "analysis", "pandas", "docker", "postgresql"):
        modules = {IMPORT_NAME.get(n, n) for n in _names(extras[extra]) if n != "farm"}
        assert modules == set(EXTRA_MODULES[extra]), extra
        assert all(MODULE_EXTRA[m] == extra for m in modules)
    base = {IMPORT_NAME.get(n, n) for n in _names(PYPROJECT["project"]["dependencies"])}
    assert base.isdisjoint(MODULE_EXTRA), "a base requirement is also named as an extra's"
    assert extras["all"] == ["farm[controller,analysis,web,pandas,docker,postgresql]"]


def test_the_message_names_the_extras_and_the_pip_line() -> None:
    message = missing_extra_message("report", "matplotlib.pyplot")
    assert message.startswith("`farm report` needs the 'analysis'")
    assert "pip install 'farm[analysis" in message
    assert "pip install 'farm[pandas]'" in missing_extra_message("results", "pandas")


def _wheel_names(tree: Path, out: Path) -> list[str]:
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", str(tree), "-w", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = out.glob("farm-*.whl")
    return zipfile.ZipFile(wheel).namelist()


@pytest.mark.wheel
def test_a_new_sub_package_ships_with_no_list_to_edit(tmp_path: Path) -> None:
    """The layers branch moves agents/ into families (agents/android/, ...): setuptools finds them."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        (tree / name).write_text((ROOT / name).read_text())
    roles = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    for role in roles:  # every role folder pyproject maps
        (tree / role).mkdir()
        (tree / role / "__init__.py").write_text("")
    (tree / "agents" / "android" / "drivers").mkdir(parents=True)
    (tree / "agents" / "android" / "__init__.py").write_text("")
    (tree / "agents" / "android" / "drivers" / "__init__.py").write_text("")
    (tree / "web" / "static").mkdir()
    (tree / "web" / "static" / "dashboard.css").write_text("body {}")
    names = _wheel_names(tree, tmp_path / "dist")
    assert "farm/agents/android/drivers/__init__.py" in names and "farm/web/static/dashboard.css" in names


@pytest.mark.wheel
def test_the_wheel_builds_without_warnings_and_ships_the_data(farm_wheel: Path, tmp_path: Path) -> None:
    # -v: pip shows setuptools' own output (its warnings) only when verbose
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", str(ROOT), "-w", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    warnings = [line for line in (p.stdout + p.stderr).splitlines() if "warn" in line.lower()
                and "byte-compiling is disabled" not in line]  # distutils' note that pip compiles at install
    assert warnings == [], "\n".join(warnings)
    names = zipfile.ZipFile(farm_wheel).namelist()
    for data in ("farm/web/static/dashboard.css", "farm/proto/device_types/pixel_4.yaml", "farm/py.typed",
                 "farm/controller/analysis/population_prior.json", "farm/controller/operations/reference-suite.yaml"):
        assert data in names, data
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "deploy/"))]
