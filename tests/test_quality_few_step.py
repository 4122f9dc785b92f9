"""`make quality-lcm` (export/eval/quality_few_step.py) measures what users run: its edit-rt rows
are the images `edit-rt run` writes for the same base and edits, and its img2img baseline is
diffusers' LCM-LoRA recipe (LCMScheduler, load_lora_weights). On the session's tiny model with a
random UNet-only rank-8 LoRA declared as a speed LoRA (lcm, 4 steps, guidance 1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from typer.testing import CliRunner

from edit_rt.export.compile.adapters import convert_adapters
from edit_rt.export.eval.quality_few_step import edit_rt_images, few_step_pipeline, img2img_image, lcm_img2img
from edit_rt.runtime.apps.cli import app
from edit_rt.runtime.config.load import load_config
from edit_rt.runtime.engine.manifest import load_manifest

from .test_adapters import make_lora

EDITS = {"colour": (None, "a green circle on a blue background"), "shape": (None, "a red square on a blue background")}


@pytest.fixture(scope="module")
def lora(model_dir, tmp_path_factory) -> Path:
    return make_lora(model_dir, tmp_path_factory.mktemp("fast-lora"), seed=5, rank=8, alpha=8.0, text=False)


@pytest.fixture(scope="module")
def config(model_dir, adapter_onnx_dir, lora, tmp_path_factory) -> Path:
    """A config file whose base runs the LoRA's schedule (as configs/shapes-lcm.yaml), its
    adapter converted (named apart from other modules' LoRAs in the shared export)."""
    convert_adapters(model_dir, load_manifest(adapter_onnx_dir), {"fast": lora}, adapter_onnx_dir.parent / "adapters")
    folder = tmp_path_factory.mktemp("few-step")
    data = {"model": str(model_dir), "build_dir": str(adapter_onnx_dir.parent.parent), "output_dir": str(folder / "out"),
            "adapters": {"fast": {"path": str(lora), "sampler": "lcm", "steps": 4, "guidance": 1.0}},
            "export": {"adapter_slots": 3, "adapter_rank": 8}, "store": {"ram_mb": 16, "disk_dir": str(folder / "bases")},
            "base": {"prompt": "a red circle on a blue background", "negative_prompt": "", "seed": 0, "width": 32,
                     "height": 32, "adapters": {"fast": 1.0}}}  # fmt: skip
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_few_step_rows_are_the_images_edit_rt_run_writes(config):
    cfg = load_config(config)
    assert (cfg.base.sampler, cfg.base.steps, cfg.base.guidance) == ("lcm", 4, 1.0)
    with few_step_pipeline(cfg) as pipe:
        images, unet_rows = edit_rt_images(pipe, pipe.generate_base(cfg.base), EDITS)
    # an unguided row-step is one UNet row: a k-step tail costs k
    assert unet_rows == {(p, k): float(k) for p in ("none", "auto") for k in (1, 2)}
    keys = sorted(images)
    data = yaml.safe_load(config.read_text())
    data["edits"] = [{"prompt": EDITS[kind][1], "tail_steps": tail, "strength": s, "preserve": p} for p, kind, tail, s in keys]
    run_config = config.with_name("run.yaml")
    run_config.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["run", str(run_config)])
    assert result.exit_code == 0, result.output
    out = Path(data["output_dir"])
    for k, key in enumerate(keys):
        written = np.asarray(Image.open(out / f"edit_{k:02d}.png").convert("RGB")).astype(int)
        ours = np.round(np.clip(images[key], 0, 1) * 255).astype(int)
        # one batched call per tail here, another batch there: fp32 sums in another order may
        # move a value across a rounding boundary, never further
        assert np.abs(written - ours).max() <= 1, key
    plain = [k for k in keys if k[0] == "none"]
    assert len({images[k].tobytes() for k in plain}) == len(plain)  # every tail, strength and prompt its own image


def test_the_img2img_baseline_is_diffusers_lcm_lora_recipe(config, model_dir, lora):
    from diffusers import LCMScheduler, StableDiffusionImg2ImgPipeline

    cfg = load_config(config)
    ours_pipe = lcm_img2img(cfg, "fast", 1.0)
    image = np.random.default_rng(0).random((32, 32, 3)).astype(np.float32)
    ours = img2img_image(ours_pipe, EDITS["colour"][1], image, tail=2, steps=4, guidance=1.0, seed=3)

    reference = StableDiffusionImg2ImgPipeline.from_pretrained(model_dir, safety_checker=None, requires_safety_checker=False)
    reference.scheduler = LCMScheduler.from_config(reference.scheduler.config)
    reference.set_progress_bar_config(disable=True)

    def draw() -> np.ndarray:
        return reference(EDITS["colour"][1], image=image[None], strength=0.5, num_inference_steps=4, guidance_scale=1.0,
                         output_type="np", generator=torch.Generator().manual_seed(3)).images[0]  # fmt: skip

    without = draw()
    reference.load_lora_weights(str(lora))
    np.testing.assert_allclose(ours, draw(), atol=1e-6)
    assert np.abs(ours - without).max() > 1e-2  # the LoRA is in it


def test_a_config_without_a_speed_lora_is_refused_in_one_line(config, monkeypatch, capsys):
    """`edit-rt quality --few-step` on a base that runs no speed LoRA: exit 2, one line naming the fix."""
    import sys

    from edit_rt.runtime.apps import cli

    data = yaml.safe_load(config.read_text())
    data["base"].pop("adapters")
    plain = config.with_name("plain.yaml")
    plain.write_text(yaml.safe_dump(data))
    monkeypatch.setattr(sys, "argv", ["edit-rt", "quality", str(plain), "--few-step"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {plain}: base.adapters uses no speed LoRA") and "--few-step" in lines[0]
