"""The OpenVINO backend, ``openvino``: the same exported ONNX graphs on OpenVINO's CPU plugin.

No second export: OpenVINO's ONNX frontend reads the ``.onnx`` files the export stage wrote (not
`make engines`' ``ort-cpu`` graphs, which hold ONNX Runtime's own fused ops). What differs from
``ort-cpu`` (backend_ort.py) is how a graph is compiled:

- **static shapes, one compile per shape**: a bound step call's rows are a bucket (pow2, as on
  the GPU backends), and each bucket's shapes are compiled once and kept (fixed shapes run
  faster than dynamic ones on this plugin: docs/engines.md); ``infer`` outside the step loop
  compiles the shapes it is given, kept likewise. Each compiled shape holds its own copy of the
  weights, repacked (measured: +105 MB a shape for the bench UNet's 65 MB): a graph with more
  than :attr:`OvGraph.STATIC_WEIGHTS_LIMIT` of weights (SD 1.5's UNet: 3.4 GB) is compiled
  once with its dynamic axes instead, one copy of its weights for every row count;
- **precision stated, never defaulted**: OpenVINO's CPU plugin computes in bf16 by default on
  a processor that has it, so ``INFERENCE_PRECISION_HINT`` is always set: ``f32`` (exact, the
  default) or ``bf16`` (``engines.precision: bf16``, refused on a CPU without ``avx512_bf16`` or
  AMX). In bf16 the graph's inputs and outputs stay fp32 (the K/V, the latents) and the CPU
  plugin lowers only what feeds its convolutions and matmuls: the step graph's nodes outside
  the UNet module (classifier-free guidance, the sampler's update) run in fp32, as the fp16 GPU
  graphs keep them (export/compile/fp16.py). tests/test_openvino.py reads that from the
  compiled model's own runtime report (:func:`outside_unet` names the nodes).

Memory is host memory, as on ``ort-cpu`` (:class:`~.device.HostTensor`); a binding hands the
step loop's views to an infer request as ``ov.Tensor`` objects over the same bytes (shared
memory, no copy), so the loop's resident slots are used in place.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from ..errors import ArtifactError, ConfigError
from .device import DeviceTensor, HostTensor, TensorView

log = logging.getLogger(__name__)

# The CPU features on which OpenVINO runs bf16 natively: AVX-512 BF16 (Cooper Lake, Zen 4 and
# later) or AMX (Sapphire Rapids and later). Elsewhere its bf16 is emulated, slower than fp32.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
PRECISIONS = {"fp32": "f32", "bf16": "bf16"}


@functools.lru_cache(maxsize=1)
def openvino_unavailable_reason() -> Optional[str]:
    """None when OpenVINO's runtime and its CPU plugin load here, else why not (probed once)."""
    try:
        import openvino as ov
    except ImportError:
        return "openvino is not installed (pip install 'edit-rt[openvino]')"
    try:
        if "CPU" not in ov.Core().available_devices:
            return "OpenVINO has no CPU device here"
    except RuntimeError as err:  # the plugin failed to load
        return f"OpenVINO's CPU plugin does not load ({str(err).splitlines()[0][:120]})"
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The processor's feature flags as Linux lists them (empty where there is no /proc)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_unavailable_reason(flags: Optional[set[str]] = None) -> Optional[str]:
    """None when this CPU computes bf16 natively, else why ``precision: bf16`` is refused."""
    flags = cpu_flags() if flags is None else flags
    if any(flag in flags for flag in BF16_FLAGS):
        return None
    return (f"this CPU has neither {' nor '.join(BF16_FLAGS)} (no native bf16: OpenVINO would emulate it, slower "
            "than fp32); use engines.precision: fp32")  # fmt: skip


def resolve_precision(precision: str) -> str:
    """The precision an ``openvino`` run computes in: ``bf16`` where asked and the CPU has it,
    ``fp32`` for ``fp32`` and for the config's default ``fp16`` (a GPU precision: the CPU
    engines are fp32); ``bf16`` on a CPU without it is refused with the reason."""
    if precision != "bf16":
        return "fp32"
    reason = bf16_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"engines.precision: bf16 cannot run here: {reason}")
    return "bf16"


def auto_precision(precision: str, flags: Optional[set[str]] = None) -> tuple[str, str]:
    """What ``backend: auto`` computes in on ``openvino``, and why: the config's default
    ``fp16`` (reduced precision where the hardware has it, as on a GPU) is ``bf16`` on a CPU
    with native bf16 (its identity edits stay exact and `make quality` does not move under it:
    docs/quality.md, bf16 on OpenVINO), else ``fp32``; ``fp32`` and ``bf16`` as stated."""
    if precision != "fp16":
        return resolve_precision(precision), f"engines.precision: {precision}"
    if bf16_unavailable_reason(flags) is None:
        return "bf16", "bf16: the CPU has it natively (engines.precision: fp32 keeps fp32)"
    return "fp32", "fp32: the CPU has no native bf16"


