"""The engine layer: the compiled graphs (backends: ONNX Runtime, OpenVINO, TensorRT), their memory (device,
cuda), the one thread that calls them, engines.json, the manifest and the step graph's
signature. Nothing above it touches a device buffer. Imports runtime's root only: the edit model (model/)
and the engine are independent of each other.
"""
