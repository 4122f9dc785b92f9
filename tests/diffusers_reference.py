"""diffusers' own text-to-image generations, each computed once per test session.

"A generation equals diffusers" is the suite's most repeated reference: the same tiny model,
sampler, base and initial latents are asked for by several files, and by each CPU engine. This
loads each model's diffusers pipeline once and memoises each image per (model folder, pipeline
class, sampler, base, initial latents), so a reference costs one diffusers run per session.
The images come back read-only: a test that changed one would change every later test's
reference.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable
from unittest import mock

import numpy as np
import torch

from edit_rt.runtime.loop.solver_slots import ancestral_noise
from edit_rt.runtime.model.edit import Base


def _schedulers() -> dict[str, Callable]:
    """diffusers' scheduler for each of edit-rt's samplers, from the model's own scheduler config;
    ``own``: the model folder's scheduler as saved (SDXL's Euler, a Turbo folder's Euler a)."""
    from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler, EulerDiscreteScheduler,
                           UniPCMultistepScheduler)  # fmt: skip

    return {
        "own": None,
        "ddim": DDIMScheduler.from_config,
        "euler": EulerDiscreteScheduler.from_config,
        "euler_karras": lambda cfg: EulerDiscreteScheduler.from_config(cfg, use_karras_sigmas=True),
        "euler_a": EulerAncestralDiscreteScheduler.from_config,
        "dpmpp_2m": lambda cfg: DPMSolverMultistepScheduler.from_config(cfg, algorithm_type="dpmsolver++", solver_order=2),
        "dpmpp_2m_karras": lambda cfg: DPMSolverMultistepScheduler.from_config(
            cfg, algorithm_type="dpmsolver++", solver_order=2, use_karras_sigmas=True),
        "unipc": UniPCMultistepScheduler.from_config,
    }  # fmt: skip


class DiffusersReference:
    """``reference(model_dir, base, latents, sampler=...)`` -> diffusers' images (N, H, W, 3) in [0, 1]."""

    def __init__(self) -> None:
        self._pipes: dict[tuple[str, str], object] = {}
        self._images: dict[tuple, np.ndarray] = {}
        self.computed = 0  # diffusers runs, for the cache's own test

    def pipe(self, model_dir: Path, sdxl: bool = False):
        """The model's diffusers pipeline, loaded once (its scheduler is set per call)."""
        from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

        cls = StableDiffusionXLPipeline if sdxl else StableDiffusionPipeline
        key = (str(Path(model_dir).resolve()), cls.__name__)
        if key not in self._pipes:
            pipe = cls.from_pretrained(model_dir)
            pipe.set_progress_bar_config(disable=True)
            self._pipes[key] = (pipe, pipe.scheduler)
        return self._pipes[key]

    def __call__(self, model_dir: Path, base: Base, latents: np.ndarray, sampler: str = "ddim", sdxl: bool = False) -> np.ndarray:
        """diffusers' image for ``base`` (its prompts, steps, guidance, size; on SDXL its size and
        crop conditioning) from ``latents`` (x_0 before the scheduler's initial sigma), with
        ``sampler``'s scheduler; a stochastic scheduler draws edit-rt's per-step noise of
        ``base.seed`` (``ancestral_noise``), so that both sides add the same noise."""
        latents = np.ascontiguousarray(latents, np.float32)
        key = (str(Path(model_dir).resolve()), sdxl, sampler, repr(base), latents.shape,
               hashlib.sha256(latents.tobytes()).hexdigest())  # fmt: skip
        if key not in self._images:
            image = self._generate(model_dir, base, latents, sampler, sdxl)
            image.flags.writeable = False
            self._images[key] = image
            self.computed += 1
        return self._images[key]

    def _generate(self, model_dir: Path, base: Base, latents: np.ndarray, sampler: str, sdxl: bool) -> np.ndarray:
        pipe, own = self.pipe(model_dir, sdxl)
        make = _schedulers()[sampler]
        pipe.scheduler = own if make is None else make(own.config)
        steps = iter(range(1 << 16))

        def noise(shape, generator=None, device=None, dtype=None, layout=None):
            out = np.empty(tuple(shape), np.float32)
            return torch.from_numpy(ancestral_noise(base.seed, next(steps), out)).to(dtype)

        call = dict(prompt=base.prompt, negative_prompt=base.negative_prompt, num_inference_steps=base.steps,
                    guidance_scale=base.guidance, height=base.height, width=base.width,
                    latents=torch.from_numpy(latents.copy()), output_type="np")  # fmt: skip
        if sdxl:
            call.update(clip_skip=base.clip_skip or None,
                        original_size=(base.original_height or base.height, base.original_width or base.width),
                        crops_coords_top_left=(base.crop_top, base.crop_left), target_size=(base.height, base.width))  # fmt: skip
        elif base.clip_skip:
            raise ValueError("clip_skip on SD 1.x/2.x: pass the embeddings (tests/test_families.py's _sd_reference)")
        from diffusers.schedulers import scheduling_euler_ancestral_discrete

        with mock.patch.object(scheduling_euler_ancestral_discrete, "randn_tensor", noise):
            try:
                return pipe(**call).images
            finally:
                pipe.scheduler = own
