"""`farm quantize`: an int8 variant of an .onnx model made with ONNX Runtime's own tool, and its lineage.

Methods (issue 30 item 3):
- `dynamic`: `onnxruntime.quantization.quantize_dynamic` — int8 weights, activations quantized at run time;
  needs no calibration data.
- `static`: `quantize_static` in the QOperator format (QLinearConv, ...), activations' ranges from calibration data.
- `qdq`: `quantize_static` in the QDQ format (QuantizeLinear/DequantizeLinear pairs around float ops).

Calibration data (static, qdq): an .npz whose keys are the model's input names, a .npy (one-input models), or a
folder of them; an array is one sample (the input's shape) or a stack of samples (one more leading axis). Files
are read with `allow_pickle=False`: a pickle named .npy is refused, never run. Without calibration data, farm feeds
random inputs of the model's shapes (uniform [0, 1) for floats) and the lineage says so: ranges from random inputs
are not the ranges of real data, so the variant's accuracy means little.

The lineage is a sidecar `OUT.farm-lineage.json` (the source's sha256 and path, the method, the calibration set and
its sha256, onnxruntime's version, the date), also kept in the model's own metadata (`farm.lineage`), so a copy of
the file without its sidecar still says what it was made from. `read_lineage` reads either.

.tflite files are refused: LiteRT ships the interpreter only; its quantizer is TensorFlow's TFLiteConverter,
which is not installed with farm. fp16 needs onnxconverter-common (`--method fp16` uses it when installed).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

METHODS = ("dynamic", "static", "qdq", "fp16")
LINEAGE_SUFFIX = ".farm-lineage.json"
METADATA_KEY = "farm.lineage"
RANDOM_SAMPLES = 8  # calibration samples of random inputs when no data is given
MAX_SAMPLES = 1000  # calibration samples read from the given data at most


class QuantizeError(ValueError):
    """Why a model was not quantized: names the file and the flag to change."""


@dataclass(frozen=True)
class QuantizeResult:
    output: Path
    lineage_path: Path
    lineage: dict[str, Any]
    source_size_bytes: int
    output_size_bytes: int
    seconds: float


def lineage_path(model: Path) -> Path:
    return model.with_name(model.name + LINEAGE_SUFFIX)


def default_output(model: Path, method: str) -> Path:
    tag = {"dynamic": "int8", "static": "int8-static", "qdq": "int8-qdq", "fp16": "fp16"}[method]
    return model.with_name(f"{model.stem}.{tag}.onnx")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


METADATA_READ_LIMIT = 256 << 20  # an .onnx larger than this is not parsed for its metadata (its sidecar still counts)


def read_lineage(model: Path, *, metadata: bool = True) -> dict[str, Any] | None:
    """The model's lineage: its sidecar, else the `farm.lineage` entry of an .onnx file's metadata; None if neither.
    (ONNX has no partial parse: reading the metadata reads the file, so files over METADATA_READ_LIMIT are skipped.)"""
    sidecar = lineage_path(model)
    try:
        data = json.loads(sidecar.read_text())
        if isinstance(data, dict):
            return data
    except (OSError, ValueError):
        pass
    if (not metadata or model.suffix.lower() != ".onnx" or not model.is_file()
            or model.stat().st_size > METADATA_READ_LIMIT):
        return None
    try:
        import onnx
        proto = onnx.load(str(model), load_external_data=False)
    except Exception:  # not an ONNX file after all: no lineage to read
        return None
    for prop in proto.metadata_props:
        if prop.key == METADATA_KEY:
            try:
                data = json.loads(prop.value)
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


# --- calibration data ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelInput:
    name: str
    shape: list[int | str | None]  # as declared: a symbol or None for a dynamic dimension
    dtype: Any  # numpy dtype


def model_inputs(model: Path) -> list[ModelInput]:
    """The graph's inputs that are not initializers, with their declared shapes and numpy dtypes."""
    import onnx
    from onnx import helper

    proto = onnx.load(str(model), load_external_data=False)
    initializers = {i.name for i in proto.graph.initializer}
    found = []
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        t = value.type.tensor_type
        shape: list[int | str | None] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                         for d in t.shape.dim]
        found.append(ModelInput(value.name, shape, helper.tensor_dtype_to_np_dtype(t.elem_type)))
    return found


