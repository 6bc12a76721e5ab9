"""The model <-> protobuf mapping: TaskSpec and RunResult cross the wire field for field.

Names match one for one; a dict or mixed-type list travels as `<name>_json`, and a None
becomes an unset `optional` field, so what arrives equals what was sent.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from datetime import datetime
from enum import Enum
from collections.abc import Iterable
from typing import Any, TypeVar

from google.protobuf.message import Message
from pydantic import BaseModel, ConfigDict
from pydantic_core import to_jsonable_python

from farm.proto.op_profile import MAX_NODES, MAX_OP_TYPES, bounded
from farm.proto.results import FailureClass, RunResult, TelemetrySample, run_result_from_dict
from farm.proto.sample_limits import MAX_SAMPLES, kept_note, notes_message
from farm.proto.tasks import Sha256, TaskPlan, TaskSpec

ModelT = TypeVar("ModelT", bound=BaseModel)

# One result on the wire, well under the 16 MiB gRPC message limit, so it always arrives whole.
MAX_RESULT_BYTES = 8 << 20


def fill_message(message: Message, obj: Any) -> Message:
    """Copy a dataclass, pydantic model (or dict) into a message of the same shape."""
    fields = message.DESCRIPTOR.fields_by_name
    items: Iterable[tuple[str, Any]]
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, BaseModel):  # a field's alias is its name on the wire; LOCAL fields never travel
        local = getattr(obj, "LOCAL", ())
        items = ((info.alias or name, getattr(obj, name)) for name, info in type(obj).model_fields.items()
                 if name not in local)
    else:
        items = ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    for name, value in items:
        if value is None:
            continue
        if f"{name}_json" in fields:
            setattr(message, f"{name}_json", json.dumps(to_jsonable_python(value)))
            continue
        field = fields[name]
        target = getattr(message, name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            target.update(value)
        elif field.is_repeated:
            if field.message_type is not None:
                for item in value:
                    fill_message(target.add(), item)
            else:
                target.extend(value)
        elif field.message_type is not None:
            target.SetInParent()  # an all-default sub-message must still arrive as present
            fill_message(target, value)
        elif isinstance(value, datetime):  # a Timestamp travels as Unix seconds (a double), as the store keeps it
            setattr(message, name, value.timestamp())
        else:
            setattr(message, name, value.value if isinstance(value, Enum) else value)
    return message


# How message_to_dict reads a field, decided once per message type (_fields), not per field of every message.
_JSON, _MAP, _MESSAGES, _SCALARS, _MESSAGE, _OPTIONAL, _SCALAR = range(7)


@functools.cache
def _fields(descriptor: Any) -> tuple[tuple[str, int], ...]:
    plan = []
    for field in descriptor.fields:
        if field.name.endswith("_json"):
            kind = _JSON
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            kind = _MAP
        elif field.is_repeated:
            kind = _MESSAGES if field.message_type is not None else _SCALARS
        elif field.message_type is not None:
            kind = _MESSAGE
        elif field.has_presence:
            kind = _OPTIONAL
        else:
            kind = _SCALAR
        plan.append((field.name, kind))
    return tuple(plan)


def message_to_dict(message: Message) -> dict[str, Any]:
    """The inverse of fill_message, as the plain dict dataclasses.asdict would give."""
    out: dict[str, Any] = {}
    for name, kind in _fields(message.DESCRIPTOR):
        value = getattr(message, name)
        if kind == _SCALAR:
            out[name] = value
        elif kind == _JSON:
            if value:
                out[name.removesuffix("_json")] = json.loads(value)
        elif kind == _MAP:
            out[name] = dict(value)
        elif kind == _MESSAGES:
            out[name] = [message_to_dict(v) for v in value]
        elif kind == _SCALARS:
            out[name] = list(value)
        elif not message.HasField(name):  # an optional scalar or a sub-message, unset
            out[name] = None
        else:
            out[name] = message_to_dict(value) if kind == _MESSAGE else value
    return out


class _TaskExtra(BaseModel):
    """TaskSpec.extra_json on the wire: the plan's fields that have no field of their own in the message."""

    model_config = ConfigDict(extra="forbid")  # a key this version does not know is refused, as in TaskSpec

    script_archive: Sha256 | None = None
    # issue 29: sent only when not the cpu/fp32 default, so agents of earlier versions still take every cpu task
    accelerator: str | None = None
    precision: str | None = None


# The plan's fields that travel as fields of their own in the TaskSpec message (numbers kept since v1).
_PLAN_FIELDS = ("workload", "sim", "run_timeout_s", "base_dir")


def answer_to_message(answer: BaseModel, message: Message) -> Message:
    """An answer model into its response message: field for field, or, for a message that is one
    `document_json`, the whole answer as JSON (a non-finite float travels as Infinity/NaN and comes back)."""
    if _is_document(message, type(answer)):
        message.document_json = json.dumps(to_jsonable_python(answer))  # type: ignore[attr-defined]
        return message
    return fill_message(message, answer)


def model_from_message(message: Message, model: type[ModelT]) -> ModelT:
    """The inverse of fill_message / answer_to_message, validated as the model (a request from the wire is hostile)."""
    if _is_document(message, model):
        return model.model_validate(json.loads(message.document_json))  # type: ignore[attr-defined]
    return model.model_validate(message_to_dict(message))


def _is_document(message: Message, model: type[BaseModel]) -> bool:
    return "document_json" in message.DESCRIPTOR.fields_by_name and "document" not in model.model_fields


