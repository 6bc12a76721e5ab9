"""workload.dataset read where a job is submitted (issue 30): the samples, labels and reference outputs are
checked against every model of the job and packed into `workload.dataset.packed`, so agents never read a
user's files and every target compares its outputs with the same reference.

Everything from the user's folder is hostile until checked: paths must stay inside the job's folder, only regular
files are opened, sizes are summed from `stat` before anything is read (the budget is MAX_DATASET_BYTES), arrays
are loaded with allow_pickle=False, and each problem names the file and the field.

A `.tar` (or `.tar.gz`, `.tgz`, `.tar.bz2`, `.tar.xz`) is read as a folder would be, in memory, never extracted to disk:
its members are read in one pass, each header checked before any of its data is read — no absolute name, no `..`,
regular files only (no device, FIFO or sparse member), links only to a regular member of the same archive, at most
MAX_FILES members, and the members' sizes summed against MAX_DATASET_BYTES as each header arrives, so a
decompression bomb is refused from the header that claims too much.
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from farm.proto.accuracy import MAX_DATASET_BYTES, MAX_PACKED_BYTES, pack, unpack, unpack_bytes
from farm.proto.escape import printable
from farm.proto.copying import replaced
from farm.proto.spec import BenchmarkWorkload, DatasetSpec, ImagePreprocess

ResolvedModel = Any  # jobfile.ResolvedModel (jobfile imports this module: no import back)

ARRAY_SUFFIXES = {".npy", ".npz", ".zip"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm"}
MAX_IMAGE_PIXELS = 40_000_000  # a decompression bomb is refused from its header, before it is decoded
MAX_FILES = 100_000
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")


@dataclass(frozen=True)
class _File:
    """One file of a dataset: in the job's folder (`path`) or a member of a tar, read into memory (`data`)."""

    shown: str  # as messages name it: relative to the job's folder, an archive's member after the archive's name
    suffix: str
    path: Path | None = None
    data: bytes | None = None

    def open(self) -> BinaryIO:
        if self.data is not None:
            return io.BytesIO(self.data)
        assert self.path is not None
        return open(self.path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK))


