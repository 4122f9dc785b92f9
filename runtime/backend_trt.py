"""The ``trt`` backend: native TensorRT plans, run with ``execute_async_v3`` on one stream.

Follows TensorRT's documented Python API (and its demo/Diffusion ``engine.py``): deserialize
the plan, create an execution context, then per call ``set_input_shape``,
``set_tensor_address`` and ``execute_async_v3``. Device memory comes from Polygraphy's small
CUDA wrapper (``polygraphy.cuda``), so no other CUDA binding is needed. ``tensorrt`` is
imported only when this backend is activated.

A binding owns one device buffer per tensor. Static inputs (cached K/V) are uploaded once at
bind time; per call only the per-step inputs go up and the output comes down.
"""

from __future__ import annotations

import ctypes.util
import logging
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

log = logging.getLogger(__name__)


def trt_unavailable_reason() -> Optional[str]:
    """None when TensorRT and an NVIDIA GPU are usable here, else why not (one line)."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "the tensorrt Python package is not installed"
    if ctypes.util.find_library("cuda") is None:
        return "no NVIDIA driver (libcuda) is present"
    try:
        from polygraphy import cuda  # lazy: the trt backend only (its small CUDA wrapper)

        cuda.Stream().free()
    except Exception as err:  # CUDA reports a missing GPU in several ways
        return f"no usable NVIDIA GPU ({err})"
    return None


class TrtBinding:
    def __init__(self, graph: "TrtGraph", inputs, outputs, static):
        from polygraphy import cuda  # lazy: the trt backend only (its small CUDA wrapper)

        self.graph = graph
        self.host = {**inputs, **outputs}
        self.inputs = dict(inputs)
        self.outputs = dict(outputs)
        self.dynamic = [name for name in inputs if name not in static]
        self.device = {name: cuda.DeviceArray(shape=a.shape, dtype=a.dtype) for name, a in self.host.items()}
        for name in static:
            self.device[name].copy_from(inputs[name], graph.stream)
        graph.stream.synchronize()

    def run(self) -> None:
        context, stream = self.graph.context, self.graph.stream
        for name in self.dynamic:
            self.device[name].copy_from(self.inputs[name], stream)
        # Shapes and addresses are context state: set them for this binding on every call
        # (cheap host-side calls; several bindings share one context).
        for name, array in self.inputs.items():
            context.set_input_shape(name, array.shape)
        for name, buffer in self.device.items():
            context.set_tensor_address(name, buffer.ptr)
        if not context.execute_async_v3(stream.ptr):
            raise RuntimeError(f"{self.graph.path.name}: execute_async_v3 failed")
        for name, array in self.outputs.items():
            self.device[name].copy_to(array, stream)
        stream.synchronize()

    def free(self) -> None:
        for buffer in self.device.values():
            buffer.free()


class TrtGraph:
    """One TensorRT plan file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.engine: Any = None
        self.context: Any = None
        self.stream: Any = None
        self.input_names: list[str] = []
        self.output_names: list[str] = []
        self.bindings: list[TrtBinding] = []

    def activate(self) -> "TrtGraph":
        import tensorrt as trt
        from polygraphy import cuda  # lazy: the trt backend only (its small CUDA wrapper)

        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            from .errors import ArtifactError

            raise ArtifactError(f"{self.path}: TensorRT cannot load this plan; re-run `make engines`")
        self.context = self.engine.create_execution_context()
        self.stream = cuda.Stream()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = lambda n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT  # noqa: E731
        self.input_names = [n for n in names if is_input(n)]
        self.output_names = [n for n in names if not is_input(n)]
        return self

    def deactivate(self) -> None:
        for binding in self.bindings:
            binding.free()
        self.bindings = []
        if self.stream is not None:
            self.stream.free()
        self.context = self.engine = self.stream = None

    def __enter__(self) -> "TrtGraph":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def bind(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray], static=frozenset()) -> TrtBinding:
        binding = TrtBinding(self, inputs, outputs, static)
        self.bindings.append(binding)
        return binding

    def infer(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """One call on fresh buffers (text encoding, decoding: not in the step loop)."""
        for name, array in feeds.items():
            self.context.set_input_shape(name, array.shape)
        outputs = {
            name: np.empty(tuple(self.context.get_tensor_shape(name)), dtype=np.float32) for name in self.output_names
        }
        binding = TrtBinding(self, {k: np.ascontiguousarray(v) for k, v in feeds.items()}, outputs, frozenset())
        try:
            binding.run()
        finally:
            binding.free()
        return [outputs[name] for name in self.output_names]
