"""farm's packages, found by setuptools' own discovery under each role folder.

pyproject.toml's package-dir maps the import names to the folders on disk (farm.controller ->
controller/, ...); this finds every package below them, so a new sub-package (agents/android/,
models/fixtures/, ...) ships without a list to update. Folders without __init__.py (web/static/,
proto/farm/v1/) are not packages: what ships from them is declared as package data in pyproject.
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
packages = sorted({name for name in package_dir}
                  | {f"{name}.{sub}" for name, folder in package_dir.items() for sub in find_packages(ROOT / folder)})
setup(packages=packages)
