"""The planner's model shape (issue 55, part 2; export/world/plan_model.py), on random weights:
a trajectory round-trips through its latent grid, and the folder passes the compile stage and the
runtime unchanged, generating what diffusers' own pipeline generates and keeping a masked row of
the base exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edit_rt.export.world import driving
from edit_rt.export.world.plan_model import CHANNELS, GRID, from_latents, to_latents, write_planner_model
from edit_rt.runtime.model.edit import Base, Mask, TailRow

BASE = Base(prompt=driving.prompt(driving.random_scene(np.random.default_rng(3)), "follow"), negative_prompt="",
            seed=5, steps=10, guidance=3.0, width=GRID, height=GRID)  # fmt: skip


def test_expert_trajectories_round_trip_through_the_latent_grid():
    rng = np.random.default_rng(0)
    plans = [driving.expert(driving.random_scene(rng), b, a) for b in driving.BEHAVIOURS for a in (0.0, 1.0)]
    plans = [p.trajectory for p in plans if p.trajectory is not None]
    assert len(plans) >= 8
    for trajectory in plans:
        latents = to_latents(trajectory)
        assert latents.shape == (CHANNELS, GRID, GRID) and latents.dtype == np.float32
        assert np.all(latents[3] == 0) and np.abs(latents[:3]).max() < 3  # normalised to about unit spread
        np.testing.assert_allclose(from_latents(latents), trajectory, atol=1e-4 * 160)
    # step t lies at row t // 8, column t % 8: row 0 is the present and the next 0.7 s
    marked = np.zeros((CHANNELS, GRID, GRID), dtype=np.float32)
    marked[0, 2, 5] = 1.0
    x = from_latents(marked)[:, 0]
    assert np.flatnonzero(x != x[0]).tolist() == [2 * GRID + 5]
    with pytest.raises(ValueError, match=r"\[64, 3\]"):
        to_latents(np.zeros((32, 3)))


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    from edit_rt.export.compile.onnx_export import export_onnx

    root = tmp_path_factory.mktemp("planner")
    model = write_planner_model(root / "models" / "planner", seed=0)
    export_onnx(model, root / "build" / "planner" / "onnx")
    return model, root / "build" / "planner" / "onnx"


def test_a_plan_is_what_diffusers_generates_from_the_same_noise(planner):
    import torch
    from diffusers import StableDiffusionPipeline

    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    model, onnx = planner
    with EditPipeline(onnx, model) as pipe:
        noise = pipe.initial_noise(BASE)
        ours = pipe.generate_base(BASE, noise=noise).final_latent
    reference = StableDiffusionPipeline.from_pretrained(model)
    reference.set_progress_bar_config(disable=True)
    theirs = reference(BASE.prompt, negative_prompt=BASE.negative_prompt, num_inference_steps=BASE.steps, eta=0.0,
                       guidance_scale=BASE.guidance, height=GRID, width=GRID, latents=torch.from_numpy(noise),
                       output_type="latent").images.numpy()  # fmt: skip
    assert ours.shape == (1, CHANNELS, GRID, GRID)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_a_behaviour_edit_keeps_the_masked_present_exactly_and_rows_run_as_one_batch(planner):
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    model, onnx = planner
    scene = driving.random_scene(np.random.default_rng(3))
    present = Mask(0, 1, GRID, GRID - 1)  # the edit may change rows 1..7; row 0 stays the base's
    rows = [TailRow(driving.prompt(scene, b, a), 1.0, 4, BASE.guidance, mask=present)
            for b, a in (("overtake left", 0.0), ("overtake left", 1.0), ("brake to stop", 0.5))]  # fmt: skip
    with EditPipeline(onnx, model) as pipe:
        state = pipe.generate_base(BASE)
        batched = pipe.run_tail(state, rows)
        alone = [pipe.run_tail(state, [row])[0] for row in rows]
        identity = pipe.run_tail(state, [dataclasses.replace(rows[0], prompt=BASE.prompt, mask=None)])[0]
    base = state.final_latent[0]
    for k, plan in enumerate(batched):
        np.testing.assert_array_equal(plan[:, 0], base[:, 0])  # the present: exactly the base's
        assert np.abs(plan[:, 1:] - base[:, 1:]).max() > 1e-3  # the rest was re-planned
        np.testing.assert_allclose(plan, alone[k], atol=1e-5)
    np.testing.assert_allclose(identity, base, atol=1e-5)  # the base's own prompt re-enters to the base
