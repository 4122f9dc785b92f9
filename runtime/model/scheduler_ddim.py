"""DDIM (eta = 0) timesteps and per-step coefficients, in numpy.

Song et al., "Denoising Diffusion Implicit Models" (https://arxiv.org/abs/2010.02502), eq. 12
with sigma_t = 0. The update itself is fused into the ``unet_step`` graph; this file decides,
for every step, the timestep t and the two cumulative alphas that graph takes as per-row
inputs, exactly as diffusers' ``DDIMScheduler.set_timesteps()`` does (tests/test_scheduler.py
checks them against it; the fused update is held against diffusers' pipelines themselves,
tests/test_pipeline.py and test_families.py). It matches diffusers'
``schedulers/scheduling_ddim.py`` (``DDIMScheduler``, eta 0) and ``scheduling_ddim_inverse.py``.

In the step graph's generic update (step_coefs.py) DDIM eta 0 (eq. 12) is c_x0 = sqrt(alpha_prev),
c_eps = sqrt(1 - alpha_prev), the rest 0; its alpha-bar is the training chain's
(training_chain.py), as every sampler's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, Mapping

import numpy as np

from ..errors import ModelError
from .step_coefs import COEFS, Schedule
from .training_chain import alphas_cumprod, trained_betas_refusal

PredictionType = Literal["epsilon", "v_prediction", "sample"]


def ddim_coefs(alpha_prev: np.ndarray, clip: float) -> np.ndarray:
    """DDIM eta 0 (Song et al. 2020, eq. 12): x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps.

    In float32 as ``np.sqrt(alpha_prev)`` and ``np.sqrt(1 - alpha_prev)``, so the graph's
    generic update (a sum of coefficient x term) gives eq. 12 computed directly, bit for bit.
    """
    alpha_prev = np.asarray(alpha_prev, dtype=np.float32)
    coefs = np.zeros((len(alpha_prev), len(COEFS)), dtype=np.float32)
    coefs[:, COEFS.index("x0")] = np.sqrt(alpha_prev)
    coefs[:, COEFS.index("eps")] = np.sqrt(np.float32(1) - alpha_prev)
    coefs[:, COEFS.index("clip")] = np.float32(clip)
    return coefs


@dataclass(frozen=True)
class DDIMConfig:
    """The subset of a diffusers ``scheduler_config.json`` that DDIM reads."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    set_alpha_to_one: bool = True
    steps_offset: int = 0
    prediction_type: PredictionType = "epsilon"
    timestep_spacing: str = "leading"
    clip_sample: bool = True
    clip_sample_range: float = 1.0

    @classmethod
    def from_scheduler_config(cls, cfg: Mapping[str, Any]) -> "DDIMConfig":
        """Reads a diffusers scheduler config (PNDM, DDIM, ... all share these fields).

        Stable Diffusion ships a PNDM config; the pipeline swaps in DDIM with the same
        betas, exactly as ``DDIMScheduler.from_config(pipe.scheduler.config)`` does.
        """
        why = trained_betas_refusal(cfg)
        if why is not None:
            raise ModelError(f"scheduler_config.json: {why}")
        if cfg.get("thresholding"):
            raise ModelError("scheduler_config.json: thresholding=true is not supported by edit-rt")
        if cfg.get("rescale_betas_zero_snr"):
            raise ModelError("scheduler_config.json: rescale_betas_zero_snr is not supported by edit-rt")
        fields = {k: cfg[k] for k in cls.__dataclass_fields__ if k in cfg}
        # DDIMScheduler's defaults for keys other schedulers' configs do not carry.
        return cls(**fields)


