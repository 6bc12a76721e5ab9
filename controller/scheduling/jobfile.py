"""Reading job.yaml: YAML -> JobSpec -> models found and inspected, or one clear error.

Every error is a JobFileError whose message names the file, the line, the field path
and what is wrong, so the CLI can print it as one paragraph with no traceback.
"""

from __future__ import annotations

import errno
import glob
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import yaml
from pydantic import ValidationError

from farm.controller.scheduling.hooks import missing_model_hint
from farm.proto.copying import replaced
from farm.proto.accelerators import parse_accelerator, why_not
from farm.proto.device_types import DeviceType
from farm.proto.escape import cut_list, printable
from farm.proto.regular_files import MAX_JOB_FILE_BYTES, FileRefused, read_regular_file
from farm.proto.results import ModelFacts, TensorInfo
from farm.proto.storable import field_path, refusal, unstorable
from farm.proto.spec import JOB_FILE, MAX_INPUT_FILE_BYTES, MAX_INPUT_VALUE_ELEMENTS, BenchmarkWorkload, InputSpec, JobSpec, ModelEntry, ScriptWorkload, cores_missing, default_cpus, input_value_shape, parse_cpuset
from farm.proto.tasks import DEFAULT_MAX_TASKS

BENCHMARK_FORMATS = {".tflite": "tflite", ".onnx": "onnx"}
MiB, GiB = 1 << 20, 1 << 30


@dataclass
class JobProblem:
    """One thing wrong with a job file, where it is: printed as file:line: field: message."""

    file: str
    line: int | None
    field: str
    message: str

    def __str__(self) -> str:
        return ": ".join(str(p) for p in (self.file if self.line is None else f"{self.file}:{self.line}",
                                          self.field, self.message) if p)

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "field": self.field or None, "message": self.message}


class JobFileError(Exception):
    """A job file that cannot run; the message is for a person, `problems` for a script."""

    def __init__(self, problems: list[JobProblem] | str) -> None:
        self.problems = [JobProblem("", None, "", problems)] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


@dataclass
class HostCapacity:
    """What the host that will run the sim has: checked against the job's budget at validation."""

    cores: list[int]
    memory_bytes: int | None

    @classmethod
    def here(cls) -> "HostCapacity":
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            memory = None
        return cls(sorted(os.sched_getaffinity(0)), memory)


@dataclass
class InvalidModel:
    """A model of the job that cannot run; with skip_invalid it is recorded as a `job` failure."""

    path: str
    name: str
    family: str | None
    entry_index: int
    problem: JobProblem
    sha256: str = ""


@dataclass
class ResolvedModel:
    path: Path
    name: str
    family: str | None
    facts: ModelFacts
    entry_index: int  # which `models:` entry it came from, for error lines
    display: str | None = None  # where the user has the file, when `path` is the controller's stored copy


@dataclass
class DeviceTarget:
    """A device a job can run on, as the controller knows it (embedded: from the lab's device list)."""

    name: str
    device_type: DeviceType | None = None  # None when the type is unknown
    tags: list[str] = field(default_factory=list)

    @property
    def units(self) -> list[str]:
        """The compute units a job may ask of it: its type's; a device of unknown type is known to have a CPU."""
        return list(self.device_type.accelerators) if self.device_type is not None else ["cpu"]


@dataclass
class ResolvedJob:
    spec: JobSpec
    source: str  # the file's text, stored with the job
    source_path: Path | None
    base_dir: Path
    models: list[ResolvedModel]
    script_dir: Path | None = None
    script_path: Path | None = None
    targets: list[DeviceTarget | None] = field(default_factory=list)  # None = the sim itself
    script_archive: str | None = None  # sha256 of workload.dir packed, in the controller's artifact store
    invalid: list[InvalidModel] = field(default_factory=list)  # skipped models (--skip-invalid)
    warnings: list[JobProblem] = field(default_factory=list)  # runs will happen, but not quite as written


def _locate(root: yaml.Node | None, loc: tuple[Any, ...], missing: bool = False) -> tuple[yaml.Node | None, str]:
    """The YAML node a pydantic error location points at, and its field path (models[1].path).

    Pydantic puts union-branch labels ('str', 'ModelEntry', 'benchmark') into locations;
    they are recognised as keys that are not in the document and left out.
    """
    node, path = root, ""
    for i, key in enumerate(loc):
        last = i + 1 == len(loc)
        if isinstance(node, yaml.SequenceNode) and isinstance(key, int):
            path += f"[{key}]"
            if key >= len(node.value):
                return node, path
            node = node.value[key]
        elif isinstance(node, yaml.MappingNode):
            tag = next((v.value for k, v in node.value if k.value == "type" and isinstance(v, yaml.ScalarNode)), None)
            if key == tag and not last:
                continue  # the discriminated union's branch label (workload 'script'), not the field `script`
            match = next(((k, v) for k, v in node.value if k.value == key), None)
            if match is None:
                if last and missing:  # a missing field: name it, point at its parent
                    return node, path + ("." if path else "") + str(key)
                continue
            path += ("." if path else "") + str(key)
            node = match[0] if last else match[1]  # the last key: point at the field's own line
        else:
            break  # a scalar: what follows are branch labels
    return node, path or "(top level)"


