"""Run an ONNX model on random input and print each inference's time as a JSON line for farm."""

import argparse
import json
import time

import numpy as np
import onnxruntime as ort

DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(uint8)": np.uint8}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]  # a dynamic batch runs as 1
        feeds[i.name] = rng.random(shape).astype(DTYPES.get(i.type, np.float32))
    session.run(None, feeds)  # the first inference warms the runtime up; not a sample
    for _ in range(args.iterations):
        start = time.perf_counter()
        session.run(None, feeds)
        print(json.dumps({"latency_ms": (time.perf_counter() - start) * 1000.0}), flush=True)


if __name__ == "__main__":
    main()
