"""farm.model_generators: what makes farm's example and fixture models (`farm models generate`, the
nightly reference suite). Nothing here is needed to inspect or run a model (that is farm.models).

- mobilenetv2: the MobileNetV2 architecture with random weights, format-independent
- generate_onnx / generate_tflite: that network (and a tiny one-conv model) as .onnx / .tflite
- classic_tflite: classic architectures as .tflite
- onnx_net / published_nets: the published Jetson experiment's networks, built layer by layer as ONNX
- zoo: the real model-zoo architectures the onnx package ships
- generate: generate_examples() writes the whole family (broken models for tests live in tests/)
"""
