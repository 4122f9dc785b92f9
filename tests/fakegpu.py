"""A simulated GPU for the tests: CUDA's runtime, TensorRT and ONNX Runtime's CUDA EP, on the CPU.

Written from the documented rules, not from edit-rt's code, so that code which breaks a rule
computes wrong results or fails here as it would on an NVIDIA GPU:

- **Streams** (CUDA Runtime API, "Streams", "Asynchronous Concurrent Execution"): work queued on
  a stream runs in order, at a time of the device's choosing; here, as late as the rules allow
  (only when the host synchronizes, or another stream waits on an event of it), which is the
  schedule that exposes a missing synchronization. A host read of device memory before the
  stream has run sees the old bytes.
- **Copies** (``cudaMemcpyAsync``): from pageable host memory the source is staged at the call
  (it may be reused at once), to pageable memory the call returns when the copy is done; with
  page-locked memory (``cudaMallocHost``) the copy reads or writes the host bytes when the stream
  runs it. A pageable copy cannot be captured into a graph.
- **Capture** (``cudaStreamBeginCapture``): work enqueued on a capturing stream is recorded, not
  run. In ``cudaStreamCaptureModeGlobal`` no thread may make a potentially unsafe call
  (``cudaMalloc``, ``cudaFree``, ``cudaMallocHost``, a synchronization) while the capture lasts;
  in ``ThreadLocal`` mode only the capturing thread may not. Such a call fails with
  ``cudaErrorStreamCaptureUnsupported`` and invalidates the capture
  (``cudaStreamEndCapture`` then fails with ``cudaErrorStreamCaptureInvalidated``).
- **TensorRT** (``IExecutionContext``): input shapes and tensor addresses are the context's
  state; ``enqueueV3`` launches kernels with the state it finds. A context is not thread-safe
  (here: it belongs to the thread that made it). A CUDA graph captured from a context replays
  the shapes and addresses of its capture: replaying it after the context was given other shapes
  or addresses is undefined (NVIDIA: re-capture when they change); here it is refused. A context
  made with ``USER_MANAGED`` allocation runs only after ``set_device_memory`` with enough bytes.
  A context is enqueued once outside a capture before one captures it, and again after its
  input shapes change (TensorRT's developer guide, "CUDA Graphs": "call enqueueV3() once before
  capturing the graph" so that it updates its internal state outside the capture).
  Tensor dtypes are the engine's (``get_tensor_dtype``), whatever the buffer was allocated as.
- **ONNX Runtime CUDA EP**: a session computes on the stream given as ``user_compute_stream``,
  else on its own; ``Run`` synchronizes its stream at the end unless the run option
  ``disable_synchronize_execution_providers`` is 1. With ``enable_cuda_graph`` a
  ``gpu_graph_id`` runs once as a regular run (the CUDA EP's ``min_num_runs_before_cuda_graph_capture_``,
  1: its allocations happen outside the capture), is captured on its second run and replayed
  with the addresses of that run, as ONNX Runtime's ``cuda_graph.cc`` does it: the capture is in
  *global* mode (a ``cudaMalloc``, ``cudaFree`` or sync by any thread while it lasts invalidates
  it, and the Run fails; ``FakeOrt.during_capture`` runs inside that window, where a test puts
  another thread's work) and the replay synchronizes the stream after its launch, whatever the
  run options say (a host wait per replayed step); a session whose nodes are not all on the CUDA
  EP refuses ``enable_cuda_graph`` at creation (``FakeOrt.cpu_ops``: the op types the simulated
  CUDA EP lacks).

The "kernels" compute the real result: each engine is an ONNX graph run by ONNX Runtime's CPU
provider on the bytes found in simulated device memory, so wrong ordering is a wrong image.
Violations of a rule that real hardware leaves undefined raise :class:`RuleViolation`.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import shutil
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np
import onnxruntime as real_ort

PLAN_MAGIC = b"EDITRT-SIMULATED-PLAN\n"
_ONNX_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
            "tensor(int32)": np.int32, "tensor(bool)": np.bool_}  # fmt: skip


class RuleViolation(AssertionError):
    """Code did what the documentation leaves undefined (or forbids outright)."""


class _Err:
    """cudaError_t: members compare by identity and have a ``name``, as cuda-python's enum."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


class cudaError_t:
    cudaSuccess = _Err("cudaSuccess")
    cudaErrorInvalidValue = _Err("cudaErrorInvalidValue")
    cudaErrorStreamCaptureUnsupported = _Err("cudaErrorStreamCaptureUnsupported")
    cudaErrorStreamCaptureInvalidated = _Err("cudaErrorStreamCaptureInvalidated")
    cudaErrorIllegalAddress = _Err("cudaErrorIllegalAddress")
    cudaErrorNoDevice = _Err("cudaErrorNoDevice")


OK = cudaError_t.cudaSuccess


def _check(result, what: str):
    """A cudart call's value, or a RuntimeError naming the call (ONNX Runtime's CUDA_CALL_THROW)."""
    err, *value = result if isinstance(result, tuple) else (result,)
    if err is not OK:
        raise RuntimeError(f"CUDA failure {err}: {what}")
    return value[0] if value else None


@dataclass
class _Stream:
    handle: int
    blocking: bool
    queue: deque = field(default_factory=deque)  # (seq, op)
    capture: Optional["_Capture"] = None
    seq: int = 0  # ops enqueued so far
    done: int = 0  # ops run so far


@dataclass
class _Capture:
    mode: str
    thread: int
    ops: list = field(default_factory=list)
    invalid: Optional[str] = None
    contexts: list = field(default_factory=list)  # (context, shapes, addresses) of each enqueueV3


