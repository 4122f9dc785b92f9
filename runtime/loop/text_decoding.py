"""The text decoding loops (issue 56), beside the step loop: rows are texts of one layout, a
step is one call of a text graph, and a step unmasks and edits tokens instead of denoising. The
masked loop and the autoregressive one report each finished block or token (``on_block``,
``on_token``: streaming).

**Masked diffusion** (:func:`decode_masked`): a row is a text of ``L`` ids, some of them the mask
id; the *region* is the positions to decode, in *blocks* (a generation: the masked tail cut into
``block_length`` pieces, decoded left to right, as LLaDA's semi-autoregressive sampling; a span
edit: the span, one block). A step predicts every masked position of the block (its argmax, or
LLaDA's Gumbel-max at a temperature) with its confidence (the softmax probability of the token
chosen, float64), then:

- *mask-to-token*, with ``steps`` (LLaDA's ``generate.py`` schedule): the block's masks are shared
  out over ``steps // blocks`` steps (``count // steps`` each, the remainder one more on the first
  steps) and each step unmasks that many, the most confident first; with ``threshold``
  (Fast-dLLM's parallel decoding): every masked position whose confidence is at least the
  threshold, and at least the most confident one, so a block ends in at most its length;
- *token-to-token* (``edit_threshold``, LLaDA 2.1's editing): a token already decoded in the block
  whose prediction is now another token with probability at least ``edit_threshold`` is replaced,
  at every step of the block and in up to ``edit_rounds`` more steps once it holds no mask (a
  block whose step edits nothing is done). Tokens outside the region are never touched.

The K/V of the tokens outside the queried ones (``cache``): ``"none"`` runs ``text_full`` over the
whole text every step (the reference); ``"prefix"`` runs it at a block's first step and keeps the
K/V before the block, later steps querying the block and everything after it (Fast-dLLM's prefix
cache); ``"dual"`` keeps everything outside the block, later steps querying the block alone
(Fast-dLLM's dual cache). A bidirectional model's cached K/V would change as the block fills (they
attend to it): the reuse is an approximation, its error measured against ``"none"`` (docs/text.md).
A block's first step of N rows that are the same text runs one row and shares it (N continuations
of one prefix), and its cache then is one row broadcast over N (the graph takes ``Np`` 1).

**A style pass** (:func:`restyle`): a finished text's region read again, every token masked in
one of ``groups`` copies of the text (one batch), and replaced where the model is now confident of
another token.

**Autoregressive** (:func:`decode_autoregressive`): the prompt run once (shared by the rows when it
is one text), then one token a step with every earlier token's K/V cached, until ``max_tokens`` or
every row has written the end-of-text id.

Rows are independent: each draws its Gumbel noise or samples from its own generator (``seeds``),
so a row's tokens are the same alone or in a batch (to the graphs' float32 batching noise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

CACHE_MODES = ("none", "prefix", "dual")


class TextGraphs(Protocol):
    """The two graphs of an exported text model (export/compile/text_export.py)."""

    def full(self, ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def cached(self, ids: np.ndarray, positions: np.ndarray, past: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class DecodeStats:
    """What a decoding cost: graph calls, the tokens they decoded or edited, the rows x positions queried."""

    forwards: int = 0
    decoded: int = 0  # mask-to-token transfers, over every row
    edited: int = 0  # token-to-token replacements, over every row
    queried: int = 0  # rows x positions the graphs ran on (the work)
    row_calls: int = 0  # the calls each row of the decoding took part in, over every row
    per_step: list = field(default_factory=list)

    def merge(self, other: "DecodeStats") -> None:
        self.forwards += other.forwards
        self.decoded += other.decoded
        self.edited += other.edited
        self.queried += other.queried
        self.row_calls += other.row_calls
        self.per_step.extend(other.per_step)

    def tokens_per_forward(self) -> float:
        """Tokens a row decodes a call (LLaDA's "tokens per forward" at batch 1; a batch's rows each)."""
        return self.decoded / max(1, self.row_calls)


def _confidence(logits: np.ndarray, temperatures: Sequence[float], rngs: Sequence[np.random.Generator], mask_id: int,
                need: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The token each position takes and its probability: ``logits`` [N, R, V] -> ([N, R], [N, R]),
    computed where ``need`` [N, R] (elsewhere token 0, confidence -inf). At a temperature, LLaDA's
    Gumbel-max in float64 (``exp(logits) / (-log u) ** temperature``, ``u`` drawn from the row's
    generator at its needed positions only: the draws over a 4096-id vocabulary cost more than the
    graph); the confidence is the softmax probability of the token taken, either way. The mask id
    is never taken (a trained model never predicts it; an untrained one could, and a position
    "decoded" to the mask would stay masked for ever)."""
    tokens = np.zeros(need.shape, dtype=np.int64)
    confidence = np.full(need.shape, -np.inf)
    for k, (rng, temperature) in enumerate(zip(rngs, temperatures)):
        where = np.flatnonzero(need[k])
        if not len(where):
            continue
        wide = logits[k, where].astype(np.float64)
        wide[:, mask_id] = -np.inf
        if temperature > 0:
            chosen = (np.exp(wide) / (-np.log(rng.random(wide.shape))) ** temperature).argmax(-1)
        else:
            chosen = wide.argmax(-1)
        shifted = wide - wide.max(-1, keepdims=True)
        log_total = np.log(np.exp(shifted).sum(-1))
        tokens[k, where] = chosen
        confidence[k, where] = np.exp(np.take_along_axis(shifted, chosen[:, None], -1)[:, 0] - log_total)
    return tokens, confidence


