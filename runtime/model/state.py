"""What a base keeps: the types the store, the loop and the server share (an edit is edit.py's).

Step i of a T-step chain (its sampler: ``base.sampler``) maps latent x_i to x_{i+1} (x_0 is the
noise, x_T the final latent). A base keeps x_i for every i of its cache window, the
unconditional prediction u_i the chain computed at each of those steps, its prompt's K/V for
every cross-attention layer and its negative prompt's (unconditional) K/V; a multistep sampler's
base also the x_0 each step predicted (from two steps before the window on: the solver history
an edit entering at the window's first step reads). An edit row re-enters at x_s with its own
K/V, the base's history at s, and runs steps s..T-1; at step s its unconditional prediction is
the base's u_s (same latent, timestep and negative prompt), so it is taken from the base
instead of computed again.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .edit import Base


@dataclass
class KV:
    """Cross-attention K/V of B prompts: ``tensors[2*i]`` is K of layer i, ``[2*i+1]`` its V.

    Each tensor is in the layout the step graph's attention reads (manifest ``kv_layout``):
    K ``[B, heads, head_dim, 77]``, V ``[B, heads, 77, head_dim]``, float32.
    """

    tensors: list[np.ndarray]
    # The family's other per-prompt values (SDXL: "text_embeds", the pooled embedding [B, P])
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    _digest: Optional[str] = field(default=None, repr=False, compare=False)

    def row(self, b: int) -> "KV":
        return KV([t[b : b + 1] for t in self.tensors], {k: v[b : b + 1] for k, v in self.extras.items()})

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors) + sum(v.nbytes for v in self.extras.values())

    @property
    def digest(self) -> str:
        """A hash of the values: two sets with the same digest hold the same numbers (a fresh
        encoding and an int8-stored copy of one negative prompt do not)."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            for t in [*self.tensors, *(self.extras[k] for k in sorted(self.extras))]:
                h.update(np.ascontiguousarray(t).data)
            self._digest = h.hexdigest()
        return self._digest


@dataclass
class BaseState:
    """What a base keeps so that edits can re-enter its chain (see ARCHITECTURE.md, cache)."""

    base: Base
    fingerprint: str
    window_start: int
    latents: np.ndarray  # [T - window_start + 1, c, h, w]: x_i for i in window_start..T
    cond_kv: KV  # the base prompt's K/V, B = 1
    uncond_kv: KV  # the negative prompt's K/V, B = 1
    # [T - window_start, c, h, w]: the unconditional prediction at x_i, i in window_start..T-1
    uncond_out: Optional[np.ndarray] = None
    # An inverted image's base (pipeline.invert): [T - window_start, c, h, w], added to every
    # row of this base after its step i, so that the base's own row retraces x_{i+1} exactly
    corrections: Optional[np.ndarray] = None
    # An inverted image's base: the pixels it was inverted from, [H, W, 3] uint8 (what its key's
    # sha256 names). A masked edit shows these outside its mask, not their VAE round trip.
    source: Optional[np.ndarray] = None
    # A multistep sampler's base: [T - window_start + 2, c, h, w], the x_0 predicted at steps
    # window_start - 2 .. T - 1 (zeros for steps before 0)
    x0: Optional[np.ndarray] = None

    def latent(self, i: int) -> np.ndarray:
        """x_i as a [1, c, h, w] view into the cache (no copy)."""
        return self.latents[i - self.window_start][None]

    def entry_uncond(self, i: int) -> Optional[np.ndarray]:
        """u_i, the unconditional prediction at x_i, [c, h, w] (None if not kept)."""
        if self.uncond_out is None or not self.window_start <= i < self.base.steps:
            return None
        return self.uncond_out[i - self.window_start]

    def history(self, i: int) -> Optional[np.ndarray]:
        """The solver history an edit entering at step i takes: (x_0 of step i - 1, of i - 2),
        [2, c, h, w] (None: the sampler reads none)."""
        if self.x0 is None:
            return None
        k = i - self.window_start + 2  # x0[k] is step i's
        return np.ascontiguousarray(self.x0[[k - 1, k - 2]])

    def windowed(self, window_start: int) -> "BaseState":
        """This generated state (window 0) kept from ``window_start`` on."""
        x0 = None
        if self.x0 is not None:  # x0 holds steps -2.. here
            x0 = self.x0[window_start:]
        return dataclasses.replace(self, window_start=window_start, latents=self.latents[window_start:],
                                   uncond_out=None if self.uncond_out is None else self.uncond_out[window_start:], x0=x0)  # fmt: skip

    def correction(self, i: int) -> Optional[np.ndarray]:
        """d_i, added after step i (None: a generated base needs none)."""
        return None if self.corrections is None else self.corrections[i - self.window_start]

    @property
    def final_latent(self) -> np.ndarray:
        return self.latents[-1][None]

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for a in (self.uncond_out, self.corrections, self.source, self.x0) if a is not None)
        return self.latents.nbytes + self.cond_kv.nbytes + self.uncond_kv.nbytes + extra
