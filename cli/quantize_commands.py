"""`farm quantize MODEL.onnx`: an int8 variant made with ONNX Runtime's own quantizer, with its lineage
(models/quantize.py). A local command: it reads and writes files here, no store and no controller."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.text import Text

from farm.cli.console import UserError, err, out
from farm.proto import strict_json


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def cmd_quantize(args: argparse.Namespace) -> int:
    from farm.cli.inspect_commands import parse_shape_args
    from farm.models.quantize import QuantizeError, quantize

    shapes = parse_shape_args(args.shape)
    if shapes and (args.method not in ("static", "qdq") or args.calibration):
        raise UserError("--shape fixes the random calibration inputs' dynamic dimensions: it goes with --method "
                        "static or qdq and no --calibration")
    try:
        result = quantize(Path(args.model), Path(args.output) if args.output else None, method=args.method,
                          calibration=Path(args.calibration) if args.calibration else None, force=args.force,
                          shapes=shapes)
    except QuantizeError as e:
        raise UserError(str(e)) from None
    calibration = result.lineage.get("calibration")
    if args.json:
        print(strict_json.dumps({"output": str(result.output), "lineage_file": str(result.lineage_path),
                                 "source_size_bytes": result.source_size_bytes,
                                 "output_size_bytes": result.output_size_bytes,
                                 "size_ratio": result.output_size_bytes / max(1, result.source_size_bytes),
                                 "seconds": result.seconds, "lineage": result.lineage}, indent=2))
        return 0
    if calibration and calibration.get("source") == "random":
        err.print(Text.assemble(("note: ", "yellow"), f"no --calibration given: calibrated on {calibration['samples']} "
                                "random inputs of the model's shapes; activation ranges of real data differ, "
                                "so give --calibration FILE.npz for a variant whose accuracy means something"),
                  highlight=False)
    out.print(Text.assemble(("wrote ", "green"), str(result.output),
                            f"  {_mb(result.source_size_bytes)} → {_mb(result.output_size_bytes)} "
                            f"({result.output_size_bytes / max(1, result.source_size_bytes):.0%}), "
                            f"--method {args.method}, {result.seconds:.1f} s"), highlight=False)
    if result.output_size_bytes >= result.source_size_bytes:
        err.print(Text.assemble(("note: ", "yellow"), "the variant is not smaller than its source: ONNX Runtime "
                                "quantized few of its weights (a small or recurrent model's quantize/dequantize "
                                "nodes can outweigh them); `farm inspect` lists its operators"), highlight=False)
    if str(result.lineage.get("preprocess", "")).startswith("skipped"):
        err.print(Text.assemble(("note: ", "yellow"), f"pre-processing {result.lineage['preprocess']}; the model "
                                "was quantized as it is"), highlight=False)
    out.print(f"lineage: {result.lineage_path} (also in the model's metadata; `farm inspect {result.output}` shows it)",
              highlight=False)
    return 0


def add_parser(sub: argparse._SubParsersAction, local: argparse.ArgumentParser) -> None:
    s = sub.add_parser("quantize", parents=[local],
                       help="an int8 variant of an .onnx model (ONNX Runtime's quantizer), with its lineage")
    s.add_argument("model", help="the .onnx model to quantize (.tflite: quantize with TensorFlow's converter)")
    s.add_argument("-o", "--output", help="the variant's path (default: MODEL's name with .int8 / .int8-static / "
                                          ".int8-qdq / .fp16 before .onnx)")
    s.add_argument("--method", choices=["dynamic", "static", "qdq", "fp16"], default="dynamic",
                   help="dynamic: int8 weights, activations at run time (default); static: QOperator int8 with "
                        "calibrated activations; qdq: QuantizeLinear/DequantizeLinear int8; fp16: needs "
                        "onnxconverter-common")
    s.add_argument("--calibration", metavar="FILE.npz|DIR",
                   help="static/qdq: real inputs (.npz keyed by input name, .npy for one input, or a folder of them; "
                        "one sample or a stack each); default: random inputs of the model's shapes")
    s.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS",
                   help="static/qdq without --calibration: an input's full shape for the random calibration inputs, "
                        "e.g. x=1x3x48x192, where the model's is dynamic (repeatable)")
    s.add_argument("--force", action="store_true", help="replace the output file when it exists")
    s.set_defaults(func=cmd_quantize)
