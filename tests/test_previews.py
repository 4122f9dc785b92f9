"""Previews while a row runs: the decoded x_0 that each step predicts, against diffusers' own.

diffusers' ``DDIMScheduler.step`` returns ``pred_original_sample``, the x_0 estimate of each
step; the runtime's preview (the x_0 the step graph computed, read from the row's solver
history after the step) must equal it for the same generation, and a tail's previews come every
``Job.preview_every`` steps (each row's own: rows of one request spread theirs over their own
tails, tests/test_door_answers.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline

from edit_rt.runtime.loop.batcher import Batcher
from edit_rt.runtime.loop.jobs import Job, Request
from edit_rt.runtime.model.edit import TailRow

from .conftest import TEST_BASE


def _diffusers_x0s(model_dir, base, latents: np.ndarray) -> list[np.ndarray]:
    pipe = StableDiffusionPipeline.from_pretrained(model_dir)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    seen = []
    step = pipe.scheduler.step

    def recording(*args, **kwargs):
        out = step(*args, **kwargs)  # the pipeline asks for a tuple: (prev_sample, pred_original_sample)
        x0 = out[1] if isinstance(out, tuple) else out.pred_original_sample
        seen.append(x0[0].numpy().copy())
        return out

    pipe.scheduler.step = recording
    pipe(base.prompt, negative_prompt=base.negative_prompt, num_inference_steps=base.steps, guidance_scale=base.guidance,
         height=base.height, width=base.width, eta=0.0, latents=torch.from_numpy(latents), output_type="latent")  # fmt: skip
    return seen


def test_a_generations_previews_are_diffusers_predicted_x0(pipeline, model_dir):
    base = TEST_BASE
    noise = pipeline.initial_noise(base)
    scheduler = pipeline.new_scheduler(noise.shape[1:], max_rows=4)
    batcher = Batcher(pipeline.resolver, scheduler)
    seen: list[tuple[int, np.ndarray]] = []
    x0s: list[np.ndarray] = []
    request = Request("gen", on_preview=lambda i, step, of, image: seen.append((step, image)))
    job = Job(request, 0, base, TailRow(base.prompt, 1.0, 0, base.guidance), noise=noise, preview_every=1)
    batcher.submit(request, [job])
    while not job.future.done():
        batcher.work_once()
        for row in scheduler.active:
            if row.previewed == row.step - 1:
                x0s.append(row.preview.copy())
    reference = _diffusers_x0s(model_dir, base, noise)
    assert [s for s, _ in seen] == list(range(1, base.steps))  # every step but the last (the result)
    for i, x0 in enumerate(x0s):
        np.testing.assert_allclose(x0, reference[i], atol=2e-4, rtol=1e-4, err_msg=f"step {i}")
    for _, image in seen:
        assert image.shape == (32, 32, 3) and 0.0 <= image.min() and image.max() <= 1.0
    # the last preview is nearly the result: the x_0 predicted one step before the end
    final = job.future.result().image
    assert np.abs(seen[-1][1] - final).mean() < 0.05


@pytest.mark.parametrize("every", [2, 3])
def test_a_tails_previews_come_every_k_steps_and_leave_its_result_alone(pipeline, base_state, every):
    row = TailRow("a blue square", 1.0, 3, TEST_BASE.guidance)
    scheduler = pipeline.new_scheduler(base_state.latents.shape[1:], max_rows=4)
    batcher = Batcher(pipeline.resolver, scheduler)
    steps: list[int] = []
    request = Request("tail", on_preview=lambda i, step, of, image: steps.append(step))
    job = Job(request, 0, base_state.base, row, state=base_state, preview_every=every)
    batcher.submit(request, [job])
    while not job.future.done():
        batcher.work_once()
    tail = TEST_BASE.steps - 3
    assert steps == [k for k in range(every, tail, every)]
    (alone,) = pipeline.run_tail(base_state, [row])
    np.testing.assert_allclose(job.future.result().latent, alone, atol=1e-5)