def openvino_precision(backend: str, precision: str) -> tuple[str, str]:
    """What an ``openvino`` pipeline computes in, and why, for the config's ``backend`` (``auto``
    or ``openvino``) and ``engines.precision``: :func:`auto_precision` where auto chose it,
    :func:`resolve_precision` where the config names the engine."""
    if backend == "auto":
        return auto_precision(precision)
    computes = resolve_precision(precision)
    return computes, computes


def host_array(view: TensorView) -> np.ndarray:
    """A numpy array over a host view's bytes (no copy): what an ``ov.Tensor`` shares."""
    buffer = (ctypes.c_char * max(1, view.nbytes)).from_address(view.ptr)
    return np.frombuffer(buffer, dtype=view.dtype, count=int(np.prod(view.shape))).reshape(view.shape)


def outside_unet(model) -> list:
    """The compute nodes of a step graph outside its UNet module: guidance, the sampler's
    update, the row bookkeeping. The exporter names nodes by module scope (``.../unet/...``
    inside it); nodes OpenVINO's frontend made while decomposing an ONNX op (``MVN_857``, no
    scope) belong where their inputs come from."""
    inside: set[str] = set()
    outside = []
    for node in model.get_ordered_ops():
        name = node.get_friendly_name()
        if "/unet/" in name or ("/" not in name and any(
                i.get_source_output().get_node().get_friendly_name() in inside for i in node.inputs())):  # fmt: skip
            inside.add(name)
        elif node.get_type_name() not in ("Parameter", "Result", "Constant"):
            outside.append(node)
    return outside


def graph_file_bytes(path: Path) -> int:
    """An ONNX graph's bytes on disk, its external weights (``<name>.onnx_data``) included."""
    data = path.with_name(path.name + "_data")
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


class OvDevice:
    """What the OpenVINO graphs of one pipeline share: one ``ov.Core`` (its CPU plugin and
    thread pools) and host memory. Compiled shapes share no weights (each repacks its own)."""

    gpu = False

    def __init__(self) -> None:
        self.core = None

    def activate(self) -> "OvDevice":
        if self.core is None:
            import openvino as ov

            self.core = ov.Core()
        return self

    def allocate(self, capacity: int, dtype) -> DeviceTensor:
        return HostTensor(capacity, dtype)

    def synchronize(self) -> None:
        """Every infer here is synchronous: nothing is in flight."""

    def free(self) -> None:
        self.core = None


class OvBinding:
    """An infer request over the step loop's views (shared memory); ``run()`` copies nothing in."""

    def __init__(self, graph: "OvGraph", inputs: Mapping[str, TensorView], outputs: Mapping[str, TensorView]):
        import openvino as ov

        compiled = graph.compiled({name: view.shape for name, view in inputs.items()})
        self.request = compiled.create_infer_request()
        for name, view in {**inputs, **outputs}.items():
            self.request.set_tensor(name, ov.Tensor(host_array(view), shared_memory=True))

    def run(self) -> None:
        self.request.infer()

    def free(self) -> None:
        self.request = None


