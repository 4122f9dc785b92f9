"""A prompt-to-prompt baseline (Hertz et al. 2022) in PyTorch, run from an edit-rt base's tail.

For ``make quality``: the editor users compare against, written against diffusers' attention
processors. From the base's x_s (the same entry point and tail as an edit-rt edit) two branches
run together, the source (the base prompt: it retraces the base's own tail) and the target (the
edit prompt), each with classifier-free guidance, in one batch ``[uncond src, uncond tgt, cond
src, cond tgt]``. As in the paper's "replace" edit (and its "refine" edit where the prompts' token counts differ):

- cross-attention: for the first ``cross_replace`` fraction of the tail the target's
  probabilities are the source's, through the token alignment (its values are its own, which
  is how the new word enters);
- self-attention: likewise for the first ``self_replace`` fraction (the layout is kept);
- local blend: the changed words' cross-attention maps (both prompts', at the map layers),
  summed over the steps so far, max-pooled (3x3), normalised by their maximum and thresholded
  (0.3): outside, the target's latent is the source's after every step.

It costs two UNet rows per edit and step (the source branch is recomputed; edit-rt keeps it).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention

from edit_rt.runtime.model.align import token_diff

from ..compile.graphs import attention_map_layers, cross_attention_layers


class P2PState:
    """What the processors share during one edit: the step, the switches, the maps."""

    def __init__(self, changed: list[int], mapper: torch.Tensor, map_layers: set[str]):
        self.changed = changed
        # target text position -> the source position whose attention it takes (-1: its own)
        self.mapper = mapper
        self.map_layers = map_layers
        self.replace_cross = False
        self.replace_self = False
        self.maps: list[torch.Tensor] = []  # this step's [2, tokens] maps of the changed words


class P2PProcessor:
    """diffusers' AttnProcessor (explicit probabilities) with prompt-to-prompt's controls."""

    def __init__(self, state: P2PState, name: str, cross: bool):
        self.state, self.name, self.cross = state, name, cross

    def __call__(self, attn: Attention, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kw):
        residual = hidden_states
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query = attn.head_to_batch_dim(attn.to_q(hidden_states))
        key = attn.head_to_batch_dim(attn.to_k(context))
        value = attn.head_to_batch_dim(attn.to_v(context))
        probs = attn.get_attention_scores(query, key, attention_mask)  # [4 * heads, tokens, keys]
        heads = attn.heads
        probs = probs.view(4, heads, *probs.shape[1:])
        if self.cross and self.state.replace_cross:
            # the conditional target (row 3) attends as the conditional source (row 2), through
            # the token alignment; positions with no counterpart (inserted words) keep their own
            mapped = self.state.mapper >= 0
            target = probs[3].clone()
            target[..., mapped] = probs[2][..., self.state.mapper[mapped]]
            probs = torch.cat([probs[:3], target[None]])
        elif not self.cross and self.state.replace_self:
            probs = torch.cat([probs[:3], probs[2:3]])
        if self.cross and self.name in self.state.map_layers:
            # head mean of the conditional rows' attention to the changed words: [2, tokens]
            self.state.maps.append(probs[2:, :, :, self.state.changed].sum(-1).mean(1))
        out = torch.bmm(probs.reshape(4 * heads, *probs.shape[2:]), value)
        out = attn.to_out[1](attn.to_out[0](attn.batch_to_head_dim(out)))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def token_mapper(source: list[int], target: list[int]) -> torch.Tensor:
    """[77]: for each target position, the source position it aligns with, -1 for none.

    Equal runs align token by token; a replaced run of the same length maps position by
    position (P2P's word swap); an insertion, or a replacement of another length, maps to
    nothing (the target keeps its own attention there, as P2P's "refine" edit does).
    """
    from difflib import SequenceMatcher

    mapper = torch.full((len(target),), -1, dtype=torch.int64)
    for tag, a0, a1, b0, b1 in SequenceMatcher(a=source, b=target, autojunk=False).get_opcodes():
        if tag == "equal" or (tag == "replace" and a1 - a0 == b1 - b0):
            mapper[b0:b1] = torch.arange(a0, a1)
    return mapper


def p2p_tail(unet, text_encoder, tokenizer, scheduler_config: dict, state, edit_prompt: str, start_step: int,
             cross_replace: float = 0.8, self_replace: float = 0.4, threshold: float = 0.3) -> np.ndarray:
    """The target branch's final latent [c, h, w] for ``edit_prompt`` from ``state``'s x_s."""
    from diffusers import DDIMScheduler

    base = state.base
    negative = base.negative_prompt or ""  # the SD family: no negative prompt is the empty one
    prompts = [negative, negative, base.prompt, edit_prompt]
    ids = tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    diff = token_diff(ids[2].tolist(), ids[3].tolist(), special)
    map_layer_ids, factor = attention_map_layers(unet)
    layers = cross_attention_layers(unet)
    p2p = P2PState(list(diff.positions), token_mapper(ids[2].tolist(), ids[3].tolist()),
                   {layers[i][0].name for i in map_layer_ids})  # fmt: skip
    processors = {}
    for name in unet.attn_processors:
        module = name[: -len(".processor")]
        processors[name] = P2PProcessor(p2p, module, module.endswith("attn2"))
    original = dict(unet.attn_processors)
    unet.set_attn_processor(processors)
    # diffusers' own DDIM (eta 0): the baseline shares none of edit-rt's step code
    schedule = DDIMScheduler.from_config(scheduler_config)
    schedule.set_timesteps(base.steps)
    latents = torch.from_numpy(np.repeat(state.latent(start_step), 2, 0).copy())  # [src, tgt]
    tail = base.steps - start_step
    acc = None
    try:
        with torch.no_grad():
            text = text_encoder(ids)[0]
            for k, i in enumerate(range(start_step, base.steps)):
                p2p.replace_cross = k < cross_replace * tail
                p2p.replace_self = k < self_replace * tail
                p2p.maps = []
                step_t = schedule.timesteps[i]
                t = torch.full((4,), float(step_t))
                out = unet(torch.cat([latents, latents]), t, encoder_hidden_states=text).sample
                uncond, cond = out.chunk(2)
                guided = uncond + base.guidance * (cond - uncond)
                latents = schedule.step(guided, step_t, latents, eta=0.0).prev_sample
                # local blend (P2P's LocalBlend): maps of the changed words, both branches
                maps = torch.stack(p2p.maps).mean(0).sum(0)  # [tokens]
                hw = latents.shape[-1] // factor
                acc = maps if acc is None else acc + maps
                mask = F.max_pool2d(acc.view(1, 1, hw, hw), 3, stride=1, padding=1)
                mask = F.interpolate(mask, size=latents.shape[-2:])[0, 0]
                mask = (mask / mask.max()) > threshold
                latents[1] = torch.where(mask, latents[1], latents[0])
    finally:
        unet.set_attn_processor(original)
    return latents[1].numpy()
