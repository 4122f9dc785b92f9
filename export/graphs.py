"""The four torch modules that become edit-rt's ONNX graphs.

- :class:`TextEncoderGraph`: ``input_ids -> hidden_states``.
- :class:`KVProjGraph`: ``hidden_states -> k_0, v_0, ...``: every cross-attention (``attn2``)
  layer's ``to_k``/``to_v`` projection, in :func:`cross_attention_layers` order.
- :class:`UNetStepGraph`: one whole denoising step: the UNet on ``[uncond; cond]`` rows with
  every cross-attention K/V an explicit input, classifier-free guidance, and the DDIM (eta 0)
  update. Every row has its own timestep, alphas and guidance, so rows at different steps of
  different edits share one call.
- :class:`VaeDecoderGraph`: ``latents -> images`` in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from torch import nn


@dataclass(frozen=True)
class CrossAttentionLayer:
    """One ``attn2`` module: its dotted name in the UNet, heads and K/V width."""

    name: str
    heads: int
    inner_dim: int


def cross_attention_layers(unet: nn.Module) -> list[tuple[CrossAttentionLayer, Attention]]:
    """Every cross-attention layer of ``unet``, in module order: the order of the K/V inputs."""
    layers = []
    for name, module in unet.named_modules():
        if isinstance(module, Attention) and name.endswith("attn2"):
            if module.spatial_norm is not None or module.norm_cross is not None:
                raise NotImplementedError(f"{name}: spatial_norm/norm_cross attention is not supported")
            layers.append((CrossAttentionLayer(name, module.heads, module.to_k.out_features), module))
    if not layers:
        raise ValueError("the UNet has no cross-attention (attn2) layers")
    return layers


class _KVSlots:
    """Where :class:`UNetStepGraph` puts this call's K/V for the processors to read."""

    def __init__(self, n: int):
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n


class PrecomputedKVProcessor:
    """A cross-attention processor that reads K/V from a slot instead of projecting the text.

    The attention itself is diffusers' ``AttnProcessor2_0`` for 3-D hidden states (what the
    transformer blocks of an SD UNet pass): q from the image tokens, softmax(q k^T / sqrt(d)) v,
    the output projection, dropout (a no-op at inference).
    """

    def __init__(self, slots: _KVSlots, index: int):
        self.slots = slots
        self.index = index

    def __call__(self, attn: Attention, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        key, value = self.slots.kv[self.index]
        residual = hidden_states
        batch = hidden_states.shape[0]
        query = attn.to_q(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        out = F.scaled_dot_product_attention(query, key, value)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim)
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


class TextEncoderGraph(nn.Module):
    def __init__(self, text_encoder: nn.Module):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(input_ids)[0]


class KVProjGraph(nn.Module):
    """``hidden_states [B,77,D]`` -> ``(k_0, v_0, k_1, v_1, ...)``; K/V are linear in the text."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.projections = nn.ModuleList()
        for _, module in cross_attention_layers(unet):
            self.projections.append(nn.ModuleList([module.to_k, module.to_v]))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = []
        for to_k, to_v in self.projections:
            out += [to_k(hidden_states), to_v(hidden_states)]
        return tuple(out)


class UNetStepGraph(nn.Module):
    """One DDIM step with classifier-free guidance, K/V explicit.

    Inputs (N rows): ``latents [N,c,h,w]``, ``timestep [N]``, ``alpha_t [N]``, ``alpha_prev [N]``,
    ``guidance [N]``, ``uncond_index [N]`` (int64 row of the uncond K/V set), then per layer
    ``cond_k_i, cond_v_i [N,77,C_i]`` and ``uncond_k_i, uncond_v_i [M,77,C_i]``.
    The M unconditional K/V sets are shared: a negative prompt's K/V are bound once and rows
    pick theirs by index, instead of every row carrying a copy.
    Output: ``next_latents [N,c,h,w]``.
    """

    def __init__(self, unet: nn.Module, prediction_type: str, clip_sample: float | None):
        super().__init__()
        if prediction_type not in ("epsilon", "v_prediction", "sample"):
            raise ValueError(f"prediction_type {prediction_type!r} is not supported")
        self.unet = unet
        self.prediction_type = prediction_type
        self.clip_sample = clip_sample
        layers = cross_attention_layers(unet)
        self.slots = _KVSlots(len(layers))
        for i, (_, module) in enumerate(layers):
            module.set_processor(PrecomputedKVProcessor(self.slots, i))
        self.num_layers = len(layers)
        self.cross_attention_dim = unet.config.cross_attention_dim

    def forward(self, latents, timestep, alpha_t, alpha_prev, guidance, uncond_index, *kv):
        n = latents.shape[0]
        # 1. the 2N UNet rows: [uncond; cond], each uncond row gathered from the shared set
        for i in range(self.num_layers):
            cond_k, cond_v, uncond_k, uncond_v = kv[4 * i : 4 * i + 4]
            self.slots.kv[i] = (
                torch.cat([uncond_k.index_select(0, uncond_index), cond_k]),
                torch.cat([uncond_v.index_select(0, uncond_index), cond_v]),
            )
        x2 = torch.cat([latents, latents])
        t2 = torch.cat([timestep, timestep])
        # The processors read the slots; encoder_hidden_states only has to exist.
        dummy_text = latents.new_zeros(2 * n, 1, self.cross_attention_dim)
        out = self.unet(x2, t2, encoder_hidden_states=dummy_text, return_dict=False)[0]
        # 2. classifier-free guidance (Ho & Salimans 2022, eq. 6), per-row scale
        out_uncond, out_cond = out.chunk(2)
        g = guidance.view(n, 1, 1, 1)
        out = out_uncond + g * (out_cond - out_uncond)
        # 3. DDIM eta=0 (Song et al. 2020, eq. 12): predicted x0 and eps, then the step
        a_t = alpha_t.view(n, 1, 1, 1)
        a_prev = alpha_prev.view(n, 1, 1, 1)
        b_t = 1 - a_t
        if self.prediction_type == "epsilon":
            x0 = (latents - b_t.sqrt() * out) / a_t.sqrt()
            eps = out
        elif self.prediction_type == "v_prediction":
            x0 = a_t.sqrt() * latents - b_t.sqrt() * out
            eps = a_t.sqrt() * out + b_t.sqrt() * latents
        else:
            x0 = out
            eps = (latents - a_t.sqrt() * x0) / b_t.sqrt()
        if self.clip_sample is not None:
            x0 = x0.clamp(-self.clip_sample, self.clip_sample)
        return a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps


class VaeDecoderGraph(nn.Module):
    """``latents [N,c,h,w]`` -> ``images [N,3,H,W]`` in [0, 1], as the pipeline post-processes."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.scaling_factor = float(vae.config.scaling_factor)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        image = self.vae.decode(latents / self.scaling_factor, return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1)