class OvGraph:
    """One ONNX graph read by OpenVINO, compiled for the CPU once per set of input shapes."""

    # Compiled shapes kept per graph (a row bucket each on the step graphs, an image count on
    # the VAE): past it the least recently used is dropped and compiled again when next needed.
    MAX_COMPILED = 16
    # Weights past which a graph is compiled once, dynamic, not once per shape: every compiled
    # shape repacks its own copy of the weights, and two copies of SD 1.5's UNet (2 x 3.4 GB)
    # would not fit beside its activations on a 16 GB machine.
    STATIC_WEIGHTS_LIMIT = 512 * 2**20
    # A zero-wide input (idle LoRA slots) fails OpenVINO's shape inference: the exporter's
    # Reshape targets hold 0, which OpenVINO reads as "copy that dimension" of an input that has
    # too few; the step loop binds the slots full width with zero scales instead (exact).
    binds_zero_width = False

    def __init__(self, path: Path, device: Optional[OvDevice] = None, threads: int = 0, precision: str = "fp32",
                 lazy: bool = False, static: Optional[bool] = None):  # fmt: skip
        """``precision``: ``fp32`` or ``bf16`` (already checked: :func:`resolve_precision`);
        ``lazy``: read on first use, as on ort-cpu; ``static``: one compile per shape (None: by the
        weights' size, below; a text graph, whose shapes change every decoding step, says False)."""
        if precision not in PRECISIONS:
            raise ConfigError(f"engines.precision: {precision!r} is not one OpenVINO runs ({', '.join(PRECISIONS)})")
        self.path = Path(path)
        self.device = device or OvDevice()
        self.threads = threads
        self.precision = precision
        self.lazy = lazy
        self.model = None
        self.input_names: list[str] = []
        self.output_names: list[str] = []
        self._dtypes: dict[str, np.dtype] = {}
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._loaded = False
        # one compile per shape, or one dynamic compile for every shape past STATIC_WEIGHTS_LIMIT:
        # known before the graph is read (its files' size, the weights all but a few kB of it),
        # so that the step loop picks its buckets for it (pow2 where each is a compile)
        self.static = graph_file_bytes(self.path) <= self.STATIC_WEIGHTS_LIMIT if static is None else static
        self._loading = threading.Lock()

    def config(self) -> dict[str, str]:
        config = {"INFERENCE_PRECISION_HINT": PRECISIONS[self.precision], "PERFORMANCE_HINT": "LATENCY"}
        if self.threads:
            config["INFERENCE_NUM_THREADS"] = str(self.threads)
        return config

    def activate(self) -> "OvGraph":
        core = self.device.activate().core
        try:
            model = core.read_model(str(self.path))
        except RuntimeError as err:  # OpenVINO raises RuntimeError for an unreadable graph
            raise ArtifactError(f"{self.path}: OpenVINO cannot read it ({str(err).splitlines()[0][:200]}); "
                                "re-run `make export`") from None  # fmt: skip
        self.input_names = [p.get_any_name() for p in model.inputs]
        self.output_names = [r.get_any_name() for r in model.outputs]
        self._dtypes = {p.get_any_name(): np.dtype(p.get_element_type().to_dtype()) for p in [*model.inputs, *model.outputs]}
        if self.static:
            self.model = model  # cloned and reshaped for each new shape's compile
        else:  # compiled once, now; the graph as read is let go (its weights are mapped from the file)
            self._compiled[("dynamic",)] = self.device.core.compile_model(model, "CPU", self.config())
        self._loaded = True
        return self

    def deactivate(self) -> None:
        self._compiled.clear()
        self.model = None
        self._loaded = False

    @property
    def loaded(self) -> bool:
        return self._loaded

    def __enter__(self) -> "OvGraph":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def _ensure_loaded(self) -> None:
        if not self._loaded and self.lazy:
            with self._loading:
                if not self._loaded:
                    log.info("%s: loading on first use", self.path.name)
                    self.activate()
        if not self._loaded:
            raise RuntimeError(f"{self.path.name}: used before activate()")

    def compiled(self, shapes: Mapping[str, tuple[int, ...]]):
        """The graph compiled for these input shapes (static), compiled on first use; a graph
        past :attr:`STATIC_WEIGHTS_LIMIT` has one compile, its axes dynamic, for every shape."""
        import openvino as ov

        self._ensure_loaded()
        if not self.static:
            return self._compiled[("dynamic",)]
        key = tuple(sorted((name, tuple(shape)) for name, shape in shapes.items()))
        compiled = self._compiled.get(key)
        if compiled is None:
            static = self.model.clone()
            static.reshape({name: ov.PartialShape(list(shape)) for name, shape in shapes.items()})
            compiled = self.device.core.compile_model(static, "CPU", self.config())
            log.debug("%s: compiled for %s", self.path.name, dict(shapes))
            self._compiled[key] = compiled
            while len(self._compiled) > self.MAX_COMPILED:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return compiled

    def dtype(self, name: str) -> np.dtype:
        self._ensure_loaded()
        return self._dtypes[name]

    def infer(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run once on ``feeds``; outputs in ``output_names`` order, freshly allocated."""
        self._ensure_loaded()
        feeds = {name: np.ascontiguousarray(value, dtype=self.dtype(name)) for name, value in feeds.items()}
        compiled = self.compiled({name: value.shape for name, value in feeds.items()})
        request = compiled.create_infer_request()
        request.infer(feeds)
        return [np.array(request.get_tensor(name).data, copy=True) for name in self.output_names]

    def allocate(self, capacity: int, dtype) -> DeviceTensor:
        return self.device.allocate(capacity, dtype)

    def synchronize(self) -> None:
        self.device.synchronize()

    def bind(self, inputs: Mapping[str, TensorView], outputs: Mapping[str, TensorView]) -> OvBinding:
        return OvBinding(self, inputs, outputs)
