"""`edit-rt quality CONFIG --few-step`: `make quality` for a few-step model (a speed LoRA's schedule).

The config's base uses a speed LoRA (``adapters: {lcm: {path, sampler: lcm, steps: 4, guidance:
1.0}}``, ``base.adapters: {lcm: 1.0}``: configs/shapes-lcm.yaml), so its bases run that schedule
(4 LCM steps, guidance 1, one UNet row a step). On the bases of `make quality`: the scenes,
seeds and edit prompts ``quality_bases`` draws for its 30-step DDIM chain (its scenes depend on
how that chain's earlier bases read, so those bases are generated too), each base generated
again on the few-step chain and read by the same judge; an edit's target is its prompt's new
value over what the few-step base shows. Measured:

- edit-rt, through the config's own pipeline (its adapters loaded, as `edit-rt run` assembles it),
  at 1- and 2-step tails and strengths 1 and 1.5, ``preserve: none`` and ``preserve: auto`` at
  the config's knobs; the UNet rows each edit ran, counted by the step loop;
- an identity edit per base at each tail (the base's own prompt): its largest 8-bit grey-level
  difference from the base, which must be 0;
- the baseline an LCM-LoRA user would otherwise run: diffusers' ``StableDiffusionImg2ImgPipeline``
  with ``LCMScheduler`` and the LoRA (``load_lora_weights`` at the base's scale), at strength
  k/T over the same T steps and guidance, its noise from the base's seed;
- prompt following of the few-step generations, as `make quality` measures it.

The methods of `make quality` that do not apply to a few-step chain are not run; the report's
``left_out`` says why for each. Writes quality.json.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np

from edit_rt.runtime.config.run_config import RunConfig, SpeedAdapter
from edit_rt.runtime.errors import ConfigError
from edit_rt.runtime.model.adapters import lora_source, normalize
from edit_rt.runtime.model.edit import TailRow
from edit_rt.runtime.pipeline.assemble import pipeline_of
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

from .judges import judge_of
from .quality import Tally, _prompt_following, knobs_label, quality_bases

log = logging.getLogger(__name__)

TAILS = (1, 2)  # of 4 steps: a 3-step tail re-runs most of the chain, no cheaper than a new base
STRENGTHS = (1.0, 1.5)
IMG2IMG = "img2img (LCM-LoRA)"
# configs/shapes.yaml's base: the chain whose bases and edits `make quality` draws
DEFAULT_SCHEDULE = {"sampler": None, "steps": 30, "guidance": 4.0, "adapters": None}

# make quality's methods that are not run on a few-step chain, and why
LEFT_OUT = {
    "uncond base, uncond base-corrected": "the rows run at guidance 1: there is no unconditional half to reuse",
    "deepcache 2, deepcache 3": "DeepCache reuses the deep features of an earlier full step of the tail; a 1-2-step "
                                "tail has at most one step after its first",
    "p2p": "export/eval/p2p.py runs DDIM's deterministic update over the tail, not LCM's (which re-noises between steps)",
    "structure 0.25, 0.5, 1": "measured on the 30-step chain only (its fractions of a 1-2-step tail round to the "
                              "whole tail or none)",
    "edit-rt (real), img2img (real)": "a picture is inverted with DDIM and its edits run DDIM (run.py refuses another "
                                      "sampler for a base from an image): no LCM chain to re-enter",
}  # fmt: skip


def speed_lora_of(cfg: RunConfig) -> tuple[str, SpeedAdapter, float]:
    """The speed LoRA the config's base runs (its name, declaration, UNet scale), or a
    ConfigError naming the fix."""
    for name, (_, unet) in normalize(cfg.base.adapters).items():
        if unet and name in cfg.speed_adapters:
            return name, cfg.speed_adapters[name], unet
    where = f"{cfg.source}: " if cfg.source is not None else ""
    raise ConfigError(f"{where}base.adapters uses no speed LoRA, so there is no few-step schedule to measure; declare "
                      "one (adapters: {lcm: {path: ..., sampler: lcm, steps: 4, guidance: 1.0}}) and set base.adapters: "
                      "{lcm: 1.0} (configs/shapes-lcm.yaml), or drop --few-step")  # fmt: skip


def few_step_pipeline(cfg: RunConfig) -> EditPipeline:
    """The config's pipeline with its adapters, as `edit-rt run` builds it, and the config's
    ``preserve:`` knobs for ``preserve: auto`` rows (not activated)."""
    pipe = pipeline_of(cfg)
    pipe.preservation.preserve = cfg.preserve
    return pipe


def edit_rt_images(pipe: EditPipeline, state, edits: Mapping[str, tuple[Any, str]], tails=TAILS, strengths=STRENGTHS,
                   preserves=("none", "auto")) -> tuple[dict[tuple, np.ndarray], dict[tuple, float]]:  # fmt: skip
    """Each edit of ``state``'s base (kind -> (target, prompt)) at every tail, strength and
    preserve mode: the images by (preserve, kind, tail, strength), and the UNet rows (halves
    included: a guided row-step is 2, an unguided one 1) per edit by (preserve, tail), from
    the step loop's counts. One batched tail per preserve mode and tail length."""
    base, T = state.base, state.base.steps
    stats = pipe.batcher(pipe.latent_shape(base)).scheduler.stats
    images, unet_rows = {}, {}
    for preserve in preserves:
        for tail in tails:
            keys = [(preserve, kind, tail, s) for kind in edits for s in strengths]
            rows = [TailRow(edits[kind][1], s, T - tail, base.guidance, preserve=preserve) for _, kind, _, s in keys]
            before = dataclasses.replace(stats)
            results = pipe.edit(state, rows)
            halves = 2 * (stats.row_steps - before.row_steps) - (stats.uncond_rows_skipped - before.uncond_rows_skipped) \
                - (stats.unguided_rows_skipped - before.unguided_rows_skipped)  # fmt: skip
            unet_rows[preserve, tail] = halves / len(rows)
            images.update((key, r.image) for key, r in zip(keys, results))
    return images, unet_rows


