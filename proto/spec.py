"""The job spec: what a user writes in job.yaml, validated into typed models.

Validation happens before anything runs; every error names the file, the line, the
field path and what is wrong (see load_job).
"""

from __future__ import annotations

import math
import re
import string
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator

from farm.proto.names import SHA256_HEX, SandboxBackendName
from farm.proto.accelerators import parse_accelerator
from farm.proto.copying import replaced

MEMORY_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
DEFAULT_RUN_DISK = 4 << 30  # sim.disk when neither it nor sim.memory is given
MAX_RUN_DISK = 16 << 40
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}
_CPUSET_RE = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
Priority = Literal["interactive", "normal", "low"]
# What a script workload's args may name; the sim driver fills exactly these.
SCRIPT_PLACEHOLDERS = ("model", "threads", "batch_size", "input_size", "accelerator", "precision")


def parse_memory(value: Any) -> int:
    """'2g', '512m', '1.5GiB', '1073741824b' -> bytes.

    A bare number is refused, quoted or not: 1024 could mean bytes or MiB, and a guess
    either way has cost a run ("out of memory at the 0 MiB limit"). `b` says bytes.
    """
    if isinstance(value, bool):
        raise ValueError("must be a size like 2g or 512m, not a boolean")
    m = _MEMORY_RE.match(str(value))
    if not m:
        raise ValueError(f"{value!r} is not a memory size; write a number with k, m or g, e.g. 2g or 512m")
    if not m.group(2) and not m.group(3):
        raise ValueError(f"{value} has no unit; did you mean {m.group(1)}m? (write k, m or g, or b for bytes)")
    size = float(m.group(1)) * MEMORY_UNITS[m.group(2).lower()]
    if size < 1 << 20:
        raise ValueError(f"{value!r} is below 1 MiB; did you mean {m.group(1)}m?")
    return int(size)


# The validation context of what a user wrote (a job file, `--set`): there a size must carry its unit.
JOB_FILE: dict[str, Any] = {"written_by": "user"}


def byte_size(value: Any, info: ValidationInfo | None = None) -> int:
    """A size in bytes: an int as the store and the wire carry it, or a size with its unit ('512m').

    In a job file (validated with the JOB_FILE context) every size goes through parse_memory, so a
    bare number is refused there as it always was; everywhere else an int is already bytes."""
    written_by_user = info is not None and info.context is not None and info.context.get("written_by") == "user"
    if isinstance(value, int) and not isinstance(value, bool) and not written_by_user:
        if value < 1 << 20:
            raise ValueError(f"{value} bytes is below 1 MiB")
        return value
    if isinstance(value, float) and not written_by_user:
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return parse_memory(value)


def parse_cpuset(value: str) -> list[int]:
    """'0-1,3' -> [0, 1, 3]; a range that runs backwards ('5-3') or a syntax error is refused."""
    text = str(value).replace(" ", "")
    if not _CPUSET_RE.match(text):
        raise ValueError(f"{value!r} is not a cpuset; write cores like '0', '0-1' or '0,2'")
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"{value!r}: the range {part} runs backwards; write {high}-{low}")
        if high - low > 4096:
            raise ValueError(f"{value!r}: the range {part} names more cores than any host has")
        cores.update(range(low, high + 1))
    return sorted(cores)


def cores_missing(cpuset: str, usable: list[int]) -> list[int]:
    """The cores of a cpuset that a host cannot use (not online, or outside its affinity)."""
    return sorted(set(parse_cpuset(cpuset)) - set(usable))


def script_placeholders(arg: str) -> list[str]:
    """The {names} in one script argument; a brace that is not a placeholder is refused."""
    try:
        fields = [name for _, name, spec, _ in string.Formatter().parse(arg) if name is not None]
    except ValueError as e:
        raise ValueError(f"{arg!r}: {e} (write {{{{ and }}}} for literal braces)") from None
    return fields


def default_cpus(cpus: float | None, threads: int, cores: int | None = None) -> float:
    """The CPU budget of a run: sim.cpus, else one core per runtime thread — on a device, no more
    than the cores it has. The one rule every reader of `threads` uses for a budget."""
    if cpus:
        return float(cpus)
    return float(min(threads, cores) if cores else threads)


