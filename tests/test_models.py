"""farm.models: generated MobileNetV2 in both runtimes, model facts, unsupported ops, fixtures."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import yaml
from ai_edge_litert.interpreter import Interpreter

from farm.models.facts import ModelError, find_unsupported_ops, inspect_model, runtime_refusal
from farm.model_generators.generate import GeneratedModel, generate_examples, write_manifest, write_tiny_onnx, write_tiny_tflite
from farm.model_generators.mobilenetv2 import WIDTHS, build_mobilenetv2, make_divisible, model_name
from farm.model_generators.zoo import copy_zoo, zoo_models
from model_fixtures import write_corrupt_onnx, write_corrupt_tflite, write_unsupported_op_onnx, write_unsupported_op_tflite

REAL_MOBILENETV2_PARAMS = 3_500_000  # the paper's 3.4M; Keras/torchvision count 3.5M


def run_tflite(path: Path, nhwc_input: np.ndarray) -> np.ndarray:
    interpreter = Interpreter(model_path=str(path), num_threads=2)
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], nhwc_input)
    interpreter.invoke()
    return np.array(interpreter.get_tensor(interpreter.get_output_details()[0]["index"]))


def run_onnx(path: Path, nchw_input: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.array(session.run(None, {session.get_inputs()[0].name: nchw_input})[0])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[float, int, str], GeneratedModel]:
    dest = tmp_path_factory.mktemp("generated")
    models = generate_examples(dest, widths=(0.5, 1.0), input_sizes=(128, 224), zoo=False)
    return {(m.width or 0.0, m.input_size or 0, m.format): m for m in models}


@pytest.mark.parametrize("width", [0.5, 1.0])
def test_generated_mobilenetv2_runs_in_both_runtimes(
    generated: dict[tuple[float, int, str], GeneratedModel], width: float
) -> None:
    image = np.random.default_rng(7).random((1, 3, 128, 128), dtype=np.float32)
    tflite_out = run_tflite(generated[(width, 128, "tflite")].path, np.ascontiguousarray(image.transpose(0, 2, 3, 1)))
    onnx_out = run_onnx(generated[(width, 128, "onnx")].path, image)
    for out in (tflite_out, onnx_out):
        assert out.shape == (1, 1000)
        assert np.isfinite(out).all()
        assert out.std() > 1e-3  # the random network still separates classes
    # Same weights, same TF 'SAME' padding: the two formats compute the same function.
    np.testing.assert_allclose(tflite_out, onnx_out, rtol=1e-3, atol=1e-4)


def test_width_one_r224_has_real_mobilenetv2_size(generated: dict[tuple[float, int, str], GeneratedModel]) -> None:
    for fmt in ("tflite", "onnx"):
        facts = inspect_model(generated[(1.0, 224, fmt)].path)
        assert facts.param_count is not None
        assert abs(facts.param_count - REAL_MOBILENETV2_PARAMS) <= 0.05 * REAL_MOBILENETV2_PARAMS, facts.param_count
    tflite_facts = inspect_model(generated[(1.0, 224, "tflite")].path)
    assert tflite_facts.op_types == {"CONV_2D": 35, "DEPTHWISE_CONV_2D": 17, "ADD": 10, "MEAN": 1, "FULLY_CONNECTED": 1}
    assert tflite_facts.inputs[0].shape == [1, 224, 224, 3]
    assert tflite_facts.outputs[0].shape == [1, 1000]
    onnx_facts = inspect_model(generated[(1.0, 224, "onnx")].path)
    assert onnx_facts.op_types["Conv"] == 52 and onnx_facts.op_types["Clip"] == 35
    # the ONNX examples take any batch (a batch sweep runs); the TFLite ones are resized by LiteRT
    assert onnx_facts.inputs[0].shape == ["batch", 3, 224, 224] and onnx_facts.inputs[0].dtype == "float32"


def test_larger_width_has_more_params(generated: dict[tuple[float, int, str], GeneratedModel]) -> None:
    counts = [build_mobilenetv2(width).param_count for width in WIDTHS]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    small = inspect_model(generated[(0.5, 224, "onnx")].path).param_count
    large = inspect_model(generated[(1.0, 224, "onnx")].path).param_count
    assert small is not None and large is not None and small < large
    # Resolution changes compute, never the weights.
    assert (
        inspect_model(generated[(0.5, 128, "tflite")].path).param_count
        == inspect_model(generated[(0.5, 224, "tflite")].path).param_count
    )


def test_model_names() -> None:
    assert model_name(0.5, 160) == "mobilenetv2_w0.5_r160"
    assert model_name(1.0, 224) == "mobilenetv2_w1.0_r224"
    assert model_name(0.35, 96) == "mobilenetv2_w0.35_r96"


def test_make_divisible_matches_the_reference_rounding() -> None:
    assert make_divisible(32 * 0.35) == 16  # 11.2 rounds up to the 8-floor, then +8 for the 10% rule
    assert make_divisible(32 * 1.3) == 40
    assert make_divisible(1280 * 1.4) == 1792
    assert make_divisible(16 * 0.75) == 16


def test_dynamic_batch(tmp_path: Path) -> None:
    (tfl, onx) = generate_examples(tmp_path, widths=(0.35,), input_sizes=(96,), zoo=False, dynamic_batch=True)
    assert tfl.path.name == "mobilenetv2_w0.35_r96_dynbatch.tflite"
    assert inspect_model(onx.path).inputs[0].shape == ["batch", 3, 96, 96]
    assert inspect_model(tfl.path).inputs[0].shape == ["?", 96, 96, 3]
    interpreter = Interpreter(model_path=str(tfl.path), num_threads=1)
    interpreter.resize_tensor_input(interpreter.get_input_details()[0]["index"], [2, 96, 96, 3])
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], np.zeros((2, 96, 96, 3), np.float32))
    interpreter.invoke()
    assert interpreter.get_tensor(interpreter.get_output_details()[0]["index"]).shape == (2, 1000)
    assert run_onnx(onx.path, np.zeros((3, 3, 96, 96), np.float32)).shape == (3, 1000)


def test_zoo_resnet50_facts() -> None:
    zoo = zoo_models()
    if "resnet50" not in zoo:
        pytest.skip("this onnx package ships no model zoo")
    facts = inspect_model(zoo["resnet50"])
    assert facts.format == "onnx" and facts.size_bytes > 0 and len(facts.sha256) == 64
    assert [(t.shape, t.dtype) for t in facts.inputs] == [([1, 3, 224, 224], "float32")]  # weights are not inputs
    assert facts.outputs[0].shape == [1, 1000]
    assert facts.op_types["Conv"] == 53
    assert facts.param_count is not None and 24e6 < facts.param_count < 27e6  # ResNet-50: 25.6M
    assert find_unsupported_ops(zoo["resnet50"]) == []


def test_copy_zoo(tmp_path: Path) -> None:
    zoo = zoo_models()
    if "squeezenet" not in zoo:
        pytest.skip("this onnx package ships no model zoo")
    (copied,) = copy_zoo(tmp_path, ["squeezenet"])
    assert copied == tmp_path / "squeezenet.onnx" and sha256(copied) == sha256(zoo["squeezenet"])
    with pytest.raises(KeyError, match="no_such_net"):
        copy_zoo(tmp_path, ["no_such_net"])


def test_corrupt_files_raise_model_error_naming_the_file(tmp_path: Path) -> None:
    corrupt = write_corrupt_tflite(tmp_path / "broken.tflite")
    with pytest.raises(ModelError, match="broken.tflite is not a valid TFLite flatbuffer"):
        inspect_model(corrupt)
    with pytest.raises(ModelError, match="broken.tflite"):
        find_unsupported_ops(corrupt)
    with pytest.raises(ValueError):  # LiteRT agrees the file is broken
        Interpreter(model_path=str(corrupt))

    wrong_kind = tmp_path / "x.tflite"
    wrong_kind.write_bytes(b"\x10\x00\x00\x00XXXX" + bytes(32))
    with pytest.raises(ModelError, match=r"x.tflite .*file identifier 'XXXX', expected 'TFL3'"):
        inspect_model(wrong_kind)

    with pytest.raises(ModelError, match="broken.onnx is not a valid ONNX model"):
        inspect_model(write_corrupt_onnx(tmp_path / "broken.onnx"))
    with pytest.raises(ModelError, match="missing.onnx does not exist"):
        inspect_model(tmp_path / "missing.onnx")
    assert issubclass(ModelError, ValueError)


def test_unsupported_ops_are_named(tmp_path: Path) -> None:
    tflite_path = write_unsupported_op_tflite(tmp_path / "unsupported.tflite")
    assert find_unsupported_ops(tflite_path) == ["FarmUnknownOp"]
    assert inspect_model(tflite_path).op_types == {"RELU": 1, "FarmUnknownOp": 1}
    interpreter = Interpreter(model_path=str(tflite_path))
    with pytest.raises(RuntimeError, match="FarmUnknownOp"):
        interpreter.allocate_tensors()

    onnx_path = write_unsupported_op_onnx(tmp_path / "unsupported.onnx")
    assert find_unsupported_ops(onnx_path) == ["farm.test:FarmUnknownOp"]
    with pytest.raises(Exception, match="FarmUnknownOp"):
        onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])


def test_a_refusal_check_trusts_an_earlier_parse_only_for_the_same_bytes(tmp_path: Path) -> None:
    """A job's refusal check skips the parse inspect_model already made, keyed by the bytes' hash: a file
    swapped for a broken one after it was inspected is parsed again and refused as broken, and a refused
    model still names its operators."""
    path = write_unsupported_op_tflite(tmp_path / "model.tflite")
    facts = inspect_model(path)
    refusal = runtime_refusal(path, parsed_sha256=facts.sha256)
    assert refusal is not None and refusal.ops == ("FarmUnknownOp",)
    write_corrupt_tflite(path)  # changed between the inspection and the check
    with pytest.raises(ModelError, match="model.tflite is not a valid TFLite flatbuffer"):
        runtime_refusal(path, parsed_sha256=facts.sha256)
    onnx_path = write_corrupt_onnx(tmp_path / "model.onnx")
    with pytest.raises(ModelError, match="model.onnx is not a valid ONNX model"):
        runtime_refusal(onnx_path, parsed_sha256=facts.sha256)


def test_supported_models_have_no_unsupported_ops(
    generated: dict[tuple[float, int, str], GeneratedModel], tmp_path: Path
) -> None:
    assert find_unsupported_ops(generated[(1.0, 224, "tflite")].path) == []
    assert find_unsupported_ops(generated[(1.0, 224, "onnx")].path) == []
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    assert find_unsupported_ops(other) == []


def test_tiny_models_and_other_files(tmp_path: Path) -> None:
    tiny_tflite = write_tiny_tflite(tmp_path / "tiny.tflite")
    tiny_onnx = write_tiny_onnx(tmp_path / "tiny.onnx")
    assert run_tflite(tiny_tflite, np.ones((1, 8, 8, 3), np.float32)).shape == (1, 8, 8, 4)
    assert run_onnx(tiny_onnx, np.ones((1, 3, 8, 8), np.float32)).shape == (1, 4, 8, 8)
    facts = inspect_model(tiny_tflite)
    assert (facts.op_count, facts.param_count, facts.op_types) == (1, 4 * 3 * 3 * 3 + 4, {"CONV_2D": 1})
    assert inspect_model(tiny_onnx).param_count == 4 * 3 * 3 * 3 + 4

    other = tmp_path / "weights.bin"
    other.write_bytes(b"abc")
    facts = inspect_model(other)
    assert (facts.format, facts.size_bytes, facts.sha256) == ("other", 3, hashlib.sha256(b"abc").hexdigest())
    assert facts.inputs == [] and facts.op_count is None and facts.param_count is None


def test_generation_is_deterministic_and_rerun_writes_nothing(tmp_path: Path) -> None:
    zoo: list[str] | bool = ["squeezenet"] if "squeezenet" in zoo_models() else False
    first = generate_examples(tmp_path / "a", widths=(0.35,), input_sizes=(96,), zoo=zoo)
    second = generate_examples(tmp_path / "b", widths=(0.35,), input_sizes=(96,), zoo=zoo)
    assert [m.path.name for m in first] == [m.path.name for m in second]
    assert [sha256(m.path) for m in first] == [sha256(m.path) for m in second]

    seen: list[tuple[str, int, int]] = []
    again = generate_examples(
        tmp_path / "a",
        widths=(0.35,),
        input_sizes=(96,),
        zoo=zoo,
        progress=lambda m, done, total: seen.append((m.name, done, total)),
    )
    assert not any(m.written for m in again)
    assert [done for _, done, _ in seen] == list(range(1, len(again) + 1)) and seen[-1][2] == len(again)
    assert {m.family for m in again} <= {"mobilenetv2", "zoo"}

    manifest = write_manifest(again, tmp_path / "a" / "models.yaml")
    entries = yaml.safe_load(manifest.read_text())["models"]
    assert entries[0] == {
        "name": "mobilenetv2_w0.35_r96",
        "path": "mobilenetv2_w0.35_r96.tflite",
        "format": "tflite",
        "family": "mobilenetv2",
        "width": 0.35,
        "input_size": 96,
    }
    assert all((manifest.parent / entry["path"]).is_file() for entry in entries)


def test_the_shipped_package_holds_no_broken_model_generators() -> None:
    import importlib
    import pkgutil

    import farm.model_generators
    import farm.models

    root = Path(farm.models.__file__).resolve().parents[1]
    shipped = [m.name for package in (farm.models, farm.model_generators)
               for m in pkgutil.iter_modules(package.__path__, package.__name__ + ".")]
    assert "farm.model_generators.generate" in shipped
    for name in shipped:
        module = importlib.import_module(name)
        assert not [a for a in vars(module) if a.startswith(("write_corrupt", "write_unsupported", "unsupported_op"))], name
    for folder in ("models", "model_generators", "controller", "client", "cli", "agents", "proto", "web"):  # the package's folders (pyproject package-dir)
        for source in (root / folder).rglob("*.py"):
            assert "model_fixtures" not in source.read_text(), f"{source} imports a test fixture"
