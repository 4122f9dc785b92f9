"""The guidance-scale embedding a full latent consistency model's UNet takes (``timestep_cond``).

An LCM distilled with guidance (Luo et al. 2023, "Latent Consistency Models",
https://arxiv.org/abs/2310.04378, sec. 4.2) takes the CFG scale w as a sinusoidal embedding added
to its time embedding (UNet ``time_cond_proj_dim``), instead of two predictions mixed: such a row
runs the conditional half only. As diffusers 0.42.1's
``LatentConsistencyModelPipeline.get_guidance_scale_embedding`` (after VDM's timestep embedding),
with the pipeline's w = guidance_scale - 1 (the Imagen CFG scale the pipeline takes, turned into
the LCM paper's), in float32:

    e = [sin(1000 w f_j), cos(1000 w f_j)],  f_j = exp(-j log(10000) / (d/2 - 1)),  j < d/2

(a zero column appended when d is odd).
"""

from __future__ import annotations

import math

import numpy as np


def guidance_embedding(guidance: float, dim: int) -> np.ndarray:
    """``[dim]`` float32: the embedding of a row at CFG scale ``guidance`` (w = guidance - 1)."""
    f = np.float32
    w = f(f(guidance) - f(1.0)) * f(1000.0)
    half = dim // 2
    step = f(math.log(10000.0)) / f(half - 1)  # torch.log of a float32 tensor, divided in float32
    # exp in float64, rounded once: torch's float32 exp agrees with that on all but a few of the
    # frequencies, numpy's float32 exp on fewer, and an ulp of a frequency moves sin(1000 w f) by
    # up to ~5e-4 at w ~ 7; so the embedding is within ~3e-5 of diffusers' (d = 256, w <= 7.5)
    freqs = np.exp((np.arange(half, dtype=np.float32) * -step).astype(np.float64)).astype(np.float32)
    args = (w * freqs).astype(np.float32)
    out = np.concatenate([np.sin(args), np.cos(args)]).astype(np.float32)
    return np.pad(out, (0, dim % 2))