def _describe(err: Mapping[str, Any]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown field (check the spelling; `farm schema` lists every field)"
    if kind == "missing":
        return "required field is missing"
    msg = err["msg"]
    return msg.removeprefix("Value error, ")


# A value that fits no branch of a union gets one error per branch; these say least.
_BRANCH_MISMATCH = {"string_type", "model_type", "model_attributes_type", "union_tag_invalid"}


def _error_lines(errors: Sequence[Mapping[str, Any]], root: yaml.Node | None, source_name: str) -> list[JobProblem]:
    by_path: dict[str, tuple[int, Mapping[str, Any]]] = {}
    for err in errors:
        node, path = _locate(root, err["loc"], missing=err["type"] == "missing")
        line = node.start_mark.line + 1 if node is not None else 1
        if path not in by_path or by_path[path][1]["type"] in _BRANCH_MISMATCH:
            by_path[path] = (line, err)
    # "not a string" next to "models[0].path: missing" only repeats the other branch's view
    keep = {p: v for p, v in by_path.items() if not (
        v[1]["type"] in _BRANCH_MISMATCH and any(o != p and o.startswith(p) for o in by_path))}
    return [JobProblem(source_name, line, path, _describe(err)) for path, (line, err) in keep.items()]


def _duplicate_keys(node: yaml.Node | None, source_name: str, path: str = "",
                    seen: set[int] | None = None) -> list[JobProblem]:
    """A key written twice in one mapping: YAML keeps the last silently, farm refuses it."""
    problems: list[JobProblem] = []
    seen = set() if seen is None else seen
    if id(node) in seen:
        return problems  # an alias: its node was checked where it was defined (and "billion laughs" stay cheap)
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, yaml.Node] = {}
        for key, value in node.value:
            name = str(key.value)
            field_path = f"{path}.{name}" if path else name
            if name in first and name != "<<":
                problems.append(JobProblem(source_name, key.start_mark.line + 1, field_path,
                                           f"duplicate key (first at line {first[name].start_mark.line + 1}); "
                                           "YAML would keep only the last one, so write it once"))
            first.setdefault(name, key)
            problems += _duplicate_keys(value, source_name, field_path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, source_name, f"{path}[{i}]", seen)
    return problems


def parse_job_text(text: str, source_name: str) -> tuple[JobSpec, yaml.Node | None]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        raise JobFileError([JobProblem(source_name, mark.line + 1 if mark else None, "", f"not valid YAML: {problem}.")]) from None
    if data is None:
        raise JobFileError([JobProblem(source_name, None, "", "the file is empty; a job needs at least `models:`.")])
    if not isinstance(data, dict):
        raise JobFileError([JobProblem(source_name, 1, "", f"a job file must be a mapping of fields (models:, workload:, ...), not a {type(data).__name__}.")])
    duplicates = _duplicate_keys(root, source_name)
    if duplicates:
        raise JobFileError(duplicates)
    unstorable_fields = [JobProblem(source_name, _line(root, *path), field_path(path), f"{refusal('this field', bad)}.")
                         for path, bad in unstorable(data)]
    if unstorable_fields:  # every store alike: a NUL reached PostgreSQL's spec_json and broke gc (issue 33, M5)
        raise JobFileError(unstorable_fields[:20])
    try:
        return JobSpec.model_validate(data, context=JOB_FILE), root
    except ValidationError as e:
        raise JobFileError(_error_lines(e.errors(include_url=False), root, source_name)) from None


def _line(root: yaml.Node | None, *loc: Any) -> int:
    node, _ = _locate(root, loc)
    return node.start_mark.line + 1 if node is not None else 1


class ModelFileGate(Protocol):
    """How a controller admits files named by a job from the wire (controller.artifacts.ControllerFiles)."""

    def check_pattern(self, pattern: str, base_dir: Path) -> None: ...
    def admit(self, name: str, base_dir: Path) -> Path: ...


def _model_line(root: yaml.Node | None, index: int) -> int:
    return _line(root, "models", index)