def transfer_counts(masked: int, steps: int) -> list[int]:
    """LLaDA's ``get_num_transfer_tokens``: ``masked`` tokens over ``steps`` steps."""
    base, remainder = divmod(masked, steps)
    return [base + (1 if i < remainder else 0) for i in range(steps)]


def blocks_of(region: np.ndarray, block_length: Optional[int]) -> list[np.ndarray]:
    """The region's positions (a bool [L]) cut into blocks of ``block_length`` (None: one block)."""
    positions = np.flatnonzero(region)
    if block_length is None or block_length >= len(positions):
        return [positions]
    return [positions[i:i + block_length] for i in range(0, len(positions), block_length)]


class _Forward:
    """One block's graph calls under a cache mode: logits at the block's positions."""

    def __init__(self, graphs: TextGraphs, cache: str, stats: DecodeStats):
        self.graphs, self.cache, self.stats = graphs, cache, stats
        self.past: Optional[np.ndarray] = None
        self.query: Optional[np.ndarray] = None  # the positions later steps run on

    def first(self, x: np.ndarray, block: np.ndarray) -> np.ndarray:
        n, length = x.shape
        shared = n > 1 and bool((x == x[:1]).all())  # rows that are one text: one row runs, all share it
        ids = x[:1] if shared else x
        logits, kv = self.graphs.full(ids, np.arange(length))
        self._count(len(ids), length, n)
        if self.cache != "none":
            if self.cache == "prefix":
                self.query = np.arange(block[0], length)
            else:
                self.query = block
            kept = np.setdiff1d(np.arange(length), self.query)
            self.past = np.ascontiguousarray(kv[:, :, :, :, kept])
        out = logits[:, block]
        return np.broadcast_to(out, (n, *out.shape[1:])) if shared else out

    def next(self, x: np.ndarray, block: np.ndarray) -> np.ndarray:
        if self.cache == "none":
            logits, _ = self.graphs.full(x, np.arange(x.shape[1]))
            self._count(len(x), x.shape[1], len(x))
            return logits[:, block]
        logits, _ = self.graphs.cached(x[:, self.query], self.query, self.past)
        self._count(len(x), len(self.query), len(x))
        return logits[:, np.searchsorted(self.query, block)]

    def _count(self, rows: int, positions: int, served: int) -> None:
        """A call that ran ``rows`` rows of ``positions`` tokens for ``served`` rows of the decoding."""
        self.stats.forwards += 1
        self.stats.queried += rows * positions
        self.stats.row_calls += served


