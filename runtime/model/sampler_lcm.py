"""LCM, the latent consistency model's multistep sampler: timesteps, alphas and the step graph's
coefficients, in numpy.

Luo et al. 2023, "Latent Consistency Models" (https://arxiv.org/abs/2310.04378), Algorithm 3
(multistep latent consistency sampling) with the consistency model's boundary condition (Song et
al. 2023, "Consistency Models", https://arxiv.org/abs/2303.01469, eq. 7 and appendix C). It
matches diffusers 0.42.1's ``schedulers/scheduling_lcm.py`` (``LCMScheduler``), which is also
what an LCM-LoRA runs with.

1. Timesteps: the distillation schedule of ``original_inference_steps`` (k = T_train // that)
   steps, t_j = j k - 1, from which n are taken at evenly spaced indices from the noisiest:
   ``timestep_spacing`` and ``steps_offset`` play no part.
2. The boundary condition at t, with sigma_data = 0.5 and t scaled by ``timestep_scaling``:

       c_skip = sigma_data^2 / ((t s)^2 + sigma_data^2),   c_out = t s / sqrt((t s)^2 + sigma_data^2)
       denoised = c_out x0 + c_skip x                      (x0 clipped where clip_sample says so)

3. Step i re-noises the denoised latent to the next timestep t' with fresh noise z:

       x' = sqrt(abar_t') denoised + sqrt(1 - abar_t') z

   and the last step returns ``denoised`` itself (what LatentConsistencyModelPipeline decodes).

In the step graph's update: c_x = sqrt(abar_t') c_skip, c_x0 = sqrt(abar_t') c_out,
c_noise = sqrt(1 - abar_t') (the last step: c_x = c_skip, c_x0 = c_out, c_noise = 0). The noise
is the ancestral noise of Euler a (``ancestral_noise(seed, step)``), so an identity edit of an
LCM base adds the same noise its base did.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .step_coefs import COEFS, COL, Schedule, finish
from .training_chain import alphas_cumprod

# LCMScheduler.__init__'s signature (diffusers 0.42.1); TCDScheduler's is the same
LCM_DEFAULTS = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", trained_betas=None,
    original_inference_steps=50, clip_sample=False, clip_sample_range=1.0, set_alpha_to_one=True, steps_offset=0,
    prediction_type="epsilon", thresholding=False, dynamic_thresholding_ratio=0.995, sample_max_value=1.0,
    timestep_spacing="leading", timestep_scaling=10.0, rescale_betas_zero_snr=False,
)  # fmt: skip
SIGMA_DATA = 0.5  # LCMScheduler.get_scalings_for_boundary_condition_discrete's


def consistency_timesteps(c: Mapping[str, Any], n: int) -> np.ndarray:
    """1. The n inference timesteps of LCM (and TCD: the same rule), int64, noisiest first."""
    n_train, original = int(c["num_train_timesteps"]), int(c["original_inference_steps"])
    if original > n_train:
        raise ValueError(f"original_inference_steps {original} is more than num_train_timesteps {n_train}")
    if not 1 <= n <= original:
        raise ValueError(f"steps={n} must lie in [1, {original}]: a consistency model's steps are taken from its "
                         f"{original}-step distillation schedule (original_inference_steps)")  # fmt: skip
    k = n_train // original
    origin = (np.arange(1, original + 1) * k - 1)[::-1]
    index = np.floor(np.linspace(0, len(origin), num=n, endpoint=False)).astype(np.int64)
    return origin[index].astype(np.int64)


def boundary_scalings(t: float, timestep_scaling: float) -> tuple[float, float]:
    """2. (c_skip, c_out) at timestep t, float32 as diffusers computes them from a long tensor."""
    f = np.float32
    scaled = f(t) * f(timestep_scaling)
    c_skip = f(SIGMA_DATA**2) / (scaled * scaled + f(SIGMA_DATA**2))
    c_out = scaled / np.sqrt(scaled * scaled + f(SIGMA_DATA**2))
    return float(c_skip), float(c_out)


class LCMSchedule(Schedule):
    """LCM's n-step chain (``LCMScheduler``); ``ancestral``: fresh noise after every step but the last.

    ``config``: ``read_config(LCM_DEFAULTS, ...)``'s dict, already checked (``samplers.check_sampler``).
    """

    def __init__(self, config: Mapping[str, Any], num_inference_steps: int, *, name: str = "lcm"):
        c, n = config, num_inference_steps
        timesteps = consistency_timesteps(c, n)
        self.name, self.num_inference_steps, self.history, self.init_sigma = name, n, 0, 1.0
        self.ancestral = n > 1
        ac = alphas_cumprod(c)
        self.timesteps = timesteps.astype(np.float32)  # integers, as float32
        self.alpha_t = ac[timesteps]
        # x_{i+1}'s alpha-bar: the next timestep's; the last step's output is denoised (clean)
        nxt = ac[timesteps[1:]].astype(np.float64)
        self.alpha_prev = np.concatenate([nxt, [1.0]]).astype(np.float32)
        coefs = np.zeros((n, len(COEFS)))
        for i, t in enumerate(timesteps):
            c_skip, c_out = boundary_scalings(float(t), float(c["timestep_scaling"]))
            if i < n - 1:  # 3. re-noised to the next timestep
                a = float(nxt[i])
                coefs[i, COL["x"]] = math.sqrt(a) * c_skip
                coefs[i, COL["x0"]] = math.sqrt(a) * c_out
                coefs[i, COL["noise"]] = math.sqrt(1.0 - a)
            else:  # the last: denoised
                coefs[i, COL["x"]] = c_skip
                coefs[i, COL["x0"]] = c_out
        coefs[:, COL["clip"]] = float(c["clip_sample_range"]) if c["clip_sample"] else math.inf
        self.coefs = finish(coefs)
