"""ONNX graphs with control flow (a `Loop` whose body runs many times a run): what op profiles and MAC counts must
handle without counting a body once per trip or tracing it without bound (issue 30)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def write_loop_onnx(path: Path, trips: int = 8, size: int = 16) -> Path:
    """x -> MatMul -> Loop(trips){MatMul, Relu, Identity} -> y: the smallest graph whose body runs `trips` times."""
    w = numpy_helper.from_array(np.full((size, size), 0.01, np.float32), "w")
    body = helper.make_graph(
        [helper.make_node("MatMul", ["x_in", "w"], ["mm"], name="body_matmul"),
         helper.make_node("Relu", ["mm"], ["x_out"], name="body_relu"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [1, size])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [1, size])])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["pre"], name="outer_matmul"),
         helper.make_node("Loop", ["trip", "cond", "pre"], ["y"], name="the_loop", body=body)],
        "loop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, size])],
        [w, numpy_helper.from_array(np.array(trips, np.int64), "trip"), numpy_helper.from_array(np.array(True), "cond")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnxruntime wheels of the last two years all read IR 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