class DDIMSchedule(Schedule):
    """The T-step DDIM chain: ``timesteps[i]``, ``alpha_t[i]``, ``alpha_prev[i]`` for step i.

    Step i maps latent x_i to x_{i+1}; x_0 is the initial noise and x_T the final latent.
    ``timesteps`` stay int64 here (consumers cast); ``coefs`` are DDIM eta 0's (``ddim_coefs``).
    """

    name: ClassVar[str] = "ddim"
    init_sigma: ClassVar[float] = 1.0
    ancestral: ClassVar[bool] = False
    history: ClassVar[int] = 0

    def __init__(self, config: DDIMConfig, num_inference_steps: int):
        if not 1 <= num_inference_steps <= config.num_train_timesteps:
            raise ValueError(
                f"steps={num_inference_steps} must lie in [1, {config.num_train_timesteps}]"
            )
        self.config = config
        self.num_inference_steps = num_inference_steps
        # 1. the training chain's cumulative alphas (the alpha-bar of DDPM, eq. 4)
        self.alphas_cumprod = alphas_cumprod(asdict(config))
        self.final_alpha_cumprod = np.float32(1.0) if config.set_alpha_to_one else self.alphas_cumprod[0]
        # 2. the inference timesteps (Lin et al. 2023, table 2: linspace / leading / trailing)
        self.timesteps = self._timesteps()
        if self.timesteps.max() >= config.num_train_timesteps:
            # "leading" spacing plus steps_offset 1 (SD's config) at T_train steps reaches
            # t = T_train, past the training chain (diffusers indexes out of bounds there)
            most = next(n for n in range(num_inference_steps - 1, 0, -1)
                        if DDIMSchedule(config, n).timesteps.max() < config.num_train_timesteps)
            raise ValueError(f"steps={num_inference_steps}: this model's schedule (timestep_spacing "
                             f"{config.timestep_spacing}, steps_offset {config.steps_offset}) takes at most {most} steps")  # fmt: skip
        # 3. per-step coefficients: alpha_t at t, alpha_prev at t - T_train // T
        prev = self.timesteps - config.num_train_timesteps // num_inference_steps
        self.alpha_t = self.alphas_cumprod[self.timesteps]
        self.alpha_prev = np.where(
            prev >= 0, self.alphas_cumprod[np.clip(prev, 0, None)], self.final_alpha_cumprod
        ).astype(np.float32)
        # 4. the generic update's coefficients (eq. 12, sigma_t = 0); x0 clipped as DDIM clips it
        self.clip = float(config.clip_sample_range) if config.clip_sample else math.inf
        self.coefs = ddim_coefs(self.alpha_prev, self.clip)

    def _timesteps(self) -> np.ndarray:
        cfg, n = self.config, self.num_inference_steps
        if cfg.timestep_spacing == "linspace":
            return np.linspace(0, cfg.num_train_timesteps - 1, n).round()[::-1].copy().astype(np.int64)
        if cfg.timestep_spacing == "leading":
            ratio = cfg.num_train_timesteps // n
            return (np.arange(0, n) * ratio).round()[::-1].copy().astype(np.int64) + cfg.steps_offset
        if cfg.timestep_spacing == "trailing":
            ratio = cfg.num_train_timesteps / n
            return np.round(np.arange(cfg.num_train_timesteps, 0, -ratio)).astype(np.int64) - 1
        raise ModelError(f"scheduler_config.json: timestep_spacing {cfg.timestep_spacing!r} is not supported")


class InverseDDIMSchedule(Schedule):
    """DDIM run backwards over steps ``start..end-1`` of ``forward``: x_{i+1} -> x_i.

    Row step k is forward step i = end - 1 - k. As diffusers' ``DDIMInverseScheduler``, the
    noise is predicted at x_{i+1} with timestep t_i, and the DDIM update (eq. 12) is taken with
    the two alphas swapped: x_i = sqrt(a_i) x0 + sqrt(1 - a_i) eps, x0 = (x_{i+1} - sqrt(1 -
    a_{i+1}) eps) / sqrt(a_{i+1}). So the step graph runs it unchanged (guidance 1: the source
    prompt's conditional prediction alone). ``coefs`` are eq. 12's from the swapped alphas.
    """

    name: ClassVar[str] = "ddim"
    init_sigma: ClassVar[float] = 1.0
    ancestral: ClassVar[bool] = False
    history: ClassVar[int] = 0

    def __init__(self, forward: DDIMSchedule, start: int, end: int):
        steps = np.arange(end - 1, start - 1, -1)
        self.num_inference_steps = end - start
        self.timesteps = forward.timesteps[steps]
        self.alpha_t = forward.alpha_prev[steps]
        self.alpha_prev = forward.alpha_t[steps]
        self.coefs = ddim_coefs(self.alpha_prev, forward.clip)
