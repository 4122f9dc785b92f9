"""Several directions in one edit, mixed by aligned tokens, not by position.

An edit row's cross-attention K/V are ``K_base + sum_i s_i (K_i[pi_i] - K_base)`` per layer (V
alike), over its terms: its own prompt at its strength and each of its ``directions``. ``pi_i``
is a permutation of the 77 text positions: ``pi_i[b]`` is the position of prompt i's token that
corresponds to the base's token at ``b``. SDXL's pooled embedding, which has no positions, mixes
by the same sum.

Why a permutation costs nothing: cross-attention over the text has no mask and no positions of
its own (those are in the text encoder's output already): a softmax over the 77 keys weighting
the 77 values. Permuting keys and values together leaves it unchanged but for float summation
order. So at strength 1 a single term runs exactly its prompt's own tail, whatever the
alignment (as position mixing does: K_base + (K_edit - K_base) is K_edit), and at any other
strength each base token moves towards the token it corresponds to, where after an inserted
word position mixing blends every later token with its neighbour's (and the base's EOS with
the edit's last word).

The alignment (:func:`token_permutation`), prompt-to-prompt's mapper in spirit: each prompt's
77 ids (BOS, tokens, EOS, padding) are cut into units, each word (its BPE tokens up to the one
that ends in ``</w>``) and each special token alone, and difflib's longest-matching-blocks
alignment pairs equal units in order. Then, in each replaced run, the k-th word pairs with the
k-th word, token by token; whatever is left (an inserted or a deleted word, the longer tail of
a replaced one, the padding a shift freed) pairs in order of position, so an inserted word
takes the padding slot that the shift freed. Words, not single tokens: a sub-word or
byte-level tokenizer would otherwise match a letter inside a replaced word with the same
letter elsewhere ("circle" and "square" share an r and an e) and scramble the word. A
replacement by words of the same token lengths is the identity: position mixing.

:func:`changed_positions` says, in the base's positions (those of the row's attention maps
after the mix), which words an edit's terms change, for ``preserve: auto``.
"""

from __future__ import annotations

import functools
from difflib import SequenceMatcher
from typing import Collection, Mapping, Optional, Sequence

import numpy as np

from .align import token_diff
from .state import KV

# The token axis of each tensor of a KV, in its layer order k_0, v_0, k_1, ...: K is
# [B, heads, head_dim, 77], V [B, heads, 77, head_dim] (the manifest's kv_layout, heads-major).
TOKEN_AXIS = (-1, -2)


def word_end_ids(vocab: Mapping[str, int]) -> frozenset[int]:
    """The ids of a CLIP BPE vocabulary's tokens that end a word (``...</w>``)."""
    return frozenset(i for token, i in vocab.items() if token.endswith("</w>"))


def units(ids: Sequence[int], special: Collection[int], word_ends: Optional[Collection[int]]) -> list[tuple[int, int]]:
    """[start, stop) of each unit of ``ids``: a word (up to a token of ``word_ends``; None: every
    token is a unit) or a special token alone (BOS, EOS, padding; a word cut off by the 77-token
    limit ends before the EOS)."""
    out, start = [], 0
    for i, t in enumerate(ids):
        if t in special:
            if start < i:
                out.append((start, i))
            out.append((i, i + 1))
            start = i + 1
        elif word_ends is None or t in word_ends:
            out.append((start, i + 1))
            start = i + 1
    if start < len(ids):
        out.append((start, len(ids)))
    return out


def token_permutation(base_ids: Sequence[int], edit_ids: Sequence[int], special: Collection[int] = (),
                      word_ends: Optional[Collection[int]] = None) -> np.ndarray:  # fmt: skip
    """``pi`` [77] int64 with ``pi[b]`` the position in ``edit_ids`` whose K/V mix into base
    position ``b`` (a permutation: see the module's docstring). ``special``: the BOS, EOS and
    padding ids; ``word_ends``: the ids that end a word (:func:`word_end_ids`). Read-only, and
    made once per pair of prompts (a slider's rows share it; ~0.5 ms to make on 77 ids)."""
    if len(base_ids) != len(edit_ids):
        raise ValueError(f"the prompts' ids are {len(base_ids)} and {len(edit_ids)} long; both must be the text length")
    ends = word_ends if word_ends is None or isinstance(word_ends, frozenset) else frozenset(word_ends)
    return _permutation(tuple(int(t) for t in base_ids), tuple(int(t) for t in edit_ids), frozenset(special), ends)


