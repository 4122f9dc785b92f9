"""The training chain every sampler runs on: its betas and their alpha-bar, in numpy, float32.

DDPM (Ho et al. 2020, https://arxiv.org/abs/2006.11239) trains on the chain
q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I), abar_t = prod_{s <= t} (1 - beta_s) (eq. 4);
a scheduler config says which betas (``beta_schedule``, ``beta_start``, ``beta_end``,
``num_train_timesteps``). Every sampler (DDIM, Euler, DPM++, UniPC, LCM, TCD) reads its
alpha-bar from :func:`alphas_cumprod` here, built as diffusers' schedulers build
``self.alphas_cumprod`` (diffusers 0.42.1, ``schedulers/scheduling_ddim.py`` ``__init__``, the same
lines in every scheduler): float32 betas, ``torch.cumprod(1 - betas)``. tests/test_scheduler.py
holds it against diffusers' own.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np

from ..errors import ModelError


def trained_betas_refusal(cfg: Mapping[str, Any]) -> Optional[str]:
    """Why a scheduler config's betas cannot run here (None: they can): every sampler builds its
    betas from ``beta_schedule`` (:func:`betas`), so an explicit ``trained_betas`` list would be
    ignored, and the model sampled on a chain it was not trained on."""
    if cfg.get("trained_betas") is not None:
        return "trained_betas is not supported by edit-rt"
    return None


def _linspace_f32(start: float, end: float, n: int) -> np.ndarray:
    """``torch.linspace(start, end, n, dtype=torch.float32)`` on the CPU, to the bit.

    torch's kernel (aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp) takes a float32 step and
    walks the first half up from ``start`` and the second half down from ``end``, each term one
    fused multiply-add (its AVX2 / AVX-512 / NEON builds), rounded once; here the product is exact in float64 (24 by at most 29
    bits) and the sum rounds to float64, then float32. numpy's linspace rounds elsewhere: a
    different last bit in ~30% of SD's betas.
    """
    lo, hi = np.float32(start), np.float32(end)
    if n == 1:
        return np.array([lo], dtype=np.float32)
    step = np.float64((hi - lo) / np.float32(n - 1))
    i = np.arange(n, dtype=np.float64)
    up = np.float64(lo) + step * i
    down = np.float64(hi) - step * (n - 1 - i)
    return np.where(i < n // 2, up, down).astype(np.float32)


def betas(num_train_timesteps: int, beta_start: float, beta_end: float, beta_schedule: str) -> np.ndarray:
    """beta_t for t = 0..T_train-1, float32, by ``beta_schedule`` as diffusers builds them."""
    n = num_train_timesteps
    if beta_schedule == "linear":
        return _linspace_f32(beta_start, beta_end, n)
    if beta_schedule == "scaled_linear":
        return _linspace_f32(beta_start**0.5, beta_end**0.5, n) ** 2
    if beta_schedule == "squaredcos_cap_v2":
        # Nichol & Dhariwal 2021, eq. 17, with betas capped at 0.999 (Python floats, then float32)
        def alpha_bar(t: float) -> float:
            return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

        return np.array([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), 0.999) for i in range(n)], dtype=np.float32)
    raise ModelError(f"scheduler_config.json: beta_schedule {beta_schedule!r} is not supported")


def alphas_cumprod(config: Mapping[str, Any]) -> np.ndarray:
    """abar_t for t = 0..T_train-1 (DDPM, eq. 4) of a scheduler config's betas, float32.

    ``config`` carries ``num_train_timesteps``, ``beta_start``, ``beta_end`` and
    ``beta_schedule``. The product accumulates in float64 and rounds each entry to float32, as
    torch's CPU cumprod of float32 does (its accumulator is a double): a float32 running product
    drifts ~10 ulp from diffusers' by t = 999.
    """
    b = betas(int(config["num_train_timesteps"]), float(config["beta_start"]), float(config["beta_end"]),
              config["beta_schedule"])  # fmt: skip
    return np.cumprod((np.float32(1.0) - b).astype(np.float64)).astype(np.float32)