@dataclass
class _Op:
    run: Callable[[], None]
    what: str
    context: Any = None  # a TensorRT enqueue: (context, shapes, addresses)


class FakeCudart:
    """cuda-python's ``cuda.bindings.runtime``: every call returns ``(error, *values)``."""

    cudaError_t = cudaError_t
    cudaStreamNonBlocking = 1
    cudaStreamDefault = 0

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice = "h2d"
        cudaMemcpyDeviceToHost = "d2h"
        cudaMemcpyDeviceToDevice = "d2d"
        cudaMemcpyDefault = "default"

    class cudaStreamCaptureMode:
        cudaStreamCaptureModeGlobal = "global"
        cudaStreamCaptureModeThreadLocal = "thread_local"
        cudaStreamCaptureModeRelaxed = "relaxed"

    def __init__(self):
        self.lock = threading.RLock()
        self.device: dict[int, np.ndarray] = {}  # base address -> bytes (cudaMalloc)
        self.pinned: dict[int, np.ndarray] = {}  # base address -> bytes (cudaMallocHost)
        self.streams: dict[int, _Stream] = {}
        self.handles = itertools.count(0x5000)
        self.graphs: dict[int, list[_Op]] = {}
        self.execs: dict[int, list[_Op]] = {}
        self.events: dict[int, tuple[int, int]] = {}  # event -> (stream, seq) recorded
        self.counts: dict[str, int] = {}
        self.kernel_threads: set[str] = set()  # threads that launched work touching an engine
        self.unsafe_threads: set[str] = set()  # threads that allocated, freed or synchronized
        self.legacy = self._new_stream(blocking=True)  # stream 0's stand-in
        self.peak_device_bytes = 0
        self.last_invalidation = ""  # why the last capture that failed was invalidated

    # --- bookkeeping ----------------------------------------------------------------------

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def _host_wait(self, why: str) -> None:
        """The host blocks until device work is done: every kind is counted under "host_waits"
        (a synchronization, a copy into pageable memory, an ONNX Runtime Run that syncs)."""
        self._count("host_waits")
        self._count(f"host_wait:{why}")

    def _new_stream(self, blocking: bool) -> _Stream:
        stream = _Stream(next(self.handles), blocking)
        self.streams[stream.handle] = stream
        return stream

    def _stream(self, handle) -> _Stream:
        handle = int(handle)
        if handle == 0:
            return self.legacy
        if handle not in self.streams:
            raise RuleViolation(f"stream {handle:#x} does not exist (destroyed, or never created)")
        return self.streams[handle]

    def region(self, ptr: int, nbytes: int) -> tuple[str, Optional[np.ndarray]]:
        """Which memory ``ptr..ptr+nbytes`` lies in: ('device'|'pinned', its bytes) or ('pageable', None)."""
        for kind, table in (("device", self.device), ("pinned", self.pinned)):
            for base, buf in table.items():
                if base <= ptr < base + buf.size:
                    if ptr + nbytes > base + buf.size:
                        raise RuleViolation(f"{nbytes} bytes at {ptr:#x} run past a {kind} allocation of {buf.size}")
                    return kind, buf[ptr - base : ptr - base + nbytes]
        return "pageable", None

    def device_bytes(self, ptr: int, nbytes: int) -> np.ndarray:
        kind, view = self.region(ptr, nbytes)
        if kind != "device":
            raise RuleViolation(f"{ptr:#x} is not device memory (a kernel read {kind} memory)")
        return view

    def _unsafe_call(self, name: str) -> Optional[_Err]:
        """The capture rule for a potentially unsafe call made by this thread."""
        me = threading.get_ident()
        self.unsafe_threads.add(threading.current_thread().name)
        for stream in self.streams.values():
            c = stream.capture
            if c is None or c.mode == "relaxed":
                continue
            if c.mode == "global" or c.thread == me:
                c.invalid = f"{name} during a {c.mode} capture"
                return cudaError_t.cudaErrorStreamCaptureUnsupported
        return None

    def _enqueue(self, stream: _Stream, op: _Op) -> None:
        if stream.capture is not None:
            stream.capture.ops.append(op)
            if op.context is not None:
                stream.capture.contexts.append(op.context)
            return
        stream.seq += 1
        stream.queue.append((stream.seq, op))
        if stream is self.legacy or stream.blocking:
            pass  # blocking streams still run lazily; the legacy stream's sync calls flush them

    def run_stream(self, stream: _Stream, upto: Optional[int] = None) -> None:
        """Let the device run ``stream``'s queued work (up to op ``upto``)."""
        with self.lock:
            while stream.queue and (upto is None or stream.queue[0][0] <= upto):
                seq, op = stream.queue.popleft()
                op.run()
                stream.done = seq

    # --- memory -----------------------------------------------------------------------------

    def cudaMalloc(self, nbytes: int):
        with self.lock:
            err = self._unsafe_call("cudaMalloc")
            if err is not None:
                return err, 0
            self._count("cudaMalloc")
            # Fresh device memory is not zeroed: fill it with NaN-ish bytes so unset reads show.
            buf = np.full(max(1, int(nbytes)), 0xFF, dtype=np.uint8)
            self.device[buf.ctypes.data] = buf
            self.peak_device_bytes = max(self.peak_device_bytes, sum(b.size for b in self.device.values()))
            return OK, buf.ctypes.data

    def cudaFree(self, ptr: int):
        with self.lock:
            err = self._unsafe_call("cudaFree")
            if err is not None:
                return (err,)
            self._count("cudaFree")
            for stream in self.streams.values():  # cudaFree synchronizes the device first
                self.run_stream(stream)
            if int(ptr) not in self.device:
                return (cudaError_t.cudaErrorInvalidValue,)
            del self.device[int(ptr)]
            return (OK,)

    def cudaMallocHost(self, nbytes: int):
        with self.lock:
            err = self._unsafe_call("cudaMallocHost")
            if err is not None:
                return err, 0
            self._count("cudaMallocHost")
            buf = np.zeros(max(1, int(nbytes)), dtype=np.uint8)
            self.pinned[buf.ctypes.data] = buf
            return OK, buf.ctypes.data

    def cudaFreeHost(self, ptr: int):
        with self.lock:
            err = self._unsafe_call("cudaFreeHost")
            if err is not None:
                return (err,)
            for stream in self.streams.values():
                self.run_stream(stream)
            self.pinned.pop(int(ptr), None)
            return (OK,)

    def cudaMemsetAsync(self, ptr: int, value: int, nbytes: int, stream):
        with self.lock:
            s = self._stream(stream)
            target = self.device_bytes(int(ptr), int(nbytes))
            self._enqueue(s, _Op(lambda: target.__setitem__(slice(None), value), "memset"))
            return (OK,)

    def cudaMemcpyAsync(self, dst: int, src: int, nbytes: int, kind, stream):
        with self.lock:
            s = self._stream(stream)
            dst, src, nbytes = int(dst), int(src), int(nbytes)
            dst_kind, _ = self.region(dst, nbytes)
            src_kind, _ = self.region(src, nbytes)
            self._count(f"memcpy_{src_kind}_to_{dst_kind}")
            if s.capture is not None and "pageable" in (src_kind, dst_kind):
                s.capture.invalid = "a copy from or to pageable host memory"
                return (cudaError_t.cudaErrorStreamCaptureUnsupported,)
            if src_kind == "pageable":
                staged = ctypes.string_at(src, nbytes)  # copied to a staging buffer at the call
                op = _Op(lambda: ctypes.memmove(dst, staged, nbytes), "memcpy h2d (staged)")
            else:
                op = _Op(lambda: ctypes.memmove(dst, src, nbytes), f"memcpy {src_kind}->{dst_kind}")
            self._enqueue(s, op)
            if dst_kind == "pageable":  # returns only once the copy has completed
                self._host_wait("memcpy to pageable")
                self.run_stream(s)
            return (OK,)

    # --- streams and events -----------------------------------------------------------------

    def cudaStreamCreate(self):
        with self.lock:
            return OK, self._new_stream(blocking=True).handle

    def cudaStreamCreateWithFlags(self, flags):
        with self.lock:
            return OK, self._new_stream(blocking=int(flags) != self.cudaStreamNonBlocking).handle

    def cudaStreamDestroy(self, stream):
        with self.lock:
            s = self._stream(stream)
            self.run_stream(s)
            del self.streams[s.handle]
            return (OK,)

    def cudaStreamSynchronize(self, stream):
        with self.lock:
            s = self._stream(stream)
            if s.capture is not None:
                s.capture.invalid = "cudaStreamSynchronize on the capturing stream"
                return (cudaError_t.cudaErrorStreamCaptureUnsupported,)
            err = self._unsafe_call("cudaStreamSynchronize")
            if err is not None:
                return (err,)
            self._count("cudaStreamSynchronize")
            self._host_wait("cudaStreamSynchronize")
            self.run_stream(s)
            return (OK,)

    def cudaDeviceSynchronize(self):
        with self.lock:
            err = self._unsafe_call("cudaDeviceSynchronize")
            if err is not None:
                return (err,)
            self._host_wait("cudaDeviceSynchronize")
            for s in list(self.streams.values()):
                self.run_stream(s)
            return (OK,)

    def cudaEventCreate(self):
        with self.lock:
            handle = next(self.handles)
            self.events[handle] = (0, 0)
            return OK, handle

    def cudaEventRecord(self, event, stream):
        with self.lock:
            s = self._stream(stream)
            self.events[int(event)] = (s.handle, s.seq)
            return (OK,)

    def cudaStreamWaitEvent(self, stream, event, flags=0):
        with self.lock:
            s = self._stream(stream)
            other, seq = self.events[int(event)]
            if other in self.streams:
                self._enqueue(s, _Op(lambda: self.run_stream(self.streams[other], seq), "wait event"))
            return (OK,)

    def cudaEventDestroy(self, event):
        self.events.pop(int(event), None)
        return (OK,)

    # --- graphs -----------------------------------------------------------------------------

    def cudaStreamBeginCapture(self, stream, mode):
        with self.lock:
            s = self._stream(stream)
            if s.capture is not None:
                return (cudaError_t.cudaErrorInvalidValue,)
            if s is self.legacy:
                return (cudaError_t.cudaErrorStreamCaptureUnsupported,)  # the legacy stream cannot capture
            s.capture = _Capture(mode, threading.get_ident())
            self._count("cudaStreamBeginCapture")
            return (OK,)

    def cudaStreamEndCapture(self, stream):
        with self.lock:
            s = self._stream(stream)
            capture, s.capture = s.capture, None
            if capture is None:
                return cudaError_t.cudaErrorInvalidValue, None
            if capture.invalid:
                self.last_invalidation = capture.invalid
                return cudaError_t.cudaErrorStreamCaptureInvalidated, None
            handle = next(self.handles)
            self.graphs[handle] = capture.ops
            self._count("captured")
            return OK, handle

    def cudaGraphInstantiate(self, graph, flags=0):
        with self.lock:
            if int(graph) not in self.graphs:
                return cudaError_t.cudaErrorInvalidValue, None
            handle = next(self.handles)
            self.execs[handle] = list(self.graphs[int(graph)])
            return OK, handle

    def cudaGraphLaunch(self, graph_exec, stream):
        with self.lock:
            s = self._stream(stream)
            ops = self.execs.get(int(graph_exec))
            if ops is None:
                return (cudaError_t.cudaErrorInvalidValue,)
            for op in ops:
                if op.context is not None:
                    context, shapes, addresses = op.context
                    context.check_replay(shapes, addresses)
            self._count("cudaGraphLaunch")
            self.kernel_threads.add(threading.current_thread().name)
            for op in ops:
                self._enqueue(s, op)
            return (OK,)

    def cudaGraphExecDestroy(self, graph_exec):
        self.execs.pop(int(graph_exec), None)
        self._count("cudaGraphExecDestroy")
        return (OK,)

    def cudaGraphDestroy(self, graph):
        self.graphs.pop(int(graph), None)
        return (OK,)

    def cudaGetDeviceCount(self):
        return OK, 1

    # --- the host's view (for tests) --------------------------------------------------------

    def pending(self) -> int:
        return sum(len(s.queue) for s in self.streams.values())


