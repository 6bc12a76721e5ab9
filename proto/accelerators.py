"""Compute units: where on a device a model runs (issue 29), and the precision it may use there.

A job's `matrix.accelerators` lists cells as `UNIT` or `UNIT:PRECISION` (`cpu`, `gpu:fp16`,
`tensorrt:int8`). A unit is a class (`gpu`, `npu`, `dsp`) or a family's own spelling (`cuda`,
`tensorrt`, `dla`, `nnapi`, `qnn`, `hexagon`); a device type lists the units it has, in order of
preference, and a class resolves to the first of them in that class. The sim is a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

# unit -> its class; a class is a unit of its own too (the device picks its first unit of the class)
UNIT_CLASS: dict[str, str] = {
    "cpu": "cpu", "gpu": "gpu", "npu": "npu", "dsp": "dsp",
    "cuda": "gpu", "tensorrt": "gpu",  # NVIDIA: ONNX Runtime's CUDA provider, TensorRT (trtexec or ORT's provider)
    "dla": "npu",  # a Jetson's deep-learning accelerator (TensorRT --useDLACore)
    "nnapi": "npu", "qnn": "npu",  # Android: NNAPI, Qualcomm's QNN delegate
    "hexagon": "dsp",  # Qualcomm's Hexagon delegate
}
PRECISIONS = ("fp32", "fp16", "int8")
# What each unit may be asked to compute in (its tools' flags: --fp16/--int8, --gpu_precision_loss_allowed, ...)
UNIT_PRECISIONS: dict[str, tuple[str, ...]] = {
    "cpu": ("fp32",), "gpu": ("fp32", "fp16"), "npu": ("fp32", "fp16", "int8"), "dsp": ("int8",),
    "cuda": ("fp32", "fp16"), "tensorrt": ("fp32", "fp16", "int8"), "dla": ("fp16", "int8"),
    "nnapi": ("fp32", "fp16", "int8"), "qnn": ("fp16", "int8"), "hexagon": ("int8",),
}
SIM_UNITS = ("cpu",)  # the sim is a CPU: a gpu cell's sim twin runs there, and its pair says what it is


@dataclass(frozen=True)
class Accelerator:
    """One cell of the accelerator axis: a unit and the precision it may use."""

    unit: str
    precision: str = "fp32"

    def __str__(self) -> str:
        return self.unit if self.precision == default_precision(self.unit) else f"{self.unit}:{self.precision}"

    @property
    def on_cpu(self) -> bool:
        return self.unit == "cpu"

    def resolved(self, device_units: list[str]) -> "Accelerator | None":
        """This cell on a device with these units: a class becomes the device's first unit of it; None
        when the device has no such unit or the unit cannot use the precision."""
        if self.unit in device_units:
            unit = self.unit
        elif self.unit in ("gpu", "npu", "dsp"):
            unit = next((u for u in device_units if UNIT_CLASS.get(u) == self.unit), "")
        else:
            unit = ""
        if not unit or self.precision not in UNIT_PRECISIONS[unit]:
            return None
        return Accelerator(unit, self.precision)


def default_precision(unit: str) -> str:
    """fp32 where the unit takes it, else its first precision (a DLA computes in fp16, Hexagon in int8)."""
    return "fp32" if "fp32" in UNIT_PRECISIONS[unit] else UNIT_PRECISIONS[unit][0]


def parse_accelerator(text: str) -> Accelerator:
    """`cuda`, `gpu:fp16`, `tensorrt:int8` -> an Accelerator; ValueError naming what is wrong."""
    unit, _, precision = str(text).strip().lower().partition(":")
    if unit not in UNIT_CLASS:
        raise ValueError(f"{text!r}: unknown compute unit {unit!r}; use one of {', '.join(UNIT_CLASS)}")
    precision = precision or default_precision(unit)
    if precision not in PRECISIONS:
        raise ValueError(f"{text!r}: unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if precision not in UNIT_PRECISIONS[unit]:
        raise ValueError(f"{text!r}: {unit} cannot be asked for {precision}; it takes "
                         f"{', '.join(UNIT_PRECISIONS[unit])}")
    return Accelerator(unit, precision)


def why_not(cell: Accelerator, device_units: list[str], device: str) -> str:
    """Why a device cannot run a cell, for a person."""
    if cell.resolved(device_units) is None and (cell.unit in device_units or any(
            UNIT_CLASS.get(u) == cell.unit for u in device_units)):
        return f"{device} has {cell.unit}, but not at {cell.precision}"
    return f"{device} has no {cell.unit} (its units: {', '.join(device_units) or 'cpu'})"
