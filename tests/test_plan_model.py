"""The planner's model shape (issue 55, part 2; export/world/plan_model.py), on random weights:
a trajectory and its scene round-trip through the latent grid, and the folder passes the compile
stage and the runtime unchanged, generating what diffusers' own pipeline generates and keeping
what a plan's mask keeps (the present, the scene's rows) exactly."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from edit_rt.export.world.plan_model import write_planner_model
from edit_rt.runtime.model import driving
from edit_rt.runtime.model.plan_grid import CHANNELS, GRID, HEIGHT, WIDTH, context, from_latents, known, plan_of, to_latents
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


def test_a_plan_is_read_as_a_vehicle_drives_it_keeping_an_expert_plan_and_dropping_per_step_noise():
    """plan_of against the expert (driving.py): its smooth plans come back within half a metre, and
    per-step noise (0.01 in latent units: ~0.45 m in x, 0.07 m/s in speed) is gone, while a
    finite-difference judge reads the raw grid as hundreds of m/s^2."""
    rng = np.random.default_rng(5)
    worst, checked, agree = 0.0, 0, 0
    for _ in range(12):
        scene = driving.random_scene(rng)
        for behaviour in driving.BEHAVIOURS:
            expert = driving.expert(scene, behaviour, float(rng.random())).trajectory
            if expert is None:
                continue
            latents = to_latents(expert, scene)
            clean = plan_of(latents)
            worst = max(worst, float(np.abs(clean[:, :2] - expert[:, :2]).max()))
            noisy = latents.copy()
            noisy[:3, :GRID] += rng.normal(0.0, 0.01, (3, GRID, GRID)).astype(np.float32)
            noisy[:, 0, 0] = latents[:, 0, 0]  # the present, kept by the mask
            read, raw = driving.judge(scene, plan_of(noisy), behaviour), driving.judge(scene, from_latents(noisy), behaviour)
            truth = driving.judge(scene, expert, behaviour)
            assert raw["peak_accel"] > 100.0 and read["peak_accel"] < truth["peak_accel"] + 4.0, (behaviour, read, truth)
            agree += read["behaviour_ok"] == truth["behaviour_ok"] and read["collision"] == truth["collision"]
            np.testing.assert_array_equal(plan_of(noisy)[0], from_latents(latents)[0])  # the present, exactly
            assert (plan_of(noisy)[:, 2] >= 0).all()
            checked += 1
    assert checked >= 40 and worst < 0.5 and agree >= 0.9 * checked, (checked, worst, agree)


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    from edit_rt.export.compile.onnx_export import export_onnx

    root = tmp_path_factory.mktemp("planner")
    model = write_planner_model(root / "models" / "planner", seed=0)
    export_onnx(model, root / "build" / "planner" / "onnx")
    return model, root / "build" / "planner" / "onnx"


@pytest.fixture(scope="module")
def planner_pipe(planner):
    """The planner's export in edit-rt's pipeline, loaded once for the tests below that run it
    directly (each its own bases and rows; PlanLoop keeps its base plans in the loop, not here)."""
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    model, onnx = planner
    with EditPipeline(onnx, model) as pipe:
        yield pipe


def _reference_plan(model, base: Base, noise: np.ndarray, known: np.ndarray = None, mask: np.ndarray = None) -> np.ndarray:
    """The model's own sampling loop in PyTorch: its UNet and text encoder, diffusers' DDIM
    scheduler from the folder (eta 0), classifier-free guidance as StableDiffusionPipeline
    applies it (which itself refuses sides that are not multiples of 8, as this grid's 10 is not).
    With ``known`` and ``mask`` (1 where it may change): kept where the mask is 0, as
    StableDiffusionInpaintPipeline does with a 4-channel UNet (``known`` noised to the next
    timestep with ``add_noise`` after each step, itself after the last)."""
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
        for i, t in enumerate(scheduler.timesteps):
            uncond, cond = unet(torch.cat([x, x]), t, encoder_hidden_states=states).sample.chunk(2)
            x = scheduler.step(uncond + base.guidance * (cond - uncond), t, x, eta=0.0).prev_sample
            if known is not None:
                proper = torch.from_numpy(known)[None]
                if i < len(scheduler.timesteps) - 1:
                    proper = scheduler.add_noise(proper, torch.from_numpy(noise), scheduler.timesteps[i + 1 : i + 2])
                m = torch.from_numpy(mask)[None, None]
                x = (1 - m) * proper + m * x
    return x.numpy()


def test_a_plan_is_what_the_models_own_pytorch_loop_generates_from_the_same_noise(planner, planner_pipe):
    model, pipe = planner[0], planner_pipe
    noise = pipe.initial_noise(BASE)
    ours = pipe.generate_base(BASE, noise=noise).final_latent
    assert ours.shape == (1, CHANNELS, HEIGHT, WIDTH)
    np.testing.assert_allclose(ours, _reference_plan(model, BASE, noise), atol=1e-4)


def test_a_base_plan_around_the_present_and_the_scene_is_diffusers_inpainting_with_them_kept_exactly(planner, planner_pipe):
    """EditPipeline.generate_base with ``known``: a generation that keeps what a planner knows
    (step 0 and the scene's rows), equal to diffusers' inpainting loop on the same UNet; the
    kept positions end exactly the known values, and a behaviour edit of it keeps them."""
    from edit_rt.runtime.errors import ConfigError
    from edit_rt.runtime.model.plan_grid import present

    model, pipe = planner[0], planner_pipe
    scene = driving.random_scene(np.random.default_rng(11))
    base = dataclasses.replace(BASE, prompt=driving.prompt(scene, "keep lane"))
    kept, mask = present(scene), known()
    noise = pipe.initial_noise(base)
    state = pipe.generate_base(base, noise=noise, known=kept, pixel_mask=mask)
    edited = pipe.run_tail(state, [TailRow(driving.prompt(scene, "brake to stop"), 1.0, 4, base.guidance, pixel_mask=mask)])
    with pytest.raises(ConfigError, match="base.sampler: euler.*ddim"):
        pipe.generate_base(dataclasses.replace(base, sampler="euler"), known=kept, pixel_mask=mask)
    plan = state.final_latent[0]
    np.testing.assert_allclose(plan, _reference_plan(model, base, noise, kept, mask)[0], atol=1e-4)
    where = mask == 0
    np.testing.assert_array_equal(plan[:, where], kept[:, where])
    np.testing.assert_array_equal(edited[0][:, where], kept[:, where])
    trajectory = from_latents(plan)
    assert trajectory[0, 1] == pytest.approx(scene.ego_y, abs=1e-5) and trajectory[0, 2] == pytest.approx(scene.ego_speed, abs=1e-5)
    assert np.abs(plan[:, ~where]).max() > 0.1  # the rest was generated
    np.testing.assert_array_equal(state.latents[0], noise[0])  # from the generation's own noise


def test_a_behaviour_edit_keeps_the_present_and_the_scene_exactly_and_rows_run_as_one_batch(planner_pipe):
    pipe = planner_pipe
    scene = driving.random_scene(np.random.default_rng(3))
    rows = [TailRow(driving.prompt(scene, b, a), 1.0, 4, BASE.guidance, pixel_mask=known())
            for b, a in (("overtake left", 0.0), ("overtake left", 1.0), ("brake to stop", 0.5))]  # fmt: skip
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


# --- the plan-edit-evaluate loop (pipeline/plans.py) ------------------------------------------------


def test_the_loop_plans_every_variant_as_one_tail_of_its_base_plan_each_judged_and_the_best_chosen(planner_pipe):
    from edit_rt.runtime.pipeline.plans import PlanLoop, Variant
    from edit_rt.runtime.model.plan_grid import present

    pipe = planner_pipe
    scene = driving.random_scene(np.random.default_rng(7))
    variants = [Variant(b, a) for b in ("follow", "brake to stop", "change lane") for a in (0.0, 1.0)] + [Variant("keep lane")]
    kept = known() == 0
    loop = PlanLoop(pipe, steps=10, guidance=3.0, tail_steps=4, seed=2, behaviour_tails={"change lane": 7})
    first = loop.run(scene, variants)
    again = loop.run(scene, variants)
    # the same base and rows written out here: each variant alone, an edit row of the base from step 6
    # (change lane, its own tail of 7: from step 3)
    base = Base(driving.prompt(scene, "keep lane", 0.5), negative_prompt="", seed=2, steps=10, guidance=3.0,
                width=WIDTH, height=HEIGHT, sampler="ddim")  # fmt: skip
    state = pipe.generate_base(base, known=present(scene), pixel_mask=known())
    alone = [pipe.run_tail(state, [TailRow(driving.prompt(scene, v.behaviour, v.aggressiveness), 1.0,
                                           3 if v.behaviour == "change lane" else 6, 3.0, pixel_mask=known())])[0]
             for v in variants]  # fmt: skip
    assert first.base_source == "generated" and again.base_source == "kept"
    assert first.rows == {"base": 10, "variants": 4 * (len(variants) - 2) + 7 * 2} and again.rows["base"] == 0
    np.testing.assert_allclose(plan_of(state.final_latent[0]), first.base.trajectory, atol=1e-4)
    for k, (plan, latent) in enumerate(zip(first.variants, alone)):
        np.testing.assert_allclose(plan.trajectory, plan_of(latent), atol=1e-4)  # batched equals alone
        np.testing.assert_array_equal(again.variants[k].trajectory, plan.trajectory)
        assert plan.trajectory[0, 1] == pytest.approx(scene.ego_y, abs=1e-5)  # the present, kept
        assert plan.scores == driving.judge(scene, plan.trajectory, plan.variant.behaviour)
    # the base's own words re-enter to the base plan
    np.testing.assert_allclose(first.variants[-1].trajectory, first.base.trajectory, atol=1e-4)
    utility = [p.scores["progress"] - 2.0 * p.scores["peak_accel"] - 0.2 * p.scores["peak_jerk"] for p in first.variants]
    assert first.best == max(range(len(variants)), key=lambda k: (first.variants[k].scores["success"], utility[k]))
    assert first.picture().size[0] > 100  # the road drawn with every plan


def test_edit_rt_run_plans_a_plan_config_and_refuses_a_wrong_one_naming_the_field(planner, tmp_path):
    import json

    import yaml
    from PIL import Image

    from .cli_in_process import edit_rt

    model, onnx = planner
    config = {"model": str(model), "build_dir": str(onnx.parent.parent), "output_dir": str(tmp_path / "out"),
              "base": {"seed": 1, "steps": 8, "guidance": 3.0},
              "plan": {"scene_seed": 4, "behaviours": ["follow", "overtake left"], "aggressiveness": [0.0, 1.0],
                       "tail_steps": 3}}  # fmt: skip
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(config))
    ran = edit_rt("run", str(tmp_path / "plan.yaml"))
    assert ran.returncode == 0, ran.stderr + ran.stdout
    assert "4 plans from one base plan" in ran.stdout
    report = json.loads((tmp_path / "out" / "plans.json").read_text())
    scene = driving.random_scene(np.random.default_rng(4))
    assert [(v["behaviour"], v["aggressiveness"]) for v in report["variants"]] == [
        ("follow", 0.0), ("follow", 1.0), ("overtake left", 0.0), ("overtake left", 1.0)]
    assert report["scene"]["ego_speed"] == scene.ego_speed and report["tail_steps"] == 3
    assert report["unet_rows"] == {"base": 8, "variants": 12, "total": 20, "sampling_every_variant": 40}
    for v in report["variants"]:
        assert v["scores"] == driving.judge(scene, np.array(v["trajectory"]), v["behaviour"])
    assert Image.open(tmp_path / "out" / "plans.png").size[0] > 100
    config["plan"]["behaviours"] = ["follow", "fly"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    ran = edit_rt("run", str(tmp_path / "bad.yaml"))
    assert ran.returncode != 0 and "plan.behaviours[1]" in ran.stderr and "'fly'" in ran.stderr


def test_post_v1_plans_answers_every_plan_as_json_from_a_kept_base_plan_and_refuses_naming_the_field(planner, planner_pipe, tmp_path):
    """A planner served (a plan config): POST /v1/plans over ASGI, held to the same base and rows
    written out on the library's pipeline."""
    from edit_rt.runtime.model.plan_grid import present

    from .in_process_server import InProcessServer

    model, onnx = planner
    pipe = planner_pipe
    server = InProcessServer(tmp_path, model, onnx, base={"seed": 3, "steps": 8, "guidance": 3.0},
                             serve={"max_edits_per_request": 6}, extra={"plan": {"scene_seed": 0, "tail_steps": 3}})  # fmt: skip
    scene = {"ego_speed": 12.0, "ego_y": -0.2, "lead_gap": 30.0, "lead_speed": 9.0, "oncoming_distance": 300.0,
             "oncoming_speed": 10.0}  # fmt: skip
    body = {"scene": scene, "behaviours": ["follow", "change lane"], "aggressiveness": [0.0, 1.0]}
    try:
        first = server.client.post("/v1/plans", json=body)
        again = server.client.post("/v1/plans", json=body)
        refusals = [server.client.post("/v1/plans", json=b) for b in (
            {**body, "behaviours": ["follow", "reverse"]},
            {**body, "scene": {**scene, "obstacle": True}},
            {**body, "behaviours": list(driving.BEHAVIOURS)},
            {**body, "tail_steps": 9})]  # fmt: skip
    finally:
        server.stop()
    assert first.status_code == 200, first.text
    plans, kept = first.json(), again.json()
    assert plans["base_source"] == "generated" and kept["base_source"] == "kept"
    assert plans["unet_rows"] == {"base": 8, "variants": 12} and kept["unet_rows"]["base"] == 0
    world = driving.Scene(**scene)
    base = Base(driving.prompt(world, "keep lane", 0.5), negative_prompt="", seed=3, steps=8, guidance=3.0,
                width=WIDTH, height=HEIGHT, sampler="ddim")  # fmt: skip
    state = pipe.generate_base(base, known=present(world), pixel_mask=known())
    rows = [TailRow(driving.prompt(world, b, a), 1.0, 5, 3.0, pixel_mask=known()) for b in ("follow", "change lane")
            for a in (0.0, 1.0)]  # fmt: skip
    expected = pipe.run_tail(state, rows)
    for plan, latent in zip(plans["variants"], expected):
        np.testing.assert_allclose(np.array(plan["trajectory"]), plan_of(latent), atol=1e-4)
        assert plan["scores"] == driving.judge(world, np.array(plan["trajectory"]), plan["behaviour"])
    assert [r.status_code for r in refusals] == [400, 400, 413, 400], [r.text for r in refusals]
    assert "behaviours" in refusals[0].text and "reverse" in refusals[0].text
    assert "scene.lead_speed" in refusals[1].text and "tail_steps" in refusals[3].text


def test_the_python_api_plans_as_the_route_does_and_names_a_wrong_field(planner, tmp_path):
    from edit_rt.runtime.apps.editor import Editor
    from edit_rt.runtime.errors import EditorError

    model, onnx = planner
    with Editor.from_model(model, onnx.parent.parent, base={"seed": 3, "steps": 8, "guidance": 3.0},
                           plan={"scene_seed": 0, "tail_steps": 3}) as ed:  # fmt: skip
        scene = driving.random_scene(np.random.default_rng(9))
        outcome = ed.plan(scene, ["brake to stop", "keep lane"], [0.5])
        again = ed.plan(dataclasses.asdict(scene), ["brake to stop", "keep lane"], [0.5])
        with pytest.raises(EditorError, match="aggressiveness") as refused:
            ed.plan(scene, ["follow"], [1.5])
        with pytest.raises(EditorError, match="scene.lead_gap"):
            ed.plan({"ego_speed": 10.0}, ["follow"])
    assert refused.value.field.startswith("aggressiveness")
    assert [p.variant.label for p in outcome.variants] == ["brake to stop 0.5", "keep lane 0.5"]
    assert outcome.base_source == "generated" and again.base_source == "kept"
    # keep lane at the base's own aggressiveness: the base plan's own words, so the base plan
    np.testing.assert_allclose(outcome.variants[1].trajectory, outcome.base.trajectory, atol=1e-4)
    for p, q in zip(outcome.variants, again.variants):
        np.testing.assert_array_equal(p.trajectory, q.trajectory)


def test_the_plans_example_of_docs_python_md_runs_on_a_planner(planner, tmp_path):
    """docs/python.md's "Plans" block, as written, on this random planner's config."""
    import re
    from pathlib import Path

    import yaml

    model, onnx = planner
    config = {"model": str(model), "build_dir": str(onnx.parent.parent), "base": {"seed": 0, "steps": 8, "guidance": 3.0},
              "plan": {"scene_seed": 0, "tail_steps": 3}}  # fmt: skip
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(config))
    text = (Path(__file__).resolve().parents[1] / "docs" / "python.md").read_text()
    section = text.split("\n## Plans\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert '"configs/plan.yaml"' in code
    namespace = {"Editor": __import__("edit_rt.runtime.apps.editor", fromlist=["Editor"]).Editor}
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code.replace('"configs/plan.yaml"', repr(str(tmp_path / "plan.yaml"))), "docs/python.md", "exec"), namespace)
    finally:
        os.chdir(here)
    outcome, best = namespace["outcome"], namespace["best"]
    assert len(outcome.variants) == 6 and best is outcome.variants[outcome.best] and best.trajectory.shape == (64, 3)
    assert (tmp_path / "plans.png").stat().st_size > 1000
