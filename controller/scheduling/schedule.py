"""Expand a job into tasks: model × matrix cell × repeat × target, each with its pair key."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict
from typing import Any

from farm.controller.scheduling.jobfile import ResolvedJob
from farm.proto.accelerators import Accelerator, parse_accelerator
from farm.proto.copying import replaced
from farm.proto.device_types import DeviceType
from farm.proto.spec import SimBudget
from farm.proto.tasks import TaskPlan

PRIORITY_RANK = {"interactive": 0, "normal": 1, "low": 2}
# Retries per failure class: infrastructure goes elsewhere, timeout once, job never.
MAX_ATTEMPTS = 3
CPU = Accelerator("cpu")


def pair_key(model_sha256: str, threads: int, batch_size: int,
             input_size: int | None, device: str, repeat: int, cpus: float | None = None,
             accelerator: Accelerator | None = None) -> str:
    """The key a device task and its sim twin share within one job (a swept sim budget is part of the cell, and
    a device's compute unit when it is not the CPU: the gpu cell's twin is another sim run than the cpu cell's)."""
    cell = f"t{threads}-b{batch_size}-r{input_size or 'native'}" + (f"-c{cpus:g}" if cpus is not None else "")
    if accelerator is not None and str(accelerator) != "cpu":
        cell += f"-u{accelerator}"
    return f"{model_sha256[:16]}/{cell}/{device}/{repeat}"


def twin_sim_budget(sim: SimBudget, device_type: DeviceType | None, threads: int) -> SimBudget:
    """The sim budget that stands in for a device: its type's CPU and memory for this thread count."""
    if device_type is None:
        return sim  # an untyped device: the job's own sim budget is the best guess there is
    entry = device_type.budget_for(threads)
    return replaced(sim, cpus=entry.cpus, memory=entry.memory)


def expand_tasks(job: ResolvedJob) -> list[dict[str, Any]]:
    """Every (model × cell × repeat × target): a sim target gives one sim task; a device gives a
    device task and its sim twin with the device's budget, both under one pair key."""
    spec = job.spec
    now = time.time()
    tasks: list[dict[str, Any]] = []
    sim = spec.sim

    def plan(budget: SimBudget, unit: Accelerator = CPU, entry: int | None = None) -> str:
        # a model entry's own inputs and input_shapes are its tasks' workload (the job's are the defaults)
        workload = spec.workload if entry is None else spec.workload_for(entry)
        return TaskPlan(workload=workload, sim=budget, run_timeout_s=spec.timeouts.run,
                        base_dir=str(job.base_dir), script_archive=job.script_archive,
                        accelerator=unit.unit, precision=unit.precision).model_dump_json()
    targets = job.targets or [None]
    facts_json = {id(model): json.dumps(asdict(model.facts)) for model in job.models}  # once per model, not per task
    units = [parse_accelerator(a) for a in spec.matrix.accelerators]
    cells = itertools.product(job.models, spec.matrix.threads, spec.matrix.batch_sizes,
                              spec.matrix.input_sizes, spec.matrix.cpus, units, range(spec.repeats), targets)

    def task(model, threads: int, batch: int, size: int | None, repeat: int, target: str, key_device: str,
             budget: SimBudget, cpus: float | None = None, unit: Accelerator = CPU,
             key_unit: Accelerator = CPU) -> dict[str, Any]:
        return {
            "seq": len(tasks), "target": target, "model_name": model.name, "model_path": model.display or str(model.path),
            "model_sha256": model.facts.sha256, "model_family": model.family,
            "model_facts_json": facts_json[id(model)], "model_size_bytes": model.facts.size_bytes,
            "model_param_count": model.facts.param_count, "threads": threads, "batch_size": batch,
            "input_size": size, "repeat": repeat, "status": "pending", "attempts": 0,
            "max_attempts": MAX_ATTEMPTS,
            "pair_key": pair_key(model.facts.sha256, threads, batch, size, key_device, repeat, cpus, key_unit),
            "spec_json": plan(budget, unit, model.entry_index),
            "priority": PRIORITY_RANK[spec.priority], "created_at": now,
        }

    for model, threads, batch, size, cpus, cell, repeat, device in cells:
        if device is None:  # matrix.cpus (sim targets only, checked in jobfile) is this run's budget
            if not cell.on_cpu:
                continue  # the sim is a CPU: refused at submit, or skipped with --skip-invalid (jobfile)
            budget = sim if cpus is None else replaced(sim, cpus=cpus)
            tasks.append(task(model, threads, batch, size, repeat, "sim", "sim", budget, cpus))
            continue
        unit = cell.resolved(device.units)
        if unit is None:
            continue  # a unit the device lacks: refused at submit, or skipped with --skip-invalid (jobfile)
        tasks.append(task(model, threads, batch, size, repeat, device.name, device.name, sim, unit=unit, key_unit=unit))
        tasks.append(task(model, threads, batch, size, repeat, "sim", device.name,
                          twin_sim_budget(sim, device.device_type, threads), key_unit=unit))
    # A model refused at validation (--skip-invalid) is one `job` failure, stored before any run.
    for bad in job.invalid:
        threads, batch, size = spec.matrix.threads[0], spec.matrix.batch_sizes[0], spec.matrix.input_sizes[0]
        tasks.append({
            "seq": len(tasks), "target": "sim", "model_name": bad.name, "model_path": bad.path,
            "model_sha256": bad.sha256, "model_family": bad.family, "model_facts_json": "{}", "threads": threads,
            "batch_size": batch, "input_size": size, "repeat": 0, "status": "failed", "attempts": 0,
            "max_attempts": MAX_ATTEMPTS, "pair_key": pair_key(bad.sha256, threads, batch, size, "sim", 0),
            "spec_json": plan(sim),
            "priority": PRIORITY_RANK[spec.priority], "created_at": now, "finished_at": now,
            "failure_class": "job", "message": f"not run: {bad.problem}",
        })
    # Run repeat 0 of every cell before repeat 1: a slow drift then touches every model alike.
    tasks.sort(key=lambda t: (t["repeat"], t["seq"]))
    for seq, t in enumerate(tasks):
        t["seq"] = seq
    return tasks
