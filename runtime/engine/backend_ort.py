"""The ONNX Runtime backends: ``ort-cpu``, ``ort-cuda`` and ``ort-tensorrt`` (see backend.py).

- :class:`OrtGraph`: one ONNX graph in a session on its execution provider; ``infer`` for the
  calls outside the step loop, ``bind`` for the loop's resident slots (an IOBinding);
- :class:`OrtDevice`: what the graphs of one pipeline share: host memory on the CPU; on a GPU
  provider one stream handed to every session (``user_compute_stream``) with cuda-python, or
  ONNX Runtime's own device memory and copies (:class:`OrtCudaTensor`) without it.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import onnxruntime as ort

from ..errors import ArtifactError, ConfigError
from .backend import _PROVIDERS, cuda_python_available
from .device import DeviceTensor, HostTensor, TensorView, _check_fits

log = logging.getLogger(__name__)

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
               "tensor(int32)": np.int32, "tensor(bool)": np.bool_, "tensor(bfloat16)": np.float32}  # fmt: skip


class OrtCudaTensor:
    """Device memory that ONNX Runtime owns (an ``OrtValue`` on ``cuda``), copied with its own
    calls, for ``ort-cuda`` without cuda-python: a host mirror takes the writes and goes up whole
    before the next run (``update_inplace``, a synchronous copy); what a run computed comes down
    whole when the host first reads it. Only rows joining and rows finishing cause copies; with
    cuda-python the runtime uses :class:`~edit_rt.runtime.engine.cuda.CudaTensor` on ONNX Runtime's
    stream instead, copying only the rows it touches."""

    device = "cuda"

    def __init__(self, capacity: int, dtype, registry: "OrtDevice"):
        self.dtype = np.dtype(dtype)
        self.capacity = capacity
        self.value = ort.OrtValue.ortvalue_from_shape_and_type([max(1, capacity)], self.dtype, "cuda", 0)
        self.ptr = int(self.value.data_ptr())
        self.mirror = np.zeros(max(1, capacity), dtype=self.dtype)
        self.host_newer = True  # the zeros go up before the first run
        self.device_newer = False
        self.registry = registry
        registry.tensors[self.ptr] = self

    def _pull(self) -> None:
        if self.device_newer:
            self.mirror[...] = self.value.numpy().reshape(-1)
            self.device_newer = False

    def flush(self) -> None:
        if self.host_newer:
            self.value.update_inplace(self.mirror)
            self.host_newer = False

    def computed(self) -> None:
        self.device_newer = True

    def write(self, host: np.ndarray, offset: int = 0) -> None:
        _check_fits(self, offset, host.size)
        self._pull()
        self.mirror[offset : offset + host.size] = host.reshape(-1)
        self.host_newer = True

    def read(self, out: np.ndarray, offset: int = 0) -> None:
        _check_fits(self, offset, out.size)
        self._pull()
        out.reshape(-1)[...] = self.mirror[offset : offset + out.size]

    read_async = read

    def move(self, dst: int, src: int, count: int) -> None:
        self.copy_from(self, dst, src, count)

    def copy_from(self, src: "OrtCudaTensor", dst: int, src_offset: int, count: int) -> None:
        _check_fits(self, dst, count)
        _check_fits(src, src_offset, count)
        self._pull()
        src._pull()
        self.mirror[dst : dst + count] = src.mirror[src_offset : src_offset + count].copy()  # src may be self
        self.host_newer = True

    def view(self, shape: tuple[int, ...]) -> TensorView:
        _check_fits(self, 0, math.prod(shape))
        return TensorView(self.ptr, tuple(shape), self.dtype, self.device)

    def free(self) -> None:
        self.registry.tensors.pop(self.ptr, None)
        self.value = None


class OrtDevice:
    """What the ONNX Runtime graphs of one pipeline share on a GPU provider: with cuda-python,
    one non-blocking stream handed to every session (``user_compute_stream``), on which the
    runtime's own copies go too, so the stream alone orders them; without it, ONNX Runtime's
    own device memory and copies (:class:`OrtCudaTensor`)."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.stream: Any = None
        self.tensors: dict[int, OrtCudaTensor] = {}
        self._activated = False

    def activate(self) -> "OrtDevice":
        if self.gpu and not self._activated:
            if cuda_python_available():
                from .cuda import CudaStream

                self.stream = CudaStream()
            self._activated = True
        return self

    def provider_options(self) -> dict[str, str]:
        if self.stream is None:
            return {}
        return {"has_user_compute_stream": "1", "user_compute_stream": str(self.stream.ptr)}

    def allocate(self, capacity: int, dtype) -> DeviceTensor:
        if not self.gpu:
            return HostTensor(capacity, dtype)
        if self.stream is not None:
            from .cuda import CudaTensor

            return CudaTensor(capacity, dtype, self.stream)
        return OrtCudaTensor(capacity, dtype, self)

    def before_run(self) -> None:
        for tensor in self.tensors.values():
            tensor.flush()

    def after_run(self, outputs: Mapping[str, TensorView]) -> None:
        for view in outputs.values():
            tensor = self.tensors.get(view.ptr)
            if tensor is not None:
                tensor.computed()

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def free(self) -> None:
        if self.stream is not None:
            self.stream.free()
            self.stream = None
        self._activated = False


