"""CPU time of the run-record flow's renderers over a large job (issue 35 item 2: renderers render models).

The 25 records of tests/fixtures/record_renderers/results.json, copied into one job of N records (each copy a model
of its own, as `farm results` of a big sweep gets from the service), go through what a user's commands print:
`farm results` (table, --runs --wide, JSON, CSV), `--pairs --json`, `farm compare A B --json` and `--pareto --json`.
Each is timed as CPU seconds of this process (time.process_time: less moved by the shared machine's load than
wall time), the median of `--rounds` rounds.

It runs on the code before the change too (which took the records' dict form, `model_dump()` of each, made here
as `farm results` made it): the two figures side by side are the change's cost or saving.

    python benchmarks/record_rendering.py [--records 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from farm.cli.render import pairs_table, results_table
from farm.controller.analysis import results as results_module
from farm.controller.analysis.compare import compare_records
from farm.controller.analysis.export import results_csv, to_json
from farm.controller.analysis.pareto import pareto
from farm.controller.analysis.results import paired_records
from farm.proto.questions import RunRecord

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "record_renderers" / "results.json"
MODELS = hasattr(results_module, "AveragedRecord")  # the renderers take models (else the records' dict form)


def _records(n: int) -> tuple[list[Any], list[Any], list[RunRecord]]:
    """Job 1 and job 2 of the fixture, each copied to about n/2 records (a copy's models renamed, so cells differ)."""
    base = [RunRecord.model_validate(r) for r in json.loads(FIXTURE.read_text())]
    jobs: dict[int, list[RunRecord]] = {1: [], 2: []}
    copies = max(1, n // len(base))
    for k in range(copies):
        for r in base:
            model = r.model.model_copy(update={"name": f"{r.model.name}-{k}"})
            jobs[r.job].append(r.model_copy(update={"model": model, "pair_key": f"{r.pair_key}-{k}"}))
    models = jobs[1] + jobs[2]
    if MODELS:
        return jobs[1], jobs[2], models
    return [r.model_dump() for r in jobs[1]], [r.model_dump() for r in jobs[2]], models


def _dump(items: list[Any]) -> list[Any]:
    return [i.model_dump() for i in items] if MODELS else items


def _tasks(one: list[Any], two: list[Any], models: list[RunRecord]) -> dict[str, Callable[[], object]]:
    console = Console(width=200, file=open("/dev/null", "w"), color_system=None)
    both = one + two

    def as_json(answer: Any) -> str:
        return to_json(answer.model_dump() if MODELS else answer)

    return {
        # what the code before the change did first in every command (the tables read the dict form): its rows
        # below leave it out (the dicts are made before the clock starts), so add it to each of them
        "model_dump() of every record": lambda: [r.model_dump() for r in models],
        "results table": lambda: console.print(results_table(both, title="job")),
        "results --runs --wide": lambda: console.print(results_table(both, title="job", wide=True, runs=True)),
        "results --json": lambda: to_json(_dump(both)),
        "results --format csv": lambda: results_csv(both),
        "results --pairs (json + table)": lambda: (to_json(_dump(paired_records(both))),
                                                   console.print(pairs_table(paired_records(both)))),
        "compare 1 2 --json": lambda: as_json(compare_records(one, two, job_a=1, job_b=2)),
        "compare 1 2 --pareto --json": lambda: as_json(pareto([(1, one), (2, two)])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    one, two, models = _records(args.records)
    print(f"{'models' if MODELS else 'dicts'}: {len(one) + len(two)} records, median of {args.rounds} rounds (CPU s)")
    for name, task in _tasks(one, two, models).items():
        times = []
        for _ in range(args.rounds):
            start = time.process_time()
            task()
            times.append(time.process_time() - start)
        print(f"| {name} | {statistics.median(times):.3f} |")


if __name__ == "__main__":
    main()
