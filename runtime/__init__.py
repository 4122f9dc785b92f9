"""edit-rt runtime: runs exported edit-rt artifacts with numpy and ONNX Runtime.

Nothing in this package imports torch, diffusers, transformers or onnx: a deployment needs only
the artifacts under ``build/<model>/`` and ``pip install edit-rt``.
"""

__version__ = "0.1.0"
