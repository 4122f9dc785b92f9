"""Backends run one compiled graph; the pipeline sees only this interface.

A graph is a context manager with ``activate()/infer()/deactivate()`` in Polygraphy's manner,
plus the two calls the step loop runs on:

- ``allocate(capacity, dtype) -> DeviceTensor``: memory in the backend's own space (host RAM
  for ONNX Runtime's CPU provider, device memory for the GPU backends), written by offset;
- ``bind(inputs, outputs) -> Binding``: binds views of such tensors by address, once; the
  binding's ``run()`` enqueues the graph on them with no allocation and no copy (on the GPU
  backends it replays a CUDA graph captured on the first run), ``free()`` releases what the
  binding holds (its captured graph);
- ``dtype(name)``: the dtype the compiled graph takes or gives for a tensor (buffers are
  allocated in it, never assumed float32);
- ``synchronize()``: wait for what was enqueued; reads queued with ``read_async`` land then.

On a GPU every graph of a pipeline shares one device object (one stream, one context-memory
block), and one thread, the pipeline's engine thread, makes every call.

Backends: ``ort-cpu`` (ONNX Runtime, CPU), ``ort-cuda`` and ``ort-tensorrt`` (ONNX Runtime's
CUDA and TensorRT execution providers), all in backend_ort.py; ``openvino`` (OpenVINO's CPU
plugin on the same ONNX graphs, fp32 or bf16, in backend_ov.py); ``trt`` (native TensorRT
plans, in backend_trt.py). :func:`backend_report` says which can start here and why,
:func:`select_backend` resolves ``auto``.
"""

from __future__ import annotations

import ctypes.util
import logging
from typing import Mapping, Optional, Protocol

import numpy as np

try:
    import onnxruntime as ort
except ImportError as err:  # neither extra was installed
    raise ImportError("edit-rt needs ONNX Runtime: pip install 'edit-rt[cpu]', or 'edit-rt[gpu]' on an NVIDIA machine") from err

from ..errors import ConfigError
from .device import DeviceTensor, TensorView
from .memory import CpuModel, available_host_bytes, engine_peak_bytes, process_rss

log = logging.getLogger(__name__)

_PROVIDERS = {
    "ort-cpu": "CPUExecutionProvider",
    "ort-cuda": "CUDAExecutionProvider",
    "ort-tensorrt": "TensorrtExecutionProvider",
}


# Every backend in the order ``auto`` tries them: the GPU's fastest first, then the CPU, where
# ort-cpu or openvino (fp32) is picked per model and size by :func:`cpu_choice`.
BACKENDS = ("trt", "ort-tensorrt", "ort-cuda", "ort-cpu", "openvino")
CPU_BACKENDS = frozenset({"openvino", "ort-cpu"})


class Binding(Protocol):
    def run(self) -> None: ...
    def free(self) -> None: ...


class Graph(Protocol):
    # Whether an input may be bound with a zero-sized axis (idle LoRA slots); a graph without
    # the attribute can.
    binds_zero_width: bool

    def activate(self) -> "Graph": ...
    def deactivate(self) -> None: ...
    def infer(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]: ...
    def dtype(self, name: str) -> np.dtype: ...
    def allocate(self, capacity: int, dtype) -> DeviceTensor: ...
    def bind(self, inputs: Mapping[str, TensorView], outputs: Mapping[str, TensorView]) -> Binding: ...
    def synchronize(self) -> None: ...


def cuda_python_available() -> bool:
    try:
        from .cuda import cudart

        cudart()
        return True
    except ImportError:
        return False


