"""What the sigma-based samplers (Euler, Euler a, DPM++ 2M, UniPC) share, in numpy.

Each mirrors a diffusers scheduler's ``set_timesteps()`` (diffusers 0.42.1,
``schedulers/scheduling_euler_discrete.py``, ``scheduling_dpmsolver_multistep.py``,
``scheduling_unipc_multistep.py``); the pieces they share are here:

1. the training chain's sigmas, sigma = sqrt((1 - abar) / abar) of its alpha-bar (training_chain.py)
   (the variance-exploding view of a VP latent: x_sigma = x / sqrt(abar), Karras et al. 2022,
   "Elucidating the Design Space of Diffusion-Based Generative Models",
   https://arxiv.org/abs/2206.00364, sec. 2 and table 1);
2. the inference timesteps per ``timestep_spacing`` (Lin et al. 2023, "Common Diffusion Noise
   Schedules and Sample Steps are Flawed", table 2), in each class's own variant;
3. Karras sigmas (Karras et al. 2022, eq. 5, rho = 7) and ``sigma_to_t``, the timestep of a sigma
   by linear interpolation of log-sigma over the training chain;
4. ``read_config``: what ``TargetScheduler.from_config(config, **overrides)`` passes to the
   target's ``__init__``.

A VP latent x at sigma has alpha-bar 1 / (sigma^2 + 1); the step graph runs on VP latents.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np


def read_config(defaults: Mapping[str, Any], cfg: Mapping[str, Any], **overrides: Any) -> dict:
    """The keyword arguments diffusers' ``from_config(cfg, **overrides)`` gives the target class.

    ``defaults`` is the target ``__init__``'s signature. As ``ConfigMixin.extract_init_dict``:
    keys listed in ``_use_default_values`` (defaults when the config was saved) are dropped, keys
    the target does not take are ignored, the target's defaults fill the rest, overrides win.
    Keys the target does not take but the config carries stay readable as ``hidden`` (diffusers
    registers them to the config too: ``_convert_to_karras`` reads ``sigma_min`` through them).
    """
    used_defaults = set(cfg.get("_use_default_values") or ())
    given = {k: v for k, v in cfg.items() if k not in used_defaults and not k.startswith("_")}
    out = dict(defaults)
    out.update({k: v for k, v in given.items() if k in defaults})
    out.update(overrides)
    out["hidden"] = {k: v for k, v in given.items() if k not in defaults}
    return out


def train_sigmas(ac: np.ndarray) -> np.ndarray:
    """1. sigma_t = sqrt((1 - abar_t) / abar_t) for t = 0..T_train-1, float32 as diffusers'."""
    return (((np.float32(1) - ac) / ac) ** np.float32(0.5)).astype(np.float32)


def spaced_timesteps(spacing: str, n: int, n_train: int, steps_offset: int, *, plus_one: bool,
                     last: Optional[int] = None) -> np.ndarray:  # fmt: skip
    """2. Inference timesteps, float64 (callers cast as their class does).

    ``plus_one``: the multistep classes (DPM-Solver, UniPC) space n + 1 points and drop the last
    (t = 0); Euler's spaces n. ``last``: DPM-Solver's ``lambda_min_clipped`` cut (default T_train).
    """
    last = n_train if last is None else last
    if plus_one:
        if spacing == "linspace":
            return np.linspace(0, last - 1, n + 1).round()[::-1][:-1].astype(np.int64).astype(np.float64)
        if spacing == "leading":
            ratio = last // (n + 1)
            return (np.arange(0, n + 1) * ratio).round()[::-1][:-1].astype(np.int64).astype(np.float64) + steps_offset
        if spacing == "trailing":
            ratio = n_train / n
            return np.arange(last, 0, -ratio).round().astype(np.int64).astype(np.float64) - 1
    else:
        if spacing == "linspace":
            return np.linspace(0, n_train - 1, n, dtype=np.float32)[::-1].astype(np.float64)
        if spacing == "leading":
            ratio = n_train // n
            return (np.arange(0, n) * ratio).round()[::-1].astype(np.float32).astype(np.float64) + steps_offset
        if spacing == "trailing":
            ratio = n_train / n
            return np.arange(n_train, 0, -ratio).round().astype(np.float32).astype(np.float64) - 1
    raise ValueError(f"timestep_spacing {spacing!r} is not one of 'linspace', 'leading', 'trailing'")


def karras_sigmas(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
    """3. Karras et al. 2022, eq. 5: sigma_i = (smax^(1/rho) + i/(n-1) (smin^(1/rho) - smax^(1/rho)))^rho."""
    ramp = np.linspace(0, 1, n)
    min_inv_rho, max_inv_rho = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho


def karras_bounds(c: Mapping[str, Any], in_sigmas: np.ndarray) -> tuple:
    """3. (sigma_min, sigma_max) of ``_convert_to_karras``: the config's, else ``in_sigmas``' ends."""
    def get(key):
        return c[key] if key in c else c["hidden"].get(key)

    lo, hi = get("sigma_min"), get("sigma_max")
    return (float(in_sigmas[-1]) if lo is None else float(lo), float(in_sigmas[0]) if hi is None else float(hi))


def sigma_to_t(sigma: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """3. The (fractional) training timestep of each sigma: log-sigma interpolated linearly."""
    sigma = np.asarray(sigma, dtype=np.float64)
    log_sigma = np.log(np.maximum(sigma, 1e-10))
    dists = log_sigma - log_sigmas[:, np.newaxis]
    low_idx = np.cumsum((dists >= 0), axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    high_idx = low_idx + 1
    low, high = log_sigmas[low_idx], log_sigmas[high_idx]
    w = np.clip((low - log_sigma) / (low - high), 0, 1)
    return ((1 - w) * low_idx + w * high_idx).reshape(sigma.shape)


def vp_alpha(sigmas: np.ndarray) -> np.ndarray:
    """alpha-bar of a VP latent at sigma: 1 / (sigma^2 + 1) (1.0 at sigma 0), float64."""
    s = np.asarray(sigmas, dtype=np.float64)
    return 1.0 / (s * s + 1.0)


def check_steps(n: int, n_train: int) -> None:
    if not 1 <= n <= n_train:
        raise ValueError(f"steps={n} must lie in [1, {n_train}]")


def check_first_timestep(timesteps: np.ndarray, n: int) -> None:
    """diffusers finds step 0 by its timestep and takes the second match: a repeated first
    timestep would start its loop at step 1."""
    if (timesteps == timesteps[0]).sum() > 1:
        raise ValueError(f"steps={n}: this model's schedule repeats its first timestep ({timesteps[0]:g}) at "
                         f"{n} steps, where diffusers' scheduler would skip its first step")


def sqrt1p(s: np.ndarray) -> np.ndarray:
    """sqrt(sigma^2 + 1): the VP <-> VE scale, float64."""
    s = np.asarray(s, dtype=np.float64)
    return np.sqrt(s * s + 1.0)