def lcm_img2img(cfg: RunConfig, name: str, scale: float):
    """diffusers' img2img as an LCM-LoRA's card runs it: ``LCMScheduler``, the LoRA loaded at
    ``scale`` (its UNet scale in the base)."""
    from diffusers import LCMScheduler, StableDiffusionImg2ImgPipeline

    pipe = StableDiffusionImg2ImgPipeline.from_pretrained(cfg.model_dir, safety_checker=None, requires_safety_checker=False)
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)
    weights = lora_source(cfg.adapters[name])
    pipe.load_lora_weights(str(weights.parent), weight_name=weights.name, adapter_name=name)
    pipe.set_adapters([name], adapter_weights=[scale])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def img2img_image(pipe, text: str, image: np.ndarray, tail: int, steps: int, guidance: float, seed: int) -> np.ndarray:
    """``image`` ([H, W, 3] in [0, 1]) re-drawn for ``text`` over the last ``tail`` of ``steps``
    (strength tail/steps), its noise from ``seed``, as `make quality`'s img2img rows."""
    import torch

    return pipe(text, image=image[None], strength=tail / steps, num_inference_steps=steps, guidance_scale=guidance,
                output_type="np", generator=torch.Generator().manual_seed(seed)).images[0]  # fmt: skip


def _grey_levels(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.round(a * 255) - np.round(b * 255)).max())


