"""The few-step schedules through the whole runtime, against diffusers' own pipelines:

- a full LCM (its UNet takes the guidance embedding, ``timestep_cond``; a
  ``LatentConsistencyModelPipeline`` folder) at 4 steps equals ``LatentConsistencyModelPipeline``;
- LCM on a plain SD model (as with an LCM-LoRA: CFG, no embedding) and TCD (gamma 0.3) at 4 steps
  equal ``StableDiffusionPipeline`` with ``LCMScheduler`` / ``TCDScheduler``;
- a Turbo-style folder (``EulerAncestralDiscreteScheduler``, ``timestep_spacing: trailing``) at 1
  and 4 steps with guidance 0 equals ``StableDiffusionPipeline`` with its own scheduler (and Euler
  on the same spacing);

each fed the same initial latents and edit-rt's per-step noise (``ancestral_noise``, patched in for
the scheduler's ``randn_tensor``, as tests/test_samplers_pipeline.py does for Euler a); then
identity edits reproduce each base, and an LCM edit with 1- and 2-step tails batches as alone.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (EulerAncestralDiscreteScheduler, EulerDiscreteScheduler, LatentConsistencyModelPipeline, LCMScheduler, StableDiffusionPipeline,
                       TCDScheduler)  # fmt: skip
from diffusers.schedulers import scheduling_euler_ancestral_discrete, scheduling_lcm, scheduling_tcd

from edit_rt.runtime.loop.solver_slots import ancestral_noise
from edit_rt.runtime.model.edit import Base, TailRow
from edit_rt.runtime.model.guidance_embedding import guidance_embedding
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

from .conftest import TEST_BASE
from .test_graphs import assert_graph_matches_torch

BATCH_ATOL = 1e-5  # as tests/test_pipeline.py: fp32 reordering across batch sizes
IMAGE_ATOL = 1e-4  # images in [0, 1], as tests/test_samplers_pipeline.py
FEW = dataclasses.replace(TEST_BASE, steps=4)
TURBO_SCHEDULER = {"_class_name": "EulerAncestralDiscreteScheduler", "timestep_spacing": "trailing"}


@pytest.fixture(scope="module")
def lcm(tmp_path_factory):
    """A tiny full LCM (time_cond_proj_dim 32), exported, and its pipeline."""
    from edit_rt.export.compile.onnx_export import export_onnx
    from edit_rt.export.world.tiny_model import write_tiny_lcm

    model = write_tiny_lcm(tmp_path_factory.mktemp("models") / "tiny-lcm", seed=0)
    onnx = tmp_path_factory.mktemp("build") / "tiny-lcm" / "onnx"
    export_onnx(model, onnx)
    with EditPipeline(onnx, model) as pipe:
        yield pipe, model, onnx


@pytest.fixture(scope="module")
def turbo(model_dir, tmp_path_factory):
    """The tiny SD folder with a Turbo model's scheduler (Euler a, trailing timesteps), exported."""
    from edit_rt.export.compile.onnx_export import export_onnx

    model = tmp_path_factory.mktemp("models") / "tiny-turbo"
    shutil.copytree(model_dir, model)
    path = model / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **TURBO_SCHEDULER}))
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "scheduler": ["diffusers", TURBO_SCHEDULER["_class_name"]]}))
    onnx = tmp_path_factory.mktemp("build") / "tiny-turbo" / "onnx"
    export_onnx(model, onnx)
    with EditPipeline(onnx, model) as pipe:
        yield pipe, model


def _draw(monkeypatch, module, seed: int) -> None:
    """``module``'s scheduler draws edit-rt's noise of base seed ``seed``, step by step."""
    steps = iter(range(1000))

    def noise(shape, generator=None, device=None, dtype=None, layout=None):
        out = np.empty(tuple(shape), np.float32)
        return torch.from_numpy(ancestral_noise(seed, next(steps), out)).to(dtype)

    monkeypatch.setattr(module, "randn_tensor", noise)


def _ours(pipe: EditPipeline, base: Base):
    noise = pipe.initial_noise(base)
    state = pipe.generate_base(base, noise=noise)
    return noise, state, pipe.decode(state.final_latent)


def _sd_reference(model_dir: Path, scheduler, base: Base, latents: np.ndarray, **kw) -> np.ndarray:
    """StableDiffusionPipeline's image with ``scheduler(its config)`` from ``latents``."""
    pipe = StableDiffusionPipeline.from_pretrained(model_dir)
    pipe.scheduler = scheduler(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        base.prompt, negative_prompt=base.negative_prompt, num_inference_steps=base.steps, guidance_scale=base.guidance,
        height=base.height, width=base.width, latents=torch.from_numpy(latents), output_type="np", **kw,
    ).images  # fmt: skip


# --- against diffusers ------------------------------------------------------------------------------


def test_the_guidance_embedding_is_diffusers(lcm):
    pipe, model, onnx = lcm
    roles = pipe.manifest.step_roles
    assert roles["timestep_cond"] == "row_cond:timestep_cond"
    for g in (1.0, 2.0, 8.5):
        ref = LatentConsistencyModelPipeline.get_guidance_scale_embedding(None, torch.tensor([g - 1.0]), 32)[0].numpy()
        # exp and sin in float32 round apart in the last bit (guidance_embedding.py)
        np.testing.assert_allclose(guidance_embedding(g, 32), ref, atol=3e-5)
    assert_graph_matches_torch("unet_step", onnx, model)