@functools.lru_cache(maxsize=1024)
def _permutation(base_ids: tuple, edit_ids: tuple, special: frozenset, word_ends: Optional[frozenset]) -> np.ndarray:
    a, b = units(base_ids, special, word_ends), units(edit_ids, special, word_ends)
    key = lambda ids, u: tuple(ids[u[0] : u[1]])  # noqa: E731
    matcher = SequenceMatcher(a=[key(base_ids, u) for u in a], b=[key(edit_ids, u) for u in b], autojunk=False)
    pi = np.full(len(base_ids), -1, dtype=np.int64)
    free_base: list[int] = []  # positions left unpaired, in order
    free_edit: list[int] = []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag in ("equal", "replace"):
            for ua, ub in zip(a[a0:a1], b[b0:b1]):  # equal: the same tokens; replace: word k with word k
                n = min(ua[1] - ua[0], ub[1] - ub[0])
                pi[ua[0] : ua[0] + n] = np.arange(ub[0], ub[0] + n)
                free_base += range(ua[0] + n, ua[1])
                free_edit += range(ub[0] + n, ub[1])
        paired = min(a1 - a0, b1 - b0) if tag in ("equal", "replace") else 0
        free_base += [p for ua in a[a0 + paired : a1] for p in range(*ua)]
        free_edit += [p for ub in b[b0 + paired : b1] for p in range(*ub)]
    pi[free_base] = free_edit  # as many of each: both prompts have every position once
    pi.flags.writeable = False
    return pi


def is_identity(pi: np.ndarray) -> bool:
    return bool((pi == np.arange(pi.size)).all())


def mixed_kv(base: KV, terms: Sequence[tuple[KV, float, Optional[np.ndarray]]]) -> KV:
    """``K_base + sum_i s_i (K_i[pi_i] - K_base)`` per tensor (V alike, along its own token
    axis), and the extras (SDXL's pooled embedding) by the same sum without a permutation; one
    prompt (B = 1). ``terms``: (K/V of prompt i, s_i, pi_i or None for the identity).

    Each tensor is one new array (plus one scratch array with several terms): the first term's
    difference is made in it and the base added last, so one term at identity is the position
    mix bit for bit, and no term (or every term at strength 0) is the base exactly.
    """
    if not terms:
        return KV([t[:1] for t in base.tensors], {k: v[:1] for k, v in base.extras.items()})
    perms = [None if pi is None or is_identity(pi) else pi for _, _, pi in terms]
    tensors = [_mix(b[:1], [(kv.tensors[j][:1], s, pi) for (kv, s, _), pi in zip(terms, perms)], TOKEN_AXIS[j % 2])
               for j, b in enumerate(base.tensors)]  # fmt: skip
    extras = {k: _mix(v[:1], [(kv.extras[k][:1], s, None) for kv, s, _ in terms], None) for k, v in base.extras.items()}
    return KV(tensors, extras)


def _mix(b: np.ndarray, terms: list, axis: Optional[int]) -> np.ndarray:
    out = scratch = None
    for e, s, pi in terms:
        if out is not None and scratch is None:
            scratch = np.empty(b.shape, np.result_type(e, b))
        into = scratch if out is not None else None
        if pi is None:
            d = np.subtract(e, b, out=into)
        else:  # the prompt's tokens in the base's order: the one copy this term makes
            d = np.take(e, pi, axis=axis, out=into, mode="clip")
            d -= b
        d *= s
        if out is None:
            out = d
        else:
            out += d
    out += b
    return out


def changed_positions(base_ids: Sequence[int], base_weights: Optional[Sequence[float]],
                      terms: Sequence[tuple[Sequence[int], Optional[Sequence[float]]]], perms: Sequence[np.ndarray],
                      special: Collection[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:  # fmt: skip
    """For ``preserve: auto``: (changed, content) in the base's positions, which is what a row's
    attention maps are indexed by once its K/V are mixed: the union over ``terms`` ((ids,
    weights) each, aligned by ``perms``) of the words each changes (align.py's diff: the base's
    replaced or deleted tokens where they are, the term's new ones where its permutation puts
    them), and every position that holds a word of some term."""
    changed: set[int] = set()
    content: set[int] = set()
    for (ids, weights), pi in zip(terms, perms):
        at = np.argsort(pi)  # position in the term -> position in the base
        diff = token_diff(base_ids, ids, set(special), base_weights, weights)
        changed |= set(diff.base_positions) | {int(at[p]) for p in diff.edit_positions}
        content |= {int(at[p]) for p, t in enumerate(ids) if t not in special}
    return tuple(sorted(changed)), tuple(sorted(content))
