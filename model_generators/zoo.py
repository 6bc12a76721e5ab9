"""Real model-zoo architectures that ship inside the `onnx` package (no download needed).

onnx keeps "light" copies of the classic ONNX model zoo networks for its backend tests: the full
graph (ResNet-50, SqueezeNet, ShuffleNet, Inception v1/v2, DenseNet-121, VGG-19, AlexNet,
ZFNet-512) with each weight replaced by a ConstantOfShape node, so a file is a few hundred KB
but builds real-size tensors at load time and runs at the real cost.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

ZOO_PREFIX = "light_"


def zoo_directory() -> Path:
    """Where the installed onnx package keeps its light model-zoo files."""
    import onnx

    return Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "light"


def zoo_models() -> dict[str, Path]:
    """Zoo name (e.g. 'resnet50') -> path of its .onnx file, sorted by name; empty if onnx ships none."""
    directory = zoo_directory()
    if not directory.is_dir():
        return {}
    found = {path.stem.removeprefix(ZOO_PREFIX): path for path in directory.glob(f"{ZOO_PREFIX}*.onnx")}
    return dict(sorted(found.items()))


def copy_zoo(dest: Path, names: Iterable[str] | None = None) -> list[Path]:
    """Copy zoo models (all, or `names`) into `dest` as <name>.onnx; unchanged files are left alone.

    Raises KeyError listing the known names when a requested name is not in the zoo.
    """
    available = zoo_models()
    wanted = list(available) if names is None else list(names)
    unknown = [name for name in wanted if name not in available]
    if unknown:
        raise KeyError(f"not in the onnx model zoo: {', '.join(unknown)} (known: {', '.join(available)})")
    dest.mkdir(parents=True, exist_ok=True)
    copied: list[Path] = []
    for name in wanted:
        source = available[name]
        target = dest / f"{name}.onnx"
        if not (target.is_file() and target.read_bytes() == source.read_bytes()):
            shutil.copyfile(source, target)
        copied.append(target)
    return copied