def _load_array_file(path: Path, flag: str) -> dict[str, Any]:
    """{name: array} from one .npz, or {"": array} from one .npy; pickles refused."""
    import numpy as np

    try:
        loaded = np.load(path, allow_pickle=False)
    except ValueError as e:  # "Object arrays cannot be loaded when allow_pickle=False", or not an array file
        raise QuantizeError(f"{flag} {path}: not a plain NumPy array file ({e}); farm reads .npy/.npz with "
                            "allow_pickle=False, so pickled objects are refused") from None
    except OSError as e:
        raise QuantizeError(f"{flag} {path}: cannot be read: {e}") from None
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            try:
                return {key: loaded[key] for key in loaded.files}
            except ValueError as e:
                raise QuantizeError(f"{flag} {path}: an array in it is not plain ({e}); farm reads .npz with "
                                    "allow_pickle=False, so pickled objects are refused") from None
    return {"": loaded}


def _samples_of(array: Any, model_input: ModelInput, where: str) -> list[Any]:
    """One array as a list of samples of the input's shape: the array itself, or a stack of them."""
    import numpy as np

    declared = model_input.shape

    def fits(shape: tuple[int, ...]) -> bool:
        return len(shape) == len(declared) and all(
            not (isinstance(d, int) and d > 0) or d == s for d, s in zip(declared, shape, strict=True))

    if np.dtype(array.dtype).kind != np.dtype(model_input.dtype).kind and not (
            np.dtype(array.dtype).kind in "iu" and np.dtype(model_input.dtype).kind in "iu"):
        raise QuantizeError(f"{where}: input {model_input.name!r} is {np.dtype(model_input.dtype)}, the file gives "
                            f"{array.dtype}")
    if fits(array.shape):
        return [np.asarray(array, dtype=model_input.dtype)]
    if array.ndim == len(declared) + 1 and fits(array.shape[1:]):
        return [np.asarray(a, dtype=model_input.dtype) for a in array]  # a 0-d input's samples stay arrays
    shape = "×".join("?" if not (isinstance(d, int) and d > 0) else str(d) for d in declared)
    raise QuantizeError(f"{where}: input {model_input.name!r} has shape {shape}, the file gives "
                        f"{'×'.join(map(str, array.shape)) or 'a scalar'} (one sample of that shape, or a stack of "
                        "them along a new first axis)")


def calibration_files(source: Path) -> list[Path]:
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.suffix.lower() in (".npy", ".npz") and p.is_file())
        if not files:
            raise QuantizeError(f"--calibration {source}: the folder holds no .npy or .npz file")
        return files
    if not source.exists():
        raise QuantizeError(f"--calibration {source}: no such file or folder")
    if source.suffix.lower() not in (".npy", ".npz"):
        raise QuantizeError(f"--calibration {source}: give an .npz (keys: the model's input names), an .npy "
                            "(one-input models) or a folder of them")
    return [source]


def calibration_sha256(source: Path, files: list[Path]) -> str:
    """A file's sha256; for a folder, the sha256 of its files' names and digests, in order."""
    if not source.is_dir():
        return file_sha256(source)
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def read_calibration(source: Path, inputs: list[ModelInput]) -> list[dict[str, Any]]:
    """The calibration samples ({input name: array} each) in `source`, checked against the model's inputs."""
    names = [i.name for i in inputs]
    by_name = {i.name: i for i in inputs}
    samples: list[dict[str, Any]] = []
    for path in calibration_files(source):
        arrays = _load_array_file(path, "--calibration")
        where = f"--calibration {path}"
        if "" in arrays:  # a .npy: one input's values
            if len(inputs) != 1:
                raise QuantizeError(f"{where}: an .npy holds one array, the model has {len(inputs)} inputs "
                                    f"({', '.join(names)}); give an .npz with one array per input name")
            arrays = {names[0]: arrays[""]}
        missing = [n for n in names if n not in arrays]
        unknown = [k for k in arrays if k not in by_name]
        if missing or unknown:
            raise QuantizeError(
                f"{where}: the arrays' names must be the model's input names ({', '.join(names)})"
                + (f"; missing: {', '.join(missing)}" if missing else "")
                + (f"; not inputs of the model: {', '.join(k[:80] for k in unknown)}" if unknown else ""))
        per_input = {n: _samples_of(arrays[n], by_name[n], where) for n in names}
        counts = {len(v) for v in per_input.values()}
        if len(counts) != 1:
            raise QuantizeError(f"{where}: the inputs give different numbers of samples "
                                f"({', '.join(f'{n}: {len(v)}' for n, v in per_input.items())})")
        for i in range(counts.pop()):
            samples.append({n: per_input[n][i] for n in names})
            if len(samples) >= MAX_SAMPLES:
                return samples
    return samples