def _missing_file(path: Path, written: str) -> str:
    """Why a model path that does not open as a file: missing, a dangling link, or a symlink loop."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"model file {written!r} is a symlink loop (following the links from {path} comes back round); point it at a real file."
        if os.path.islink(path):
            return f"model file {written!r} is a symlink to {os.readlink(path)}, which does not exist."
    hint = missing_model_hint(path)  # the example-model generators' hint, registered in controller/__init__.py
    return f"model file {written!r} does not exist (looked for {path})" + (f"; {hint}." if hint else ".")


def resolve_models(spec: JobSpec, root: yaml.Node | None, base_dir: Path, source_name: str,
                   gate: ModelFileGate | None = None) -> tuple[list[ResolvedModel], list[InvalidModel]]:
    """Every model the job names, inspected; the ones that cannot run come back apart, each with its problem.

    gate: None for the user's own files (embedded, the client); a controller passes its gate, and a
    name outside its roots is refused at once (nothing is looked up outside them). The steps: each entry's paths
    (its glob expanded), each path admitted and inspected, then the default names given and checked distinct."""
    resolved: list[ResolvedModel] = []
    invalid: list[InvalidModel] = []
    for index, raw in enumerate(spec.models):
        entry = raw if isinstance(raw, ModelEntry) else ModelEntry(path=raw)
        place = _EntryPlace(entry, index, source_name, _model_line(root, index), invalid)
        for path in _entry_paths(place, base_dir, gate):
            model = _inspected(place, path, base_dir, gate)
            if model is not None:
                resolved.append(model)
    _name_models(resolved, source_name)
    return resolved, invalid


@dataclass
class _EntryPlace:
    """A `models:` entry and where the job file has it; `bad` records one of its files as an InvalidModel."""

    entry: ModelEntry
    index: int
    source_name: str
    line: int
    invalid: list[InvalidModel]

    @property
    def field_path(self) -> str:
        return f"models[{self.index}]"

    @property
    def where(self) -> str:
        return f"{self.source_name}:{self.line}: {self.field_path}"

    def bad(self, path: str, message: str) -> None:
        name = self.entry.name or Path(path).stem
        self.invalid.append(InvalidModel(path, name, self.entry.family, self.index,
                                         JobProblem(self.source_name, self.line, self.field_path, message)))


def _entry_paths(place: _EntryPlace, base_dir: Path, gate: ModelFileGate | None) -> list[Path]:
    """The files an entry names: its glob's matches (none: the entry is bad), else its one path; a controller's gate
    refuses a pattern outside its roots before any lookup."""
    entry = place.entry
    if gate is not None:
        try:
            gate.check_pattern(entry.path, base_dir)  # before any lookup: nothing is learnt outside the roots
        except ValueError as e:
            raise JobFileError(f"{place.where}: {e}") from None
    pattern = str(base_dir / (os.path.expanduser(entry.path) if gate is None else entry.path))
    if not glob.has_magic(entry.path):
        return [Path(pattern)]
    paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
    if not paths:
        place.bad(entry.path, f"the glob {entry.path!r} matches no file (searched from {base_dir}).")
    elif entry.name and len(paths) > 1:
        raise JobFileError([JobProblem(place.source_name, place.line, place.field_path, f"`name` is given but the glob {entry.path!r} matches {len(paths)} files; give names per file or drop `name`.")])
    return paths


def _inspected(place: _EntryPlace, path: Path, base_dir: Path, gate: ModelFileGate | None) -> ResolvedModel | None:
    """One file of an entry, admitted by the gate and inspected; None when it is bad (recorded on the entry)."""
    from farm.models.facts import ModelError, inspect_model  # numpy, onnx: loaded when a job is read
    entry = place.entry
    display = None
    if gate is not None:
        try:
            display, path = str(path), gate.admit(str(path), base_dir)
        except ValueError as e:
            raise JobFileError(f"{place.where}: {e}") from None
    if not path.exists():
        place.bad(str(path), _missing_file(path, entry.path))
        return None
    if not os.access(path, os.R_OK) or path.is_dir():
        place.bad(str(path), f"model file {path} cannot be read (is it a directory, or are permissions missing?).")
        return None
    try:
        facts = inspect_model(path)
    except ModelError as e:
        place.bad(str(path), str(e))
        return None
    if display is not None:
        facts.path = display
    return ResolvedModel(path.resolve(), entry.name or "", entry.family, facts, place.index, display)


def _name_models(resolved: list[ResolvedModel], source_name: str) -> None:
    """Default names are file stems; the same stem in two formats keeps its extension to stay distinct. Two models
    of one name are refused."""
    shown = {id(m): Path(m.display or m.path) for m in resolved}
    stems = [shown[id(m)].stem for m in resolved if not m.name]
    for m in resolved:
        if not m.name:
            m.name = shown[id(m)].name if stems.count(shown[id(m)].stem) > 1 else shown[id(m)].stem
    names = [m.name for m in resolved]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise JobFileError([JobProblem(source_name, None, "models", f"two models share the name(s) {dupes}; give each a distinct `name`.")])


def _benchmark_problem(spec: JobSpec, model: ResolvedModel) -> str | None:
    """Why the built-in benchmark cannot run this model as the job asks, or None."""
    from farm.models.facts import ModelError, runtime_refusal  # loaded when a job is read, not for `farm jobs`
    suffix = model.path.suffix.lower()
    if suffix not in BENCHMARK_FORMATS:
        return (f"{model.path.name} is a {suffix or 'extension-less'} file; the built-in benchmark runs .tflite "
                f"and .onnx — use `workload: {{type: script, ...}}` for other formats.")
    workload = spec.workload
    assert isinstance(workload, BenchmarkWorkload)
    try:
        # inspect_model parsed these bytes in resolve_models: the hash lets the refusal check skip a second parse
        refusal = runtime_refusal(model.path, use_xnnpack=workload.use_xnnpack, parsed_sha256=model.facts.sha256)
    except ModelError as e:
        return str(e)
    if refusal is not None:  # the runtime's verdict, loaded with the options a run uses
        ops = f" (operator(s) it names: {', '.join(refusal.ops)})" if refusal.ops else ""
        hint = " Replace them, or register a custom-op library." if refusal.ops else ""
        return (f"{model.path.name} cannot be loaded by the {BENCHMARK_FORMATS[suffix]} runtime that runs it{ops}; "
                f"{refusal.runtime} says: {printable(refusal.message, 600)}.{hint}")
    problems = _input_problems(spec, model, layout="nhwc" if BENCHMARK_FORMATS[suffix] == "tflite" else "nchw")
    return "; ".join(problems) + "." if problems else None


def _input_problems(spec: JobSpec, model: ResolvedModel, layout: str) -> list[str]:
    """Every input of this model that cannot be fed as the job asks, each named by its field: a name the model
    lacks, a value its dtype cannot hold, a dynamic dimension left unset, a value whose shape disagrees with the
    shape the run feeds (input_shapes, the model's own, or a swept batch or size)."""
    workload = spec.workload_for(model.entry_index)
    assert isinstance(workload, BenchmarkWorkload)
    return _input_name_problems(spec, model, workload) + _input_shape_problems(spec, model, workload, layout)


def _input_name_problems(spec: JobSpec, model: ResolvedModel, workload: BenchmarkWorkload) -> list[str]:
    """An input named in input_shapes or inputs that the model lacks, and a value its input's dtype cannot hold;
    each named by the field that sets it (the model's own entry, else the workload)."""
    entry = spec.entry(model.entry_index)
    inputs = {t.name: t for t in model.facts.inputs}
    problems: list[str] = []

    def where(name: str, field_name: str = "inputs") -> str:
        own = name in (entry.inputs if field_name == "inputs" else entry.input_shapes)
        return (f"models[{model.entry_index}].{field_name}.{printable(name, 80)}" if own
                else f"workload.{field_name}.{printable(name, 80)} (models[{model.entry_index}])")

    for field_name, names in (("input_shapes", workload.input_shapes), ("inputs", workload.inputs)):
        for name in names:
            if name not in inputs:
                problems.append(f"{where(name, field_name)}: {model.path.name} has no input named "
                                f"{printable(name, 80)!r} (its inputs: {printable(', '.join(inputs), 300)})")
    for name, given in workload.inputs.items():
        problem = _input_value_problem(name, given, inputs[name].dtype) if name in inputs else None
        if problem:
            problems.append(f"{where(name)}: {model.path.name}: {problem}")
    return problems


def _input_shape_problems(spec: JobSpec, model: ResolvedModel, workload: BenchmarkWorkload,
                          layout: str) -> list[str]:
    """The first shape problem of each input over the matrix's batch sizes and input sizes (the harness fills shapes
    with this same function), in the model's input order."""
    overrides = workload.shape_overrides()
    found: dict[str, str] = {}
    for batch in spec.matrix.batch_sizes:
        for size in spec.matrix.input_sizes:
            for tensor in model.facts.inputs:
                if tensor.name not in found:
                    problem = _shape_problem(spec, model, workload, tensor, layout, batch, size, overrides)
                    if problem is not None:
                        found[tensor.name] = problem
    return list(found.values())


def _shape_problem(spec: JobSpec, model: ResolvedModel, workload: BenchmarkWorkload, tensor: TensorInfo,
                   layout: str, batch: int, size: int | None, overrides: dict[str, list[int]]) -> str | None:
    """Why one input cannot be fed in one cell of the matrix: its shape cannot be resolved, the job's shape
    contradicts a fixed dimension (ONNX Runtime), or the job's value does not broadcast to the shape the run feeds."""
    from farm.models.runtimes import InputShapeError, resolve_shape
    import numpy as np  # loaded when a job is read, not for `farm jobs`
    field = f"models[{model.entry_index}].inputs"  # where a shape conflict is fixed: the model's own entry
    try:
        shape = resolve_shape(tensor.name, tensor.shape, layout=layout, batch_size=batch,
                              input_size=size, overrides=overrides)
    except InputShapeError as e:
        return (f"{field}.{printable(tensor.name, 80)}: {model.path.name}: {e} (or "
                f"{field.removesuffix('inputs')}input_shapes.{printable(tensor.name, 80)})")
    fixed = [d if isinstance(d, int) and d > 0 else None for d in tensor.shape]
    if layout == "nchw" and tensor.name in overrides and any(
            f is not None and f != d for axis, (f, d) in enumerate(zip(fixed, shape))
            if axis or batch == 1):  # ONNX Runtime feeds only a fixed dimension's own size
        return (f"{field}.{printable(tensor.name, 80)}: {model.path.name} declares "
                f"{tensor.name!r} as {list(tensor.shape)}, but the job gives it the shape "
                f"{shape}{_source(workload.inputs.get(tensor.name))}")
    fed = workload.inputs.get(tensor.name)
    if fed is None or not isinstance(fed.value, list):
        return None
    value_shape = input_value_shape(fed.value)
    try:
        fits = list(np.broadcast_shapes(tuple(value_shape), tuple(shape))) == shape
    except ValueError:
        fits = False
    if fits:
        return None
    source = f"file {fed.file!r}" if fed.file else "value"
    cell = f" (batch {batch}{f', input size {size}' if size is not None else ''})" \
        if len(spec.matrix.batch_sizes) > 1 or size is not None else ""
    return (f"{field}.{printable(tensor.name, 80)}: {model.path.name}: the {source} has shape "
            f"{value_shape}, but the run feeds {tensor.name!r} the shape {shape}{cell}; "
            "give a value of that shape, or set the input's shape to the value's")


def _source(given: InputSpec | None) -> str:
    if given is None or given.shape is not None or not isinstance(given.value, list):
        return ""
    return f" (the shape of its {f'file {given.file!r}' if given.file else 'value'})"


def _flat_numbers(value: Any) -> list[float]:
    return [x for item in value for x in _flat_numbers(item)] if isinstance(value, list) else [float(value)]


def _input_value_problem(name: str, given: InputSpec, dtype: str) -> str | None:
    """Why a value or range cannot feed an input of this dtype (whole numbers in range for integer inputs)."""
    import numpy as np  # loaded when a job is read, not for `farm jobs`
    if given.value is None and given.random is None:
        return None
    try:
        info: Any = np.iinfo(np.dtype(dtype))
    except (TypeError, ValueError):
        return None if dtype.startswith(("float", "bool")) else f"input {printable(name, 80)!r} is {dtype}, which takes no given values"
    numbers = _flat_numbers(given.value) if given.value is not None else []
    if given.random is not None:
        numbers += [given.random.low, given.random.high]
    if any(x != round(x) or not info.min <= x <= info.max for x in numbers):
        return f"input {printable(name, 80)!r} is {dtype}, so its values must be whole numbers in [{info.min}, {info.max}]"
    return None


def load_input_files(spec: JobSpec, root: yaml.Node | None, base_dir: Path, source_name: str) -> None:
    """Read each workload.inputs.NAME.file (a .npy inside the job's folder) into its value, checked like a model
    file: a regular file by type before any read, its size before reading, numbers only and all finite."""
    workload = spec.workload
    if not isinstance(workload, BenchmarkWorkload):
        return
    _load_inputs(workload.inputs, ("workload",), root, base_dir, source_name)
    for index, raw in enumerate(spec.models):  # a model entry's own inputs (models[N].inputs.NAME.file)
        if isinstance(raw, ModelEntry):
            _load_inputs(raw.inputs, ("models", index), root, base_dir, source_name)


def _load_inputs(inputs: dict[str, InputSpec], where: tuple[Any, ...], root: yaml.Node | None, base_dir: Path,
                 source_name: str) -> None:
    import numpy as np  # loaded when a job is read, not for `farm jobs`
    folder = base_dir.resolve()
    prefix = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(where))
    for name, given in inputs.items():
        if given.file is None or given.value is not None:
            continue  # a value already read (a stored spec) is not read again
        field_path = f"{prefix}.inputs.{printable(name, 80)}.file"

        def bad(message: str) -> JobFileError:
            return JobFileError([JobProblem(source_name, _line(root, *where, "inputs", name, "file"), field_path,
                                            message)])
        path = (folder / os.path.expanduser(given.file)).resolve()
        if not path.is_relative_to(folder):
            raise bad(f"{printable(given.file, 200)!r} is outside the job's folder ({folder}); inputs are read from there only.")
        try:
            info = os.stat(path)
        except OSError as e:
            raise bad(f"{printable(given.file, 200)!r} cannot be opened ({e.strerror}; looked for {path}).") from None
        if not stat.S_ISREG(info.st_mode):
            raise bad(f"{printable(given.file, 200)!r} is not a regular file (a FIFO, device or folder is never read).")
        if info.st_size > MAX_INPUT_FILE_BYTES:
            raise bad(f"{printable(given.file, 200)!r} is {info.st_size} bytes; input files are at most "
                      f"{MAX_INPUT_FILE_BYTES} bytes (use `random` for large inputs).")
        try:
            with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
                array = np.load(f, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise bad(f"{printable(given.file, 200)!r} is not a .npy array numpy can read without pickles ({printable(e, 200)}).") from None
        if not isinstance(array, np.ndarray) or array.dtype.kind not in "biuf":
            raise bad(f"{printable(given.file, 200)!r} holds {getattr(array, 'dtype', type(array).__name__)}; give numbers.")
        if array.size > MAX_INPUT_VALUE_ELEMENTS or array.size == 0:
            raise bad(f"{printable(given.file, 200)!r} has {array.size} elements; give 1 to {MAX_INPUT_VALUE_ELEMENTS}.")
        if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
            raise bad(f"{printable(given.file, 200)!r} holds NaN or infinite values; inputs must be finite.")
        values = array.tolist() if array.ndim else array.item()
        inputs[name] = replaced(given, value=values)


def check_dataset(spec: JobSpec, models: list[ResolvedModel], root: yaml.Node | None, base_dir: Path,
                  source_name: str) -> None:
    """workload.dataset read, checked against every model and packed with the job (controller/scheduling/datasets.py)."""
    from farm.controller.scheduling.datasets import DatasetRefused, load_dataset
    if not isinstance(spec.workload, BenchmarkWorkload) or spec.workload.dataset is None:
        return
    try:
        load_dataset(spec.workload, models, base_dir)
    except DatasetRefused as e:
        raise JobFileError([JobProblem(source_name, _line(root, "workload", "dataset", e.field),
                                       f"workload.dataset.{e.field}", f"{e}.")]) from None


def fixed_dimension_warnings(spec: JobSpec, models: list[ResolvedModel], root: yaml.Node | None,
                             source_name: str) -> list[JobProblem]:
    """Matrix cells an ONNX model cannot run: ONNX Runtime feeds only the shape a model declares, so a fixed
    batch or spatial size that the matrix changes fails those runs (LiteRT resizes .tflite inputs itself)."""
    workload = spec.workload
    if not isinstance(workload, BenchmarkWorkload):
        return []
    problems = []
    for model in models:
        if BENCHMARK_FORMATS.get(model.path.suffix.lower()) != "onnx":
            continue
        model_workload = spec.workload_for(model.entry_index)
        assert isinstance(model_workload, BenchmarkWorkload)
        overrides = model_workload.shape_overrides()
        for tensor in model.facts.inputs:
            dims = tensor.shape
            if tensor.name in overrides or not dims or not isinstance(dims[0], int):
                batch_bad = []
            else:
                # batch 1 keeps a fixed first dimension as it is (runtimes.resolve_shape): only other batches fail
                batch_bad = [b for b in spec.matrix.batch_sizes if b != dims[0] and b != 1]
            if batch_bad:
                problems.append(JobProblem(source_name, _line(root, "matrix", "batch_sizes"), "matrix.batch_sizes",
                                           f"{model.path.name} has a fixed batch of {dims[0]} (input {tensor.name!r}): "
                                           f"its runs at batch {', '.join(map(str, batch_bad))} will fail; export it "
                                           "with a dynamic batch dimension."))
            spatial = dims[2:4] if len(dims) == 4 and tensor.name not in overrides else []
            size_bad = [z for z in spec.matrix.input_sizes if z is not None and spatial
                        and any(isinstance(d, int) and d != z for d in spatial)]
            if size_bad:
                problems.append(JobProblem(source_name, _line(root, "matrix", "input_sizes"), "matrix.input_sizes",
                                           f"{model.path.name} has a fixed input size of {spatial[0]}x{spatial[1]} "
                                           f"(input {tensor.name!r}): its runs at {', '.join(map(str, size_bad))} will "
                                           "fail; use a model file per size (farm models generate --sizes)."))
    return problems


def check_benchmark_models(spec: JobSpec, models: list[ResolvedModel], root: yaml.Node | None,
                           source_name: str) -> list[InvalidModel]:
    """Only formats the built-in benchmark runs, no operator the runtime lacks, every input shape known."""
    invalid = []
    for model in models:
        problem = _benchmark_problem(spec, model)
        if problem:
            invalid.append(InvalidModel(str(model.path), model.name, model.family, model.entry_index,
                                        JobProblem(source_name, _model_line(root, model.entry_index),
                                                   f"models[{model.entry_index}]", problem), model.facts.sha256))
    return invalid


def check_script(spec: JobSpec, base_dir: Path, root: yaml.Node | None, source_name: str) -> tuple[Path, Path | None]:
    workload = spec.workload
    assert isinstance(workload, ScriptWorkload)
    def line(field: str) -> int:
        node, _ = _locate(root, ("workload", field))
        return node.start_mark.line + 1 if node is not None else 1

    script_dir = (base_dir / workload.dir).resolve()
    if not script_dir.is_dir():
        raise JobFileError([JobProblem(source_name, line("dir"), "workload.dir", f"{workload.dir!r} is not a directory (looked for {script_dir}).")])
    script_path = None
    if workload.script:
        script_path = (script_dir / workload.script).resolve()
        if not script_path.is_file():
            raise JobFileError([JobProblem(source_name, line("script"), "workload.script", f"{workload.script!r} does not exist in {script_dir}.")])
        try:
            with open(script_path, "rb"):
                pass
        except OSError as e:
            raise JobFileError([JobProblem(source_name, line("script"), "workload.script", f"{script_path} cannot be read: {e.strerror}.")]) from None
    check_build_files(spec, script_dir, root, source_name)  # the build reads workload.dir too
    return script_dir, script_path


def check_build_files(spec: JobSpec, script_dir: Path, root: yaml.Node | None, source_name: str) -> None:
    """sim.build's Dockerfile and wheel folder are in workload.dir (the build context), checked before any run."""
    build = spec.sim.build
    if build is None:
        return
    for key, want_dir in (("dockerfile", False), ("pip_wheels", True)):
        name = getattr(build, key)
        if name is None:
            continue
        path = (script_dir / name).resolve()
        ok = path.is_relative_to(script_dir) and (path.is_dir() if want_dir else path.is_file())
        if not ok:
            kind = "a folder" if want_dir else "a file"
            raise JobFileError([JobProblem(source_name, _line(root, "sim", "build", key), f"sim.build.{key}",
                                           f"{name!r} is not {kind} inside workload.dir ({script_dir}); the build "
                                           "reads only that folder.")])


def resolve_targets(spec: JobSpec, root: yaml.Node | None, source_name: str,
                    devices: list[DeviceTarget]) -> list[DeviceTarget | None]:
    """sim, device names, type:X and tag:Y -> the sim (None) and concrete devices, each once."""
    by_name = {d.name: d for d in devices}
    out: list[DeviceTarget | None] = []
    for index, target in enumerate(spec.targets):
        if target == "sim":
            matched: list[DeviceTarget | None] = [None]
        elif target.startswith("type:"):
            matched = [d for d in devices if d.device_type is not None and d.device_type.name == target[5:]]
        elif target.startswith("tag:"):
            matched = [d for d in devices if target[4:] in d.tags]
        else:
            matched = [by_name[target]] if target in by_name else []
        if not matched:
            known = cut_list(sorted(by_name)) or "none configured (list them in a file named by FARM_DEVICES)"
            raise JobFileError([JobProblem(source_name, _line(root, "targets", index), f"targets[{index}]",
                                           f"no device matches {target!r}; known devices: {known}.")])
        out += [m for m in matched if m not in out]
    return out


def check_cpu_sweep(spec: JobSpec, root: yaml.Node | None, source_name: str,
                    targets: list[DeviceTarget | None]) -> None:
    """matrix.cpus sweeps the sim's own budget: one place for it, and no device (a twin takes its device's)."""
    if spec.matrix.cpus == [None]:
        return
    where = _line(root, "matrix", "cpus")
    if spec.sim.cpus is not None:
        raise JobFileError([JobProblem(source_name, where, "matrix.cpus",
                                       f"sim.cpus ({spec.sim.cpus:g}) and matrix.cpus both set the CPU budget; keep "
                                       "one: matrix.cpus to sweep it, sim.cpus for one budget.")])
    devices = [t.name for t in targets if t is not None]
    if devices:
        raise JobFileError([JobProblem(source_name, where, "matrix.cpus",
                                       f"matrix.cpus sweeps the sim's budget, but the job also targets "
                                       f"{', '.join(devices[:3])}, whose sim twins take their device type's budget; "
                                       "run the CPU sweep as its own job with targets: [sim].")])


def check_accelerators(spec: JobSpec, root: yaml.Node | None, source_name: str,
                       targets: list[DeviceTarget | None], skip_invalid: bool) -> list[JobProblem]:
    """Every (target, unit) cell a target cannot run: refused with the reason, or, with skip_invalid, skipped
    (the problems come back as warnings; expand_tasks leaves those cells out)."""
    problems = []
    for index, text in enumerate(spec.matrix.accelerators):
        cell = parse_accelerator(text)
        for target in targets or [None]:
            if target is None:
                if not cell.on_cpu:
                    problems.append(JobProblem(source_name, _line(root, "matrix", "accelerators", index),
                                               f"matrix.accelerators[{index}]",
                                               f"the sim is a CPU and cannot run {cell}; target a device that has "
                                               f"it (a device's sim twin runs on the CPU and is paired with it)"))
            elif cell.resolved(target.units) is None:
                problems.append(JobProblem(source_name, _line(root, "matrix", "accelerators", index),
                                           f"matrix.accelerators[{index}]", why_not(cell, target.units, target.name)
                                           + "; drop the cell, pick other targets, or --skip-invalid to skip it"))
    runnable = [(c, t) for c in spec.matrix.accelerators for t in targets or [None]
                if (parse_accelerator(c).on_cpu if t is None else parse_accelerator(c).resolved(t.units) is not None)]
    if problems and (not skip_invalid or not runnable):
        raise JobFileError(problems + ([JobProblem(source_name, _line(root, "matrix", "accelerators"),
                                                   "matrix.accelerators", "no target can run any of the cells.")]
                                       if not runnable else []))
    return problems


def planned_task_count(spec: JobSpec, models: int, targets: list[DeviceTarget | None]) -> tuple[int, str]:
    """How many tasks expand_tasks will make (at most: cells a target lacks are left out), and the product
    spelled out for a person."""
    cells = (len(spec.matrix.threads) * len(spec.matrix.batch_sizes) * len(spec.matrix.input_sizes)
             * len(spec.matrix.cpus) * len(spec.matrix.accelerators))
    runs_per_cell = sum(1 if t is None else 2 for t in targets or [None])  # a device run has a sim twin
    total = models * cells * spec.repeats * runs_per_cell
    return total, (f"{models:,} model(s) × {cells:,} matrix cell(s) × {spec.repeats:,} repeat(s) × "
                   f"{runs_per_cell:,} target run(s)")


def check_task_count(spec: JobSpec, models: int, targets: list[DeviceTarget | None], max_tasks: int,
                     source_name: str) -> None:
    total, product = planned_task_count(spec, models, targets)
    if total > max_tasks:
        raise JobFileError([JobProblem(source_name, 1, "(job)", f"the job expands to {total:,} runs ({product}), "
                                       f"over the limit of {max_tasks:,} per job; split it, or raise the limit "
                                       f"with --max-tasks.")])


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def check_host(spec: JobSpec, root: yaml.Node | None, source_name: str, host: HostCapacity,
               targets: list[DeviceTarget | None]) -> list[JobProblem]:
    """The sim budget against the host that runs it: cores it lacks are an error, more than it has a warning. The
    checks in turn: sim.cpuset's cores, the CPUs a run asks for, sim.memory, each device's sim twins."""
    sim = spec.sim
    cores = host.cores
    if sim.cpuset is not None:
        missing = cores_missing(sim.cpuset, cores)  # the sim driver checks the same on an agent's host
        if missing:
            raise JobFileError([JobProblem(source_name, _line(root, "sim", "cpuset"), "sim.cpuset",
                                           f"{sim.cpuset!r} names core(s) {','.join(map(str, missing))}, which this "
                                           f"host cannot use (it has {','.join(map(str, cores))}).")])
        cores = parse_cpuset(sim.cpuset)
    check = _HostCheck(spec, root, source_name, host, cores)
    found = [check.cpus(), check.memory()]
    return [w for w in found if w is not None] + check.twins(targets)


@dataclass
class _HostCheck:
    """One job's budget against one host's cores (sim.cpuset's, where it names them) and memory: a warning each."""

    spec: JobSpec
    root: yaml.Node | None
    source_name: str
    host: HostCapacity
    cores: list[int]

    @property
    def where(self) -> str:
        return f"the {len(self.cores)} core(s) {'of sim.cpuset' if self.spec.sim.cpuset else 'this host has'}"

    def cpus(self) -> JobProblem | None:
        """sim.cpus, else the matrix's cpus, else its threads' default budget, over the cores."""
        sim, matrix, n = self.spec.sim, self.spec.matrix, len(self.cores)
        if sim.cpus is not None and sim.cpus > n:
            return JobProblem(self.source_name, _line(self.root, "sim", "cpus"), "sim.cpus",
                              f"{sim.cpus:g} CPUs is more than {self.where}; the sim cannot give more than it has, "
                              f"so runs get at most {n}.")
        if any(c is not None and c > n for c in matrix.cpus):
            return JobProblem(self.source_name, _line(self.root, "matrix", "cpus"), "matrix.cpus",
                              f"{max(c for c in matrix.cpus if c is not None):g} CPUs is more than {self.where}; "
                              f"the sim cannot give more than it has, so those runs get at most {n}.")
        if sim.cpus is None and None in matrix.cpus and default_cpus(None, max(matrix.threads)) > n:
            return JobProblem(self.source_name, _line(self.root, "matrix", "threads"), "matrix.threads",
                              f"{max(matrix.threads)} threads get a budget of as many CPUs, more than "
                              f"{self.where}; the sim cannot give more than it has, so those runs get at most "
                              f"{n} and their threads share cores.")
        return None

    def memory(self) -> JobProblem | None:
        memory, host_memory = self.spec.sim.memory, self.host.memory_bytes
        if memory is not None and host_memory and memory > host_memory:
            return JobProblem(self.source_name, _line(self.root, "sim", "memory"), "sim.memory",
                              f"{_gib(memory)} is more than this host's {_gib(host_memory)}; the sim "
                              "cannot give more than it has, so a run may be killed below the limit.")
        return None

    def twins(self, targets: list[DeviceTarget | None]) -> list[JobProblem]:
        """Each device target whose sim twins' budget (its device type's, at the matrix's threads) is over the host's,
        named by the `targets` entry that chose it."""
        warnings = []
        for device in {t.name: t for t in targets if t is not None and t.device_type is not None}.values():
            device_type = device.device_type
            assert device_type is not None  # the filter above
            twins = [device_type.budget_for(threads) for threads in self.spec.matrix.threads]
            cpus, memory = max(b.cpus for b in twins), max(b.memory for b in twins)
            if cpus > len(self.cores) or (self.host.memory_bytes and memory > self.host.memory_bytes):
                index = next((i for i, t in enumerate(self.spec.targets) if t in (device.name, f"type:{device_type.name}")
                              or (t.startswith("tag:") and t[4:] in device.tags)), 0)
                warnings.append(JobProblem(self.source_name, _line(self.root, "targets", index), f"targets[{index}]",
                                           f"the sim twins of {device.name} get up to {cpus:g} CPUs and {_gib(memory)} "
                                           f"(device type {device_type.name}), more than {self.where} or this host's "
                                           "memory; the sim cannot give more than it has."))
        return warnings


def load_job_text(text: str, source_name: str, base_dir: Path, source_path: Path | None = None,
                  devices: list[DeviceTarget] | None = None, *, max_tasks: int = DEFAULT_MAX_TASKS,
                  skip_invalid: bool = False, host: HostCapacity | None = None) -> ResolvedJob:
    """Validate and resolve a job; every bad model is listed at once.

    skip_invalid keeps the models that can run (the others come back in `invalid`); host is
    the machine that will run the sim, when that is known here (embedded mode).
    """
    spec, root = parse_job_text(text, source_name)
    return resolve_job(spec, root, text, source_name, base_dir, source_path, devices, max_tasks=max_tasks,
                       skip_invalid=skip_invalid, host=host)


def resolve_job(spec: JobSpec, root: yaml.Node | None, text: str, source_name: str, base_dir: Path,
                source_path: Path | None = None, devices: list[DeviceTarget] | None = None, *,
                max_tasks: int = DEFAULT_MAX_TASKS, skip_invalid: bool = False,
                host: HostCapacity | None = None) -> ResolvedJob:
    """A validated spec resolved into a job (models inspected, targets found, limits checked), as
    load_job_text does for a file; root is the file's YAML (None for a spec farm built itself: no lines)."""
    load_input_files(spec, root, base_dir, source_name)
    targets = resolve_targets(spec, root, source_name, devices or [])
    check_cpu_sweep(spec, root, source_name, targets)
    skipped_cells = check_accelerators(spec, root, source_name, targets, skip_invalid)
    check_task_count(spec, len(spec.models), targets, max_tasks, source_name)  # before any glob or file
    models, invalid = resolve_models(spec, root, base_dir, source_name)
    job = ResolvedJob(spec=spec, source=text, source_path=source_path, base_dir=base_dir, models=models,
                      targets=targets)
    if isinstance(spec.workload, BenchmarkWorkload):
        invalid += check_benchmark_models(spec, models, root, source_name)
        bad = {m.path for m in invalid}
        job.models = [m for m in models if str(m.path) not in bad]
        if not invalid:
            check_dataset(spec, job.models, root, base_dir, source_name)
    else:
        job.script_dir, job.script_path = check_script(spec, base_dir, root, source_name)
    invalid.sort(key=lambda m: (m.problem.line or 0, m.entry_index))  # in the order the file names them
    if invalid and (not skip_invalid or not job.models):
        hint = [JobProblem(source_name, None, "models", "no model of the job can run.")] if not job.models else \
            [] if skip_invalid else [JobProblem(source_name, None, "models", (
                f"the other {len(job.models)} model(s) can run: `farm submit --skip-invalid` runs them and records "
                "the ones above as `job` failures (or fix or drop those in the job file)."))]
        raise JobFileError([*(m.problem for m in invalid), *hint])
    job.invalid = invalid
    check_task_count(spec, len(job.models), targets, max_tasks, source_name)
    if host is not None:
        job.warnings = check_host(spec, root, source_name, host, targets)
    job.warnings = [*job.warnings, *skipped_cells, *fixed_dimension_warnings(spec, job.models, root, source_name)]
    return job


def load_job(path: Path, devices: list[DeviceTarget] | None = None, *, max_tasks: int = DEFAULT_MAX_TASKS,
             skip_invalid: bool = False, host: HostCapacity | None = None) -> ResolvedJob:
    """Read, validate and resolve a job file, or raise JobFileError."""
    try:
        text = read_regular_file(path, "job file", MAX_JOB_FILE_BYTES).decode()  # a FIFO or device refused unread
    except FileNotFoundError:
        raise JobFileError([JobProblem(str(path), None, "", "no such job file.")]) from None
    except FileRefused as e:
        raise JobFileError([JobProblem(str(path), None, "", str(e).removeprefix(f"{path}: "))]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise JobFileError([JobProblem(str(path), None, "", f"cannot read the job file: {e}.")]) from None
    return load_job_text(text, str(path), path.resolve().parent, path.resolve(), devices, max_tasks=max_tasks,
                         skip_invalid=skip_invalid, host=host)
