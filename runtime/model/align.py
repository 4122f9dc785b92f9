"""Which tokens an edit changes: a token-level diff of the base prompt and the edit prompt.

Both prompts are CLIP id sequences of 77 (BOS, tokens, EOS, padding). The diff (difflib's
longest-matching-blocks alignment, the one ``git diff`` uses in spirit) keeps the tokens the
two prompts share in order and reports the rest: the base's tokens that were replaced or
deleted and the edit's tokens that replace them or were inserted. Positions are indices into
the 77-token sequences, which is what the step graph's attention maps are indexed by; tokens
past the 77 limit were truncated away and cannot be seen (the report says so).

With AUTOMATIC1111's weighting (model/weighting.py) the ids are the prompt's words without the
syntax, and a token is compared with its weight: ``a (red:1.3) car`` -> ``a (blue:1.3) car``
changes the one word, ``a red car`` -> ``a (red:1.5) car`` changes ``red`` (its K/V moved), and
brackets that leave the words and weights alone change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Optional, Sequence


@dataclass(frozen=True)
class TokenDiff:
    base_positions: tuple[int, ...]  # base tokens replaced or deleted
    edit_positions: tuple[int, ...]  # edit tokens that replace them or were inserted

    @property
    def unchanged(self) -> bool:
        return not self.base_positions and not self.edit_positions

    @property
    def positions(self) -> tuple[int, ...]:
        """Every changed position, of either prompt, in order (a row's map reads both)."""
        return tuple(sorted(set(self.base_positions) | set(self.edit_positions)))


def _content(ids: Sequence[int], special: set[int], weights: Optional[Sequence[float]]) -> list[tuple[int, tuple]]:
    """(position, (id, weight)) of the prompt's own tokens: no BOS, EOS or padding."""
    return [(i, (int(t), 1.0 if weights is None else float(weights[i]))) for i, t in enumerate(ids) if t not in special]


def token_diff(base_ids: Sequence[int], edit_ids: Sequence[int], special: set[int],
               base_weights: Optional[Sequence[float]] = None,
               edit_weights: Optional[Sequence[float]] = None) -> TokenDiff:  # fmt: skip
    """The changed positions of ``base_ids`` and ``edit_ids`` (77 ids each); ``special`` holds
    the BOS/EOS/padding ids that are not words; the weights (77 each; None: all 1) are each
    token's emphasis, and a token whose weight changed is changed."""
    base, edit = _content(base_ids, special, base_weights), _content(edit_ids, special, edit_weights)
    matcher = SequenceMatcher(a=[t for _, t in base], b=[t for _, t in edit], autojunk=False)
    base_changed, edit_changed = [], []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        base_changed += [base[k][0] for k in range(a0, a1)]
        edit_changed += [edit[k][0] for k in range(b0, b1)]
    return TokenDiff(tuple(base_changed), tuple(edit_changed))