# --- TensorRT ----------------------------------------------------------------------------------


def write_plan(path: Path, onnx_path: Path, dtypes: Optional[dict[str, str]] = None,
               profiles: Optional[list[dict[str, list]]] = None) -> None:  # fmt: skip
    """A simulated plan: the ONNX graph it computes, the engine's tensor dtypes where they
    differ from the graph's (an fp16 engine's K/V inputs, say), and its optimization profiles'
    shapes (one per served latent size where the graph has spatial axes)."""
    spec = {"onnx": str(onnx_path), "dtypes": dtypes or {}, "profiles": profiles or [{}]}
    Path(path).write_bytes(PLAN_MAGIC + json.dumps(spec).encode())


class _DataType:
    def __init__(self, name: str, np_dtype):
        self.name, self.np = name, np.dtype(np_dtype)

    def __repr__(self) -> str:
        return f"DataType.{self.name}"


class FakeTensorRT(ModuleType):
    """The parts of the ``tensorrt`` module the runtime uses (TensorRT 10's Python API)."""

    def __init__(self, cudart: FakeCudart):
        super().__init__("tensorrt")
        self.__version__ = "10.13.0.sim"
        self.cudart = cudart
        self.contexts: list["FakeContext"] = []
        self.DataType = SimpleNamespace(FLOAT=_DataType("FLOAT", np.float32), HALF=_DataType("HALF", np.float16),
                                        INT64=_DataType("INT64", np.int64), INT32=_DataType("INT32", np.int32),
                                        BOOL=_DataType("BOOL", np.bool_))  # fmt: skip
        self.TensorIOMode = SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
        self.ExecutionContextAllocationStrategy = SimpleNamespace(STATIC="STATIC", ON_PROFILE_CHANGE="ON_PROFILE_CHANGE",
                                                                  USER_MANAGED="USER_MANAGED")  # fmt: skip
        fake = self

        class Logger:
            WARNING, ERROR, INFO = 2, 1, 3

            def __init__(self, level=2):
                self.level = level

        class Runtime:
            def __init__(self, logger):
                self.logger = logger

            def deserialize_cuda_engine(self, plan: bytes):
                if not plan.startswith(PLAN_MAGIC):
                    return None
                return FakeEngine(fake, json.loads(plan[len(PLAN_MAGIC) :]))

        self.Logger, self.Runtime = Logger, Runtime

    def nptype(self, dtype: _DataType):
        return dtype.np.type

    def dtype_of(self, np_dtype) -> _DataType:
        for dt in vars(self.DataType).values():
            if dt.np == np.dtype(np_dtype):
                return dt
        raise TypeError(np_dtype)


