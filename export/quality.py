"""`edit-rt quality`: does an edit do what it says, and keep the rest? Measured by the reader.

On the shapes model, for bases drawn from the world and edits that change one attribute (the
shape's colour, the background's colour, the shape's kind), at several tail fractions K/T and
strengths: *success* = the reader finds the edit's target attribute; *preservation* = every
other attribute, the position included, reads as in the base. Side by side, the same edits as
a user would do them without edit-rt: diffusers' img2img at strength K/T on the base image with
the edit prompt (same model, same steps, fresh noise). Writes quality.json and quality.png.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from edit_rt.runtime.config import Base, RunConfig
from edit_rt.runtime.images import to_uint8
from edit_rt.runtime.pipeline import EditPipeline, TailRow

from .shapes import COLOURS, SHAPES, Scene, prompt, random_scene, read

EDIT_KINDS = ("colour", "background", "shape")


def edited(scene: Scene, kind: str, rng: np.random.Generator) -> Scene:
    """``scene`` with one attribute changed to another valid value."""
    if kind == "shape":
        return dataclasses.replace(scene, shape=str(rng.choice([s for s in SHAPES if s != scene.shape])))
    taken = {scene.colour, scene.background}
    new = str(rng.choice([c for c in COLOURS if c not in taken]))
    return dataclasses.replace(scene, **{kind: new})


FIELDS = tuple(f.name for f in dataclasses.fields(Scene))


def _read(image: np.ndarray) -> Scene | None:
    """The reader on a decoded image ([H, W, 3] in [0, 1]), quantized as a saved PNG would be."""
    return read(to_uint8(image))


def _score(result: Scene | None, target: Scene, base: Scene, kind: str) -> tuple[bool, bool, list[str]]:
    """(success, preserved, the other attributes that changed); an unreadable image fails both."""
    if result is None:
        return False, False, []
    changed = [f for f in FIELDS if f != kind and getattr(result, f) != getattr(base, f)]
    return getattr(result, kind) == getattr(target, kind), not changed, changed


def run_quality(
    cfg: RunConfig,
    bases: int = 50,
    fractions: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5),
    strengths: tuple[float, ...] = (0.5, 1.0, 1.5),
    default_fraction: float | None = None,
    prompts: int = 100,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The table over ``bases`` bases: edit-rt at every tail fraction (strength 1) and at every
    strength at ``default_fraction`` (the config's ``cache.default_tail_fraction`` unless given),
    img2img at every tail fraction; ``prompts`` generations measure prompt following first."""
    from diffusers import DDIMScheduler, StableDiffusionImg2ImgPipeline

    T = cfg.base.steps
    default_fraction = cfg.cache.default_tail_fraction if default_fraction is None else default_fraction
    settings = sorted({(f, 1.0) for f in fractions} | {(default_fraction, s) for s in strengths})
    pipe = EditPipeline(cfg.onnx_dir, cfg.model, threads=cfg.threads, image_size=(cfg.base.height, cfg.base.width)).activate()
    following = _prompt_following(pipe, cfg.base, prompts) if prompts else None
    img2img = StableDiffusionImg2ImgPipeline.from_pretrained(cfg.model, safety_checker=None, requires_safety_checker=False)
    img2img.scheduler = DDIMScheduler.from_config(img2img.scheduler.config)
    img2img.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(0)
    counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])  # n, success, preserved, both, unreadable
    changes: dict[tuple, dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    base_reads = 0
    for b in range(bases):
        intended = random_scene(rng)
        base = dataclasses.replace(cfg.base, prompt=prompt(intended), seed=b)
        state = pipe.generate_base(base)
        base_image = pipe.decode(state.final_latent)[0]
        seen = _read(base_image)
        base_reads += seen == intended
        if seen is None:
            continue  # an unreadable base has no attributes to preserve
        for kind in EDIT_KINDS:
            target = edited(seen, kind, rng)
            text = prompt(target)
            rows = [TailRow(text, s, T - max(1, round(f * T)), base.guidance) for f, s in settings]
            keys = [("edit-rt", kind, f, s) for f, s in settings]
            images = pipe.decode(pipe.run_tail(state, rows))
            results = [_read(im) for im in images]
            for f in fractions:
                out = img2img(text, image=base_image[None], strength=f, num_inference_steps=T, guidance_scale=base.guidance,
                              output_type="np", generator=torch.Generator().manual_seed(b)).images[0]  # fmt: skip
                results.append(_read(out))
                keys.append(("img2img", kind, f, 1.0))
            for key, result in zip(keys, results):
                ok, kept, changed = _score(result, target, seen, kind)
                c = counts[key]
                c[0] += 1
                c[1] += ok
                c[2] += kept
                c[3] += ok and kept
                c[4] += result is None
                for field in changed:
                    changes[key][field] += 1
        say(f"quality: base {b + 1}/{bases}")
    pipe.deactivate()
    table = [
        {"method": m, "kind": k, "tail_fraction": f, "strength": s, "n": c[0],
         "success": c[1] / c[0], "preservation": c[2] / c[0], "success_and_preserved": c[3] / c[0],
         "unreadable": c[4] / c[0], "changed": {field: n / c[0] for field, n in changes[m, k, f, s].items() if field != k}}
        for (m, k, f, s), c in sorted(counts.items())
    ]  # fmt: skip
    report = {"model": str(cfg.model), "steps": T, "bases": bases, "base_prompt_following": base_reads / bases,
              "prompt_following": following, "guidance": cfg.base.guidance, "default_tail_fraction": default_fraction, "rows": table}  # fmt: skip
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "quality.png")
    return report


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(EDIT_KINDS), figsize=(12, 3.4), sharey=True)
    for ax, kind in zip(axes, EDIT_KINDS):
        for method, colour in (("edit-rt", "tab:orange"), ("img2img", "tab:blue")):
            rows = [r for r in report["rows"] if r["method"] == method and r["kind"] == kind and r["strength"] == 1.0]
            rows.sort(key=lambda r: r["tail_fraction"])
            xs = [r["tail_fraction"] for r in rows]
            ax.plot(xs, [r["success"] for r in rows], "-o", color=colour, label=f"{method} success")
            ax.plot(xs, [r["preservation"] for r in rows], "--s", color=colour, label=f"{method} preserved")
        ax.set(title=f"edit: {kind}", xlabel="tail fraction K/T", ylim=(0, 1.02))
    axes[0].set_ylabel("rate over bases")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"edit-rt quality on the shapes model ({report['bases']} bases, T={report['steps']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def prompt_following(cfg: RunConfig, n: int = 100) -> dict[str, float]:
    """How often the reader finds, in the model's own generations, what their prompts asked for."""
    with EditPipeline(cfg.onnx_dir, cfg.model, threads=cfg.threads, image_size=(cfg.base.height, cfg.base.width)) as pipe:
        return _prompt_following(pipe, cfg.base, n)


def _prompt_following(pipe: EditPipeline, base: Base, n: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    hits: dict[str, int] = defaultdict(int)
    for k in range(n):
        scene = random_scene(rng)
        state = pipe.generate_base(dataclasses.replace(base, prompt=prompt(scene), seed=1000 + k))
        seen = _read(pipe.decode(state.final_latent)[0])
        if seen is None:
            continue
        for field in FIELDS:
            hits[field] += getattr(seen, field) == getattr(scene, field)
        hits["all"] += seen == scene
    return {field: hits[field] / n for field in (*FIELDS, "all")}