class DatasetRefused(Exception):
    """A dataset that cannot run: `field` is the workload.dataset field at fault, the message names the file."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


_Refused = DatasetRefused


def load_dataset(workload: BenchmarkWorkload, models: list[ResolvedModel], base_dir: Path) -> None:
    """Read, check and pack workload.dataset (a no-op without one); DatasetRefused names the file and the field."""
    dataset = workload.dataset
    if dataset is None:
        return
    if dataset.packed is not None:  # a stored spec (resume, retry) or a user's own: checked as it is read
        try:
            inputs, labels, reference = unpack(dataset.packed)
        except (ValueError, KeyError, OSError, EOFError) as e:
            raise _Refused("packed", f"is not a dataset farm packed ({printable(e, 200)}); leave the field out") from None
    else:
        inputs, labels, reference = _read(dataset, models, base_dir.resolve())
        packed = pack(inputs, labels, reference)
        if len(packed) * 3 // 4 > MAX_PACKED_BYTES:
            raise _Refused("path", f"{printable(dataset.path, 200)!r} packs to {len(packed) * 3 // 4:,} bytes of "
                                   f"samples, labels and reference outputs, over the {MAX_PACKED_BYTES:,} bytes a "
                                   "task carries; use workload.dataset.limit or fewer samples")
        workload.dataset = replaced(dataset, packed=packed, artifact=None)  # read here: no upload is named
    _check_against_models(workload.dataset, inputs, labels, reference, models)


def load_dataset_artifact(workload: BenchmarkWorkload, models: list[ResolvedModel], raw: bytes, sha256: str) -> None:
    """A dataset a client checked, packed and uploaded (dataset.npz, by sha256), checked again here against every
    model of the job; the job keeps its sha256 (`artifact`), never the samples: agents fetch it by hash."""
    dataset = workload.dataset
    assert dataset is not None  # the caller says why not otherwise
    if len(raw) > MAX_PACKED_BYTES:
        raise _Refused("path", f"the uploaded dataset {sha256[:12]} is {len(raw):,} bytes, over the "
                               f"{MAX_PACKED_BYTES:,} bytes a packed dataset may be; use workload.dataset.limit")
    try:
        inputs, labels, reference = unpack_bytes(raw)
    except ValueError as e:
        raise _Refused("path", f"the uploaded dataset {sha256[:12]} is not a dataset farm packed "
                               f"({printable(e, 200)})") from None
    _check_rows(inputs, labels, reference, f"the uploaded dataset {sha256[:12]}")
    _check_against_models(dataset, inputs, labels, reference, models)
    workload.dataset = replaced(dataset, packed=None, artifact=sha256)


def _check_rows(inputs: dict[str, Any], labels: Any, reference: dict[str, Any], shown: str) -> None:
    """What the reading of a user's files makes sure of, checked again on arrays that came from the wire: numbers
    only, finite, one count of samples, a label per sample, a reference row per sample."""
    import numpy as np

    if not inputs:
        raise _Refused("path", f"{shown} holds no input")
    for field, group in (("path", inputs), ("reference", reference), ("labels", {"labels": labels})):
        for name, array in group.items():
            if array is None:
                continue
            if array.dtype.kind not in "biuf" or array.ndim < 1:
                raise _Refused(field, f"{shown}: {printable(name, 80)!r} is {array.dtype}{list(array.shape)}; "
                                      "numbers with the sample as the first axis are needed")
            if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
                raise _Refused(field, f"{shown}: {printable(name, 80)!r} holds NaN or infinite values")
    counts = {name: len(a) for name, a in inputs.items()}
    count = next(iter(counts.values()))
    if len(set(counts.values())) > 1 or count == 0:
        raise _Refused("path", f"{shown}: the inputs hold {counts} samples; one count of at least 1 is needed")
    if labels is not None and len(labels) != count:
        raise _Refused("labels", f"{shown}: {len(labels)} labels for {count} samples; one label per sample")
    short = {name: len(a) for name, a in reference.items() if len(a) < count}
    if short:
        raise _Refused("reference", f"{shown}: the reference holds fewer rows than the {count} samples: {short}")


def _inside(folder: Path, written: str, field: str) -> Path:
    path = (folder / os.path.expanduser(written)).resolve()
    if not path.is_relative_to(folder):
        raise _Refused(field, f"{printable(written, 200)!r} is outside the job's folder ({folder}); a dataset is read "
                              "from there only")
    return path


def _regular(path: Path, field: str, shown: str) -> int:
    try:
        info = os.stat(path)
    except OSError as e:
        raise _Refused(field, f"{shown!r} cannot be opened ({e.strerror}; looked for {path})") from None
    if not stat.S_ISREG(info.st_mode):
        raise _Refused(field, f"{shown!r} is not a regular file (a FIFO, device or folder is never read)")
    return info.st_size


def is_archive(name: str) -> bool:
    return name.lower().endswith(ARCHIVE_SUFFIXES)


def _files(dataset: DatasetSpec, folder: Path) -> tuple[list[_File], int]:
    """The dataset's files and their total size, from stat alone (nothing is read yet); an archive's members are
    read here, each header checked before its data (`_archive`)."""
    path = _inside(folder, dataset.path, "path")
    archive = None
    if path.is_dir():
        paths: list[Path] = []
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if len(paths) >= MAX_FILES:
                    raise _Refused("path", f"{printable(dataset.path, 200)!r} holds more than {MAX_FILES:,} files")
                paths.append(Path(entry.path))
        paths.sort()
        if not paths:
            raise _Refused("path", f"{printable(dataset.path, 200)!r} is an empty folder")
    else:
        paths = [path]
        archive = path if is_archive(path.name) else None
    total = 0
    files = []
    for file in paths:
        shown = printable(str(file.relative_to(folder)), 200)
        if archive is None:
            _suffix_allowed(file.suffix.lower(), shown)
        total += _regular(file, "path", shown)
        files.append(_File(shown, file.suffix.lower(), path=file))
    for field in ("labels", "reference"):
        written = getattr(dataset, field)
        if written is not None and not written.lower().endswith(".onnx"):
            total += _regular(_inside(folder, written, field), field, printable(written, 200))
    if total > MAX_DATASET_BYTES:
        raise _Refused("path", f"{printable(dataset.path, 200)!r} and its labels and reference are {total:,} bytes, "
                               f"over the dataset budget of {MAX_DATASET_BYTES:,} bytes (checked before reading)")
    if archive is not None:
        files = _archive(archive, files[0].shown)
    return files, total


def _suffix_allowed(suffix: str, shown: str) -> None:
    if suffix not in ARRAY_SUFFIXES | IMAGE_SUFFIXES:
        raise _Refused("path", f"{shown!r} is a {suffix or 'extension-less'} file; a dataset holds .npy, .npz "
                               f"and images ({', '.join(sorted(IMAGE_SUFFIXES))}), or a .tar of them")


def _member_name(name: str, where: str) -> str:
    """A member's name as a relative path inside the archive; refused when absolute or climbing out."""
    normal = posixpath.normpath(name)
    if name.startswith(("/", "\\")) or posixpath.isabs(normal) or normal == ".." or normal.startswith("../") \
            or ".." in name.replace("\\", "/").split("/"):
        raise _Refused("path", f"{where} has an absolute name or `..` in it; an archive's members stay inside it")
    return normal


