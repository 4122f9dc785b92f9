"""`edit-rt parity`: every graph on every backend against its PyTorch source, as a report.

Per graph, on fresh random inputs at several batch sizes within the profile, Polygraphy's
``Comparator`` runs: the PyTorch module (the reference), the plain ONNX graph on ONNX Runtime,
the ONNX-Runtime-optimized CPU engine, and the TensorRT plan where one is built and TensorRT is
present. Writes ``build/<model>/parity.md`` (a table: max abs and relative error, tolerance,
pass/fail) and ``parity.json``.

The graphs are those the export has (engines.graphs_of): the optional tiny autoencoder's
(``taesd_decoder``, ``taesd_encoder``) where it was exported, against diffusers'
``AutoencoderTiny`` loaded again from the source the manifest names (export/compile/tiny_vae.py),
wrapped as the export wrapped it.
"""

from __future__ import annotations

import copy

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator
from polygraphy.logger import G_LOGGER

from edit_rt.runtime.config.run_config import RunConfig
from edit_rt.runtime.engine.backend_trt import trt_unavailable_reason
from edit_rt.runtime.engine.engines import EngineSet, graphs_of, load_engines
from edit_rt.runtime.engine.graph_set import cpu_name, engine_device, engine_tools
from edit_rt.runtime.engine.manifest import Manifest, load_manifest
from edit_rt.runtime.errors import ArtifactError
from edit_rt.runtime.model.samplers import schedule_for

from . import adapter_slots
from .families import family_module
from .family import family_of
from .graphs import (KVProjGraph, LatentBlendGraph, TinyVaeEncoderGraph, UNetShallowStepGraph, UNetStepGraph,
                     VaeDecoderGraph, VaeEncoderGraph, attention_map_layers)  # fmt: skip
from .tiny_vae import load_tiny_vae

# fp32 backends: ONNX Runtime reorders and fuses the same sums as PyTorch, ~1e-6 relative per
# layer; through the ~30 layers of a UNet that stays below 1e-4 on outputs of order 1.
FP32_TOL = (1e-4, 1e-3)  # (atol, rtol)
# fp16 TensorRT against fp32 ONNX Runtime: a 10-bit mantissa (~5e-4 relative per op) through
# the same depth; SD's own fp16 deployments see ~1e-2 on the UNet output.
FP16_TOL = (3e-2, 3e-2)


class TorchCpuRunner(BaseRunner):
    """A Polygraphy runner for a torch module on the CPU (Polygraphy's PytRunner moves to CUDA)."""

    def __init__(self, module: torch.nn.Module, input_metadata: TensorMetadata, output_names: list[str]):
        super().__init__(prefix="torch-cpu-runner")
        self.module = module
        self.input_metadata = input_metadata
        self.output_names = output_names

    def activate_impl(self):
        self.module.eval()

    def get_input_metadata_impl(self):
        return self.input_metadata

    def infer_impl(self, feed_dict):
        with torch.no_grad():
            start = time.perf_counter()
            outputs = self.module(*(torch.from_numpy(v) for v in feed_dict.values()))
            self.inference_time = time.perf_counter() - start
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        return OrderedDict((name, out.numpy()) for name, out in zip(self.output_names, outputs))

    def deactivate_impl(self):
        pass


