"""benchmark_model output → farm's result type, on every real sample we have.

Fixtures in tests/fixtures/benchmark_model/ are real captured output (public):
  a: Raspberry Pi, google/XNNPACK issue #999 (newer, delta memory)
  b: TI AM62x, TexasInstruments processor-sdk-doc (INFO: prefixes, percentiles, 1.24027e+06)
  c: Xiaomi Mi11, TF 2.4 build, lp6m/yolov5s_android (peak memory)
  d: TFLite benchmark README, --enable_op_profiling (oldest "Average inference timings" form, [start] column)
  e: TensorFlow 1 benchmark_model with glog prefixes ("no stats" / "with stats")
  f, g: Arm Total Compute TC2 expected results (INFO:, XNNPACK; g with op profiling, abridged after
     the first regular Run Order rows)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from farm.agents.parsers.benchmark_model import (
    BenchmarkOutputError,
    MemoryKind,
    UnsupportedOperatorError,
    parse_benchmark_model,
)

FIXTURES = Path(__file__).parent / "fixtures" / "benchmark_model"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_every_fixture_parses_into_latency_stats():
    names = sorted(p.name for p in FIXTURES.glob("*.txt"))
    assert len(names) >= 7
    for name in names:
        stats = parse_benchmark_model(fixture(name)).to_latency_stats()
        assert stats.avg > 0, name


def test_raspberry_pi_newer_format_with_memory_delta():
    out = parse_benchmark_model(fixture("a_raspberry_pi_xnnpack_issue999.txt"))
    assert out.generation == "inference-timings"
    assert out.init_ms == pytest.approx(18.777)
    assert out.first_ms == pytest.approx(64.791)
    assert out.warmup_avg_ms == pytest.approx(57.7582)
    assert out.avg_ms == pytest.approx(55.0432)
    assert (out.std_ms, out.min_ms, out.max_ms, out.count) == pytest.approx((1.562, 53.077, 60.727, 50))
    assert out.warmup is not None and out.warmup.count == 9
    assert out.memory_kind is MemoryKind.DELTA
    assert (out.memory_init_mb, out.memory_overall_mb) == pytest.approx((8.97656, 18.7227))
    assert out.periodic_peak_mb is None
    stats = out.to_latency_stats()
    assert stats.avg == pytest.approx(55.0432) and stats.count == 50
    # No median printed and no p90/p99 ever: not derivable, so NaN (stored as NULL), never invented.
    assert math.isnan(stats.p50) and math.isnan(stats.p90) and math.isnan(stats.p99)


def test_info_prefixes_exponents_and_percentiles():
    out = parse_benchmark_model(fixture("b_ti_am62x_info_prefix.txt"))
    assert out.avg_ms == pytest.approx(1240.27)
    assert out.warmup_avg_ms == pytest.approx(1357.6)
    assert out.init_ms == pytest.approx(5.579)
    assert (out.p5_ms, out.median_ms, out.p95_ms) == pytest.approx((1238.753, 1239.807, 1247.415))
    assert out.model_size_mb == pytest.approx(67.3128)
    assert out.warmup is not None and out.warmup.first_ms is None  # a 1-run warmup prints no first=
    assert out.to_latency_stats().p50 == pytest.approx(1239.807)
    assert out.memory_overall_mb == pytest.approx(109.832)


def test_tf24_summary_only_with_peak_memory():
    out = parse_benchmark_model(fixture("c_xiaomi_mi11_tf24_peak_memory.txt"))
    assert (out.init_ms, out.first_ms, out.warmup_avg_ms, out.avg_ms) == pytest.approx(
        (16.242, 360.262, 304.586, 249.684))
    assert out.memory_kind is MemoryKind.PEAK
    assert (out.memory_init_mb, out.memory_overall_mb) == pytest.approx((4.92969, 138.809))
    assert out.count is None and out.std_ms is None
    stats = out.to_latency_stats()
    assert stats.count == 0 and math.isnan(stats.std)


def test_oldest_format_with_op_profiling_tables():
    out = parse_benchmark_model(fixture("d_tflite_readme_op_profiling.txt"))
    assert out.generation == "average-timings"
    assert (out.warmup_avg_ms, out.init_ms, out.avg_ms) == pytest.approx((83.235, 38.467, 79.7609))
    # Without run statistics lines the profiler's own "Timings (microseconds)" line gives the spread.
    assert (out.count, out.min_ms, out.max_ms, out.std_ms) == pytest.approx((50, 77.385, 88.213, 1.929))
    assert len(out.run_order) == 31
    first = out.run_order[0]
    assert (first.node_type, first.start_ms, first.avg_ms, first.name) == (
        "CONV_2D", 0.0, 4.269, "MobilenetV1/MobilenetV1/Conv2d_0/Relu6")
    assert [r.node_type for r in out.op_types] == [
        "CONV_2D", "DEPTHWISE_CONV_2D", "SOFTMAX", "RESHAPE", "AVERAGE_POOL_2D"]
    conv = out.op_types[0]
    assert (conv.count, conv.avg_ms, conv.percent, conv.cdf_percent, conv.mem_kb, conv.times_called) == (
        15, 1.406, 89.27, 89.27, 0.0, 0)


def test_tensorflow1_glog_no_stats_form():
    out = parse_benchmark_model(fixture("e_tensorflow1_glog_no_stats.txt"))
    assert out.generation == "average-timings"
    assert out.warmup_avg_ms == pytest.approx(169.371)
    assert out.avg_ms == pytest.approx(154.047)  # "no stats", not the slower profiled "with stats"
    assert out.count == 65 and out.min_ms == pytest.approx(84.108)
    assert out.first_ms == pytest.approx(237.9)  # first warmup run
    assert out.op_types[0].node_type == "Conv2D" and out.op_types[0].mem_kb == pytest.approx(1269.76)
    assert len(out.op_types) == 13


def test_newer_op_profiling_separates_initialization_from_regular_runs():
    out = parse_benchmark_model(fixture("g_arm_tc2_op_profiling_abridged.txt"))
    assert out.avg_ms == pytest.approx(7.45497) and out.count == 67
    assert [r.node_type for r in out.init_op_types] == ["ModifyGraphWithDelegate", "AllocateTensors"]
    assert out.init_op_types[0].mem_kb == pytest.approx(3428.0)
    # Node types with spaces and commas survive; this newer table has no [start] column.
    row = out.run_order[0]
    assert row.node_type == "Convolution (NHWC, QU8) IGEMM"
    assert row.start_ms is None and row.first_ms == pytest.approx(0.267) and row.avg_ms == pytest.approx(0.278)
    assert row.name == "Delegate/Convolution (NHWC, QU8) IGEMM:0"
    assert out.run_order[-1].node_type == "Add (ND, QU8)"


def test_periodic_peak_memory_line():
    # Format as the reference describes it for newer tools run with --report_peak_memory_footprint.
    text = fixture("f_arm_tc2_xnnpack_info.txt") + (
        "INFO: Overall peak memory footprint (MB) via periodic monitoring: 14.4883\n")
    out = parse_benchmark_model(text)
    assert out.periodic_peak_mb == pytest.approx(14.4883)
    assert out.memory_kind is MemoryKind.DELTA and out.memory_overall_mb == pytest.approx(10.5898)


def test_garbage_output_raises_with_the_raw_text_kept():
    garbage = "CANNOT LINK EXECUTABLE \"benchmark_model\": library \"libc++_shared.so\" not found\n"
    with pytest.raises(BenchmarkOutputError) as info:
        parse_benchmark_model(garbage)
    assert info.value.raw_text == garbage
    with pytest.raises(BenchmarkOutputError):
        parse_benchmark_model("")


@pytest.mark.parametrize("text, op", [
    ("ERROR: Encountered unresolved custom op: FarmUnknownOp.\n"
     "ERROR: Node number 3 (FarmUnknownOp) failed to prepare.\n", "FarmUnknownOp"),
    ("ERROR: Didn't find op for builtin opcode 'CONV_2D' version '5'. An older version of this builtin "
     "might be supported. Are you using an old TFLite binary with a newer model?\n"
     "ERROR: Registration failed.\n", "CONV_2D"),
    ("ERROR: Op builtin_code out of range: 150. Are you using old TFLite binary with newer model?\n",
     "builtin opcode 150"),
])
def test_unsupported_operator_is_named(text, op):
    with pytest.raises(UnsupportedOperatorError) as info:
        parse_benchmark_model("INFO: Loaded model m.tflite\n" + text + "Failed to initialize the interpreter\n")
    assert info.value.operator == op
    assert op in str(info.value)
    assert "Failed to initialize" in info.value.raw_text


def test_output_read_through_a_pty_with_crlf_line_ends():
    # Older adbd runs legacy `shell:` commands on a pty, which turns every \n into \r\n.
    text = fixture("b_ti_am62x_info_prefix.txt").replace("\n", "\r\n")
    out = parse_benchmark_model(text)
    assert out.avg_ms == pytest.approx(1240.27) and out.median_ms == pytest.approx(1239.807)