def parse_duration(value: Any) -> float:
    """'90s', '10m', '250ms', 30 -> seconds."""
    if isinstance(value, bool):
        raise ValueError("must be a duration like 90s or 10m")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION_RE.match(str(value))
        if not m:
            raise ValueError(f"{value!r} is not a duration; write e.g. 90s, 10m or 1h")
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2).lower() if m.group(2) else None]
    if not math.isfinite(seconds):  # a NaN limit never trips (every comparison is false), an infinite one never ends
        raise ValueError(f"{value!r} is not a finite duration; write e.g. 90s, 10m or 1h")
    if seconds <= 0:
        raise ValueError("must be positive")
    return seconds


class Strict(BaseModel):
    # Unknown fields are rejected: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, defer_build=True)


MAX_NAME_CHARS = 200  # job, model and family names: shown in every table and progress line


def _bounded_name(v: str | None) -> str | None:
    if v is not None and len(v) > MAX_NAME_CHARS:
        raise ValueError(f"is {len(v):,} characters long; a name is at most {MAX_NAME_CHARS}")
    return v


MAX_INPUT_VALUE_ELEMENTS = 262_144  # a value (or .npy file) given inline: 1 MiB of float32; larger inputs are random
MAX_INPUT_FILE_BYTES = 4 * 1024 * 1024  # a .npy file's size on disk, checked before it is read


def _input_value_elements(value: Any, depth: int = 0) -> int:
    """Elements of a number or nested list of numbers; ValueError names what is wrong."""
    if depth > 8:
        raise ValueError("value nests deeper than 8 dimensions")
    if isinstance(value, bool) or isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"value {value} is not a finite number")
        return 1
    if isinstance(value, list):
        total = 0
        for item in value:
            total += _input_value_elements(item, depth + 1)
            if total > MAX_INPUT_VALUE_ELEMENTS:
                raise ValueError(f"value has more than {MAX_INPUT_VALUE_ELEMENTS} elements; use `random` for large inputs")
        return total
    raise ValueError(f"value must be a number or a list of numbers, got {type(value).__name__}")


def input_value_shape(value: Any) -> list[int]:
    """The shape of a number ([]) or of regular nested lists; ValueError for ragged ones."""
    if not isinstance(value, list):
        return []
    if not value:
        raise ValueError("value is an empty list")
    shapes = [input_value_shape(item) for item in value]
    if any(shape != shapes[0] for shape in shapes):
        raise ValueError("value is ragged: its lists differ in length")
    return [len(value), *shapes[0]]


class RandomRange(Strict):
    low: float = Field(description="Smallest value (inclusive)")
    high: float = Field(description="Largest value (inclusive for integer inputs, exclusive for float ones)")

    @model_validator(mode="after")
    def _ordered(self) -> "RandomRange":
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            raise ValueError(f"low and high must be finite numbers, got low={self.low}, high={self.high}")
        if self.low > self.high:
            raise ValueError(f"low ({self.low:g}) is above high ({self.high:g})")
        return self


class InputSpec(Strict):
    """What one model input is fed: a value, a .npy file, random numbers in a range, and/or a shape."""

    value: Any = Field(None, description="A number (filled to the input's shape) or nested lists of numbers")
    file: str | None = Field(None, description="A .npy file (relative to the job file, inside its folder); read "
                                                "when the job is submitted, its values kept with the job")
    random: RandomRange | None = Field(None, description="Uniform random values in [low, high]")
    shape: list[int] | None = Field(None, description="The input's full shape (as workload.input_shapes)")

    @field_validator("value")
    @classmethod
    def _numbers(cls, v: Any) -> Any:
        if v is not None:
            _input_value_elements(v)
            input_value_shape(v)
        return v

    @field_validator("shape")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(d <= 0 for d in v)):
            raise ValueError(f"every dimension must be a positive integer, got {v}")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "InputSpec":
        if self.random is not None and (self.value is not None or self.file is not None):
            raise ValueError("give one of value, file or random, not random with another")
        if self.value is None and self.file is None and self.random is None and self.shape is None:
            raise ValueError("give value, file, random or shape")
        return self


def _check_input_shapes(v: dict[str, list[int]]) -> dict[str, list[int]]:
    for name, shape in v.items():
        if not shape or any(d <= 0 for d in shape):
            raise ValueError(f"input {name!r}: every dimension must be a positive integer, got {shape}")
    return v


