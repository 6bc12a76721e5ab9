"""`farm submit JOB --set workload.iterations=20 --set 'matrix.threads=[1]'`: change any field of a
job file for one submission. Values are YAML (as in the file), paths are dotted (a number indexes a
list: `models.0.family=x`), the result is validated like the file, and the job text that is stored
is the one that ran, with the overrides named at its top.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml
from pydantic import ValidationError

from farm.proto.spec import JOB_FILE, JobSpec

MAX_OVERRIDES = 100


class OverrideError(ValueError):
    """A --set that cannot apply: no `=`, a value that is not YAML, a path through a scalar, or a value
    the job's schema refuses. The message names the --set."""


def parse_override(override: str) -> tuple[list[str], Any]:
    """`a.b.c=VALUE` -> (["a", "b", "c"], the YAML value)."""
    path, sep, raw = override.partition("=")
    keys = path.strip().split(".")
    if not sep or not all(k.strip() for k in keys):
        raise OverrideError(f"--set {override!r}: give FIELD=VALUE with a dotted field path, e.g. "
                            "--set workload.iterations=20 or --set 'matrix.threads=[1, 2]'.")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise OverrideError(f"--set {path}: the value {raw!r} is not valid YAML ({getattr(e, 'problem', e)}); "
                            "quote it for the shell, e.g. --set 'matrix.threads=[1, 2]'.") from None
    return [k.strip() for k in keys], value


def _assign(document: dict[str, Any], keys: list[str], value: Any, shown: str) -> None:
    node: Any = document
    for depth, key in enumerate(keys):
        last = depth == len(keys) - 1
        where = ".".join(keys[:depth]) or "the job"
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise OverrideError(f"--set {shown}: {where} is a list of {len(node)}; index it with 0 to "
                                    f"{len(node) - 1}, not {key!r}.")
            if last:
                node[int(key)] = value
                return
            if keys[0] == "models" and depth == 1 and isinstance(node[int(key)], str):
                node[int(key)] = {"path": node[int(key)]}  # `- a.tflite` is short for `- {path: a.tflite}`
            node = node[int(key)]
        elif isinstance(node, dict):
            if last:
                node[key] = value
                return
            if node.get(key) is None:
                node[key] = {}  # a section the file leaves out: --set sim.cpus=0.5 adds `sim:`
            node = node[key]
        else:
            raise OverrideError(f"--set {shown}: {where} is {node!r}, not a mapping or list, so it has no "
                                f"field {key!r}.")


def _document_path(document: Any, loc: Sequence[Any]) -> str:
    """A validation error's location as a dotted path of the document (a union's branch tag dropped)."""
    node, parts = document, []
    for index, part in enumerate(loc):
        if isinstance(node, dict) and str(part) in node:
            node = node[str(part)]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        elif index != len(loc) - 1:
            continue  # e.g. "benchmark" in workload.benchmark.iterations: the branch pydantic tried
        parts.append(str(part))
    return ".".join(parts)


def _describe(error: Any) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown field (check the spelling; `farm schema` lists every field)"
    return str(error["msg"])


def _under(loc: str, path: str) -> bool:
    return loc == path or loc.startswith(path + ".") or path.startswith(loc + ".")


def apply_overrides(text: str, overrides: Sequence[str]) -> str:
    """The job text with every override applied (validated like the file; errors name the --set)."""
    if len(overrides) > MAX_OVERRIDES:
        raise OverrideError(f"{len(overrides)} --set options; at most {MAX_OVERRIDES} (edit the job file instead).")
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # the file's own error, with its line, comes from validating the file
    if not isinstance(document, dict):
        return text
    paths: dict[str, str] = {}
    for override in overrides:
        keys, value = parse_override(override)
        shown = f"{'.'.join(keys)}={override.partition('=')[2].strip()}"
        _assign(document, keys, value, shown)
        paths[".".join(keys)] = shown
    try:
        JobSpec.model_validate(document, context=JOB_FILE)
    except ValidationError as e:
        problems = []
        for error in e.errors(include_url=False):
            loc = _document_path(document, error["loc"])
            for path, shown in paths.items():
                if _under(loc, path):
                    problems.append(f"--set {shown}: {loc}: {_describe(error)}.")
                    break
        if problems:
            raise OverrideError(" ".join(dict.fromkeys(problems))) from None
    header = "".join(f"# farm submit --set {o}\n" for o in overrides)
    return header + str(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))
