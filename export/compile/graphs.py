"""The torch modules that become edit-rt's ONNX graphs (the text encoder's is the family's:
``export/family_*.py``).

- :class:`KVProjGraph`: ``hidden_states -> k_0, v_0, ...``: every cross-attention (``attn2``)
  layer's ``to_k``/``to_v`` projection, in :func:`cross_attention_layers` order, already in
  the layout the step's attention reads (so a step never reshuffles K/V).
- :class:`UNetStepGraph`: one whole denoising step: the UNet on ``[uncond; cond]`` rows with
  every cross-attention K/V an explicit input, classifier-free guidance, and the sampler's
  update, linear with per-row coefficients (runtime/model/samplers.py). Every row has its own
  timestep, coefficients, solver history and guidance, so rows of different samplers, steps and
  edits share one call.
- :class:`UNetShallowStepGraph`: the same step with the UNet's deep blocks skipped, their
  output taken from an input (DeepCache, Ma et al. 2023): ``unet_step`` also returns the
  features entering the UNet's last up block (``deep_out``), and a shallow step runs only the
  outer blocks around them (conv_in, the first down block, the last up block, conv_out).
- :class:`LatentBlendGraph`: after each step, on the device, the rows' next latents with their
  base's latents where a mask keeps the base, plus an inverted base's correction, and the
  solver history carried to the next step: the loop's latents never leave the device between
  steps.
- :class:`VaeDecoderGraph`: ``latents -> images`` in [0, 1].
- :class:`VaeEncoderGraph`: ``images -> latents`` (an uploaded image's, to invert it).
- ``taesd_decoder`` is :class:`VaeDecoderGraph` around diffusers' ``AutoencoderTiny`` (same
  ``decode`` call, same latents in, same [0, 1] out); :class:`TinyVaeEncoderGraph` its encoder.
"""

from __future__ import annotations

from contextlib import contextmanager
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
            if module.spatial_norm is not None or module.norm_cross is not None or module.norm_q is not None or module.norm_k is not None:
                raise NotImplementedError(f"{name}: spatial_norm/norm_cross/qk-norm attention is not supported")
            layers.append((CrossAttentionLayer(name, module.heads, module.to_k.out_features), module))
    if not layers:
        raise ValueError("the UNet has no cross-attention (attn2) layers")
    return layers


class _StepContext:
    """What :class:`UNetStepGraph` hands its cross-attention processors for one call."""

    def __init__(self, n: int):
        self.kv: list[tuple[torch.Tensor, ...] | None] = [None] * n
        self.uncond_rows = 0
        self.set_bias: torch.Tensor | None = None
        self.want_maps = False
        self.maps: list[torch.Tensor] = []  # per map layer: [N, 77, image tokens]
        # structure keeping: per UNet row, the row whose self-attention queries and keys it uses
        self.self_index: torch.Tensor | None = None
        self.deep: torch.Tensor | None = None  # the features entering the skip branch's up block


# Added to the scores of another set's tokens: exp() of it underflows to exactly 0 in fp32
# (and it is representable in fp16), so a row attends to its own negative prompt only.
_OTHER_SET = -1.0e4