def _check_input_names(v: dict[str, "InputSpec"]) -> dict[str, "InputSpec"]:
    for name in v:
        if not 0 < len(name) <= 1000 or any(ord(c) < 32 or 0x7f <= ord(c) < 0xa0 for c in name):
            raise ValueError(f"input name {name[:80]!r} must be 1-1000 characters without control characters")
    return v


class ModelEntry(Strict):
    path: str = Field(description="Model file, or a glob such as models/*.tflite; relative to the job file")
    name: str | None = Field(None, description="Display name; defaults to the file name without extension")
    family: str | None = Field(None, description="Models of one family share a calibration where the data says so")
    inputs: dict[str, InputSpec] = Field(
        default_factory=dict,
        description="This model's own workload.inputs, by input name (the workload's are defaults; a name given here "
                    "replaces the workload's for this model)")
    input_shapes: dict[str, list[int]] = Field(
        default_factory=dict,
        description="This model's own workload.input_shapes, by input name (replacing the workload's for these names)")

    _names = field_validator("name", "family")(_bounded_name)
    _shapes = field_validator("input_shapes")(_check_input_shapes)
    _input_names = field_validator("inputs")(_check_input_names)

    @model_validator(mode="after")
    def _one_shape_per_input(self) -> "ModelEntry":
        both = sorted(name for name, spec in self.inputs.items() if spec.shape is not None and name in self.input_shapes)
        if both:
            raise ValueError(f"input(s) {both} have a shape in both input_shapes and inputs; give it once")
        return self


class ImagePreprocess(Strict):
    """How an image file of a dataset becomes one input sample: resized, scaled, normalised, laid out, cast."""

    size: list[int] = Field(description="[height, width] the image is resized to")
    layout: Literal["nchw", "nhwc"] = Field("nchw", description="Channels first (ONNX's usual) or last (LiteRT's)")
    scale: float = Field(1 / 255, gt=0, allow_inf_nan=False, description="Pixel values 0..255 are multiplied by this first")
    mean: list[float] = Field(default_factory=lambda: [0.0, 0.0, 0.0], description="Subtracted per channel (after scale)")
    std: list[float] = Field(default_factory=lambda: [1.0, 1.0, 1.0], description="Divided per channel (after mean)")
    dtype: Literal["float32", "float16", "uint8", "int8"] = Field("float32", description="The sample's dtype")
    channels: Literal[1, 3] = Field(3, description="3: RGB, 1: grey")

    @field_validator("size")
    @classmethod
    def _size(cls, v: list[int]) -> list[int]:
        if len(v) != 2 or any(not 0 < d <= 4096 for d in v):
            raise ValueError(f"give [height, width], each 1 to 4096, got {v}")
        return v

    @model_validator(mode="after")
    def _per_channel(self) -> "ImagePreprocess":
        for name in ("mean", "std"):
            values = getattr(self, name)
            if len(values) != self.channels or not all(math.isfinite(x) for x in values):
                raise ValueError(f"{name} needs {self.channels} finite number(s), one per channel, got {values}")
        if any(x == 0 for x in self.std):
            raise ValueError("std must not hold 0")
        return self


class AccuracyThresholds(Strict):
    """Where a run's outputs disagree too much: the run fails as `accuracy` (its timings are kept)."""

    max_abs_error: float | None = Field(None, ge=0, allow_inf_nan=False, description="Largest allowed |output - reference|")
    min_cosine: float | None = Field(None, ge=-1, le=1, description="Smallest allowed cosine similarity to the reference")
    min_snr_db: float | None = Field(None, allow_inf_nan=False, description="Smallest allowed SNR against the reference, dB")
    min_top1_agreement: float | None = Field(None, ge=0, le=1, description="Share of samples whose top-1 matches the reference's")
    min_accuracy_top1: float | None = Field(None, ge=0, le=1, description="Smallest allowed top-1 accuracy against the labels")