def random_feeds(manifest: Manifest, graph: str, n: int, m: int, rng: np.random.Generator, hw: int) -> OrderedDict:
    """Random but plausible inputs for ``graph``: N = n rows (n // 2 of them at their entry step,
    their unconditional prediction given), m negative-prompt sets, hw x hw latents."""
    feeds = OrderedDict()
    # each row at a random step of UniPC (reads both history slots) or Euler a (adds noise)
    schedules = [schedule_for(name, manifest.scheduler_config, 20) for name in ("unipc", "euler_a")]
    picks = rng.integers(0, 20, size=n)

    def per_row(values) -> np.ndarray:  # values(schedule) -> its per-step array
        return np.stack([values(schedules[r % 2])[picks[r]] for r in range(n)]).astype(np.float32)

    vocab = manifest.data["model"].get("vocab_size", 49408)
    # the step graphs' inputs by role (runtime/engine/step_signature.py), the other graphs' by name
    roles = manifest.roles(graph) if graph.startswith("unet_step") else {}
    for spec in manifest.graphs[graph].inputs:
        scale = manifest.vae_scale_factor
        slots = manifest.adapters["slots"]
        dims = {"N": n, "B": n, "E": n // 2, "U": 2 * n - n // 2, "P": slots, "R": slots * manifest.adapters["rank"], "S": m * manifest.data["model"]["text_len"], "M": m, "H": hw, "W": hw,
                "IH": hw * scale, "IW": hw * scale}  # fmt: skip
        shape = [dims[d] if isinstance(d, str) else d for d in spec.shape]
        role = roles.get(spec.name, "")
        if spec.name in ("input_ids", "input_ids_2"):
            feeds[spec.name] = rng.integers(0, vocab, size=shape).astype(np.int64)
        elif role == "row_ref":  # any row's pattern, or its own
            feeds[spec.name] = rng.integers(0, n, size=shape).astype(np.int64)
        elif role == "set_index":
            feeds[spec.name] = rng.integers(0, m, size=shape).astype(np.int64)
        elif role == "row_cond:time_ids":  # SDXL's sizes and crop corner, in pixels
            feeds[spec.name] = rng.integers(0, 1024, size=shape).astype(np.float32)
        elif role.startswith("step_scalar:"):  # the schedule's value at a random step per row
            feeds[spec.name] = per_row(lambda schedule, attr=role.split(":", 1)[1]: getattr(schedule, attr))
        elif role == "step_coefs":  # the samplers' updates at those steps (step_coefs.COEFS)
            feeds[spec.name] = per_row(lambda schedule: schedule.coefs)
        elif role == "row_scalar:guidance":
            feeds[spec.name] = rng.uniform(1.0, 9.0, size=shape).astype(np.float32)
        elif spec.name == "adapter_scale":  # a slider's range
            feeds[spec.name] = rng.uniform(-2.0, 2.0, size=shape).astype(np.float32)
        elif "_lora_" in spec.name:  # LoRA matrices: small, as trained ones are
            feeds[spec.name] = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        elif spec.name == "images":
            feeds[spec.name] = rng.random(shape).astype(np.float32)
        elif spec.name == "keep":  # latent_blend: 1 where the base's latent is kept
            feeds[spec.name] = (rng.random(shape) > 0.5).astype(np.float32)
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


class KeptInputs(torch.nn.Module):
    """A step graph's PyTorch source called with the inputs its ONNX graph kept (the exporter
    drops those no output reads: a shallow step's skipped layers' K/V): the others are zeros
    in ``unet_step``'s shape for the call's rows, read by nothing that reaches an output."""

    def __init__(self, module: torch.nn.Module, manifest: Manifest, graph: str):
        super().__init__()
        self.module = module
        self.traced = manifest.data["graphs"][graph]["traced_inputs"]  # the adapter inputs last
        self.kept = [t.name for t in manifest.graphs[graph].inputs]
        self.specs = {t.name: t for t in manifest.graphs["unet_step"].inputs}
        self.text_len = manifest.data["model"]["text_len"]
        self.slots, self.rank = manifest.adapters["slots"], manifest.adapters["rank"]
        roles = manifest.roles(graph)
        self.latents, self.given = (next(n for n, r in roles.items() if r == role) for role in ("latents", "entry_uncond"))

    def forward(self, *kept):
        given = dict(zip(self.kept, kept))
        n, _, h, w = given[self.latents].shape
        dims = {"N": n, "E": given[self.given].shape[0], "S": self.text_len, "M": 1, "H": h, "W": w,
                "P": self.slots, "R": self.slots * self.rank}  # (a skipped layer's LoRA matrices: slots x rank wide)
        args = []
        for name in self.traced:
            if name in given:
                args.append(given[name])
            else:
                spec = self.specs[name]
                dtype = torch.int64 if np.dtype(spec.dtype) == np.int64 else torch.float32
                args.append(torch.zeros([dims[d] if isinstance(d, str) else d for d in spec.shape], dtype=dtype))
        return self.module(*args)


def tiny_torch_module(graph: str, manifest: Manifest) -> torch.nn.Module:
    """The PyTorch source of a tiny autoencoder's graph: diffusers' ``AutoencoderTiny`` from the
    file or folder it was exported from (the manifest's ``source``), as the export wrapped it."""
    source = Path(manifest.data["graphs"][graph]["source"])
    if not source.exists():
        raise ArtifactError(f"{graph}: exported from {source}, which is gone, and parity compares the graph with it; "
                            "put it back, or re-run `make export` with export.tiny_vae naming where it is now")  # fmt: skip
    tiny = load_tiny_vae(source).module
    return VaeDecoderGraph(tiny) if graph == "taesd_decoder" else TinyVaeEncoderGraph(tiny)