class OrtBinding:
    """An ONNX Runtime IOBinding over views of backend memory; ``run()`` allocates nothing.

    With ``graph_id`` (ONNX Runtime's CUDA EP with ``enable_cuda_graph``) the first run is a
    regular one (its allocations), the second captures a CUDA graph under that id in global
    capture mode (no other thread may allocate, free or synchronize meanwhile: every CUDA call of
    the pipeline is on the engine thread, engine_thread.py) and later runs replay it (run option
    ``gpu_graph_id``); each replay synchronizes the stream (cuda_graph.cc). The id is
    the bucket's (same shapes, same addresses), so a binding made again for an evicted bucket
    replays the graph ONNX Runtime kept for it: ids are recycled, never exhausted.
    """

    def __init__(self, graph: "OrtGraph", inputs: Mapping[str, TensorView],
                 outputs: Mapping[str, TensorView], graph_id: Optional[int] = None):  # fmt: skip
        self.graph = graph
        self.session = graph._active_session()
        self.outputs = dict(outputs)
        self.io = self.session.io_binding()
        for name, view in inputs.items():
            self.io.bind_input(name, view.device, 0, view.dtype, view.shape, view.ptr)
        for name, view in outputs.items():
            self.io.bind_output(name, view.device, 0, view.dtype, view.shape, view.ptr)
        self.run_options: Optional[ort.RunOptions] = None
        if graph_id is not None or graph.device.stream is not None:
            self.run_options = ort.RunOptions()
            if graph_id is not None:
                self.run_options.add_run_config_entry("gpu_graph_id", str(graph_id))
            if graph.device.stream is not None:
                # the runtime synchronizes its stream when it reads; Run need not wait each step
                self.run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")

    def run(self) -> None:
        self.graph.device.before_run()
        self.session.run_with_iobinding(self.io, self.run_options)
        self.graph.device.after_run(self.outputs)

    def free(self) -> None:
        self.io.clear_binding_inputs()
        self.io.clear_binding_outputs()


