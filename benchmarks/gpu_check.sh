#!/usr/bin/env bash
# The one real check on an NVIDIA GPU (issue 29): a controller and an agent on this host, the host's GPU as a
# device of the `nvidia` driver (host: local, NVML telemetry), and a PyTorch script job on it at fp32 and fp16
# (benchmarks/gpu_check/). Run from the repository root on a host with a GPU, PyTorch and nvidia-ml-py; writes
# what it measured under $OUT (default ./gpu-check-out). farm's wheel and the dependencies the host lacks may lie
# in .whl/ (made beside: `pip wheel --no-deps . -w .whl` and `pip download` of the rest); they are installed first.
# FARM_GPU_PYTHON picks the interpreter (default python3). Nothing in CI needs this.
set -euo pipefail
PY=${FARM_GPU_PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/farm-gpu-check.XXXXXX)
chmod 755 "$WORK"
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$OUT/gpu_check.log" >&2; }
if [ -z "${GPU_CHECK_NO_WHEELS:-}" ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  log "installing farm and what the host lacks from .whl/"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl
fi
farm() { "$PY" -m farm.cli.main "$@"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv > "$OUT/nvidia_smi.csv"
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", "python", sys.version.split()[0])' | tee "$OUT/torch.txt"

cp -r benchmarks/gpu_check/. "$WORK/"
log "models"
"$PY" "$WORK/make_models.py" "$WORK/models" | tee "$OUT/models.txt"
cat > "$WORK/lab.yaml" <<LAB
devices:
  - name: gpu-1
    driver: nvidia
    type: nvidia-gpu-host
    host: local
    python: $(command -v "$PY")
    telemetry: ${FARM_GPU_TELEMETRY:-auto}
LAB
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export FARM_DB="$WORK/farm.db"
log "controller on 127.0.0.1:$PORT, agent with gpu-1"
farm controller serve --listen "127.0.0.1:$PORT" --db "$FARM_DB" --no-auth --log-level warning > "$OUT/controller.log" 2>&1 &
CONTROLLER=$!
AGENT=""
trap 'kill $AGENT $CONTROLLER 2>/dev/null || true' EXIT
alive() { kill -0 "$1" 2>/dev/null || { log "$2 died:"; tail -5 "$OUT/$2.log" >&2; exit 3; }; }
export FARM_CONTROLLER="127.0.0.1:$PORT"
for _ in $(seq 30); do alive $CONTROLLER controller; farm jobs --json >/dev/null 2>&1 && break; sleep 1; done
farm agent --controller "127.0.0.1:$PORT" --name gpu-host --devices "$WORK/lab.yaml" --sim-slots 1 \
  --work-dir "$WORK/agent" --log-level warning > "$OUT/agent.log" 2>&1 &
AGENT=$!
for _ in $(seq 60); do alive $AGENT agent; farm devices --json 2>/dev/null | grep -q '"gpu-1"' && break; sleep 1; done
farm devices | tee "$OUT/devices.txt"
log "job"
status=0
# GPU_CHECK_SET: --set overrides for a dry run on a host without a GPU (e.g. matrix.accelerators=[cpu])
farm submit "$WORK/job.yaml" ${GPU_CHECK_SET:+--set "$GPU_CHECK_SET"} > "$OUT/submit.txt" 2> "$OUT/submit.err" || status=$?
log "submit exited $status"
cat "$OUT/submit.txt"
farm results 1 --json > "$OUT/results.json" || true
farm results 1 --pairs --json > "$OUT/pairs.json" || true
farm results 1 --wide > "$OUT/results_wide.txt" || true
log "done"
exit $status
