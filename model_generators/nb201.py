"""NAS-Bench-201 networks as ONNX, from the ``arch_str`` cell encoding of the public benchmark.

The macro skeleton is NAS-Bench-201's (Dong & Yang, "NAS-Bench-201: Extending the Scope of
Reproducible Neural Architecture Search", ICLR 2020, Fig. 1 and its public ``TinyNetwork``):
a 3×3 stem conv to 16 channels (batch norm), three stages of 5 cells with C = 16, 32, 64 at
32×32, 16×16 and 8×8 joined by residual reduction blocks (ReLU-conv 3×3 stride 2, ReLU-conv 3×3,
beside a 2×2 average pool and a 1×1 conv), then batch norm + ReLU, a global average pool and a
10-class fully connected layer on a 32×32 RGB (CIFAR) input.

A cell has 4 nodes; node j sums one operation on each earlier node i (6 edges), each one of
``none`` (no edge), ``skip_connect``, ``nor_conv_1x1`` and ``nor_conv_3x3`` (ReLU, conv, batch norm)
or ``avg_pool_3x3`` (stride 1). ``arch_str`` writes them per node:
``|op~0|+|op~0|op~1|+|op~0|op~1|op~2|``. Batch norm is folded into the convs, as a deployed model
has it; weights are random from a fixed seed (the features farm reads do not depend on them).
"""

from __future__ import annotations

import re

import onnx

from farm.model_generators.onnx_net import OnnxNet, Tensor

OPERATIONS = ("none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3")
STAGE_CHANNELS = (16, 32, 64)
CELLS_PER_STAGE = 5
CLASSES = 10
INPUT_SIZE = 32
_EDGE = re.compile(r"^([a-z0-9_]+)~(\d+)$")


class ArchError(ValueError):
    """An ``arch_str`` that is not a NAS-Bench-201 cell, or a cell whose output is always zero."""


def parse_arch(arch: str) -> list[list[tuple[str, int]]]:
    """``arch_str`` as, per node 1..3, its (operation, source node) edges; ArchError naming what is wrong."""
    nodes = []
    for j, part in enumerate(arch.strip().split("+"), start=1):
        edges = []
        for text in part.strip("|").split("|"):
            match = _EDGE.match(text)
            if match is None or match.group(1) not in OPERATIONS:
                raise ArchError(f"arch_str {arch[:200]!r}: edge {text[:60]!r} is not OP~NODE with OP one of "
                                f"{', '.join(OPERATIONS)}")
            edges.append((match.group(1), int(match.group(2))))
        if sorted(source for _, source in edges) != list(range(j)):
            raise ArchError(f"arch_str {arch[:200]!r}: node {j} must take one edge from each of nodes 0..{j - 1}")
        nodes.append(edges)
    if len(nodes) != 3:
        raise ArchError(f"arch_str {arch[:200]!r}: a NAS-Bench-201 cell has 3 computed nodes, not {len(nodes)}")
    return nodes


def _relu_conv(net: OnnxNet, x: Tensor, channels: int, kernel: int, stride: int, name: str) -> Tensor:
    return net.conv(net.relu(x, name=f"{name}_pre"), channels, kernel, stride, act=None, name=name)


def _cell(net: OnnxNet, x: Tensor, nodes: list[list[tuple[str, int]]], name: str) -> Tensor:
    values: list[Tensor | None] = [x]
    for j, edges in enumerate(nodes, start=1):
        terms = []
        for op, source in edges:
            value = values[source]
            if op == "none" or value is None:
                continue  # a zero tensor: adds nothing
            edge = f"{name}_n{j}_e{source}"
            if op == "skip_connect":
                terms.append(value)
            elif op == "avg_pool_3x3":
                terms.append(net.avg_pool(value, 3, 1, 1, name=edge))
            else:
                terms.append(_relu_conv(net, value, value.channels, 1 if op == "nor_conv_1x1" else 3, 1, edge))
        total = terms[0] if terms else None
        for k, term in enumerate(terms[1:]):
            total = net.add(total, term, name=f"{name}_n{j}_sum{k}")  # type: ignore[arg-type]
        values.append(total)
    if values[-1] is None:
        raise ArchError(f"{name}: the cell's output node receives nothing (its network outputs a constant)")
    out = values[-1]
    if out is x:  # the whole cell is a skip: keep a node so every cell shows in the graph
        out = net.relu(net.relu(x, name=f"{name}_id"), name=f"{name}_id2")
    return out


def _reduction(net: OnnxNet, x: Tensor, channels: int, name: str) -> Tensor:
    a = _relu_conv(net, x, channels, 3, 2, f"{name}_a")
    b = _relu_conv(net, a, channels, 3, 1, f"{name}_b")
    shortcut = net.conv(net.avg_pool(x, 2, 2, 0, name=f"{name}_pool"), channels, 1, padding=0, act=None,
                        name=f"{name}_down")
    return net.add(b, shortcut, name=f"{name}_add")


def nb201_network(arch: str, *, seed: int = 0) -> onnx.ModelProto:
    """The NAS-Bench-201 network of one ``arch_str``; ArchError if it is not one, or is degenerate."""
    nodes = parse_arch(arch)
    net = OnnxNet("nb201", 3, (INPUT_SIZE, INPUT_SIZE), seed)
    x = net.conv(net.input, STAGE_CHANNELS[0], 3, act=None, name="stem")
    for stage, channels in enumerate(STAGE_CHANNELS):
        if stage:
            x = _reduction(net, x, channels, f"reduce{stage}")
        for cell in range(CELLS_PER_STAGE):
            x = _cell(net, x, nodes, f"s{stage}c{cell}")
    x = net.relu(x, name="lastact")
    return net.model(net.classifier(x, CLASSES), f"NAS-Bench-201 {arch}")
