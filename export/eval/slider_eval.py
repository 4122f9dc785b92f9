"""Does a concept slider follow its scale, and leave the rest alone? Measured on the shapes world.

Two halves, kept apart so that edit-rt's runtime can feed its own images into the second:

1. *Images* (diffusers): for bases (prompt, seed) of the shapes world and slider scales (default
   -2..2 in 9 steps), ``sweep`` draws each base at each scale with a
   ``StableDiffusionPipeline`` (DDIM) that has the slider loaded (``load_lora_weights``), either
   with the LoRA over the whole chain (the pipeline's own call, after ``set_adapters``) or over
   the tail only: the chain at scale 0 up to the entry step ``steps * (1 - tail_fraction)``
   (18 of 30 at the default 0.4), then the adapter on for the remaining steps, in a denoising
   loop written out here with the pipeline's UNet and scheduler, from the latents the pipeline
   itself would draw (so at scale 0 it reproduces the pipeline's image).
2. *Metrics* (numpy): ``slider_metrics`` takes, per slider, uint8 images [bases, scales, H, W, 3]
   and reads them with the shapes world's readers:

   - *follows*: per base, the Spearman correlation of the scale against the slider's attribute
     (``saturation``; ``stroke``; ``sharpness`` negated, since blur lowers it); reported as the
     share of bases with rho >= 0.9 (the issue's goal: >= 0.9 for >= 90% of bases) and the
     median rho;
   - *range*: the mean over bases of the attribute's max - min across the scales;
   - *scene preserved*: the share of images (bases x non-zero scales) whose scene, read by
     ``read_any_look`` (shape, position, colour and background names, read so that the three
     attributes do not disturb it), equals the scale-0 image's; bases whose scale-0 image reads
     as nothing are left out;
   - *cross-talk*: for each other attribute, the mean over those images of its change from the
     scale-0 image, relative to that attribute's own range under its own slider;
   - *preserved*: the share of images whose scene is preserved and whose other two attributes
     each moved by less than ``CROSS_TOLERANCE`` of their own slider's range (the issue's goal:
     >= 0.95).

   ``two_slider_metrics`` does the *follows* measure for slider A swept while slider B is held
   at a fixed scale.

Both halves work in either shapes world: ``evaluate_sliders`` takes the world from the model
folder (``shapes.world_of``: 1 for the 32x32 model, 2 for the 64x64 one) and draws that world's
bases at its image size; the metrics take ``world`` to read with that world's readers
(``readers``; default 1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from edit_rt.runtime.pipeline.images import to_uint8

from ..world.look_round_trip import spearman
from ..world.looks import read_any_look, saturation, sharpness, stroke
from ..world.shapes import WORLD_SIZES, prompt, random_scene, world_of

log = logging.getLogger(__name__)

SCALES = tuple(float(s) for s in np.linspace(-2.0, 2.0, 9))
# slider -> (reader, the sign that makes it rise with the slider)
READERS: dict[str, tuple[Callable[[np.ndarray], float], float]] = {
    "saturation": (saturation, 1.0),
    "stroke": (stroke, 1.0),
    "blur": (sharpness, -1.0),
}


def readers(world: int = 1) -> dict[str, tuple[Callable[[np.ndarray], float], float]]:
    """``READERS`` for ``world``'s images: the stroke reader is the one that reads each world
    its own way (``looks.stroke``)."""
    return READERS if world == 1 else {**READERS, "stroke": (partial(stroke, world=world), 1.0)}


FOLLOWS_RHO = 0.9  # the bar for "follows its scale" on one base
# An other attribute moved by less than this share of its own slider's range counts as kept:
# on renders, the readers themselves couple by up to ~0.2 (an outline lowers sharpness).
CROSS_TOLERANCE = 0.25


@dataclass(frozen=True)
class EvalBase:
    prompt: str
    seed: int


def world_bases(n: int, seed: int = 0, world: int = 1) -> list[EvalBase]:
    """``n`` bases of the shapes world ``world``: random scenes' prompts, each with its own seed."""
    rng = np.random.default_rng(seed)
    return [EvalBase(prompt(random_scene(rng, world)), 1000 * seed + i) for i in range(n)]