def load_sources(model_dir: Path, manifest: Manifest):
    """The model's PyTorch components as its export loaded them, once for every graph's source
    (``torch_module(..., sources=)``): a model of several GB is read from disk once, not per graph."""
    return family_module(family_of(model_dir)).load_components(model_dir, manifest.data["model"].get("variant"))


def torch_module(graph: str, model_dir: Path, manifest: Manifest, sources=None) -> torch.nn.Module:
    """The PyTorch source of ``graph`` on its own copy of the components (export wrappers swap
    processors and install adapter slots): a copy of ``sources`` (``load_sources``), or freshly
    loaded."""
    if graph.startswith("taesd_"):
        return tiny_torch_module(graph, manifest)
    family = family_module(family_of(model_dir))
    spec = manifest.adapters
    components = _copy_for(graph, sources, bool(spec["slots"])) if sources is not None else load_sources(model_dir, manifest)
    if not spec["slots"] or graph not in ("text_encoder", "kv_proj", "unet_step", "unet_step_shallow"):
        module = _torch_module(graph, components, family)
    else:
        _, contexts = adapter_slots.install_all(components, spec["rank"])
        module = _torch_module(graph, components, family)  # on the adapted layers
        names = manifest.data["graphs"][graph].get("traced_inputs") or [t.name for t in manifest.graphs[graph].inputs]
        own = [name for name in names if name != "adapter_scale" and "_lora_" not in name]
        module = adapter_slots.wrap(graph, module, len(own), contexts)
    return KeptInputs(module, manifest, graph) if graph == "unet_step_shallow" else module


# The parts of the components each graph's source reads: the copy for a graph copies these and
# shares the rest (adapter slots are installed on the text encoders and the UNet alike).
_READS = {"text_encoder": ("text_encoders",), "kv_proj": ("unet",), "unet_step": ("unet",),
          "unet_step_shallow": ("unet",), "vae_encoder": ("vae",), "vae_decoder": ("vae",), "latent_blend": ()}  # fmt: skip


def _copy_for(graph: str, sources, adapters: bool):
    """``sources`` with the parts ``graph``'s source reads copied (wrappers may change them) and
    the rest shared: a model's weights held at most twice, not once per graph."""
    reads = set(_READS.get(graph, ("unet", "vae", "text_encoders")))
    if adapters and graph in ("text_encoder", "kv_proj", "unet_step", "unet_step_shallow"):
        reads |= {"unet", "text_encoders"}
    shared = {id(getattr(sources, part)): getattr(sources, part) for part in ("unet", "vae", "text_encoders") if part not in reads}
    return copy.deepcopy(sources, memo=shared)


def _torch_module(graph: str, components, family) -> torch.nn.Module:
    unet, vae, scheduler = components.unet, components.vae, components.scheduler
    if graph == "text_encoder":
        return family.TextGraph(components)
    if graph == "kv_proj":
        return KVProjGraph(unet)
    if graph.startswith("unet_step"):  # unsliced: the slices' concatenation is the same attention
        map_layers, factor = attention_map_layers(unet)
        step = UNetStepGraph(unet, scheduler.get("prediction_type", "epsilon"), map_layers=map_layers,
                             map_factor=factor, conds=family.conds(components))  # fmt: skip
        return step if graph == "unet_step" else UNetShallowStepGraph(step)
    if graph == "vae_encoder":
        return VaeEncoderGraph(vae)
    if graph == "latent_blend":
        return LatentBlendGraph()
    return VaeDecoderGraph(vae)


def torch_runner(graph: str, manifest: Manifest, model_dir: Path, sources=None) -> TorchCpuRunner:
    spec = manifest.graphs[graph]
    meta = TensorMetadata()
    for t in spec.inputs:
        meta.add(t.name, np.dtype(t.dtype), [None if isinstance(d, str) else d for d in t.shape])
    return TorchCpuRunner(torch_module(graph, model_dir, manifest, sources), meta, [o.name for o in spec.outputs])


def ort_runner(path: Path, name: str) -> OnnxrtRunner:
    return OnnxrtRunner(SessionFromOnnx(str(path), providers=["CPUExecutionProvider"]), name=name)


@dataclass
class ParityReport:
    path: Path
    rows: list[dict[str, Any]]

    @property
    def passed(self) -> int:
        return sum(r["pass"] for r in self.rows)

    @property
    def total(self) -> int:
        return len(self.rows)


