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
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

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
                held: Optional[int] = None, loading: int = 0) -> MemoryPlan:  # fmt: skip
    """The plan for ``latent_hw`` latents of ``manifest``'s graphs. ``budget``: the bytes the
    process may use in all (``engines.max_memory_gb``; None: what the machine has free now plus
    what the process already holds); ``held``: the process's resident bytes now, read from
    /proc when None; ``loading``: weights not loaded yet that will be (a check made before the
    graphs load, so that a refusal comes before their seconds)."""
    graphs = manifest.data["graphs"]
    step = graphs["unet_step"]
    weights = sum(int(g.get("weight_bytes", 0)) for g in graphs.values())
    model = manifest.data["model"]
    blocks = model.get("block_out_channels")
    row = step_row_bytes(manifest.layers, latent_hw, int(step.get("slice_heads", 0)), blocks[0] if blocks else None)
    shallow = graphs.get("unet_step_shallow", {})  # DeepCache's deep features, resident for both UNet rows (slots.py)
    deep = [t["shape"][1] for t in shallow.get("inputs", []) if shallow.get("roles", {}).get(t["name"]) == "deep_in"]
    row += deep_feature_bytes(int(deep[0]) if deep else 0, latent_hw)
    decode = decode_row_bytes(latent_hw, manifest.vae_scale_factor, int(model.get("vae_channels", 128)))
    if budget is not None:  # the process's own share counts against a budget, not against what the machine has free
        free: Optional[int] = budget - (process_rss() if held is None else held) - loading
    else:
        have = available_host_bytes()
        free = None if have is None else have - loading
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
