"""Run figures declared once (issue 35; proto/results.py, `figure(...)`): a declaration that cannot work is refused
when farm loads, naming the RunResult field; a record shows the stored value in the declared unit. Where the
declaration reaches the store, the wire and the record is tested on every declared figure by tests/store_contract.py,
tests/test_grpc_protocol.py and tests/test_store_written_before.py."""

from __future__ import annotations

import dataclasses

import pytest

from farm.controller.store.rows import ResultRow
from farm.controller.store.sql import SUMMARY_COLUMNS
from farm.proto.questions import RunRecord, RunRecordFields
from farm.proto.results import FIGURES, RunFigure, check_figures


def _figure(name: str = "npu_memory_peak_bytes", record: str = "npu_memory_peak_mb", **kw: object) -> RunFigure:
    fields: dict[str, object] = {"unit": "MiB", "column": int, "record": record, "doc": "d", "per": 1 << 20,
                                 "digits": 2, **kw}
    return RunFigure(name=name, **fields)  # type: ignore[arg-type]


def test_a_declaration_that_cannot_work_is_refused_naming_its_field() -> None:
    with pytest.raises(TypeError, match=r"RunResult\.npu_memory_peak_bytes: a run figure's column is int or float"):
        check_figures([_figure(column=str)])
    with pytest.raises(TypeError, match=r"per must be a positive number"):
        check_figures([_figure(per=0.0)])
    with pytest.raises(TypeError, match=r"record key 'npu_memory_peak_mb' is not an identifier, or another figure's"):
        check_figures([_figure(), _figure(name="other_bytes")])
    with pytest.raises(TypeError, match=r"record key 'npu memory' is not an identifier"):
        check_figures([_figure(record="npu memory")])


def test_a_name_or_record_key_already_written_by_hand_is_refused() -> None:
    # what the store and RunRecord check the declared figures against when farm loads
    hand_written = {*SUMMARY_COLUMNS, *ResultRow.__dataclass_fields__} - {f.name for f in FIGURES}
    with pytest.raises(TypeError, match=r"RunResult\.peak_rss_bytes: the store's result row already has"):
        check_figures([_figure(name="peak_rss_bytes")], columns=hand_written)
    with pytest.raises(TypeError, match=r"record key 'peak_rss_mb' is already a RunRecord field"):
        check_figures([_figure(record="peak_rss_mb")], records=RunRecordFields.model_fields)
    assert check_figures(FIGURES, columns=hand_written, records=RunRecordFields.model_fields) == FIGURES


def test_a_record_shows_the_stored_value_in_the_declared_unit() -> None:
    mib = _figure()
    assert (mib.shown(19818 << 20), mib.shown(None), mib.shown(1536 * 1024)) == (19818.0, None, 1.5)
    count = _figure(column=int, per=1.0)
    assert count.shown(7) == 7 and isinstance(count.shown(7), int)
    assert dataclasses.replace(mib, column=float, per=1000.0, digits=3).shown(1234.5678) == 1.235
    # each declared figure is a RunRecord field after the hand-written ones, in declaration order
    assert [f.name for f in FIGURES][:1] == ["gpu_memory_peak_bytes"]
    assert list(RunRecord.model_fields)[-len(FIGURES):] == [f.record for f in FIGURES]
    assert list(RunRecord.model_fields)[:len(RunRecordFields.model_fields)] == list(RunRecordFields.model_fields)
