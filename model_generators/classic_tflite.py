"""SqueezeNet 1.1 and GoogLeNet (Inception v1) as .tflite files, for the published phones experiment.

That experiment ran MobileNetV2 0.25–1.0, SqueezeNet and an Inception network with TFLite's
`benchmark_model`; the onnx package ships the two classics only as ONNX, and phones run .tflite.
These are the published architectures, float32, NHWC, random weights (a float kernel's cost does
not depend on the values), built with the same flatbuffer writer as MobileNetV2:

- SqueezeNet 1.1 (Iandola et al. 2016, and the v1.1 definition in the SqueezeNet repository): a 3x3/2
  stem, eight fire modules (1x1 squeeze, then 1x1 and 3x3 expands concatenated), 1x1 classifier,
  global average pool.
- GoogLeNet (Szegedy et al. 2015, "Going deeper with convolutions", Table 1): nine inception
  modules (1x1; 1x1→3x3; 1x1→5x5; 3x3 max pool→1x1, concatenated), average pool, fully connected.

SqueezeNet's stem and pools are unpadded, so its maps are the original's (224, 111, 55, 27, 13);
GoogLeNet pads SAME, which gives the paper's 112, 56, 28, 14, 7.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from farm.models.tflite_writer import INPUT_NAME, OUTPUT_NAME, TFLiteGraphBuilder
from farm.model_generators.mobilenetv2 import DEFAULT_SEED

SQUEEZENET_NAME = "squeezenet1_1"
INCEPTION_NAME = "inception_v1"
# (squeeze, expand 1x1, expand 3x3) of fire2..fire9; a max pool follows fire3 and fire5 (v1.1)
_FIRES = [(16, 64, 64), (16, 64, 64), (32, 128, 128), (32, 128, 128), (48, 192, 192), (48, 192, 192),
          (64, 256, 256), (64, 256, 256)]
_SQUEEZENET_POOL_AFTER = {1, 3}
# (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj) of 3a, 3b, 4a..4e, 5a, 5b; a max pool after 3b and 4e
_INCEPTIONS = [(64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64), (192, 96, 208, 16, 48, 64),
               (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64), (112, 144, 288, 32, 64, 64),
               (256, 160, 320, 32, 128, 128), (256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128)]
_INCEPTION_POOL_AFTER = {1, 6}


def _out_size(spatial: int, kernel: int, stride: int, valid: bool) -> int:
    return (spatial - kernel) // stride + 1 if valid else -(-spatial // stride)


class _Net:
    """A graph under construction with its current tensor and shape (batch 1, NHWC)."""

    def __init__(self, seed: int, input_size: int) -> None:
        self.graph = TFLiteGraphBuilder()
        self.rng = np.random.default_rng(seed)
        self.input = self.graph.activation(INPUT_NAME, [1, input_size, input_size, 3])
        self.names: set[str] = set()

    def _name(self, base: str) -> str:
        name, n = base, 1
        while name in self.names:
            n += 1
            name = f"{base}_{n}"
        self.names.add(name)
        return name

    def conv(self, name: str, x: tuple[int, int, int], cin: int, cout: int, kernel: int, stride: int = 1,
             relu: bool = True, valid: bool = False) -> tuple[int, int, int]:
        tensor, spatial, _ = x
        fan_in = cin * kernel * kernel
        weight = (self.rng.standard_normal((cout, kernel, kernel, cin)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        w = self.graph.constant(f"{name}_weight", weight)
        b = self.graph.constant(f"{name}_bias", np.zeros(cout, dtype=np.float32))
        out_spatial = _out_size(spatial, kernel, stride, valid)
        out = self.graph.activation(self._name(name), [1, out_spatial, out_spatial, cout])
        options = schema.Conv2DOptionsT()
        options.padding = schema.Padding.VALID if valid else schema.Padding.SAME
        options.strideH = options.strideW = stride
        options.dilationHFactor = options.dilationWFactor = 1
        options.fusedActivationFunction = (schema.ActivationFunctionType.RELU if relu
                                           else schema.ActivationFunctionType.NONE)
        self.graph.operator(schema.BuiltinOperator.CONV_2D, [tensor, w, b], [out], schema.BuiltinOptions.Conv2DOptions,
                            options)
        return out, out_spatial, cout

    def pool(self, name: str, x: tuple[int, int, int], kernel: int, stride: int, valid: bool = False
             ) -> tuple[int, int, int]:
        tensor, spatial, channels = x
        out_spatial = _out_size(spatial, kernel, stride, valid)
        out = self.graph.activation(self._name(name), [1, out_spatial, out_spatial, channels])
        options = schema.Pool2DOptionsT()
        options.padding = schema.Padding.VALID if valid else schema.Padding.SAME
        options.strideH = options.strideW = stride
        options.filterHeight = options.filterWidth = kernel
        self.graph.operator(schema.BuiltinOperator.MAX_POOL_2D, [tensor], [out],
                            schema.BuiltinOptions.Pool2DOptions, options)
        return out, out_spatial, channels

    def concat(self, name: str, parts: list[tuple[int, int, int]]) -> tuple[int, int, int]:
        spatial = parts[0][1]
        channels = sum(p[2] for p in parts)
        out = self.graph.activation(self._name(name), [1, spatial, spatial, channels])
        options: Any = schema.ConcatenationOptionsT()
        options.axis = 3
        self.graph.operator(schema.BuiltinOperator.CONCATENATION, [p[0] for p in parts], [out],
                            schema.BuiltinOptions.ConcatenationOptions, options)
        return out, spatial, channels

    def global_pool(self, x: tuple[int, int, int]) -> tuple[int, int]:
        tensor, _, channels = x
        axes = self.graph.constant("global_pool_axes", np.array([1, 2], dtype=np.int32))
        out = self.graph.activation("global_pool", [1, channels])
        options = schema.ReducerOptionsT()
        options.keepDims = False
        self.graph.operator(schema.BuiltinOperator.MEAN, [tensor, axes], [out], schema.BuiltinOptions.ReducerOptions,
                            options)
        return out, channels

    def fully_connected(self, x: tuple[int, int], units: int) -> int:
        tensor, depth = x
        weight = (self.rng.standard_normal((units, depth)) * np.sqrt(1.0 / depth)).astype(np.float32)
        w = self.graph.constant("classifier_weight", weight)
        b = self.graph.constant("classifier_bias", np.zeros(units, dtype=np.float32))
        out = self.graph.activation(OUTPUT_NAME, [1, units])
        self.graph.operator(schema.BuiltinOperator.FULLY_CONNECTED, [tensor, w, b], [out],
                            schema.BuiltinOptions.FullyConnectedOptions, schema.FullyConnectedOptionsT())
        return out


def squeezenet_tflite(input_size: int = 224, *, seed: int = DEFAULT_SEED) -> bytes:
    """SqueezeNet 1.1: input (1, size, size, 3), output (1, 1000) (the 1x1 classifier, then the global pool)."""
    net = _Net(seed, input_size)
    # unpadded stem and pools, as v1.1 defines them: 224 -> 111 -> 55 -> 27 -> 13
    x = net.conv("conv1", (net.input, input_size, 3), 3, 64, 3, stride=2, valid=True)
    x = net.pool("pool1", x, 3, 2, valid=True)
    for i, (squeeze, e1, e3) in enumerate(_FIRES):
        fire = f"fire{i + 2}"
        s = net.conv(f"{fire}_squeeze1x1", x, x[2], squeeze, 1)
        x = net.concat(f"{fire}_concat", [net.conv(f"{fire}_expand1x1", s, squeeze, e1, 1),
                                          net.conv(f"{fire}_expand3x3", s, squeeze, e3, 3)])
        if i in _SQUEEZENET_POOL_AFTER:
            x = net.pool(f"pool{i + 2}", x, 3, 2, valid=True)
    x = net.conv("conv10", x, x[2], 1000, 1)
    tensor, _, _ = x
    axes = net.graph.constant("global_pool_axes", np.array([1, 2], dtype=np.int32))
    logits = net.graph.activation(OUTPUT_NAME, [1, 1000])
    options = schema.ReducerOptionsT()
    options.keepDims = False
    net.graph.operator(schema.BuiltinOperator.MEAN, [tensor, axes], [logits], schema.BuiltinOptions.ReducerOptions,
                       options)
    return net.graph.to_bytes([net.input], [logits], f"SqueezeNet 1.1, random weights (seed {seed}); generated by farm")


def inception_v1_tflite(input_size: int = 224, *, seed: int = DEFAULT_SEED) -> bytes:
    """GoogLeNet (Inception v1) without its training-time side heads: input (1, size, size, 3), output (1, 1000)."""
    net = _Net(seed, input_size)
    x = net.conv("conv1_7x7_s2", (net.input, input_size, 3), 3, 64, 7, stride=2)
    x = net.pool("pool1_3x3_s2", x, 3, 2)
    x = net.conv("conv2_3x3_reduce", x, 64, 64, 1)
    x = net.conv("conv2_3x3", x, 64, 192, 3)
    x = net.pool("pool2_3x3_s2", x, 3, 2)
    names = ["3a", "3b", "4a", "4b", "4c", "4d", "4e", "5a", "5b"]
    for i, (b1, r3, b3, r5, b5, proj) in enumerate(_INCEPTIONS):
        m = f"inception_{names[i]}"
        cin = x[2]
        branch1 = net.conv(f"{m}_1x1", x, cin, b1, 1)
        branch3 = net.conv(f"{m}_3x3", net.conv(f"{m}_3x3_reduce", x, cin, r3, 1), r3, b3, 3)
        branch5 = net.conv(f"{m}_5x5", net.conv(f"{m}_5x5_reduce", x, cin, r5, 1), r5, b5, 5)
        branch_pool = net.conv(f"{m}_pool_proj", net.pool(f"{m}_pool", x, 3, 1), cin, proj, 1)
        x = net.concat(f"{m}_output", [branch1, branch3, branch5, branch_pool])
        if i in _INCEPTION_POOL_AFTER:
            x = net.pool(f"pool{3 if i == 1 else 4}_3x3_s2", x, 3, 2)
    logits = net.fully_connected(net.global_pool(x), 1000)
    return net.graph.to_bytes([net.input], [logits],
                              f"GoogLeNet (Inception v1), random weights (seed {seed}); generated by farm")


CLASSIC_TFLITE = {SQUEEZENET_NAME: squeezenet_tflite, INCEPTION_NAME: inception_v1_tflite}