# 1. images (diffusers)


def _set_weights(pipe, weights: dict[str, float]) -> None:
    pipe.set_adapters(list(weights), adapter_weights=list(weights.values()))


def _initial_latents(pipe, bases: Sequence[EvalBase], height: int, width: int):
    """The latents ``pipe(..., generator=[one per base])`` starts from (prepare_latents)."""
    import torch

    shape = (1, pipe.unet.config.in_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    latents = torch.cat([torch.randn(shape, generator=torch.Generator().manual_seed(b.seed)) for b in bases])
    return latents * pipe.scheduler.init_noise_sigma


def _denoise(pipe, latents, context, timesteps, guidance: float):
    """DDIM steps ``timesteps`` from ``latents`` with classifier-free guidance, as the pipeline's
    loop does them (uncond first in the batch; eta = 0)."""
    import torch

    with torch.no_grad():
        for t in timesteps:
            eps_uncond, eps_text = pipe.unet(torch.cat([latents] * 2), t, encoder_hidden_states=context).sample.chunk(2)
            eps = eps_uncond + guidance * (eps_text - eps_uncond)  # Ho & Salimans 2022, eq. 6
            latents = pipe.scheduler.step(eps, t, latents).prev_sample
    return latents


def _decode(pipe, latents) -> np.ndarray:
    import torch

    with torch.no_grad():
        image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
    return to_uint8(pipe.image_processor.postprocess(image, output_type="np"))


def sweep(
    pipe,
    bases: Sequence[EvalBase],
    adapter: str,
    scales: Sequence[float] = SCALES,
    mode: str = "tail",
    held: Optional[dict[str, float]] = None,
    steps: int = 30,
    guidance: float = 4.0,
    tail_fraction: float = 0.4,
    size: int = 32,
) -> np.ndarray:
    """uint8 [bases, scales, size, size, 3]: each base drawn with ``adapter`` at each scale (and
    the adapters in ``held`` at their fixed scales), over the whole chain (``mode="whole"``) or
    over the tail only (``"tail"``: every adapter at 0 before the entry step)."""
    import torch

    if mode not in ("whole", "tail"):
        raise ValueError(f"mode must be 'whole' or 'tail', not {mode!r}")
    held = dict(held or {})
    prompts = [b.prompt for b in bases]
    out = np.zeros((len(bases), len(scales), size, size, 3), dtype=np.uint8)
    if mode == "whole":
        for j, s in enumerate(scales):
            _set_weights(pipe, {adapter: float(s), **held})
            generators = [torch.Generator().manual_seed(b.seed) for b in bases]
            images = pipe(prompts, negative_prompt=[""] * len(bases), num_inference_steps=steps, guidance_scale=guidance,
                          generator=generators, height=size, width=size, output_type="np").images  # fmt: skip
            out[:, j] = to_uint8(images)
        return out
    entry = int(round(steps * (1.0 - tail_fraction)))
    with torch.no_grad():
        positive, negative = pipe.encode_prompt(prompts, "cpu", 1, True, negative_prompt=[""] * len(bases))
    context = torch.cat([negative, positive])
    pipe.scheduler.set_timesteps(steps)
    timesteps = pipe.scheduler.timesteps
    _set_weights(pipe, {adapter: 0.0, **{k: 0.0 for k in held}})
    start = _denoise(pipe, _initial_latents(pipe, bases, size, size), context, timesteps[:entry], guidance)
    for j, s in enumerate(scales):
        _set_weights(pipe, {adapter: float(s), **held})
        out[:, j] = _decode(pipe, _denoise(pipe, start, context, timesteps[entry:], guidance))
    return out


# 2. metrics (numpy only: any images will do)


def readings(images: np.ndarray, world: int = 1) -> dict[str, np.ndarray]:
    """Every attribute's reading, [bases, scales], of uint8 images [bases, scales, H, W, 3] of ``world``."""
    flat = images.reshape(-1, *images.shape[2:])
    return {name: np.array([reader(im) for im in flat]).reshape(images.shape[:2]) for name, (reader, _) in readers(world).items()}


def _follows(values: np.ndarray, scales: Sequence[float], sign: float) -> dict:
    rhos = np.array([spearman(scales, sign * row) for row in values])
    return {"share_rho_ge_0.9": float(np.mean(rhos >= FOLLOWS_RHO)), "median_rho": float(np.median(rhos)), "rho": rhos.round(3).tolist()}


def slider_metrics(sweeps: dict[str, np.ndarray], scales: Sequence[float] = SCALES, world: int = 1) -> dict[str, dict]:
    """Per slider (module docstring): follows, range, scene preserved, cross-talk, preserved.
    ``sweeps[name]`` is uint8 [bases, len(scales), H, W, 3] of ``world``, ``scales`` must hold 0
    (the reference every image is compared with); cross-talk needs the other sliders' sweeps for
    their ranges, and is left out for an attribute whose slider is not in ``sweeps``."""
    scales = [float(s) for s in scales]
    if 0.0 not in scales:
        raise ValueError(f"scales {scales} must include 0, the image every other is compared with")
    zero = scales.index(0.0)
    read = {name: readings(images, world) for name, images in sweeps.items()}
    ranges = {name: float(np.mean(np.ptp(read[name][name], axis=1))) for name in sweeps}
    report = {}
    for name, images in sweeps.items():
        if name not in READERS:
            raise ValueError(f"unknown slider {name!r}: one of {sorted(READERS)}")
        values = read[name]
        scenes = [[read_any_look(im, world) for im in row] for row in images]
        kept_scene, kept, cross = [], [], {o: [] for o in READERS if o != name}
        for b, row in enumerate(scenes):
            if row[zero] is None:
                continue
            for j, scene in enumerate(row):
                if j == zero:
                    continue
                same = scene == row[zero]
                moved = {o: abs(values[o][b, j] - values[o][b, zero]) / ranges[o] for o in cross if ranges.get(o)}
                for o, m in moved.items():
                    cross[o].append(m)
                kept_scene.append(same)
                kept.append(same and all(m < CROSS_TOLERANCE for m in moved.values()))
        report[name] = {
            **_follows(values[name], scales, READERS[name][1]),
            "range": ranges[name],
            "curve": values[name].mean(axis=0).round(4).tolist(),
            "curve_std": values[name].std(axis=0).round(4).tolist(),
            "scene_preserved": float(np.mean(kept_scene)) if kept_scene else None,
            "cross_talk": {o: float(np.mean(v)) for o, v in cross.items() if v},
            "preserved": float(np.mean(kept)) if kept else None,
            "readable_bases": int(sum(row[zero] is not None for row in scenes)),
            "bases": len(images),
        }
    return report


def two_slider_metrics(sweeps: dict[tuple[str, str, float], np.ndarray], scales: Sequence[float], world: int = 1) -> dict[str, dict]:
    """``sweeps[(a, b, scale_b)]``: uint8 [bases, len(scales), H, W, 3] of ``world``, slider ``a``
    swept at ``scales`` with slider ``b`` held at ``scale_b``; per key, does a's attribute still
    follow a."""
    report = {}
    for (a, b, held), images in sweeps.items():
        reader, sign = readers(world)[a]
        values = np.array([[reader(im) for im in row] for row in images])
        report[f"{a} swept, {b} at {held:+g}"] = {**_follows(values, scales, sign), "range": float(np.mean(np.ptp(values, axis=1)))}
    return report


def plot_sliders(metrics: dict[str, dict[str, dict]], scales: Sequence[float], path: Path) -> None:
    """Attribute vs scale per slider (mean over bases, +- one std), one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({n for per_mode in metrics.values() for n in per_mode})
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.0), squeeze=False)
    labels = {"saturation": "saturation (mean chroma)", "stroke": "stroke (px of outline)", "blur": "sharpness (1 / edge px)"}
    for ax, name in zip(axes[0], names):
        for mode, per_mode in metrics.items():
            m = per_mode.get(name)
            if m is None:
                continue
            mean, std = np.array(m["curve"]), np.array(m["curve_std"])
            ax.plot(scales, mean, marker="o", ms=3, label=f"{mode}: {m['share_rho_ge_0.9']:.0%} of bases rho>=0.9")
            ax.fill_between(scales, mean - std, mean + std, alpha=0.15)
        ax.set(title=f"{name} slider", xlabel="slider scale", ylabel=labels.get(name, name))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def evaluate_sliders(
    model_dir: Path,
    slider_dir: Path,
    names: Sequence[str],
    n_bases: int = 30,
    scales: Sequence[float] = SCALES,
    two_slider_scales: Sequence[float] = (-2.0, -1.0, 0.0, 1.0, 2.0),
    held_scales: Sequence[float] = (-1.0, 1.0),
    steps: int = 30,
    guidance: float = 4.0,
    tail_fraction: float = 0.4,
    seed: int = 0,
) -> tuple[dict, dict[str, np.ndarray]]:
    """The whole measurement on the diffusers side: every slider in ``slider_dir/<name>/`` swept
    over ``n_bases`` bases of the model's world (``world_of``) at its image size, whole chain and
    tail, then each slider swept with the next one held at each of ``held_scales`` (tail only,
    where edit-rt runs them). Returns the report and the tail sweeps' images by slider (for a
    contact sheet)."""
    import time

    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(model_dir), safety_checker=None, requires_safety_checker=False)
    if not isinstance(pipe.scheduler, DDIMScheduler):
        raise ValueError(f"{model_dir}: the slider measurement runs DDIM, the scheduler is {type(pipe.scheduler).__name__}")
    pipe.set_progress_bar_config(disable=True)
    for name in names:
        pipe.load_lora_weights(str(Path(slider_dir) / name), adapter_name=name)
    world = world_of(model_dir)
    bases = world_bases(n_bases, seed, world)
    settings = dict(steps=steps, guidance=guidance, tail_fraction=tail_fraction)
    size = WORLD_SIZES[world]
    report: dict = {"world": world, "bases": n_bases, "scales": list(scales), **settings, "seconds": {}}
    tails: dict[str, np.ndarray] = {}
    for mode in ("whole", "tail"):
        start = time.perf_counter()
        sweeps = {name: sweep(pipe, bases, name, scales, mode=mode, size=size, **settings) for name in names}
        report[mode] = slider_metrics(sweeps, scales, world)
        report["seconds"][mode] = round(time.perf_counter() - start, 1)
        log.info("%s: %s (%.0f s)", mode, {n: m["share_rho_ge_0.9"] for n, m in report[mode].items()}, report["seconds"][mode])
        if mode == "tail":
            tails = sweeps
    start = time.perf_counter()
    pairs = {}
    # each slider swept with the next one held (saturation with stroke, stroke with blur, blur
    # with saturation): every slider is swept once and held once, at a third of the cost of all
    for a, b in zip(names, list(names[1:]) + list(names[:1])):
        if a == b:
            continue
        for held in held_scales:
            pairs[(a, b, float(held))] = sweep(pipe, bases, a, two_slider_scales, mode="tail", held={b: float(held)}, size=size, **settings)
    report["two_sliders"] = two_slider_metrics(pairs, two_slider_scales, world)
    report["two_slider_scales"] = list(two_slider_scales)
    report["seconds"]["two_sliders"] = round(time.perf_counter() - start, 1)
    return report, tails
