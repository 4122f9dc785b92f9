"""Backends run one exported graph. ``ort-cpu`` (ONNX Runtime, CPU) is the embedded default.

A backend is a context manager with ``activate()/infer()/deactivate()`` in Polygraphy's manner;
the pipeline sees only that interface, never which runtime is behind it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import numpy as np
import onnxruntime as ort

from .errors import ArtifactError

log = logging.getLogger(__name__)


class OrtGraph:
    """One ONNX graph in an ONNX Runtime CPU session."""

    def __init__(self, path: Path, threads: int = 0):
        self.path = Path(path)
        self.threads = threads
        self.session: ort.InferenceSession | None = None
        self.input_names: list[str] = []
        self.output_names: list[str] = []

    def activate(self) -> "OrtGraph":
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.threads:
            options.intra_op_num_threads = self.threads
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime raises its own exception types per failure
            raise ArtifactError(f"{self.path}: ONNX Runtime cannot load it ({err}); re-run `make export`") from None
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        return self

    def deactivate(self) -> None:
        self.session = None

    def __enter__(self) -> "OrtGraph":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def infer(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run the graph; outputs in ``output_names`` order, freshly allocated by ONNX Runtime."""
        if self.session is None:
            raise RuntimeError(f"{self.path.name}: infer() before activate()")
        return self.session.run(self.output_names, feeds)
