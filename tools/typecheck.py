"""Type-check the package as it installs: mypy sees farm.* while the folders on disk are the roles
(proto/, controller/, agents/, cli/, models/), so this links them under a farm/ in a temporary
folder, the way pyproject's package-dir maps them, and runs mypy with pyproject's [tool.mypy].

    python tools/typecheck.py        (`make test` runs it before pytest)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    with tempfile.TemporaryDirectory(prefix="farm-typecheck-") as tmp:
        farm = Path(tmp, "farm")
        farm.mkdir()
        for name in ("__init__.py", "version.py", "py.typed"):
            shutil.copy(ROOT / "farm" / name, farm / name)
        for package, folder in package_dir.items():
            parts = package.split(".")
            if len(parts) == 2:  # farm.X -> X/; deeper packages come with their folder
                (farm / parts[1]).symlink_to(ROOT / folder, target_is_directory=True)
        return subprocess.call([sys.executable, "-m", "mypy", "-p", "farm", "--config-file", str(ROOT / "pyproject.toml"),
                                "--cache-dir", str(ROOT / ".mypy_cache")], cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
