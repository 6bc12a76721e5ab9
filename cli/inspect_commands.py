"""`farm inspect MODEL`: what a .tflite or .onnx file is, without running it — inputs and outputs,
parameters, MACs and FLOPs, size, operators by type, and a per-layer table (op, MACs, params,
output shape), like MLTK's model profiler.

FLOPs are 2 × MACs (one multiply and one add per multiply-accumulate), the convention of the
published figures; operators that are not convolutions or matrix products count as 0 (models/macs.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from farm.cli.console import UserError, out
from farm.proto import strict_json

DEFAULT_LAYER_ROWS = 40  # on a terminal; --all-layers or --json for every one


def flops(macs: int | None) -> int | None:
    return None if macs is None else 2 * macs


def _si(n: int | float | None, unit: str = "") -> str:
    """1234567 -> '1.23 M': big counts readable at a glance (the exact figure is in --json)."""
    if n is None:
        return "unknown"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.3g} {prefix}{unit}"
    return f"{n:g} {unit}".rstrip()


def _shape(shape: list[Any]) -> str:
    return "×".join("?" if d is None else str(d) for d in shape) if shape else "—"


def parse_shape_args(values: list[str]) -> dict[str, list[int]]:
    """--shape NAME=1x3x640x640 (repeatable) as {NAME: [1, 3, 640, 640]}; UserError naming the bad one."""
    shapes: dict[str, list[int]] = {}
    for value in values:
        name, sep, dims = value.rpartition("=")
        try:
            shape = [int(d) for d in dims.lower().replace(",", "x").split("x")]
        except ValueError:
            shape = []
        if not sep or not name or not shape or any(d <= 0 or d > 1 << 31 for d in shape):
            raise UserError(f"--shape {value[:120]!r}: give NAME=DIMS with positive whole dimensions, e.g. "
                            "--shape images=1x3x640x640")
        if name in shapes:
            raise UserError(f"--shape: input {name[:80]!r} is given twice")
        shapes[name] = shape
    return shapes


def inspect_report(path: Path, input_shapes: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Every figure `farm inspect` shows, as plain data (the --json output). Raises facts.ModelError.
    input_shapes fixes dynamic input dimensions (ONNX), so MACs can be counted."""
    from farm.models.facts import ModelError, inspect_model  # the runtimes' parsers: loaded for this command only
    from farm.models.macs import model_layers

    facts = inspect_model(path, input_shapes)
    if facts.format == "other":
        raise ModelError(f"{path}: farm reads .tflite and .onnx files; this one is neither (by its extension)")
    from farm.models.quantize import read_lineage

    layers = model_layers(path, input_shapes)
    total_macs = facts.macs
    return {
        "path": str(path), "format": facts.format, "size_bytes": facts.size_bytes, "sha256": facts.sha256,
        "inputs": [dataclasses.asdict(t) for t in facts.inputs],
        "outputs": [dataclasses.asdict(t) for t in facts.outputs],
        "param_count": facts.param_count, "macs": total_macs, "flops": flops(total_macs),
        "mac_shares": {"conv": facts.conv_macs_share, "depthwise": facts.depthwise_macs_share,
                       "fc": facts.fc_macs_share, "other": facts.other_macs_share},
        # parts of the conv share (FLOPs shares are the same fractions: FLOPs = 2 × MACs throughout)
        "conv_shares": {"1x1": facts.conv1x1_macs_share, "3x3": facts.conv3x3_macs_share,
                        "grouped": facts.grouped_macs_share},
        "activation_bytes": facts.activation_bytes, "op_count": facts.op_count, "layer_count": len(layers),
        "op_types": dict(sorted(facts.op_types.items(), key=lambda kv: (-kv[1], kv[0]))),
        "layers": [{**dataclasses.asdict(layer), "flops": flops(layer.macs)} for layer in layers],
        # ONNX Loop/If/Scan nodes whose bodies' MACs the total leaves out (models/macs.py): "macs" is a floor then
        "macs_not_counted": [{"name": layer.name, "op": layer.op, "note": layer.note}
                             for layer in layers if layer.note],
        "lineage": read_lineage(path),  # what `farm quantize` made it from (its sidecar or metadata), else None
    }