class PrecomputedKVProcessor:
    """A cross-attention processor that reads cached K/V instead of projecting the text.

    The call's rows are ``[uncond rows; cond rows]``. Each half attends over its own K/V, bound
    in the layout the attention reads, so no K/V block is gathered, concatenated or transposed
    per step:

    - cond: ``k [N, heads, head_dim, 77]`` (K transposed per head), ``v [N, heads, 77, head_dim]``;
    - uncond: the negative prompts' sets side by side on the token axis, ``k [heads, head_dim,
      S]``, ``v [heads, S, head_dim]`` with S = 77 x sets; every uncond row scores all S tokens
      and a bias masks the other sets' (each set is read once per layer, for every row).

    Otherwise it is diffusers' attention for 3-D hidden states: q from the image tokens,
    softmax(q k^T * scale) v, the output projection, dropout (a no-op at inference).
    """

    def __init__(self, context: _StepContext, index: int, map_layer: bool = False):
        self.context = context
        self.index = index
        self.map_layer = map_layer

    def __call__(self, attn: Attention, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        cond_k, cond_v, uncond_k, uncond_v = self.context.kv[self.index]
        residual = hidden_states
        rows, tokens, _ = hidden_states.shape
        heads = attn.heads
        head_dim = cond_v.shape[-1]
        sets_tokens = uncond_k.shape[-1]
        query = attn.to_q(hidden_states) * attn.scale
        nu = self.context.uncond_rows
        # 1. unconditional rows: scores over every set, other sets masked out. Heads are the
        # batch of one matmul over all those rows' tokens, [heads, nu x tokens, d] x [heads, d, S]:
        # the sets' K/V are read where they are bound, and nothing broadcasts (ONNX Runtime's
        # MatMul refuses to broadcast over a batch of 0 rows, which a call whose every row is
        # given its unconditional prediction has: E = N). Each reshape's 0 (nu = 0) stands where
        # its input's 0-sized axis does, so ONNX's "0 copies that axis" gives the same shape. A
        # reshape, not a transpose, feeds the matmul: ONNX Runtime fuses a Transpose into the
        # MatMul after it (FusedMatMul), which divides by zero on an empty batch (SIGFPE).
        query_u = query[:nu].view(nu, tokens, heads, head_dim).permute(2, 0, 1, 3).reshape(heads, nu * tokens, head_dim)
        scores_u = torch.matmul(query_u, uncond_k).view(heads, nu, tokens, sets_tokens) + self.context.set_bias
        probs_u = scores_u.softmax(dim=-1).view(heads, nu * tokens, sets_tokens)
        out_u = torch.matmul(probs_u, uncond_v).transpose(0, 1).reshape(nu, tokens, heads * head_dim)
        # 2. conditional rows: each over its own row's K/V
        query_c = query[nu:].view(rows - nu, tokens, heads, head_dim).transpose(1, 2)
        probs_c = torch.matmul(query_c, cond_k).softmax(dim=-1)
        out_c = torch.matmul(probs_c, cond_v).transpose(1, 2).reshape(rows - nu, tokens, heads * head_dim)
        if self.map_layer and self.context.want_maps:
            # 3. the attention each image token pays to each text position, head mean: [N, 77, tokens]
            self.context.maps.append(probs_c.mean(dim=1).transpose(1, 2))
        out = torch.cat([out_u, out_c])
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


class SharedLayoutProcessor:
    """A self-attention (``attn1``) processor that can take a row's attention *pattern* from
    another row: row r attends with the queries and keys of row ``self_index[r]`` and its own
    values, ``softmax(q_ref k_ref^T / sqrt(d)) v_r`` (plug-and-play's self-attention injection,
    Tumanyan et al. 2023): the reference's layout, the row's own content. With every row its
    own reference it is diffusers' attention (``AttnProcessor2_0`` for 3-D hidden states)."""

    def __init__(self, context: _StepContext, slice_heads: int = 0):
        """``slice_heads`` > 0: attention over that many heads at a time (diffusers' attention
        slicing, ``SlicedAttnProcessor``, over the head axis): the scores of a 64x64 latent are
        heads x 4096^2 floats per UNet row (512 MiB for SD 1.5's 8 heads), and an ONNX runtime
        holds every one of a call's rows at once; one head a time holds 1/8 of it. The slices
        are static (the head count is), so the graph keeps its dynamic rows and size."""
        self.context = context
        self.slice_heads = slice_heads

    def __call__(self, attn: Attention, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        residual = hidden_states
        rows, tokens, _ = hidden_states.shape
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        index = self.context.self_index
        if index is not None:
            query, key = query.index_select(0, index), key.index_select(0, index)
        head_dim = value.shape[-1] // attn.heads
        q, k, v = (t.view(rows, tokens, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        if 0 < self.slice_heads < attn.heads:
            s = self.slice_heads
            out = torch.cat([F.scaled_dot_product_attention(q[:, h : h + s], k[:, h : h + s], v[:, h : h + s], scale=attn.scale)
                             for h in range(0, attn.heads, s)], dim=1)  # fmt: skip
        else:
            out = F.scaled_dot_product_attention(q, k, v, scale=attn.scale)
        out = out.transpose(1, 2).reshape(rows, tokens, attn.heads * head_dim)
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def self_attention_layers(unet: nn.Module) -> list[Attention]:
    """Every self-attention (``attn1``) of the UNet's transformer blocks."""
    return [m for name, m in unet.named_modules() if isinstance(m, Attention) and name.endswith("attn1")]


def kv_layout(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, 77, C]`` projections -> the step graph's layout: K ``[B, heads, head_dim, 77]``,
    V ``[B, heads, 77, head_dim]``."""
    b, t, c = k.shape
    k = k.view(b, t, heads, c // heads).permute(0, 2, 3, 1)
    v = v.view(b, t, heads, c // heads).transpose(1, 2)
    return k.contiguous(), v.contiguous()


class KVProjGraph(nn.Module):
    """``hidden_states [B,77,D]`` -> ``(k_0, v_0, k_1, v_1, ...)`` in the step graph's layout
    (:func:`kv_layout`); K/V are linear in the text, so an edit mixes them per element."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.projections = nn.ModuleList()
        self.heads = []
        for _, module in cross_attention_layers(unet):
            self.projections.append(nn.ModuleList([module.to_k, module.to_v]))
            self.heads.append(module.heads)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = []
        for (to_k, to_v), heads in zip(self.projections, self.heads):
            out += kv_layout(to_k(hidden_states), to_v(hidden_states), heads)
        return tuple(out)


# The skip branch a shallow step keeps (DeepCache's SD setting, ``cache_layer_id`` 0): the outer
# blocks run, the deep features entering the last up block are a step's own from its last full
# step. A deeper branch keeps more blocks and saves less.
DEEP_BRANCH = 0


class _DeepSkipped(nn.Module):
    """Stands in for the UNet's deep blocks in a shallow step: as the down blocks it passes the
    sample on with one placeholder skip connection, as the up blocks it takes that placeholder
    back (``resnets``: how many diffusers' loop hands it) and returns the cached features."""

    def __init__(self, feature: torch.Tensor, up: bool):
        super().__init__()
        self.feature = feature
        self.up = up
        self.resnets = [None]

    def forward(self, hidden_states, temb=None, **kwargs):
        if self.up:
            return self.feature
        return hidden_states, (hidden_states,)


def deep_feature_block(unet: nn.Module, branch: int = DEEP_BRANCH) -> nn.Module:
    """The up block whose output a full step returns as ``deep_out``: the features entering
    up block ``len - 1 - branch``."""
    blocks = len(unet.up_blocks)
    if not 0 <= branch < blocks - 1:
        raise ValueError(f"deep branch {branch}: a UNet of {blocks} up blocks has branches 0..{blocks - 2}")
    return unet.up_blocks[blocks - 2 - branch]


@contextmanager
def shallow_unet(unet: nn.Module, feature: torch.Tensor, branch: int = DEEP_BRANCH):
    """``unet`` with its deep blocks skipped while the block is open: down blocks ``0..branch``
    (the last without its downsampler, whose output only deeper blocks read), no mid block, the
    up blocks from ``len - 1 - branch`` fed ``feature``. diffusers' own forward runs around
    them (time and added embeddings, the skip connections, conv_out)."""
    down, mid, up = unet.down_blocks, unet.mid_block, unet.up_blocks
    keep = down[branch]
    downsamplers = getattr(keep, "downsamplers", None)
    try:
        if downsamplers is not None:
            keep.downsamplers = None
        unet.down_blocks = nn.ModuleList([*down[: branch + 1], _DeepSkipped(feature, up=False)])
        unet.mid_block = None
        unet.up_blocks = nn.ModuleList([_DeepSkipped(feature, up=True), *up[len(up) - 1 - branch :]])
        yield unet
    finally:
        unet.down_blocks, unet.mid_block, unet.up_blocks = down, mid, up
        if downsamplers is not None:
            keep.downsamplers = downsamplers


class UNetStepGraph(nn.Module):
    """One sampler step with classifier-free guidance, K/V explicit.

    Inputs (N rows): ``latents [N,c,h,w]``, ``timestep [N]`` (float: Karras sigmas fall
    between training timesteps), ``alpha_t [N]`` (the latent's alpha-bar), ``coefs [N,7]`` (the
    row's update, columns ``step_coefs.COEFS``), ``guidance [N]``, ``uncond_index [N]`` (int64:
    the row's negative-prompt set), ``uncond_given [E,c,h,w]``, ``uncond_slope [E]`` (below),
    ``self_ref [N]`` (below),
    ``history [N,2,c,h,w]`` (the x_0 predicted one and two steps before), ``noise [N,c,h,w]``
    (an ancestral sampler's fresh noise; zeros or anything finite for the others), the family's
    conds, then per layer ``cond_k_i [N,heads,d,77]``, ``cond_v_i [N,heads,77,d]``,
    ``uncond_k_i [heads,d,S]``, ``uncond_v_i [heads,S,d]`` (S = 77 x sets).

    The update (every sampler edit-rt runs is linear in these; the host computes the
    coefficients per row and step, one file per algorithm): from the guided prediction, x_0
    (clamped to the row's ``clip``) and eps, then ``next = c_x x + c_x0 x_0 + c_eps eps + c_h0
    h_0 + c_h1 h_1 + c_noise noise``; ``history_out`` is ``(x_0, h_0)``. DDIM is ``c_x0 =
    sqrt(a_prev)``, ``c_eps = sqrt(1 - a_prev)``, the rest 0: Song et al. 2020, eq. 12, the
    same numbers as the fused DDIM update before it.

    ``uncond_given`` holds the unconditional prediction of the *last* E rows, known already (a
    row at its entry step re-enters the base's chain at a latent whose unconditional prediction
    the base computed; an unguided row, given zeros): the UNet runs N - E unconditional rows and
    N conditional ones, 0 <= E <= N (E = N: no unconditional row at all, manifest
    ``step_all_given``). A row
    whose tail takes the base's prediction at every step (``tail.uncond: base-corrected``)
    re-enters at a latent x_e near the base's x_b, and takes ``u_b + k (x_e - x_b)``: the host
    gives ``uncond_given = u_b - k x_b`` and ``uncond_slope = k`` and the graph adds ``k x_e``
    (0: the prediction as given; runtime/loop/uncond_reuse.py derives k).
    Outputs: ``next_latents [N,c,h,w]``, ``uncond_out [N,c,h,w]`` (each row's unconditional
    prediction, which a base generation keeps for its edits' entry steps), ``history_out
    [N,2,c,h,w]`` and ``deep_out [U,C,h',w']``: the features entering the UNet's skip branch
    (:func:`deep_feature_block`) for each UNet row, ``[uncond rows; cond rows]`` (U = 2N - E,
    N to 2N), which :class:`UNetShallowStepGraph` takes at a row's next steps.

    With ``map_layers`` (edit-rt's export always gives them: one step graph, manifest v9) it
    also returns ``attn_maps [N, 77, h/f, w/f]``: per row and text position, the conditional
    cross-attention the image tokens pay to it, averaged over heads and over the layers at 1/f
    of the latent resolution (``preserve: auto`` reads them; other steps leave them unread).

    ``self_ref [N]`` (int64, after ``uncond_given``) is the row whose self-attention pattern
    each row uses (itself, or a reference row carrying its base's own tail: structure keeping,
    ``SharedLayoutProcessor``), for both halves of CFG (an uncond half whose reference computes
    none uses its own).
    """

    def __init__(self, unet: nn.Module, prediction_type: str, text_len: int = 77,
                 map_layers: frozenset[int] | None = None, map_factor: int = 1, conds: list[dict] | None = None,
                 slice_heads: int = 0):  # fmt: skip
        """``slice_heads``: self-attention over that many heads at a time (0: all at once;
        :class:`SharedLayoutProcessor`). ``conds``: the family's per-row conditioning besides K/V (family_*.conds): each is an
        input ``cond_<name> [N, dim]`` and ``uncond_<name> [M, dim]`` (the negative prompts' sets,
        indexed by uncond_index) when its uncond side is a set, else one ``<name> [N, dim]``."""
        super().__init__()
        self.conds = list(conds or [])
        if prediction_type not in ("epsilon", "v_prediction", "sample"):
            raise ValueError(f"prediction_type {prediction_type!r} is not supported")
        self.unet = unet
        self.prediction_type = prediction_type
        self.text_len = text_len
        self.map_layers = map_layers
        self.map_factor = map_factor
        layers = cross_attention_layers(unet)
        self.context = _StepContext(len(layers))
        for i, (_, module) in enumerate(layers):
            module.set_processor(PrecomputedKVProcessor(self.context, i, map_layers is not None and i in map_layers))
        for module in self_attention_layers(unet):  # in both variants: the same numbers for the same rows
            module.set_processor(SharedLayoutProcessor(self.context, slice_heads))
        self.num_layers = len(layers)
        self.cross_attention_dim = unet.config.cross_attention_dim
        self.deep_branch = DEEP_BRANCH
        context = self.context
        deep_feature_block(unet, self.deep_branch).register_forward_hook(lambda m, i, out: setattr(context, "deep", out))

    def forward(self, latents, timestep, alpha_t, coefs, guidance, uncond_index, uncond_given, uncond_slope, *rest):
        outputs = self.step(latents, timestep, alpha_t, coefs, guidance, uncond_index, uncond_given, uncond_slope, rest,
                            maps=self.map_layers is not None)  # fmt: skip
        return (*outputs, self.context.deep)

    def step(self, latents, timestep, alpha_t, coefs, guidance, uncond_index, uncond_given, uncond_slope, rest, maps: bool):
        """The step's outputs but ``deep_out`` (``maps``: with ``attn_maps``)."""
        self.context.maps = []
        self.context.want_maps = maps
        n = latents.shape[0]
        nu = n - uncond_given.shape[0]
        # rows [uncond 0..nu-1; cond 0..n-1], each with its reference's self-attention pattern
        self_ref, history, noise, rest = rest[0], rest[1], rest[2], rest[3:]
        ref_u = self_ref[:nu]
        ref_u = torch.where(ref_u < nu, ref_u, torch.arange(nu, device=latents.device))
        self.context.self_index = torch.cat([ref_u, self_ref + nu])
        added, k, timestep_cond = {}, 0, None
        for cond in self.conds:  # the UNet's added conditioning, rows [uncond; cond]
            if cond["uncond"] == "set":
                cond_value, sets = rest[k], rest[k + 1]
                added[cond["name"]] = torch.cat([sets.index_select(0, uncond_index[:nu]), cond_value])
                k += 2
            elif cond.get("source") == "guidance":  # a full LCM's guidance embedding (family.guidance_conds)
                timestep_cond = torch.cat([rest[k][:nu], rest[k]])
                k += 1
            else:
                added[cond["name"]] = torch.cat([rest[k][:nu], rest[k]])
                k += 1
        kv = rest[k:]
        # 1. the UNet's rows: [uncond rows 0..nu-1; cond rows 0..n-1]
        for i in range(self.num_layers):
            self.context.kv[i] = kv[4 * i : 4 * i + 4]
        sets_tokens = kv[2].shape[-1]
        token_set = torch.arange(sets_tokens, device=latents.device) // self.text_len
        other = (token_set[None, :] != uncond_index[:nu, None]).to(latents.dtype)
        # [nu, 1, S] against the scores' [heads, nu, tokens, S]; unsqueeze, not a view to (nu, 1,
        # S): ONNX's Reshape reads a 0 in its target as "copy that axis", which nu = 0 would be
        self.context.set_bias = (other * _OTHER_SET).unsqueeze(1)
        self.context.uncond_rows = nu
        x = torch.cat([latents[:nu], latents])
        t = torch.cat([timestep[:nu], timestep])
        # The processors read the context; encoder_hidden_states only has to exist.
        dummy_text = latents.new_zeros(x.shape[0], 1, self.cross_attention_dim)
        out = self.unet(x, t, encoder_hidden_states=dummy_text, timestep_cond=timestep_cond,
                        added_cond_kwargs=added or None, return_dict=False)[0]
        out_uncond = torch.cat([out[:nu], uncond_given + uncond_slope.view(-1, 1, 1, 1) * latents[nu:]])
        out_cond = out[nu:]
        # 2. classifier-free guidance (Ho & Salimans 2022, eq. 6), per-row scale
        g = guidance.view(n, 1, 1, 1)
        pred = out_uncond + g * (out_cond - out_uncond)
        # 3. the prediction as x_0 and eps at the row's alpha-bar (Salimans & Ho 2022 for v)
        a_t = alpha_t.view(n, 1, 1, 1)
        b_t = 1 - a_t
        if self.prediction_type == "epsilon":
            x0 = (latents - b_t.sqrt() * pred) / a_t.sqrt()
            eps = pred
        elif self.prediction_type == "v_prediction":
            x0 = a_t.sqrt() * latents - b_t.sqrt() * pred
            eps = a_t.sqrt() * pred + b_t.sqrt() * latents
        else:
            x0 = pred
        c = [coefs[:, k].view(n, 1, 1, 1) for k in range(coefs.shape[1])]
        c_x, c_x0, c_eps, c_h0, c_h1, c_noise, clip = c
        x0 = torch.minimum(torch.maximum(x0, -clip), clip)  # DDIM's clip_sample; +inf: none
        if self.prediction_type == "sample":
            eps = (latents - a_t.sqrt() * x0) / b_t.sqrt()
        # 4. the sampler's linear update (runtime/model/samplers.py), then the history shifted
        h0, h1 = history[:, 0], history[:, 1]
        next_latents = c_x * latents + c_x0 * x0 + c_eps * eps + c_h0 * h0 + c_h1 * h1 + c_noise * noise
        history_out = torch.stack([x0, h0], dim=1)
        if not maps:
            return next_latents, out_uncond, history_out
        maps = torch.stack(self.context.maps).mean(dim=0)
        f = self.map_factor
        return next_latents, out_uncond, history_out, maps.reshape(n, self.text_len, latents.shape[2] // f, latents.shape[3] // f)


class UNetShallowStepGraph(nn.Module):
    """A DeepCache step (Ma et al. 2023): :class:`UNetStepGraph`'s step with the UNet's deep
    blocks skipped (:func:`shallow_unet`), the features they would give read from
    ``deep_features [U,C,h',w']`` (the ``deep_out`` of the rows' last full step, the same rows
    in the same order) after ``noise``; the other inputs and the first three outputs are
    ``unet_step``'s. Cross-attention layers inside the skipped blocks are not run, so their K/V
    (and adapter matrices) are not inputs; no ``attn_maps`` (rows collecting maps run full)."""

    def __init__(self, step: UNetStepGraph):
        super().__init__()
        self.full = step

    def forward(self, latents, timestep, alpha_t, coefs, guidance, uncond_index, uncond_given, uncond_slope,
                self_ref, history, noise, deep_features, *rest):  # fmt: skip
        with shallow_unet(self.full.unet, deep_features, self.full.deep_branch):
            return self.full.step(latents, timestep, alpha_t, coefs, guidance, uncond_index, uncond_given, uncond_slope,
                                  (self_ref, history, noise, *rest), maps=False)  # fmt: skip


def layer_factor(name: str, levels: int) -> int:
    """How much smaller than the latent an ``attn2`` layer's image grid is, from its place in a
    ``UNet2DConditionModel`` (each down block but the last halves the grid; up blocks undo it)."""
    block, index = name.split(".")[0], name.split(".")[1]
    if block == "mid_block":
        return 2 ** (levels - 1)
    if block == "down_blocks":
        return 2 ** int(index)
    return 2 ** (levels - 1 - int(index))


def attention_map_layers(unet: nn.Module) -> tuple[frozenset[int], int]:
    """The cross-attention layers whose maps edit-rt reads, and their factor f.

    Prompt-to-prompt reads SD's maps at 16x16 for 64x64 latents: the coarsest grid that still
    resolves an object. Here: every layer at the smallest factor whose grid, at the UNet's
    ``sample_size``, is at most 16 on a side (SD 1.x: f = 4, 16x16; the 64x64 shapes model's
    16x16 latents: f = 1); a UNet with no such layer (SD 2.x at 96, SDXL at 128) takes the
    largest factor <= 4 it has.
    """
    levels = len(unet.config.block_out_channels)
    factors = [layer_factor(layer.name, levels) for layer, _ in cross_attention_layers(unet)]
    size = unet.config.sample_size
    size = max(size) if isinstance(size, (tuple, list)) else int(size)
    within = [x for x in factors if size / x <= 16]
    if within:
        f = min(within)
    else:
        f = max(x for x in factors if x <= 4) if any(x <= 4 for x in factors) else min(factors)
    return frozenset(i for i, x in enumerate(factors) if x == f), f


class VaeDecoderGraph(nn.Module):
    """``latents [N,c,h,w]`` -> ``images [N,3,H,W]`` in [0, 1], as the pipeline post-processes:
    ``decode(latents / scaling_factor)``, as diffusers' pipelines call any ``vae``. An
    ``AutoencoderTiny`` (``taesd_decoder``) has ``scaling_factor`` 1.0 (TAESD decodes the latents
    the UNet produces as they are) and returns [-1, 1] like the VAE, so the same graph serves it."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.scaling_factor = float(vae.config.scaling_factor)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        image = self.vae.decode(latents / self.scaling_factor, return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1)


class VaeEncoderGraph(nn.Module):
    """``images [N,3,H,W]`` in [0, 1] -> ``latents [N,c,h,w]``: the posterior's mean, scaled, as
    diffusers' img2img takes it (``mode()``, no sampling: the same image gives the same latent)."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.scaling_factor = float(vae.config.scaling_factor)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        posterior = self.vae.encode(images * 2 - 1, return_dict=False)[0]
        return posterior.mode() * self.scaling_factor


class TinyVaeEncoderGraph(nn.Module):
    """``images [N,3,H,W]`` in [0, 1] -> ``latents [N,c,h,w]`` through ``AutoencoderTiny``: its
    encoder gives the latent itself (no posterior), scaled by its ``scaling_factor`` (1.0: TAESD
    works on the latents the UNet sees), as diffusers' img2img's ``retrieve_latents`` takes it."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.scaling_factor = float(vae.config.scaling_factor)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.vae.encode(images * 2 - 1, return_dict=False)[0] * self.scaling_factor


class LatentBlendGraph(nn.Module):
    """``latents = where(keep, base, next_latents + add)`` per row and latent pixel, and
    ``history = history_out``: the step's solver history carried to its next input (a copy on
    the device, bound like the latents).

    ``keep`` [N, 1, h, w] is 1 where a masked (or ``preserve: auto``) row keeps its base's latent
    ``base`` of the same step, 0 elsewhere and for every unmasked row; ``add`` is an inverted
    base's per-step correction (Direct Inversion), zeros for every other row. A select, not a
    mix: an unused ``base`` row may hold anything, and it never reaches the result.
    """

    def forward(self, next_latents, keep, base, add, history_out):
        return torch.where(keep > 0.5, base, next_latents + add), history_out + 0.0
