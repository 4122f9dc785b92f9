"""The ``trt`` backend: native TensorRT plans, run with ``execute_async_v3`` on one stream.

Follows TensorRT's documented Python API (and its demo/Diffusion ``engine.py``): deserialize
the plan, create execution contexts, ``set_input_shape`` and ``set_tensor_address`` per tensor,
``execute_async_v3``. Device memory, copies and CUDA graphs come from ``cuda.py`` (NVIDIA's
cuda-python). ``tensorrt`` is imported only when this backend is activated.

What the rules ask, and where it is done:

- every graph of a pipeline shares one :class:`TrtDevice`: one non-blocking stream (so slot
  writes, steps, maps, blends and VAE calls are ordered by the stream alone, with no event), and
  one device-memory block that every execution context uses as its scratch
  (``ExecutionContextAllocationStrategy.USER_MANAGED`` + ``set_device_memory``): the contexts
  run one at a time on that stream, so they can share it;
- input shapes and tensor addresses are a context's state, so every binding (one bucket of the
  step loop: rows, entry rows, negative-prompt sets) has its own context, set once, captured once
  as a CUDA graph and replayed; a graph is never replayed on a context that another shape used;
- ``infer`` (text encoder, VAE) has one context per graph and device buffers kept per tensor
  (grown, never reallocated per call), so serving allocates nothing while a step is captured;
- buffer dtypes are the engine's (``get_tensor_dtype``), not assumed;
- a context is not thread-safe: the pipeline's engine thread makes and uses every one.
"""

from __future__ import annotations

import logging
import math
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
        return "the tensorrt Python package is not installed (pip install 'edit-rt[gpu]')"
    try:
        from .cuda import check, cudart

        count = check(cudart().cudaGetDeviceCount(), "cudaGetDeviceCount")
    except ImportError:
        return "NVIDIA's cuda-python is not installed (pip install 'edit-rt[gpu]')"
    except Exception as err:  # CUDA reports a missing driver or GPU in several ways
        return f"no usable NVIDIA GPU ({err})"
    if not count:
        return "no NVIDIA GPU is visible"
    return None


class TrtDevice:
    """What every TensorRT graph of one pipeline shares: the runtime, the stream, the scratch."""

    def __init__(self):
        self.runtime: Any = None
        self.stream: Any = None
        self.scratch_bytes = 0  # the most any engine's context needs
        self.scratch: Any = None  # one CudaTensor, made when the first context is

    def activate(self) -> "TrtDevice":
        if self.runtime is None:
            import tensorrt as trt

            from .cuda import CudaStream

            self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            self.stream = CudaStream()
        return self

    def reserve(self, nbytes: int) -> None:
        if self.scratch is not None and nbytes > self.scratch.capacity:
            raise RuntimeError("an engine was activated after the shared context memory was made; activate all first")
        self.scratch_bytes = max(self.scratch_bytes, int(nbytes))

    def context_memory(self) -> tuple[int, int]:
        if self.scratch is None:
            from .cuda import CudaTensor

            self.scratch = CudaTensor(max(1, self.scratch_bytes), np.uint8, self.stream)
        return self.scratch.ptr, self.scratch.capacity

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def free(self) -> None:
        if self.scratch is not None:
            self.scratch.free()
            self.scratch = None
        if self.stream is not None:
            self.stream.free()
            self.stream = None
        self.runtime = None


class TrtBinding:
    """One bucket: its own execution context with shapes and addresses set once, captured as a
    CUDA graph on the first run and replayed after. ``run()`` only enqueues (no host sync)."""

    def __init__(self, graph: "TrtGraph", inputs: Mapping[str, TensorView], outputs: Mapping[str, TensorView],
                 cuda_graph: bool = True):  # fmt: skip
        self.graph = graph
        self.context = graph.new_context()
        graph.use_profile(self.context, {name: view.shape for name, view in inputs.items()})
        for name, view in inputs.items():
            if not self.context.set_input_shape(name, view.shape):
                raise RuntimeError(f"{graph.path.name}: {name} {view.shape} is outside the engine's profile; {graph.rebuild}")
        for name, view in {**inputs, **outputs}.items():
            graph.check_dtype(name, view.dtype)
            self.context.set_tensor_address(name, view.ptr)
        self.use_cuda_graph = cuda_graph
        self.cuda_graph: Any = None

    def _enqueue(self) -> None:
        if not self.context.execute_async_v3(self.graph.device.stream.ptr):
            raise RuntimeError(f"{self.graph.path.name}: execute_async_v3 failed")

    def run(self) -> None:
        from .cuda import CudaGraph

        if self.cuda_graph is not None:
            self.cuda_graph.launch()
        elif self.use_cuda_graph:
            self.cuda_graph = CudaGraph(self.graph.device.stream, self._enqueue)  # runs, then captures
        else:
            self._enqueue()

    def free(self) -> None:
        if self.cuda_graph is not None:
            self.cuda_graph.free()
            self.cuda_graph = None
        self.context = None