def task_to_message(task: TaskSpec, message: Message) -> Message:
    """The task as the message carries it: its own fields, the plan's flattened beside them, the script
    archive in extra_json (as agents of earlier versions read it); the agent's local archive path stays here.

    The plan's part is encoded once per plan object (the controller keeps one per stored plan, issue 35) and
    merged in; only the task's own fields are filled each time."""
    message.MergeFromString(_plan_part(task.plan, type(message)))
    return fill_message(message, {name: getattr(task, name) for name in type(task).model_fields
                                  if name not in ("plan", "script_archive_path")})


# plan object's id -> (the plan, kept so the id is not reused, and its fields encoded in a TaskSpec message)
_PLAN_PARTS: dict[tuple[int, type], tuple[TaskPlan, bytes]] = {}
PLAN_PARTS_KEPT = 4096


def _plan_part(plan: TaskPlan, kind: type[Message]) -> bytes:
    key = (id(plan), kind)
    known = _PLAN_PARTS.get(key)
    if known is not None and known[0] is plan:
        return known[1]
    fields: dict[str, Any] = {name: getattr(plan, name) for name in _PLAN_FIELDS}
    # A workload field left at its default is not sent (the agent's model fills it in again): an agent of an
    # earlier version, which refuses a key it does not know, still takes every task that uses no newer field.
    fields["workload"] = {"type": plan.workload.type,
                          **plan.workload.model_dump(mode="json", exclude_defaults=True)}
    fields["extra"] = _TaskExtra(script_archive=plan.script_archive,
                                 accelerator=None if plan.accelerator == "cpu" else plan.accelerator,
                                 precision=None if plan.precision == "fp32" else plan.precision
                                 ).model_dump(exclude_none=True)
    part: bytes = fill_message(kind(), fields).SerializeToString()
    if len(_PLAN_PARTS) >= PLAN_PARTS_KEPT:
        _PLAN_PARTS.clear()
    _PLAN_PARTS[key] = (plan, part)
    return part


def task_from_message(message: Message) -> TaskSpec:
    data = message_to_dict(message)
    plan = {name: data.pop(name, None) for name in _PLAN_FIELDS}
    extra = _TaskExtra.model_validate(data.pop("extra", None) or {})
    # the workload and budget become the spec's models again; a field the model does not know is refused
    units = {"accelerator": extra.accelerator or "cpu", "precision": extra.precision or "fp32"}
    return TaskSpec.model_validate({**data, "plan": {**plan, "script_archive": extra.script_archive, **units}})


def result_to_message(result: RunResult, message: Message) -> Message:
    return fill_message(message, result)


def result_from_message(message: Message) -> RunResult:
    """The wire's result as a RunResult. Its samples (per-iteration timings and telemetry samples: most of a
    result's fields) go straight from the message's repeated fields, which protobuf has already typed (double,
    int64), into the result; the rest goes through the dict and the model, validated as every message is.
    Building and validating a dict per sample cost most of the controller's time per result (issue 35)."""
    rest = type(message)()
    rest.CopyFrom(message)
    rest.ClearField("iterations_ms")  # type: ignore[attr-defined]
    telemetry = message.telemetry if message.HasField("telemetry") else None  # type: ignore[attr-defined]
    if telemetry is not None:
        rest.telemetry.ClearField("samples")  # type: ignore[attr-defined]
    result = run_result_from_dict(message_to_dict(rest))
    result.iterations_ms = list(message.iterations_ms)  # type: ignore[attr-defined]
    if telemetry is not None and result.telemetry is not None:
        result.telemetry.samples = _samples(telemetry.samples)
    return result


def _samples(messages: Iterable[Any]) -> list[TelemetrySample]:
    """TelemetrySamples from a message's samples without the model's validation: protobuf has already typed their
    fields as the model's own (double, double, int64), so validating 25 of them per result would only cost (~3 us
    each). Each object's __dict__ is given whole, in this loop: a call per sample cost a quarter more."""
    new, cls, out = object.__new__, TelemetrySample, []
    for s in messages:
        sample = new(cls)
        sample.__dict__ = {"t_s": s.t_s, "cpu_percent": s.cpu_percent, "memory_bytes": s.memory_bytes}
        out.append(sample)
    return out


def result_for_the_wire(result: RunResult, message: Message) -> Message:
    """Fill `message` with a result that fits MAX_RESULT_BYTES: samples past MAX_SAMPLES are cut with a
    note; a result that is still too large becomes a `job` failure that says so (it can never be delivered)."""
    notes = []
    if len(result.iterations_ms) > MAX_SAMPLES:
        notes.append(kept_note(len(result.iterations_ms), "per-iteration timings"))
        result = dataclasses.replace(result, iterations_ms=result.iterations_ms[:MAX_SAMPLES])
    if result.telemetry and len(result.telemetry.samples) > MAX_SAMPLES:
        notes.append(kept_note(len(result.telemetry.samples), "telemetry samples"))
        result = dataclasses.replace(result, telemetry=dataclasses.replace(
            result.telemetry, samples=result.telemetry.samples[:MAX_SAMPLES]))
    if len(result.op_profile) > MAX_NODES + MAX_OP_TYPES:  # drivers bound it already; an old agent might not
        result = dataclasses.replace(result, op_profile=bounded(result.op_profile))
    if notes:
        result = dataclasses.replace(result, message=notes_message(result.message, notes))
    fill_message(message, result)
    size = message.ByteSize()
    if size > MAX_RESULT_BYTES:
        message.Clear()
        fill_message(message, RunResult.failed(FailureClass.JOB, (
            f"the run's result is {size} bytes with samples capped at {MAX_SAMPLES}, over the {MAX_RESULT_BYTES} "
            "byte limit per result (its log tail, environment or tool versions are too large); shorten what the "
            "workload prints")))
    return message
