"""Write farm's example models: the MobileNetV2 family in both formats, the onnx zoo, a tiny conv.

Output is deterministic (fixed seed, deterministic serialisation), so a second run finds every
file already holding the same bytes and writes nothing.
"""

from __future__ import annotations

import os
import re
import shlex
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from farm.model_generators.classic_tflite import CLASSIC_TFLITE
from farm.model_generators.generate_onnx import mobilenetv2_onnx, serialize_onnx, tiny_onnx
from farm.model_generators.generate_tflite import mobilenetv2_tflite, tiny_tflite
from farm.model_generators.mobilenetv2 import DEFAULT_SEED, INPUT_SIZES, WIDTHS, model_name
from farm.model_generators.published_nets import JETSON_EXPERIMENT_MODELS
from farm.model_generators.zoo import copy_zoo, zoo_models

FORMATS: tuple[str, ...] = ("tflite", "onnx")
MOBILENETV2_FAMILY = "mobilenetv2"
ZOO_FAMILY = "zoo"
DYNAMIC_BATCH_SUFFIX = "_dynbatch"


@dataclass(frozen=True)
class GeneratedModel:
    path: Path
    name: str  # file stem: mobilenetv2_w0.5_r160, resnet50
    family: str  # "mobilenetv2" | "zoo" | "image" | "video" (the published Jetson experiment's)
    format: str  # "tflite" | "onnx"
    width: float | None = None
    input_size: int | None = None
    written: bool = True  # False when the file already held exactly these bytes


# Called after each model with (model, models done so far, models in total).
ProgressCallback = Callable[[GeneratedModel, int, int], None]


def write_if_changed(path: Path, data: bytes) -> bool:
    """Atomically replace `path` with `data` unless it already holds exactly that; True if written."""
    if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target, then rename: a reader never sees half a model.
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return True


def mobilenetv2_bytes(
    fmt: str, width: float, input_size: int, *, dynamic_batch: bool = False, seed: int = DEFAULT_SEED
) -> bytes:
    """The serialised MobileNetV2 variant in `fmt` ('tflite' or 'onnx')."""
    if fmt == "tflite":
        return mobilenetv2_tflite(width, input_size, dynamic_batch=dynamic_batch, seed=seed)
    if fmt == "onnx":
        return serialize_onnx(mobilenetv2_onnx(width, input_size, dynamic_batch=dynamic_batch, seed=seed))
    raise ValueError(f"unknown model format {fmt!r} (expected one of {', '.join(FORMATS)})")


def generate_examples(
    dest: Path,
    *,
    widths: Sequence[float] = WIDTHS,
    input_sizes: Sequence[int] = INPUT_SIZES,
    formats: Sequence[str] = FORMATS,
    zoo: bool | Iterable[str] = True,
    dynamic_batch: bool = False,
    published: bool = False,
    seed: int = DEFAULT_SEED,
    progress: ProgressCallback | None = None,
) -> list[GeneratedModel]:
    """Write MobileNetV2 for every width x input size x format, plus the zoo, into `dest`.

    `zoo` is True (every zoo model), False (none) or the zoo names to copy. `published` adds the
    published Jetson experiment's 5 image and 11 video models as ONNX (families "image" and "video").
    Files that already hold the same bytes are not rewritten (GeneratedModel.written is False for them).
    """
    unknown_formats = [fmt for fmt in formats if fmt not in FORMATS]
    if unknown_formats:
        raise ValueError(f"unknown model format(s) {unknown_formats} (expected {', '.join(FORMATS)})")
    zoo_names: list[str] = list(zoo_models()) if zoo is True else [] if zoo is False else list(zoo)
    # the classics as .tflite too (phones run nothing else): SqueezeNet 1.1 and GoogLeNet, built here
    classics = list(CLASSIC_TFLITE) if zoo is True and "tflite" in formats else []
    total = len(widths) * len(input_sizes) * len(formats) + len(zoo_names) + len(classics)
    grid = {f"{model_name(width, size)}{DYNAMIC_BATCH_SUFFIX if dynamic_batch else ''}.{fmt}"
            for width in widths for size in input_sizes for fmt in formats}
    # MobileNetV2 1.0x at 224 is one of them when the grid has it too: written once
    extra = [model for model in JETSON_EXPERIMENT_MODELS if f"{model.name}.onnx" not in grid] if published else []
    total += len(extra)
    dest.mkdir(parents=True, exist_ok=True)
    generated: list[GeneratedModel] = []

    def record(model: GeneratedModel) -> None:
        generated.append(model)
        if progress is not None:
            progress(model, len(generated), total)

    suffix = DYNAMIC_BATCH_SUFFIX if dynamic_batch else ""
    for width in widths:  # width outermost: the weights of one width are built once, reused per size
        for input_size in input_sizes:
            name = model_name(width, input_size) + suffix
            for fmt in formats:
                path = dest / f"{name}.{fmt}"
                # ONNX Runtime cannot resize a fixed input (LiteRT can): the ONNX files always take any batch
                data = mobilenetv2_bytes(fmt, width, input_size, dynamic_batch=dynamic_batch or fmt == "onnx",
                                         seed=seed)
                written = write_if_changed(path, data)
                record(GeneratedModel(path, name, MOBILENETV2_FAMILY, fmt, width, input_size, written))

    for name in classics:
        path = dest / f"{name}.tflite"
        record(GeneratedModel(path, name, ZOO_FAMILY, "tflite", input_size=224,
                              written=write_if_changed(path, CLASSIC_TFLITE[name](seed=seed))))

    for name in zoo_names:
        target = dest / f"{name}.onnx"
        before = target.read_bytes() if target.is_file() else None
        (path,) = copy_zoo(dest, [name])
        record(GeneratedModel(path, name, ZOO_FAMILY, "onnx", written=before != path.read_bytes()))

    for published_model in extra:
        path = dest / f"{published_model.name}.onnx"
        written = write_if_changed(path, serialize_onnx(published_model.build(seed=seed)))
        record(GeneratedModel(path, published_model.name, published_model.family, "onnx", written=written))
    return generated


