"""The negative prompts' K/V, resident once per distinct set in the step loop's backend memory.

A step call mixes rows of up to ``max_sets`` negative prompts: their unconditional K/V (and the
family's set conditioning, SDXL's pooled embedding) lie side by side on the token axis (``S`` =
77 x sets) of the ``set_kv`` inputs, and each row's ``set_index`` says which is its own. A set
is keyed by its values' digest (a fresh encoding and an int8-stored copy of one negative prompt
are two sets), counts the rows that use it, and is dropped to make room only when no row does.
The scheduler (row_scheduler.py) holds one :class:`UncondSets` and re-indexes its rows whenever the
layout is rewritten.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from ..engine.device import DeviceTensor
from ..engine.step_signature import StepSignature
from ..model.state import KV
from .rows import Row, SchedulerStats


@dataclass
class _Set:
    kv: KV
    users: int = 0


class UncondSets:
    """Up to ``max_sets`` negative prompts' K/V in ``dev`` (allocated here, by ``alloc``)."""

    def __init__(self, sig: StepSignature, text_len: int, max_sets: int, alloc: Callable[[str, int], DeviceTensor],
                 dev: dict[str, DeviceTensor], stats: SchedulerStats):  # fmt: skip
        self.specs = sig.shapes
        self.text_len = text_len
        self.max_sets = max_sets
        self.set_kv, self.set_cond = list(sig.set_kv), sig.set_cond  # set_cond: input -> the family's cond
        self.stats = stats  # set_writes
        self.sets: OrderedDict[str, _Set] = OrderedDict()
        self.dev = dev
        for name in self.set_kv:
            dev[name] = alloc(name, max_sets * self.elems(name))
        for name in self.set_cond:
            dev[name] = alloc(name, max_sets * math.prod(self.specs[name][1:]))

    def elems(self, name: str) -> int:
        """Elements of one set in input ``name``."""
        return math.prod(self.text_len if d == "S" else d for d in self.specs[name])

    def shape(self, name: str, sets: int) -> tuple[int, ...]:
        """Input ``name``'s shape with ``sets`` sets side by side."""
        return tuple(sets * self.text_len if d == "S" else d for d in self.specs[name])

    def __len__(self) -> int:
        return len(self.sets)

    def fits(self, digests: Iterable[str]) -> bool:
        """Whether the sets rows use now and ``digests`` fit in one call."""
        used = {k for k, s in self.sets.items() if s.users}
        return len(used | set(digests)) <= self.max_sets

    def place(self, joining: Sequence[Row]) -> bool:
        """Make every joining row's set resident (sets nobody uses make room, never one a joining
        row needs: it has no users yet); whether the layout was rewritten (rows to re-index)."""
        needed = {r.uncond.digest for r in joining}
        if all(key in self.sets for key in needed):
            return False
        for key in [k for k, s in self.sets.items() if not s.users and k not in needed]:
            del self.sets[key]
        for row in joining:
            self.sets.setdefault(row.uncond.digest, _Set(row.uncond))
        self.write()
        return True

    def positions(self) -> dict[str, int]:
        """Each resident set's index (the rows' ``set_index``)."""
        return {key: k for k, key in enumerate(self.sets)}

    def join(self, row: Row) -> None:
        row.set_key = row.uncond.digest
        self.sets[row.set_key].users += 1

    def leave(self, row: Row) -> None:
        self.sets[row.set_key].users -= 1

    def clear(self) -> None:
        """Idle: the next rows start with only their own sets."""
        self.sets.clear()

    def keep_only(self, needed: set[str]) -> bool:
        """After a failed step: keep only the sets in ``needed``, written afresh (a set write the
        failure cut short leaves nothing behind); whether there are any (rows to re-index)."""
        for key in [k for k in self.sets if k not in needed]:
            del self.sets[key]
        if self.sets:
            self.write()
        return bool(self.sets)

    def write(self) -> None:
        """Lay the resident sets side by side on the token axis."""
        for j, name in enumerate(self.set_kv):
            axis = self.specs[name].index("S")
            self.dev[name].write(np.concatenate([s.kv.tensors[j][0] for s in self.sets.values()], axis=axis))
        for name, cond in self.set_cond.items():  # [sets, dim]: one row per set
            self.dev[name].write(np.concatenate([s.kv.extras[cond] for s in self.sets.values()]))
        self.stats.set_writes += 1