class FakeEngine:
    # Scratch ("activation") memory each execution context needs, in bytes.
    DEVICE_MEMORY = 1 << 16

    def __init__(self, trt: FakeTensorRT, spec: dict):
        self.trt = trt
        self.name = Path(spec["onnx"]).stem
        self.session = real_ort.InferenceSession(spec["onnx"], providers=["CPUExecutionProvider"])
        self.onnx_dtype = {v.name: np.dtype(_ONNX_NP[v.type]) for v in [*self.session.get_inputs(), *self.session.get_outputs()]}
        self.dtypes = {n: np.dtype(spec["dtypes"].get(n, d)) for n, d in self.onnx_dtype.items()}
        self.inputs = [v.name for v in self.session.get_inputs()]
        self.outputs = [v.name for v in self.session.get_outputs()]
        self.onnx_shape = {v.name: v.shape for v in [*self.session.get_inputs(), *self.session.get_outputs()]}
        self.profiles = [{n: [tuple(s) for s in shapes] for n, shapes in profile.items()} for profile in spec["profiles"]]
        self.num_io_tensors = len(self.inputs) + len(self.outputs)
        self.device_memory_size_v2 = self.DEVICE_MEMORY
        self.num_optimization_profiles = len(self.profiles)
        self._out_shapes: dict[tuple, dict[str, tuple]] = {}

    def get_tensor_name(self, i: int) -> str:
        return [*self.inputs, *self.outputs][i]

    def get_tensor_mode(self, name: str):
        return self.trt.TensorIOMode.INPUT if name in self.inputs else self.trt.TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str):
        return self.trt.dtype_of(self.dtypes[name])

    def get_tensor_shape(self, name: str):
        return tuple(d if isinstance(d, int) else -1 for d in self.onnx_shape[name])

    def get_tensor_profile_shape(self, name: str, profile_index: int):
        if not 0 <= profile_index < self.num_optimization_profiles:
            raise RuleViolation(f"{self.name}: no optimization profile {profile_index} ({self.num_optimization_profiles} built)")
        profile = self.profiles[profile_index]
        if name not in profile:
            shape = self.get_tensor_shape(name)
            return [shape, shape, shape]
        return profile[name]

    def get_device_memory_size_for_profile_v2(self, profile_index: int) -> int:
        return self.DEVICE_MEMORY

    def create_execution_context(self, strategy=None):
        context = FakeContext(self, strategy or self.trt.ExecutionContextAllocationStrategy.STATIC)
        self.trt.contexts.append(context)
        return context

    def output_shapes(self, shapes: dict[str, tuple]) -> dict[str, tuple]:
        key = tuple(sorted(shapes.items()))
        if key not in self._out_shapes:
            feeds = {n: np.zeros(shapes[n], dtype=self.onnx_dtype[n]) for n in self.inputs}
            outs = self.session.run(self.outputs, feeds)
            self._out_shapes[key] = {n: tuple(o.shape) for n, o in zip(self.outputs, outs)}
        return self._out_shapes[key]