def _archive(path: Path, shown: str) -> list[_File]:
    """A tar's members as dataset files, read in one pass: each header is checked (name, type, links, the count and
    the running size) before any of its data is read; nothing is written to disk."""
    import tarfile

    data: dict[str, bytes] = {}
    links: dict[str, tuple[str, str]] = {}  # name -> (the member it points at, as written)
    count = total = 0
    try:
        with tarfile.open(path, mode="r|*") as tar:  # a stream: no seeking back, headers as they come
            for member in tar:
                count += 1
                where = f"{shown!r} member {printable(member.name, 200)!r}"
                if count > MAX_FILES:
                    raise _Refused("path", f"{shown!r} holds more than {MAX_FILES:,} members")
                name = _member_name(member.name, where)
                if member.isdir() or posixpath.basename(name).startswith("."):
                    continue
                if member.issym() or member.islnk():
                    target = (posixpath.join(posixpath.dirname(name), member.linkname) if member.issym()
                              else member.linkname)
                    links[name] = (_link_target(target, member.linkname, where), member.linkname)
                    continue
                if not member.isreg() or member.issparse():
                    raise _Refused("path", f"{where} is not a regular file (a device, FIFO or sparse member is never "
                                           "read)")
                _suffix_allowed(posixpath.splitext(name)[1].lower(), f"{shown} member {printable(name, 200)}")
                total += member.size
                if total > MAX_DATASET_BYTES:
                    raise _Refused("path", f"{shown!r} unpacks to more than {MAX_DATASET_BYTES:,} bytes (at {where}), "
                                           "over the dataset budget (checked from the members' headers before their "
                                           "data is read)")
                body = tar.extractfile(member)
                data[name] = body.read(member.size + 1) if body is not None else b""
                if len(data[name]) != member.size:
                    raise _Refused("path", f"{where} holds {len(data[name]):,} bytes, its header says {member.size:,}")
    except _Refused:
        raise
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:  # EOFError: a cut-off .gz
        raise _Refused("path", f"{shown!r} is not a tar archive farm can read ({printable(e, 200)})") from None
    for name, (target, written) in links.items():
        if target not in data:
            raise _Refused("path", f"{shown!r} member {printable(name, 200)!r} links to {printable(written, 200)!r}, "
                                   "which is not a regular file of the archive")
        _suffix_allowed(posixpath.splitext(name)[1].lower(), f"{shown} member {printable(name, 200)}")
        data[name] = data[target]
    if not data:
        raise _Refused("path", f"{shown!r} holds no sample file")
    return [_File(f"{shown}:{printable(name, 200)}", posixpath.splitext(name)[1].lower(), data=data[name])
            for name in sorted(data)]


