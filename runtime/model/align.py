"""Which tokens an edit changes: a token-level diff of the base prompt and the edit prompt.

Both prompts are CLIP id sequences of 77 (BOS, tokens, EOS, padding). The diff (difflib's
longest-matching-blocks alignment, the one ``git diff`` uses in spirit) keeps the tokens the
two prompts share in order and reports the rest: the base's tokens that were replaced or
deleted and the edit's tokens that replace them or were inserted. Positions are indices into
the 77-token sequences, which is what the step graph's attention maps are indexed by; tokens
past the 77 limit were truncated away and cannot be seen (the report says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Sequence


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


def _content(ids: Sequence[int], special: set[int]) -> list[tuple[int, int]]:
    """(position, id) of the prompt's own tokens: no BOS, EOS or padding."""
    return [(i, t) for i, t in enumerate(ids) if t not in special]


def token_diff(base_ids: Sequence[int], edit_ids: Sequence[int], special: set[int]) -> TokenDiff:
    """The changed positions of ``base_ids`` and ``edit_ids`` (77 ids each); ``special`` holds
    the BOS/EOS/padding ids that are not words."""
    base, edit = _content(base_ids, special), _content(edit_ids, special)
    matcher = SequenceMatcher(a=[t for _, t in base], b=[t for _, t in edit], autojunk=False)
    base_changed, edit_changed = [], []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        base_changed += [base[k][0] for k in range(a0, a1)]
        edit_changed += [edit[k][0] for k in range(b0, b1)]
    return TokenDiff(tuple(base_changed), tuple(edit_changed))