class FakeContext:
    """An IExecutionContext: shapes and addresses are its state, and it has one owner thread."""

    def __init__(self, engine: FakeEngine, strategy):
        self.engine = engine
        self.owner = threading.get_ident()
        self.owner_name = threading.current_thread().name
        self.strategy = strategy
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}
        self.device_memory: Optional[tuple[int, int]] = None
        self.enqueues = 0
        self.warm_shapes: Optional[dict] = None  # the shapes of its last enqueue outside a capture
        self.profile_index = 0  # a new context starts on profile 0 (TensorRT's default)

    def _owned(self, call: str) -> None:
        if threading.get_ident() != self.owner:
            raise RuleViolation(
                f"IExecutionContext of {self.engine.name} used ({call}) from thread "
                f"{threading.current_thread().name!r}; it belongs to {self.owner_name!r} (a context is not thread-safe)"
            )

    def set_optimization_profile_async(self, index: int, stream_handle: int) -> bool:
        """TensorRT: select profile ``index`` (shapes set before are invalidated); a profile
        the engine lacks is an error."""
        self._owned("set_optimization_profile_async")
        if not 0 <= index < self.engine.num_optimization_profiles:
            raise RuleViolation(f"{self.engine.name}: set_optimization_profile_async({index}) of "
                                f"{self.engine.num_optimization_profiles} profiles")  # fmt: skip
        self.profile_index = index
        self.shapes.clear()
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        self._owned("set_input_shape")
        shape = tuple(int(d) for d in shape)
        lo, _, hi = self.engine.get_tensor_profile_shape(name, self.profile_index)
        if len(shape) != len(lo) or any(not a <= d <= b for a, d, b in zip(lo, shape, hi)):
            return False  # TensorRT logs an error and returns false outside the profile
        self.shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str):
        self._owned("get_tensor_shape")
        if name in self.engine.inputs:
            return self.shapes.get(name, self.engine.get_tensor_shape(name))
        return self.engine.output_shapes(self.shapes)[name]

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self._owned("set_tensor_address")
        self.addresses[name] = int(ptr)
        return True

    def set_device_memory(self, ptr: int, size: int) -> None:
        self._owned("set_device_memory")
        self.device_memory = (int(ptr), int(size))

    def check_replay(self, shapes: dict, addresses: dict) -> None:
        if shapes != self.shapes or addresses != self.addresses:
            changed = sorted(n for n in set(shapes) | set(self.shapes) if shapes.get(n) != self.shapes.get(n))
            moved = sorted(n for n in set(addresses) | set(self.addresses) if addresses.get(n) != self.addresses.get(n))
            raise RuleViolation(
                f"a CUDA graph captured from the {self.engine.name} context is replayed after the context "
                f"was given other shapes {changed} or addresses {moved}: re-capture, or one context per graph"
            )

    def execute_async_v3(self, stream_handle: int) -> bool:
        self._owned("execute_async_v3")
        cudart = self.engine.trt.cudart
        if self.strategy == "USER_MANAGED":
            if self.device_memory is None:
                raise RuleViolation(f"{self.engine.name}: USER_MANAGED context enqueued before set_device_memory")
            ptr, size = self.device_memory
            if size < self.engine.DEVICE_MEMORY or cudart.region(ptr, size)[0] != "device":
                raise RuleViolation(f"{self.engine.name}: the context's device memory is too small or not device memory")
        missing = [n for n in self.engine.inputs if n not in self.shapes] + [
            n for n in self.engine.inputs + self.engine.outputs if n not in self.addresses]  # fmt: skip
        if missing:
            raise RuleViolation(f"{self.engine.name}: enqueueV3 with unset shapes or addresses {missing}")
        shapes, addresses = dict(self.shapes), dict(self.addresses)
        engine = self.engine

        def kernel() -> None:
            feeds = {}
            for n in engine.inputs:
                dt, shape = engine.dtypes[n], shapes[n]
                raw = cudart.device_bytes(addresses[n], int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
                feeds[n] = raw.view(dt).reshape(shape).astype(engine.onnx_dtype[n])
            outs = engine.session.run(engine.outputs, feeds)
            for n, value in zip(engine.outputs, outs):
                dt = engine.dtypes[n]
                target = cudart.device_bytes(addresses[n], value.size * dt.itemsize)
                target[...] = np.ascontiguousarray(value.astype(dt)).view(np.uint8).reshape(-1)

        with cudart.lock:
            stream = cudart._stream(stream_handle)
            if stream.capture is None:
                self.warm_shapes = shapes
            elif self.warm_shapes != shapes:
                raise RuleViolation(f"{engine.name}: enqueueV3 captured before the context was enqueued once outside a "
                                    "capture with these shapes (TensorRT: call enqueueV3 once before capturing)")  # fmt: skip
            cudart.kernel_threads.add(threading.current_thread().name)
            cudart._enqueue(stream, _Op(kernel, f"enqueueV3 {engine.name}", (self, shapes, addresses)))
        self.enqueues += 1
        return True


def write_trt_engines(manifest, out: Path, profile, dtypes: Optional[dict[str, dict[str, str]]] = None,
                      device: str = "Simulated GPU", version: str = "10.13.0.sim") -> Path:  # fmt: skip
    """A ``trt`` engines folder of simulated plans for ``manifest``'s graphs, with the
    engines.json `make engines` writes (same profile, per graph ``dtypes`` overrides)."""
    from edit_rt.runtime.engine.engines import GRAPHS, EngineSet, write_engines_json
    from edit_rt.runtime.engine.profiles import spatial

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    graphs = {}
    for graph in GRAPHS:
        sizes = profile.latent_sizes() if spatial(manifest.graphs[graph].inputs) else profile.latent_sizes()[:1]
        shapes = [profile.at(size).shapes(manifest.graphs[graph].inputs, graph) for size in sizes]
        write_plan(out / f"{graph}.plan", manifest.path(graph), (dtypes or {}).get(graph),
                   [{n: list(s) for n, s in one.items()} for one in shapes])  # fmt: skip
        graphs[graph] = {"file": f"{graph}.plan", "source_onnx": str(manifest.path(graph)),
                         "source_sha256": manifest.data["graphs"][graph]["sha256"]}  # fmt: skip
    write_engines_json(EngineSet(out, "trt", profile, "fp16", {"tensorrt": version}, device, graphs))
    return out


# --- ONNX Runtime's CUDA execution provider -------------------------------------------------------


class FakeOrtValue:
    """An OrtValue in simulated device memory (``ortvalue_from_shape_and_type(..., 'cuda', 0)``)."""

    def __init__(self, cudart: FakeCudart, shape, dtype):
        self.cudart = cudart
        self._shape = list(shape)
        self._dtype = np.dtype(dtype)
        nbytes = int(np.prod(self._shape, dtype=np.int64)) * self._dtype.itemsize
        err, self.ptr = cudart.cudaMalloc(nbytes)
        if err is not OK:
            raise RuntimeError(f"ONNX Runtime could not allocate CUDA memory ({err.name})")
        self.nbytes = nbytes

    def __del__(self) -> None:
        # ONNX Runtime returns an OrtValue's memory to its arena when the value is released
        self.cudart.device.pop(getattr(self, "ptr", 0), None)

    def data_ptr(self) -> int:
        return self.ptr

    def shape(self):
        return list(self._shape)

    def device_name(self) -> str:
        return "cuda"

    def _legacy_sync(self) -> None:
        # cudaMemcpy on the legacy stream: waits for blocking streams, not for non-blocking ones
        for s in list(self.cudart.streams.values()):
            if s.blocking:
                self.cudart.run_stream(s)

    def update_inplace(self, array: np.ndarray) -> None:
        with self.cudart.lock:
            self._legacy_sync()
            data = np.ascontiguousarray(array, dtype=self._dtype).view(np.uint8).reshape(-1)
            self.cudart.device_bytes(self.ptr, data.size)[...] = data

    def numpy(self) -> np.ndarray:
        with self.cudart.lock:
            self._legacy_sync()
            return self.cudart.device_bytes(self.ptr, self.nbytes).copy().view(self._dtype).reshape(self._shape)


class FakeIOBinding:
    def __init__(self):
        self.inputs: dict[str, tuple] = {}
        self.outputs: dict[str, tuple] = {}

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr):
        self.inputs[name] = (device_type, np.dtype(element_type), tuple(shape), int(buffer_ptr))

    def bind_output(self, name, device_type="cpu", device_id=0, element_type=None, shape=None, buffer_ptr=None):
        self.outputs[name] = (device_type, np.dtype(element_type), tuple(shape), int(buffer_ptr))

    def clear_binding_inputs(self):
        self.inputs.clear()

    def clear_binding_outputs(self):
        self.outputs.clear()


