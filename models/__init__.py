"""farm.models: what farm knows about a model file — what ships and runs on every role.

- facts: inspect_model() -> ModelFacts, find_unsupported_ops(), ModelError
- macs: multiply-accumulates per operator, from the graph
- runtimes: the ONNX Runtime session and LiteRT interpreter a run and the validator both load
- tflite_writer: the .tflite graph builder (the custom-operator probe; the generators build on it)

The example and fixture models are made by farm.model_generators (model_generators/).
"""
