"""Stable Diffusion 1.x / 2.x: one CLIP text encoder, no conditioning besides the text.

Prompt embeddings are the text encoder's last hidden state; with ``clip_skip`` c the hidden
state c layers before the last, through the final layer norm (diffusers' rule). The text graph
returns the candidates for every c it supports, stacked, so the runtime picks per base.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .family import Components, guidance_conds, load_family

CLIP_SKIPS = 4  # clip_skip 0 (none), 1, 2, 3


def load_components(model_dir: Path, variant: Optional[str] = None) -> Components:
    from transformers import CLIPTextModel

    return load_family("sd", model_dir, variant, [(CLIPTextModel, "text_encoder", "tokenizer")])


class TextGraph(nn.Module):
    """``input_ids [B,77]`` -> ``hidden_states [B, CLIP_SKIPS, 77, D]`` (index c: clip_skip c)."""

    def __init__(self, components: Components):
        super().__init__()
        self.text_encoder = components.text_encoders[0]
        self.skips = min(CLIP_SKIPS, self.text_encoder.config.num_hidden_layers)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.text_encoder(input_ids, output_hidden_states=True).hidden_states
        # transformers 5 flattened CLIPTextModel (no .text_model); 4.x nests it
        norm = getattr(self.text_encoder, "text_model", self.text_encoder).final_layer_norm
        return torch.stack([norm(hidden[-(c + 1)]) for c in range(self.skips)], dim=1)


def text_inputs() -> list[str]:
    return ["input_ids"]


def text_outputs() -> list[str]:
    return ["hidden_states"]


def conds(components: Components) -> list[dict]:
    """Per-row conditioning besides K/V: none for SD 1.x / 2.x, but a full LCM's guidance embedding."""
    return guidance_conds(components.unet)


def description(components: Components) -> dict:
    return {"family": "sd", "tokenizers": ["tokenizer.json"], "clip_skips": min(CLIP_SKIPS, components.text_encoders[0].config.num_hidden_layers),
            "zero_empty_negative": False, "negative_clip_skip": False, "conds": conds(components),
            # StableDiffusionPipeline never upcasts its VAE (AutoencoderKL's config says
            # force_upcast by default, but only the SDXL pipelines read it)
            "vae_force_upcast": False}  # fmt: skip
