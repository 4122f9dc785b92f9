"""The little CUDA the GPU backends need: device memory, copies, a stream, CUDA graphs.

Written against CUDA's runtime API as NVIDIA's ``cuda-python`` exposes it (``cudart``, the
binding TensorRT's demo/Diffusion uses): every call returns ``(error, *results)``. Imported
only by the GPU backends, lazily; the tests run this module against a fake ``cudart``.

- :class:`CudaTensor`: a ``cudaMalloc`` allocation the runtime writes by element offset
  (``cudaMemcpyAsync`` on the backend's stream) — the device side of a slot.
- :class:`CudaGraph`: capture one launch of a bound engine (``cudaStreamBeginCapture`` ...
  ``cudaStreamEndCapture``, ``cudaGraphInstantiate``), then replay it with ``cudaGraphLaunch``:
  one CPU call per step instead of one per kernel. A binding's buffers never move (they are
  slots), so its graph stays valid until the binding is freed.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from .device import TensorView, _check_fits

_cudart: Any = None


def cudart() -> Any:
    """NVIDIA's CUDA runtime binding (cuda-python): ``cuda.bindings.runtime`` or ``cuda.cudart``."""
    global _cudart
    if _cudart is None:
        try:
            from cuda.bindings import runtime as module  # cuda-python >= 12.6
        except ImportError:
            from cuda import cudart as module  # older cuda-python
        _cudart = module
    return _cudart


def use_cudart(module: Any) -> None:
    """Use ``module`` as the CUDA runtime binding (the tests pass a fake one)."""
    global _cudart
    _cudart = module


def check(result: Any) -> Any:
    """``(error, *values)`` -> the values; a CUDA error raises with its name."""
    rt = cudart()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA error {getattr(err, 'name', err)}")
    return values[0] if len(values) == 1 else tuple(values) or None


class CudaStream:
    def __init__(self):
        self.handle = check(cudart().cudaStreamCreate())

    @property
    def ptr(self) -> int:
        return int(self.handle)

    def synchronize(self) -> None:
        check(cudart().cudaStreamSynchronize(self.handle))

    def free(self) -> None:
        if self.handle is not None:
            check(cudart().cudaStreamDestroy(self.handle))
            self.handle = None


class CudaTensor:
    """``capacity`` elements of ``dtype`` in device memory, copied on ``stream``."""

    device = "cuda"

    def __init__(self, capacity: int, dtype, stream: CudaStream, ptr: Optional[int] = None, owner: Any = None):
        """``ptr`` adopts memory someone else owns (``owner``, kept alive, e.g. an OrtValue)."""
        self.dtype = np.dtype(dtype)
        self.capacity = capacity
        self.stream = stream
        self.owner = owner
        self.owned = ptr is None
        self.ptr = int(check(cudart().cudaMalloc(max(1, capacity) * self.dtype.itemsize))) if ptr is None else ptr

    def _copy(self, dst: int, src: int, nbytes: int, kind: str) -> None:
        rt = cudart()
        check(rt.cudaMemcpyAsync(dst, src, nbytes, getattr(rt.cudaMemcpyKind, kind), self.stream.handle))

    def write(self, host: np.ndarray, offset: int = 0) -> None:
        _check_fits(self, offset, host.size)
        host = np.ascontiguousarray(host, dtype=self.dtype)
        self._copy(self.ptr + offset * self.dtype.itemsize, host.ctypes.data, host.nbytes, "cudaMemcpyHostToDevice")
        # pageable host memory: the copy has read it once this call returns (CUDA's semantics)

    def read(self, out: np.ndarray, offset: int = 0) -> None:
        _check_fits(self, offset, out.size)
        self._copy(out.ctypes.data, self.ptr + offset * self.dtype.itemsize, out.nbytes, "cudaMemcpyDeviceToHost")
        self.stream.synchronize()

    def move(self, dst: int, src: int, count: int) -> None:
        _check_fits(self, max(dst, src), count)
        size = self.dtype.itemsize
        self._copy(self.ptr + dst * size, self.ptr + src * size, count * size, "cudaMemcpyDeviceToDevice")

    def view(self, shape: tuple[int, ...]) -> TensorView:
        _check_fits(self, 0, math.prod(shape))
        return TensorView(self.ptr, tuple(shape), self.dtype, self.device)

    def free(self) -> None:
        if self.owned and self.ptr:
            check(cudart().cudaFree(self.ptr))
        self.ptr = 0
        self.owner = None


class CudaGraph:
    """One captured launch, replayed by :meth:`launch`."""

    def __init__(self, stream: CudaStream, enqueue: Callable[[], None]):
        """Run ``enqueue`` once for real (engines allocate and tune on a first launch), then
        capture a second run of it as a graph."""
        rt = cudart()
        enqueue()
        check(rt.cudaStreamBeginCapture(stream.handle, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal))
        try:
            enqueue()
        finally:
            self.graph = check(rt.cudaStreamEndCapture(stream.handle))
        self.instance = check(rt.cudaGraphInstantiate(self.graph, 0))
        self.stream = stream

    def launch(self) -> None:
        check(cudart().cudaGraphLaunch(self.instance, self.stream.handle))

    def free(self) -> None:
        rt = cudart()
        if self.instance is not None:
            check(rt.cudaGraphExecDestroy(self.instance))
            check(rt.cudaGraphDestroy(self.graph))
        self.instance = self.graph = None
