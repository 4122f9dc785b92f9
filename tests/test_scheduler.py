"""The runtime's DDIM timesteps and alphas against diffusers' own DDIMScheduler (the update they
feed is fused in the step graph and held against diffusers' pipelines: test_pipeline.py)."""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import DDIMScheduler

from edit_rt.runtime.model.scheduler_ddim import DDIMConfig, DDIMSchedule
from edit_rt.runtime.model.training_chain import alphas_cumprod

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
    # within 2 ulp: the alpha-bar is diffusers' (test_alpha_bar_equals_diffusers_within_two_ulp)
    for i, t in enumerate(ref.timesteps.tolist()):
        alpha_prev = ref.alphas_cumprod[t - ratio] if t - ratio >= 0 else ref.final_alpha_cumprod
        np.testing.assert_array_max_ulp(ours.alpha_t[i], ref.alphas_cumprod[t].numpy(), maxulp=2)
        np.testing.assert_array_max_ulp(ours.alpha_prev[i], np.float32(alpha_prev), maxulp=2)


@pytest.mark.parametrize("config", CONFIGS[:1] + CONFIGS[3:] + [dict(beta_start=0.0001, beta_end=0.03, num_train_timesteps=1100)])
def test_alpha_bar_equals_diffusers_within_two_ulp(config):
    """The training chain every sampler reads (DDIM's here, the sigma samplers' from the same
    function) is diffusers' float32 ``alphas_cumprod``: the same float32 betas (torch's linspace
    rounds each term once, a fused multiply-add on the CPUs torch builds its kernels for) and the
    same product, accumulated in double as torch's CPU cumprod does). Held within 2 ulp, not to
    the bit: a torch kernel built without fused multiply-add rounds its linspace up to 2 ulp
    apart (the old float32 product was 21 ulp off on SD's schedule)."""
    ref = DDIMScheduler(**config)
    expected = ref.alphas_cumprod.numpy()
    chain = DDIMSchedule(DDIMConfig.from_scheduler_config(ref.config), 10).alphas_cumprod
    assert chain.dtype == np.float32
    np.testing.assert_array_max_ulp(chain, expected, maxulp=2)
    np.testing.assert_array_max_ulp(alphas_cumprod(ref.config), expected, maxulp=2)


def test_pndm_config_of_sd15_reads_as_ddim():
    """SD 1.5 ships a PNDM scheduler config; the pipeline swaps DDIM in with the same betas."""
    pndm = dict(SD15, _class_name="PNDMScheduler", skip_prk_steps=True, num_train_timesteps=1000)
    ref = DDIMScheduler.from_config(pndm)
    ref.set_timesteps(50)
    ours = DDIMSchedule(DDIMConfig.from_scheduler_config(pndm), 50)
    np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy())
