"""What the blend takes from a row's base at every step, resident in backend memory.

A masked row (an explicit mask or ``preserve: auto`` once its mask exists) keeps its base's
latent where the mask says: after each step ``i`` the blend takes the base's ``x_{i+1}``; a row
of an inverted image's base adds the base's correction ``d_i``. Those arrays go up once, as a
*window* (one per step from the row's step ``lo`` to its end), when the row first blends; each
step then copies its array into the blend's input slot on the device, so such a row's steady
step sends the backend nothing a plain row does not. Rows of one base over the same steps (a
slider's positions, a batch of masked edits) share one window; when the last of them leaves its
memory is kept for the next window that fits (up to ``SPARE`` of them: a ``cudaMalloc`` or
``cudaFree`` while serving would wait on the device), and freed with the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..engine.device import DeviceTensor
from .rows import Row


@dataclass
class _Window:
    tensor: DeviceTensor
    lo: int  # the window holds the arrays after steps lo, lo + 1, ...
    owner: Any  # held so that the key's id stays this base's while the window lives
    rows: set = field(default_factory=set)  # ids of the rows using it


class BaseWindows:
    """One blend input's windows, keyed by (base, first step, end step)."""

    SPARE = 8

    def __init__(self, allocate: Callable[[int], DeviceTensor], latent_elems: int,
                 owner: Callable[[Row], Any], at: Callable[[Any, int], np.ndarray]):
        """``allocate(elems)`` makes a tensor in the dtype of the blend's input; ``owner(row)``
        is the base state a row's window comes from, ``at(owner, i)`` its array after step ``i``
        ([c, h, w])."""
        self.allocate = allocate
        self.owner, self.at = owner, at
        self.latent_elems = latent_elems
        self.windows: dict[tuple[int, int, int], _Window] = {}
        self.by_row: dict[int, tuple[int, int, int]] = {}
        self.spare: list[DeviceTensor] = []  # memory of windows no row uses, for the next one
        self.uploads = 0  # windows written (a test's and a reader's count)

    def source(self, row: Row) -> tuple[DeviceTensor, int]:
        """The tensor holding ``row``'s array after its current step, and its offset."""
        key = self.by_row.get(id(row))
        if key is None:
            key = self._acquire(row)
        window = self.windows[key]
        return window.tensor, (row.step - window.lo) * self.latent_elems

    def _acquire(self, row: Row) -> tuple[int, int, int]:
        owner = self.owner(row)
        key = (id(owner), row.step, row.end)
        window = self.windows.get(key)
        if window is None:
            count = row.end - row.step  # one per step from the row's to its last
            tensor = self._tensor(count * self.latent_elems)
            for k in range(count):
                tensor.write(np.ascontiguousarray(self.at(owner, row.step + k)), offset=k * self.latent_elems)
            window = self.windows[key] = _Window(tensor, row.step, owner)
            self.uploads += 1
        window.rows.add(id(row))
        self.by_row[id(row)] = key
        return key

    def release(self, row: Row) -> None:
        """``row`` left: its window goes with the last row using it."""
        key = self.by_row.pop(id(row), None)
        if key is None:
            return
        window = self.windows[key]
        window.rows.discard(id(row))
        if not window.rows:
            del self.windows[key]
            self.spare.append(window.tensor)
            if len(self.spare) > self.SPARE:  # the smallest goes
                self.spare.sort(key=lambda tensor: tensor.capacity)
                self.spare.pop(0).free()

    def _tensor(self, elems: int) -> DeviceTensor:
        fits = [tensor for tensor in self.spare if tensor.capacity >= elems]
        if not fits:
            return self.allocate(elems)
        tensor = min(fits, key=lambda tensor: tensor.capacity)
        self.spare.remove(tensor)
        return tensor

    def free(self) -> None:
        for tensor in [*(window.tensor for window in self.windows.values()), *self.spare]:
            tensor.free()
        self.windows.clear()
        self.by_row.clear()
        self.spare.clear()
