"""The step graph's sampler update, as every sampler hands it: ``COEFS`` and ``Schedule``.

Every deterministic solver edit-rt runs is linear in the current VP latent and the last x0
predictions, so the ``unet_step`` graph (export/compile/graphs.py) runs them all with one generic
update, per row,

    next = c_x * x + c_x0 * clamp(x0, -clip, clip) + c_eps * eps + c_h0 * h0 + c_h1 * h1 + c_noise * noise

with the coefficients a per-row input (``step_coefs``, columns ``COEFS``); an ancestral sampler
adds a per-step normal latent (``noise``). Each sampler's file (scheduler_ddim.py,
sampler_euler.py, ...) fills a :class:`Schedule`: its timesteps, alphas and these coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The columns of ``Schedule.coefs``, in the order the step graph reads them.
COEFS = ("x", "x0", "eps", "h0", "h1", "noise", "clip")
COL = {name: i for i, name in enumerate(COEFS)}


@dataclass(eq=False)
class Schedule:
    """A T-step sampler chain as the step graph runs it; row i maps VP latent x_i to x_{i+1}.

    ``timesteps[i]`` is what the UNet takes at step i, ``alpha_t[i]`` the alpha-bar of x_i (the
    graph converts the prediction to x0 and eps with it), ``alpha_prev[i]`` that of x_{i+1} (1.0
    where the final sigma is 0), ``coefs[i]`` the update's coefficients (columns ``COEFS``).
    x_0 = ``init_sigma`` * standard normal noise; ``ancestral``: the update reads a fresh normal
    latent per step; ``history``: how many past x0 predictions (h0, h1) it reads.
    """

    name: str
    num_inference_steps: int
    timesteps: np.ndarray
    alpha_t: np.ndarray
    alpha_prev: np.ndarray
    coefs: np.ndarray
    init_sigma: float = 1.0
    ancestral: bool = False
    history: int = 0


def finish(coefs: np.ndarray) -> np.ndarray:
    """A sampler's coefficients (computed in float64) as the step graph takes them: float32,
    one column per ``COEFS``."""
    out = np.asarray(coefs, dtype=np.float64).astype(np.float32)
    if out.ndim != 2 or out.shape[1] != len(COEFS):
        raise ValueError(f"coefficients of shape {out.shape}: the step graph takes [steps, {len(COEFS)}] ({', '.join(COEFS)})")
    return out
