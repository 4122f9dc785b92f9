"""The LCM-LoRA distillation (export/world/lcm_distill.py) on the session's tiny model: its
boundary condition and solver grid are LCMScheduler's, the LoRA it saves is what diffusers'
load_lora_weights applies (against the low-rank update merged by hand), and a run cut at a piece
and resumed ends where an uncut run does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edit_rt.export.world.lcm_distill import DDIMSolver, LcmSpec, boundary_scalings, train_lcm

# toy sizes: a few distillation steps of a handful of scenes take a second or two
SPEC = LcmSpec(scenes=8, batch=2, rank=4, alpha=8.0)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these tests are a few small UNet calls, which a second thread hardly
    speeds up and a busy 2-core machine slows ~7x (oversubscribed threads, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_boundary_condition_and_grid_are_lcm_schedulers():
    from diffusers import LCMScheduler

    scheduler = LCMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    solver = DDIMSolver(scheduler.alphas_cumprod, 50)
    scheduler.set_timesteps(50)  # 50 of the 50 origin steps: the grid itself, descending
    assert solver.timesteps.tolist() == sorted(scheduler.timesteps.tolist())
    assert solver.skip == 20
    t = torch.tensor([0, 19, 259, 999])
    c_skip, c_out = boundary_scalings(t)
    for i, step in enumerate(t.tolist()):
        ref_skip, ref_out = scheduler.get_scalings_for_boundary_condition_discrete(step)
        assert c_skip[i].item() == pytest.approx(float(ref_skip), rel=1e-6)
        assert c_out[i].item() == pytest.approx(float(ref_out), rel=1e-6, abs=1e-12)


def _merged_unet(model_dir, lora_file, spec):
    """The base UNet with W + (alpha / r) B A added into each adapted layer by hand."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file

    unet = UNet2DConditionModel.from_pretrained(model_dir / "unet").eval()
    tensors = load_file(lora_file)
    layers = {k.removeprefix("unet.").removesuffix(".lora_A.weight") for k in tensors if k.endswith("lora_A.weight")}
    assert layers, "the file holds no LoRA layers"
    with torch.no_grad():
        for name in layers:
            a, b = tensors[f"unet.{name}.lora_A.weight"], tensors[f"unet.{name}.lora_B.weight"]
            weight = unet.get_submodule(name).weight
            delta = (spec.alpha / spec.rank) * (b.flatten(1) @ a.flatten(1))
            weight += delta.view(weight.shape)
    return unet, len(layers)


def test_distilled_lora_loads_in_diffusers_and_changes_the_unet(model_dir, tmp_path):
    from diffusers import StableDiffusionPipeline

    report = train_lcm(model_dir, SPEC, tmp_path / "lora", tmp_path / "ckpt", minutes=0, piece_minutes=0, max_steps=2)
    assert report["steps"] == 2 and report["finished"] and len(report["loss"]) == 2
    assert all(".attentions." in n for n in report["adapted_modules"])  # only what the adapter slots carry
    pipe = StableDiffusionPipeline.from_pretrained(str(model_dir), safety_checker=None, requires_safety_checker=False)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([999, 259])
    context = torch.randn(2, 77, pipe.text_encoder.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = pipe.unet(x, t, context).sample
        pipe.load_lora_weights(str(tmp_path / "lora"), adapter_name="lcm")
        loaded = pipe.unet(x, t, context).sample
        merged_unet, n_layers = _merged_unet(model_dir, tmp_path / "lora" / "pytorch_lora_weights.safetensors", SPEC)
        merged = merged_unet(x, t, context).sample
    assert n_layers == len(report["adapted_modules"])
    assert (loaded - base).abs().max().item() > 1e-4  # the LoRA moved the UNet
    torch.testing.assert_close(loaded, merged, atol=1e-5, rtol=1e-5)


def test_a_run_cut_at_a_piece_and_resumed_equals_an_uncut_run(model_dir, tmp_path):
    uncut = train_lcm(model_dir, SPEC, None, tmp_path / "uncut", minutes=0, piece_minutes=0, max_steps=3)
    # a piece of ~0 minutes stops after its first step, its state saved
    first = train_lcm(model_dir, SPEC, None, tmp_path / "cut", minutes=0, piece_minutes=1e-9, max_steps=3)
    assert not first["finished"] and first["steps"] == 1 and first["stopped_by"] == "piece"
    resumed = train_lcm(model_dir, SPEC, None, tmp_path / "cut", minutes=0, piece_minutes=0, max_steps=3)
    assert resumed["finished"] and resumed["steps"] == 3 and resumed["pieces"] == 2
    assert resumed["loss"] == uncut["loss"]
    a = torch.load(tmp_path / "uncut" / "state.pt", weights_only=False)["lora"]
    b = torch.load(tmp_path / "cut" / "state.pt", weights_only=False)["lora"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)  # trained, not the zero init
    # a checkpoint of another spec is refused, not silently mixed in
    with pytest.raises(ValueError, match="another spec"):
        train_lcm(model_dir, dataclasses.replace(SPEC, seed=1), None, tmp_path / "cut", max_steps=5)