def _link_target(target: str, written: str, where: str) -> str:
    normal = posixpath.normpath(target)
    if posixpath.isabs(written) or posixpath.isabs(normal) or normal == ".." or normal.startswith("../"):
        raise _Refused("path", f"{where} is a link out of the archive (to {printable(written, 200)!r}); links may "
                               "only point at a file of the same archive")
    return normal


def _load_array(path: Path | _File, shown: str, field: str) -> Any:
    import numpy as np

    source = path if isinstance(path, _File) else _File(shown, path.suffix.lower(), path=path)
    try:
        with source.open() as f:
            array = np.load(f, allow_pickle=False)
            if not isinstance(array, np.ndarray):  # an .npz: every member, no pickle
                array = {str(k): array[k] for k in array.files}
    except (OSError, ValueError, EOFError, KeyError) as e:
        raise _Refused(field, f"{shown!r} is not a .npy/.npz numpy can read without pickles ({printable(e, 200)})") from None
    for name, a in (array.items() if isinstance(array, dict) else [("", array)]):
        if a.dtype.kind not in "biuf":
            raise _Refused(field, f"{shown!r}{f' member {name!r}' if name else ''} holds {a.dtype}; give numbers")
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise _Refused(field, f"{shown!r}{f' member {name!r}' if name else ''} holds NaN or infinite values")
    return array


def _image(file: _File, shown: str, prep: ImagePreprocess) -> Any:
    import numpy as np
    try:
        from PIL import Image
    except ImportError:
        raise _Refused("path", f"{shown!r} is an image, and reading images needs Pillow "
                               "(pip install 'farm[analysis]')") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with file.open() as f, Image.open(f) as img:
                if img.width * img.height > MAX_IMAGE_PIXELS:
                    raise _Refused("path", f"{shown!r} is {img.width}x{img.height} pixels, over {MAX_IMAGE_PIXELS:,}")
                resized = img.convert("RGB" if prep.channels == 3 else "L").resize(
                    (prep.size[1], prep.size[0]), Image.Resampling.BILINEAR)
                pixels = np.asarray(resized, dtype=np.float32)
    except _Refused:
        raise
    except Exception as e:  # Pillow raises many types for a broken file
        raise _Refused("path", f"{shown!r} is not an image Pillow can read ({printable(e, 200)})") from None
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    values = (pixels * prep.scale - np.array(prep.mean, np.float32)) / np.array(prep.std, np.float32)
    if prep.layout == "nchw":
        values = values.transpose(2, 0, 1)
    if prep.dtype in ("uint8", "int8"):
        info = np.iinfo(prep.dtype)
        values = np.clip(np.round(values), info.min, info.max)
    return values.astype(prep.dtype)


def _the_input(dataset: DatasetSpec, models: list[ResolvedModel]) -> str:
    if dataset.input is not None:
        return dataset.input
    names = {t.name for m in models for t in m.facts.inputs}
    if len(names) == 1:
        return next(iter(names))
    raise _Refused("input", f"the job's models take {len(names)} inputs ({printable(', '.join(sorted(names)), 200)}); "
                            "name the one the samples feed")