def _errors(out: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> dict[str, Any]:
    diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
    scale = float(np.abs(ref).max()) or 1.0
    return {
        "max_abs": float(diff.max()),
        "max_rel": float(diff.max() / scale),  # relative to the reference's largest magnitude
        "atol": atol,
        "rtol": rtol,
        "pass": bool(np.all(diff <= atol + rtol * np.abs(ref))),
    }


def parity_report(cfg: RunConfig, batch_sizes: tuple[int, ...] | None = None,
                  graphs: Optional[Sequence[str]] = None) -> ParityReport:  # fmt: skip
    """Run every graph (or ``graphs`` of them) on every built backend and write parity.md /
    parity.json."""
    manifest = load_manifest(cfg.onnx_dir)
    manifest.check_model(cfg.model_dir)
    scale = manifest.vae_scale_factor
    hw = cfg.base.height // scale
    e = cfg.engines
    sizes = batch_sizes or tuple(sorted({e.min_batch, min(2, e.max_batch), min(e.opt_batch, 4)}))
    engine_sets: dict[str, EngineSet] = {}
    if (cfg.engines_dir / "ort-cpu" / "engines.json").is_file():
        engine_sets["ort-cpu"] = load_engines(cfg.engines_dir / "ort-cpu", manifest, "ort-cpu", engine_tools("ort-cpu"), cpu_name())
    trt_reason = trt_unavailable_reason()
    if trt_reason is None and (cfg.engines_dir / "trt" / "engines.json").is_file():
        engine_sets["trt"] = load_engines(cfg.engines_dir / "trt", manifest, "trt", engine_tools("trt"), engine_device("trt"), [(hw, hw)])

    G_LOGGER.module_severity = G_LOGGER.WARNING  # Polygraphy logs every tensor at INFO
    rows = []
    rng = np.random.default_rng(0)
    exported = graphs_of(manifest)
    for graph in graphs or exported:
        if graph not in exported:
            raise ArtifactError(f"{graph}: not a graph of {cfg.onnx_dir} (it has {', '.join(exported)})")
    wanted = list(graphs or exported)
    sources = load_sources(cfg.model_dir, manifest) if any(not g.startswith("taesd_") for g in wanted) else None
    for graph in wanted:
        runners = [torch_runner(graph, manifest, cfg.model_dir, sources), ort_runner(manifest.path(graph), "onnx")]
        if "ort-cpu" in engine_sets and graph in engine_sets["ort-cpu"].graphs:
            runners.append(ort_runner(engine_sets["ort-cpu"].path(graph), "ort-cpu-engine"))
        if "trt" in engine_sets and graph in engine_sets["trt"].graphs:
            from polygraphy.backend.trt import EngineFromBytes, TrtRunner

            runners.append(TrtRunner(EngineFromBytes(engine_sets["trt"].path(graph).read_bytes()), name="trt"))
        data = [random_feeds(manifest, graph, n, min(n, 2), rng, hw) for n in sizes]
        results = Comparator.run(runners, data_loader=data)
        outputs = {name: iterations for name, iterations in results}
        reference = outputs[runners[0].name]
        for runner in runners[1:]:
            tol = FP16_TOL if runner.name == "trt" and engine_sets["trt"].precision != "fp32" else FP32_TOL
            for n, got, ref in zip(sizes, outputs[runner.name], reference):
                # One row per call: the worst of its outputs (kv_proj has two per layer).
                per_output = {name: _errors(got[name], ref[name], *tol) for name in ref.keys()}
                worst = max(per_output, key=lambda name: (not per_output[name]["pass"], per_output[name]["max_abs"]))
                rows.append({"graph": graph, "backend": runner.name, "batch": n, "output": worst, **per_output[worst]})

    out_dir = cfg.onnx_dir.parent
    lines = [
        "# edit-rt parity report",
        "",
        f"Reference: PyTorch (fp32, CPU). Batch sizes: {', '.join(map(str, sizes))}. Latents {hw}x{hw}.",
        f"TensorRT: {'compared' if 'trt' in engine_sets else 'not compared (' + (trt_reason or 'no trt engines built') + ')'}.",
        "",
        "| graph | backend | batch | worst output | max abs err | max rel err | tolerance (atol / rtol) | result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['graph']} | {r['backend']} | {r['batch']} | {r['output']} | {r['max_abs']:.2e} | "
            f"{r['max_rel']:.2e} | {r['atol']:g} / {r['rtol']:g} | {'pass' if r['pass'] else 'FAIL'} |"
        )
    path = out_dir / "parity.md"
    path.write_text("\n".join(lines) + "\n")
    (out_dir / "parity.json").write_text(json.dumps(rows, indent=2))
    return ParityReport(path, rows)
