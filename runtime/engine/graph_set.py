"""Which compiled graphs a run uses: the backend, its engine files, its batch limit.

``graphs_from_artifacts`` resolves the configured backend (``auto`` picks the fastest one
available), checks the engines under ``build/<model>/engines/<backend>/`` against the ONNX
manifest, and returns one unactivated graph per stage. ``ort-cpu`` uses the saved
ONNX-Runtime-optimized graphs where `make engines` built them and the plain ONNX otherwise;
``openvino`` reads the exported ONNX graphs and compiles them itself, per shape.
"""

from __future__ import annotations

import logging
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import onnxruntime as ort

from ..errors import ConfigError
from .backend import Graph, select_backend
from .memory import cpu_model
from .backend_ort import OrtDevice, OrtGraph
from .engines import graph_precision, graphs_of, load_engines, upcasts
from .manifest import Manifest
from .profiles import EditBatchProfile, ort_trt_profile_options

log = logging.getLogger(__name__)


def cpu_name() -> str:
    """The CPU model: ONNX Runtime's saved CPU graphs may hold ISA-specific layouts."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str:
    """GPU 0's name (a TensorRT plan runs only on the GPU model it was built for)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
        return out.stdout.strip() or "nvidia-gpu"
    except (OSError, subprocess.SubprocessError):
        return "nvidia-gpu"


def engine_tools(backend: str) -> dict[str, str]:
    if backend == "trt":
        import tensorrt

        return {"tensorrt": tensorrt.__version__}
    return {"onnxruntime": ort.__version__}


# Graphs only some requests need (an upload's encoding), made on first use on the CPU: a GPU
# backend makes every graph up front, on the thread that owns the device.
LAZY = frozenset({"vae_encoder", "taesd_encoder"})


def engine_device(backend: str) -> str:
    return gpu_name() if backend == "trt" else cpu_name()


@dataclass
class GraphSet:
    backend: str
    reason: str
    graphs: dict[str, Graph]
    files: dict[str, Path]
    # The edit-batch profile the graphs run under: a trt plan's own, else the config's.
    profile: EditBatchProfile
    # What the graphs share (stream, context memory): freed once, after every graph.
    device: Any = None


def backend_for(backend: str, built: set[str], manifest: Manifest, latent_hw: tuple[int, int],
                max_memory: Optional[int] = None) -> tuple[str, str]:
    """The backend a pipeline of ``manifest`` at ``latent_hw`` runs on, and why: ``auto``
    resolved per model and size (on the CPU, the engine that one step row a call must fit in
    ``max_memory``: the memory plan splits larger calls, memory.py)."""
    if backend != "auto":
        return select_backend(backend, built)
    return select_backend(backend, built, cpu_model(manifest, latent_hw, LAZY), 1, max_memory)


