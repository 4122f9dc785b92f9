"""The two text models of issue 56 (trained by export/world/train_text.py, exported by text_export.py), one transformer of one size: a masked-diffusion model
(bidirectional attention, LLaDA's recipe) and an autoregressive one (causal attention), the
baseline.

Both are a pre-LayerNorm transformer: token and learned absolute position embeddings, ``layers``
blocks of multi-head self-attention and a GELU MLP (4x), a final LayerNorm, the output tied to
the token embedding. The only difference is the attention mask: ``causal`` lets a token see
only the positions at or before its own.

Cached K/V are explicit inputs. :meth:`TextTransformer.forward` takes the queried tokens, their
absolute positions and optionally ``past_kv`` (``[layers, 2, Np, heads, P, head_dim]``: the K/V of
P other tokens of the same text, ``Np`` 1 or the batch: one cache shared by every row, as N
continuations of one prefix share it) and returns the logits of the queried tokens and their own
K/V (``[layers, 2, N, heads, Lq, head_dim]``). A position embedding is added at the input, so a
cached token's K/V already say where it stands: the cache holds any tokens, before or after the
queried ones (a prefix, or a prefix and a suffix around a span). The attention over cache and
queries is one softmax over both score blocks, written apart so a cache of one row broadcasts
over N rows without being copied. Under ``causal`` a cached token is always earlier than every
queried one (the autoregressive loop caches only the past).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class TextSpec:
    vocab_size: int = 4096
    d_model: int = 192
    layers: int = 4
    heads: int = 4
    max_len: int = 256
    causal: bool = False  # False: the masked-diffusion model; True: the autoregressive baseline
    mask_id: int = 1  # text_corpus.MASK
    eos_id: int = 2  # text_corpus.EOS
    # rotary position embeddings on queries and keys (LLaDA's, as LLaMA's), besides the learned
    # absolute ones: attention then sees relative offsets directly (train_text.py says why)
    rope: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def as_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, spec: TextSpec):
        super().__init__()
        self.heads, self.head_dim, self.rope = spec.heads, spec.head_dim, spec.rope
        self.ln1 = nn.LayerNorm(spec.d_model)
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.d_model)
        self.ln2 = nn.LayerNorm(spec.d_model)
        self.mlp = nn.Sequential(nn.Linear(spec.d_model, 4 * spec.d_model), nn.GELU(), nn.Linear(4 * spec.d_model, spec.d_model))

    def forward(self, x: torch.Tensor, self_bias: Optional[torch.Tensor], past: Optional[torch.Tensor],
                rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None):  # fmt: skip
        n, lq, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, lq, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if rotary is not None:  # keys are cached rotated: a cached token's K holds its own position
            q, k = _rotated(q, *rotary), _rotated(k, *rotary)
        scale = 1.0 / math.sqrt(self.head_dim)
        scores = (q @ k.transpose(-1, -2)) * scale  # [N, H, Lq, Lq]
        if self_bias is not None:
            scores = scores + self_bias
        if past is None:
            attended = scores.softmax(-1) @ v
        else:  # past: [2, Np, H, P, hd]; one softmax over [cache | queries]
            p = past.shape[3]
            cached = (q @ past[0].transpose(-1, -2)) * scale  # [N, H, Lq, P]
            weights = torch.cat([cached, scores], dim=-1).softmax(-1)
            attended = weights[..., :p] @ past[1] + weights[..., p:] @ v
        x = x + self.proj(attended.transpose(1, 2).reshape(n, lq, d))
        x = x + self.mlp(self.ln2(x))
        return x, torch.stack([k, v])


class TextTransformer(nn.Module):
    def __init__(self, spec: TextSpec):
        super().__init__()
        self.spec = spec
        self.tok = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos = nn.Embedding(spec.max_len, spec.d_model)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.ln = nn.LayerNorm(spec.d_model)
        self.apply(_init)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, past_kv: Optional[torch.Tensor] = None):
        """Logits ``[N, Lq, vocab]`` of ``input_ids`` ``[N, Lq]`` at ``positions`` ``[Lq]``, and their
        K/V ``[layers, 2, N, heads, Lq, head_dim]``."""
        x = self.tok(input_ids) + self.pos(positions)[None]
        bias = None
        if self.spec.causal:  # a query sees the queried tokens at or before its position
            later = positions[None, :] > positions[:, None]
            bias = torch.zeros(later.shape, dtype=x.dtype).masked_fill(later, float("-inf"))
        rotary = _rotary(positions, self.spec.head_dim) if self.spec.rope else None
        kvs = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, bias, None if past_kv is None else past_kv[i], rotary)
            kvs.append(kv)
        logits = self.ln(x) @ self.tok.weight.T
        return logits, torch.stack(kvs)


def _rotary(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin at ``positions``: [Lq, head_dim / 2] each (the half-split layout, LLaMA's)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def masked_diffusion_loss(model: TextTransformer, ids: torch.Tensor, generator: torch.Generator, eps: float = 1e-3,
                          weighted: bool = True) -> torch.Tensor:  # fmt: skip
    """LLaDA's pre-training loss: a mask ratio ``t ~ U(eps, 1)`` per sequence, each token masked
    with probability ``t``, the cross-entropy of the masked tokens weighted by ``1 / t``, summed and
    divided by the tokens in the batch (LLaDA's Algorithm 1: an upper bound on the negative
    log-likelihood per token). ``weighted=False``: each sequence's mean cross-entropy over its masked
    tokens, averaged over the sequences (the same masks, ``1 / (t L)`` replaced by one over the
    count actually masked): what the model is trained on (train_text.py says why)."""
    n, length = ids.shape
    t = eps + (1 - eps) * torch.rand(n, 1, generator=generator)
    masked = torch.rand(n, length, generator=generator) < t
    noisy = torch.where(masked, torch.full_like(ids, model.spec.mask_id), ids)
    logits, _ = model(noisy, torch.arange(length))
    ce = F.cross_entropy(logits[masked], ids[masked], reduction="none")
    if not weighted:  # each sequence's mean over its masked tokens, the sequences' mean
        per_token = torch.zeros(n, length).masked_scatter(masked, ce)
        counts = masked.sum(1)
        return (per_token.sum(1)[counts > 0] / counts[counts > 0]).mean()
    return (ce / t.expand(n, length)[masked]).sum() / (n * length)


def masked_diffusion_training_loss(model: TextTransformer, ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return masked_diffusion_loss(model, ids, generator, weighted=False)


def autoregressive_loss(model: TextTransformer, ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Next-token cross-entropy (``generator`` unused: the loss draws nothing)."""
    logits, _ = model(ids[:, :-1], torch.arange(ids.shape[1] - 1))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def loss_of(model: TextTransformer, training: bool = False):
    """The kind's loss: for the masked-diffusion model, LLaDA's bound (held-out) or, ``training``, its unweighted form."""
    if model.spec.causal:
        return autoregressive_loss
    return masked_diffusion_training_loss if training else masked_diffusion_loss


def save_text_model(out: Path, model: TextTransformer, tokenizer, report: Optional[dict] = None) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(model.spec.as_dict(), indent=1))
    tokenizer.save(str(out / "tokenizer.json"))
    if report is not None:
        (out / "training.json").write_text(json.dumps(report))
    return out


def load_text_model(folder: Path) -> TextTransformer:
    """A model folder written by :func:`save_text_model`, in eval mode."""
    from safetensors.torch import load_file

    folder = Path(folder)
    model = TextTransformer(TextSpec(**json.loads((folder / "config.json").read_text())))
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return model.eval()
