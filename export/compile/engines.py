"""`edit-rt engines`: compile ``build/<model>/onnx/`` for the backends this machine has.

- ``ort-cpu`` (everywhere): each graph with all of ONNX Runtime's graph optimizations applied
  once and saved, so a later start loads it with optimizations off.
- ``trt`` (where TensorRT and an NVIDIA GPU are present): a plan per graph built with
  Polygraphy's builder API as a strongly typed network (no deprecated precision flags: the
  precision is the ONNX graph's, fp16 with fp32 islands by default, see fp16.py), one
  optimization profile over the edit-batch axis (the VAE's own, ``vae_max_batch`` rows), and a
  timing cache shared by all builds.

Each backend folder gets an ``engines.json`` (see edit_rt.runtime.engine.engines).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import onnxruntime as ort

from edit_rt.runtime.engine.backend_trt import trt_unavailable_reason
from edit_rt.runtime.engine.engines import EngineSet, graph_precision, graphs_of, upcasts, write_engines_json
from edit_rt.runtime.engine.graph_set import cpu_name, engine_device, engine_tools
from edit_rt.runtime.engine.manifest import Manifest, load_manifest
from edit_rt.runtime.engine.profiles import EditBatchProfile
from edit_rt.runtime.errors import ConfigError

log = logging.getLogger(__name__)

# A graph with more weights than this is its own ort-cpu engine (no optimized copy): SD 1.5's
# UNet, text encoder and VAE; the shapes and test models' graphs (a few MB) are copied.
COPY_LIMIT = 32 * 2**20


def ort_cpu_engines(manifest: Manifest, out: Path, profile: EditBatchProfile,
                    done: Callable[[str], None] = lambda name: None) -> EngineSet:  # fmt: skip
    """Save every graph ONNX-Runtime-optimized (ORT_ENABLE_ALL) for this CPU, but those whose
    weights pass COPY_LIMIT: their engine is the exported graph itself (a path relative to the
    engines folder, optimized as it loads). ORT_ENABLE_ALL rewrites a CPU graph's weights (the
    NCHWc convolution layout), so a saved copy could share no byte with the export: SD 1.5's
    UNet, text encoder and VAE would be 4.1 GB again, to save seconds of a start that reads
    them anyway (docs/engines.md)."""
    staging = _fresh(out)
    graphs = {}
    for graph in graphs_of(manifest):
        source = manifest.path(graph)
        if manifest.data["graphs"][graph].get("weight_bytes", 0) > COPY_LIMIT:
            graphs[graph] = {**_entry(manifest, graph, os.path.relpath(source, out)), "optimized": False}
            log.info("ort-cpu: %s is used as exported (optimized as it loads; no copy of its weights)", source.name)
            done(f"ort-cpu/{graph}")
            continue
        target = staging / f"{graph}.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(target)
        # ORT warns that ORT_ENABLE_ALL output is specific to this CPU: engines.json records
        # the CPU and the runtime refuses the engines elsewhere.
        options.log_severity_level = 3
        if manifest.data["graphs"][graph].get("external_data"):
            # a graph past protobuf's 2 GiB (or the export's threshold) needs external data too
            options.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name", f"{graph}.onnx_data"
            )
            options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        graphs[graph] = _entry(manifest, graph, target.name)
        log.info("ort-cpu: %s -> %s", source.name, target)
        done(f"ort-cpu/{graph}")
    return _publish(staging, out, EngineSet(out, "ort-cpu", profile, "fp32", engine_tools("ort-cpu"), cpu_name(), graphs))


def trt_engines(manifest: Manifest, out: Path, profile: EditBatchProfile, precision: str,
                done: Callable[[str], None] = lambda name: None) -> EngineSet:  # fmt: skip
    """Build a TensorRT plan per graph with Polygraphy (needs TensorRT and a GPU): strongly
    typed networks, the precision carried by the ONNX graph itself (see fp16.py), an
    optimization profile per served latent size for the graphs with spatial axes (the runtime
    picks the one its shapes fit: backend_trt.TrtGraph.use_profile), the VAE's rows its own."""
    from polygraphy.backend.trt import CreateConfig, Profile, engine_bytes_from_network, network_from_onnx_path

    from edit_rt.runtime.engine.profiles import spatial

    if precision == "bf16":
        raise ConfigError("engines.precision: bf16 strongly typed plans need a bf16 ONNX export, which edit-rt "
                          "does not make yet; use fp16 (SD's UNet is trained for it) or fp32")  # fmt: skip
    profile = dataclasses.replace(profile, step_all_given=manifest.step_all_given)  # the step graph's E range: the export's
    staging = _fresh(out)
    timing_cache = out.parent / "trt-timing.cache"  # outside `out`: reused across rebuilds
    graphs = {}
    for graph in graphs_of(manifest):
        inputs = manifest.graphs[graph].inputs
        trt_profiles = []
        for size in profile.latent_sizes() if spatial(inputs) else profile.latent_sizes()[:1]:
            trt_profile = Profile()
            for name, (lo, opt, hi) in profile.at(size).shapes(inputs, graph).items():
                trt_profile.add(name, min=lo, opt=opt, max=hi)
            trt_profiles.append(trt_profile)
        own = graph_precision(manifest, graph, precision)
        source = typed_onnx(manifest, graph, own, staging)
        network = network_from_onnx_path(str(source), strongly_typed=True)
        config = CreateConfig(profiles=trt_profiles, load_timing_cache=str(timing_cache) if timing_cache.exists() else None)
        plan = engine_bytes_from_network(network, config=config, save_timing_cache=str(timing_cache))
        target = staging / f"{graph}.plan"
        target.write_bytes(plan)
        graphs[graph] = {**_entry(manifest, graph, target.name), "precision": own}
        log.info("trt: %s -> %s (%s, strongly typed)", graph, target, own)
        done(f"trt/{graph}")
    for typed in staging.glob("*.typed.onnx*"):
        typed.unlink()  # the plans hold what they need
    return _publish(staging, out, EngineSet(out, "trt", profile, precision, engine_tools("trt"), engine_device("trt"), graphs))


