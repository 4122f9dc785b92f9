"""Backends run one compiled graph; the pipeline sees only this interface.

A graph is a context manager with ``activate()/infer()/deactivate()`` in Polygraphy's manner,
plus the two calls the step loop runs on:

- ``allocate(capacity, dtype) -> DeviceTensor``: memory in the backend's own space (host RAM
  for ONNX Runtime's CPU provider, device memory for the GPU backends), written by offset;
- ``bind(inputs, outputs) -> Binding``: binds views of such tensors by address, once; the
  binding's ``run()`` executes the graph on them with no allocation and no copy (on the GPU
  backends it replays a CUDA graph captured on the first run), ``free()`` releases what the
  binding holds (its captured graph).

Backends: ``ort-cpu`` (ONNX Runtime, CPU; the default), ``ort-cuda`` and ``ort-tensorrt``
(ONNX Runtime's CUDA and TensorRT execution providers), ``trt`` (native TensorRT plans, in
backend_trt.py). :func:`select_backend` resolves ``auto``.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Mapping, Optional, Protocol

import numpy as np
import onnxruntime as ort

from .device import DeviceTensor, HostTensor, TensorView
from .errors import ArtifactError, ConfigError

log = logging.getLogger(__name__)

_PROVIDERS = {
    "ort-cpu": "CPUExecutionProvider",
    "ort-cuda": "CUDAExecutionProvider",
    "ort-tensorrt": "TensorrtExecutionProvider",
}


class Binding(Protocol):
    def run(self) -> None: ...
    def free(self) -> None: ...


class Graph(Protocol):
    def activate(self) -> "Graph": ...
    def deactivate(self) -> None: ...
    def infer(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]: ...
    def allocate(self, capacity: int, dtype) -> DeviceTensor: ...
    def bind(self, inputs: Mapping[str, TensorView], outputs: Mapping[str, TensorView]) -> Binding: ...


class OrtBinding:
    """An ONNX Runtime IOBinding over views of backend memory; ``run()`` allocates nothing.

    With ``graph_id`` (ONNX Runtime's CUDA EP with ``enable_cuda_graph``) the first run captures
    a CUDA graph under that id and later runs replay it (run option ``gpu_graph_id``).
    """

    def __init__(self, session: ort.InferenceSession, inputs: Mapping[str, TensorView],
                 outputs: Mapping[str, TensorView], graph_id: Optional[int] = None):  # fmt: skip
        self.session = session
        self.io = session.io_binding()
        for name, view in inputs.items():
            self.io.bind_input(name, view.device, 0, view.dtype, view.shape, view.ptr)
        for name, view in outputs.items():
            self.io.bind_output(name, view.device, 0, view.dtype, view.shape, view.ptr)
        self.run_options: Optional[ort.RunOptions] = None
        if graph_id is not None:
            self.run_options = ort.RunOptions()
            self.run_options.add_run_config_entry("gpu_graph_id", str(graph_id))

    def run(self) -> None:
        self.session.run_with_iobinding(self.io, self.run_options)

    def free(self) -> None:
        # ONNX Runtime keeps a captured CUDA graph for the session's life: ids are never reused
        # (OrtGraph caps how many it hands out), so freeing drops only the binding.
        self.io.clear_binding_inputs()
        self.io.clear_binding_outputs()


class OrtGraph:
    """One ONNX graph in an ONNX Runtime session on the given execution provider."""

    # ONNX Runtime cannot free a captured CUDA graph before its session ends, so a session
    # captures at most this many bindings; later ones run without a graph (and say so).
    MAX_CUDA_GRAPHS = 64

    def __init__(
        self,
        path: Path,
        backend: str = "ort-cpu",
        threads: int = 0,
        optimized: bool = False,
        provider_options: Optional[dict[str, str]] = None,
        cuda_graphs: bool = False,
    ):
        if backend not in _PROVIDERS:
            raise ConfigError(f"backend: {backend!r} is not an ONNX Runtime backend ({', '.join(_PROVIDERS)})")
        self.path = Path(path)
        self.backend = backend
        self.threads = threads
        # An engine from `edit-rt engines` is already optimized: loading it skips that work.
        self.optimized = optimized
        self.provider_options = dict(provider_options or {})
        self.device = "cpu" if backend == "ort-cpu" else "cuda"
        # CUDA graphs need every node on the CUDA EP and every input on the device: only the
        # step graph on ort-cuda asks for them.
        self.cuda_graphs = cuda_graphs and backend == "ort-cuda"
        self.session: ort.InferenceSession | None = None
        self.stream = None  # the CUDA stream the runtime copies on (GPU providers)
        self.input_names: list[str] = []
        self.output_names: list[str] = []
        self._graph_ids = itertools.count(1)  # 0 is ONNX Runtime's own default id

    def session_providers(self) -> list:
        provider = _PROVIDERS[self.backend]
        options = dict(self.provider_options)
        if self.cuda_graphs:
            options["enable_cuda_graph"] = "1"
        providers: list = [(provider, options)] if options else [provider]
        if provider != "CPUExecutionProvider" and not self.cuda_graphs:
            providers.append("CPUExecutionProvider")  # ops a GPU provider lacks
        return providers

    def activate(self) -> "OrtGraph":
        options = ort.SessionOptions()
        options.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_DISABLE_ALL if self.optimized else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        )
        if self.threads:
            options.intra_op_num_threads = self.threads
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=self.session_providers())
        except Exception as err:  # onnxruntime raises its own exception types per failure
            if self.cuda_graphs:
                # e.g. a node ONNX Runtime places on the CPU: capture is impossible, run without
                log.warning("%s: no CUDA graphs (%s); running without them", self.path.name, err)
                self.cuda_graphs = False
                return self.activate()
            raise ArtifactError(f"{self.path}: ONNX Runtime cannot load it ({err}); re-run `make export`") from None
        if self.device == "cuda":
            from .cuda import CudaStream

            self.stream = CudaStream()
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        return self

    def deactivate(self) -> None:
        self.session = None
        if self.stream is not None:
            self.stream.free()
            self.stream = None

    def __enter__(self) -> "OrtGraph":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def _active_session(self) -> ort.InferenceSession:
        if self.session is None:
            raise RuntimeError(f"{self.path.name}: used before activate()")
        return self.session

    def infer(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run once on ``feeds``; outputs in ``output_names`` order, freshly allocated."""
        return self._active_session().run(self.output_names, feeds)

    def allocate(self, capacity: int, dtype) -> DeviceTensor:
        if self.device == "cpu":
            return HostTensor(capacity, dtype)
        from .cuda import CudaTensor

        # ONNX Runtime's own device memory (an OrtValue), written by offset on our stream.
        value = ort.OrtValue.ortvalue_from_shape_and_type([max(1, capacity)], np.dtype(dtype), "cuda", 0)
        return CudaTensor(capacity, dtype, self.stream, ptr=value.data_ptr(), owner=value)

    def bind(self, inputs: Mapping[str, TensorView], outputs: Mapping[str, TensorView]) -> OrtBinding:
        graph_id = None
        if self.cuda_graphs:
            graph_id = next(self._graph_ids)
            if graph_id > self.MAX_CUDA_GRAPHS:
                log.info("%s: %d CUDA graphs captured already; this binding runs without one",
                         self.path.name, self.MAX_CUDA_GRAPHS)  # fmt: skip
                graph_id = -1  # ONNX Runtime: no capture or replay for this run
        return OrtBinding(self._active_session(), inputs, outputs, graph_id)


def available_backends() -> dict[str, str]:
    """Backends this machine can run, each with the reason it can (or the first that cannot)."""
    found = {}
    providers = ort.get_available_providers()
    try:
        from .backend_trt import trt_unavailable_reason

        reason = trt_unavailable_reason()
    except ImportError as err:  # pragma: no cover - the module itself is always importable
        reason = str(err)
    if reason is None:
        found["trt"] = "TensorRT and an NVIDIA GPU are present"
    for backend in ("ort-tensorrt", "ort-cuda"):
        if _PROVIDERS[backend] in providers:
            found[backend] = f"onnxruntime has {_PROVIDERS[backend]}"
    found["ort-cpu"] = "ONNX Runtime CPU runs everywhere"
    return found


def select_backend(requested: str, built: set[str]) -> tuple[str, str]:
    """Resolve ``auto`` to the fastest backend that is available and has engines; say why."""
    available = available_backends()
    if requested != "auto":
        if requested not in available:
            raise ConfigError(
                f"backend: {requested} is not available on this machine (available: "
                f"{', '.join(available)}); use backend: auto or ort-cpu"
            )
        return requested, "chosen in the config"
    for backend in ("trt", "ort-tensorrt", "ort-cuda", "ort-cpu"):
        if backend in available and (backend in built or backend.startswith("ort-")):
            skipped = [b for b in ("trt", "ort-tensorrt", "ort-cuda") if b not in available]
            why = available[backend]
            if skipped:
                why += f"; not available here: {', '.join(skipped)}"
            return backend, why
    raise AssertionError("ort-cpu is always available")  # pragma: no cover
