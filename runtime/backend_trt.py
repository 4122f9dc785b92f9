"""The ``trt`` backend: native TensorRT plans, run with ``execute_async_v3`` on one stream.

Follows TensorRT's documented Python API (and its demo/Diffusion ``engine.py``): deserialize
the plan, create an execution context, ``set_input_shape`` and ``set_tensor_address`` per
tensor, ``execute_async_v3``. Device memory, copies and CUDA graphs come from ``cuda.py``
(NVIDIA's cuda-python). ``tensorrt`` is imported only when this backend is activated.

A binding fixes shapes and addresses (views of slot memory that never moves), runs once for
real, then captures the launch as a CUDA graph; every later ``run()`` replays it with one
``cudaGraphLaunch``. Freeing a binding (its bucket evicted) destroys its graph.
"""

from __future__ import annotations

import ctypes.util
import logging
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from .device import TensorView

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
        from .cuda import CudaStream

        CudaStream().free()
    except ImportError:
        return "NVIDIA's cuda-python is not installed (pip install 'edit-rt[trt]')"
    except Exception as err:  # CUDA reports a missing GPU in several ways
        return f"no usable NVIDIA GPU ({err})"
    return None


class TrtBinding:
    """Shapes and addresses of one set of views, captured as a CUDA graph on the first run."""

    def __init__(self, graph: "TrtGraph", inputs: Mapping[str, TensorView], outputs: Mapping[str, TensorView],
                 cuda_graph: bool = True):  # fmt: skip
        self.graph = graph
        self.inputs = dict(inputs)
        self.addresses = {name: view.ptr for name, view in {**inputs, **outputs}.items()}
        self.use_cuda_graph = cuda_graph
        self.cuda_graph: Any = None

    def _enqueue(self) -> None:
        context, stream = self.graph.context, self.graph.stream
        # Shapes and addresses are context state shared by every binding of this graph: set
        # them for this one (cheap host calls; a replayed graph does not need them).
        for name, view in self.inputs.items():
            context.set_input_shape(name, view.shape)
        for name, ptr in self.addresses.items():
            context.set_tensor_address(name, ptr)
        if not context.execute_async_v3(stream.ptr):
            raise RuntimeError(f"{self.graph.path.name}: execute_async_v3 failed")

    def run(self) -> None:
        from .cuda import CudaGraph

        if self.cuda_graph is not None:
            self.cuda_graph.launch()
        elif self.use_cuda_graph:
            self.cuda_graph = CudaGraph(self.graph.stream, self._enqueue)  # runs, then captures
        else:
            self._enqueue()
        self.graph.stream.synchronize()

    def free(self) -> None:
        if self.cuda_graph is not None:
            self.cuda_graph.free()
            self.cuda_graph = None


class TrtGraph:
    """One TensorRT plan file."""

    def __init__(self, path: Path, cuda_graphs: bool = True):
        self.path = Path(path)
        self.cuda_graphs = cuda_graphs
        self.engine: Any = None
        self.context: Any = None
        self.stream: Any = None
        self.input_names: list[str] = []
        self.output_names: list[str] = []

    def activate(self) -> "TrtGraph":
        import tensorrt as trt

        from .cuda import CudaStream

        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            from .errors import ArtifactError

            raise ArtifactError(f"{self.path}: TensorRT cannot load this plan; re-run `make engines`")
        self.context = self.engine.create_execution_context()
        self.stream = CudaStream()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = lambda n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT  # noqa: E731
        self.input_names = [n for n in names if is_input(n)]
        self.output_names = [n for n in names if not is_input(n)]
        return self

    def deactivate(self) -> None:
        if self.stream is not None:
            self.stream.free()
        self.context = self.engine = self.stream = None

    def __enter__(self) -> "TrtGraph":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def allocate(self, capacity: int, dtype):
        from .cuda import CudaTensor

        return CudaTensor(capacity, dtype, self.stream)

    def bind(self, inputs: Mapping[str, TensorView], outputs: Mapping[str, TensorView]) -> TrtBinding:
        return TrtBinding(self, inputs, outputs, self.cuda_graphs)

    def infer(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """One call on fresh buffers (text encoding, decoding: not in the step loop)."""
        for name, array in feeds.items():
            self.context.set_input_shape(name, array.shape)
        outputs = {
            name: np.empty(tuple(self.context.get_tensor_shape(name)), dtype=np.float32) for name in self.output_names
        }
        tensors = {}
        try:
            views = {}
            for name, array in {**feeds, **outputs}.items():
                tensors[name] = self.allocate(max(1, array.size), array.dtype)
                views[name] = tensors[name].view(array.shape)
            for name, array in feeds.items():
                tensors[name].write(np.ascontiguousarray(array))
            TrtBinding(self, {k: views[k] for k in feeds}, {k: views[k] for k in outputs}, cuda_graph=False).run()
            for name, array in outputs.items():
                tensors[name].read(array)
        finally:
            for tensor in tensors.values():
                tensor.free()
        return [outputs[name] for name in self.output_names]