def manifest_entries(models: Iterable[GeneratedModel], relative_to: Path | None = None) -> list[dict[str, Any]]:
    """One plain dict per model (name, path, format, family and, for MobileNetV2, width/input_size)."""
    entries: list[dict[str, Any]] = []
    for model in models:
        path = model.path
        if relative_to is not None:
            path = Path(os.path.relpath(path.resolve(), relative_to.resolve()))
        entry: dict[str, Any] = {
            "name": model.name,
            "path": path.as_posix(),
            "format": model.format,
            "family": model.family,
        }
        if model.width is not None:
            entry["width"] = model.width
        if model.input_size is not None:
            entry["input_size"] = model.input_size
        entries.append(entry)
    return entries


def write_manifest(models: Iterable[GeneratedModel], path: Path) -> Path:
    """Write `models:` as a YAML list, paths relative to the manifest's folder."""
    document = {"models": manifest_entries(models, relative_to=path.parent)}
    write_if_changed(path, yaml.safe_dump(document, sort_keys=False).encode())
    return path


# --- the smallest valid models: smoke runs and scheduling benchmarks -----------------------------


def write_tiny_tflite(path: Path) -> Path:
    """One conv on (1, 8, 8, 3): a valid model that loads and runs in milliseconds."""
    write_if_changed(path, tiny_tflite())
    return path


def write_tiny_onnx(path: Path) -> Path:
    """One conv on (1, 3, 8, 8): a valid model that loads and runs in milliseconds."""
    write_if_changed(path, serialize_onnx(tiny_onnx()))
    return path


_EXAMPLE_NAME = re.compile(r"mobilenetv2_w(\d+(?:\.\d+)?)_r(\d+)(_dynbatch)?\.(tflite|onnx)")


def generate_hint(path: Path) -> str | None:
    """For a missing model file that is one of farm's generated examples, the command that writes it."""
    folder = shlex.quote(str(path.parent))
    m = _EXAMPLE_NAME.fullmatch(path.name)
    if m:
        width, size, dynamic, fmt = m.groups()
        if dynamic:
            return ("it is one of farm's example models, with a dynamic batch dimension: `farm models generate --help` "
                    "says how to write it")
        return (f"it is one of farm's example models: `farm models generate {folder} --widths {width} --sizes {size} "
                f"--formats {fmt} --no-zoo` writes it (`make models` writes every model the examples use into "
                "examples/models)")
    if path.suffix == ".onnx" and path.stem in {model.name for model in JETSON_EXPERIMENT_MODELS}:
        return (f"it is one of the published Jetson experiment's models: `farm models generate {folder} --published "
                "--no-zoo --formats onnx --widths 1.0 --sizes 224` writes them (`make models` writes every model the "
                "examples use into examples/models)")
    if path.suffix == ".onnx" and path.stem in zoo_models():
        return (f"it is one of the ONNX zoo models farm copies: `farm models generate {folder} --formats onnx "
                "--widths 1.0 --sizes 224` writes it with the others")
    return None
