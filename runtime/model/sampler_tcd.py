"""TCD, trajectory consistency distillation's strategic stochastic sampler: timesteps, alphas and
the step graph's coefficients, in numpy.

Zheng et al. 2024, "Trajectory Consistency Distillation" (https://arxiv.org/abs/2402.19159),
Algorithm 4 (strategic stochastic sampling, gamma). It matches diffusers 0.42.1's
``schedulers/scheduling_tcd.py`` (``TCDScheduler``) with ``eta`` = gamma = 0.3, its ``step()``'s
default and the value the TCD authors recommend (StableDiffusionPipeline passes its own ``eta``,
0.0 unless given: run it with ``eta=0.3`` to compare).

1. Timesteps: LCM's (``sampler_lcm.consistency_timesteps``).
2. Step i at t, next timestep t' (0 after the last), s = floor((1 - gamma) t'):
   the trajectory's point at s from the prediction (eq. 14),

       x_s = sqrt(abar_s) x0 + sqrt(1 - abar_s) eps

   then forward to t' with fresh noise z (eq. 15): x' = sqrt(abar_t' / abar_s) x_s
   + sqrt(1 - abar_t' / abar_s) z; the last step (or gamma 0) returns x_s itself.

In the step graph's update: c_x0 = A sqrt(abar_s), c_eps = A sqrt(1 - abar_s), c_noise = B with
A = sqrt(abar_t' / abar_s), B = sqrt(1 - abar_t' / abar_s) (the last step: A = 1, B = 0); no
clipping (TCDScheduler.step clips nothing). The noise is Euler a's ``ancestral_noise(seed, step)``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .sampler_lcm import LCM_DEFAULTS, consistency_timesteps
from .step_coefs import COEFS, COL, Schedule, finish
from .training_chain import alphas_cumprod

TCD_DEFAULTS = dict(LCM_DEFAULTS)  # TCDScheduler.__init__'s signature is LCMScheduler's
TCD_GAMMA = 0.3  # TCDScheduler.step's default eta


class TCDSchedule(Schedule):
    """TCD's n-step chain (``TCDScheduler``) at ``gamma``; ``ancestral``: noise after every step but the last."""

    def __init__(self, config: Mapping[str, Any], num_inference_steps: int, *, gamma: float = TCD_GAMMA,
                 name: str = "tcd"):  # fmt: skip
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma {gamma} must lie in [0, 1]")
        c, n = config, num_inference_steps
        timesteps = consistency_timesteps(c, n)
        self.name, self.num_inference_steps, self.history, self.init_sigma = name, n, 0, 1.0
        self.gamma = gamma
        self.ancestral = n > 1 and gamma > 0
        ac = alphas_cumprod(c)
        self.timesteps = timesteps.astype(np.float32)
        self.alpha_t = ac[timesteps]
        nxt = np.concatenate([timesteps[1:], [0]])
        # s = floor((1 - gamma) t'), in float32 as torch computes it from a long tensor
        s = np.floor(np.float32(1.0 - gamma) * nxt.astype(np.float32)).astype(np.int64)
        a_prev, a_s = ac[nxt], ac[s]
        coefs = np.zeros((n, len(COEFS)))
        alpha_prev = np.empty(n)
        for i in range(n):
            last = i == n - 1 or gamma == 0
            # the ratio in float32, as diffusers forms it before its square roots
            ratio = float(np.float32(a_prev[i]) / np.float32(a_s[i]))
            a, b = (1.0, 0.0) if last else (math.sqrt(ratio), math.sqrt(max(1.0 - ratio, 0.0)))
            coefs[i, COL["x0"]] = a * math.sqrt(float(a_s[i]))
            coefs[i, COL["eps"]] = a * math.sqrt(1.0 - float(a_s[i]))
            coefs[i, COL["noise"]] = b
            alpha_prev[i] = a_s[i] if last else a_prev[i]
        coefs[:, COL["clip"]] = math.inf
        self.alpha_prev = alpha_prev.astype(np.float32)
        self.coefs = finish(coefs)
