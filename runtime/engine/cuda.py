"""The little CUDA the ``trt`` backend needs: one stream, device memory, pinned staging, CUDA graphs.

Written against CUDA's runtime API as NVIDIA's ``cuda-python`` exposes it (``cudart``, the
binding TensorRT's demo/Diffusion uses): every call returns ``(error, *results)``. Imported
only by the GPU backends, lazily; the tests run it against a simulated runtime
(``tests/fakegpu.py``) that enforces the documented rules.

- :class:`CudaStream`: the backend's one stream, non-blocking (it never waits on the legacy
  default stream). Host copies go through its page-locked staging memory: a copy from pinned
  memory is truly asynchronous and can be captured, and a staged region is reused only after the
  stream has synchronized. Reads into host arrays are deferred to :meth:`CudaStream.synchronize`,
  so one step reads every finished row with one synchronization.
- :class:`CudaTensor`: a ``cudaMalloc`` allocation written by element offset on that stream.
- :class:`CudaGraph`: capture one launch of a bound engine in thread-local capture mode (other
  threads may still allocate), then replay it with ``cudaGraphLaunch``. A failed capture reports
  the enqueue's own error, not the end-of-capture error it causes.
"""

from __future__ import annotations

import ctypes
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
    """Use ``module`` as the CUDA runtime binding (the tests pass a simulated one)."""
    global _cudart
    _cudart = module


def check(result: Any, what: str = "") -> Any:
    """``(error, *values)`` -> the values; a CUDA error raises with its name (and ``what``)."""
    rt = cudart()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA error {getattr(err, 'name', err)}{f' in {what}' if what else ''}")
    return values[0] if len(values) == 1 else tuple(values) or None


def _host_view(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)) if nbytes else np.empty(0, np.uint8)


class CudaStream:
    """One non-blocking stream with page-locked staging memory for host copies."""

    STAGING_BYTES = 8 << 20  # grown on demand (only outside a capture: it is cudaMallocHost)

    def __init__(self):
        rt = cudart()
        self.handle = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
        self._staging_ptr = 0
        self._staging = np.empty(0, np.uint8)
        self._used = 0
        self._reads: list[tuple[np.ndarray, np.ndarray]] = []  # (staged bytes, host target) after sync
        self._after: list[Callable[[], None]] = []
        self.syncs = 0

    @property
    def ptr(self) -> int:
        return int(self.handle)

    def _stage(self, nbytes: int) -> tuple[int, np.ndarray]:
        """``nbytes`` of pinned memory that no queued copy still uses."""
        nbytes = -(-nbytes // 256) * 256  # keep every staged region aligned
        if self._used + nbytes > self._staging.size:
            self.synchronize()  # every staged copy has run: the whole buffer is free again
            if nbytes > self._staging.size:
                if self._staging_ptr:
                    check(cudart().cudaFreeHost(self._staging_ptr), "cudaFreeHost")
                size = max(self.STAGING_BYTES, nbytes)
                self._staging_ptr = int(check(cudart().cudaMallocHost(size), "cudaMallocHost"))
                self._staging = _host_view(self._staging_ptr, size)
        at = self._used
        self._used += nbytes
        return self._staging_ptr + at, self._staging[at : at + nbytes]

    def upload(self, dst: int, host: np.ndarray) -> None:
        """Queue a copy of ``host`` (contiguous) to device address ``dst``; ``host`` may be reused at once."""
        data = host.reshape(-1).view(np.uint8)
        src, staged = self._stage(data.size)
        staged[: data.size] = data
        rt = cudart()
        check(rt.cudaMemcpyAsync(dst, src, data.size, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.handle), "upload")

    def download(self, out: np.ndarray, src: int) -> None:
        """Queue a copy of device ``src`` into ``out`` (contiguous); it lands at :meth:`synchronize`."""
        nbytes = out.nbytes
        ptr, staged = self._stage(nbytes)
        rt = cudart()
        check(rt.cudaMemcpyAsync(ptr, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.handle), "download")
        self._reads.append((staged[:nbytes], out))

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        rt = cudart()
        check(rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.handle), "copy")

    def synchronize(self) -> None:
        check(cudart().cudaStreamSynchronize(self.handle), "cudaStreamSynchronize")
        self.syncs += 1
        for staged, out in self._reads:
            out.reshape(-1).view(np.uint8)[...] = staged
        self._reads.clear()
        for fn in self._after:
            fn()
        self._after.clear()
        self._used = 0

    def after_sync(self, fn: Callable[[], None]) -> None:
        self._after.append(fn)

    def free(self) -> None:
        if self.handle is not None:
            self.synchronize()
            check(cudart().cudaStreamDestroy(self.handle), "cudaStreamDestroy")
            self.handle = None
        if self._staging_ptr:
            check(cudart().cudaFreeHost(self._staging_ptr), "cudaFreeHost")
            self._staging_ptr = 0
            self._staging = np.empty(0, np.uint8)


