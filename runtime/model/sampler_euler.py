"""Euler and Euler ancestral: timesteps, alphas and the step graph's coefficients, in numpy.

Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models"
(https://arxiv.org/abs/2206.00364), Algorithm 2 with S_churn = 0 (deterministic Euler), and its
ancestral variant (k-diffusion's ``sample_euler_ancestral``: Ho et al. 2020's posterior noise
split into sigma_down, sigma_up). They match diffusers 0.42.1's
``schedulers/scheduling_euler_discrete.py`` (``EulerDiscreteScheduler``, s_churn 0) and
``scheduling_euler_ancestral_discrete.py`` (``EulerAncestralDiscreteScheduler``).

diffusers runs them on the VE latent x_sigma = x * sqrt(sigma^2 + 1), x the VP latent the UNet
takes (``scale_model_input``); the step graph runs on x. With d = (x_sigma - x0) / sigma (= eps,
whatever the prediction type) and sigma' the next sigma:

    (E1) Euler:    x_sigma' = x_sigma + (sigma' - sigma) d
    (E2) Euler a:  sigma_up = sqrt(sigma'^2 (sigma^2 - sigma'^2) / sigma^2),
                   sigma_down = sqrt(sigma'^2 - sigma_up^2),
                   x_sigma' = x_sigma + (sigma_down - sigma) d + sigma_up * noise
    (E3) VP:       x' = x_sigma' / sqrt(sigma'^2 + 1), so
                   c_x = sqrt(sigma^2 + 1) / sqrt(sigma'^2 + 1),
                   c_eps = (sigma_down - sigma) / sqrt(sigma'^2 + 1)  (sigma_down = sigma' for E1),
                   c_noise = sigma_up / sqrt(sigma'^2 + 1).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .sampler_sigmas import (check_first_timestep, check_steps, karras_bounds, karras_sigmas, sigma_to_t,
                             spaced_timesteps, sqrt1p, train_sigmas, vp_alpha)  # fmt: skip
from .step_coefs import COEFS, COL, Schedule, finish
from .training_chain import alphas_cumprod

# EulerDiscreteScheduler.__init__'s signature (diffusers 0.42.1)
EULER_DEFAULTS = dict(
    num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", trained_betas=None,
    prediction_type="epsilon", interpolation_type="linear", use_karras_sigmas=False, use_exponential_sigmas=False,
    use_beta_sigmas=False, sigma_min=None, sigma_max=None, timestep_spacing="linspace", timestep_type="discrete",
    steps_offset=0, rescale_betas_zero_snr=False, final_sigmas_type="zero",
)  # fmt: skip
# EulerAncestralDiscreteScheduler.__init__'s signature
EULER_A_DEFAULTS = dict(
    num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", trained_betas=None,
    prediction_type="epsilon", timestep_spacing="linspace", steps_offset=0, rescale_betas_zero_snr=False,
)  # fmt: skip


class EulerSchedule(Schedule):
    """Euler (``ancestral=False``, ``EulerDiscreteScheduler``) or Euler a (``ancestral=True``).

    ``config``: ``read_config(EULER_DEFAULTS or EULER_A_DEFAULTS, ...)``'s dict, already checked
    (``samplers.check_sampler``) for options edit-rt does not run.
    """

    def __init__(self, config: Mapping[str, Any], num_inference_steps: int, *, ancestral: bool = False,
                 name: str = "euler"):  # fmt: skip
        c = config
        n, n_train = num_inference_steps, int(c["num_train_timesteps"])
        check_steps(n, n_train)
        karras = bool(c.get("use_karras_sigmas")) and not ancestral
        self.name, self.num_inference_steps, self.ancestral, self.history = name, n, ancestral, 0
        # -- set_timesteps() --
        # 1. the training chain and its sigmas
        ac = alphas_cumprod(c)
        sig_train = train_sigmas(ac)
        log_sigmas = np.log(sig_train)
        # 2. timesteps per spacing, their sigmas by linear interpolation over t
        timesteps = spaced_timesteps(c["timestep_spacing"], n, n_train, int(c["steps_offset"]), plus_one=False)
        sigmas = np.interp(timesteps, np.arange(0, len(sig_train)), sig_train)
        # 3. Karras sigmas (eq. 5) between this schedule's own ends; timesteps by log-sigma
        if karras:
            lo, hi = karras_bounds(c, sigmas)
            sigmas = karras_sigmas(lo, hi, n)
            timesteps = sigma_to_t(sigmas, log_sigmas)
        # 4. the final sigma: 0, or the training chain's smallest
        final = c.get("final_sigmas_type", "zero")
        if final == "sigma_min":
            last = float(((1 - ac[0]) / ac[0]) ** np.float32(0.5))
        elif final == "zero":
            last = 0.0
        else:
            raise ValueError(f"final_sigmas_type {final!r} is not one of 'zero', 'sigma_min'")
        sigmas = np.concatenate([sigmas, [last]]).astype(np.float32)
        self.sigmas = sigmas
        if c.get("timestep_type", "discrete") == "continuous" and c["prediction_type"] == "v_prediction":
            self.timesteps = (np.log(sigmas[:-1]) * np.float32(0.25)).astype(np.float32)
        else:
            self.timesteps = timesteps.astype(np.float32)
        check_first_timestep(self.timesteps, n)
        # init_noise_sigma: sigma_max (linspace, trailing) or sqrt(sigma_max^2 + 1) (leading)
        smax = np.float32(sigmas.max())
        init_noise_sigma = float(smax) if c["timestep_spacing"] in ("linspace", "trailing") else \
            float((smax**2 + np.float32(1)) ** np.float32(0.5))  # fmt: skip
        self.init_sigma = init_noise_sigma / float(sqrt1p(sigmas[0]))
        # -- per-step coefficients --
        s, s_next = sigmas[:-1].astype(np.float64), sigmas[1:].astype(np.float64)
        self.alpha_t = vp_alpha(s).astype(np.float32)
        self.alpha_prev = vp_alpha(s_next).astype(np.float32)
        if ancestral:
            # (E2) the ancestral split of the step to sigma'
            up = np.sqrt(s_next**2 * (s**2 - s_next**2) / s**2)
            down = np.sqrt(np.maximum(s_next**2 - up**2, 0.0))
        else:
            up, down = np.zeros_like(s), s_next
        coefs = np.zeros((n, len(COEFS)))
        # (E3) in VP space
        coefs[:, COL["x"]] = sqrt1p(s) / sqrt1p(s_next)
        coefs[:, COL["eps"]] = (down - s) / sqrt1p(s_next)
        coefs[:, COL["noise"]] = up / sqrt1p(s_next)
        coefs[:, COL["clip"]] = math.inf
        self.coefs = finish(coefs)
