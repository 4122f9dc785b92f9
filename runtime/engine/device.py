"""Memory in a backend: the slots of the step loop live here, written once, bound by address.

A :class:`DeviceTensor` is a flat allocation in the backend's own memory (host RAM for ONNX
Runtime on the CPU, device memory for the GPU backends) that the runtime writes and reads by
element offset, never by reallocating. :meth:`DeviceTensor.view` gives a
:class:`TensorView` (address, shape, dtype) of its first elements, which is what a binding
binds: a prefix of rows ``[:n]``, or a set of negative prompts laid side by side.

``HostTensor`` is the CPU backend's: a numpy array that ONNX Runtime reads in place (an
``OrtValue`` over the same memory). The CUDA tensors are in ``cuda.py``; a test backend that
counts bytes wraps any of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

try:
    import onnxruntime as ort
except ImportError as err:  # neither extra was installed
    raise ImportError("edit-rt needs ONNX Runtime: pip install 'edit-rt[cpu]', or 'edit-rt[gpu]' on an NVIDIA machine") from err


@dataclass(frozen=True)
class TensorView:
    """The first ``prod(shape)`` elements of a device tensor, as a graph input or output."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    device: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


class DeviceTensor(Protocol):
    """A flat allocation of ``capacity`` elements of ``dtype`` in a backend's memory."""

    dtype: np.dtype
    capacity: int
    device: str

    def write(self, host: np.ndarray, offset: int = 0) -> None:
        """Copy ``host`` (contiguous) to elements ``offset..offset + host.size``."""

    def read(self, out: np.ndarray, offset: int = 0) -> None:
        """Copy elements ``offset..offset + out.size`` into ``out`` (contiguous), now."""

    def read_async(self, out: np.ndarray, offset: int = 0) -> None:
        """The same copy, landing when the backend next synchronizes (at once on the CPU)."""

    def move(self, dst: int, src: int, count: int) -> None:
        """Copy ``count`` elements from ``src`` to ``dst`` inside this tensor (no host trip):
        ``copy_from(self, dst, src, count)``."""

    def copy_from(self, src: "DeviceTensor", dst: int, src_offset: int, count: int) -> None:
        """Copy ``count`` elements of ``src`` (same backend and dtype) from ``src_offset`` to
        ``dst`` in this tensor, in the backend's own memory (no host trip)."""

    def view(self, shape: tuple[int, ...]) -> TensorView: ...

    def free(self) -> None: ...


def _check_fits(tensor: DeviceTensor, offset: int, count: int) -> None:
    if offset < 0 or offset + count > tensor.capacity:
        raise IndexError(f"elements {offset}..{offset + count} outside a tensor of {tensor.capacity}")


class HostTensor:
    """ONNX Runtime CPU memory: a numpy array, and an OrtValue over the same bytes."""

    device = "cpu"

    def __init__(self, capacity: int, dtype):
        self.dtype = np.dtype(dtype)
        self.capacity = capacity
        self.array = np.zeros(capacity, dtype=self.dtype)
        # ONNX Runtime binds CPU numpy memory without a copy: the OrtValue is this array.
        self.value = ort.OrtValue.ortvalue_from_numpy(self.array)

    def write(self, host: np.ndarray, offset: int = 0) -> None:
        _check_fits(self, offset, host.size)
        self.array[offset : offset + host.size] = host.reshape(-1)

    def read(self, out: np.ndarray, offset: int = 0) -> None:
        _check_fits(self, offset, out.size)
        out.reshape(-1)[...] = self.array[offset : offset + out.size]

    read_async = read

    def move(self, dst: int, src: int, count: int) -> None:
        self.copy_from(self, dst, src, count)

    def copy_from(self, src: "HostTensor", dst: int, src_offset: int, count: int) -> None:
        _check_fits(self, dst, count)
        _check_fits(src, src_offset, count)
        self.array[dst : dst + count] = src.array[src_offset : src_offset + count]

    def view(self, shape: tuple[int, ...]) -> TensorView:
        _check_fits(self, 0, math.prod(shape))
        return TensorView(self.array.ctypes.data, tuple(shape), self.dtype, self.device)

    def free(self) -> None:
        self.value = None