def run_few_step_quality(
    cfg: RunConfig,
    bases: int = 50,
    tails: tuple[int, ...] = TAILS,
    strengths: tuple[float, ...] = STRENGTHS,
    prompts: int = 100,
    say: Callable[[str], None] = log.info,
    progress: Optional[Callable[[int, str], Callable[[int], None]]] = None,
) -> dict[str, Any]:
    """The few-step table over ``bases`` of `make quality`'s bases; writes quality.json."""
    name, speed, scale = speed_lora_of(cfg)
    T, g = cfg.base.steps, cfg.base.guidance
    if judge_of(cfg.model_dir).world != 1:
        raise ConfigError(f"{cfg.model}: --few-step measures world-1 shapes models (configs/shapes-lcm.yaml) only")
    if max(tails) >= T:
        raise ConfigError(f"tails {tails}: each must be shorter than the base's {T} steps")
    started = time.perf_counter()
    pipe = few_step_pipeline(cfg).activate()
    say(f"quality (few-step): {cfg.base.sampler} {T} steps, guidance {g:g}, LoRA {name} x{scale:g}; "
        f"backend {pipe.graph_set.backend} ({pipe.graph_set.reason})")  # fmt: skip
    bar = progress or (lambda total, description: lambda n: None)
    judge = judge_of(cfg.model_dir)
    following = _prompt_following(pipe, cfg.base, prompts, judge, bar(prompts, "prompts")) if prompts else None
    img2img = lcm_img2img(cfg, name, scale)
    auto = knobs_label((cfg.preserve.threshold, cfg.preserve.dilate, cfg.preserve.region))
    methods = {"none": "edit-rt", "auto": auto}
    tallies: dict[tuple, Tally] = defaultdict(Tally)
    unet_rows: dict[tuple, list[float]] = defaultdict(list)
    identity: list[float] = []
    scenes: list[str] = []
    base_reads, default_reads, shown_already = 0, 0, 0
    advance = bar(bases, "bases")
    # make quality's bases and edit prompts: its scenes are drawn after the edits of the bases
    # before, which depend on how its own chain's bases read, so that chain is generated too
    default = dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, **DEFAULT_SCHEDULE))
    for b, (intended, drawn, _, default_image, _, default_edits) in enumerate(quality_bases(pipe, default, judge, bases)):
        scenes.append(drawn.prompt)
        default_reads += judge.follow(default_image, intended)["all"]
        base = dataclasses.replace(cfg.base, prompt=drawn.prompt, seed=drawn.seed)
        state = pipe.generate_base(base)
        base_image = pipe.decode(state.final_latent)[0]
        seen = judge.base_reading(base_image, intended)
        base_reads += judge.follow(base_image, intended)["all"]
        same = pipe.edit(state, [TailRow(base.prompt, cfg.cache.default_strength, T - k, g) for k in tails])
        identity.append(max(_grey_levels(r.image, base_image) for r in same))
        if seen is None or default_edits is None:
            advance(1)
            continue  # no attributes to preserve (or no edits drawn: make quality skipped this base)
        # the same edit prompts; what each should show, as this base reads
        edits = {kind: (dataclasses.replace(seen, **{kind: getattr(target, kind)}), text) for kind, (target, text) in default_edits.items()}
        shown_already += sum(getattr(seen, kind) == getattr(target, kind) for kind, (target, _) in edits.items())
        images, rows = edit_rt_images(pipe, state, edits, tails, strengths)
        for (preserve, tail), n in rows.items():
            unet_rows[methods[preserve], tail].append(n)
        for (preserve, kind, tail, s), image in images.items():
            tallies[methods[preserve], kind, tail, s].add(judge.score(image, base_image, seen, edits[kind][0], kind))
        for kind, (target, text) in edits.items():
            for tail in tails:
                out = img2img_image(img2img, text, base_image, tail, T, g, seed=b)
                tallies[IMG2IMG, kind, tail, 1.0].add(judge.score(out, base_image, seen, target, kind))
        say(f"quality (few-step): base {b + 1}/{bases}")
        advance(1)
    pipe.deactivate()
    for tail in tails:  # diffusers at guidance <= 1 runs no unconditional half: one UNet row a step
        unet_rows[IMG2IMG, tail].append(float(tail if g <= 1 else 2 * tail))
    table = [{"method": m, "kind": k, "tail_steps": t, "tail_fraction": t / T, "strength": s,
              "unet_rows_per_edit": float(np.mean(unet_rows[m, t])) if unet_rows[m, t] else None, **tally.row()}
             for (m, k, t, s), tally in sorted(tallies.items())]  # fmt: skip
    report = {
        "model": str(cfg.model), "world": judge.world, "kinds": list(judge.kinds()), "bases": bases,
        "sampler": cfg.base.sampler, "steps": T, "guidance": g, "speed_lora": {"name": name, "path": str(speed.path), "scale": scale},
        "tails": list(tails), "strengths": list(strengths), "preserve": dataclasses.asdict(cfg.preserve),
        "base_prompt_following": base_reads / bases, "prompt_following": following, "rows": table,
        "identity_grey_levels": {"max": max(identity, default=0.0), "per_base": identity},
        "default_schedule": DEFAULT_SCHEDULE, "default_base_prompt_following": default_reads / bases,
        "edits_already_shown": shown_already, "left_out": LEFT_OUT, "scenes": scenes, "backend": pipe.graph_set.backend, "backend_reason": pipe.graph_set.reason,
        "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(report, indent=2))
    return report