def random_calibration(model: Path, inputs: list[ModelInput], count: int = RANDOM_SAMPLES,
                       shapes: dict[str, list[int]] | None = None) -> list[dict[str, Any]]:
    """Random samples of the model's shapes (batch 1; floats uniform [0, 1), integers 0/1); `shapes` (--shape) fixes
    dynamic dimensions."""
    import numpy as np

    from farm.models.runtimes import InputShapeError, resolve_shape

    rng = np.random.default_rng(0)
    samples = []
    for _ in range(count):
        sample = {}
        for i in inputs:
            try:
                shape = resolve_shape(i.name, [d if isinstance(d, int) else None for d in i.shape], layout="nchw",
                                      batch_size=1, input_size=None, overrides=shapes or {})
            except InputShapeError as e:
                raise QuantizeError(f"{model}: {e.args[0].split(';')[0]}; random calibration inputs need full "
                                    f"shapes: give --shape {i.name}=DIMS, or --calibration FILE.npz with real "
                                    "inputs") from None
            dtype = np.dtype(i.dtype)
            if dtype.kind == "f":
                sample[i.name] = rng.random(shape, dtype=np.float32).astype(dtype)
            elif dtype.kind in "iub":
                sample[i.name] = rng.integers(0, 1, size=shape, endpoint=True).astype(dtype)
            else:
                raise QuantizeError(f"{model}: input {i.name!r} is {dtype}; give --calibration with its values")
        samples.append(sample)
    return samples


class _Reader:
    """onnxruntime's CalibrationDataReader protocol over a list of samples."""

    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self._it = iter(samples)

    def get_next(self) -> dict[str, Any] | None:
        return next(self._it, None)

    def rewind(self) -> None:  # not needed by MinMax; kept for the protocol
        pass


# --- quantize ------------------------------------------------------------------------------------------------
def _onnxruntime_message(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:600]}" if text else type(e).__name__


def check_source(model: Path, method: str) -> None:
    if method not in METHODS:
        raise QuantizeError(f"--method {method}: choose one of {', '.join(METHODS)}")
    if not model.exists():
        raise QuantizeError(f"{model}: no such file")
    if not model.is_file():
        raise QuantizeError(f"{model}: not a file")
    suffix = model.suffix.lower()
    if suffix == ".tflite":
        raise QuantizeError(
            f"{model}: farm quantize makes variants of .onnx files with ONNX Runtime's tool; a .tflite is quantized "
            "by TensorFlow's TFLiteConverter (LiteRT, installed here, ships only the interpreter). Quantize the "
            "source model with TensorFlow, or give its .onnx export")
    if suffix != ".onnx":
        raise QuantizeError(f"{model}: farm quantize reads .onnx files (this one is neither .onnx nor .tflite "
                            "by its extension)")