class DatasetSpec(Strict):
    """Real inputs for every target (issue 30): the model runs on each sample after the timed loop, and the run
    records its outputs' digests and summaries, agreement with a reference and, with labels, accuracy."""

    path: str = Field(description="A folder of samples (.npy, .npz or images), one .npz/.npy file whose first axis "
                                  "is the sample, or a .tar (.tar.gz, .tgz, .tar.bz2, .tar.xz) of sample files, read "
                                  "like a folder; relative to the job file, inside its folder")
    input: str | None = Field(None, description="The model input the samples feed (.npy and images); default: the "
                                                "model's only input. A .npz names its inputs by key")
    labels: str | None = Field(None, description="A .npy (or .txt, one per line) of class ids, one per sample")
    reference: str | None = Field(None, description="What outputs are compared with: a float .onnx model (run on the "
                                                    "CPU where the job is submitted, once for every target) or a .npz "
                                                    "of reference outputs by output name, first axis the sample")
    output: str | None = Field(None, description="The output top-k and accuracy read (default: the model's first)")
    image: ImagePreprocess | None = Field(None, description="How image files become samples")
    limit: int | None = Field(None, gt=0, le=100_000, description="Use the first N samples only")
    thresholds: AccuracyThresholds = Field(default_factory=AccuracyThresholds)
    # set where the job is submitted: the samples, labels and reference outputs packed (farm's own, never written)
    packed: str | None = Field(None, description="Set by farm when the job is submitted; do not write it")
    # set where a controller takes the job: the packed dataset's sha256 in its artifact store (agents fetch it)
    artifact: Annotated[str, StringConstraints(pattern=SHA256_HEX.pattern)] | None = Field(
        None, description="Set by farm when a job is submitted to a controller (the packed dataset as an uploaded "
                          "artifact, by sha256); do not write it")


class BenchmarkWorkload(Strict):
    """Built-in benchmark for .tflite (LiteRT) and .onnx (ONNX Runtime) files."""

    type: Literal["benchmark"] = "benchmark"
    iterations: int = Field(50, gt=0, description="Timed inferences per run")
    warmup: int = Field(5, ge=0, description="Untimed inferences before the timed ones (the first is reported apart)")
    input_shapes: dict[str, list[int]] = Field(
        default_factory=dict,
        description="Shapes for inputs with dynamic dimensions, by input name",
    )
    use_xnnpack: bool = Field(True, description="TFLite only: use the XNNPACK delegate")
    inputs: dict[str, InputSpec] = Field(
        default_factory=dict,
        description="What each input is fed, by input name: {value: 16000}, {file: x.npy}, {random: {low, high}} "
                    "or {shape: [...]}; inputs not named get random values (a sample-rate input 16000, an integer "
                    "attention mask 1, token type ids 0, position ids 0..n, token ids random below vocab_size)",
    )
    dataset: DatasetSpec | None = Field(
        None, description="Real inputs and their expected outputs: every run also runs the model on each sample and "
                          "records agreement with a reference and accuracy (docs/how-to/accuracy.md)")
    vocab_size: int | None = Field(
        None, ge=2, le=1 << 31,
        description="Token-id inputs (input_ids, token_ids, ids) not named in inputs get random ids in "
                    "[0, vocab_size - 1]; unset: [0, 127], which every real vocabulary holds")
    cooldown_c: float | None = Field(
        None, gt=0, lt=120, allow_inf_nan=False,
        description="Phones: before each run, wait until the SoC is below this temperature in °C (default: the device "
                    "entry's thermal_limit_c, 45); what was waited is recorded")
    sustained_s: float | None = Field(
        None, gt=0, le=3600, allow_inf_nan=False,
        description="Phones: repeat the timed loop for this many seconds; the run reports the last window (sustained) "
                    "and keeps every window's latency and temperature, the first and last apart (burst vs sustained)")
    android_mode: Literal["shell", "app"] = Field(
        "shell", description="Phones: `shell` runs the benchmark_model binary over adb; `app` runs TensorFlow's "
                             "benchmark APK as a foreground activity (am start, results from logcat), as an app is "
                             "scheduled; every run records its mode")
    op_profiling: bool = Field(False, description="Also time every operator: phones pass --enable_op_profiling=true "
                                                  "to benchmark_model; the sim traces ONNX models with ONNX Runtime's "
                                                  "profiler in a separate pass after the timed loop")

    _shapes = field_validator("input_shapes")(_check_input_shapes)
    _input_names = field_validator("inputs")(_check_input_names)

    @model_validator(mode="after")
    def _one_shape_per_input(self) -> "BenchmarkWorkload":
        both = sorted(name for name, spec in self.inputs.items() if spec.shape is not None and name in self.input_shapes)
        if both:
            raise ValueError(f"input(s) {both} have a shape in both input_shapes and inputs; give it once")
        return self

    def for_model(self, entry: "ModelEntry") -> "BenchmarkWorkload":
        """This workload as one model entry runs it: the entry's inputs and input_shapes replace the workload's,
        name by name (a shape the entry gives wins over a shape the workload gives in either place)."""
        if not entry.inputs and not entry.input_shapes:
            return self
        inputs = {n: s for n, s in self.inputs.items() if not (s.shape is not None and n in entry.input_shapes)}
        inputs.update(entry.inputs)
        shapes = {n: s for n, s in self.input_shapes.items()
                  if not (n in entry.inputs and entry.inputs[n].shape is not None)}
        shapes.update(entry.input_shapes)
        return replaced(self, inputs=inputs, input_shapes=shapes)

    def shape_overrides(self) -> dict[str, list[int]]:
        """Every input's explicit shape: input_shapes and inputs.NAME.shape together."""
        from_values = {n: input_value_shape(s.value) for n, s in self.inputs.items()
                       if s.shape is None and isinstance(s.value, list)}  # a whole tensor given: its shape is the input's
        return {**from_values, **self.input_shapes,
                **{n: list(s.shape) for n, s in self.inputs.items() if s.shape is not None}}