@pytest.mark.parametrize("guidance", [8.5, 1.0])
def test_a_full_lcm_equals_the_lcm_pipeline(lcm, guidance, monkeypatch):
    pipe, model, _ = lcm
    base = dataclasses.replace(FEW, guidance=guidance)  # sampler None: the folder's LCMScheduler
    assert pipe.default_sampler == "lcm"
    before = dataclasses.replace(pipe.batcher(pipe.latent_shape(base)).scheduler.stats)
    noise, _, ours = _ours(pipe, base)
    stats = pipe.batcher(pipe.latent_shape(base)).scheduler.stats
    # guidance enters through the embedding only: one UNet half a step (Row.unguided)
    assert stats.unguided_row_steps - before.unguided_row_steps == base.steps
    reference = LatentConsistencyModelPipeline.from_pretrained(model)
    reference.set_progress_bar_config(disable=True)
    _draw(monkeypatch, scheduling_lcm, base.seed)
    expected = reference(base.prompt, num_inference_steps=base.steps, guidance_scale=guidance, height=base.height,
                         width=base.width, latents=torch.from_numpy(noise), output_type="np").images  # fmt: skip
    np.testing.assert_allclose(ours, expected, atol=IMAGE_ATOL)


@pytest.mark.parametrize("sampler", ["lcm", "tcd"])
def test_lcm_and_tcd_on_a_plain_model_equal_diffusers(pipeline, model_dir, sampler, monkeypatch):
    """No embedding (an SD UNet, as an LCM-LoRA runs): CFG with the negative prompt, as diffusers."""
    base = dataclasses.replace(FEW, sampler=sampler)
    noise, _, ours = _ours(pipeline, base)
    scheduler = {"lcm": LCMScheduler.from_config, "tcd": TCDScheduler.from_config}[sampler]
    _draw(monkeypatch, {"lcm": scheduling_lcm, "tcd": scheduling_tcd}[sampler], base.seed)
    kw = {"eta": 0.3} if sampler == "tcd" else {}  # TCD's gamma: StableDiffusionPipeline's eta
    np.testing.assert_allclose(ours, _sd_reference(model_dir, scheduler, base, noise, **kw), atol=IMAGE_ATOL)


@pytest.mark.parametrize("sampler,steps", [("euler_a", 1), ("euler_a", 4), ("euler", 4)])
def test_a_turbo_model_equals_diffusers_at_guidance_0(turbo, sampler, steps, monkeypatch):
    pipe, model = turbo
    assert pipe.default_sampler == "euler_a"
    base = dataclasses.replace(TEST_BASE, steps=steps, guidance=0.0, sampler=sampler)
    noise, _, ours = _ours(pipe, base)
    _draw(monkeypatch, scheduling_euler_ancestral_discrete, base.seed)
    scheduler = {"euler_a": EulerAncestralDiscreteScheduler, "euler": EulerDiscreteScheduler}[sampler].from_config
    np.testing.assert_allclose(ours, _sd_reference(model, scheduler, base, noise), atol=IMAGE_ATOL)


# --- edits ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def few_step_states(lcm, turbo, pipeline):
    """4-step bases: the full LCM, LCM and TCD on plain SD, Turbo's Euler a at guidance 0."""
    lcm_pipe, turbo_pipe = lcm[0], turbo[0]
    cases = {"lcm-embedded": (lcm_pipe, FEW), "lcm": (pipeline, dataclasses.replace(FEW, sampler="lcm")),
             "tcd": (pipeline, dataclasses.replace(FEW, sampler="tcd")),
             "turbo": (turbo_pipe, dataclasses.replace(FEW, guidance=0.0))}  # fmt: skip
    return {k: (pipe, pipe.generate_base(base)) for k, (pipe, base) in cases.items()}


@pytest.mark.parametrize("case", ["lcm-embedded", "lcm", "tcd", "turbo"])
def test_an_identity_edit_reproduces_a_few_step_base(few_step_states, case):
    """From every start step the tail re-enters the base's chain with its latent and its noise."""
    pipe, state = few_step_states[case]
    g, T = state.base.guidance, state.base.steps
    rows = [row for s in range(1, T) for row in (TailRow("a green square", 0.0, s, g), TailRow(state.base.prompt, 1.0, s, g))]
    for final in pipe.run_tail(state, rows):
        np.testing.assert_allclose(final, state.final_latent[0], atol=BATCH_ATOL)


def test_lcm_tails_of_one_and_two_steps_batch_as_alone(few_step_states):
    pipe, state = few_step_states["lcm-embedded"]
    g = state.base.guidance
    # a 1-step and two 2-step tails, one at another guidance (its own embedding in the same call)
    rows = [TailRow("a blue square", 1.0, 3, g), TailRow("a green circle", 0.7, 2, g), TailRow("a green circle", 0.7, 2, 3.0)]
    alone = [pipe.run_tail(state, [row])[0] for row in rows]
    together = pipe.run_tail(state, rows)
    for result, expected in zip(together, alone):
        np.testing.assert_allclose(result, expected, atol=BATCH_ATOL)
    # the edits edit: each differs from the base, and the guidance embedding changes the row
    assert all(np.abs(a - state.final_latent[0]).max() > 1e-3 for a in alone)
    assert np.abs(alone[1] - alone[2]).max() > 1e-4
