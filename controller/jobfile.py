"""Reading job.yaml: YAML -> JobSpec -> models found and inspected, or one clear error.

Every error is a JobFileError whose message names the file, the line, the field path
and what is wrong, so the CLI can print it as one paragraph with no traceback.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml
from pydantic import ValidationError

from farm.models.facts import ModelError, find_unsupported_ops, inspect_model
from farm.proto.results import ModelFacts
from farm.proto.spec import BenchmarkWorkload, JobSpec, ModelEntry, ScriptWorkload

BENCHMARK_FORMATS = {".tflite": "tflite", ".onnx": "onnx"}


class JobFileError(Exception):
    """A job file that cannot run; the message is for a person."""


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
    device_type: Any = None  # farm.agents.device_types.DeviceType, or None when the type is unknown
    tags: list[str] = field(default_factory=list)


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


def _describe(err: dict[str, Any]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown field (check the spelling; `farm schema` lists every field)"
    if kind == "missing":
        return "required field is missing"
    msg = err["msg"]
    return msg.removeprefix("Value error, ")


# A value that fits no branch of a union gets one error per branch; these say least.
_BRANCH_MISMATCH = {"string_type", "model_type", "model_attributes_type", "union_tag_invalid"}


def _error_lines(errors: list[dict[str, Any]], root: yaml.Node | None, source_name: str) -> list[str]:
    by_path: dict[str, tuple[int, dict[str, Any]]] = {}
    for err in errors:
        node, path = _locate(root, err["loc"], missing=err["type"] == "missing")
        line = node.start_mark.line + 1 if node is not None else 1
        if path not in by_path or by_path[path][1]["type"] in _BRANCH_MISMATCH:
            by_path[path] = (line, err)
    # "not a string" next to "models[0].path: missing" only repeats the other branch's view
    keep = {p: v for p, v in by_path.items() if not (
        v[1]["type"] in _BRANCH_MISMATCH and any(o != p and o.startswith(p) for o in by_path))}
    return [f"{source_name}:{line}: {path}: {_describe(err)}" for path, (line, err) in keep.items()]


def parse_job_text(text: str, source_name: str) -> tuple[JobSpec, yaml.Node | None]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source_name}:{mark.line + 1}" if mark else source_name
        problem = getattr(e, "problem", None) or str(e)
        raise JobFileError(f"{where}: not valid YAML: {problem}.") from None
    if data is None:
        raise JobFileError(f"{source_name}: the file is empty; a job needs at least `models:`.")
    if not isinstance(data, dict):
        raise JobFileError(f"{source_name}:1: a job file must be a mapping of fields (models:, workload:, ...), not a {type(data).__name__}.")
    try:
        return JobSpec.model_validate(data), root
    except ValidationError as e:
        raise JobFileError("\n".join(_error_lines(e.errors(include_url=False), root, source_name))) from None


def _model_line(root: yaml.Node | None, index: int) -> int:
    node, _ = _locate(root, ("models", index))
    return node.start_mark.line + 1 if node is not None else 1


class ModelFileGate(Protocol):
    """How a controller admits files named by a job from the wire (controller.artifacts.ControllerFiles)."""

    def check_pattern(self, pattern: str, base_dir: Path) -> None: ...
    def admit(self, name: str, base_dir: Path) -> Path: ...


def resolve_models(spec: JobSpec, root: yaml.Node | None, base_dir: Path, source_name: str,
                   gate: ModelFileGate | None = None) -> list[ResolvedModel]:
    """gate: None for the user's own files (embedded, the client); a controller passes its gate."""
    resolved: list[ResolvedModel] = []
    for index, raw in enumerate(spec.models):
        entry = raw if isinstance(raw, ModelEntry) else ModelEntry(path=raw)
        where = f"{source_name}:{_model_line(root, index)}: models[{index}]"
        if gate is not None:
            try:
                gate.check_pattern(entry.path, base_dir)  # before any lookup: nothing is learnt outside the roots
            except ValueError as e:
                raise JobFileError(f"{where}: {e}") from None
        pattern = str(base_dir / (os.path.expanduser(entry.path) if gate is None else entry.path))
        if glob.has_magic(entry.path):
            paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
            if not paths:
                raise JobFileError(f"{where}: the glob {entry.path!r} matches no file (searched from {base_dir}).")
            if entry.name and len(paths) > 1:
                raise JobFileError(f"{where}: `name` is given but the glob {entry.path!r} matches {len(paths)} files; give names per file or drop `name`.")
        else:
            paths = [Path(pattern)]
        for path in paths:
            display = None
            if gate is not None:
                try:
                    display, path = str(path), gate.admit(str(path), base_dir)
                except ValueError as e:
                    raise JobFileError(f"{where}: {e}") from None
            if not path.exists():
                raise JobFileError(f"{where}: model file {entry.path!r} does not exist (looked for {path}).")
            if not os.access(path, os.R_OK) or path.is_dir():
                raise JobFileError(f"{where}: model file {path} cannot be read (is it a directory, or are permissions missing?).")
            try:
                facts = inspect_model(path)
            except ModelError as e:
                raise JobFileError(f"{where}: {e}") from None
            if display is not None:
                facts.path = display
            resolved.append(ResolvedModel(path.resolve(), entry.name or "", entry.family, facts, index, display))
    # Default names are file stems; the same stem in two formats keeps its extension to stay distinct.
    shown = {id(m): Path(m.display or m.path) for m in resolved}
    stems = [shown[id(m)].stem for m in resolved if not m.name]
    for m in resolved:
        if not m.name:
            m.name = shown[id(m)].name if stems.count(shown[id(m)].stem) > 1 else shown[id(m)].stem
    names = [m.name for m in resolved]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise JobFileError(f"{source_name}: models: two models share the name(s) {dupes}; give each a distinct `name`.")
    return resolved


