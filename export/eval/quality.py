"""`edit-rt quality`: does an edit do what it says, and keep the rest? Measured on the shapes world.

On the shapes model, for bases drawn from the world and edits that change one attribute (the
shape's colour, the background's colour, the shape's kind), as a user would make them: the
base prompt with that one word replaced. Scores, per edit:

- *success*: the reader finds the edit's target attribute; *preservation*: every other
  attribute, position included, reads as in the base; *both*;
- *untouched PSNR*: PSNR (8-bit, capped at 60 dB for identical pixels) of the region the edit
  should not touch, from the reader's segmentation of the base: the background for colour and
  shape edits (less the new shape, for shape edits), the shape for background edits;
- *silhouette IoU*: the shape's pixels in the base against the edit's (colour and background
  edits; a shape edit changes the silhouette on purpose).

Side by side on the same bases: edit-rt at several tail fractions K/T and strengths with
``preserve: none``; the same rows on the base's unconditional prediction (``tail.uncond:
base`` and ``base-corrected``, methods "uncond base", "uncond base-corrected") and with
DeepCache (``tail.deepcache`` 2 and 3, methods "deepcache 2", "deepcache 3"); edit-rt with ``preserve: auto`` at the default tail and strength, for each
setting of its knobs; diffusers' img2img at strength K/T (same model and steps, fresh noise);
prompt-to-prompt from the same base tail (export/eval/p2p.py). A "real image" mode does the same
on shapes-world renders that no model drew: inverted into bases (pipeline.invert), then edited,
against img2img on the same renders. Writes quality.json and quality.png.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from edit_rt.runtime.config.run_config import RunConfig
from edit_rt.runtime.model.edit import Base, TailRow
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

from ..world.shapes import prompt, render
from .judges import Score, judge_of
from .targets import judge_targets, oracle_beside

# preserve: auto knobs measured (threshold, dilate, region); the config's default is one of them
AUTO_KNOBS = tuple((t, d, r) for t in (0.3, 0.5) for d in (0, 1) for r in ("contrast", "words"))
# Longer tails than the default, where keeping the base's layout may let an edit go further
STRUCTURE_TAILS = (0.5, 0.6)
# tail.uncond modes measured beside the exact tail (compute) at every setting of it
UNCOND_REUSE = ("base", "base-corrected")
# tail.deepcache intervals measured beside it likewise (methods "deepcache 2", "deepcache 3")
DEEPCACHE = (2, 3)


@dataclass
class Tally:
    n: int = 0
    success: int = 0
    preserved: int = 0
    both: int = 0
    unreadable: int = 0
    changed: dict = field(default_factory=dict)
    psnr: list = field(default_factory=list)
    iou: list = field(default_factory=list)
    other_kept: list = field(default_factory=list)  # world 2, two-object bases: the other object
    other_psnr: list = field(default_factory=list)

    def add(self, score: Score) -> None:
        self.n += 1
        self.success += score.success
        self.preserved += score.preserved
        self.both += score.success and score.preserved
        self.unreadable += score.unreadable
        for f in score.changed:
            self.changed[f] = self.changed.get(f, 0) + 1
        self.psnr.append(score.psnr)
        if score.iou is not None:
            self.iou.append(score.iou)
        if score.other_kept is not None:
            self.other_kept.append(score.other_kept)
            self.other_psnr.append(score.other_psnr)

    def row(self) -> dict[str, Any]:
        n = max(self.n, 1)
        row = {
            "n": self.n, "success": self.success / n, "preservation": self.preserved / n,
            "success_and_preserved": self.both / n, "unreadable": self.unreadable / n,
            "untouched_psnr": float(np.mean(self.psnr)) if self.psnr else None,
            "untouched_psnr_at_least_35": float(np.mean(np.array(self.psnr) >= 35)) if self.psnr else None,
            "silhouette_iou": float(np.mean(self.iou)) if self.iou else None,
            "changed": {f: v / n for f, v in sorted(self.changed.items())},
        }  # fmt: skip
        if self.other_kept:
            row["other_kept"] = float(np.mean(self.other_kept))
            row["other_psnr"] = float(np.mean(self.other_psnr))
            row["other_psnr_at_least_35"] = float(np.mean(np.array(self.other_psnr) >= 35))
        return row


def quality_bases(pipe: EditPipeline, cfg: RunConfig, judge, bases: int,
                  advance: Callable[[int], None] = lambda n: None) -> Iterator[tuple]:  # fmt: skip
    """`make quality`'s bases, drawn in order from one seed (the oracle ceiling and the maps'
    overlap of export/eval/gates.py edit the same ones): per base (the scene asked for, the Base, its
    state, its image, the reader's view of it, the edits of it); the last two None when the base
    does not show its prompt's objects (no attributes to preserve)."""
    rng = np.random.default_rng(0)
    for b in range(bases):
        intended = judge.scene(rng)
        base = dataclasses.replace(cfg.base, prompt=prompt(intended), seed=b)
        state = pipe.generate_base(base)
        base_image = pipe.decode(state.final_latent)[0]
        seen = judge.base_reading(base_image, intended)
        advance(1)
        yield intended, base, state, base_image, seen, None if seen is None else judge.edits(intended, seen, rng)


def knobs_label(knobs: tuple[float, int, str]) -> str:
    t, d, r = knobs
    return f"auto t{t:g} d{d} {r}"


def run_quality(
    cfg: RunConfig,
    bases: int = 50,
    fractions: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5),
    strengths: tuple[float, ...] = (0.5, 1.0, 1.5),
    default_fraction: float | None = None,
    prompts: int = 100,
    auto_knobs: tuple[tuple[float, int, str], ...] = AUTO_KNOBS,
    structures: tuple[float, ...] = (0.25, 0.5, 1.0),
    real_images: int = 50,
    say: Callable[[str], None] = print,
    progress: Optional[Callable[[int, str], Callable[[int], None]]] = None,
) -> dict[str, Any]:
    """The table over ``bases`` bases: edit-rt (``preserve: none``) at every tail fraction
    (strength 1) and every strength at ``default_fraction`` (the config's tail unless given);
    at the default tail and strength, ``preserve: auto`` for each of ``auto_knobs`` and
    prompt-to-prompt; structure keeping at each of ``structures`` at the default strength and
    the default and longer tails; img2img at every tail fraction. ``prompts`` generations
    measure prompt following first."""
    from diffusers import DDIMScheduler, StableDiffusionImg2ImgPipeline

    from ..compile.onnx_export import load_components
    from .p2p import p2p_tail

    T = cfg.base.steps
    default_fraction = cfg.cache.default_tail_fraction if default_fraction is None else default_fraction
    default_strength = cfg.cache.default_strength
    settings = sorted({(f, 1.0) for f in fractions} | {(default_fraction, s) for s in strengths})
    structure_settings = [(f, k) for f in sorted({default_fraction, *STRUCTURE_TAILS}) for k in structures]
    # the config's engine: its backend (auto: the fastest here) and precision (bf16 on openvino)
    pipe = EditPipeline(cfg.onnx_dir, cfg.model_dir, threads=cfg.threads, image_size=(cfg.base.height, cfg.base.width),
                        backend=cfg.backend, engines_dir=cfg.engines_dir, precision=cfg.engines.precision).activate()  # fmt: skip
    say(f"quality: backend {pipe.graph_set.backend} ({pipe.graph_set.reason})")
    bar = progress or (lambda total, description: lambda n: None)
    judge = judge_of(cfg.model_dir)
    following = _prompt_following(pipe, cfg.base, prompts, judge, bar(prompts, "prompts")) if prompts else None
    advance = bar(bases, "bases")
    img2img = StableDiffusionImg2ImgPipeline.from_pretrained(cfg.model_dir, safety_checker=None, requires_safety_checker=False)
    img2img.scheduler = DDIMScheduler.from_config(img2img.scheduler.config)
    img2img.set_progress_bar_config(disable=True)
    unet, text_encoder, _, tokenizer, scheduler_config = load_components(cfg.model_dir)
    tallies: dict[tuple, Tally] = defaultdict(Tally)
    identity: list[float] = []  # per base: the largest grey-level difference of its identity edit
    base_reads = 0
    start = T - max(1, round(default_fraction * T))
    for b, (intended, base, state, base_image, seen, edits) in enumerate(quality_bases(pipe, cfg, judge, bases)):
        base_reads += judge.follow(base_image, intended)["all"]
        # an identity edit (the base's own prompt) must give the base back: its largest
        # difference in 8-bit grey levels (0 where every kernel is deterministic)
        (same,) = pipe.edit(state, [TailRow(base.prompt, default_strength, start, base.guidance)])
        identity.append(float(np.abs(np.round(same.image * 255) - np.round(base_image * 255)).max()))
        if seen is None:
            continue  # an unreadable base has no attributes to preserve
        # edit-rt, preserve: none, every setting of every kind in one batched tail; then the same
        # rows on the base's unconditional prediction (tail.uncond), beside the exact tail
        # and with DeepCache (tail.deepcache k: every k-th tail step full)
        for method, mode, k in (("edit-rt", "compute", 1), *((f"uncond {m}", m, 1) for m in UNCOND_REUSE),
                                *((f"deepcache {k}", "compute", k) for k in DEEPCACHE)):  # fmt: skip
            rows = [TailRow(text, s, T - max(1, round(f * T)), base.guidance, uncond=mode, deepcache=k)
                    for _, text in edits.values() for f, s in settings]  # fmt: skip
            images = iter(r.image for r in pipe.edit(state, rows))
            for kind, (target, _) in edits.items():
                for f, s in settings:
                    tallies[method, kind, f, s].add(judge.score(next(images), base_image, seen, target, kind))
        # edit-rt, preserve: auto, each setting of its knobs, at the default tail and strength
        for knobs in auto_knobs:
            t, d, region = knobs
            pipe.preservation.preserve = dataclasses.replace(cfg.preserve, threshold=t, dilate=d, region=region)
            rows = [TailRow(text, default_strength, start, base.guidance, preserve="auto") for _, text in edits.values()]
            for (kind, (target, _)), result in zip(edits.items(), pipe.edit(state, rows)):
                tallies[knobs_label(knobs), kind, default_fraction, default_strength].add(
                    judge.score(result.image, base_image, seen, target, kind))
        pipe.preservation.preserve = cfg.preserve
        # edit-rt, structure keeping (the base's self-attention pattern for the first fraction
        # of the tail), at the default tail and strength, and at longer tails
        rows = [TailRow(text, default_strength, T - max(1, round(f * T)), base.guidance, structure=k)
                for _, text in edits.values() for f, k in structure_settings]  # fmt: skip
        images = iter(r.image for r in pipe.edit(state, rows))
        for kind, (target, _) in edits.items():
            for f, k in structure_settings:
                tallies[f"structure {k:g}", kind, f, default_strength].add(judge.score(next(images), base_image, seen, target, kind))
        for kind, (target, text) in edits.items():
            for f in fractions:
                out = img2img(text, image=base_image[None], strength=f, num_inference_steps=T, guidance_scale=base.guidance,
                              output_type="np", generator=torch.Generator().manual_seed(b)).images[0]  # fmt: skip
                tallies["img2img", kind, f, 1.0].add(judge.score(out, base_image, seen, target, kind))
            latent = p2p_tail(unet, text_encoder, tokenizer, scheduler_config, state, text, start)
            tallies["p2p", kind, default_fraction, 1.0].add(judge.score(pipe.decode(latent[None])[0], base_image, seen, target, kind))
        say(f"quality: base {b + 1}/{bases}")
        advance(1)
    _real_images(pipe, img2img, cfg, judge, real_images, default_fraction, default_strength, tallies, bar(real_images, "real images"))
    pipe.deactivate()
    table = [{"method": m, "kind": k, "tail_fraction": f, "strength": s, **t.row()} for (m, k, f, s), t in sorted(tallies.items())]
    report = {"model": str(cfg.model), "world": judge.world, "kinds": list(judge.kinds()), "steps": T, "bases": bases, "base_prompt_following": base_reads / bases,
              "prompt_following": following, "guidance": cfg.base.guidance, "default_tail_fraction": default_fraction,
              "default_strength": default_strength, "preserve_default": dataclasses.asdict(cfg.preserve),
              "rows": table, "backend": pipe.graph_set.backend, "backend_reason": pipe.graph_set.reason,
              "identity_grey_levels": {"max": max(identity, default=0.0), "mean": float(np.mean(identity)) if identity else 0.0,
                                       "per_base": identity}}  # fmt: skip
    report["targets"] = judge_targets(report)
    report["oracle_ceiling"] = oracle_beside(cfg.model_dir)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "quality.png")
    return report


