#!/usr/bin/env bash
# Fill .whl/ with what benchmarks/gpu_check.sh installs on an NVIDIA host that has PyTorch, numpy, onnx, onnxruntime,
# grpcio-less Python 3.12 and no network (the workplace's H200 image): farm's own wheel and the dependencies that image
# lacks, for CPython 3.12 on x86-64. Run here, where the package index is reachable; carry .whl to the host.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
rm -f .whl/farm-*.whl
python3 -m pip wheel -q --no-deps . -w .whl
download=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
"${download[@]}" pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection typing_extensions \
  platformdirs paramiko bcrypt PyNaCl cryptography cffi pycparser rsa pyasn1 invoke sqlite-utils sqlite-fts4 \
  click-default-group "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1" "protobuf>=7.35.1" \
  croniter python-dateutil tzdata backports.strenum ai-edge-litert
python3 -m pip wheel -q --no-deps adb_shell==0.4.4 -w .whl  # pure Python, published as a source archive only
du -sh .whl