def typed_onnx(manifest: Manifest, graph: str, precision: str, folder: Path) -> Path:
    """The ONNX graph a strongly typed build of ``graph`` at ``precision`` starts from: the
    exported fp32 graph, or its fp16 form with the model's fp32 islands (fp16.py)."""
    source = manifest.path(graph)
    if precision == "fp32":
        return source
    import onnx

    from .fp16 import fp16_graph, unet_fp32_nodes

    islands: set[str] = set()
    fp16_inputs: set[str] = set()
    if graph.startswith("unet_step"):
        islands = unet_fp32_nodes(onnx.load(str(source), load_external_data=False))
        if upcasts(manifest, graph):
            islands |= fp32_attention_nodes(source)
        fp16_inputs = {n for n, role in manifest.roles(graph).items() if role in ("row_kv", "set_kv")}
    return fp16_graph(source, folder / f"{graph}.typed.onnx", islands, fp16_inputs)


def fp32_attention_nodes(onnx_path: Path) -> set[str]:
    """The ONNX nodes of every attention's scores: each Softmax and what computes its input back
    to the ``q k^T`` MatMul (through the scale and mask Mul/Add/Div, and the Reshape that puts
    the unconditional rows' heads-batched scores in row order for their mask). diffusers computes
    these in fp32 under ``upcast_attention``/``upcast_softmax``; an fp16 plan keeps them fp32."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    producer = {out: node for node in model.graph.node for out in node.output}
    names: set[str] = set()
    for node in model.graph.node:
        if node.op_type != "Softmax":
            continue
        names.add(node.name)
        source = producer.get(node.input[0])
        while source is not None and source.op_type in ("Add", "Mul", "Div", "Reshape", "MatMul"):
            names.add(source.name)
            if source.op_type == "MatMul":
                break
            source = producer.get(source.input[0])
    return names




def build_engines(
    onnx_dir: Path,
    engines_dir: Path,
    profile: EditBatchProfile,
    precision: str = "fp16",
    say: Callable[[str], None] = print,
    trt_reason: Optional[str] = "probe",
    progress: Optional[Callable[[str], None]] = None,
) -> dict[str, EngineSet]:
    """Build every backend's engines that this machine can; say what was built and skipped.

    ``progress`` is called with "<backend>/<graph>" as each engine is done."""
    manifest = load_manifest(onnx_dir)
    profile = dataclasses.replace(profile, step_all_given=manifest.step_all_given)  # the step graph's E range: the export's
    reason = trt_unavailable_reason() if trt_reason == "probe" else trt_reason
    done = progress or (lambda name: None)
    built = {"ort-cpu": ort_cpu_engines(manifest, Path(engines_dir) / "ort-cpu", profile, done)}
    if reason is None:
        built["trt"] = trt_engines(manifest, Path(engines_dir) / "trt", profile, precision, done)
    else:
        say(f"TensorRT is unavailable ({reason}): built the ONNX Runtime CPU engines only")
    return built


def _entry(manifest: Manifest, graph: str, file: str) -> dict:
    return {"file": file, "source_onnx": str(manifest.path(graph)), "source_sha256": manifest.data["graphs"][graph]["sha256"]}


def _fresh(out: Path) -> Path:
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, out: Path, engines: EngineSet) -> EngineSet:
    """Write engines.json, then swap the folder in whole: a failed build keeps the old one."""
    write_engines_json(dataclasses.replace(engines, root=staging))
    if out.exists():
        shutil.rmtree(out)
    os.replace(staging, out)
    return engines