def _real_images(pipe: EditPipeline, img2img, cfg: RunConfig, judge, n: int, fraction: float, strength: float,
                 tallies: dict, advance: Callable[[int], None]) -> None:  # fmt: skip
    """The "real image" mode: shapes-world renders no model drew, inverted (pipeline.invert), then
    edited; img2img on the same renders at strength K/T. Methods "edit-rt (real)", "img2img (real)";
    the untouched region's PSNR is against the input picture itself."""
    rng = np.random.default_rng(2)
    T = cfg.base.steps
    start = T - max(1, round(fraction * T))
    for k in range(n):
        scene = judge.scene(rng)
        picture = render(scene, cfg.base.width, rng).astype(np.float32) / 255
        seen = judge.base_reading(picture, scene)  # the reader on a clean render: the scene itself
        if seen is None:
            advance(1)
            continue
        base = dataclasses.replace(cfg.base, prompt=prompt(scene), seed=0, image=f"render:{k}")
        state = pipe.invert(picture, base)
        edits = judge.edits(scene, seen, rng)
        rows = [TailRow(text, strength, start, base.guidance) for _, text in edits.values()]
        for (kind, (target, text)), result in zip(edits.items(), pipe.edit(state, rows)):
            tallies["edit-rt (real)", kind, fraction, strength].add(judge.score(result.image, picture, seen, target, kind))
            out = img2img(text, image=picture[None], strength=fraction, num_inference_steps=T, guidance_scale=base.guidance,
                          output_type="np", generator=torch.Generator().manual_seed(k)).images[0]  # fmt: skip
            tallies["img2img (real)", kind, fraction, 1.0].add(judge.score(out, picture, seen, target, kind))
        advance(1)


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in report.get("kinds", ("colour", "background", "shape")) if any(r["kind"] == k for r in report["rows"])]
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.4 * len(kinds), 3.6), sharey=True, squeeze=False)
    axes = axes[0]
    f0, s0 = report["default_tail_fraction"], report["default_strength"]
    for ax, kind in zip(axes, kinds):
        for method, colour in (("edit-rt", "tab:orange"), ("img2img", "tab:blue")):
            rows = [r for r in report["rows"] if r["method"] == method and r["kind"] == kind and r["strength"] == 1.0]
            rows.sort(key=lambda r: r["tail_fraction"])
            xs = [r["tail_fraction"] for r in rows]
            ax.plot(xs, [r["success_and_preserved"] for r in rows], "-o", color=colour, label=f"{method} (none), both")
            ax.plot(xs, [r["preservation"] for r in rows], ":", color=colour, alpha=0.6, label=f"{method} (none), preserved")
        for k, alpha in ((0.25, 0.4), (0.5, 0.6), (1.0, 0.9)):
            rows = sorted((r for r in report["rows"] if r["method"] == f"structure {k:g}" and r["kind"] == kind),
                          key=lambda r: r["tail_fraction"])  # fmt: skip
            ax.plot([r["tail_fraction"] for r in rows], [r["success_and_preserved"] for r in rows], "--",
                    color="tab:red", alpha=alpha, label=f"edit-rt structure {k:g}, x{s0:g}, both")  # fmt: skip
        marks = [r for r in report["rows"] if r["kind"] == kind and r["tail_fraction"] == f0
                 and (r["method"].startswith("auto") or r["method"] == "p2p")]  # fmt: skip
        for r in marks:
            style = ("s", "tab:purple") if r["method"] == "p2p" else ("*", "tab:green")
            ax.plot([f0], [r["success_and_preserved"]], style[0], color=style[1], alpha=0.7)
        ax.plot([], [], "*", color="tab:green", label=f"edit-rt auto (each knob setting), x{s0:g}")
        ax.plot([], [], "s", color="tab:purple", label="prompt-to-prompt")
        ax.set(title=f"edit: {kind}", xlabel="tail fraction K/T", ylim=(0, 1.02))
    axes[0].set_ylabel("success and preserved")
    axes[-1].legend(fontsize=6)
    fig.suptitle(f"edit-rt quality on the shapes model ({report['bases']} bases, T={report['steps']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def prompt_following(cfg: RunConfig, n: int = 100) -> dict[str, float]:
    """How often the reader finds, in the model's own generations, what their prompts asked for."""
    with EditPipeline(cfg.onnx_dir, cfg.model_dir, threads=cfg.threads, image_size=(cfg.base.height, cfg.base.width)) as pipe:
        return _prompt_following(pipe, cfg.base, n, judge_of(cfg.model_dir))


def _prompt_following(pipe: EditPipeline, base: Base, n: int, judge, advance: Callable[[int], None] = lambda n: None) -> dict[str, float]:
    """Per attribute, the fraction of the prompts that ask for it whose generation shows it
    (export/eval/judges.py ``follow``)."""
    rng = np.random.default_rng(1)
    hits: dict[str, list[bool]] = defaultdict(list)
    for k in range(n):
        scene = judge.scene(rng)
        state = pipe.generate_base(dataclasses.replace(base, prompt=prompt(scene), seed=1000 + k))
        for f, ok in judge.follow(pipe.decode(state.final_latent)[0], scene).items():
            hits[f].append(ok)
        advance(1)
    return {f: float(np.mean(v)) for f, v in hits.items()}
