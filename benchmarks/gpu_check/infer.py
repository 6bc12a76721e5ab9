"""The GPU check's script workload (benchmarks/gpu_check.sh): one TorchScript model timed with PyTorch on the
compute unit farm names ({accelerator}: cpu or cuda) at the precision it names ({precision}).

Prints one JSON line per timed inference ({"latency_ms": ...}: farm's per-inference samples); on a GPU each one is
timed to the end of its kernels (torch.cuda.synchronize). Runs at least --iterations, and on until --min-seconds
have passed, so a fast GPU run lasts long enough for NVML's power and energy readings."""
import argparse
import json
import sys
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--accelerator", default="cpu")
parser.add_argument("--precision", default="fp32")
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--size", type=int, default=224)
parser.add_argument("--iterations", type=int, default=20)
parser.add_argument("--warmup", type=int, default=5)
parser.add_argument("--min-seconds", type=float, default=2.0)
parser.add_argument("--max-iterations", type=int, default=5000)
args = parser.parse_args()

if args.accelerator not in ("cpu", "cuda", "gpu"):
    sys.exit(f"infer.py drives cpu and cuda, not {args.accelerator}")
device = "cpu" if args.accelerator == "cpu" else "cuda"
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("infer.py: accelerator cuda asked for, but PyTorch sees no CUDA device on this host")
dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(args.precision)
if dtype is None:
    sys.exit(f"infer.py runs fp32 and fp16, not {args.precision}")
torch.set_num_threads(args.threads)
model = torch.jit.load(args.model, map_location="cpu").eval().to(device=device, dtype=dtype)
x = torch.randn(args.batch, 3, args.size, args.size, device=device, dtype=dtype)


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


with torch.inference_mode():
    for _ in range(args.warmup):
        model(x)
    sync()
    start = time.perf_counter()
    done = 0
    while done < args.iterations or (time.perf_counter() - start < args.min_seconds and done < args.max_iterations):
        t0 = time.perf_counter()
        model(x)
        sync()
        print(json.dumps({"latency_ms": (time.perf_counter() - t0) * 1e3}))
        done += 1
if device == "cuda":
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "max_memory_allocated_mib": torch.cuda.max_memory_allocated() / 2**20}), file=sys.stderr)
