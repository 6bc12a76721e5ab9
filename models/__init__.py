"""farm.models: example models and what farm knows about a model file.

- facts: inspect_model() -> ModelFacts, find_unsupported_ops(), ModelError
- mobilenetv2: the MobileNetV2 architecture with random weights, format-independent
- generate_onnx / generate_tflite: that network (and a tiny one-conv model) as .onnx / .tflite
- zoo: the real model-zoo architectures the onnx package ships
- generate: generate_examples() writes the whole family (broken models for tests live in tests/)
"""
