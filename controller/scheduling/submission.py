"""A job from the wire -> a ResolvedJob, reading nothing on the controller's host by a client's say-so.

Two ways in: the client uploaded the models (and workload.dir, packed) and names them by
sha256 — the usual `farm submit`; or the job names files on the controller's host, which
must lie under the operator's models roots (ControllerFiles). `base_dir` from the wire only
says where relative names start; it grants nothing.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from farm.controller.scheduling.artifacts import ArtifactError, ControllerFiles
from farm.controller.scheduling.jobfile import (
    DeviceTarget, InvalidModel, JobFileError, JobProblem, ResolvedJob, ResolvedModel, _locate, check_benchmark_models, check_dataset,
    check_task_count, parse_job_text, resolve_models, resolve_targets,
)
from farm.models.facts import ModelError, inspect_model
from farm.proto.accuracy import MAX_PACKED_BYTES
from farm.proto.copying import replaced
from farm.proto.escape import printable
from farm.proto.names import is_sha256
from farm.proto.script_archive import MAX_SCRIPT_ARCHIVE_BYTES, ScriptArchiveError, check_archive
from farm.proto.spec import BenchmarkWorkload, ModelEntry, ScriptWorkload
from farm.proto.storable import refusal, unstorable
from farm.proto.tasks import DEFAULT_MAX_TASKS

MODEL_NAME = re.compile(r"^[^\x00-\x1f\x7f]{1,200}$")
SOURCE = re.compile(r"^[^\x00-\x1f\x7f]{1,4096}$")


def _line(root: Any, *loc: Any) -> int:
    node, _ = _locate(root, loc)
    return node.start_mark.line + 1 if node is not None else 1


def load_submitted_job(request: Any, files: ControllerFiles, devices: list[DeviceTarget],
                       max_script_archive_bytes: int = MAX_SCRIPT_ARCHIVE_BYTES, *,
                       max_tasks: int = DEFAULT_MAX_TASKS) -> ResolvedJob:
    """request: a farm_pb2.SubmitJobRequest. Raises JobFileError with a message for the person who submitted."""
    for what, text in (("file_name", request.file_name), ("base_dir", request.base_dir)):  # kept with the job
        for _, bad in unstorable(text):
            raise JobFileError(f"the submitted job's {what}: {refusal('it', bad)}")
    source_name = request.file_name or "job.yaml"
    spec, root = parse_job_text(request.job_yaml, source_name)
    targets = resolve_targets(spec, root, source_name, devices)
    check_task_count(spec, len(spec.models), targets, max_tasks, source_name)  # before any file is looked at
    base_dir = Path(request.base_dir or "/")
    if not base_dir.is_absolute():
        raise JobFileError(f"{source_name}: base_dir must be an absolute path")
    archive = None
    if isinstance(spec.workload, ScriptWorkload):  # first: a refused folder leaves no model copied in
        archive = _script_archive(request, spec.workload, root, files, base_dir, source_name, max_script_archive_bytes)
    if isinstance(spec.workload, BenchmarkWorkload):
        named = [("workload", spec.workload.inputs)] + [
            (f"models[{i}]", spec.entry(i).inputs) for i in range(len(spec.models))]
        unread = [(where, name) for where, inputs in named for name, given in sorted(inputs.items())
                  if given.file is not None and given.value is None]
        _dataset_given(request, spec.workload, root, source_name)
        if unread:  # nothing is read from this machine's disk on a remote user's say-so
            raise JobFileError(f"{source_name}: {unread[0][0]}.inputs.{printable(unread[0][1], 80)}.file: input files "
                               "are read where the job is submitted; a controller takes the values inline (value: [...])")
    invalid: list[InvalidModel] = []
    if request.models:
        models = _uploaded_models(request, spec, root, files, source_name)
    else:
        models, invalid = resolve_models(spec, root, base_dir, source_name, gate=files)
    if isinstance(spec.workload, BenchmarkWorkload):
        invalid += check_benchmark_models(spec, models, root, source_name)
    if invalid:  # every bad model at once; a remote submit has no --skip-invalid
        raise JobFileError([m.problem for m in sorted(invalid, key=lambda m: (m.problem.line or 0, m.entry_index))])
    if isinstance(spec.workload, BenchmarkWorkload) and spec.workload.dataset is not None \
            and spec.workload.dataset.packed is None:
        _uploaded_dataset(spec.workload, models, files, root, source_name)  # checked here, kept as its sha256
    else:
        check_dataset(spec, models, root, base_dir, source_name)  # a packed dataset: unpacked and checked, nothing read
    check_task_count(spec, len(models), targets, max_tasks, source_name)
    return ResolvedJob(spec=spec, source=request.job_yaml, source_path=None, base_dir=base_dir, models=models,
                       targets=targets, script_archive=archive)


def _dataset_given(request: Any, workload: BenchmarkWorkload, root: Any, source_name: str) -> None:
    """The dataset comes as the client's upload (request.dataset_sha256) or packed in the file; its files are never
    read on this host. An upload's sha256 becomes workload.dataset.artifact, checked with the models."""
    dataset = workload.dataset
    where = f"{source_name}:{_line(root, 'workload', 'dataset')}: workload.dataset"
    if dataset is None:
        if request.dataset_sha256:
            raise JobFileError(f"{where}: the submit names an uploaded dataset, and the job file has no "
                               "workload.dataset")
        return
    if request.dataset_sha256:
        if not is_sha256(request.dataset_sha256):
            raise JobFileError(f"{where}: {request.dataset_sha256[:80]!r} is not a sha256")
        workload.dataset = replaced(dataset, packed=None, artifact=request.dataset_sha256)
    elif dataset.packed is None and dataset.artifact is None:
        raise JobFileError(f"{where}.path: a dataset is read where the job is submitted and uploaded with it; "
                           "`farm submit --controller` does that (this request carried none)")


