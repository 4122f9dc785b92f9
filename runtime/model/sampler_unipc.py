"""UniPC (bh2, data prediction, order 2, with its corrector): timesteps, alphas, coefficients.

Zhao et al. 2023, "UniPC: A Unified Predictor-Corrector Framework for Fast Sampling of Diffusion
Models" (https://arxiv.org/abs/2302.04867): the UniP-2 predictor (Algorithm 1) and the UniC
corrector (Algorithm 2) with B(h) = e^h - 1 ("bh2"), in the data-prediction form. It matches
diffusers 0.42.1's ``schedulers/scheduling_unipc_multistep.py`` (``UniPCMultistepScheduler``,
solver_type "bh2", predict_x0, solver_order 2, disable_corrector [], lower_order_final,
final_sigmas_type, Karras sigmas); computed in float64, cast to float32 at the end.

Notation: step j takes the (uncorrected) VP latent x_j at sigma_j to x_{j+1}; alpha_j =
1 / sqrt(sigma_j^2 + 1), s_j = sigma_j alpha_j, lambda_j = log(alpha_j / s_j); m_j the x0 the
model predicts at x_j (diffusers converts the model output with the uncorrected x_j, as the
graph does). For the interval k -> k+1: h = lambda_{k+1} - lambda_k, hh = -h,
phi = expm1(hh) (h phi_1), B = expm1(hh) (bh2), rk = (lambda_{k-1} - lambda_k) / h.

    (U1) predictor of order p at step k, from the corrected x^c_k:
         x_{k+1} = (s_{k+1}/s_k) x^c_k - alpha_{k+1} phi m_k - alpha_{k+1} B P_k,
         P_k = 0 (p = 1), 0.5 (m_{k-1} - m_k) / rk (p = 2: rhos_p = 0.5)
    (U2) corrector at step j (j >= 1) of the order q that step j-1's predictor used, on the same
         interval j-1 -> j (same h, phi, B, rk), from x^c_{j-1} (diffusers' ``last_sample``):
         x^c_j = (s_j/s_{j-1}) x^c_{j-1} - alpha_j phi m_{j-1}
                 - alpha_j B (rc_0 (m_{j-2} - m_{j-1}) / rk [q = 2] + rc_last (m_j - m_{j-1}))
         rhos_c = [0.5] (q = 1), else the solution of R rc = b with R = [[1, 1], [rk, 1]],
         b_i = i! h_phi_i / B, h_phi_1 = phi / hh - 1, h_phi_{i+1} = h_phi_i / hh - 1 / (i+1)!
    (U3) (U1) at k = j-1 and (U2) share their first two terms, so
         x^c_j = x_j + delta_j,  delta_j = -alpha_j B ((rc_0 - 0.5) (m_{j-2} - m_{j-1}) / rk [q = 2]
                                                     + rc_last (m_j - m_{j-1})):
         the corrected latent is the graph's x_j plus a combination of m_j, m_{j-1}, m_{j-2}.
    (U4) one graph step = (U2) at j, then (U1) at j: with R_j = s_{j+1}/s_j,
         next = R_j x_j + (R_j d0 + p0) m_j + (R_j d1 + p1) m_{j-1} + R_j d2 m_{j-2},
         delta_j = d0 m_j + d1 m_{j-1} + d2 m_{j-2} and (U1)'s p0 m_j + p1 m_{j-1}:
         c_x = R_j, c_x0 = R_j d0 + p0, c_h0 = R_j d1 + p1, c_h1 = R_j d2 (history 2).

Orders as diffusers': step 0 runs no corrector and a first-order predictor (warm-up); the
predictor's order is min(2, T - j) with lower_order_final (first order at the last step), else 2;
the corrector at j takes step j-1's order. The final step to sigma = 0 has lambda = inf,
expm1(-inf) = -1 (phi = B = -1), s_T / s_{T-1} = 0, so x_T = m_{T-1}; with lower_order_final
off it would divide by rk = 0 (diffusers returns inf/nan there; ``samplers`` refuses it).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .sampler_dpmpp import alpha_sigma_lambda, multistep_sigmas
from .sampler_sigmas import check_steps, vp_alpha
from .step_coefs import COEFS, COL, Schedule, finish

# UniPCMultistepScheduler.__init__'s signature (diffusers 0.42.1)
UNIPC_DEFAULTS = dict(
    num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", trained_betas=None,
    solver_order=2, prediction_type="epsilon", thresholding=False, dynamic_thresholding_ratio=0.995,
    sample_max_value=1.0, predict_x0=True, solver_type="bh2", lower_order_final=True, disable_corrector=[],
    solver_p=None, use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False,
    use_flow_sigmas=False, flow_shift=1.0, timestep_spacing="linspace", steps_offset=0, final_sigmas_type="zero",
    rescale_betas_zero_snr=False, use_dynamic_shifting=False, time_shift_type="exponential", sigma_min=None,
    sigma_max=None, shift_terminal=None,
)  # fmt: skip


def _interval(lam: np.ndarray, k: int):
    """h, phi = expm1(-h), B = expm1(-h) of the interval k -> k+1 (lambda_{k+1} = inf: -1, -1)."""
    h = lam[k + 1] - lam[k]
    hh = -h
    phi = math.expm1(hh) if math.isfinite(hh) else -1.0
    return h, hh, phi, phi


def _rhos_c(q: int, rk: float, hh: float, phi: float, B: float) -> np.ndarray:
    """(U2) the corrector's rhos: [0.5] at order 1, else R^-1 b (diffusers' loop, ported)."""
    if q == 1:
        return np.array([0.5])
    rks = np.array([rk, 1.0])
    R, b = [], []
    h_phi_k = phi / hh - 1.0
    factorial_i = 1
    for i in range(1, q + 1):
        R.append(rks ** (i - 1))
        b.append(h_phi_k * factorial_i / B)
        factorial_i *= i + 1
        h_phi_k = h_phi_k / hh - 1.0 / factorial_i
    return np.linalg.solve(np.stack(R), np.array(b))


class UniPCSchedule(Schedule):
    """UniPC bh2, order 2, corrector on (``UniPCMultistepScheduler``); ``history`` 2.

    ``config``: ``read_config(UNIPC_DEFAULTS, ..., solver_type="bh2", predict_x0=True,
    solver_order=2, disable_corrector=[])``'s dict, already checked (``samplers.check_sampler``).
    """

    def __init__(self, config: Mapping[str, Any], num_inference_steps: int, *, name: str = "unipc"):
        c = config
        n = num_inference_steps
        check_steps(n, int(c["num_train_timesteps"]))
        # -- set_timesteps() --
        timesteps, sigmas = multistep_sigmas(c, n, last_timestep=int(c["num_train_timesteps"]), unipc=True)
        n = len(timesteps)
        self.name, self.num_inference_steps, self.ancestral, self.history, self.init_sigma = name, n, False, 2, 1.0
        self.timesteps, self.sigmas = timesteps.astype(np.float32), sigmas  # integers, as float32
        self.alpha_t = vp_alpha(sigmas[:-1]).astype(np.float32)
        self.alpha_prev = vp_alpha(sigmas[1:]).astype(np.float32)
        # -- per-step coefficients --
        alpha, sig, lam = alpha_sigma_lambda(sigmas)
        # the predictor's order per step: warm-up, then 2, lower at the end with lower_order_final
        order = [min(min(2, n - j) if c["lower_order_final"] else 2, j + 1) for j in range(n)]
        coefs = np.zeros((n, len(COEFS)))
        coefs[:, COL["clip"]] = math.inf
        for j in range(n):
            R = 0.0 if sig[j + 1] == 0 else sig[j + 1] / sig[j]
            # (U3) the corrector's delta_j = d0 m_j + d1 m_{j-1} + d2 m_{j-2}
            d0 = d1 = d2 = 0.0
            if j >= 1:
                q = order[j - 1]
                h, hh, phi, B = _interval(lam, j - 1)
                rk = (lam[j - 2] - lam[j - 1]) / h if q == 2 else 1.0
                rc = _rhos_c(q, rk, hh, phi, B)
                k = alpha[j] * B
                d0, d1 = -k * rc[-1], k * rc[-1]
                if q == 2:
                    d1 += k * (rc[0] - 0.5) / rk
                    d2 = -k * (rc[0] - 0.5) / rk
            # (U1) the predictor j -> j+1 from x^c_j: p0 m_j + p1 m_{j-1}
            h, hh, phi, B = _interval(lam, j)
            p0, p1 = -alpha[j + 1] * phi, 0.0
            if order[j] == 2:
                rk = (lam[j - 1] - lam[j]) / h
                p0 += alpha[j + 1] * B * 0.5 / rk
                p1 = -alpha[j + 1] * B * 0.5 / rk
            # (U4)
            coefs[j, COL["x"]] = R
            coefs[j, COL["x0"]] = R * d0 + p0
            coefs[j, COL["h0"]] = R * d1 + p1
            coefs[j, COL["h1"]] = R * d2
        self.coefs = finish(coefs)
