"""`make quality`'s slider section: the shapes world's concept sliders through edit-rt, side by
side with the same LoRA applied by diffusers over the whole chain and over the same tail.

On the same bases (the shapes world's prompts and seeds, the same initial latents for both
engines), the same scales (-2..2 in 9 steps), from the config's default tail:

- ``edit-rt tail``: one base generation each, then each slider's sweep as ONE batched tail of
  K steps (9 rows; every slider resident in an adapter slot at once);
- ``diffusers tail``: diffusers' UNet and DDIM from the same entry step with the adapter on
  (export/eval/slider_eval.py ``sweep(mode="tail")``): the same computation, another engine;
- ``diffusers whole``: ``set_adapters`` + a full generation per scale (what the Concept Sliders
  scripts do): T UNet steps per image instead of K.

Each is read by export/eval/slider_eval.py's ``slider_metrics`` (does the attribute follow the scale,
its range, is the rest preserved); two sliders at once by ``two_slider_metrics`` (edit-rt: A
swept with B held at each of ``held``). The UNet cost per image is reported with each. The bases
and the readers are those of the model's world (``shapes.world_of``: 1 or 2).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from edit_rt.runtime.config.run_config import RunConfig
from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.model.edit import Base, TailRow
from edit_rt.runtime.pipeline.images import to_uint8

from ..world.shapes import world_of
from .slider_eval import SCALES, plot_sliders, slider_metrics, sweep, two_slider_metrics, world_bases, _initial_latents

log = logging.getLogger(__name__)

SLIDER_FILE = "pytorch_lora_weights.safetensors"


def slider_files(sliders_dir: Path) -> dict[str, Path]:
    """The committed sliders: name -> LoRA file (``sliders/<name>/pytorch_lora_weights.safetensors``)."""
    return {d.name: d / SLIDER_FILE for d in sorted(Path(sliders_dir).iterdir()) if (d / SLIDER_FILE).is_file()}


def slider_quality(cfg: RunConfig, sliders_dir: Path, bases: int = 50, scales: Sequence[float] = SCALES,
                   held: Sequence[float] = (-1.5, 1.5), say: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """The section's report (written to ``cfg.output_dir``/sliders.json and sliders.png)."""
    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    from ..compile.adapters import convert_adapters
    from ..compile.onnx_export import export_onnx

    files = slider_files(sliders_dir)
    if not files:
        raise FileNotFoundError(f"{sliders_dir}: no sliders (<name>/{SLIDER_FILE}); run `make sliders`")
    root = Path(cfg.build_dir) / cfg.model_name
    onnx = root / "onnx-sliders"
    if not (onnx / "manifest.json").is_file() or load_manifest(onnx).adapters["slots"] < len(files):
        say(f"quality: exporting {cfg.model} with {len(files)} adapter slots")
        export_onnx(cfg.model_dir, onnx, adapter_slots_n=len(files), adapter_rank=8)
    converted = convert_adapters(cfg.model_dir, load_manifest(onnx), files, root / "adapters-sliders")
    base_cfg, T = cfg.base, cfg.base.steps
    K = max(1, round(cfg.cache.default_tail_fraction * T))
    entry = T - K
    world = world_of(cfg.model_dir)
    eval_bases = world_bases(bases, world=world)
    scales = [float(s) for s in scales]

    pipe = StableDiffusionPipeline.from_pretrained(cfg.model_dir, safety_checker=None, requires_safety_checker=False)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    for name, path in files.items():
        pipe.load_lora_weights(str(path), adapter_name=name)

    say(f"quality: sliders {', '.join(files)} through edit-rt, {bases} bases x {len(scales)} scales, {K}-step tails")
    ours = {name: np.zeros((bases, len(scales), base_cfg.height, base_cfg.width, 3), dtype=np.uint8) for name in files}
    pairs = [(a, b, h) for a in files for b in files if a != b for h in held]
    both = {key: np.zeros_like(ours[key[0]]) for key in pairs}
    with EditPipeline(onnx, cfg.model_dir, threads=cfg.threads, image_size=(base_cfg.height, base_cfg.width),
                      adapters=converted) as rt:  # fmt: skip
        for i, b in enumerate(eval_bases):
            noise = _initial_latents(pipe, [b], base_cfg.height, base_cfg.width).numpy()
            base = Base(prompt=b.prompt, negative_prompt="", seed=b.seed, steps=T, guidance=base_cfg.guidance,
                        width=base_cfg.width, height=base_cfg.height)  # fmt: skip
            state = rt.generate_base(base, noise=noise)
            for name in files:
                rows = [TailRow(b.prompt, 1.0, entry, base.guidance, adapters={name: (s, s)}) for s in scales]
                ours[name][i] = to_uint8(rt.decode(rt.run_tail(state, rows)))
            for a, other, h in pairs:
                rows = [TailRow(b.prompt, 1.0, entry, base.guidance, adapters={a: (s, s), other: (h, h)}) for s in scales]
                both[(a, other, h)][i] = to_uint8(rt.decode(rt.run_tail(state, rows)))
    say("quality: the same sliders through diffusers, over the same tail and over the whole chain")
    with torch.no_grad():
        theirs = {mode: {name: sweep(pipe, eval_bases, name, scales, mode=mode, held={o: 0.0 for o in files if o != name},
                                     steps=T, guidance=base_cfg.guidance, tail_fraction=K / T, size=base_cfg.width)
                         for name in files} for mode in ("tail", "whole")}  # fmt: skip
    methods = {"edit-rt tail": ours, "diffusers tail": theirs["tail"], "diffusers whole": theirs["whole"]}
    rows_per_image = {"edit-rt tail": K, "diffusers tail": K, "diffusers whole": T}
    report = {
        "world": world, "bases": bases, "scales": scales, "steps": T, "tail_steps": K, "entry_step": entry,
        "sliders": sorted(files),
        "methods": {m: {"unet_steps_per_image": rows_per_image[m], "metrics": slider_metrics(s, scales, world)} for m, s in methods.items()},
        "two_sliders": two_slider_metrics(both, scales, world),
        # the same computation on two engines: how far apart their uint8 images are
        "edit_rt_vs_diffusers_tail": {name: {"max_abs": int(np.abs(ours[name].astype(int) - theirs["tail"][name]).max()),
                                             "mean_abs": float(np.abs(ours[name].astype(int) - theirs["tail"][name]).mean())}
                                      for name in files},  # fmt: skip
    }
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sliders.json").write_text(json.dumps(report, indent=2))
    plot_sliders({m: v["metrics"] for m, v in report["methods"].items()}, scales, out / "sliders.png")
    return report
