"""The reference suite, and the one path that submits it as a health check.

The suite ships inside farm (package data), so a wheel install has it; its models are
generated (deterministically) on first use into the controller's data directory, beside
the store, because the installed package may be read-only. `farm refresh`, the health check
before user work and the controller's --refresh-cron all submit through submit_reference_suite:
only jobs submitted here are health checks (jobs.kind), whatever a user names a job.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import yaml
from platformdirs import user_data_dir

from farm.controller.scheduling.artifacts import ArtifactStore
from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import DeviceTarget, JobFileError, ResolvedJob, load_job
from farm.controller.store import Store
from farm.model_generators.generate import generate_examples, write_if_changed
from farm.proto.spec import Priority

REFERENCE_SUITE_NAME = "reference-suite"
HEALTH_CHECK = "health_check"  # jobs.kind of a suite job farm submitted; every other job is "user"
SUITE_FILE = "reference-suite.yaml"
# The generated models the suite may name: mobilenetv2_w<width>_r<input size>.tflite
_GENERATED_MODEL = re.compile(r"^mobilenetv2_w(\d+(?:\.\d+)?)_r(\d+)\.tflite$")


class SuiteError(ValueError):
    """The reference suite cannot be read or its models cannot be written."""


def bundled_suite_text() -> str:
    return resources.files("farm.controller.operations").joinpath(SUITE_FILE).read_text(encoding="utf-8")


def suite_dir(store: Store) -> Path:
    """Where the bundled suite and its generated models live: beside the store (the data directory)."""
    if str(store.path) == ":memory:":  # an in-memory store has no directory of its own
        return Path(user_data_dir("farm", appauthor=False)) / "reference-suite"
    return store.path.resolve().parent / "reference-suite"


def prepare_suite(store: Store, suite: Path | None = None) -> Path:
    """The suite file to load, with every generated model it names written: `suite`, or the bundled one
    copied into the data directory."""
    if suite is None:
        suite = suite_dir(store) / SUITE_FILE
        try:
            write_if_changed(suite, bundled_suite_text().encode())
        except OSError as e:
            raise SuiteError(f"cannot write the reference suite into {suite.parent}: {e}") from None
    elif not suite.is_file():
        raise SuiteError(f"{suite}: no such reference suite")
    ensure_suite_models(suite)
    return suite


def ensure_suite_models(suite: Path) -> list[Path]:
    """Generate the suite's missing MobileNetV2 models beside it (never downloaded); returns those written."""
    try:
        spec = yaml.safe_load(suite.read_text()) or {}
    except OSError as e:
        raise SuiteError(f"{suite}: cannot read the reference suite: {e}") from None
    except yaml.YAMLError:
        return []  # loading the job names the file, line and field
    entries = spec.get("models", []) if isinstance(spec, dict) else []
    paths = [suite.parent / (m.get("path", "") if isinstance(m, dict) else str(m)) for m in entries]
    missing = [p for p in paths if not p.exists() and _GENERATED_MODEL.match(p.name)]
    written = []
    for path in missing:  # one at a time: each names its own width and size
        width, size = _GENERATED_MODEL.match(path.name).groups()  # type: ignore[union-attr]
        try:
            generate_examples(path.parent, widths=[float(width)], input_sizes=[int(size)], formats=("tflite",), zoo=False)
        except OSError as e:
            raise SuiteError(f"cannot write the reference model {path}: {e}") from None
        written.append(path)
    return written


def load_reference_suite(store: Store, devices: list[DeviceTarget], suite: Path | None = None, *,
                         priority: Priority = "low") -> ResolvedJob:
    """The suite as a job on every given device, each with its sim twin. Raises SuiteError or JobFileError."""
    job = load_job(prepare_suite(store, suite), devices=devices)
    job.targets = list(devices)
    job.spec.targets = [d.name for d in devices]
    job.spec.priority = priority
    return job


def submit_reference_suite(store: Store, devices: list[DeviceTarget], suite: Path | None = None, *,
                           priority: Priority = "low", artifacts: ArtifactStore | None = None) -> int:
    """Submit the suite to `devices` as a health check; returns the job id.

    With `artifacts` (a controller's store), the suite's models are copied in first: remote agents
    fetch models from there and nowhere else."""
    if not devices:
        raise SuiteError("the reference suite needs at least one device")
    job = load_reference_suite(store, devices, suite, priority=priority)
    if artifacts is not None:
        try:
            for model in job.models:
                artifacts.add_file(model.path)
        except (OSError, ValueError) as e:
            raise SuiteError(f"a reference model cannot be stored for the agents: {e}") from None
    return Controller(store).submit(job, name=REFERENCE_SUITE_NAME, kind=HEALTH_CHECK)


__all__ = ["HEALTH_CHECK", "REFERENCE_SUITE_NAME", "JobFileError", "SuiteError", "bundled_suite_text",
           "ensure_suite_models", "load_reference_suite", "prepare_suite", "submit_reference_suite", "suite_dir"]
