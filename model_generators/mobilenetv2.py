"""MobileNetV2 (Sandler et al., 2018) as plain layers with weights, independent of any file format.

generate_onnx and generate_tflite both serialise the same `MobileNetV2` object, so the two
formats of one (width, seed) carry identical weights and compute the same function.
Batch norm is folded into the convolutions (as every deployed MobileNetV2 has it), so each
convolution has a weight and a bias.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np

WIDTHS: tuple[float, ...] = (0.25, 0.35, 0.5, 0.75, 1.0, 1.3, 1.4)
INPUT_SIZES: tuple[int, ...] = (96, 128, 160, 192, 224)
NUM_CLASSES = 1000
DEFAULT_SEED = 0

# (expansion t, output channels c, repeats n, first stride s): Table 2 of the paper.
INVERTED_RESIDUAL_SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
STEM_CHANNELS = 32
HEAD_CHANNELS = 1280


def make_divisible(value: float, divisor: int = 8, min_value: int | None = None) -> int:
    """Round a channel count to a multiple of `divisor`, never dropping more than 10%."""
    floor = divisor if min_value is None else min_value
    rounded = max(floor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


ConvKind = Literal["conv", "depthwise"]


@dataclass(frozen=True)
class ConvLayer:
    """A 2-D convolution with folded batch norm; `weight` is OIHW (depthwise: C x 1 x kH x kW)."""

    name: str
    kind: ConvKind
    weight: np.ndarray
    bias: np.ndarray
    stride: int
    relu6: bool

    @property
    def out_channels(self) -> int:
        return int(self.weight.shape[0])

    @property
    def kernel_size(self) -> int:
        return int(self.weight.shape[2])

    @property
    def param_count(self) -> int:
        return int(self.weight.size + self.bias.size)


@dataclass(frozen=True)
class InvertedResidual:
    name: str
    layers: tuple[ConvLayer, ...]  # [expand 1x1,] depthwise 3x3, project 1x1 (linear)
    residual: bool  # stride 1 and same input/output channels


@dataclass(frozen=True)
class MobileNetV2:
    width: float
    seed: int
    stem: ConvLayer
    blocks: tuple[InvertedResidual, ...]
    head: ConvLayer  # final 1x1 conv to 1280 (or more when width > 1)
    classifier_weight: np.ndarray  # (classes, features), as Gemm with transB=1 / FULLY_CONNECTED
    classifier_bias: np.ndarray

    def conv_layers(self) -> list[ConvLayer]:
        return [self.stem, *(layer for block in self.blocks for layer in block.layers), self.head]

    @property
    def param_count(self) -> int:
        convs = sum(layer.param_count for layer in self.conv_layers())
        return convs + int(self.classifier_weight.size + self.classifier_bias.size)


def model_name(width: float, input_size: int) -> str:
    """File stem used for one generated variant, e.g. mobilenetv2_w0.5_r160, mobilenetv2_w1.0_r224."""
    label = f"{width:g}"
    if "." not in label:
        label += ".0"  # 1.0, not 1: the way MobileNet checkpoints are named
    return f"mobilenetv2_w{label}_r{input_size}"


def _conv(
    rng: np.random.Generator,
    name: str,
    kind: ConvKind,
    in_channels: int,
    out_channels: int,
    kernel: int,
    stride: int,
    relu6: bool,
) -> ConvLayer:
    in_per_group = 1 if kind == "depthwise" else in_channels
    fan_in = in_per_group * kernel * kernel
    # He init, damped for the linear projections so the residual sums stay O(1) through 17 blocks.
    gain = np.sqrt(2.0 / fan_in) * (1.0 if relu6 else 0.5)
    weight = (rng.standard_normal((out_channels, in_per_group, kernel, kernel)) * gain).astype(np.float32)
    bias = (rng.standard_normal(out_channels) * 0.01).astype(np.float32)
    return ConvLayer(name=name, kind=kind, weight=weight, bias=bias, stride=stride, relu6=relu6)


@functools.lru_cache(maxsize=2)
def build_mobilenetv2(width: float = 1.0, seed: int = DEFAULT_SEED, num_classes: int = NUM_CLASSES) -> MobileNetV2:
    """Random-weight MobileNetV2 at a width multiplier; deterministic for a given seed.

    Weights do not depend on the input resolution (the network is fully convolutional up to
    the global pool), so one build serves every input size. Cached: treat the arrays as read-only.
    """
    if width <= 0:
        raise ValueError(f"width multiplier must be positive, got {width}")
    rng = np.random.default_rng(seed)
    in_channels = make_divisible(STEM_CHANNELS * width)
    stem = _conv(rng, "stem", "conv", 3, in_channels, 3, 2, relu6=True)

    blocks: list[InvertedResidual] = []
    for expansion, channels, repeats, first_stride in INVERTED_RESIDUAL_SETTINGS:
        out_channels = make_divisible(channels * width)
        for repeat in range(repeats):
            stride = first_stride if repeat == 0 else 1
            name = f"block{len(blocks) + 1}"
            hidden = in_channels * expansion
            layers: list[ConvLayer] = []
            if expansion != 1:
                layers.append(_conv(rng, f"{name}_expand", "conv", in_channels, hidden, 1, 1, relu6=True))
            layers.append(_conv(rng, f"{name}_depthwise", "depthwise", hidden, hidden, 3, stride, relu6=True))
            layers.append(_conv(rng, f"{name}_project", "conv", hidden, out_channels, 1, 1, relu6=False))
            residual = stride == 1 and in_channels == out_channels
            blocks.append(InvertedResidual(name=name, layers=tuple(layers), residual=residual))
            in_channels = out_channels

    head_channels = make_divisible(HEAD_CHANNELS * max(1.0, width))
    head = _conv(rng, "head", "conv", in_channels, head_channels, 1, 1, relu6=True)
    classifier_weight = (rng.standard_normal((num_classes, head_channels)) * np.sqrt(1.0 / head_channels)).astype(
        np.float32
    )
    classifier_bias = np.zeros(num_classes, dtype=np.float32)
    return MobileNetV2(
        width=width,
        seed=seed,
        stem=stem,
        blocks=tuple(blocks),
        head=head,
        classifier_weight=classifier_weight,
        classifier_bias=classifier_bias,
    )


def same_padding(input_size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow 'SAME' padding (before, after) for one spatial axis: extra pixel goes after."""
    output_size = -(-input_size // stride)
    total = max((output_size - 1) * stride + kernel - input_size, 0)
    return total // 2, total - total // 2
