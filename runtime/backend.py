"""Backends run one compiled graph; the pipeline sees only this interface.

A graph is a context manager with ``activate()/infer()/deactivate()`` in Polygraphy's manner,
plus ``bind(inputs, outputs, static)``: it binds caller-owned host buffers once and returns a
:class:`Binding` whose ``run()`` executes the graph on them with no allocation. ``static``
names the inputs that do not change between runs (cached K/V): a device backend uploads them
once at bind time; the others (latents, per-row scalars) are read at every ``run()``. Outputs
are written into the caller's buffers: ``run()`` returns nothing, and the buffers are reused.

Backends: ``ort-cpu`` (ONNX Runtime, CPU; the default), ``ort-cuda`` and ``ort-tensorrt``
(ONNX Runtime's CUDA and TensorRT execution providers), ``trt`` (native TensorRT plans, in
backend_trt.py). :func:`select_backend` resolves ``auto``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping, Optional, Protocol

import numpy as np
import onnxruntime as ort

from .errors import ArtifactError, ConfigError

log = logging.getLogger(__name__)

_PROVIDERS = {
    "ort-cpu": "CPUExecutionProvider",
    "ort-cuda": "CUDAExecutionProvider",
    "ort-tensorrt": "TensorrtExecutionProvider",
}


class Binding(Protocol):
    def run(self) -> None: ...


class Graph(Protocol):
    def activate(self) -> "Graph": ...
    def deactivate(self) -> None: ...
    def infer(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]: ...
    def bind(
        self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray], static: frozenset[str]
    ) -> Binding: ...


class OrtBinding:
    """An ONNX Runtime IOBinding over caller-owned buffers; ``run()`` allocates nothing on the CPU."""

    def __init__(self, session: ort.InferenceSession, inputs, outputs, static, device: str):
        self.session = session
        # Keep the buffers (and any device copies) alive for as long as the binding is.
        self.buffers = {**inputs, **outputs}
        self.device_values: dict[str, ort.OrtValue] = {}
        self.io = session.io_binding()
        for name, array in inputs.items():
            _check_buffer(name, array)
            if device != "cpu" and name in static:
                # Cached K/V go to the device once; per-step inputs stay on the host.
                value = ort.OrtValue.ortvalue_from_numpy(array, device, 0)
                self.device_values[name] = value
                self.io.bind_ortvalue_input(name, value)
            else:
                self.io.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        for name, array in outputs.items():
            _check_buffer(name, array)
            self.io.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)

    def run(self) -> None:
        self.session.run_with_iobinding(self.io)


def _check_buffer(name: str, array: np.ndarray) -> None:
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: bound buffers must be C-contiguous (a prefix of a batch buffer is)")


class OrtGraph:
    """One ONNX graph in an ONNX Runtime session on the given execution provider."""

    def __init__(
        self,
        path: Path,
        backend: str = "ort-cpu",
        threads: int = 0,
        optimized: bool = False,
        provider_options: Optional[dict[str, str]] = None,
    ):
        if backend not in _PROVIDERS:
            raise ConfigError(f"backend: {backend!r} is not an ONNX Runtime backend ({', '.join(_PROVIDERS)})")
        self.path = Path(path)
        self.backend = backend
        self.threads = threads
        # An engine from `edit-rt engines` is already optimized: loading it skips that work.
        self.optimized = optimized
        self.provider_options = provider_options or {}
        self.device = "cpu" if backend == "ort-cpu" else "cuda"
        self.session: ort.InferenceSession | None = None
        self.input_names: list[str] = []
        self.output_names: list[str] = []

    def activate(self) -> "OrtGraph":
        options = ort.SessionOptions()
        options.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_DISABLE_ALL if self.optimized else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        )
        if self.threads:
            options.intra_op_num_threads = self.threads
        provider = _PROVIDERS[self.backend]
        providers = [(provider, self.provider_options)] if self.provider_options else [provider]
        if provider != "CPUExecutionProvider":
            providers.append("CPUExecutionProvider")  # ops a GPU provider lacks
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=providers)
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

    def _active_session(self) -> ort.InferenceSession:
        if self.session is None:
            raise RuntimeError(f"{self.path.name}: used before activate()")
        return self.session

    def infer(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run once on ``feeds``; outputs in ``output_names`` order, freshly allocated."""
        return self._active_session().run(self.output_names, feeds)

    def bind(
        self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray], static: frozenset[str] = frozenset()
    ) -> OrtBinding:
        return OrtBinding(self._active_session(), inputs, outputs, static, self.device)


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
