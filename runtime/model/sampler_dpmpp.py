"""DPM-Solver++(2M): timesteps, alphas and the step graph's coefficients, in numpy.

Lu et al. 2022, "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion Probabilistic
Models" (https://arxiv.org/abs/2211.01095): the data-prediction multistep solver, order 2. It
matches diffusers 0.42.1's ``schedulers/scheduling_dpmsolver_multistep.py``
(``DPMSolverMultistepScheduler``, algorithm_type "dpmsolver++", solver_order 2, solver_type
"midpoint" or "heun", lower_order_final, euler_at_final, final_sigmas_type, Karras sigmas).

With alpha_s = 1 / sqrt(sigma^2 + 1), sigma_s = sigma alpha_s (the VP latent's signal and noise
scales; x is the VP latent, as diffusers' DPM-Solver runs on it), lambda = log(alpha / sigma),
h = lambda_t - lambda_s0, h_0 = lambda_s0 - lambda_s1, r0 = h_0 / h, and x0, h0 the data
predictions at s0 (this step) and s1 (the previous one):

    (D1) first order (eq. 5; DDIM):   x_t = (sigma_t / sigma_s0) x - alpha_t (e^-h - 1) x0
    (D2) 2M, midpoint (Algorithm 2):  x_t = (sigma_t / sigma_s0) x - alpha_t (e^-h - 1) D0
                                            - 0.5 alpha_t (e^-h - 1) D1
    (D3) 2M, heun (diffusers' variant): x_t = (sigma_t / sigma_s0) x - alpha_t (e^-h - 1) D0
                                            + alpha_t ((e^-h - 1) / h + 1) D1
         with D0 = x0, D1 = (x0 - h0) / r0.

(D1) runs at the first step (no history yet) and at the last where lower_order_final (with fewer
than 15 steps), euler_at_final or a final sigma of 0 asks it; at sigma_t = 0, lambda_t = inf and
(D1) is x_t = x0.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .sampler_sigmas import (check_first_timestep, check_steps, karras_bounds, karras_sigmas, sigma_to_t,
                             spaced_timesteps, train_sigmas, vp_alpha)  # fmt: skip
from .step_coefs import COEFS, COL, Schedule, finish
from .training_chain import alphas_cumprod

# DPMSolverMultistepScheduler.__init__'s signature (diffusers 0.42.1)
DPM_DEFAULTS = dict(
    num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", trained_betas=None,
    solver_order=2, prediction_type="epsilon", thresholding=False, dynamic_thresholding_ratio=0.995,
    sample_max_value=1.0, algorithm_type="dpmsolver++", solver_type="midpoint", lower_order_final=True,
    euler_at_final=False, use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False,
    use_lu_lambdas=False, use_flow_sigmas=False, flow_shift=1.0, final_sigmas_type="zero",
    lambda_min_clipped=-float("inf"), variance_type=None, timestep_spacing="linspace", steps_offset=0,
    rescale_betas_zero_snr=False, use_dynamic_shifting=False, time_shift_type="exponential",
)  # fmt: skip


def alpha_sigma_lambda(sigmas: np.ndarray):
    """alpha_t = 1 / sqrt(sigma^2 + 1), sigma_t = sigma alpha_t, lambda_t = log alpha_t - log sigma_t
    (float64; lambda = inf at sigma 0, as torch.log(0) = -inf gives)."""
    s = np.asarray(sigmas, dtype=np.float64)
    alpha = 1.0 / np.sqrt(s * s + 1.0)
    sig = s * alpha
    with np.errstate(divide="ignore"):
        lam = np.log(alpha) - np.log(sig)
    return alpha, sig, lam


def multistep_sigmas(c: Mapping[str, Any], n: int, *, last_timestep: int, unipc: bool):
    """set_timesteps() of the multistep classes (DPM-Solver, UniPC): (timesteps int64, sigmas f32).

    ``unipc``: UniPC's variant, which rounds Karras timesteps for every beta schedule and ends a
    Karras schedule at its own smallest sigma where final_sigmas_type is "sigma_min" (DPM-Solver:
    at the training chain's).
    """
    n_train = int(c["num_train_timesteps"])
    # 1. the training chain
    ac = alphas_cumprod(c)
    sig_train = train_sigmas(ac)
    log_sigmas = np.log(sig_train)
    # 2. timesteps: n + 1 points spaced, the last (t = 0) dropped
    timesteps = spaced_timesteps(c["timestep_spacing"], n, n_train, int(c["steps_offset"]), plus_one=True,
                                 last=last_timestep)  # fmt: skip
    final = c["final_sigmas_type"]
    if final not in ("zero", "sigma_min"):
        raise ValueError(f"final_sigmas_type {final!r} is not one of 'zero', 'sigma_min'")
    if c["use_karras_sigmas"]:
        # 3. Karras sigmas (Karras et al. 2022, eq. 5) over the whole training range; timesteps
        # by log-sigma interpolation, rounded (not for squaredcos_cap_v2, DPM-Solver only)
        full = np.flip(sig_train).copy()
        lo, hi = karras_bounds(c, full)
        sigmas = karras_sigmas(lo, hi, n)
        timesteps = sigma_to_t(sigmas, log_sigmas)
        if unipc or c["beta_schedule"] != "squaredcos_cap_v2":
            timesteps = timesteps.round()
        karras_last = sigmas[-1]
    else:
        sigmas = np.interp(timesteps, np.arange(0, len(sig_train)), sig_train)
        karras_last = None
    # 4. the final sigma
    if final == "zero":
        last = 0.0
    elif unipc and karras_last is not None:
        last = karras_last
    else:
        last = float(((1 - ac[0]) / ac[0]) ** np.float32(0.5))
    sigmas = np.concatenate([sigmas, [last]]).astype(np.float32)
    timesteps = timesteps.astype(np.int64)
    check_first_timestep(timesteps, n)
    return timesteps, sigmas


def last_timestep(c: Mapping[str, Any]) -> int:
    """DPM-Solver's ``lambda_min_clipped``: the timesteps stop where lambda_t falls below it."""
    n_train = int(c["num_train_timesteps"])
    lmc = float(c["lambda_min_clipped"])
    if lmc == -math.inf:
        return n_train
    ac = alphas_cumprod(c)
    lam = np.log(np.sqrt(ac)) - np.log(np.sqrt(np.float32(1) - ac))
    return n_train - int(np.searchsorted(np.flip(lam), np.float32(lmc), side="left"))


class DPMSolverPPSchedule(Schedule):
    """DPM-Solver++(2M) (``DPMSolverMultistepScheduler``, dpmsolver++, order 2); ``history`` 1.

    ``config``: ``read_config(DPM_DEFAULTS, ..., algorithm_type="dpmsolver++", solver_order=2)``'s
    dict, already checked (``samplers.check_sampler``) for options edit-rt does not run.
    """

    def __init__(self, config: Mapping[str, Any], num_inference_steps: int, *, name: str = "dpmpp_2m"):
        c = config
        n = num_inference_steps
        check_steps(n, int(c["num_train_timesteps"]))
        # -- set_timesteps() --
        timesteps, sigmas = multistep_sigmas(c, n, last_timestep=last_timestep(c), unipc=False)
        n = len(timesteps)
        self.name, self.num_inference_steps, self.ancestral, self.history, self.init_sigma = name, n, False, 1, 1.0
        self.timesteps, self.sigmas = timesteps.astype(np.float32), sigmas  # integers, as float32
        self.alpha_t = vp_alpha(sigmas[:-1]).astype(np.float32)
        self.alpha_prev = vp_alpha(sigmas[1:]).astype(np.float32)
        # -- per-step coefficients --
        alpha, sig, lam = alpha_sigma_lambda(sigmas)
        heun = c["solver_type"] == "heun"
        coefs = np.zeros((n, len(COEFS)))
        coefs[:, COL["clip"]] = math.inf
        for i in range(n):
            final = i == n - 1 and (c["euler_at_final"] or (c["lower_order_final"] and n < 15)
                                    or c["final_sigmas_type"] == "zero")  # fmt: skip
            if sig[i + 1] == 0:
                # sigma_t = 0: lambda_t = inf, e^-h = 0
                ratio, em1 = 0.0, -1.0
                h = math.inf
            else:
                h = lam[i + 1] - lam[i]
                ratio, em1 = sig[i + 1] / sig[i], math.exp(-h) - 1.0
            a = alpha[i + 1] * em1  # alpha_t (e^-h - 1)
            coefs[i, COL["x"]] = ratio
            if i == 0 or final:
                coefs[i, COL["x0"]] = -a  # (D1)
                continue
            r0 = (lam[i] - lam[i - 1]) / h
            if heun:  # (D3)
                b = alpha[i + 1] * (em1 / h + 1.0)
                coefs[i, COL["x0"]] = -a + b / r0
                coefs[i, COL["h0"]] = -b / r0
            else:  # (D2)
                coefs[i, COL["x0"]] = -a - 0.5 * a / r0
                coefs[i, COL["h0"]] = 0.5 * a / r0
        self.coefs = finish(coefs)