class TrtGraph:
    """One TensorRT plan file on a shared :class:`TrtDevice`."""

    rebuild = "re-run `make engines`"

    def __init__(self, path: Path, device: Optional[TrtDevice] = None, cuda_graphs: bool = True):
        self.path = Path(path)
        self.device = device or TrtDevice()
        self.cuda_graphs = cuda_graphs
        self.engine: Any = None
        self.input_names: list[str] = []
        self.output_names: list[str] = []
        self._trt: Any = None
        self._context: Any = None  # infer()'s own context
        self._context_profile = 0  # the optimization profile infer()'s context is on
        self._buffers: dict[str, Any] = {}  # infer()'s device buffers, per tensor, grown only
        self.contexts_made = 0

    def activate(self) -> "TrtGraph":
        import tensorrt as trt

        self._trt = trt
        self.device.activate()
        self.engine = self.device.runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            from ..errors import ArtifactError

            raise ArtifactError(f"{self.path}: TensorRT cannot load this plan; {self.rebuild}")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = lambda n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT  # noqa: E731
        self.input_names = [n for n in names if is_input(n)]
        self.output_names = [n for n in names if not is_input(n)]
        size = getattr(self.engine, "device_memory_size_v2", None)
        if size is None:  # TensorRT < 10.1
            size = self.engine.device_memory_size
        self.device.reserve(size)
        return self

    def deactivate(self) -> None:
        for tensor in self._buffers.values():
            tensor.free()
        self._buffers.clear()
        self._context = None
        self.engine = None

    def __enter__(self) -> "TrtGraph":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def dtype(self, name: str) -> np.dtype:
        """The engine's dtype of tensor ``name`` (a strongly typed fp16 plan has fp16 K/V)."""
        return np.dtype(self._trt.nptype(self.engine.get_tensor_dtype(name)))

    def check_dtype(self, name: str, dtype) -> None:
        if np.dtype(dtype) != self.dtype(name):
            raise TypeError(f"{self.path.name}: {name} is bound as {np.dtype(dtype)}, the engine takes {self.dtype(name)}")

    def new_context(self) -> Any:
        trt = self._trt
        strategy = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        context = self.engine.create_execution_context(strategy)
        ptr, size = self.device.context_memory()
        if hasattr(context, "set_device_memory"):  # TensorRT >= 10.1
            context.set_device_memory(ptr, size)
        else:
            context.device_memory = ptr
        self.contexts_made += 1
        return context

    def profile_for(self, shapes: Mapping[str, tuple]) -> int:
        """The engine's optimization profile (one per served latent size) whose ranges hold
        every input shape; a shape no profile holds is the engine's refusal."""
        for k in range(self.engine.num_optimization_profiles):
            if all(_within(self.engine.get_tensor_profile_shape(name, k), shape) for name, shape in shapes.items()):
                return k
        name, shape = next(iter(shapes.items()))
        raise RuntimeError(f"{self.path.name}: {name} {tuple(shape)} is outside every profile of the engine; {self.rebuild}")

    def use_profile(self, context: Any, shapes: Mapping[str, tuple]) -> int:
        """Put ``context`` on the profile for ``shapes`` (before its shapes are set: a switch
        invalidates them), on the one stream. A single-profile engine needs no call."""
        k = self.profile_for(shapes)
        if self.engine.num_optimization_profiles > 1:
            if not context.set_optimization_profile_async(k, self.device.stream.ptr):
                raise RuntimeError(f"{self.path.name}: set_optimization_profile_async({k}) failed")
        return k

    def synchronize(self) -> None:
        self.device.synchronize()

    def allocate(self, capacity: int, dtype):
        from .cuda import CudaTensor

        return CudaTensor(capacity, dtype, self.device.stream)

    def bind(self, inputs: Mapping[str, TensorView], outputs: Mapping[str, TensorView]) -> TrtBinding:
        return TrtBinding(self, inputs, outputs, self.cuda_graphs)

    def _buffer(self, name: str, elems: int) -> Any:
        tensor = self._buffers.get(name)
        if tensor is None or tensor.capacity < elems:
            if tensor is not None:
                tensor.free()
            tensor = self._buffers[name] = self.allocate(max(1, elems), self.dtype(name))
        return tensor

    def infer(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """One call (text encoding, VAE: not in the step loop) on this graph's kept buffers;
        outputs come back as float32 host arrays whatever the engine's dtype."""
        if self._context is None:
            self._context = self.new_context()
        context = self._context
        shapes = {name: array.shape for name, array in feeds.items()}
        if self.engine.num_optimization_profiles > 1 and self.profile_for(shapes) != self._context_profile:
            self._context_profile = self.use_profile(context, shapes)  # another size than the last call's
        for name, array in feeds.items():
            if not context.set_input_shape(name, array.shape):
                raise RuntimeError(f"{self.path.name}: {name} {array.shape} is outside the engine's profile; {self.rebuild}")
        shapes = {name: tuple(context.get_tensor_shape(name)) for name in self.output_names}
        for name, array in feeds.items():
            tensor = self._buffer(name, array.size)
            tensor.write(np.ascontiguousarray(array))
            context.set_tensor_address(name, tensor.ptr)
        outputs = {}
        for name, shape in shapes.items():
            tensor = self._buffer(name, math.prod(shape))
            context.set_tensor_address(name, tensor.ptr)
            outputs[name] = np.empty(shape, dtype=np.float32 if self.dtype(name).kind == "f" else self.dtype(name))
        if not context.execute_async_v3(self.device.stream.ptr):
            raise RuntimeError(f"{self.path.name}: execute_async_v3 failed")
        for name, out in outputs.items():
            self._buffers[name].read_async(out)
        self.device.synchronize()
        return [outputs[name] for name in self.output_names]


def _within(profile_shape, shape) -> bool:
    lo, _, hi = profile_shape
    return len(shape) == len(lo) and all(a <= d <= b for a, d, b in zip(lo, shape, hi))
