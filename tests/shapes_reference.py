"""diffusers' own generation of a committed shapes model: the reference the model tests hold
edit-rt's ONNX runtime to."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from edit_rt.runtime.model.edit import Base
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline


def assert_generation_equals_diffusers(pipe: EditPipeline, model: Path, base: Base, prompt: str) -> None:
    """edit-rt's generation of ``prompt`` equals ``StableDiffusionPipeline``'s (DDIM, the same
    initial noise) within 1e-4."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    reference = StableDiffusionPipeline.from_pretrained(model)
    reference.scheduler = DDIMScheduler.from_config(reference.scheduler.config)
    reference.set_progress_bar_config(disable=True)
    base = dataclasses.replace(base, prompt=prompt)
    noise = pipe.initial_noise(base)
    ours = pipe.decode(pipe.generate_base(base, noise=noise).final_latent)
    expected = reference(base.prompt, negative_prompt=base.negative_prompt, num_inference_steps=base.steps,
                         guidance_scale=base.guidance, height=base.height, width=base.width,
                         latents=torch.from_numpy(noise), output_type="np").images  # fmt: skip
    np.testing.assert_allclose(ours, expected, atol=1e-4)