def lineage_line(lineage: dict[str, Any]) -> Text:
    """`farm quantize`'s record as one line: method, source and its hash, calibration set, tool and date."""
    source = lineage.get("source") or {}
    calibration = lineage.get("calibration")
    if not calibration:
        calibrated = "no calibration data"
    elif calibration.get("source") == "random":
        calibrated = f"calibrated on {calibration.get('samples')} random inputs"
    else:
        calibrated = (f"calibrated on {calibration.get('path')} ({calibration.get('samples')} samples, "
                      f"sha256 {str(calibration.get('sha256'))[:16]}…)")
    tool = lineage.get("tool") or {}
    return Text.assemble(("lineage: ", "bold"), f"{lineage.get('precision', '?')} by --method {lineage.get('method')} "
                         f"from {source.get('path')} (sha256 {str(source.get('sha256'))[:16]}…); {calibrated}; "
                         f"onnxruntime {tool.get('onnxruntime')}, {lineage.get('created')}")


def _tensors_table(title: str, tensors: list[dict[str, Any]]) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for c in ("name", "shape", "dtype"):
        t.add_column(c)
    for x in tensors:
        t.add_row(Text(x["name"]), Text(_shape(x["shape"])), Text(x["dtype"]))
    return t


def _layers_table(layers: list[dict[str, Any]], total_macs: int | None, rows: int | None) -> Table:
    shown = layers if rows is None else layers[:rows]
    t = Table(title=f"layers ({len(shown)} of {len(layers)})", title_justify="left", header_style="bold")
    for c, justify in (("#", "right"), ("layer", "left"), ("op", "left"), ("MACs", "right"), ("% MACs", "right"),
                       ("params", "right"), ("output shape", "left")):
        t.add_column(c, justify=justify)  # type: ignore[arg-type]
    for layer in shown:
        share = "" if not total_macs or layer["macs"] is None else f"{100 * layer['macs'] / total_macs:.1f}"
        t.add_row(str(layer["index"]), Text(layer["name"]), Text(layer["op"]),
                  "not counted" if layer.get("note") else "?" if layer["macs"] is None else _si(layer["macs"]), share, _si(layer["params"]),
                  Text(_shape(layer["output_shape"])))
    if rows is not None and len(layers) > rows:
        t.caption = f"{len(layers) - rows} more layer(s): --all-layers shows them, --json gives every figure"
    return t


def cmd_inspect(args: argparse.Namespace) -> int:
    from farm.models.facts import ModelError

    path = Path(args.model)
    try:
        report = inspect_report(path, parse_shape_args(args.shape))
    except ModelError as e:
        raise UserError(str(e)) from None
    if args.json:
        print(strict_json.dumps(report, indent=2))
        return 0
    out.print(Text.assemble((path.name, "bold"), f"  {report['format']}, {_si(report['size_bytes'], 'B')}, "
                            f"sha256 {report['sha256'][:16]}…"))
    shares = ", ".join(f"{k} {v:.0%}" for k, v in report["mac_shares"].items() if v)
    out.print(f"parameters {_si(report['param_count'])} · MACs {_si(report['macs'])} · FLOPs {_si(report['flops'])}"
              f" (batch 1{'; ' + shares if shares else ''})")
    conv_shares = ", ".join(f"{k} {v:.0%}" for k, v in report["conv_shares"].items() if v)
    out.print(f"layers {report['layer_count']} · activations {_si(report['activation_bytes'], 'B')}"
              f"{' · of the MACs in convs: ' + conv_shares if conv_shares else ''}")
    if report["lineage"]:
        out.print(lineage_line(report["lineage"]), highlight=False)
    if report["macs"] is None:
        out.print("MACs unknown: a convolution or matrix product has a shape that is only known at run time; "
                  "fix the inputs' dynamic dimensions with --shape NAME=1x3x224x224")
    for item in report["macs_not_counted"]:
        out.print(Text(f"MACs not counted in {item['op']} {item['name']!r}: {item['note']}; "
                       f"the total above is a floor"), style="yellow")
    out.print(_tensors_table("inputs", report["inputs"]))
    out.print(_tensors_table("outputs", report["outputs"]))
    ops = Table(title=f"operators ({report['op_count']})", title_justify="left", header_style="bold")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, n in report["op_types"].items():
        ops.add_row(Text(op), str(n))
    out.print(ops)
    out.print(_layers_table(report["layers"], report["macs"], None if args.all_layers else DEFAULT_LAYER_ROWS))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("inspect", help="a model's inputs, outputs, parameters, MACs/FLOPs, operators and layers")
    s.add_argument("model", help="a .tflite or .onnx file")
    s.add_argument("--json", action="store_true", help="machine-readable output, every layer")
    s.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS",
                   help="an input's full shape, e.g. images=1x3x640x640, for MACs of a model with dynamic dimensions "
                        "(repeatable; .onnx)")
    s.add_argument("--all-layers", action="store_true", help=f"every layer, not the first {DEFAULT_LAYER_ROWS}")
    s.set_defaults(func=cmd_inspect)