def _uploaded_dataset(workload: BenchmarkWorkload, models: list[ResolvedModel], files: ControllerFiles, root: Any,
                      source_name: str) -> None:
    """The uploaded dataset.npz read from this controller's store, its bytes hashed again (a file changed on disk
    since it was stored is refused), bounded and checked against every model; the job keeps only its sha256."""
    from farm.controller.scheduling.datasets import DatasetRefused, load_dataset_artifact

    dataset = workload.dataset
    assert dataset is not None and dataset.artifact is not None  # _dataset_given set it
    sha256 = dataset.artifact
    where = f"{source_name}:{_line(root, 'workload', 'dataset')}: workload.dataset"
    stored = files.store.path(sha256)
    if stored is None:
        raise JobFileError(f"{where}: no uploaded dataset with sha256 {sha256} on this controller; "
                           "`farm submit` uploads it before it submits the job")
    size = stored.stat().st_size
    if size > MAX_PACKED_BYTES:
        raise JobFileError(f"{where}: the uploaded dataset {sha256[:12]} is {size:,} bytes, over the "
                           f"{MAX_PACKED_BYTES:,} bytes a packed dataset may be; use workload.dataset.limit")
    raw = stored.read_bytes()
    actual = hashlib.sha256(raw).hexdigest()
    if actual != sha256:
        raise JobFileError(f"{where}: the stored dataset {sha256[:12]} now hashes to {actual[:12]}: it changed on "
                           "this controller's disk after it was uploaded; upload it again (`farm submit`)")
    try:
        load_dataset_artifact(workload, models, raw, sha256)
    except DatasetRefused as e:
        raise JobFileError([JobProblem(source_name, _line(root, "workload", "dataset", e.field),
                                       f"workload.dataset.{e.field}", f"{e}.")]) from None


def _uploaded_models(request: Any, spec: Any, root: Any, files: ControllerFiles, source_name: str) -> list[ResolvedModel]:
    models: list[ResolvedModel] = []
    for model in request.models:
        if not 0 <= model.entry < len(spec.models):
            raise JobFileError(f"{source_name}: models: the upload names entry {model.entry}, and the file has "
                               f"{len(spec.models)} model entries")
        where = f"{source_name}:{_line(root, 'models', model.entry)}: models[{model.entry}]"
        if not MODEL_NAME.match(model.name):
            raise JobFileError(f"{where}: model name {model.name[:80]!r} must be 1-200 printable characters")
        stored = files.store.path(model.sha256)
        if stored is None:
            raise JobFileError(f"{where}: no uploaded file with sha256 {model.sha256[:64]!r} on this controller; "
                               "`farm submit` uploads the models before it submits the job")
        shown = model.source if SOURCE.match(model.source) else model.name  # display only
        try:
            facts = inspect_model(stored)  # the controller's own reading of the bytes it will serve
        except ModelError as e:
            raise JobFileError(f"{where}: {shown}: {e}") from None
        facts.path = shown
        entry = spec.models[model.entry]
        family = entry.family if isinstance(entry, ModelEntry) else None
        models.append(ResolvedModel(stored, model.name, family, facts, model.entry, display=facts.path))
    names = [m.name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise JobFileError(f"{source_name}: models: two models share the name(s) {dupes}; give each a distinct `name`.")
    return models


def _script_archive(request: Any, workload: ScriptWorkload, root: Any, files: ControllerFiles, base_dir: Path,
                    source_name: str, max_bytes: int) -> str:
    where = f"{source_name}:{_line(root, 'workload', 'dir')}: workload.dir"
    try:
        if request.script_archive_sha256:
            sha256 = request.script_archive_sha256
        else:  # a folder on the controller's host: only under a models root, packed as a client would
            sha256 = files.pack_script_dir(workload.dir, base_dir, max_bytes)
        stored = files.store.path(sha256)
        if stored is None:
            raise JobFileError(f"{where}: no uploaded script folder with sha256 {sha256[:64]!r} on this "
                               "controller; `farm submit` uploads it before it submits the job")
        if stored.stat().st_size > max_bytes:
            raise JobFileError(f"{where}: the packed folder is over {max_bytes >> 20} MiB")
        check_archive(stored, script=workload.script)
    except (ArtifactError, ScriptArchiveError) as e:
        raise JobFileError(f"{where}: {e}") from None
    return sha256