class OrtGraph:
    """One ONNX graph in an ONNX Runtime session on the given execution provider."""

    # ONNX Runtime cannot free a captured CUDA graph before its session ends: a session keeps at
    # most this many (one per bucket, reused); a bucket past them runs without one (and says so).
    MAX_CUDA_GRAPHS = 64

    def __init__(
        self,
        path: Path,
        backend: str = "ort-cpu",
        threads: int = 0,
        optimized: bool = False,
        provider_options: Optional[dict[str, str]] = None,
        cuda_graphs: bool = False,
        device: Optional[OrtDevice] = None,
        lazy: bool = False,
        arena: bool = True,
    ):
        """``lazy``: the session is made on first use, not by the pipeline's activate() (a graph
        only some requests need, e.g. ``vae_encoder`` for uploads: 140 MB of SD 1.5's weights
        that a text-to-image run never holds). ``optimized``: the file is `edit-rt engines`'
        ORT_ENABLE_ALL output, loaded with optimizations off. ``arena``: ONNX Runtime's CPU memory
        arena, which keeps a call's peak activations for the session's life (and grew by another
        2.2 GiB on a second SD 1.5 call at 512x512); off, a call's memory is returned after it."""
        if backend not in _PROVIDERS:
            raise ConfigError(f"backend: {backend!r} is not an ONNX Runtime backend ({', '.join(_PROVIDERS)})")
        self.path = Path(path)
        self.backend = backend
        self.threads = threads
        # An engine from `edit-rt engines` is already optimized: loading it skips that work.
        self.optimized = optimized
        self.provider_options = dict(provider_options or {})
        self.device = device or OrtDevice(gpu=backend != "ort-cpu")
        # CUDA graphs need every node on the CUDA EP and every input on the device: only the
        # step graph on ort-cuda asks for them.
        self.cuda_graphs = cuda_graphs and backend == "ort-cuda"
        self.session: ort.InferenceSession | None = None
        self.input_names: list[str] = []
        self.output_names: list[str] = []
        self._dtypes: dict[str, np.dtype] = {}
        self._graph_ids: dict[tuple, int] = {}  # bucket (shapes, addresses) -> its gpu_graph_id
        self.lazy = lazy
        self.arena = arena
        self._loading = threading.Lock()  # a lazy graph's first users wait for one session

    def session_providers(self) -> list:
        provider = _PROVIDERS[self.backend]
        device = self.device.provider_options()
        options = dict(self.provider_options) | device
        if self.cuda_graphs:
            options["enable_cuda_graph"] = "1"
        providers: list = [(provider, options)] if options else [provider]
        if provider == "TensorrtExecutionProvider":  # nodes TensorRT declines run on CUDA, on the same stream, not the CPU
            providers.append(("CUDAExecutionProvider", device) if device else "CUDAExecutionProvider")
        if provider != "CPUExecutionProvider" and not self.cuda_graphs:
            providers.append("CPUExecutionProvider")  # ops a GPU provider lacks
        return providers

    def activate(self) -> "OrtGraph":
        self.device.activate()
        options = ort.SessionOptions()
        options.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_DISABLE_ALL if self.optimized else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        )
        if self.threads:
            options.intra_op_num_threads = self.threads
        options.enable_cpu_mem_arena = self.arena
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=self.session_providers())
        except Exception as err:  # onnxruntime raises its own exception types per failure
            if self.cuda_graphs:
                # e.g. a node ONNX Runtime places on the CPU: capture is impossible, run without
                log.warning("%s: no CUDA graphs (%s); running without them", self.path.name, err)
                self.cuda_graphs = False
                return self.activate()
            raise ArtifactError(f"{self.path}: ONNX Runtime cannot load it ({err}); re-run `make export`") from None
        values = [*self.session.get_inputs(), *self.session.get_outputs()]
        self._dtypes = {v.name: np.dtype(_ORT_DTYPES.get(v.type, np.float32)) for v in values}
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        return self

    def deactivate(self) -> None:
        self.session = None

    @property
    def loaded(self) -> bool:
        return self.session is not None

    def __enter__(self) -> "OrtGraph":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def _active_session(self) -> ort.InferenceSession:
        if self.session is None and self.lazy:
            with self._loading:
                if self.session is None:
                    log.info("%s: loading on first use", self.path.name)
                    self.activate()
        if self.session is None:
            raise RuntimeError(f"{self.path.name}: used before activate()")
        return self.session

    def dtype(self, name: str) -> np.dtype:
        """The session's dtype of input or output ``name`` (an fp16 graph's K/V are fp16)."""
        if not self._dtypes:
            self._active_session()
        return self._dtypes[name]

    def infer(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run once on ``feeds``; outputs in ``output_names`` order, freshly allocated."""
        session = self._active_session()
        self.device.before_run()
        feeds = {name: np.asarray(value, dtype=self.dtype(name)) for name, value in feeds.items()}
        return session.run(self.output_names, feeds)

    def allocate(self, capacity: int, dtype) -> DeviceTensor:
        return self.device.allocate(capacity, dtype)

    def synchronize(self) -> None:
        self.device.synchronize()

    def bind(self, inputs: Mapping[str, TensorView], outputs: Mapping[str, TensorView]) -> OrtBinding:
        graph_id = None
        if self.cuda_graphs:
            key = tuple((name, view.shape, view.ptr) for name, view in sorted({**inputs, **outputs}.items()))
            graph_id = self._graph_ids.get(key)
            if graph_id is None:
                graph_id = len(self._graph_ids) + 1  # 0 is ONNX Runtime's own default id
                if graph_id > self.MAX_CUDA_GRAPHS:
                    log.info("%s: %d CUDA graphs captured already; this bucket runs without one",
                             self.path.name, self.MAX_CUDA_GRAPHS)  # fmt: skip
                    graph_id = -1  # ONNX Runtime: no capture or replay for this run
                else:
                    self._graph_ids[key] = graph_id
        return OrtBinding(self, inputs, outputs, graph_id)