def decode_masked(graphs: TextGraphs, x: np.ndarray, region: np.ndarray, mask_id: int, *, block_length: Optional[int] = None,
                  steps: Optional[int] = None, threshold: Optional[float] = None, edit_threshold: Optional[float] = None,
                  edit_rounds: int = 1, cache: str = "none", temperature: float | Sequence[float] = 0.0,
                  seeds: Optional[Sequence[int]] = None, stop_id: Optional[int] = None,
                  on_block: Optional[Callable[[np.ndarray, int], None]] = None) -> tuple[np.ndarray, DecodeStats]:  # fmt: skip
    """Decode ``x`` [N, L] (int64, ``mask_id`` where unknown) over ``region`` (bool [L]): the
    rows with every masked position of the region filled. Exactly one of ``steps`` (LLaDA's
    schedule, over every block) and ``threshold`` (parallel decoding). ``temperature``: every
    row's, or each row's. ``stop_id``: once every row holds it in a finished block, later blocks
    are not decoded (left masked). ``on_block(x, end)``: called as each block is done, ``x``'s
    positions before ``end`` final (a later block never changes them); what it raises ends the
    decoding."""
    if (steps is None) == (threshold is None):
        raise ValueError("decode_masked: give steps (a fixed schedule) or threshold (parallel decoding), one of them")
    if cache not in CACHE_MODES:
        raise ValueError(f"cache {cache!r}: one of {', '.join(CACHE_MODES)}")
    x = np.array(x, dtype=np.int64, copy=True)
    n = len(x)
    rngs = [np.random.default_rng(s) for s in (seeds if seeds is not None else range(n))]
    temperatures = [float(temperature)] * n if np.isscalar(temperature) else [float(t) for t in temperature]
    stats = DecodeStats()
    blocks = blocks_of(np.asarray(region, dtype=bool), block_length)
    per_block = None if steps is None else max(1, steps // len(blocks))
    for block in blocks:
        masked0 = x[:, block] == mask_id
        schedule = None if per_block is None else [transfer_counts(int(c), per_block) for c in masked0.sum(1)]
        forward = _Forward(graphs, cache, stats)
        step, extra = 0, 0
        while True:
            masked = x[:, block] == mask_id
            if not masked.any():
                if edit_threshold is None or extra >= edit_rounds:
                    break
                extra += 1
            logits = forward.first(x, block) if step == 0 else forward.next(x, block)
            need = masked if edit_threshold is None else np.ones_like(masked)
            tokens, confidence = _confidence(logits, temperatures, rngs, mask_id, need)
            transfer = np.zeros_like(masked)
            for k in range(n):
                ranked = np.where(masked[k], confidence[k], -np.inf)
                if schedule is not None:
                    count = schedule[k][step] if step < per_block else int(masked[k].sum())
                else:
                    count = max(int((ranked >= threshold).sum()), 1 if masked[k].any() else 0)
                transfer[k, np.argsort(-ranked, kind="stable")[:count]] = True
            transfer &= masked
            edits = np.zeros_like(masked)
            if edit_threshold is not None:
                edits = ~masked & (tokens != x[:, block]) & (confidence >= edit_threshold)
            changed = transfer | edits
            x[:, block] = np.where(changed, tokens, x[:, block])
            stats.decoded += int(transfer.sum())
            stats.edited += int(edits.sum())
            stats.per_step.append(int(changed.sum()))
            step += 1
            if not masked.any() and not edits.any():
                break
        done = np.flatnonzero(region)[: np.searchsorted(np.flatnonzero(region), block[-1]) + 1]
        if on_block is not None:
            on_block(x, int(block[-1]) + 1)
        if stop_id is not None and (x[:, done] == stop_id).any(1).all():
            break
    return x, stats


def restyle(graphs: TextGraphs, x: np.ndarray, region: np.ndarray, mask_id: int, *, edit_threshold: float, rounds: int,
            groups: int = 4, cache: str = "prefix") -> tuple[np.ndarray, DecodeStats]:  # fmt: skip
    """A style pass: ``x`` [N, L] with no mask in ``region`` (bool [L]), every region token read
    again as the masked-diffusion model was trained to read tokens, masked. A round masks the
    region's positions ``groups`` ways (position i of the region in group ``i % groups``), runs the
    ``groups`` x N masked texts as one batch, and replaces each token whose masked prediction (its
    argmax, the mask id never taken) is another token with probability >= ``edit_threshold``;
    up to ``rounds`` rounds, a round that changes nothing ending it. A model trained on masked
    tokens only predicts a token it can see as itself: reading a token unmasked edits nothing.

    ``cache``: ``"none"`` runs every masked text whole; ``"prefix"`` runs the text once (the first
    round's first call) and keeps the K/V before the region for every later call, which then
    queries the region and what follows it (the bidirectional prefix's K/V computed with the
    unmasked text: an approximation, as the decoding's prefix cache)."""
    if cache not in ("none", "prefix"):
        raise ValueError(f"restyle: cache {cache!r}: none or prefix")
    x = np.array(x, dtype=np.int64, copy=True)
    n, length = x.shape
    positions = np.flatnonzero(region)
    stats = DecodeStats()
    groups = max(1, min(groups, len(positions)))
    member = np.zeros((groups, length), dtype=bool)  # [g, L]: the positions group g masks
    for g in range(groups):
        member[g, positions[g::groups]] = True
    query = np.arange(positions[0], length) if cache == "prefix" else np.arange(length)
    past = None
    if cache == "prefix":
        _, kv = graphs.full(x, np.arange(length))
        stats.forwards += 1
        stats.queried += n * length
        stats.row_calls += n
        past = np.repeat(np.ascontiguousarray(kv[:, :, :, :, : positions[0]]), groups, axis=2)  # row k's, for its groups
    for _ in range(rounds):
        masked = np.repeat(x, groups, axis=0)  # rows k * groups + g
        masked[np.tile(member, (n, 1))] = mask_id
        if past is None:
            logits, _ = graphs.full(masked, query)
        else:
            logits, _ = graphs.cached(masked[:, query], query, past)
        stats.forwards += 1
        stats.queried += len(masked) * len(query)
        stats.row_calls += n
        need = np.tile(member[:, query], (n, 1))
        tokens, confidence = _confidence(logits, [0.0] * len(masked), [None] * len(masked), mask_id, need)
        # each position's prediction from the one row of its text that masked it
        tokens = np.where(need, tokens, 0).reshape(n, groups, len(query)).sum(1)
        confidence = np.where(need, confidence, -np.inf).reshape(n, groups, len(query)).max(1)
        current = x[:, query]
        change = region[query][None] & (tokens != current) & (confidence >= edit_threshold)
        stats.edited += int(change.sum())
        stats.per_step.append(int(change.sum()))
        if not change.any():
            break
        x[:, query] = np.where(change, tokens, current)
    return x, stats


def decode_autoregressive(graphs: TextGraphs, prompt: np.ndarray, max_tokens: int, eos_id: int, *,
                          temperature: float | Sequence[float] = 0.0, seeds: Optional[Sequence[int]] = None,
                          rows: int = 1, on_token: Optional[Callable[[np.ndarray], None]] = None) -> tuple[np.ndarray, DecodeStats]:  # fmt: skip
    """``rows`` continuations of ``prompt`` (int64 [P], one text), each up to ``max_tokens`` ids
    (the end-of-text id written, then nothing); returns [rows, max_tokens] (``eos_id`` after a row's
    end). ``on_token(out)``: called with the tokens so far [rows, t] as each step is done; what it
    raises ends the decoding."""
    prompt = np.asarray(prompt, dtype=np.int64)
    rngs = [np.random.default_rng(s) for s in (seeds if seeds is not None else range(rows))]
    temperatures = [float(temperature)] * rows if np.isscalar(temperature) else [float(t) for t in temperature]
    stats = DecodeStats()
    logits, past = graphs.full(prompt[None], np.arange(len(prompt)))
    stats.forwards, stats.queried, stats.row_calls = 1, len(prompt), rows
    out = np.full((rows, max_tokens), eos_id, dtype=np.int64)
    done = np.zeros(rows, dtype=bool)
    last = np.broadcast_to(logits[:, -1], (rows, logits.shape[-1]))
    for t in range(max_tokens):
        tokens = np.array([_sample(last[k], temperatures[k], rngs[k]) if temperatures[k] > 0 else int(last[k].argmax())
                           for k in range(rows)])  # fmt: skip
        tokens = np.where(done, eos_id, tokens)
        out[:, t] = tokens
        stats.decoded += int((~done).sum())
        done |= tokens == eos_id
        if on_token is not None:
            on_token(out[:, : t + 1])
        if done.all() or t == max_tokens - 1:
            break
        logits, kv = graphs.cached(tokens[:, None], np.array([len(prompt) + t]), past)
        stats.forwards += 1
        stats.queried += rows
        stats.row_calls += rows
        if past.shape[2] != rows:  # the prompt's one row, now every row's own
            past = np.repeat(past, rows, axis=2)
        past = np.concatenate([past, kv], axis=4)
        last = logits[:, -1]
    return out, stats


def _sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    wide = logits.astype(np.float64) / temperature
    probs = np.exp(wide - wide.max())
    return int(rng.choice(len(probs), p=probs / probs.sum()))