def _read(dataset: DatasetSpec, models: list[ResolvedModel], folder: Path) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    import numpy as np

    files, _ = _files(dataset, folder)
    samples: dict[str, list[Any]] = {}
    whole: dict[str, Any] | None = None
    for file in files:
        shown = file.shown
        suffix = file.suffix
        if suffix in IMAGE_SUFFIXES:
            if dataset.image is None:
                raise _Refused("image", f"{shown!r} is an image; give workload.dataset.image (size, layout, mean, std, "
                                        "dtype) so farm knows how the model wants it")
            samples.setdefault(_the_input(dataset, models), []).append(_image(file, shown, dataset.image))
            continue
        array = _load_array(file, shown, "path")
        if len(files) == 1:  # one file: its first axis is the sample
            whole = array if isinstance(array, dict) else {_the_input(dataset, models): array}
            for name, a in whole.items():
                if a.ndim < 1:
                    raise _Refused("path", f"{shown!r}{f' member {name!r}' if isinstance(array, dict) else ''} is a "
                                           "scalar; its first axis must be the sample")
            break
        for name, a in (array.items() if isinstance(array, dict) else [(_the_input(dataset, models), array)]):
            samples.setdefault(name, []).append(a)
    inputs: dict[str, Any] = {}
    if whole is not None:
        inputs = dict(whole)
    else:
        for name, parts in samples.items():
            shapes = {(p.shape, p.dtype.str) for p in parts}
            if len(shapes) > 1:
                first = parts[0]
                odd = next(i for i, p in enumerate(parts) if (p.shape, p.dtype.str) != (first.shape, first.dtype.str))
                raise _Refused("path", f"sample {odd} of input {printable(name, 80)!r} ({printable(files[odd].shown, 100)}) "
                                       f"is {parts[odd].dtype}{list(parts[odd].shape)}, the first is "
                                       f"{first.dtype}{list(first.shape)}; every sample of an input is alike")
            inputs[name] = np.stack(parts)
    counts = {name: len(a) for name, a in inputs.items()}
    if len(set(counts.values())) > 1:
        raise _Refused("path", f"the inputs hold different numbers of samples: {counts}")
    count = next(iter(counts.values()))
    if count == 0:
        raise _Refused("path", f"{printable(dataset.path, 200)!r} holds no sample")
    if dataset.limit is not None:
        inputs = {n: a[:dataset.limit] for n, a in inputs.items()}
        count = min(count, dataset.limit)
    labels = _labels(dataset, folder, count)
    reference = _reference(dataset, folder, inputs, count)
    return inputs, labels, reference


def _labels(dataset: DatasetSpec, folder: Path, count: int) -> Any:
    import numpy as np

    if dataset.labels is None:
        return None
    path = _inside(folder, dataset.labels, "labels")
    shown = printable(dataset.labels, 200)
    if path.suffix.lower() == ".txt":
        try:
            rows = [line.strip() for line in path.read_text().splitlines() if line.strip()]
            labels = np.array([int(r) for r in rows], dtype=np.int64)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise _Refused("labels", f"{shown!r} is not one whole-number class id a line ({printable(e, 200)})") from None
    else:
        labels = _load_array(path, shown, "labels")
        if isinstance(labels, dict) or labels.dtype.kind not in "iu" or labels.ndim > 2 or (
                labels.ndim == 2 and labels.shape[1] != 1):
            raise _Refused("labels", f"{shown!r} must be whole-number class ids, one per sample ([N] or [N, 1])")
        labels = labels.reshape(-1).astype(np.int64)
    if len(labels) < count:
        raise _Refused("labels", f"{shown!r} has {len(labels)} row(s), fewer than the dataset's {count} sample(s)")
    if len(labels) > count and dataset.limit is None:
        raise _Refused("labels", f"{shown!r} has {len(labels)} rows, more than the dataset's {count} samples; which "
                                 "label is whose is unclear")
    if np.any(labels < 0):
        raise _Refused("labels", f"{shown!r} holds a negative class id")
    return labels[:count]


def _reference(dataset: DatasetSpec, folder: Path, inputs: dict[str, Any], count: int) -> dict[str, Any]:
    import numpy as np

    if dataset.reference is None:
        return {}
    path = _inside(folder, dataset.reference, "reference")
    shown = printable(dataset.reference, 200)
    if path.suffix.lower() == ".onnx":
        _regular(path, "reference", shown)
        return _run_reference(path, shown, inputs)
    loaded = _load_array(path, shown, "reference")
    if not isinstance(loaded, dict):
        raise _Refused("reference", f"{shown!r} must be a .npz of outputs by output name (or a float .onnx model)")
    for name, a in loaded.items():
        if a.ndim < 1 or len(a) < count:
            raise _Refused("reference", f"{shown!r} member {printable(name, 80)!r} has {len(a) if a.ndim else 0} "
                                        f"row(s), fewer than the dataset's {count} sample(s)")
    return {name: a[:count].astype(np.float32) for name, a in loaded.items()}