class CudaTensor:
    """``capacity`` elements of ``dtype`` in device memory, copied on ``stream``, zeroed at birth."""

    device = "cuda"

    def __init__(self, capacity: int, dtype, stream: CudaStream):
        self.dtype = np.dtype(dtype)
        self.capacity = capacity
        self.stream = stream
        nbytes = max(1, capacity) * self.dtype.itemsize
        self.ptr = int(check(cudart().cudaMalloc(nbytes), "cudaMalloc"))
        # cudaMalloc'd memory holds anything: padded rows of a bucket read it
        check(cudart().cudaMemsetAsync(self.ptr, 0, nbytes, stream.handle), "cudaMemsetAsync")

    def write(self, host: np.ndarray, offset: int = 0) -> None:
        _check_fits(self, offset, host.size)
        self.stream.upload(self.ptr + offset * self.dtype.itemsize, np.ascontiguousarray(host, dtype=self.dtype))

    def read_async(self, out: np.ndarray, offset: int = 0) -> None:
        """Queue a read into ``out``; it lands when the stream synchronizes."""
        _check_fits(self, offset, out.size)
        src = self.ptr + offset * self.dtype.itemsize
        if out.dtype == self.dtype and out.flags.c_contiguous:
            self.stream.download(out, src)
        else:  # an fp16 engine output read into fp32 memory: land in its own dtype, convert after sync
            landing = np.empty(out.shape, self.dtype)
            self.stream.download(landing, src)
            self.stream.after_sync(lambda: np.copyto(out, landing, casting="unsafe"))

    def read(self, out: np.ndarray, offset: int = 0) -> None:
        self.read_async(out, offset)
        self.stream.synchronize()

    def move(self, dst: int, src: int, count: int) -> None:
        self.copy_from(self, dst, src, count)

    def copy_from(self, src: "CudaTensor", dst: int, src_offset: int, count: int) -> None:
        _check_fits(self, dst, count)
        _check_fits(src, src_offset, count)
        if src.dtype != self.dtype:
            raise TypeError(f"a device copy between {src.dtype} and {self.dtype}")
        size = self.dtype.itemsize
        self.stream.copy(self.ptr + dst * size, src.ptr + src_offset * size, count * size)

    def view(self, shape: tuple[int, ...]) -> TensorView:
        _check_fits(self, 0, math.prod(shape))
        return TensorView(self.ptr, tuple(shape), self.dtype, self.device)

    def free(self) -> None:
        if self.ptr:
            check(cudart().cudaFree(self.ptr), "cudaFree")
        self.ptr = 0


class CudaGraph:
    """One captured launch, replayed by :meth:`launch`."""

    def __init__(self, stream: CudaStream, enqueue: Callable[[], None]):
        """Run ``enqueue`` once for real (engines allocate and tune on a first launch), then
        capture a second run of it as a graph, in thread-local mode."""
        rt = cudart()
        self.graph: Optional[Any] = None
        self.instance: Optional[Any] = None
        self.stream = stream
        enqueue()
        mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        check(rt.cudaStreamBeginCapture(stream.handle, mode), "cudaStreamBeginCapture")
        try:
            enqueue()
        except BaseException:
            rt.cudaStreamEndCapture(stream.handle)  # ends the broken capture; the enqueue's error is the one to see
            raise
        self.graph = check(rt.cudaStreamEndCapture(stream.handle), "capturing the step as a CUDA graph")
        result = rt.cudaGraphInstantiate(self.graph, 0)
        self.instance = check(result, "cudaGraphInstantiate")

    def launch(self) -> None:
        check(cudart().cudaGraphLaunch(self.instance, self.stream.handle), "cudaGraphLaunch")

    def free(self) -> None:
        rt = cudart()
        if self.instance is not None:
            check(rt.cudaGraphExecDestroy(self.instance), "cudaGraphExecDestroy")
        if self.graph is not None:
            check(rt.cudaGraphDestroy(self.graph), "cudaGraphDestroy")
        self.instance = self.graph = None