class ScriptWorkload(Strict):
    """A user's own command, timed as a whole (the original tool's COMMAND/SCRIPT/DIR/PIPREQUIREMENTS)."""

    type: Literal["script"]
    command: str = Field("python", description="Program that runs the script, e.g. python or bash")
    script: str | None = Field(None, description="Script file, relative to dir")
    args: list[str] = Field(default_factory=list, description="Arguments; {model}, {threads}, {batch_size}, {input_size}, {accelerator} (cpu, cuda, ...) "
                                                                   "and {precision} (fp32, fp16, int8) are filled in")
    dir: str = Field(".", description="Working directory, relative to the job file")
    pip_requirements: list[str] = Field(default_factory=list, description="Installed into a cached virtual environment before the run")

    @field_validator("args")
    @classmethod
    def _known_placeholders(cls, v: list[str]) -> list[str]:
        for arg in v:
            for name in script_placeholders(arg):
                if name not in SCRIPT_PLACEHOLDERS:
                    known = ", ".join(f"{{{p}}}" for p in SCRIPT_PLACEHOLDERS)
                    raise ValueError(f"{arg!r}: unknown placeholder {{{name}}}; use {known}")
        return v


Workload = Annotated[Union[BenchmarkWorkload, ScriptWorkload], Field(discriminator="type")]


def _once_each(v: list[Any]) -> list[Any]:
    """A matrix value listed twice would run the same cell twice, silently: `repeats` is for that."""
    twice = sorted({x for x in v if v.count(x) > 1}, key=str)
    if twice:
        raise ValueError(f"{', '.join('null' if x is None else str(x) for x in twice)} listed more than once; each value is one cell of the "
                         "matrix (use `repeats: N` to run a cell again)")
    return v