def check_benchmark_models(spec: JobSpec, models: list[ResolvedModel], root: yaml.Node | None, source_name: str) -> None:
    """Only formats the built-in benchmark runs, and no operator the runtime lacks."""
    for model in models:
        where = f"{source_name}:{_model_line(root, model.entry_index)}: models[{model.entry_index}]"
        suffix = model.path.suffix.lower()
        if suffix not in BENCHMARK_FORMATS:
            raise JobFileError(
                f"{where}: {model.path.name} is a {suffix or 'extension-less'} file; the built-in "
                f"benchmark runs .tflite and .onnx — use `workload: {{type: script, ...}}` for other formats."
            )
        unsupported = find_unsupported_ops(model.path)
        if unsupported:
            raise JobFileError(
                f"{where}: {model.path.name} uses operator(s) the {BENCHMARK_FORMATS[suffix]} runtime "
                f"here does not support: {', '.join(unsupported)}. Replace them, or register a custom-op library."
            )
        if isinstance(spec.workload, BenchmarkWorkload):
            for name in spec.workload.input_shapes:
                if name not in {t.name for t in model.facts.inputs}:
                    known = ", ".join(t.name for t in model.facts.inputs)
                    raise JobFileError(
                        f"{where}: workload.input_shapes: {model.path.name} has no input named {name!r} (its inputs: {known})."
                    )


def check_script(spec: JobSpec, base_dir: Path, root: yaml.Node | None, source_name: str) -> tuple[Path, Path | None]:
    workload = spec.workload
    assert isinstance(workload, ScriptWorkload)
    def line(field: str) -> int:
        node, _ = _locate(root, ("workload", field))
        return node.start_mark.line + 1 if node is not None else 1

    script_dir = (base_dir / workload.dir).resolve()
    if not script_dir.is_dir():
        raise JobFileError(f"{source_name}:{line('dir')}: workload.dir: {workload.dir!r} is not a directory (looked for {script_dir}).")
    script_path = None
    if workload.script:
        script_path = (script_dir / workload.script).resolve()
        if not script_path.is_file():
            raise JobFileError(f"{source_name}:{line('script')}: workload.script: {workload.script!r} does not exist in {script_dir}.")
        try:
            with open(script_path, "rb"):
                pass
        except OSError as e:
            raise JobFileError(f"{source_name}:{line('script')}: workload.script: {script_path} cannot be read: {e.strerror}.") from None
    return script_dir, script_path


def resolve_targets(spec: JobSpec, root: yaml.Node | None, source_name: str,
                    devices: list[DeviceTarget]) -> list[DeviceTarget | None]:
    """sim, device names, type:X and tag:Y -> the sim (None) and concrete devices, each once."""
    by_name = {d.name: d for d in devices}
    out: list[DeviceTarget | None] = []
    for index, target in enumerate(spec.targets):
        node, _ = _locate(root, ("targets", index))
        where = f"{source_name}:{node.start_mark.line + 1 if node is not None else 1}: targets[{index}]"
        if target == "sim":
            matched: list[DeviceTarget | None] = [None]
        elif target.startswith("type:"):
            matched = [d for d in devices if d.device_type is not None and d.device_type.name == target[5:]]
        elif target.startswith("tag:"):
            matched = [d for d in devices if target[4:] in d.tags]
        else:
            matched = [by_name[target]] if target in by_name else []
        if not matched:
            known = ", ".join(sorted(by_name)) or "none configured (list them in a file named by FARM_DEVICES)"
            raise JobFileError(f"{where}: no device matches {target!r}; known devices: {known}.")
        out += [m for m in matched if m not in out]
    return out


def load_job_text(text: str, source_name: str, base_dir: Path, source_path: Path | None = None,
                  devices: list[DeviceTarget] | None = None) -> ResolvedJob:
    spec, root = parse_job_text(text, source_name)
    targets = resolve_targets(spec, root, source_name, devices or [])
    models = resolve_models(spec, root, base_dir, source_name)
    job = ResolvedJob(spec=spec, source=text, source_path=source_path, base_dir=base_dir, models=models,
                      targets=targets)
    if isinstance(spec.workload, BenchmarkWorkload):
        check_benchmark_models(spec, models, root, source_name)
    else:
        job.script_dir, job.script_path = check_script(spec, base_dir, root, source_name)
    return job


def load_job(path: Path, devices: list[DeviceTarget] | None = None) -> ResolvedJob:
    """Read, validate and resolve a job file, or raise JobFileError."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise JobFileError(f"{path}: no such job file.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JobFileError(f"{path}: cannot read the job file: {e}.") from None
    return load_job_text(text, str(path), path.resolve().parent, path.resolve(), devices)
