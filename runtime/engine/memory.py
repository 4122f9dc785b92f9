"""Host memory on the CPU path: what the graphs hold, what a call adds per row, what fits.

ONNX Runtime on the CPU holds each graph's weights once (its pre-packed copies replace the
originals: SD 1.5's 3.36 GB UNet costs 3.2 GiB of RSS loaded) and, while a call runs, the
activations of every row of it. At 512x512 those are large: the self-attention scores of the
64x64 latent grid are heads x 4096^2 floats per UNet row, twice per step row (classifier-free
guidance), and their softmax as much again: 2.2 GB for one SD 1.5 row unsliced, which is why
the export slices that attention one head at a time (``export.attention_slicing``). The VAE
decoder's activations at full image size come on top when images are decoded.

:class:`MemoryPlan` counts these from the manifest (weights) and a per-row estimate fitted to
measurements (docs/performance.md), so the loop can run a call at the rows that fit (the rest
wait for the next call: more calls, never a refusal) and refuse only a size at which not even
one row fits, saying how much it needs and how much there is.

:data:`ENGINE_MEMORY` does the same for each CPU engine as a whole (ONNX Runtime, OpenVINO fp32
and bf16: what each holds of the weights and a row), and :func:`unet_gflop` counts a UNet row's
arithmetic, so that ``backend: auto`` picks the engine that fits and runs the model fastest
(backend.py's ``cpu_choice``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from ..errors import ConfigError

# Live float32 tensors of the finest level's shape (channels x latent pixels) one UNet row holds
# at its peak besides attention scores: ResNet and transformer activations, skip connections
# kept for the up path, ONNX Runtime's scratch. Fitted to SD 1.5 at 512x512 (docs/performance.md).
LIVE_TENSORS = 40
# Of the decoder at full image size per decoded image: the same count over its widest level
# (SD's VAE: 128 channels x 512 x 512); fitted likewise (one 512x512 decode: +0.76..0.88 GiB).
VAE_LIVE_TENSORS = 6
# What is kept free besides the estimate: the allocator's rounding, Python, the images.
MARGIN = 512 * 2**20
# Past this an image's decode runs alone: on the CPU a VAE call costs the same per image at any
# count, so batching such images only adds their activations up (SD 1.5 at 512x512: 4 images a
# call took a 4-edit run from 6.5 to 8.3 GB), and each image is written as soon as it is done.
DECODE_ALONE = 256 * 2**20


def _finest(layers: Sequence[dict]) -> tuple[int, int, int]:
    """(level, heads, channels) of the finest grid with attention, from the manifest's
    cross-attention layer list (a ``down_blocks.k`` layer sees the latent at 1/2^k a side)."""
    down = [(int(layer["name"].split(".")[1]), layer["heads"], layer["inner_dim"])
            for layer in layers if layer["name"].startswith("down_blocks.")]  # fmt: skip
    if down:
        return min(down)
    layer = max(layers, key=lambda l: l["heads"], default={"heads": 1, "inner_dim": 64})
    return 0, layer["heads"], layer["inner_dim"]


def step_row_bytes(layers: Sequence[dict], latent_hw: tuple[int, int], slice_heads: int = 0,
                   channels0: Optional[int] = None) -> int:  # fmt: skip
    """About what one step row (its two UNet rows) adds to a call at ``latent_hw`` latents:
    attention scores and softmax of the finest level (``slice_heads`` heads at a time, 0: all)
    and :data:`LIVE_TENSORS` activations of the finest level's width over the latent grid."""
    h, w = latent_hw
    level, heads, inner = _finest(layers)
    held = slice_heads if 0 < slice_heads < heads else heads
    tokens = -(-h // 2**level) * -(-w // 2**level)
    scores = held * tokens**2 * 4 * 2
    activations = LIVE_TENSORS * (channels0 or inner) * h * w * 4
    return 2 * (scores + activations)


def deep_feature_bytes(channels: int, latent_hw: tuple[int, int]) -> int:
    """A step row's slot of DeepCache's resident deep features: two UNet rows of ``channels``
    over the latent grid, fp32 (allocated with the slots, whether or not a row uses them)."""
    return 2 * channels * latent_hw[0] * latent_hw[1] * 4


def decode_row_bytes(latent_hw: tuple[int, int], vae_scale: int, vae_channels: int = 128) -> int:
    """About what decoding one image adds: the mid block's attention over every latent pixel
    (one head, scores and softmax) and the decoder's activations at full image size."""
    h, w = latent_hw
    attention = (h * w) ** 2 * 4 * 2
    return attention + VAE_LIVE_TENSORS * vae_channels * (h * vae_scale) * (w * vae_scale) * 4


def process_rss() -> int:
    """This process's resident memory now (Linux's /proc/self/statm), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_host_bytes() -> Optional[int]:
    """Memory the kernel could give this process now (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class MemoryPlan:
    """What a latent size costs on the CPU path, and the rows of a call that fit ``free``."""

    weights: int  # the graphs' weights, held for the process's life
    step_row: int  # one step row's activations
    decode_row: int  # one decoded image's activations
    free: Optional[int]  # bytes this process may still take (None: unknown, no limit)
    latent_hw: tuple[int, int] = (0, 0)  # the latent size planned for
    native: int = 0  # the model's own image size in pixels (its UNet's sample_size x the VAE's factor; 0: unknown)

    def step_rows(self, limit: int) -> int:
        """Rows per step call that fit (at most ``limit``; 0: not even one)."""
        if self.free is None:
            return limit
        return max(0, min(limit, (self.free - MARGIN) // max(self.step_row, 1)))

    def decode_rows(self, limit: int) -> int:
        """Images per VAE call that fit (at least 1 where one step row fits: a decode runs
        after the tail's calls, in their memory); one where an image is large (DECODE_ALONE)."""
        if self.decode_row > DECODE_ALONE:
            return 1
        if self.free is None:
            return limit
        return max(1, min(limit, (self.free - MARGIN) // max(self.decode_row, 1)))


def memory_plan(manifest: Any, latent_hw: tuple[int, int], budget: Optional[int] = None,
                held: Optional[int] = None, loading: int = 0, engine: str = "ort-cpu") -> MemoryPlan:  # fmt: skip
    """The plan for ``latent_hw`` latents of ``manifest``'s graphs. ``budget``: the bytes the
    process may use in all (``engines.max_memory_gb``; None: what the machine has free now plus
    what the process already holds); ``held``: the process's resident bytes now, read from
    /proc when None; ``loading``: weights not loaded yet that will be (a check made before the
    graphs load, so that a refusal comes before their seconds); ``engine``: whose rows
    (ENGINE_MEMORY: openvino's dynamic compile holds more a row, and rows' more after a call)."""
    graphs = manifest.data["graphs"]
    step = graphs["unet_step"]
    weights = sum(int(g.get("weight_bytes", 0)) for g in graphs.values())
    model = manifest.data["model"]
    blocks = model.get("block_out_channels")
    row = step_row_bytes(manifest.layers, latent_hw, int(step.get("slice_heads", 0)), blocks[0] if blocks else None)
    shallow = graphs.get("unet_step_shallow", {})  # DeepCache's deep features, resident for both UNet rows (loop/row_scheduler.py)
    deep = [t["shape"][1] for t in shallow.get("inputs", []) if shallow.get("roles", {}).get(t["name"]) == "deep_in"]
    row += deep_feature_bytes(int(deep[0]) if deep else 0, latent_hw)
    decode = decode_row_bytes(latent_hw, manifest.vae_scale_factor, int(model.get("vae_channels", 128)))
    cost = ENGINE_MEMORY[engine]
    extra = int(cost.per_row * row * cost.extra_rows)
    row = int(cost.per_row * row)
    if budget is not None:  # the process's own share counts against a budget, not against what the machine has free
        free: Optional[int] = budget - (process_rss() if held is None else held) - loading - extra
    else:
        have = available_host_bytes()
        free = None if have is None else have - loading - extra
    return MemoryPlan(weights, row, decode, free, tuple(latent_hw))


def plan_from_model_dir(model_dir: Path, width: int, height: int, budget: Optional[int] = None) -> MemoryPlan:
    """:func:`memory_plan` from a diffusers folder's configs and files, before anything is
    exported (so `edit-rt export` refuses a size no row fits before its minutes): the UNet's
    finest attention level and its heads (diffusers reads ``attention_head_dim`` as the head
    count where ``num_attention_heads`` is unset), the VAE's factor, the weights' file sizes
    (fp16 files count twice: the graphs are fp32)."""
    unet = json.loads((model_dir / "unet" / "config.json").read_text())
    vae = json.loads((model_dir / "vae" / "config.json").read_text())
    blocks = list(unet["block_out_channels"])
    heads = unet.get("num_attention_heads") or unet.get("attention_head_dim") or 8
    heads = list(heads) if isinstance(heads, (list, tuple)) else [heads] * len(blocks)
    level = next((k for k, kind in enumerate(unet["down_block_types"]) if "CrossAttn" in kind), 0)
    layers = [{"name": f"down_blocks.{level}.attentions.0.transformer_blocks.0.attn2", "heads": int(heads[level]),
               "inner_dim": int(blocks[level])}]  # fmt: skip
    size = unet.get("sample_size", 64)
    size = size if isinstance(size, int) else max(size)
    tokens = (size // 2**level) ** 2
    sliced = 1 if heads[level] * tokens**2 * 4 > 256 * 2**20 else 0  # export.attention_slicing "auto"
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    hw = (height // scale, width // scale)
    weights = 0
    for part in ("unet", "text_encoder", "text_encoder_2", "vae"):
        for f in (model_dir / part).glob("*.safetensors") if (model_dir / part).is_dir() else ():
            weights += f.stat().st_size * (2 if ".fp16." in f.name else 1)
    row = step_row_bytes(layers, hw, sliced, blocks[0]) + deep_feature_bytes(blocks[1] if len(blocks) > 1 else 0, hw)
    decode = decode_row_bytes(hw, scale, int(vae["block_out_channels"][0]))
    have = budget if budget is not None else available_host_bytes()
    return MemoryPlan(weights, row, decode, None if have is None else have - weights, hw, size * scale)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def no_row_fits(plan: MemoryPlan, width: int, height: int, latent_hw: tuple[int, int], native: int,
                budgeted: bool) -> str:  # fmt: skip
    """The one line that refuses a size at which not even one step row fits."""
    where = "engines.max_memory_gb allows" if budgeted else "this machine has"
    return (f"base.width/height: {width}x{height} needs about {gib(plan.step_row + MARGIN)} for one step row "
            f"(attention over {latent_hw[0]}x{latent_hw[1]} latents) beside {gib(plan.weights)} of weights, and {where} "
            f"{gib(max(plan.free or 0, 0))} more; use a smaller size (the model's own is {native}x{native}), free "
            "memory, or raise engines.max_memory_gb")  # fmt: skip


# Backends whose rows this plan counts before an export: the CPU's (its memory is the host's) and
# auto, which may choose it; a GPU's engines fix their own size and rows (engines.py checks them).
PLANNED_BEFORE_EXPORT = frozenset({"ort-cpu", "auto"})


def refuse_sizes_no_row_fits(model_dir: Path, backend: str, sizes: Iterable[tuple[int, int]],
                             max_memory_gb: Optional[float]) -> None:  # fmt: skip
    """Refuse (ConfigError, :func:`no_row_fits`'s line) the first of ``sizes`` (width, height) at
    which not even one step row of the diffusers model in ``model_dir`` fits beside its weights,
    within ``max_memory_gb`` (``engines.max_memory_gb``; None: what the machine has free). Read
    from the model's configs (:func:`plan_from_model_dir`), so `edit-rt export` refuses before
    its minutes rather than after them. A folder that is no SD model is left to the export."""
    if backend not in PLANNED_BEFORE_EXPORT or not (model_dir / "unet" / "config.json").is_file():
        return
    budget = None if max_memory_gb is None else int(max_memory_gb * 1e9)
    for width, height in sizes:
        plan = plan_from_model_dir(model_dir, width, height, budget)
        if plan.step_rows(1) == 0:
            raise ConfigError(no_row_fits(plan, width, height, plan.latent_hw, plan.native, budget is not None))


# ---- The CPU engines side by side: what each holds, and which one runs a model fastest ----

@dataclass(frozen=True)
class EngineMemory:
    """A CPU engine's peak resident bytes as a function of the model: ``base`` (the process and
    the engine's libraries) + the weights as the engine holds them + ``per_row`` step rows
    (:func:`step_row_bytes`) for each row of a call and ``extra_rows`` more after a first call."""

    base: int
    external: float  # bytes held per byte of weights in an .onnx_data file
    inline: float  # per byte of weights inside an .onnx file
    per_row: float
    extra_rows: float = 0.0


# Fitted to the peak RSS of docs/engines-cpu.json (shapes, bench and SD 1.5 models; each engine
# in a process of its own after a warm-up and timed tails; tests/test_backend_select.py holds
# every point within 15%). ONNX Runtime pre-packs an external weight in place of its original
# (SD 1.5's 3.36 GB UNet: 3.4 GB loaded) but keeps a weight that sits inside the .onnx beside
# what it packs (~1.5x: the bench model's 0.1 GB of graphs load as 0.26 GB, SD 1.5's 0.89 GB of
# text encoder, VAE and small graphs as 1.4 GB); a row is what step_row_bytes counts (measured
# per row: 0.80x on SD 1.5 between 1 and 4 rows, 1.0x on the bench model between 4 and 16).
# OpenVINO compiled with dynamic axes (SD 1.5's UNet, past backend_ov's 512 MiB static limit)
# maps and repacks its weights (1.37x loaded in fp32, 1.22x in bf16) and has no static memory
# plan for dynamic shapes: 1.35 step rows a row in fp32 (0.74 in bf16) and about 3 (4) rows'
# more held after the first call. Those two are fitted to SD 1.5's 1- and 4-row points alone:
# the only dynamic compile measured. Statically compiled graphs (the bench and shapes models)
# repack their weights once per compiled shape and are not modelled: auto leaves them to ort-cpu.
ENGINE_MEMORY = {
    "ort-cpu": EngineMemory(base=106 * 10**6, external=1.0, inline=1.5, per_row=1.0),
    "openvino": EngineMemory(base=135 * 10**6, external=1.37, inline=1.37, per_row=1.35, extra_rows=2.94),
    "openvino bf16": EngineMemory(base=135 * 10**6, external=1.22, inline=1.22, per_row=0.74, extra_rows=4.0),
}


@dataclass(frozen=True)
class CpuModel:
    """What choosing a CPU engine reads of an export at one latent size."""

    external: int  # weight bytes of the graphs loaded up front, in .onnx_data files
    inline: int  # and inside .onnx files
    step_row: int  # one step row's activations (step_row_bytes, DeepCache's features with it)
    gflop_per_unet_row: float  # the UNet's arithmetic for one UNet row (unet_gflop)
    unet_weights: int  # unet_step's weight bytes: OpenVINO compiles it static per shape up to 512 MiB


def engine_peak_bytes(engine: str, model: CpuModel, rows: int) -> int:
    """``engine``'s ("ort-cpu", "openvino", "openvino bf16") expected peak resident bytes for
    calls of ``rows`` step rows of ``model`` (ENGINE_MEMORY)."""
    m = ENGINE_MEMORY[engine]
    held = m.base + m.external * model.external + m.inline * model.inline
    return int(held + m.per_row * model.step_row * (rows + m.extra_rows))


def unet_gflop(blocks: Sequence[int], layers: Sequence[dict], latent_hw: tuple[int, int]) -> float:
    """GFLOP of one UNet row at ``latent_hw`` from the manifest: the channels per level and the
    cross-attention layer list (one transformer each: its level from its name, its width). Counts
    the convolutions (two 3x3 per ResNet, layers_per_block of them down a level and one more up,
    whose first conv also reads the skip; the down- and upsamplers), each transformer's linears
    (proj in/out, q/k/v/out of self-attention, q/out of cross-attention, the GEGLU feed-forward:
    20 c^2 multiply-adds a token) and its self-attention matmuls (2 tokens^2 c). It is 91 to 97%
    of torch's FlopCounterMode on diffusers' own UNet (shapes 0.161 of 0.177, bench 4.05 of 4.28,
    SD 1.5 778 of 803 GFLOP: norms, time embedding and 1x1 skips are left out)."""
    h, w = latent_hw
    top = len(blocks) - 1
    by_level: dict[tuple[int, str], list[int]] = {}
    attentions: dict[int, set[str]] = {}  # a down level's attention modules: one per ResNet (SDXL's hold 2 or 10 transformers)
    for layer in layers:
        parts = layer["name"].split(".")
        if parts[0] == "down_blocks":
            key = (int(parts[1]), "down")
            attentions.setdefault(key[0], set()).add(".".join(parts[:4]))
        elif parts[0] == "up_blocks":
            key = (top - int(parts[1]), "up")
        else:
            key = (top, "mid")
        by_level.setdefault(key, []).append(int(layer["inner_dim"]))
    per_block = max([len(v) for v in attentions.values()] or [1])
    macs = 0.0
    for k, c in enumerate(blocks):
        tokens = -(-h // 2**k) * -(-w // 2**k)
        # ResNets: per_block down and per_block + 1 up, two 3x3 convs each, the up path's first reading 2c
        macs += tokens * 9 * c * c * (2 * per_block + 3 * (per_block + 1))
        for width in by_level.get((k, "down"), []) + by_level.get((k, "up"), []) + by_level.get((k, "mid"), []):
            macs += tokens * 20 * width * width + 2 * tokens * tokens * width
        if (k, "mid") in by_level:
            macs += tokens * 9 * c * c * 4  # the mid block's two ResNets
        if k < top:  # the stride-2 downsampler into level k + 1 and the upsampler's conv back at level k
            macs += tokens // 4 * 9 * c * c + tokens * 9 * blocks[k + 1] ** 2
    return 2 * macs / 1e9


def cpu_model(manifest: Any, latent_hw: tuple[int, int], lazy: Sequence[str] = ()) -> CpuModel:
    """:class:`CpuModel` of ``manifest``'s graphs at ``latent_hw``; graphs in ``lazy`` load on
    first use (an upload's encoder) and are not counted."""
    graphs = manifest.data["graphs"]
    external = inline = 0
    for name, g in graphs.items():
        if name in lazy:
            continue
        if g.get("external_data"):
            external += int(g.get("weight_bytes", 0))
        else:
            inline += int(g.get("weight_bytes", 0))
    plan = memory_plan(manifest, latent_hw, budget=0, held=0)
    blocks = manifest.data["model"].get("block_out_channels") or [int(layer["inner_dim"]) for layer in manifest.layers[:1]]
    return CpuModel(external, inline, plan.step_row, unet_gflop(blocks, manifest.layers, latent_hw),
                    int(graphs["unet_step"].get("weight_bytes", 0)))  # fmt: skip
