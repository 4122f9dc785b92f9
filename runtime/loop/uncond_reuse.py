"""An edit tail that takes its base's unconditional prediction at every step (``tail.uncond``).

A tail row re-enters its base's chain at step ``s`` and runs ``T - s`` steps, each computing a
conditional prediction (the edit's K/V) and an unconditional one (the negative prompt's). The
base computed the unconditional prediction ``u_b(i)`` at its own latent ``x_b(i)`` for every
step of the cache window and keeps it (``BaseState.uncond_out``); the edit's latent ``x_e(i)``
starts at ``x_b(s)`` and drifts from it as the edit takes effect. Three modes:

- ``compute`` (the default): the row computes ``u(x_e(i))``, as diffusers does; at its entry
  step it takes ``u_b(s)``, which is the same number (``x_e(s) = x_b(s)``);
- ``base``: ``u_b(i)`` at every step, i.e. the zeroth-order guess ``u(x_e) ~ u(x_b)``. The
  step graph skips the row's unconditional half: a tail of N such rows runs the UNet on
  N rows instead of 2N (N + 1 on an export without ``step_all_given``, where one row of a
  call computes);
- ``base-corrected``: the first-order guess ``u(x_e) ~ u_b + k (x_e - x_b)``, with ``k`` the
  Jacobian of the ideal denoiser under a unit-variance Gaussian prior on the clean latent
  (SD's latents are scaled to about unit variance by the VAE's ``scaling_factor``). With
  ``x = sqrt(a) x_0 + sqrt(1 - a) eps`` and ``x_0 ~ N(0, I)``, ``x ~ N(0, I)`` and
  ``E[x_0 | x] = sqrt(a) x``, so ``E[eps | x] = (x - a x) / sqrt(1 - a) = sqrt(1 - a) x``:
  ``k = sqrt(1 - a)`` for an epsilon prediction, ``sqrt(a)`` for a sample (x_0) prediction,
  and ``sqrt(a) sqrt(1 - a) - sqrt(1 - a) sqrt(a) = 0`` for a v prediction (``v = sqrt(a) eps
  - sqrt(1 - a) x_0``), where the mode is ``base``. The two extremes measured worse: ``k = 0``
  (``base``) and ``k = 1 / sqrt(1 - a)`` (the base's unconditional x_0 kept, i.e. ``dx_0/dx
  = 0``); docs/performance.md has the numbers. The step graph adds ``k x_e`` on the device
  (``uncond_slope``), the host gives ``u_b - k x_b``: no latent comes back to the host.

When every row of a call takes the base's prediction, none computes its own (the step graph
takes E = N, manifest ``step_all_given``). On an export without it the call's first such row
computes its own (exact for that row), as at entry steps: a lone row saves nothing there, and a
row's numbers depend on whether it was that row.

A row computes as today whenever the base's prediction is not the one it would compute: a
row with another negative prompt, guidance, adapters or seed than its base (its chain is not
the base's), a generation, an inversion, a related generation, a structure reference row. A base
generated unguided (guidance <= 1, rows.py) computed no prediction and keeps none: its edits
compute theirs. An unguided row takes none at all (zeros at scale 1, row_scheduler.py), whatever its mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..model.state import BaseState

UNCOND_MODES = ("compute", "base", "base-corrected")


def gaussian_slope(prediction_type: str, alpha: float) -> float:
    """d E[prediction | x] / d x for a unit-variance Gaussian clean latent at alpha-bar ``alpha``."""
    if prediction_type == "epsilon":
        return math.sqrt(1.0 - alpha)
    if prediction_type == "sample":
        return math.sqrt(alpha)
    if prediction_type == "v_prediction":
        return 0.0
    raise ValueError(f"prediction_type {prediction_type!r} has no slope")


@dataclass(eq=False)
class BaseUncond:
    """A row's unconditional prediction taken from its base at every step."""

    state: BaseState
    mode: str  # "base" | "base-corrected"
    prediction_type: str = "epsilon"

    def at(self, step: int, alpha: float) -> Optional[tuple[np.ndarray, float]]:
        """(what the graph's ``uncond_given`` takes, its ``uncond_slope``) at ``step``: ``u_b``
        and 0, or ``u_b - k x_b`` and k. None where the base kept no prediction."""
        u = self.state.entry_uncond(step)
        if u is None:
            return None
        if self.mode == "base":
            return u, 0.0
        k = gaussian_slope(self.prediction_type, float(alpha))
        if k == 0.0:
            return u, 0.0
        return u - np.float32(k) * self.state.latent(step)[0], k