def quantize(model: Path, output: Path | None = None, *, method: str = "dynamic", calibration: Path | None = None,
             force: bool = False, shapes: dict[str, list[int]] | None = None) -> QuantizeResult:
    """Write an int8 (or fp16) variant of `model` and its lineage; QuantizeError says why not. The steps: the output
    name checked, the source loaded as a run loads it, the calibration samples, the variant written to a temporary
    file beside the output and loaded back, its lineage stamped in, then moved into place with its sidecar."""
    out = _checked_output(model, output, method, calibration, force)
    from farm.models.runtimes import onnx_session
    try:  # the source must load as a run loads it: onnxruntime's own message otherwise
        onnx_session(str(model), threads=1)
    except Exception as e:
        raise QuantizeError(f"{model}: ONNX Runtime cannot load it: {_onnxruntime_message(e)}") from None
    samples, calibration_record = _calibration_samples(model, method, calibration, shapes)
    started = time.perf_counter()
    tmp = _temporary_beside(out)
    try:
        preprocess = _write_variant(model, tmp, method, samples)
        seconds = time.perf_counter() - started
        try:
            onnx_session(str(tmp), threads=1)
        except Exception as e:
            raise QuantizeError(f"{model}: ONNX Runtime's quantizer wrote a model it cannot load "
                                f"(--method {method}): {_onnxruntime_message(e)}") from None
        lineage = _lineage(model, method, calibration_record, preprocess, seconds)
        _stamp_metadata(tmp, lineage)
        lineage["output"] = {"path": str(out.absolute()), "sha256": file_sha256(tmp), "size_bytes": tmp.stat().st_size}
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        for extra in out.parent.iterdir():  # the pre-processed model and onnxruntime's files beside it
            if extra.name.startswith(tmp.stem):
                extra.unlink(missing_ok=True)
    sidecar = lineage_path(out)
    sidecar.write_text(json.dumps(lineage, indent=2) + "\n")
    return QuantizeResult(out, sidecar, lineage, model.stat().st_size, out.stat().st_size, seconds)


def _checked_output(model: Path, output: Path | None, method: str, calibration: Path | None, force: bool) -> Path:
    """The variant's path (-o, else the default name beside the source), or QuantizeError naming what is wrong
    with it, or with a --calibration the method does not use."""
    check_source(model, method)
    out = output or default_output(model, method)
    if out.suffix.lower() != ".onnx":
        raise QuantizeError(f"-o {out}: the variant is an ONNX file; give a name ending in .onnx")
    if out.resolve() == model.resolve():
        raise QuantizeError(f"-o {out}: that is the source model; give another name")
    if out.exists() and not force:
        named = f"-o {out}" if output is not None else f"{out} (the default output name; -o gives another)"
        raise QuantizeError(f"{named}: the file exists; give another name, or --force to replace it")
    if not out.parent.is_dir():
        raise QuantizeError(f"-o {out}: the folder {out.parent} does not exist")
    if calibration is not None and method in ("dynamic", "fp16"):
        raise QuantizeError(f"--calibration {calibration}: --method {method} uses no calibration data; "
                            "use --method static or qdq")
    return out


