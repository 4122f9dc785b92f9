"""The runtime's DDIM timesteps and alphas against diffusers' own DDIMScheduler (the update they
feed is fused in the step graph and held against diffusers' pipelines: test_pipeline.py)."""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import DDIMScheduler

from edit_rt.runtime.model.scheduler_ddim import DDIMConfig, DDIMSchedule

SD15 = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
            set_alpha_to_one=False, steps_offset=1)  # fmt: skip
CONFIGS = [
    SD15,
    dict(SD15, timestep_spacing="trailing", prediction_type="v_prediction"),
    dict(SD15, timestep_spacing="linspace"),
    dict(beta_schedule="linear", set_alpha_to_one=True, clip_sample=True),
    dict(beta_schedule="squaredcos_cap_v2", prediction_type="sample", clip_sample=False),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("steps", [1, 7, 10, 50])
def test_timesteps_and_alphas_equal_diffusers(config, steps):
    ref = DDIMScheduler(**config)
    ref.set_timesteps(steps)
    ours = DDIMSchedule(DDIMConfig.from_scheduler_config(ref.config), steps)
    np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy())
    ratio = ref.config.num_train_timesteps // steps
    # rtol 1e-5: both are float32 cumulative products of 1000 betas; torch and numpy round the
    # linspace differently in the last bit, which grows to ~1e-6 relative at the chain's end.
    for i, t in enumerate(ref.timesteps.tolist()):
        alpha_prev = ref.alphas_cumprod[t - ratio] if t - ratio >= 0 else ref.final_alpha_cumprod
        np.testing.assert_allclose(ours.alpha_t[i], ref.alphas_cumprod[t].item(), rtol=1e-5)
        np.testing.assert_allclose(ours.alpha_prev[i], float(alpha_prev), rtol=1e-5)


def test_pndm_config_of_sd15_reads_as_ddim():
    """SD 1.5 ships a PNDM scheduler config; the pipeline swaps DDIM in with the same betas."""
    pndm = dict(SD15, _class_name="PNDMScheduler", skip_prk_steps=True, num_train_timesteps=1000)
    ref = DDIMScheduler.from_config(pndm)
    ref.set_timesteps(50)
    ours = DDIMSchedule(DDIMConfig.from_scheduler_config(pndm), 50)
    np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy())