def _ort_cuda_reason() -> Optional[str]:
    """None when ONNX Runtime can really put memory on a CUDA device here, else why not.

    ``get_available_providers`` lists the CUDA EP whenever onnxruntime-gpu is installed, even
    with no GPU or CUDA libraries: allocating one element on the device is the real test."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (pip install 'edit-rt[gpu]' for onnxruntime-gpu)"
    try:
        ort.OrtValue.ortvalue_from_shape_and_type([1], np.float32, "cuda", 0)
    except Exception as err:  # onnxruntime raises its own types (missing CUDA libraries, no device)
        return f"onnxruntime-gpu cannot reach a CUDA device ({str(err).splitlines()[0][:120]})"
    return None


def available_backends() -> dict[str, str]:
    """Backends this machine can really start, each with the reason it can."""
    return {b: why for b, (ok, why) in backend_report().items() if ok}


def backend_report(openvino: bool = True) -> dict[str, tuple[bool, str]]:
    """Every backend: whether it can start here, and why (or why not). ``openvino=False``
    leaves openvino out: its probe loads OpenVINO's CPU plugin (and its thread pool) into the
    process, which only a pipeline that may run on it should pay."""
    report: dict[str, tuple[bool, str]] = {}
    try:
        from .backend_trt import trt_unavailable_reason

        reason = trt_unavailable_reason()
    except ImportError as err:  # pragma: no cover - the module itself is always importable
        reason = str(err)
    report["trt"] = (True, "TensorRT and an NVIDIA GPU are present") if reason is None else (False, reason)
    cuda_reason = _ort_cuda_reason()
    if cuda_reason is None:
        copies = "copies on one stream (cuda-python)" if cuda_python_available() else "ONNX Runtime's own copies"
        report["ort-cuda"] = (True, f"onnxruntime-gpu reaches a CUDA device; {copies}")
    else:
        report["ort-cuda"] = (False, cuda_reason)
    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        report["ort-tensorrt"] = (False, "onnxruntime has no TensorrtExecutionProvider")
    elif cuda_reason is not None:
        report["ort-tensorrt"] = (False, cuda_reason)
    elif ctypes.util.find_library("nvinfer") is None and reason is not None:
        report["ort-tensorrt"] = (False, "the TensorRT libraries (libnvinfer) are not installed")
    else:
        report["ort-tensorrt"] = (True, "onnxruntime has TensorrtExecutionProvider and a CUDA device")
    if openvino:
        from .backend_ov import openvino_unavailable_reason

        ov_reason = openvino_unavailable_reason()
        report["openvino"] = (True, "OpenVINO's CPU plugin loads") if ov_reason is None else (False, ov_reason)
    report["ort-cpu"] = (True, "ONNX Runtime CPU runs everywhere")
    return {b: report[b] for b in BACKENDS if b in report}


# OpenVINO fp32 over ort-cpu by the UNet's GFLOP a row (docs/engines.md, The CPU engines, and
# docs/engines-cpu.json; 2 threads): the shapes model (0.18) 0.93-1.09x a step and its whole demo
# run 0.63x (a static compile per row count costs more than the steps it speeds); the bench model
# (4.3) 1.02-1.22x; SD 1.5 at 512x512 (803) 1.00x at 2 UNet rows a call and 2.25x at 8 (ONNX
# Runtime's page faults past 2 rows: docs/engines.md), 2.0x over a whole 4-edit run. Nothing
# was measured between 4.3 and 803; below this the fixed costs of a step dominate and the two
# engines tie at best, above it the convolutions and attention do.
OPENVINO_MIN_GFLOP = 100.0
# OpenVINO compiles a UNet up to this many weight bytes once per input shape, each compile with
# its own repacked weights (backend_ov.OvGraph.STATIC_WEIGHTS_LIMIT): not what the memory model
# or the GFLOP rule measured, so auto leaves such a model on ort-cpu.
OPENVINO_STATIC_WEIGHTS = 512 * 2**20


def cpu_choice(model: CpuModel, rows: int, budget: Optional[int], openvino_reason: Optional[str]) -> tuple[str, str]:
    """The CPU engine ``auto`` runs ``model`` on, and why (numbers included): openvino (fp32)
    where the UNet's arithmetic makes it the faster engine (OPENVINO_MIN_GFLOP) and its expected
    peak (memory.ENGINE_MEMORY) at ``rows`` step rows a call fits ``budget`` (bytes;
    None: what this machine has available now plus what this process holds), else ort-cpu.
    ``openvino_reason``: why openvino cannot start here (None: it can). Its precision is
    backend_ov.auto_precision's (bf16 where the CPU has it natively, unless fp32 is asked)."""
    gflop = model.gflop_per_unet_row
    if gflop < OPENVINO_MIN_GFLOP:
        return "ort-cpu", (f"ort-cpu: {gflop:.3g} GFLOP a UNet row, under the {OPENVINO_MIN_GFLOP:g} at which "
                           "openvino fp32 runs faster (fixed costs dominate a step there)")  # fmt: skip
    if model.unet_weights <= OPENVINO_STATIC_WEIGHTS:
        return "ort-cpu", (f"ort-cpu: {gflop:.3g} GFLOP a UNet row, but its {model.unet_weights / 2**20:.0f} MiB "
                           "UNet would compile static per row count on openvino (a weight copy a shape)")  # fmt: skip
    if openvino_reason is not None:
        return "ort-cpu", f"ort-cpu: openvino fp32 would be faster at {gflop:.0f} GFLOP a UNet row, but {openvino_reason}"
    need = engine_peak_bytes("openvino", model, rows)
    if budget is None:
        have = available_host_bytes()
        limit, where = (None, "") if have is None else (have + process_rss(), "available")
    else:
        limit, where = budget, "engines.max_memory_gb"
    if limit is not None and need > limit:
        ort_need = engine_peak_bytes("ort-cpu", model, rows)
        return "ort-cpu", (f"ort-cpu: openvino fp32 would be faster at {gflop:.0f} GFLOP a UNet row but needs about "
                           f"{need / 1e9:.1f} GB at {rows} row(s) a call, over the {limit / 1e9:.1f} GB {where} "
                           f"(ort-cpu: {ort_need / 1e9:.1f} GB)")  # fmt: skip
    fits = "" if limit is None else f" of the {limit / 1e9:.1f} GB {where}"
    return "openvino", (f"openvino: {gflop:.0f} GFLOP a UNet row, where it runs 1.0-2.25x as fast as ort-cpu, "
                        f"in about {need / 1e9:.1f} GB at {rows} row(s) a call{fits}")  # fmt: skip


