"""farm.models: example models and what farm knows about a model file.

- facts: inspect_model() -> ModelFacts, find_unsupported_ops(), ModelError
- mobilenetv2: the MobileNetV2 architecture with random weights, format-independent
- generate_onnx / generate_tflite: that network (and tiny test models) as .onnx / .tflite
- zoo: the real model-zoo architectures the onnx package ships
- generate: generate_examples() writes the whole family, plus fixtures for tests
"""
