"""SDXL: two text encoders, and the pooled text embedding and size ids as per-row conditioning.

As ``StableDiffusionXLPipeline`` forms them: both encoders' penultimate hidden states
(``clip_skip`` c: c more layers back), concatenated; the pooled embedding of the second
(``CLIPTextModelWithProjection``), which the UNet's ``add_embedding`` takes with the
``time_ids`` (original size, crop corner, target size). An empty negative prompt is zeros
(``force_zeros_for_empty_prompt``). An edit mixes the pooled embedding with its strength, as it
mixes K/V; the size ids are the base's. The VAE of SDXL 1.0 overflows in fp16
(``force_upcast``): its engines stay fp32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .family import Components, guidance_conds, load_family

CLIP_SKIPS = 3  # clip_skip 0 (the penultimate layer), 1, 2


def load_components(model_dir: Path, variant: Optional[str] = None) -> Components:
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    return load_family("sdxl", model_dir, variant, [(CLIPTextModel, "text_encoder", "tokenizer"),
                                                   (CLIPTextModelWithProjection, "text_encoder_2", "tokenizer_2")])  # fmt: skip


class TextGraph(nn.Module):
    """``input_ids, input_ids_2 [B,77]`` -> ``hidden_states [B, CLIP_SKIPS, 77, D1+D2]``,
    ``pooled [B, P]``."""

    def __init__(self, components: Components):
        super().__init__()
        self.encoder_1, self.encoder_2 = components.text_encoders
        layers = min(self.encoder_1.config.num_hidden_layers, self.encoder_2.config.num_hidden_layers)
        self.skips = min(CLIP_SKIPS, layers - 1)

    def forward(self, input_ids: torch.Tensor, input_ids_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out_1 = self.encoder_1(input_ids, output_hidden_states=True)
        out_2 = self.encoder_2(input_ids_2, output_hidden_states=True)
        hidden = [torch.cat([out_1.hidden_states[-(c + 2)], out_2.hidden_states[-(c + 2)]], dim=-1) for c in range(self.skips)]
        return torch.stack(hidden, dim=1), out_2.text_embeds


def text_inputs() -> list[str]:
    return ["input_ids", "input_ids_2"]


def text_outputs() -> list[str]:
    return ["hidden_states", "pooled"]


def conds(components: Components) -> list[dict]:
    """``text_embeds``: the pooled embedding, mixed by strength, its uncond a negative prompt's
    set; ``time_ids``: six numbers per row, the same for both halves."""
    pooled = components.text_encoders[1].config.projection_dim
    return [{"name": "text_embeds", "dim": pooled, "source": "pooled", "mix": True, "uncond": "set"},
            {"name": "time_ids", "dim": 6, "source": "time_ids", "mix": False, "uncond": "row"},
            *guidance_conds(components.unet)]  # fmt: skip


def description(components: Components) -> dict:
    layers = min(e.config.num_hidden_layers for e in components.text_encoders)
    return {"family": "sdxl", "tokenizers": ["tokenizer.json", "tokenizer_2.json"], "clip_skips": min(CLIP_SKIPS, layers - 1),
            "zero_empty_negative": bool(components.index.get("force_zeros_for_empty_prompt", True)),
            "negative_clip_skip": False, "conds": conds(components),
            "vae_force_upcast": bool(components.vae.config.get("force_upcast", True))}  # fmt: skip
