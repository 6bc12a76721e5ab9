"""`replaced`: a model copy that refuses field names the model does not have (pydantic keeps them silently)."""

from pathlib import Path

import pytest

from farm.proto.copying import replaced
from farm.proto.spec import SimBudget

ROOT = Path(__file__).resolve().parent.parent


def test_a_known_field_is_changed_and_the_original_kept() -> None:
    sim = SimBudget(cpus=1, memory="512MB")
    more = replaced(sim, cpus=2)
    assert more.cpus == 2 and more.memory == sim.memory and sim.cpus == 1


def test_an_unknown_field_is_refused_by_name() -> None:
    sim = SimBudget(cpus=1, memory="512MB")
    with pytest.raises(TypeError, match="SimBudget has no field cpu_count, run_timeout_s"):
        replaced(sim, run_timeout_s=5, cpu_count=2)


def test_farm_code_copies_models_only_through_replaced() -> None:
    # a bare model_copy(update=...) is how a removed field once lost a board's run timeout without an error
    offenders = [str(p.relative_to(ROOT)) for folder in ("agents", "controller", "client", "cli", "proto", "web", "farm")
                 for p in (ROOT / folder).rglob("*.py")
                 if "model_copy(update" in p.read_text() and p.name != "copying.py"]
    assert offenders == []
