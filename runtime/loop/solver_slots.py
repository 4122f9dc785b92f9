"""The sampler's side of the step loop's resident slots: each row's update coefficients, its
solver history and an ancestral sampler's noise (runtime/model/samplers.py says what they are).

- ``coefs`` ``[rows, 7]``: the row's schedule's ``coefs`` at its step, written once per step
  with the other step scalars (one write for every row, padding included);
- ``history`` ``[rows, 2, c, h, w]``: the x_0 each row predicted one and two steps before,
  resident: written when a row joins (an edit's from its base's kept x_0, a generation's zeros),
  then carried on the device from the step's ``history_out`` by ``latent_blend``; it moves with
  the row's slot (the scheduler's ``row_elems``);
- ``noise`` ``[rows, c, h, w]``: written per step for ancestral rows only, from
  :func:`ancestral_noise` (the base's seed and the step: an edit of an ancestral base adds the
  same noise its base did, so an identity edit reproduces it). Other rows' coefficient on it is
  0, and the buffer holds only finite numbers (zeros, or an earlier row's noise), so it adds 0.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..engine.backend import Graph
from ..engine.device import DeviceTensor
from ..engine.step_signature import StepSignature
from ..model.step_coefs import COEFS
from .rows import Row


def ancestral_noise(seed: int, step: int, out: np.ndarray) -> np.ndarray:
    """The standard normal noise an ancestral row of a base with ``seed`` adds at ``step``,
    written into ``out`` (float32): numpy's PCG64 on (seed, step), independent of the initial
    noise's stream (pipeline.initial_noise draws from the seed alone)."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 1, int(step)]))
    rng.standard_normal(out=out.reshape(-1), dtype=np.float32)
    return out


class SolverSlots:
    """The coefficient, history and noise buffers of ``max_rows`` slots, in ``dev``."""

    def __init__(self, sig: StepSignature, graph: Graph, latent_shape: Sequence[int], max_rows: int,
                 dev: dict[str, DeviceTensor]):  # fmt: skip
        self.sig = sig
        self.latent_elems = math.prod(latent_shape)
        self.history_elems = 2 * self.latent_elems
        self.coefs = np.zeros((max_rows, len(COEFS)), dtype=graph.dtype(sig.step_coefs))
        self.noise = np.zeros(tuple(latent_shape), dtype=np.float32)
        self.zero_history = np.zeros((2, *latent_shape), dtype=np.float32)
        self.dev = dev
        for name, elems in ((sig.step_coefs, max_rows * len(COEFS)), (sig.history, max_rows * self.history_elems),
                            (sig.history_out, max_rows * self.history_elems), (sig.step_noise, max_rows * self.latent_elems)):  # fmt: skip
            dev[name] = graph.allocate(elems, graph.dtype(name))
            dev[name].write(np.zeros(elems, dtype=dev[name].dtype))  # device memory starts as anything

    def place(self, row: Row) -> None:
        """A joining row's history: its base's x_0 before its entry step, or zeros."""
        history = self.zero_history if row.history is None else row.history
        self.dev[self.sig.history].write(history, offset=row.slot * self.history_elems)

    def prepare(self, rows: Sequence[Row], b: int) -> None:
        """Each row's coefficients at its step (padding rows: the first row's), and each
        ancestral row's noise."""
        n = len(rows)
        for r, row in enumerate(rows):
            self.coefs[r] = row.schedule.coefs[row.step]
            if row.schedule.ancestral:
                ancestral_noise(row.noise_seed, row.step, self.noise)
                self.dev[self.sig.step_noise].write(self.noise, offset=r * self.latent_elems)
        self.coefs[n:b] = self.coefs[0]
        self.dev[self.sig.step_coefs].write(self.coefs[:b])

    def read_x0(self, row: Row, out: np.ndarray) -> None:
        """The x_0 ``row`` predicted at the step just run (after the blend), landing at the next sync."""
        self.dev[self.sig.history].read_async(out, offset=row.slot * self.history_elems)

    def read_history(self, row: Row) -> None:
        """``row.history`` <- its slot's (a suspended row keeps its solver state)."""
        if row.history is None:
            row.history = np.empty_like(self.zero_history)
        self.dev[self.sig.history].read_async(row.history, offset=row.slot * self.history_elems)