def _run_entry(run_options, key: str) -> str:
    if run_options is None:
        return ""
    try:
        return run_options.get_run_config_entry(key)
    except Exception:  # onnxruntime raises for a key never set
        return ""


class FakeCudaSession:
    """An InferenceSession on CUDAExecutionProvider: computes on the CPU, reads and writes
    simulated device memory, on the ``user_compute_stream`` it was given or on its own."""

    def __init__(self, fake_ort: "FakeOrt", path: str, options, providers):
        self.cudart = fake_ort.cudart
        self.fake_ort = fake_ort
        self.cpu = real_ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        name, opts = providers[0] if isinstance(providers[0], tuple) else (providers[0], {})
        self.provider_options = dict(opts)
        self.cuda_graph = opts.get("enable_cuda_graph") == "1"
        if self.cuda_graph and fake_ort.cpu_ops:
            import onnx

            ops = {n.op_type for n in onnx.load(path, load_external_data=False).graph.node} & fake_ort.cpu_ops
            if ops:  # ONNX Runtime's words (inference_session.cc)
                raise RuntimeError("This session cannot use the CUDA Graph feature as requested by the user as all compute "
                                   f"graph nodes have not been partitioned to the CUDA EP ({sorted(ops)} on the CPU)")
        if "user_compute_stream" in opts:
            self.stream = self.cudart._stream(int(opts["user_compute_stream"]))
        else:
            self.stream = self.cudart._new_stream(blocking=True)  # ONNX Runtime's own stream
        self.captured: dict[str, tuple] = {}  # gpu_graph_id -> (inputs, outputs) of its capture
        self.graph_runs: dict[str, int] = {}  # gpu_graph_id -> its runs so far
        self.execs: dict[str, Any] = {}  # gpu_graph_id -> its instantiated CUDA graph
        self.runs = 0

    def get_inputs(self):
        return self.cpu.get_inputs()

    def get_outputs(self):
        return self.cpu.get_outputs()

    def get_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def io_binding(self):
        return FakeIOBinding()

    def run(self, output_names, feeds, run_options=None):
        self.cudart.kernel_threads.add(threading.current_thread().name)
        return self.cpu.run(output_names, feeds)

    def run_with_iobinding(self, io: FakeIOBinding, run_options=None) -> None:
        graph_id = _run_entry(run_options, "gpu_graph_id")
        state = (dict(io.inputs), dict(io.outputs))
        if self.cuda_graph and graph_id not in ("", "-1"):
            if graph_id in self.captured and self.captured[graph_id] != state:
                raise RuleViolation(f"gpu_graph_id {graph_id} replayed with other bound addresses or shapes than its capture")
            self.captured.setdefault(graph_id, state)
        inputs, outputs = state
        cudart = self.cudart

        def kernel() -> None:
            feeds = {}
            for name, (device, dt, shape, ptr) in inputs.items():
                nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                raw = cudart.device_bytes(ptr, nbytes) if device == "cuda" else np.ctypeslib.as_array(
                    (ctypes.c_uint8 * nbytes).from_address(ptr))  # fmt: skip
                feeds[name] = raw.view(dt).reshape(shape).copy()
            outs = self.cpu.run(list(outputs), feeds)
            for (name, (device, dt, shape, ptr)), value in zip(outputs.items(), outs):
                cudart.device_bytes(ptr, value.nbytes)[...] = np.ascontiguousarray(value, dtype=dt).view(np.uint8).reshape(-1)

        sync = _run_entry(run_options, "disable_synchronize_execution_providers") != "1"
        graphed = self.cuda_graph and graph_id not in ("", "-1")
        runs = self.graph_runs[graph_id] = self.graph_runs.get(graph_id, 0) + 1
        if graphed and runs >= 2 and graph_id not in self.execs:  # cuda_graph.cc CaptureBegin: global mode
            self._capture(graph_id, kernel)
        if graphed and runs >= 2:
            # cuda_graph.cc: Replay() launches and then synchronizes the stream, run options or not
            with cudart.lock:
                _check(cudart.cudaGraphLaunch(self.execs[graph_id], self.stream.handle), "cudaGraphLaunch")
                cudart._host_wait("ort Run")
                cudart.run_stream(self.stream)
            self.runs += 1
            return
        with cudart.lock:
            cudart.kernel_threads.add(threading.current_thread().name)
            cudart._enqueue(self.stream, _Op(kernel, "ort run"))
            if sync:
                cudart._host_wait("ort Run")
                cudart.run_stream(self.stream)  # Run synchronizes its stream before returning, unless told not to
        self.runs += 1

    def _capture(self, graph_id: str, kernel: Callable[[], None]) -> None:
        """The Run that captures: CaptureBegin (global mode), the kernels, CaptureEnd; a capture
        some thread invalidated fails the Run with CUDA's error, as ONNX Runtime's CUDA_CALL does."""
        cudart = self.cudart
        _check(cudart.cudaStreamBeginCapture(self.stream.handle, cudart.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal),
               "cudaStreamBeginCapture")  # fmt: skip
        self.fake_ort.during_capture()
        with cudart.lock:
            cudart.kernel_threads.add(threading.current_thread().name)
            cudart._enqueue(self.stream, _Op(kernel, "ort run"))
        err, graph = cudart.cudaStreamEndCapture(self.stream.handle)
        if err is not OK:
            raise RuntimeError(f"CUDA failure {err}: {cudart.last_invalidation} ; GPU=0 ; "
                               "expr=cudaStreamEndCapture(stream_, &graph_)")  # fmt: skip
        self.execs[graph_id] = _check(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")


class FakeOrt(ModuleType):
    """``onnxruntime`` with a CUDA provider on the simulated GPU; everything else is the real one."""

    def __init__(self, cudart: FakeCudart):
        super().__init__("onnxruntime")
        self.cudart = cudart
        self.sessions: list[FakeCudaSession] = []
        self.cpu_ops: set[str] = set()  # op types the simulated CUDA EP lacks (they would run on the CPU)
        self.during_capture: Callable[[], None] = lambda: None  # what happens while a session captures
        for name in ("SessionOptions", "RunOptions", "GraphOptimizationLevel", "__version__"):
            setattr(self, name, getattr(real_ort, name))
        fake = self

        class OrtValue:
            @staticmethod
            def ortvalue_from_shape_and_type(shape, dtype, device="cpu", device_id=0):
                if device == "cuda":
                    return FakeOrtValue(fake.cudart, shape, dtype)
                return real_ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, device_id)

            ortvalue_from_numpy = staticmethod(real_ort.OrtValue.ortvalue_from_numpy)

        self.OrtValue = OrtValue

    def get_available_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def InferenceSession(self, path, sess_options=None, providers=None):
        from .ort_options import PROVIDERS

        for provider in providers or ():
            name, options = provider if isinstance(provider, tuple) else (provider, {})
            unknown = sorted(set(options) - PROVIDERS.get(name, set(options)))
            if unknown:  # ProviderOptionsParser::Parse's words
                raise RuntimeError(f"[ONNXRuntimeError] : 1 : FAIL : Unknown provider option: \"{unknown[0]}\".")
        first = providers[0] if providers else "CPUExecutionProvider"
        if (first[0] if isinstance(first, tuple) else first) == "CUDAExecutionProvider":
            session = FakeCudaSession(self, str(path), sess_options, providers)
            self.sessions.append(session)
            return session
        return real_ort.InferenceSession(path, sess_options, providers=providers)