def select_backend(requested: str, built: set[str], cpu: Optional[CpuModel] = None, rows: int = 1,
                   budget: Optional[int] = None) -> tuple[str, str]:  # fmt: skip
    """Resolve ``auto`` to the fastest backend that is available and has engines; say why. On
    the CPU, with ``cpu`` (the model at its size) the engine is :func:`cpu_choice`'s for calls
    of ``rows`` step rows within ``budget`` bytes; without it, ort-cpu."""
    # auto probes openvino only for a model that may run on it (its probe loads the CPU plugin)
    report = backend_report(openvino=requested == "openvino")
    available = {b: why for b, (ok, why) in report.items() if ok}
    if requested != "auto":
        if requested not in available:
            report = backend_report()  # the whole list for the message
            available = {b: why for b, (ok, why) in report.items() if ok}
            why = report[requested][1] if requested in report else "no such backend"
            raise ConfigError(
                f"backend: {requested} is not available on this machine ({why}; available: "
                f"{', '.join(available)}); use backend: auto or ort-cpu"
            )
        return requested, "chosen in the config"
    for backend in BACKENDS:
        # trt needs its plans built; the others compile (or read) the ONNX graphs themselves
        if backend in available and (backend in built or backend != "trt"):
            skipped = [b for b in BACKENDS[: BACKENDS.index(backend)] if b not in available]
            why = available[backend]
            if backend == "ort-cpu" and cpu is not None:
                ov_reason = None
                if cpu.gflop_per_unet_row >= OPENVINO_MIN_GFLOP and cpu.unet_weights > OPENVINO_STATIC_WEIGHTS:
                    from .backend_ov import openvino_unavailable_reason

                    ov_reason = openvino_unavailable_reason()
                backend, why = cpu_choice(cpu, rows, budget, ov_reason)
            if skipped:
                why += f"; not available here: {', '.join(skipped)}"
            return backend, why
    raise AssertionError("ort-cpu is always available")  # pragma: no cover
