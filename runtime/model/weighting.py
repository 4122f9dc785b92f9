"""Prompt weighting as AUTOMATIC1111's web UI computes it: ``(word)``, ``[word]``, ``(word:1.3)``.

What its web UI does with a prompt, and what edit-rt does with each part (modules/prompt_parser.py,
modules/sd_hijack_clip.py and modules/sd_emphasis.py "Original", its default):

1. **Emphasis** (honoured): ``(a)`` multiplies the weight of ``a`` by 1.1, ``[a]`` divides it by
   1.1, ``(a:1.3)`` multiplies it by 1.3; groups nest and multiply (``((a))`` is 1.21); ``\\(``
   ``\\)`` ``\\[`` ``\\]`` ``\\\\`` are the literal characters; an unclosed ``(`` or ``[`` weighs
   everything after it, a stray ``)`` or ``]`` is text. :func:`parse_attention` gives the spans
   (text, weight) with A1111's rules, to its floats.
2. **Tokens** (:class:`SpanTokenizer`): each span is tokenized alone and the ids joined, then
   the tokenizer's own truncation (75 tokens + BOS + EOS), template and padding to 77; every
   BPE token of a span has the span's weight, BOS, EOS and padding 1.
3. **Hidden states** (:func:`emphasize`): the text encoder runs on those plain ids; its hidden
   states ``z [77, D]`` are multiplied by each token's weight, then rescaled so that their mean
   is the original mean (``z *= w; z *= mean_before / mean_after``), per text encoder (SDXL's
   two, each its own mean); SDXL's pooled embedding is not weighted. K/V are linear in ``z``,
   so weighting ``z`` before ``kv_proj`` is weighting K/V exactly.

Refused with :class:`PromptSyntaxError`, naming the syntax and what to write instead, what A1111
gives a meaning that edit-rt does not run (never taken as text): prompt editing ``[a:b:0.5]``
and alternation ``[a|b]`` (a row's K/V are one prompt for all its steps; found with A1111's
schedule grammar by :func:`schedule_at`), ``AND`` and a prompt's trailing ``:weight``
(composable diffusion; ``:1`` is the identity and is honoured), ``BREAK`` (a second 75-token
chunk), extra networks ``<lora:name:0.8>`` (a door that takes LoRA tags reads them first:
model/lora_tags.py), and a weight that is not a number (``(a:1.2.3)``,
where A1111 fails with a traceback). Past 75 tokens a prompt is truncated, as diffusers
truncates (A1111 would start a second chunk); ``truncated`` says how many tokens went. Negative
prompts are parsed as A1111 parses them: emphasis applies, ``AND`` and a trailing ``:2`` are text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from tokenizers import Encoding, Tokenizer

from ..errors import PromptSyntaxError

ROUND = 1.1  # (a): A1111's round-bracket multiplier; [a] divides by it
_SPECIAL = "\\()[]:"  # characters that end a run of plain text in the emphasis syntax
_EXPLICIT = re.compile(r":\s*([+-]?[.\d]+)\s*\)")  # "(a:1.3)": A1111's weight (its re_attention)
_BREAK = re.compile(r"\bBREAK\b")
_AND = re.compile(r"\bAND\b")
# a positive prompt's trailing ":2" (A1111's re_weight, as a search from the end: the same match)
_TRAILING_WEIGHT = re.compile(r"\s*:\s*([-+]?(?:\d+\.?|\d*\.\d+))\s*$")
_EXTRA_NETWORK = re.compile(r"<(\w+):([^>]+)>")  # <lora:name:0.8>, <hypernet:name:1>
# The schedule grammar's NUMBER (lark's SIGNED_NUMBER), then "]": the end of "[a:b:0.5]"
_STEP_CLOSE = re.compile(r"\s*[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?\s*\]")


def _show(text: str, limit: int = 40) -> str:
    return f"`{text if len(text) <= limit else text[:limit] + '...'}`"


# --- 1. the emphasis syntax ----------------------------------------------------------------------


def parse_attention(text: str) -> list[tuple[str, float]]:
    """``text`` -> [(span, weight)], A1111's ``parse_prompt_attention``: runs of equal weight
    merged, at least one span. Weights are A1111's floats (products in its order: a group
    multiplies what it holds when it closes; unclosed round groups, then unclosed square ones,
    at the end)."""
    spans: list[list] = []  # [text, weight], mutable: a closing group multiplies its range
    rounds: list[int] = []  # the span index each open "(" started at
    squares: list[int] = []

    def close(start: int, factor: float) -> None:
        for span in spans[start:]:
            span[1] *= factor

    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            if i + 1 < n and text[i + 1] in "()[]\\":
                spans.append([text[i + 1], 1.0])
                i += 2
            else:  # a lone backslash is dropped (A1111 keeps "" in its place)
                spans.append(["", 1.0])
                i += 1
        elif c == "(":
            rounds.append(len(spans))
            i += 1
        elif c == "[":
            squares.append(len(spans))
            i += 1
        elif c == ":" and (explicit := _EXPLICIT.match(text, i)):
            if rounds:
                close(rounds.pop(), _weight(explicit.group(1), text, i, explicit.end()))
            else:  # no "(" to close: the whole ":1.3)" is text
                spans.append([_no_break(explicit.group(0)), 1.0])
            i = explicit.end()
        elif c == ")" and rounds:
            close(rounds.pop(), ROUND)
            i += 1
        elif c == "]" and squares:
            close(squares.pop(), 1 / ROUND)
            i += 1
        elif c in _SPECIAL:  # ":", or a ")" / "]" with nothing open
            spans.append([c, 1.0])
            i += 1
        else:
            j = i + 1
            while j < n and text[j] not in _SPECIAL:
                j += 1
            spans.append([_no_break(text[i:j]), 1.0])
            i = j
    for start in rounds:
        close(start, ROUND)
    for start in squares:
        close(start, 1 / ROUND)
    merged: list[tuple[str, float]] = []
    for span, weight in spans or [["", 1.0]]:
        if merged and merged[-1][1] == weight:
            merged[-1] = (merged[-1][0] + span, weight)
        else:
            merged.append((span, weight))
    return merged


def _weight(number: str, text: str, start: int, end: int) -> float:
    try:
        return float(number)
    except ValueError:
        raise PromptSyntaxError(f"{_show(text[max(0, start - 20):end])}: the weight {number!r} is not a number; "
                                "write one, as in `(word:1.2)`") from None  # fmt: skip


def _no_break(chunk: str) -> str:
    if _BREAK.search(chunk):
        raise PromptSyntaxError("`BREAK` starts a second 75-token chunk in AUTOMATIC1111, and this model's K/V "
                                "hold one 77-token chunk: remove BREAK (lowercase `break` is the word)")  # fmt: skip
    return chunk


# --- what A1111 would run and edit-rt does not -------------------------------------------------------


def schedule_at(text: str) -> Optional[tuple[int, int, str]]:
    """The first ``[...]`` that A1111's prompt-schedule grammar reads as prompt editing
    (``[a:b:0.5]``, ``[a:3]``, ``[a::3]``) or alternation (``[a|b]``): (start, end, kind); None
    when there is none, or when the grammar cannot read the prompt at all (a ``|`` outside
    brackets: A1111 then takes the whole prompt as it is).

    Its grammar (modules/prompt_parser.py, a lark grammar) as a recognizer over positions:
    ``P[i]`` is the set of ends of a ``prompt`` (a sequence of elements: emphasized groups,
    scheduled, alternate, plain text with ``\\x`` escapes) that starts at i, a bitset, built from
    the end of the text backwards; the top level also takes ``[ ] ( ) :`` as literal characters.
    """
    n = len(text)
    if "[" not in text or not ("|" in text or _STEP_CLOSE.search(text)):
        return None  # no "|" and no ":NUMBER]": nothing can be scheduled (the common case, O(n))
    mask = lambda chars: sum(1 << k for k, c in enumerate(text) if c in chars)  # noqa: E731
    close_round, close_square, colons, bars = mask(")"), mask("]"), mask(":"), mask("|")

    def bits(x: int):
        while x:
            low = x & -x
            yield low.bit_length() - 1
            x ^= low

    def step_close(j: int) -> int:  # [WHITESPACE] NUMBER [WHITESPACE] "]" from j: the end past "]"
        m = _STEP_CLOSE.match(text, j)
        return 1 << m.end() if m else 0

    P = [0] * (n + 1)
    E = [0] * (n + 1)  # ends of one element starting at i
    scheduled: dict[int, tuple[int, str]] = {}  # "[" position -> (its ends, kind)
    P[n] = 1 << n
    for i in range(n - 1, -1, -1):
        c, ends = text[i], 0
        if c not in "\\[]():|":
            ends = 1 << (i + 1)
        elif c == "\\":
            ends = 1 << (i + 2) if i + 1 < n and text[i + 1] != "\n" else 0
        elif c == "(":
            inner = P[i + 1]
            ends = (inner & close_round) << 1  # "(" prompt ")"
            for k in bits(inner & colons):  # "(" prompt ":" prompt ")"
                ends |= (P[k + 1] & close_round) << 1
        elif c == "[":
            inner = P[i + 1]
            ends = (inner & close_square) << 1  # "[" prompt "]"
            edit = 0  # "[" [prompt ":"] prompt ":" NUMBER "]"
            for k in bits(inner & colons):
                edit |= step_close(k + 1)
                for k2 in bits(P[k + 1] & colons):
                    edit |= step_close(k2 + 1)
            alternate, seen, todo = 0, 0, inner & bars  # "[" prompt ("|" [prompt])+ "]"
            while todo:
                k = next(bits(todo))
                todo ^= 1 << k
                seen |= 1 << k
                after = P[k + 1]
                alternate |= (after & close_square) << 1
                todo |= after & bars & ~seen
            if edit or alternate:
                scheduled[i] = (edit | alternate, "prompt editing" if edit else "alternation")
            ends |= edit | alternate
        E[i] = ends
        reach = 1 << i
        for e in bits(ends):
            reach |= P[e]
        P[i] = reach
    if not scheduled:
        return None
    # the top level: (prompt | /[][():]/+)*, read from the end: Q[i] when text[i:] parses
    Q = [False] * (n + 1)
    Q[n] = True
    for i in range(n - 1, -1, -1):
        Q[i] = (text[i] in "[]():" and Q[i + 1]) or any(Q[e] for e in bits(E[i]))
    if not Q[0]:
        return None  # A1111's parser fails and it runs the prompt as written
    reached = 1  # positions the top level reaches from 0
    for i in range(n):
        if not reached >> i & 1:
            continue
        if i in scheduled:
            ends, kind = scheduled[i]
            good = [e for e in bits(ends) if Q[e]]
            if good:
                return i, good[0], kind
        if text[i] in "[]():":
            reached |= 1 << (i + 1)
        reached |= E[i]
    return None


def _network_refusal(tag: re.Match, negative: bool) -> str:
    """Why an extra-network tag is refused here. A LoRA tag is read where a prompt becomes a
    request's adapters (model/lora_tags.py: the A1111 routes, a config's base and edit prompts),
    never by the text encoder; A1111 itself reads none in a negative prompt (its
    ``parse_extra_network_prompts`` parses the prompts only: there the tag is text)."""
    shown, kind = _show(tag.group(0)), tag.group(1)
    if kind not in ("lora", "lyco"):
        return f"{shown} is an AUTOMATIC1111 extra network ({kind}); edit-rt loads none: remove it from the prompt"
    if negative:
        return (f"{shown} is an AUTOMATIC1111 extra network (a LoRA) in a negative prompt, where AUTOMATIC1111 "
                "reads it as text and loads nothing: move it to the prompt, or remove it")  # fmt: skip
    name = tag.group(2).split(":")[0][:40]
    return (f"{shown} is an AUTOMATIC1111 extra network (a LoRA), which this prompt does not read: give it as "
            f"adapters: {{{name!r}: scale}} (a generation's or an edit's `adapters`), or send the prompt where tags are read "
            "(/sdapi/v1/txt2img and img2img, a config's base.prompt and edits[i].prompt)")  # fmt: skip


def prompt_spans(text: str, negative: bool = False) -> list[tuple[str, float]]:
    """The weighted spans A1111 encodes for ``text``, or :class:`PromptSyntaxError` for what it
    would run and edit-rt does not. ``negative``: A1111 reads a negative prompt without
    ``AND`` and a trailing weight (they are text there)."""
    network = _EXTRA_NETWORK.search(text)
    if network:
        raise PromptSyntaxError(_network_refusal(network, negative))
    if not negative:
        if _AND.search(text):
            raise PromptSyntaxError("`AND` combines prompts in AUTOMATIC1111 (composable diffusion), which edit-rt "
                                    "does not run: write lowercase `and`, or make them separate edits")  # fmt: skip
        trailing = _TRAILING_WEIGHT.search(text)
        weight = trailing.group(1) if trailing else None
        if weight is not None and float(weight) != 1.0:
            raise PromptSyntaxError(f"the trailing `:{weight}` is AUTOMATIC1111's weight of a composable prompt (it "
                                    "scales this prompt's guidance), which edit-rt does not run: set the guidance "
                                    "(cfg_scale) instead, or end the prompt with another character")  # fmt: skip
        if trailing:  # A1111 encodes the text before the weight (":1" is the identity)
            text = text[: trailing.start()]
    found = schedule_at(text)
    if found:
        start, end, kind = found
        what = ("a prompt that changes at a step" if kind == "prompt editing" else "a prompt that alternates every step")
        raise PromptSyntaxError(f"{_show(text[start:end])} is AUTOMATIC1111's {kind} ({what}), which edit-rt does not "
                                "run (a row's K/V are one prompt for all its steps): make them separate edits, or "
                                "write `\\[` `\\]` for literal brackets")  # fmt: skip
    return parse_attention(text)


# --- 2. tokens and their weights -------------------------------------------------------------------


@dataclass(frozen=True)
class WeightedIds:
    """One prompt's CLIP ids [77] (BOS, tokens, EOS, padding) and each id's weight [77]."""

    ids: np.ndarray  # int64
    weights: np.ndarray  # float32 (A1111 casts its multipliers to float32 before multiplying)
    truncated: int  # the prompt's tokens past the 75 that fit

    @property
    def weighted(self) -> bool:
        return bool((self.weights != 1.0).any())


class SpanTokenizer:
    """Tokenizes weighted spans with one CLIP tokenizer (a ``tokenizers.Tokenizer`` set up with
    SD's truncation and padding to 77): each span alone, without special tokens, as A1111 does
    (a span boundary inside a word splits it, as there), the encodings joined, then the
    tokenizer's own truncation, BOS/EOS template and padding. A single span of weight 1 gives
    exactly ``tokenizer.encode(text)``'s ids."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._spans = Tokenizer.from_str(tokenizer.to_str())  # the same tokenizer, untruncated, unpadded
        self._spans.no_padding()
        self._spans.no_truncation()

    def encode(self, spans: Sequence[tuple[str, float]]) -> WeightedIds:
        parts = self._spans.encode_batch([text for text, _ in spans], add_special_tokens=False)
        weights = [w for part, (_, w) in zip(parts, spans) for _ in part.ids]
        final = self.tokenizer.post_process(Encoding.merge(parts, growing_offsets=False))
        # the prompt's own tokens are sequence 0 (BOS, EOS and padding have none); SD's
        # tokenizers truncate on the right, so the kept ones are the first
        kept = [k for k, s in enumerate(final.sequence_ids) if s == 0]
        out = np.ones(len(final.ids), dtype=np.float32)
        out[kept] = np.asarray(weights[: len(kept)], dtype=np.float32)
        return WeightedIds(np.asarray(final.ids, dtype=np.int64), out, len(weights) - len(kept))


# --- 3. the hidden states ---------------------------------------------------------------------------


def encoder_widths(reference: np.ndarray, changed: Sequence[np.ndarray]) -> list[int]:
    """Each text encoder's width in hidden states ``[77, D]`` that concatenate several
    encoders' (SDXL: 768 + 1280), from the text graph's outputs: ``reference`` for one set of
    ids, ``changed[k]`` with only encoder k's ids changed. The encoders share nothing, so the
    others' columns stay bit-equal and encoder k's are those that moved (the manifest records
    only D)."""
    widths, lo = [], 0
    for k, hidden in enumerate(changed):
        cols = np.flatnonzero((hidden != reference).any(axis=0))
        if len(cols) == 0 or cols[0] != lo or cols[-1] - cols[0] + 1 != len(cols):
            raise ValueError(f"text encoder {k}'s columns of the hidden states are not the block after {lo}")
        widths.append(len(cols))
        lo += len(cols)
    if lo != reference.shape[-1]:
        raise ValueError(f"the text encoders' columns cover {lo} of {reference.shape[-1]}")
    return widths


def emphasize(hidden: np.ndarray, weights: Sequence[np.ndarray], widths: Sequence[int]) -> np.ndarray:
    """A1111's "Original" emphasis on one prompt's hidden states ``[77, D]``: each text
    encoder's columns (``widths``, in order, summing to D) times its tokens' ``weights`` [77],
    rescaled to the mean they had. A weighting that leaves no finite mean is refused."""
    out = np.empty_like(hidden)
    lo = 0
    for width, w in zip(widths, weights):
        z = hidden[:, lo : lo + width]
        before = z.mean(dtype=np.float32)
        weighted = z * w[:, None]
        scale = before / weighted.mean(dtype=np.float32)
        out[:, lo : lo + width] = weighted * scale
        lo += width
    if not np.isfinite(out).all():
        raise PromptSyntaxError("these weights leave the text encoder's output without a finite mean "
                                "(A1111 divides by it); use weights nearer 1")  # fmt: skip
    return out
