"""`edit-rt export`: a diffusers SD folder -> ``build/<model>/onnx/`` (six graphs + manifest).

Each graph is exported with the TorchScript exporter (``dynamo=False``; the dynamo exporter was
not validated for these graphs), the edit batch ``N`` and the latent size dynamic, then checked
with ``onnx.checker`` and ONNX shape inference. A graph whose weights pass
``external_data_threshold_mb`` is re-saved with its tensors in ``<graph>.onnx_data``.

The UNet is exported once: ``unet_step`` returns the cross-attention maps ``preserve: auto``
reads beside the next latents (manifest v9). Two graphs, a plain step and a maps variant, held
two copies of the UNet's weights on disk and in memory (3.4 GB each for SD 1.5 in fp32), and
the maps cost nothing measurable per step (the mean over heads of attention probabilities the
step computes anyway, at 1/4 of the latent grid: 522 vs 515 ms a call on the bench model).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import onnx
import torch

from edit_rt.runtime.engine.manifest import MANIFEST_VERSION, model_fingerprint, sha256_file
from edit_rt.runtime.errors import ModelError
from edit_rt.runtime.model.step_coefs import COEFS
from edit_rt.runtime.storage.store_files import follow_umask

from . import adapter_slots, family_sd
from .export_inputs import export_inputs
from .families import family_module
from .family import family_of
from .graphs import (DEEP_BRANCH, KVProjGraph, LatentBlendGraph, UNetShallowStepGraph, UNetStepGraph, VaeDecoderGraph,
                     VaeEncoderGraph, attention_map_layers, cross_attention_layers)  # fmt: skip
from .graphs import TinyVaeEncoderGraph
from .tiny_vae import checked_for, load_tiny_vae, tiny_vae_source

log = logging.getLogger(__name__)

TEXT_LEN = 77  # CLIP's context length: every SD prompt is padded to it
EXPORT_STAGES = 7  # text_encoder, kv_proj, unet_step, unet_step_shallow, latent_blend, vae_decoder, vae_encoder
# attention_slicing "auto": one head at a time where a UNet row's self-attention scores at the
# model's own size pass this (SD 1.5 at 512x512: 8 heads x 4096^2 floats = 512 MiB a row, and a
# call holds them for every row and both halves of guidance; the shapes models: a few MiB).
SLICE_SCORES_BYTES = 256 * 2**20
_ONNX_DTYPES = {1: "float32", 7: "int64", 10: "float16", 16: "bfloat16", 6: "int32"}


def load_components(model_dir: Path, variant: Optional[str] = None):
    """(unet, text_encoder, vae, tokenizer, scheduler config) of an SD 1.x/2.x folder (the tests'
    and the shapes tools' PyTorch references; the export itself goes through the family)."""
    components = family_sd.load_components(Path(model_dir), variant)
    return components.unet, components.text_encoders[0], components.vae, components.tokenizers[0], components.scheduler


def _spec(value_info) -> dict:
    t = value_info.type.tensor_type
    shape = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
    return {"name": value_info.name, "dtype": _ONNX_DTYPES.get(t.elem_type, str(t.elem_type)), "shape": shape}


def _export_graph(
    module: torch.nn.Module,
    args: tuple,
    path: Path,
    input_names: list[str],
    output_names: list[str],
    dynamic_axes: dict,
    opset: int,
    threshold_bytes: int,
) -> dict:
    """Export ``module`` to ``path``, check it, and return its manifest entry."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp) / path.name
        # The tracer warns about every Python branch on a shape (diffusers has several that
        # are constant for a given latent size); the exported graph is checked against torch.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            # "Only steps=1 can be constant folded": the exporter leaves a strided Slice (the
            # scheduler's ::-1, a stride-2 slice) as a node, which is what the graph needs
            warnings.filterwarnings("ignore", message="Constant folding", category=UserWarning)
            torch.onnx.export(
                module,
                args,
                str(tmp_path),
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
        model = onnx.load(str(tmp_path))  # pulls in external data, if torch wrote any
    weight_bytes = sum(len(t.raw_data) or onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    external = weight_bytes > threshold_bytes
    data_file = path.with_name(path.name + "_data")
    for stale in (path, data_file):
        stale.unlink(missing_ok=True)
    if external:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data_file.name,
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, str(path))
    for written in (path, data_file) if external else (path,):
        follow_umask(written)  # onnx writes its external data 0600
    # Path-based check and inference: they work past protobuf's 2 GiB message limit.
    onnx.checker.check_model(str(path), full_check=True)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False))
    return {
        "file": path.name,
        "external_data": data_file.name if external else None,
        "weight_bytes": weight_bytes,
        "file_bytes": path.stat().st_size + (data_file.stat().st_size if external else 0),
        "inputs": [_spec(v) for v in inferred.graph.input],
        "outputs": [_spec(v) for v in inferred.graph.output],
        "sha256": sha256_file(path),
    }


@dataclass
class StepIO:
    """The step graph's inputs (name, role, example value, dynamic axes) and outputs, in order.

    The one place that names them: the export traces with these, the manifest records their
    roles, and the runtime allocates and fills its slots from the roles alone.
    """

    inputs: list[tuple[str, str, torch.Tensor, dict[int, str]]]
    outputs: list[tuple[str, str]]
    output_axes: dict[str, dict[int, str]]

    @property
    def roles(self) -> dict[str, str]:
        return {name: role for name, role, _, _ in self.inputs} | dict(self.outputs)


def step_io(layers: list, c: int, h: int, w: int, maps: bool = False, conds: Optional[list[dict]] = None,
            adapters: Optional[tuple[list, int, int]] = None, deep: int = 0, shallow: bool = False) -> StepIO:  # fmt: skip
    """The step graph's inputs with their roles (runtime/engine/step_signature.py reads them back):
    ``latents``, ``step_scalar:<schedule attribute>`` (changes every step),
    ``row_scalar:<row attribute>`` (fixed per row), ``set_index`` (the row's negative-prompt
    set), ``entry_uncond`` (rows at their entry step), ``row_ref`` (the row whose self-attention
    pattern it takes), ``row_kv`` (the row's K/V, layer order), ``set_kv`` (the negative
    prompts' K/V), and with ``adapters`` ((adapter layers, slots, rank): adapter_slots.py)
    ``row_adapters`` (the row's scale per adapter slot) and ``adapter_weight`` (the slots' LoRA
    matrices, resident), ``step_coefs`` (the sampler's update, step_coefs.COEFS), ``history``
    (the row's last two x_0), ``step_noise`` (an ancestral sampler's); outputs
    ``next_latents``, ``uncond_out``, ``history_out``, (the maps variant) ``attn_maps`` and
    ``deep_out`` (the ``deep`` channels entering the skip branch, at the latent's size).
    ``shallow``: ``unet_step_shallow``'s (graphs.UNetShallowStepGraph): ``deep_features`` (role
    ``deep_in``) after ``noise``, outputs the first three."""
    # Traced with N=3 rows, E=1 of them at entry and 2 negative-prompt sets, so that no batch
    # or set count of 1 gets frozen into the graph as a broadcast.
    n, e, sets = 3, 1, 2
    latent_axes = {0: "N", 2: "H", 3: "W"}
    inputs = [
        ("latents", "latents", torch.randn(n, c, h, w), latent_axes),
        ("timestep", "step_scalar:timesteps", torch.tensor([900.0, 500.0, 20.0]), {0: "N"}),
        ("alpha_t", "step_scalar:alpha_t", torch.tensor([0.1, 0.5, 0.9]), {0: "N"}),
        # the sampler's per-row update (step_coefs.COEFS), written once per step as one tensor
        ("coefs", "step_coefs", torch.rand(n, len(COEFS)) + 0.5, {0: "N"}),
        ("guidance", "row_scalar:guidance", torch.tensor([7.5, 5.0, 1.0]), {0: "N"}),
        ("uncond_index", "set_index", torch.tensor([1, 0, 1], dtype=torch.int64), {0: "N"}),
        ("uncond_given", "entry_uncond", torch.randn(e, c, h, w), {0: "E", 2: "H", 3: "W"}),
        # a given row's slope on its own latent (tail.uncond: base-corrected; 0: u as given)
        ("uncond_slope", "entry_slope", torch.rand(e), {0: "E"}),
    ]
    # the row whose self-attention pattern each row takes (structure keeping; itself otherwise)
    inputs.append(("self_ref", "row_ref", torch.tensor([0, 0, 2], dtype=torch.int64), {0: "N"}))
    # a multistep solver's last two x_0 (resident per row), an ancestral sampler's step noise
    inputs.append(("history", "history", torch.randn(n, 2, c, h, w), {0: "N", 3: "H", 4: "W"}))
    inputs.append(("noise", "step_noise", torch.randn(n, c, h, w), latent_axes))
    if shallow:  # each UNet row's deep features from its last full step, [uncond rows; cond rows]
        inputs.append(("deep_features", "deep_in", torch.randn(2 * n - e, deep, h, w), {0: "U", 2: "H", 3: "W"}))
    for cond in conds or []:  # the family's per-row conditioning (SDXL: text_embeds, time_ids)
        name, dim = cond["name"], cond["dim"]
        if cond["uncond"] == "set":
            inputs += [(f"cond_{name}", f"row_cond:{name}", torch.randn(n, dim), {0: "N"}),
                       (f"uncond_{name}", f"set_cond:{name}", torch.randn(sets, dim), {0: "M"})]  # fmt: skip
        else:
            inputs.append((name, f"row_cond:{name}", torch.rand(n, dim) * 64, {0: "N"}))

    for i, layer in enumerate(layers):
        d = layer.inner_dim // layer.heads
        inputs += [
            (f"cond_k_{i}", "row_kv", torch.randn(n, layer.heads, d, TEXT_LEN), {0: "N"}),
            (f"cond_v_{i}", "row_kv", torch.randn(n, layer.heads, TEXT_LEN, d), {0: "N"}),
            (f"uncond_k_{i}", "set_kv", torch.randn(layer.heads, d, sets * TEXT_LEN), {2: "S"}),
            (f"uncond_v_{i}", "set_kv", torch.randn(layer.heads, sets * TEXT_LEN, d), {1: "S"}),
        ]
    if adapters is not None:
        adapter_layers, slots, rank = adapters
        for name, example, axes in adapter_slots.example_inputs(adapter_layers, "unet_step", n, slots, rank):
            inputs.append((name, "row_adapters" if name == "adapter_scale" else "adapter_weight", example, axes))
    outputs = [("next_latents", "next_latents"), ("uncond_out", "uncond_out"), ("history_out", "history_out")]
    axes = {name: latent_axes for name, _ in outputs}
    axes["history_out"] = {0: "N", 3: "H", 4: "W"}
    if maps and not shallow:
        outputs.append(("attn_maps", "attn_maps"))
        axes["attn_maps"] = {0: "N", 2: "HM", 3: "WM"}
    if not shallow:
        outputs.append(("deep_out", "deep_out"))
        axes["deep_out"] = {0: "U", 2: "H", 3: "W"}
    return StepIO(inputs, outputs, axes)


def _write_tokenizer(tokenizer, out: Path) -> None:
    """Save the fast tokenizer as one ``tokenizer.json`` with SD's padding and truncation set."""
    backend = tokenizer.backend_tokenizer
    pad_id = tokenizer.pad_token_id
    backend.enable_truncation(max_length=TEXT_LEN)
    backend.enable_padding(length=TEXT_LEN, pad_id=pad_id, pad_token=tokenizer.pad_token)
    backend.save(str(out))


@dataclass(frozen=True)
class ExportEvent:
    """One graph of `edit-rt export` starting (``seconds`` None) or done. ``weight`` is its share
    of ``total``, its parameter count (tracing, folding and writing a graph take time with its
    weights: SD 1.5's UNet is 80% of the export), so a bar weighted by it moves as the work does."""

    graph: str
    weight: int
    total: int
    seconds: Optional[float] = None
    bytes_written: Optional[int] = None


def _parameters(*modules) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def slice_heads_for(unet: torch.nn.Module, attention_slicing: Union[str, int]) -> int:
    """The step graph's self-attention heads per slice (graphs.SharedLayoutProcessor; 0: all at
    once) for ``export.attention_slicing``: ``auto`` slices one head at a time where one row's
    scores at the UNet's own size pass SLICE_SCORES_BYTES, an int is heads per slice."""
    if attention_slicing != "auto":
        return int(attention_slicing)
    size = unet.config.sample_size
    h, w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    down = [(int(name.split(".")[1]), m.heads) for name, m in unet.named_modules()
            if name.startswith("down_blocks.") and name.endswith("attn1")]  # fmt: skip
    if not down:
        return 0
    level, heads = min(down)  # the finest grid with self-attention: the most tokens
    tokens = -(-h // 2**level) * -(-w // 2**level)
    return 1 if heads * tokens**2 * 4 > SLICE_SCORES_BYTES else 0


def export_onnx(model_dir: Path, out_dir: Path, opset: int = 17, external_data_threshold_mb: float = 1900.0,
                progress: Optional[Callable[[ExportEvent], None]] = None, variant: Optional[str] = None,
                adapter_slots_n: int = 0, adapter_rank: int = 16,
                attention_slicing: Union[str, int] = "auto", tiny_vae: Optional[Path] = None) -> Path:  # fmt: skip
    """Export ``model_dir`` to ``out_dir`` and write ``manifest.json``; return the manifest path.

    ``progress`` is called as each graph starts and when it is done (:class:`ExportEvent`,
    ``EXPORT_STAGES`` graphs in all); ``variant`` picks diffusers' variant weights (``fp16``:
    cast to fp32 for the graphs); ``adapter_slots_n`` > 0 gives the text encoder, kv_proj and
    step graphs that many resident LoRA slots of rank up to ``adapter_rank``
    (export/compile/adapter_slots.py); 0: none; ``attention_slicing`` the step graph's self-attention
    slicing (:func:`slice_heads_for`); ``tiny_vae`` the tiny autoencoder (export.tiny_vae; None: the
    model folder's ``vae_tiny/`` if any), exported as ``taesd_decoder`` (and ``taesd_encoder``)."""
    report = progress or (lambda event: None)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    family = family_module(family_of(model_dir))  # refuses what edit-rt cannot run, in one line
    components = family.load_components(model_dir, variant)
    fingerprint, file_stats = model_fingerprint(model_dir)
    unet, vae, scheduler = components.unet, components.vae, components.scheduler
    tiny_source = tiny_vae_source(model_dir, tiny_vae)
    tiny = None if tiny_source is None else checked_for(load_tiny_vae(tiny_source), vae)
    if scheduler.get("thresholding"):
        raise ModelError(f"{model_dir}/scheduler: thresholding=true is not supported by edit-rt")
    prediction_type = scheduler.get("prediction_type", "epsilon")

    # Export into a fresh folder and swap it in at the end: a failed export leaves the old one.
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    threshold = int(external_data_threshold_mb * 1024 * 1024)

    c = unet.config.in_channels
    h = w = int(unet.config.sample_size) if isinstance(unet.config.sample_size, int) else int(unet.config.sample_size[0])
    d_text = int(unet.config.cross_attention_dim)  # the hidden states kv_proj takes (SDXL: both encoders)
    attention = cross_attention_layers(unet)
    layers = [layer for layer, _ in attention]
    conds = family.conds(components)
    n2 = 2  # trace with B=2 so no batch-1 broadcast gets frozen into the graph
    graphs = {}
    slots, rank = int(adapter_slots_n), int(adapter_rank)
    adapter_layers, contexts = adapter_slots.install_all(components, rank) if slots else ([], {})
    slice_heads = slice_heads_for(unet, attention_slicing)
    vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
    weights = {
        "text_encoder": _parameters(*components.text_encoders),
        "kv_proj": _parameters(*(m for _, a in attention for m in (a.to_k, a.to_v))),
        "unet_step": _parameters(unet),
        "unet_step_shallow": _parameters(unet.conv_in, unet.down_blocks[DEEP_BRANCH], unet.up_blocks[-1 - DEEP_BRANCH], unet.conv_out),
        "latent_blend": 1,
        # the VAE's time goes to its convolutions at full image size, not its weights (SD 1.5:
        # the decoder's 49.5 M parameters took 68 s, the UNet's 860 M 119 s): weighted by both
        "vae_decoder": _parameters(vae.decoder, getattr(vae, "post_quant_conv", None)) * max(1, h * vae_scale // 64),
        "vae_encoder": _parameters(vae.encoder, getattr(vae, "quant_conv", None)) * max(1, h * vae_scale // 64),
    }
    if tiny is not None:  # a few convolutions at full image size, 64 channels wide
        weights["taesd_decoder"] = _parameters(tiny.module.decoder) * max(1, h * vae_scale // 64)
        if tiny.encoder:
            weights["taesd_encoder"] = _parameters(tiny.module.encoder) * max(1, h * vae_scale // 64)
    total = sum(weights.values())

    def export_stage(graph: str, export: Callable[[], dict]) -> None:
        report(ExportEvent(graph, weights[graph], total))
        start = time.perf_counter()
        graphs[graph] = export()
        report(ExportEvent(graph, weights[graph], total, time.perf_counter() - start, graphs[graph]["file_bytes"]))

    def adapted(graph: str, module: torch.nn.Module, inputs: int, rows: int):
        """``module`` with ``graph``'s adapter inputs appended (none without slots)."""
        if not slots:
            return module, []
        extra = adapter_slots.example_inputs(adapter_layers, graph, rows, slots, rank)
        return adapter_slots.wrap(graph, module, inputs, contexts), extra

    log.info("exporting text_encoder (%s)", components.family)
    ids = [torch.zeros(n2, TEXT_LEN, dtype=torch.int64) for _ in family.text_inputs()]
    axes = {name: {0: "B"} for name in family.text_inputs() + family.text_outputs()}
    module, extra = adapted("text_encoder", family.TextGraph(components), len(ids), n2)
    export_stage("text_encoder", lambda: _export_graph(
        module, (*ids, *(a for _, a, _ in extra)), staging / "text_encoder.onnx",
        family.text_inputs() + [name for name, _, _ in extra], family.text_outputs(),
        {**axes, **{name: ax for name, _, ax in extra if ax}}, opset, threshold,
    ))  # fmt: skip
    log.info("exporting kv_proj (%d cross-attention layers)", len(layers))
    kv_names = [f"{kind}_{i}" for i in range(len(layers)) for kind in ("k", "v")]
    kv_module, kv_extra = adapted("kv_proj", KVProjGraph(unet), 1, n2)
    export_stage("kv_proj", lambda: _export_graph(
        kv_module, (torch.randn(n2, TEXT_LEN, d_text), *(a for _, a, _ in kv_extra)), staging / "kv_proj.onnx",
        ["hidden_states"] + [name for name, _, _ in kv_extra], kv_names,
        {"hidden_states": {0: "B"}, **{k: {0: "B"} for k in kv_names}, **{name: ax for name, _, ax in kv_extra if ax}},
        opset, threshold,
    ))  # fmt: skip

    map_layers, map_factor = attention_map_layers(unet)
    log.info("exporting unet_step (prediction_type=%s, self-attention %s)", prediction_type,
             f"{slice_heads} head(s) at a time" if slice_heads else "all heads at once")  # fmt: skip
    step_graph = UNetStepGraph(unet, prediction_type, TEXT_LEN, map_layers, map_factor, conds, slice_heads).eval()
    deep = int(unet.config.block_out_channels[DEEP_BRANCH + 1])  # what the skip branch's up block takes
    for graph, module in (("unet_step", step_graph), ("unet_step_shallow", UNetShallowStepGraph(step_graph).eval())):
        io = step_io(layers, c, h, w, True, conds, (adapter_layers, slots, rank) if slots else None, deep,
                     shallow=graph == "unet_step_shallow")  # fmt: skip
        fixed = len(io.inputs) - len([1 for _, role, _, _ in io.inputs if role in ("row_adapters", "adapter_weight")])
        if slots:
            module = adapter_slots.wrap(graph, module, fixed, contexts)
        export_stage(graph, lambda: _export_graph(
            module, tuple(a for _, _, a, _ in io.inputs), staging / f"{graph}.onnx",
            [name for name, _, _, _ in io.inputs], [name for name, _ in io.outputs],
            {**{name: axes for name, _, _, axes in io.inputs}, **io.output_axes}, opset, threshold,
        ))  # fmt: skip
        # the exporter drops inputs no output reads (a shallow step's skipped layers' K/V)
        kept = {t["name"] for t in graphs[graph]["inputs"] + graphs[graph]["outputs"]}
        graphs[graph]["roles"] = {name: role for name, role in io.roles.items() if name in kept}
        graphs[graph]["traced_inputs"] = [name for name, _, _, _ in io.inputs]
    graphs["unet_step_shallow"]["deep_branch"] = DEEP_BRANCH
    graphs["unet_step"]["map_factor"] = map_factor
    graphs["unet_step"]["map_layers"] = [layers[i].name for i in sorted(map_layers)]
    graphs["unet_step"]["slice_heads"] = slice_heads

    log.info("exporting latent_blend")
    latent = lambda: torch.randn(n2, c, h, w)  # noqa: E731
    axes = {0: "N", 2: "H", 3: "W"}
    history_axes = {0: "N", 3: "H", 4: "W"}
    export_stage("latent_blend", lambda: _export_graph(
        LatentBlendGraph(), (latent(), (torch.rand(n2, 1, h, w) > 0.5).float(), latent(), latent(),
                             torch.randn(n2, 2, c, h, w)),
        staging / "latent_blend.onnx", ["next_latents", "keep", "base", "add", "history_out"], ["latents", "history"],
        {**{name: axes for name in ("next_latents", "keep", "base", "add", "latents")},
         "history_out": history_axes, "history": history_axes}, opset, threshold,
    ))  # fmt: skip
    log.info("exporting vae_decoder")
    export_stage("vae_decoder", lambda: _export_graph(
        VaeDecoderGraph(vae), (torch.randn(n2, vae.config.latent_channels, h, w),), staging / "vae_decoder.onnx",
        ["latents"], ["images"],
        {"latents": {0: "N", 2: "H", 3: "W"}, "images": {0: "N", 2: "IH", 3: "IW"}}, opset, threshold,
    ))  # fmt: skip
    log.info("exporting vae_encoder")
    scale = vae_scale
    export_stage("vae_encoder", lambda: _export_graph(
        VaeEncoderGraph(vae), (torch.rand(n2, 3, h * scale, w * scale),), staging / "vae_encoder.onnx",
        ["images"], ["latents"],
        {"images": {0: "N", 2: "IH", 3: "IW"}, "latents": {0: "N", 2: "H", 3: "W"}}, opset, threshold,
    ))  # fmt: skip
    if tiny is not None:
        log.info("exporting taesd_decoder (%s)", tiny.source)
        export_stage("taesd_decoder", lambda: _export_graph(
            VaeDecoderGraph(tiny.module), (torch.randn(n2, vae.config.latent_channels, h, w),),
            staging / "taesd_decoder.onnx", ["latents"], ["images"],
            {"latents": {0: "N", 2: "H", 3: "W"}, "images": {0: "N", 2: "IH", 3: "IW"}}, opset, threshold,
        ))  # fmt: skip
        graphs["taesd_decoder"]["source"] = str(tiny.source)
        if tiny.encoder:
            export_stage("taesd_encoder", lambda: _export_graph(
                TinyVaeEncoderGraph(tiny.module), (torch.rand(n2, 3, h * scale, w * scale),),
                staging / "taesd_encoder.onnx", ["images"], ["latents"],
                {"images": {0: "N", 2: "IH", 3: "IW"}, "latents": {0: "N", 2: "H", 3: "W"}}, opset, threshold,
            ))  # fmt: skip
            graphs["taesd_encoder"]["source"] = str(tiny.source)
    description = family.description(components)
    # diffusers' upcast_attention (SD 2.x): scores past fp16's range; fp16 engines keep them fp32
    description["upcast_attention"] = bool(unet.config.get("upcast_attention", False))
    for tokenizer, name in zip(components.tokenizers, description["tokenizers"]):
        _write_tokenizer(tokenizer, staging / name)
    import diffusers
    import onnxruntime
    import transformers

    manifest = {
        "format": "edit-rt-onnx",
        "version": MANIFEST_VERSION,
        "opset": opset,
        "tools": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
        "model": {
            "path": str(model_dir.resolve()),
            "fingerprint": fingerprint,
            "file_stats": file_stats,
            "latent_channels": c,
            "sample_size": h,
            # The traced UNet assumes latents divisible by 2 ** (number of upsamplers).
            "latent_multiple": 2 ** (len(unet.config.block_out_channels) - 1),
            "vae_scale_factor": vae_scale,
            # what runtime/engine/memory.py counts a row's activations from
            "block_out_channels": [int(c) for c in unet.config.block_out_channels],
            "vae_channels": int(vae.config.block_out_channels[0]),
            "text_len": TEXT_LEN,
            "text_hidden_size": d_text,
            "vocab_size": components.text_encoders[0].config.vocab_size,
            "variant": variant,
            "prediction_type": prediction_type,
            "scheduler": scheduler,
        },
        "family": description,
        # what `edit-rt export` compares to skip an export that would write the same graphs
        "export_inputs": export_inputs(opset, external_data_threshold_mb, variant, slots, rank, attention_slicing, tiny_vae),
        "layers": [{"name": l.name, "heads": l.heads, "inner_dim": l.inner_dim} for l in layers],
        # LoRA slots (adapter_slots.py): resident inputs of text_encoder, kv_proj and unet_step
        # (a layer whose output no graph output depends on, the last CLIP layer of a family that
        # reads the penultimate one, loses its inputs in the export: "used": false)
        "adapters": {"slots": slots, "rank": rank if slots else 0,
                     "layers": [l.manifest() | {"used": l.down in {t["name"] for t in graphs[l.graph]["inputs"]}}
                                for l in adapter_layers]},  # fmt: skip
        # K of a layer is [B, heads, head_dim, 77] (transposed per head), V [B, heads, 77, head_dim]
        "kv_layout": "heads-major",
        # the step graphs take E = N (every row given its unconditional prediction, no
        # unconditional UNet row): runtime/engine/manifest.py reads it, False where absent
        "step_all_given": True,
        "graphs": graphs,
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
    for name in description["tokenizers"]:
        follow_umask(staging / name)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
    log.info("wrote %s", out_dir)
    return out_dir / "manifest.json"