class Matrix(Strict):
    threads: list[int] = Field(default_factory=lambda: [1], description="Runtime threads")
    batch_sizes: list[int] = Field(default_factory=lambda: [1], description="Batch dimension of every input")
    input_sizes: list[int | None] = Field(
        default_factory=lambda: list[int | None]([None]),
        description="Square spatial size for image inputs (null keeps the model's own)",
    )

    cpus: list[float | None] = Field(
        default_factory=lambda: list[float | None]([None]),
        description="Sim CPU budgets to sweep, in cores like sim.cpus (null: the run's thread count); sim targets "
                    "only, and not together with sim.cpus",
    )

    accelerators: list[str] = Field(
        default_factory=lambda: ["cpu"],
        description="Compute units to run on, each UNIT or UNIT:PRECISION: cpu, gpu, npu, dsp or a family's own "
                    "(cuda, tensorrt, dla, nnapi, qnn, hexagon); precision fp32 (default), fp16 or int8. A device "
                    "runs the cells its type lists units for; the sim is a CPU",
    )

    @field_validator("accelerators")
    @classmethod
    def _units(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must list at least one compute unit, e.g. [cpu]")
        return _once_each([str(parse_accelerator(x)) for x in v])

    @field_validator("cpus")
    @classmethod
    def _budgets(cls, v: list[float | None]) -> list[float | None]:
        if not v:
            raise ValueError("must list at least one CPU budget (null: one core per thread)")
        for x in v:
            if x is not None and not (0 < x < 4096):  # also refuses NaN and infinity
                raise ValueError(f"every CPU budget must be a number of cores above 0, got {x}")
        if len(set(v)) != len(v):
            raise ValueError("a CPU budget is listed twice; each is one cell of the sweep")
        return v

    @field_validator("threads", "batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("must list at least one value")
        for x in v:
            if x < 1:
                raise ValueError(f"every value must be at least 1, got {x}")
        return _once_each(v)

    @field_validator("input_sizes")
    @classmethod
    def _sizes(cls, v: list[int | None]) -> list[int | None]:
        if not v:
            raise ValueError("must list at least one value (null keeps the model's own size)")
        for x in v:
            if x is not None and x < 1:
                raise ValueError(f"every size must be at least 1, got {x}")
        return _once_each(v)


_APT_PACKAGE_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]*(:[a-z0-9-]+)?(=[A-Za-z0-9.+:~-]+)?$")
MAX_BUILD_ITEMS = 200
MAX_BUILD_ITEM_CHARS = 4096


def inside_path(value: str, what: str) -> str:
    """A relative path that stays inside its folder (no absolute path, no `..`), for files the build reads."""
    text = str(value).strip()
    parts = text.replace("\\", "/").split("/")
    if not text or text.startswith("/") or ".." in parts or "\0" in text:
        raise ValueError(f"{value!r}: {what} must be a path inside workload.dir (relative, without ..)")
    return text


def _local_reference(requirement: str) -> bool:
    """A requirement that points pip at a file: a `file:` URL (`pkg @ file:///...`) or a path."""
    return "file:" in requirement.lower() or any(word.startswith(("/", "./", "../", "~", "\\"))
                                                 for word in requirement.replace("@", " ").split())


class SimBuild(Strict):
    """An image the docker backend builds for the job, cached by the hash of all that goes into it.

    Either steps (base, apt, pip, run) or a Dockerfile; its files come from workload.dir.
    """

    base: str | None = Field(None, description="Image the steps start from (default: farm's own base image); it must be on the engine, nothing is pulled")
    apt: list[str] = Field(default_factory=list, description="Debian packages, unpacked into /opt/farm-build/apt (needs the network at build time)")
    pip: list[str] = Field(default_factory=list, description="pip requirements, installed into /opt/farm-build/site-packages (on PYTHONPATH in the run)")
    pip_wheels: str | None = Field(None, description="Folder inside workload.dir holding wheels: pip installs from it only (--no-index), offline")
    run: list[str] = Field(default_factory=list, description="Shell commands run once at build time, in workload.dir, after apt and pip (Auptimizer's PRERUN)")
    dockerfile: str | None = Field(None, description="A Dockerfile inside workload.dir, built with workload.dir as its context (instead of the steps)")
    network: bool | None = Field(None, description="Network during the build; default: on only to fetch apt packages or pip packages from an index")
    timeout: float = Field(1800, description="The build's time limit, e.g. 90s or 30m; a build over it fails as job")

    @field_validator("timeout", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("apt")
    @classmethod
    def _apt_names(cls, v: list[str]) -> list[str]:
        if len(v) > MAX_BUILD_ITEMS:
            raise ValueError(f"at most {MAX_BUILD_ITEMS} packages")
        for name in v:
            if not _APT_PACKAGE_RE.match(name):
                raise ValueError(f"{name!r} is not a Debian package name (like libgomp1 or curl=7.88.1-10)")
        return v

    @field_validator("pip")
    @classmethod
    def _pip_requirements(cls, v: list[str]) -> list[str]:
        if len(v) > MAX_BUILD_ITEMS:
            raise ValueError(f"at most {MAX_BUILD_ITEMS} requirements")
        for req in v:
            if not req.strip() or req.lstrip().startswith("-") or any(c in req for c in "\n\r\0"):
                raise ValueError(f"{req!r} is not a requirement; write one like numpy==1.26.4 (pip options are not taken)")
            if _local_reference(req):  # the build host's files (issue 33): an env file's `file:///etc/shadow` line
                raise ValueError(f"{req[:200]!r} names a file on the building host; farm installs packages by name, "
                                 "and files only from workload.dir (sim.build.pip_wheels)")
        return v

    @field_validator("run")
    @classmethod
    def _commands(cls, v: list[str]) -> list[str]:
        if len(v) > MAX_BUILD_ITEMS:
            raise ValueError(f"at most {MAX_BUILD_ITEMS} commands")
        for command in v:
            if not command.strip() or "\0" in command or len(command) > MAX_BUILD_ITEM_CHARS:
                raise ValueError(f"{command[:60]!r}: a command must be non-empty, without NUL, at most {MAX_BUILD_ITEM_CHARS} characters")
        return v

    @field_validator("dockerfile", "pip_wheels")
    @classmethod
    def _inside(cls, v: str | None) -> str | None:
        return None if v is None else inside_path(v, "the file")

    @model_validator(mode="after")
    def _one_way(self) -> "SimBuild":
        if self.dockerfile and (self.base or self.apt or self.pip or self.pip_wheels or self.run):
            raise ValueError("give either a dockerfile or steps (base, apt, pip, pip_wheels, run), not both: "
                             "the Dockerfile's FROM and RUN lines say the rest")
        if not (self.dockerfile or self.base or self.apt or self.pip or self.run):
            raise ValueError("nothing to build: give base, apt, pip, run or dockerfile (or drop sim.build)")
        if self.pip_wheels and not self.pip:
            raise ValueError("pip_wheels names where to install from; list the packages in pip too")
        return self


_IMAGE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._/-]{0,199}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?")


class SimBudget(Strict):
    """The local sandbox that stands in for a device: its CPU and memory budget."""

    cpus: float | None = Field(None, gt=0, description="CPU budget in cores: a whole number is that many whole cores (a cpuset), a fraction a CFS quota (0.5 = half a core); default: the run's thread count")
    cpuset: str | None = Field(None, description="Cores the run may use, e.g. '0' or '0-1'")
    memory: int | None = Field(None, description="Memory limit like 2g or 512m, swap off; default: none")
    disk: int | None = Field(None, description="Quota on the files a run writes into its run directory, like "
                                               "512m or 2g (a tmpfs, so it counts within sim.memory too); "
                                               "default: sim.memory, or 4g without one")
    backend: Literal["auto", SandboxBackendName] = "auto"
    image: str | None = Field(None, description="docker backend: the user's image to run in, as it is: its own Python and packages run the script (farm's harness, limits and sampler work from outside it); it must be on the engine, nothing is pulled")
    build: SimBuild | None = Field(None, description="docker backend: build the image to run in (see SimBuild)")
    writable_root: bool = Field(False, description="docker backend: the container's root file system writable "
                                                   "(still as the run user, thrown away with the container); "
                                                   "default: read-only, with /tmp, /var/tmp, /dev/shm and the run "
                                                   "directory writable")
    sample_interval_ms: float = Field(50, ge=5, le=10_000, description="Telemetry sampling period")
    on_contention: Literal["retry", "flag", "fail"] = Field(
        "retry", description="A run whose cores other work used: retry (up to 2 more times, then keep it flagged), "
                             "flag (keep it, marked), or fail (as infrastructure)")
    quiet_wait: float = Field(0, ge=0, le=3600, description="Seconds to wait, at most, for the run's cores to be "
                                                            "quiet before it starts (0: start at once)")
    exclusive: bool = Field(False, description="Ask the kernel for the run's cores alone (a cgroup v2 cpuset "
                                               "partition); best effort, what was granted is recorded")

    @model_validator(mode="after")
    def _build_needs_docker(self) -> "SimBudget":
        if self.build is not None and self.backend != "docker":
            raise ValueError("build: an image is built only for backend: docker; set sim.backend: docker")
        if self.writable_root and self.backend != "docker":
            raise ValueError("writable_root: only a container has a root file system of its own; set "
                             "sim.backend: docker")
        if self.image is not None and self.backend != "docker":
            raise ValueError("image: a run in an image needs backend: docker; set sim.backend: docker")
        if self.image is not None and not _IMAGE_NAME_RE.fullmatch(self.image):
            raise ValueError(f"image: {self.image[:80]!r} is not a Docker image name (like myimage:1.0)")
        if self.build is not None and self.image and (self.build.dockerfile or self.build.base or self.build.apt):
            raise ValueError("build: with image, only pip, pip_wheels and run steps (installed into a venv of the "
                             "image's own Python); a dockerfile, base or apt make an image of their own: "
                             "build.base names the image a build starts from")
        return self

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, v: Any, info: ValidationInfo) -> int | None:
        return None if v is None else byte_size(v, info)

    @field_validator("disk", mode="before")
    @classmethod
    def _disk(cls, v: Any, info: ValidationInfo) -> int | None:
        size = None if v is None else byte_size(v, info)
        if size is not None and size > MAX_RUN_DISK:
            raise ValueError(f"{str(v)[:40]!r} is over {MAX_RUN_DISK >> 40} TiB; a run directory's quota is a "
                             "tmpfs held in memory: write a size like 512m or 2g")
        return size

    def disk_quota(self) -> int:
        """The run directory's quota in bytes: sim.disk, else sim.memory, else DEFAULT_RUN_DISK."""
        return self.disk or self.memory or DEFAULT_RUN_DISK

    @field_validator("cpuset")
    @classmethod
    def _cpuset(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parse_cpuset(v)
        return str(v).replace(" ", "")


class Timeouts(Strict):
    run: float = Field(600, description="One run, e.g. 90s or 10m; a run over it fails as timeout")
    job: float | None = Field(None, description="The whole job; remaining tasks are canceled")

    @field_validator("run", "job", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float | None:
        return None if v is None else parse_duration(v)


class JobSpec(Strict):
    name: str | None = Field(None, description="A label for `farm jobs`; defaults to the file name")
    models: list[Union[str, ModelEntry]] = Field(description="Model files or globs")

    _name = field_validator("name")(_bounded_name)
    workload: Workload = Field(default_factory=BenchmarkWorkload)
    matrix: Matrix = Field(default_factory=Matrix)
    repeats: int = Field(1, ge=1, le=1000, description="Runs of every matrix cell")
    targets: list[str] = Field(default_factory=lambda: ["sim"], description="Where to run: sim, a device name, type:DEVICE_TYPE or tag:TAG; every device run gets a sim twin with that device's budget")
    sim: SimBudget = Field(default_factory=SimBudget)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    priority: Priority = "normal"
    predict_for: list[str] = Field(
        default_factory=list,
        description="Calibrated devices to predict every completed run for, from the sim alone (see `farm calibrations`)",
    )

    def entry(self, index: int) -> "ModelEntry":
        raw = self.models[index]
        return raw if isinstance(raw, ModelEntry) else ModelEntry(path=raw)

    def workload_for(self, index: int) -> "Workload":
        """The workload models[index] runs: the job's, with that entry's own inputs and input_shapes."""
        if isinstance(self.workload, BenchmarkWorkload):
            return self.workload.for_model(self.entry(index))
        return self.workload

    @model_validator(mode="after")
    def _inputs_need_the_benchmark(self) -> "JobSpec":
        for index, raw in enumerate(self.models):
            if isinstance(raw, ModelEntry) and (raw.inputs or raw.input_shapes) and not isinstance(self.workload, BenchmarkWorkload):
                raise ValueError(f"models[{index}]: inputs and input_shapes feed the built-in benchmark; a script "
                                 "workload reads its own inputs")
        return self

    @field_validator("workload", mode="before")
    @classmethod
    def _benchmark_by_default(cls, v: Any) -> Any:
        # `workload: {iterations: 5}` is the built-in benchmark, as the field's default is
        return {"type": "benchmark", **v} if isinstance(v, dict) and "type" not in v else v

    @field_validator("models")
    @classmethod
    def _not_empty(cls, v: list[Union[str, ModelEntry]]) -> list[Union[str, ModelEntry]]:
        if not v:
            raise ValueError("list at least one model file or glob")
        return v

    @model_validator(mode="after")
    def _build_files_need_a_folder(self) -> "JobSpec":
        build = self.sim.build
        if build is not None and (build.dockerfile or build.pip_wheels) and not isinstance(self.workload, ScriptWorkload):
            raise ValueError("sim.build: dockerfile and pip_wheels are read from workload.dir, which only a script "
                             "workload has; use steps (base, apt, pip, run) with the benchmark")
        return self

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("list at least one target, e.g. [sim]")
        for t in v:
            if not t.strip() or t in ("type:", "tag:"):
                raise ValueError(f"{t!r} is not a target: write sim, a device name, type:NAME or tag:NAME")
        return v


def job_json_schema() -> dict[str, Any]:
    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "farm job"
    return schema


def job_file_text(spec: JobSpec) -> str:
    """A spec farm built itself as the job file that gives it back (what was set; sizes with their unit, as
    a job file must write them): the text stored with the job, like a user's file."""
    document = spec.model_dump(mode="json", exclude_unset=True)
    sim = document.get("sim") or {}
    for size in ("memory", "disk"):
        if isinstance(sim.get(size), int):
            sim[size] = f"{sim[size]}b"
    return str(yaml.safe_dump(document))