def _calibration_samples(model: Path, method: str, calibration: Path | None, shapes: dict[str, list[int]] | None,
                         ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(samples, the lineage's calibration record) for static and qdq: the --calibration file's samples, else
    random inputs of the model's shapes (--shape fixing the dynamic ones); none for dynamic and fp16."""
    inputs = model_inputs(model)
    if method not in ("static", "qdq"):
        return [], None
    if calibration is not None:
        samples = read_calibration(calibration, inputs)
        if not samples:
            raise QuantizeError(f"--calibration {calibration}: no samples in it")
        return samples, {"source": "file", "path": str(calibration.absolute()),
                         "sha256": calibration_sha256(calibration, calibration_files(calibration)),
                         "samples": len(samples)}
    unknown = sorted(set(shapes or {}) - {i.name for i in inputs})
    if unknown:
        raise QuantizeError(f"--shape {unknown[0][:80]}: {model} has no such input (its inputs: "
                            f"{', '.join(i.name for i in inputs)})")
    samples = random_calibration(model, inputs, shapes=shapes)
    return samples, {"source": "random", "path": None, "sha256": None, "samples": len(samples),
                     "note": "random inputs of the model's shapes (uniform [0, 1) for floats): the "
                             "activation ranges are not those of real data"}


def _temporary_beside(out: Path) -> Path:
    """An empty file in the output's folder (so the final move is a rename), with a plain new file's mode."""
    try:
        fd, tmp_name = tempfile.mkstemp(suffix=".onnx", prefix=f".{out.stem}.", dir=out.parent)
    except OSError as e:
        raise QuantizeError(f"-o {out}: cannot write in {out.parent}: {e.strerror or e}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as a plain new file would be, not mkstemp's 0600
    return tmp


def _write_variant(model: Path, tmp: Path, method: str, samples: list[dict[str, Any]]) -> str:
    """The variant written to tmp by ONNX Runtime's tools (pre-processed first where it can be); the pre-processing
    as the lineage records it."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(4)  # its native log lines: the failure, if any, is our message
    try:
        prepared, preprocess = _preprocess(model, tmp, method)
        try:
            _run_tool(prepared, tmp, method, samples, source=model)
        finally:
            if prepared != model:
                prepared.unlink(missing_ok=True)
    finally:
        onnxruntime.set_default_logger_severity(2)  # onnxruntime's default (warnings)
    return preprocess


def _lineage(model: Path, method: str, calibration_record: dict[str, Any] | None, preprocess: str,
             seconds: float) -> dict[str, Any]:
    """The variant's lineage (the sidecar, and the model's metadata): source, method, calibration, tool, timing."""
    import onnxruntime

    return {
        "kind": "farm-lineage", "version": 1,
        "source": {"path": str(model.absolute()), "sha256": file_sha256(model), "size_bytes": model.stat().st_size},
        "method": method, "precision": "fp16" if method == "fp16" else "int8",
        "calibration": calibration_record,
        "tool": {"name": "onnxruntime.quantization" if method != "fp16" else "onnxconverter_common.float16",
                 "onnxruntime": onnxruntime.__version__},
        "created": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "preprocess": preprocess,
        "quantize_s": round(seconds, 3),
    }


def _preprocess(model: Path, tmp: Path, method: str) -> tuple[Path, str]:
    """ONNX Runtime's own pre-processing (`quant_pre_process`: its graph optimizations, which turn Constant nodes into
    initializers the quantizer can read, and shape inference); the model as it is when that fails, said so."""
    if method == "fp16":
        return model, "none"
    import logging

    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = tmp.with_name(tmp.stem + ".pre.onnx")
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        quant_pre_process(str(model), str(prepared), skip_symbolic_shape=True)
        return prepared, "onnxruntime quant_pre_process (optimization, shape inference)"
    except Exception as e:
        prepared.unlink(missing_ok=True)
        return model, f"skipped: quant_pre_process failed ({_onnxruntime_message(e)[:200]})"
    finally:
        root.setLevel(level)


def _run_tool(model: Path, tmp: Path, method: str, samples: list[dict[str, Any]], *, source: Path) -> None:
    """`model` (perhaps pre-processed) into `tmp`; messages name `source`, the user's file."""
    if method == "fp16":
        try:
            from onnxconverter_common import float16  # type: ignore[import-not-found]
        except ImportError:
            raise QuantizeError(f"--method fp16 ({source}): needs onnxconverter-common (pip install "
                                "onnxconverter-common), which is not installed here; onnx itself has no fp16 "
                                "converter. Use --method dynamic, static or qdq for int8") from None
        import onnx
        try:
            converted = float16.convert_float_to_float16(onnx.load(str(model)), keep_io_types=True)
            onnx.save(converted, str(tmp))
        except Exception as e:
            raise QuantizeError(f"{source}: fp16 conversion failed (--method fp16): {_onnxruntime_message(e)}") from None
        return
    import logging

    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))  # its "consider pre-processing" advice goes to the root logger
    try:
        if method == "dynamic":
            quantize_dynamic(str(model), str(tmp), weight_type=QuantType.QInt8)
        else:
            quantize_static(str(model), str(tmp), _Reader(samples),  # type: ignore[arg-type]
                            quant_format=QuantFormat.QDQ if method == "qdq" else QuantFormat.QOperator,
                            activation_type=QuantType.QUInt8 if method == "static" else QuantType.QInt8,
                            weight_type=QuantType.QInt8)
    except QuantizeError:
        raise
    except Exception as e:
        raise QuantizeError(f"{source}: ONNX Runtime's quantizer failed (--method {method}): "
                            f"{_onnxruntime_message(e)}") from None
    finally:
        root.setLevel(level)


def _stamp_metadata(path: Path, lineage: dict[str, Any]) -> None:
    """The lineage in the model's own metadata_props (replacing an older farm.lineage entry)."""
    import onnx

    proto = onnx.load(str(path))
    kept = [p for p in proto.metadata_props if p.key != METADATA_KEY]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    entry = proto.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, json.dumps(lineage, sort_keys=True)
    onnx.save(proto, str(path))
