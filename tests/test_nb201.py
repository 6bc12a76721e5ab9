"""NAS-Bench-201 networks built from their ``arch_str`` (model_generators/nb201.py), read by farm's inspect.

The published range of the benchmark's CIFAR-10 networks (Dong & Yang, ICLR 2020, Table 1 / the
released API's ``get_cost_info``): 7.78 M to 220.11 M FLOPs (NAS-Bench-201 counts multiply-adds as
FLOPs) and 0.073 M to 1.53 M parameters — the cell without any conv at the low end, the cell of six
3×3 convs at the high end. Batch norm is folded here, so the parameters miss BN's few thousand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from farm.model_generators.nb201 import ArchError, nb201_network, parse_arch
from farm.models.facts import inspect_model

ALL_3X3 = "|nor_conv_3x3~0|+|nor_conv_3x3~0|nor_conv_3x3~1|+|nor_conv_3x3~0|nor_conv_3x3~1|nor_conv_3x3~2|"
ALL_SKIP = "|skip_connect~0|+|skip_connect~0|skip_connect~1|+|skip_connect~0|skip_connect~1|skip_connect~2|"
MIXED = "|nor_conv_1x1~0|+|nor_conv_3x3~0|avg_pool_3x3~1|+|none~0|nor_conv_1x1~1|skip_connect~2|"


def _facts(tmp_path: Path, arch: str):
    path = tmp_path / "cell.onnx"
    path.write_bytes(nb201_network(arch).SerializeToString())
    return inspect_model(path)


def test_the_extremes_match_the_published_range(tmp_path: Path) -> None:
    largest, smallest = _facts(tmp_path, ALL_3X3), _facts(tmp_path, ALL_SKIP)
    assert largest.macs == pytest.approx(220.11e6, rel=0.001)
    assert largest.param_count == pytest.approx(1.53e6, rel=0.005)
    assert smallest.macs == pytest.approx(7.78e6, rel=0.001)
    assert smallest.param_count == pytest.approx(0.073e6, rel=0.01)
    # no conv in the cells: the stem and the reductions' 3×3 convs, the shortcuts' 1×1, the classifier
    assert smallest.conv3x3_macs_share > 0.95 and 0 < smallest.conv1x1_macs_share < 0.05
    assert largest.conv3x3_macs_share > 0.99 and largest.depthwise_macs_share == 0.0


def test_a_mixed_cell_splits_its_work_between_1x1_and_3x3(tmp_path: Path) -> None:
    facts = _facts(tmp_path, MIXED)
    hw_channels = 32 * 32 * 16 * 16 + 16 * 16 * 32 * 32 + 8 * 8 * 64 * 64  # per stage: H·W·C·C, one cell each
    cells_1x1 = 5 * 2 * hw_channels  # two 1×1 convs per cell, five cells per stage
    shortcuts_1x1 = 16 * 16 * 32 * 16 + 8 * 8 * 64 * 32
    assert facts.conv1x1_macs_share * facts.macs == pytest.approx(cells_1x1 + shortcuts_1x1)
    assert facts.conv1x1_macs_share + facts.conv3x3_macs_share + facts.fc_macs_share == pytest.approx(1.0)


def test_bad_and_degenerate_cells_are_refused_by_name() -> None:
    with pytest.raises(ArchError, match="sep_conv"):
        parse_arch(ALL_3X3.replace("nor_conv_3x3~0|+", "sep_conv~0|+", 1))
    with pytest.raises(ArchError, match="node 2"):
        parse_arch("|skip_connect~0|+|skip_connect~0|skip_connect~0|+|none~0|none~1|none~2|")
    with pytest.raises(ArchError, match="output node"):  # nothing reaches node 3: the network is a constant
        nb201_network("|avg_pool_3x3~0|+|none~0|none~1|+|none~0|none~1|none~2|")