def graphs_from_artifacts(
    manifest: Manifest,
    engines_dir: Optional[Path],
    backend: str,
    threads: int,
    profile: EditBatchProfile,
    cuda_graphs: bool = True,
    precision: str = "fp16",
    max_memory: Optional[int] = None,
) -> GraphSet:
    """``cuda_graphs``: capture the step loop's bindings as CUDA graphs on GPU backends;
    ``precision``: what ``ort-tensorrt`` builds each graph in (per graph, as `make engines` does);
    ``max_memory``: the bytes ``auto``'s CPU engine must fit in (None: what is available).
    Every graph of the set shares one device object (stream, context memory)."""
    # ONNX Runtime's CPU arena keeps each session's peak for good: the few MB of a shapes model,
    # but GBs per graph at SD sizes (latents of 64 and up), where a call's tensors are large
    # enough that returning them costs nothing measurable (docs/performance.md)
    arena = int(manifest.data["model"]["sample_size"]) < 64
    built = set()
    if engines_dir is not None and Path(engines_dir).is_dir():
        built = {p.parent.name for p in Path(engines_dir).glob("*/engines.json")}
    chosen, reason = backend_for(backend, built, manifest, (profile.latent_height, profile.latent_width), max_memory)
    log.info("backend %s: %s", chosen, reason)

    stepping = lambda g: g.startswith("unet_step") or g == "latent_blend"  # noqa: E731  (the loop's graphs)
    if chosen == "trt":
        from .backend_trt import TrtDevice, TrtGraph

        engines = load_engines(Path(engines_dir) / "trt", manifest, "trt", engine_tools("trt"), engine_device("trt"),
                               profile.latent_sizes())  # fmt: skip
        files = {g: engines.path(g) for g in graphs_of(manifest)}
        device = TrtDevice()
        graphs = {g: TrtGraph(f, device, cuda_graphs=cuda_graphs and stepping(g)) for g, f in files.items()}
        return GraphSet(chosen, reason, graphs, files, engines.profile, device)

    if chosen == "openvino":
        from .backend_ov import OvDevice, OvGraph, openvino_precision

        computes, why = openvino_precision(backend, precision)
        # the export's ONNX graphs, not `make engines`' ort-cpu ones: those hold ONNX Runtime's
        # own fused ops (com.microsoft domain), which are ONNX Runtime's, not the model's
        files = {g: manifest.path(g) for g in graphs_of(manifest)}
        device = OvDevice()
        graphs = {g: OvGraph(f, device, threads, computes if graph_precision(manifest, g, "bf16") == "bf16" else "fp32",
                             lazy=g in LAZY) for g, f in files.items()}  # fmt: skip
        return GraphSet(chosen, f"{reason}; {why}", graphs, files, profile, device)

    if chosen == "ort-cpu" and precision == "bf16":
        raise ConfigError("engines.precision: bf16 runs on backend: openvino only (ONNX Runtime's CPU provider computes "
                          "fp32); set backend: openvino, or engines.precision: fp32")  # fmt: skip
    if chosen == "ort-cpu" and "ort-cpu" in built:
        engines = load_engines(Path(engines_dir) / "ort-cpu", manifest, "ort-cpu", engine_tools("ort-cpu"), cpu_name())
        files = {g: engines.path(g) for g in graphs_of(manifest)}
        device = OrtDevice(gpu=False)
        graphs = {g: OrtGraph(f, "ort-cpu", threads, optimized=engines.graphs[g].get("optimized", True), device=device,
                              lazy=g in LAZY, arena=arena) for g, f in files.items()}  # fmt: skip
        return GraphSet(chosen, reason + "; optimized engines from `make engines`", graphs, files, profile, device)

    files = {g: manifest.path(g) for g in graphs_of(manifest)}
    graphs = {}
    device = OrtDevice(gpu=chosen != "ort-cpu")
    for g, f in files.items():
        options = None
        if chosen == "ort-tensorrt":
            cache = Path(engines_dir or manifest.root.parent / "engines") / "ort-tensorrt"
            # The EP has one precision switch per session, no per-layer pinning: a graph with
            # fp32 islands (upcast attention, a force_upcast VAE) runs fp32 whole.
            fp16 = graph_precision(manifest, g, precision) == "fp16" and not upcasts(manifest, g)
            options = {
                **ort_trt_profile_options(profile, manifest.graphs[g].inputs, g),
                "trt_fp16_enable": "True" if fp16 else "False",
                "trt_engine_cache_enable": "True",
                "trt_engine_cache_path": str(cache),
                "trt_timing_cache_enable": "True",
            }
        graphs[g] = OrtGraph(f, chosen, threads, provider_options=options, cuda_graphs=cuda_graphs and stepping(g), device=device,
                             lazy=chosen == "ort-cpu" and g in LAZY, arena=arena or chosen != "ort-cpu")  # fmt: skip
    if chosen == "ort-cpu":
        reason += "; plain ONNX graphs (run `make engines` for the optimized ones)"
    return GraphSet(chosen, reason, graphs, files, profile, device)
