#!/bin/bash
# Size of each farm install (BENCHMARKS.md, "Install sizes with extras"): base, an agent with every backend
# and transport, and everything. Fresh venvs without system site-packages; requirements come from a wheel
# cache (filled from PyPI on the first run), so the wall time is unpacking, not downloading.
#   bash benchmarks/install_sizes.sh [PYTHON]
set -euo pipefail
PY=${1:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=/var/cache/farm-tests/install-sizes
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$CACHE"
"$PY" -m pip wheel --quiet --no-deps "$ROOT" -w "$WORK/dist"
WHEEL=$(ls "$WORK"/dist/farm-*.whl)
for spec in base docker,usb all; do
  if [ "$spec" = base ]; then req="$WHEEL"; else req="farm[$spec] @ file://$WHEEL"; fi
  "$PY" -m pip wheel --quiet --wheel-dir "$CACHE" "$req" >/dev/null
  rm -f "$CACHE"/farm-*.whl
  venv="$WORK/venv-${spec//,/-}"
  "$PY" -m venv "$venv"
  start=$(date +%s.%N)
  "$venv/bin/python" -m pip install --quiet --no-index --find-links "$CACHE" "$req"
  end=$(date +%s.%N)
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  printf '%-10s %5s MB  %3s distributions  %6.1f s\n' "$spec" "$(du -sm "$site" | cut -f1)" \
    "$("$venv/bin/python" -m pip list --format=freeze | wc -l)" "$(echo "$end - $start" | bc)"
done
