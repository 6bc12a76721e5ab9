"""The published Jetson Nano experiment's script, without PyTorch: load one image or video model,
classify a stream of random images (N, C, H, W) or 16-frame clips (N, C, T, H, W) one batch at a
time, and print each inference's time as a JSON line.

farm times the whole script (load + every inference) and samples its memory, on the board with
jtop or tegrastats and in the sim with the cgroup, as the original did with jetson-stats and
docker stats. It runs on the board's own python3 (JetPack 4 ships 3.6: keep it 3.6-compatible).

    python infer.py MODEL THREADS BATCH INFERENCES
"""

import json
import sys
import time

import numpy as np


def onnx_model(path, threads):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]

    def infer(images):
        return session.run(None, {first.name: images})[0]
    shape = [d if isinstance(d, int) and d > 0 else None for d in first.shape]
    return infer, shape, "nchw"


def tflite_model(path, threads):
    try:
        from tflite_runtime.interpreter import Interpreter
    except ImportError:
        from ai_edge_litert.interpreter import Interpreter
    interp = Interpreter(model_path=path, num_threads=threads)
    interp.allocate_tensors()
    first, out = interp.get_input_details()[0], interp.get_output_details()[0]

    def infer(images):
        if list(images.shape) != list(first["shape"]):
            interp.resize_tensor_input(first["index"], list(images.shape))
            interp.allocate_tensors()
        interp.set_tensor(first["index"], images)
        interp.invoke()
        return interp.get_tensor(out["index"])
    return infer, [int(d) for d in first["shape"]], "nhwc"


def main(model, threads, batch, images):
    infer, shape, layout = (onnx_model if model.endswith(".onnx") else tflite_model)(model, threads)
    shape[0] = batch
    if len(shape) == 5:  # a video model: channels, frames, height, width
        defaults = [3, 16, 112, 112] if layout == "nchw" else [16, 112, 112, 3]
    else:
        defaults = [3, 224, 224] if layout == "nchw" else [224, 224, 3]
    shape = [d if d is not None else defaults[i - 1] for i, d in enumerate(shape)]
    rng = np.random.RandomState(0)
    done = 0
    while done < images:
        batch_images = rng.random_sample(shape).astype(np.float32)
        t0 = time.perf_counter()
        scores = infer(batch_images)
        print(json.dumps({"latency_ms": (time.perf_counter() - t0) * 1e3,
                          "top1": int(np.argmax(scores.reshape(batch, -1)[0]))}), flush=True)
        done += batch
    print("classified {} {} with {}".format(done, "clips" if len(shape) == 5 else "images", model.rsplit("/", 1)[-1]))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
