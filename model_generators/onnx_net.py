"""A convolutional network written layer by layer as an ONNX graph, in 2-D (images) or 3-D (video clips).

The published architectures (published_nets.py) are written with it the way their PyTorch
definitions read: conv + batch norm + ReLU, pools, concatenations, channel shuffles. Batch norm is
folded into the convolution (weight and bias), as every deployed model has it; weights are random
from a fixed seed (a float kernel's cost does not depend on the values). Shapes are tracked here,
so a wrong layer table fails while the graph is built, not when it first runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from farm.model_generators.generate_onnx import INPUT_NAME, IR_VERSION, OPSET, OUTPUT_NAME, PRODUCER

Activation = Literal["relu", "relu6"] | None
Size = int | Sequence[int]


@dataclass(frozen=True)
class Tensor:
    """An activation at batch 1: its graph name, channels and spatial dims (H, W) or (T, H, W)."""

    name: str
    channels: int
    spatial: tuple[int, ...]


class OnnxNet:
    def __init__(self, name: str, channels: int, spatial: Sequence[int], seed: int) -> None:
        self.name = name
        self.dims = len(spatial)
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.input = Tensor(INPUT_NAME, channels, tuple(spatial))
        self._used: set[str] = set()

    # --- plumbing ----------------------------------------------------------------------------
    def _unique(self, base: str) -> str:
        name, n = base, 1
        while name in self._used:
            n += 1
            name = f"{base}_{n}"
        self._used.add(name)
        return name

    def _constant(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name=name))
        return name

    def _node(self, op: str, inputs: list[str], base: str, **attributes: Any) -> str:
        out = self._unique(base)
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attributes))
        return out

    def _per_axis(self, value: Size) -> tuple[int, ...]:
        values = (value,) * self.dims if isinstance(value, int) else tuple(value)
        if len(values) != self.dims:
            raise ValueError(f"{self.name}: {values} does not have one value per axis ({self.dims})")
        return values

    @staticmethod
    def _out(size: int, kernel: int, stride: int, pad: int) -> int:
        out = (size + 2 * pad - kernel) // stride + 1
        if out < 1:
            raise ValueError(f"a {kernel}-wide window with stride {stride} does not fit an axis of {size}")
        return out

    def _act(self, x: str, act: Activation, base: str) -> str:
        if act == "relu":
            return self._node("Relu", [x], f"{base}_relu")
        if act == "relu6":
            if "relu6_min" not in self._used:  # made on first use: an unused initializer makes ONNX Runtime warn
                self._used.update(("relu6_min", "relu6_max"))
                self._constant("relu6_min", np.array(0.0, dtype=np.float32))
                self._constant("relu6_max", np.array(6.0, dtype=np.float32))
            return self._node("Clip", [x, "relu6_min", "relu6_max"], f"{base}_relu6")
        return x

    # --- layers ------------------------------------------------------------------------------
    def conv(self, x: Tensor, out_channels: int, kernel: Size, stride: Size = 1, padding: Size | None = None,
             *, groups: int = 1, act: Activation = "relu", name: str = "conv") -> Tensor:
        """Conv (batch norm folded in) and its activation; padding defaults to kernel // 2 per axis."""
        k, s = self._per_axis(kernel), self._per_axis(stride)
        p = tuple(size // 2 for size in k) if padding is None else self._per_axis(padding)
        if x.channels % groups or out_channels % groups:
            raise ValueError(f"{self.name} {name}: {x.channels} -> {out_channels} channels in {groups} groups")
        fan_in = x.channels // groups * math.prod(k)
        gain = math.sqrt(2.0 / fan_in) * (1.0 if act else 0.5)  # damped when linear: residual sums stay O(1)
        base = self._unique(name)
        weight = (self.rng.standard_normal((out_channels, x.channels // groups, *k)) * gain).astype(np.float32)
        bias = (self.rng.standard_normal(out_channels) * 0.01).astype(np.float32)
        out = self._node("Conv", [x.name, self._constant(f"{base}_weight", weight), self._constant(f"{base}_bias", bias)],
                         f"{base}_conv", kernel_shape=list(k), strides=list(s), pads=list(p) + list(p),
                         dilations=[1] * self.dims, group=groups)
        spatial = tuple(self._out(n, kk, ss, pp) for n, kk, ss, pp in zip(x.spatial, k, s, p))
        return Tensor(self._act(out, act, base), out_channels, spatial)

    def _pool(self, op: str, x: Tensor, kernel: Size, stride: Size, padding: Size, name: str) -> Tensor:
        k, s, p = self._per_axis(kernel), self._per_axis(stride), self._per_axis(padding)
        extra = {"count_include_pad": 1} if op == "AveragePool" else {}  # PyTorch's default for avg_pool
        out = self._node(op, [x.name], name, kernel_shape=list(k), strides=list(s), pads=list(p) + list(p), **extra)
        return Tensor(out, x.channels, tuple(self._out(n, kk, ss, pp) for n, kk, ss, pp in zip(x.spatial, k, s, p)))

    def max_pool(self, x: Tensor, kernel: Size, stride: Size, padding: Size = 0, name: str = "maxpool") -> Tensor:
        return self._pool("MaxPool", x, kernel, stride, padding, name)

    def avg_pool(self, x: Tensor, kernel: Size, stride: Size, padding: Size = 0, name: str = "avgpool") -> Tensor:
        return self._pool("AveragePool", x, kernel, stride, padding, name)

    def concat(self, parts: Sequence[Tensor], name: str = "concat") -> Tensor:
        if len({part.spatial for part in parts}) != 1:
            raise ValueError(f"{self.name} {name}: cannot concatenate maps of sizes {[p.spatial for p in parts]}")
        out = self._node("Concat", [part.name for part in parts], name, axis=1)
        return Tensor(out, sum(part.channels for part in parts), parts[0].spatial)

    def add(self, a: Tensor, b: Tensor, act: Activation = None, name: str = "add") -> Tensor:
        if (a.channels, a.spatial) != (b.channels, b.spatial):
            raise ValueError(f"{self.name} {name}: cannot add {a} and {b}")
        return Tensor(self._act(self._node("Add", [a.name, b.name], name), act, name), a.channels, a.spatial)

    def relu(self, x: Tensor, name: str = "relu") -> Tensor:
        return Tensor(self._node("Relu", [x.name], name), x.channels, x.spatial)

    def split_halves(self, x: Tensor, name: str = "split") -> tuple[Tensor, Tensor]:
        half = x.channels // 2
        sizes = self._constant(self._unique(f"{name}_sizes"), np.array([half, x.channels - half], dtype=np.int64))
        first, second = self._unique(f"{name}_a"), self._unique(f"{name}_b")
        self.nodes.append(helper.make_node("Split", [x.name, sizes], [first, second], name=first, axis=1))
        return Tensor(first, half, x.spatial), Tensor(second, x.channels - half, x.spatial)

    def channel_shuffle(self, x: Tensor, groups: int = 2, name: str = "shuffle") -> Tensor:
        """ShuffleNet's shuffle: view as (groups, channels/groups), transpose, flatten back (batch kept by 0)."""
        grouped = self._constant(self._unique(f"{name}_grouped"),
                                 np.array([0, groups, x.channels // groups, *x.spatial], dtype=np.int64))
        flat = self._constant(self._unique(f"{name}_flat"), np.array([0, x.channels, *x.spatial], dtype=np.int64))
        y = self._node("Reshape", [x.name, grouped], f"{name}_reshape")
        y = self._node("Transpose", [y], f"{name}_transpose", perm=[0, 2, 1, *range(3, 3 + self.dims)])
        return Tensor(self._node("Reshape", [y, flat], f"{name}_back"), x.channels, x.spatial)

    def classifier(self, x: Tensor, classes: int) -> Tensor:
        """Global average pool, then a fully connected layer to `classes` logits (the graph's output)."""
        pooled = self._node("GlobalAveragePool", [x.name], "global_pool")
        flat = self._node("Flatten", [pooled], "flatten", axis=1)
        weight = (self.rng.standard_normal((classes, x.channels)) * math.sqrt(1.0 / x.channels)).astype(np.float32)
        w = self._constant("classifier_weight", weight)
        b = self._constant("classifier_bias", np.zeros(classes, dtype=np.float32))
        self.nodes.append(helper.make_node("Gemm", [flat, w, b], [OUTPUT_NAME], name=OUTPUT_NAME, transB=1))
        return Tensor(OUTPUT_NAME, classes, ())

    def conv_classifier(self, x: Tensor, classes: int) -> Tensor:
        """SqueezeNet's head: a 1x1 conv to `classes` maps with ReLU, then the global average (the output)."""
        maps = self.conv(x, classes, 1, padding=0, name="classifier")
        pooled = self._node("GlobalAveragePool", [maps.name], "global_pool")
        self.nodes.append(helper.make_node("Flatten", [pooled], [OUTPUT_NAME], name=OUTPUT_NAME, axis=1))
        return Tensor(OUTPUT_NAME, classes, ())

    # --- the model ---------------------------------------------------------------------------
    def model(self, output: Tensor, doc: str) -> onnx.ModelProto:
        """The finished graph: input (batch, C, *spatial) with a dynamic batch, output (batch, classes)."""
        if output.name != OUTPUT_NAME:
            raise ValueError(f"{self.name}: the graph must end in a classifier")
        inputs = [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT,
                                                ["batch", self.input.channels, *self.input.spatial])]
        outputs = [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", output.channels])]
        graph = helper.make_graph(self.nodes, self.name, inputs, outputs, initializer=self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                                  producer_name=PRODUCER, doc_string=doc)
        onnx.checker.check_model(model)
        return model
