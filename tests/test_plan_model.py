"""The planner's model shape (issue 55, part 2; export/world/plan_model.py), on random weights:
a trajectory and its scene round-trip through the latent grid, and the folder passes the compile
stage and the runtime unchanged, generating what diffusers' own pipeline generates and keeping
what a plan's mask keeps (the present, the scene's rows) exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edit_rt.export.world import driving
from edit_rt.export.world.plan_model import (CHANNELS, GRID, HEIGHT, WIDTH, context, from_latents, known, to_latents,
                                             write_planner_model)  # fmt: skip
from edit_rt.runtime.model.edit import Base, TailRow

BASE = Base(prompt=driving.prompt(driving.random_scene(np.random.default_rng(3)), "follow"), negative_prompt="",
            seed=5, steps=10, guidance=3.0, width=WIDTH, height=HEIGHT)  # fmt: skip


def test_expert_trajectories_and_their_scenes_round_trip_through_the_latent_grid():
    rng = np.random.default_rng(0)
    cases = [(scene, driving.expert(scene, b, a)) for scene in (driving.random_scene(rng) for _ in range(4))
             for b in driving.BEHAVIOURS for a in (0.0, 1.0)]  # fmt: skip
    cases = [(scene, p.trajectory) for scene, p in cases if p.trajectory is not None]
    assert len(cases) >= 16
    for scene, trajectory in cases:
        latents = to_latents(trajectory, scene)
        assert latents.shape == (CHANNELS, HEIGHT, WIDTH) and latents.dtype == np.float32
        assert np.all(latents[3, :GRID] == 0) and np.abs(latents).max() < 3  # normalised to about unit spread
        np.testing.assert_allclose(from_latents(latents), trajectory, atol=1e-4 * 160)
        # the scene's rows: its eight numbers, value k at column k of both rows in every channel
        np.testing.assert_array_equal(latents[:, GRID:], np.broadcast_to(context(scene), (CHANNELS, HEIGHT - GRID, WIDTH)))
        assert latents[1, 0, 0] * 2.0 + 1.75 == pytest.approx(scene.ego_y, abs=1e-5)  # step 0: the present
        assert latents[2, 0, 0] * 7.0 + 12.0 == pytest.approx(scene.ego_speed, abs=1e-5)
    # step t lies at row t // 8, column t % 8
    marked = np.zeros((CHANNELS, HEIGHT, WIDTH), dtype=np.float32)
    marked[0, 2, 5] = 1.0
    x = from_latents(marked)[:, 0]
    assert np.flatnonzero(x != x[0]).tolist() == [2 * GRID + 5]
    # what a plan keeps: step 0 and the scene's rows
    assert np.argwhere(known() == 0).tolist() == [[0, 0]] + [[r, c] for r in range(GRID, HEIGHT) for c in range(WIDTH)]
    with pytest.raises(ValueError, match=r"\[64, 3\]"):
        to_latents(np.zeros((32, 3)), cases[0][0])


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    from edit_rt.export.compile.onnx_export import export_onnx

    root = tmp_path_factory.mktemp("planner")
    model = write_planner_model(root / "models" / "planner", seed=0)
    export_onnx(model, root / "build" / "planner" / "onnx")
    return model, root / "build" / "planner" / "onnx"


def _reference_plan(model, base: Base, noise: np.ndarray) -> np.ndarray:
    """The model's own sampling loop in PyTorch: its UNet and text encoder, diffusers' DDIM
    scheduler from the folder (eta 0), classifier-free guidance as StableDiffusionPipeline
    applies it (which itself refuses sides that are not multiples of 8, as this grid's 10 is not)."""
    import torch
    from diffusers import DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(model / "tokenizer")
    encoder = CLIPTextModel.from_pretrained(model / "text_encoder").eval()
    unet = UNet2DConditionModel.from_pretrained(model / "unet").eval()
    scheduler = DDIMScheduler.from_pretrained(model / "scheduler")
    scheduler.set_timesteps(base.steps)
    with torch.no_grad():
        ids = tokenizer([base.negative_prompt, base.prompt], padding="max_length", max_length=77, truncation=True,
                        return_tensors="pt").input_ids  # fmt: skip
        states = encoder(ids)[0]
        x = torch.from_numpy(noise) * scheduler.init_noise_sigma
        for t in scheduler.timesteps:
            uncond, cond = unet(torch.cat([x, x]), t, encoder_hidden_states=states).sample.chunk(2)
            x = scheduler.step(uncond + base.guidance * (cond - uncond), t, x, eta=0.0).prev_sample
    return x.numpy()


def test_a_plan_is_what_the_models_own_pytorch_loop_generates_from_the_same_noise(planner):
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    model, onnx = planner
    with EditPipeline(onnx, model) as pipe:
        noise = pipe.initial_noise(BASE)
        ours = pipe.generate_base(BASE, noise=noise).final_latent
    assert ours.shape == (1, CHANNELS, HEIGHT, WIDTH)
    np.testing.assert_allclose(ours, _reference_plan(model, BASE, noise), atol=1e-4)


def test_a_behaviour_edit_keeps_the_present_and_the_scene_exactly_and_rows_run_as_one_batch(planner):
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    model, onnx = planner
    scene = driving.random_scene(np.random.default_rng(3))
    rows = [TailRow(driving.prompt(scene, b, a), 1.0, 4, BASE.guidance, pixel_mask=known())
            for b, a in (("overtake left", 0.0), ("overtake left", 1.0), ("brake to stop", 0.5))]  # fmt: skip
    with EditPipeline(onnx, model) as pipe:
        state = pipe.generate_base(BASE)
        batched = pipe.run_tail(state, rows)
        alone = [pipe.run_tail(state, [row])[0] for row in rows]
        identity = pipe.run_tail(state, [dataclasses.replace(rows[0], prompt=BASE.prompt, pixel_mask=None)])[0]
    base = state.final_latent[0]
    kept = known() == 0
    for k, plan in enumerate(batched):
        np.testing.assert_array_equal(plan[:, kept], base[:, kept])  # the present and the scene: exactly the base's
        assert np.abs(plan[:, ~kept] - base[:, ~kept]).max() > 1e-3  # the rest was re-planned
        np.testing.assert_allclose(plan, alone[k], atol=1e-5)
    np.testing.assert_allclose(identity, base, atol=1e-5)  # the base's own prompt re-enters to the base


def test_the_planners_training_cut_into_pieces_ends_with_the_weights_of_one_uncut_run(tmp_path):
    """export/world/train_planner.py at toy length: a piece ends on its clock with its state
    saved and writes the model as of then; the next resumes (the dataset drawn again from the
    seed) and ends where one uncut run ends; the folder passes the compile stage."""
    import torch
    from safetensors.torch import load_file

    from edit_rt.export.compile.onnx_export import export_onnx
    from edit_rt.export.world.train_planner import PlannerSpec, train_planner

    spec = PlannerSpec(steps=4, batch=4, dataset_size=6, checkpoint_every=100, max_minutes=0.0,
                       block_out_channels=(8, 16), text_hidden_size=16)  # fmt: skip
    quiet = lambda s: None  # noqa: E731
    uncut = train_planner(tmp_path / "uncut", spec, say=quiet)
    assert uncut["finished"] and uncut["steps_run"] == 4 and 10 <= uncut["plans"] <= 30
    first = train_planner(tmp_path / "piece1", spec, say=quiet, checkpoint=tmp_path / "ckpt", piece_minutes=1e-9)
    assert not first["finished"] and first["steps_run"] == 1
    resumed = train_planner(tmp_path / "piece2", spec, say=quiet, checkpoint=tmp_path / "ckpt")
    assert resumed["finished"] and resumed["loss"] == uncut["loss"]
    for part in ("unet", "text_encoder"):
        name = "diffusion_pytorch_model.safetensors" if part == "unet" else "model.safetensors"
        a, b = load_file(tmp_path / "uncut" / part / name), load_file(tmp_path / "piece2" / part / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    export_onnx(tmp_path / "piece2", tmp_path / "build" / "piece2" / "onnx")
    with pytest.raises(ValueError, match="another spec"):
        train_planner(tmp_path / "other", dataclasses.replace(spec, seed=1), say=quiet, checkpoint=tmp_path / "ckpt")