def _run_reference(path: Path, shown: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The float model over every sample, once, on this machine's CPU: what every target is compared with."""
    import numpy as np

    from farm.models.runtimes import onnx_session
    try:
        session = onnx_session(str(path), threads=1)
    except Exception as e:  # ONNX Runtime raises its own types
        raise _Refused("reference", f"{shown!r} cannot be loaded by ONNX Runtime ({printable(e, 300)})") from None
    wanted = {i.name for i in session.get_inputs()}
    if wanted - set(inputs):
        raise _Refused("reference", f"{shown!r} takes input(s) {printable(', '.join(sorted(wanted - set(inputs))), 200)}, "
                                    "which the dataset does not give")
    names = [o.name for o in session.get_outputs()]
    count = len(next(iter(inputs.values())))
    produced: dict[str, list[Any]] = {n: [] for n in names}
    try:
        for i in range(count):
            for name, value in zip(names, session.run(None, {n: inputs[n][i:i + 1] for n in wanted})):
                produced[name].append(np.asarray(value, dtype=np.float32))
    except Exception as e:
        raise _Refused("reference", f"{shown!r} failed on the dataset's samples ({printable(e, 300)})") from None
    return {n: np.concatenate(v) for n, v in produced.items()}


def _check_against_models(dataset: DatasetSpec | None, inputs: dict[str, Any], labels: Any,
                          reference: dict[str, Any], models: list[ResolvedModel]) -> None:
    """Each model of the job can take every sample: the inputs it has, the dtype, and the shape after the batch."""
    assert dataset is not None
    for model in models:
        declared = {t.name: t for t in model.facts.inputs}
        for name, samples in inputs.items():
            tensor = declared.get(name)
            if tensor is None:
                raise _Refused("input" if dataset.input else "path",
                               f"{model.path.name} has no input named {printable(name, 80)!r} (its inputs: "
                               f"{printable(', '.join(declared), 200)})")
            sample = list(samples.shape[1:])
            dims = list(tensor.shape)
            fits = len(sample) == len(dims) - 1 and all(
                not isinstance(d, int) or d <= 0 or d == s for d, s in zip(dims[1:], sample))
            if not fits:
                raise _Refused("path", f"{printable(dataset.path, 200)!r}: a sample of {printable(name, 80)!r} is "
                                       f"{sample}, but {model.path.name} takes {dims} (a sample is the input without "
                                       "its batch dimension)")
            kind = samples.dtype.kind
            want = tensor.dtype
            same_kind = (kind == "f" and want.startswith("float")) or (kind in "iu" and want.startswith(("int", "uint"))) \
                or (kind == "b" and want == "bool")
            if not same_kind:
                raise _Refused("path", f"{printable(dataset.path, 200)!r}: the samples of {printable(name, 80)!r} are "
                                       f"{samples.dtype}, but {model.path.name} takes {want}")
            if kind != "f" and samples.dtype.name != want:
                raise _Refused("path", f"{printable(dataset.path, 200)!r}: the samples of {printable(name, 80)!r} are "
                                       f"{samples.dtype}, but {model.path.name} takes {want}; give them as {want}")
        outputs = [t.name for t in model.facts.outputs]
        primary = dataset.output or (outputs[0] if outputs else None)
        if dataset.output is not None and dataset.output not in outputs:
            raise _Refused("output", f"{model.path.name} has no output named {printable(dataset.output, 80)!r} "
                                     f"(its outputs: {printable(', '.join(outputs), 200)})")
        if reference and primary not in reference:
            raise _Refused("reference", f"the reference has no output {printable(str(primary), 80)!r} of "
                                        f"{model.path.name} (it has {printable(', '.join(reference), 200)})")