# --- TensorRT's builder, through the Polygraphy calls export/compile/engines.py makes -----------------------


class FakeTrtBuilder:
    """``polygraphy.backend.trt``'s builder functions as ``export/compile/engines.py`` calls them, holding a
    build to what TensorRT's documents require, then writing simulated plans (:func:`write_plan`)
    that the simulated runtime above loads:

    - the network is parsed strongly typed (TensorRT 10: the precision comes from the ONNX
      graph's own types; `make engines` builds fp16 that way);
    - no precision builder flag with a strongly typed network (``fp16``, ``bf16``, ``int8``,
      ``tf32``: deprecated for it, and refused by the builder);
    - an optimization profile for every input with a dynamic dimension, of the input's rank,
      static dimensions as the network's, and ``min <= opt <= max`` on every axis;
    - (Polygraphy's ``Profile``) nothing else in a profile than the network's inputs.
    """

    PRECISION_FLAGS = ("fp16", "bf16", "int8", "tf32", "fp8")

    def __init__(self, stash: Path):
        self.stash = Path(stash)
        self.stash.mkdir(parents=True, exist_ok=True)
        self.built: list[str] = []

    def install(self, monkeypatch) -> "FakeTrtBuilder":
        import polygraphy.backend.trt as polygraphy_trt

        builder = self

        class Profile(dict):
            def add(self, name: str, min, opt, max) -> "Profile":
                lo, mid, hi = (tuple(int(d) for d in s) for s in (min, opt, max))
                if not len(lo) == len(mid) == len(hi):
                    raise RuleViolation(f"profile for {name}: min/opt/max of different ranks {lo} {mid} {hi}")
                if any(d < 0 for d in lo) or not all(a <= b <= c for a, b, c in zip(lo, mid, hi)):
                    raise RuleViolation(f"profile for {name}: needs 0 <= min <= opt <= max on every axis, got {lo} / {mid} / {hi}")
                self[name] = (lo, mid, hi)
                return self

        def network_from_onnx_path(path, strongly_typed=False, **kwargs):
            import onnx

            if not strongly_typed:
                raise RuleViolation(f"{path}: parsed weakly typed; edit-rt's plans are strongly typed (the ONNX carries the precision)")
            model = onnx.load(str(path), load_external_data=False)
            inputs = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
            return SimpleNamespace(path=Path(path), inputs=inputs)

        def CreateConfig(profiles=None, load_timing_cache=None, **flags):
            used = [f for f in builder.PRECISION_FLAGS if flags.get(f)]
            if used:
                raise RuleViolation(f"precision flags {used} with a strongly typed network (deprecated; the builder refuses them)")
            return SimpleNamespace(profiles=list(profiles or []))

        def engine_bytes_from_network(network, config, save_timing_cache=None):
            dynamic = {n for n, dims in network.inputs.items() if any(isinstance(d, str) or d <= 0 for d in dims)}
            if dynamic and not config.profiles:
                raise RuleViolation(f"{network.path.name}: dynamic inputs {sorted(dynamic)} and no optimization profile")
            for k, profile in enumerate(config.profiles):
                if set(profile) - set(network.inputs):
                    raise RuleViolation(f"{network.path.name}: profile {k} names no input {sorted(set(profile) - set(network.inputs))}")
                for name in dynamic:
                    if name not in profile:
                        raise RuleViolation(f"{network.path.name}: profile {k} gives no shapes for dynamic input {name}")
                for name, (lo, opt, hi) in profile.items():
                    dims = network.inputs[name]
                    if len(dims) != len(lo) or any(isinstance(d, int) and d > 0 and not lo[i] == opt[i] == hi[i] == d
                                                   for i, d in enumerate(dims)):  # fmt: skip
                        raise RuleViolation(f"{network.path.name}: profile {k} for {name} {lo}/{opt}/{hi} does not fit its dims {dims}")
            source = builder.stash / network.path.name  # the plan holds its graph: a copy outlives the build's staging
            shutil.copyfile(network.path, source)
            builder.built.append(network.path.name.split(".")[0])
            profiles = [{n: [list(s) for s in shapes] for n, shapes in p.items()} for p in config.profiles]
            spec = {"onnx": str(source), "dtypes": {}, "profiles": profiles or [{}]}
            return PLAN_MAGIC + json.dumps(spec).encode()

        monkeypatch.setattr(polygraphy_trt, "Profile", Profile)
        monkeypatch.setattr(polygraphy_trt, "network_from_onnx_path", network_from_onnx_path)
        monkeypatch.setattr(polygraphy_trt, "CreateConfig", CreateConfig)
        monkeypatch.setattr(polygraphy_trt, "engine_bytes_from_network", engine_bytes_from_network)
        return self
