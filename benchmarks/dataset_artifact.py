"""A dataset job's tasks on the wire, the packed samples inline against the uploaded artifact (issue 30).

Before, a controller job carried `workload.dataset.packed` (base64 of the .npz) in its plan, so every task offer
held the whole dataset; now the plan names the artifact by sha256 and each agent fetches it once into its cache.
This measures, for a dataset of N samples shaped like an ImageNet classifier's input (float32 [3, 224, 224]):
the packed .npz's size; one task offer's serialized bytes each way (the controller encodes a plan once and reuses
it, so bytes are what a task costs on the wire); the bytes a job of T tasks sends agents each way (after: T offers
plus one fetch per agent); the agent's own step after: reading the cached file and encoding it for its driver.

Run: python benchmarks/dataset_artifact.py [--samples N] [--tasks T] [--agents A] [--json]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def _offer_bytes(dataset: object) -> int:
    from farm.proto.generated import agent_pb2
    from farm.proto.spec import BenchmarkWorkload, SimBudget
    from farm.proto.tasks import TaskPlan, TaskSpec
    from farm.proto.wire import task_to_message

    plan = TaskPlan(workload=BenchmarkWorkload(dataset=dataset), sim=SimBudget(), run_timeout_s=600.0,
                    base_dir="/srv/jobs/bench")
    task = TaskSpec(task_id=12346, job_id=3, attempt=1, target="sim", model_name="classifier.onnx",
                    model_path="classifier.onnx", model_sha256="a" * 64, model_family=None, threads=1, batch_size=1,
                    input_size=None, repeat=0, plan=plan)
    return len(task_to_message(task, agent_pb2.TaskOffer().task).SerializeToString())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tasks", type=int, default=20, help="tasks of the job (models x threads x repeats)")
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from farm.proto.accuracy import pack
    from farm.proto.spec import DatasetSpec

    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (args.samples, 3, 224, 224)).astype(np.float32)
    labels = rng.integers(0, 1000, args.samples)
    reference = {"logits": rng.normal(0, 1, (args.samples, 1000)).astype(np.float32)}
    packed = pack({"x": x}, labels, reference)
    raw = base64.b64decode(packed)
    sha256 = hashlib.sha256(raw).hexdigest()
    inline = _offer_bytes(DatasetSpec(path="samples.npz", labels="labels.npy", packed=packed))
    artifact = _offer_bytes(DatasetSpec(path="samples.npz", labels="labels.npy", artifact=sha256))
    with tempfile.TemporaryDirectory() as tmp:  # the agent's step: its cached copy read and encoded for the driver
        cached = Path(tmp) / f"{sha256}.npz"
        cached.write_bytes(raw)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            base64.b64encode(cached.read_bytes()).decode()
            times.append(time.perf_counter() - start)
    figures = {
        "samples": args.samples, "tasks": args.tasks, "agents": args.agents, "packed_bytes": len(raw),
        "offer_bytes_inline": inline, "offer_bytes_artifact": artifact,
        "job_bytes_inline": inline * args.tasks,
        "job_bytes_artifact": artifact * args.tasks + len(raw) * args.agents,
        "agent_read_encode_ms": round(min(times) * 1000, 2),
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    for key, value in figures.items():
        print(f"{key:24} {value:,}" if isinstance(value, int) else f"{key:24} {value}")


if __name__ == "__main__":
    main()
