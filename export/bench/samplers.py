"""Samplers at equal image quality, not equal steps (issue 27), on a shapes model through the
runtime: how many steps each sampler needs to reach what 50-step DDIM reaches, and what an edit
tail costs at that setting.

1. ``prompts`` scenes (the gates' prompts: rng 1, seeds 1000 + k), generated batched with every
   sampler at every step count of ``SWEEP``, and with 100-step and 500-step DDIM as references;
2. per setting: the reader's prompt following (export/eval/judges.py ``follow``: every attribute and
   ``all``) and the mean pixel PSNR to the 100-step DDIM image of the same seed (the issue's
   reference) and to the 500-step one (``converged``: the deterministic samplers all solve the
   same probability-flow ODE, and 500 DDIM steps are its solution to within what the PSNR
   resolves, while 100-step DDIM shares 50-step DDIM's own discretization error, so it favours
   DDIM). Euler a solves another, stochastic equation: its PSNR says nothing, only prompt
   following counts for it;
3. the bar: 50-step DDIM's ``all`` prompt following and its PSNR to the converged image; a
   sampler's ``steps_needed`` is its fewest swept steps whose ``all`` is within two binomial
   standard errors of the bar's (the noise of ``prompts`` prompts: on the shapes model every
   sampler's prompt following is flat from about 8 steps) and (deterministic samplers) whose
   PSNR to the converged image is at least the bar's;
4. at each sampler's ``steps_needed`` (and 50-step DDIM): the wall time of 8 edits of one base as
   one batched tail at the config's default tail fraction, the settings interleaved over
   ``repeats`` rounds, measured side by side in this one run.

    .venv/bin/python scripts/measure_samplers.py [configs/shapes.yaml] [--prompts 100]

Writes ``samplers.json`` and ``samplers.png`` to ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from edit_rt.runtime.config.run_config import RunConfig
from edit_rt.runtime.loop.jobs import Job, Request
from edit_rt.runtime.model.edit import Base
from edit_rt.runtime.model.samplers import schedule_for
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline, TailRow

from ..eval.judges import judge_of, psnr
from ..world.shapes import prompt

REFERENCES = {"ddim_100": ("ddim", 100), "converged": ("ddim", 500)}
BAR = ("ddim", 50)
_SWEEP = (8, 10, 12, 15, 20, 25, 30, 40)
SWEEP: dict[str, tuple[int, ...]] = {
    "ddim": (10, 15, 20, 30, 50),
    **{name: _SWEEP for name in ("euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "unipc")},
}
EDITS = ("a green circle", "a blue square", "a red triangle", "on a yellow background", "bottom right",
         "a purple circle", "a white square", "an orange triangle")  # fmt: skip


def generate(pipe: EditPipeline, bases: list[Base], chunk: int = 32) -> np.ndarray:
    """Decoded images [n, H, W, 3] of ``bases``, generated as batched rows of the step loop."""
    shape = pipe.latent_shape(bases[0])
    out = []
    for i in range(0, len(bases), chunk):
        request = Request(f"bench-samplers-{i}", decode=False)
        jobs = [Job(request, k, b, TailRow(b.prompt, 1.0, 0, b.guidance), noise=pipe.initial_noise(b))
                for k, b in enumerate(bases[i : i + chunk])]  # fmt: skip
        results = pipe.batcher(shape).run(request, jobs)
        out.append(pipe.decode(np.concatenate([r.state.final_latent for r in results])))
    return np.concatenate(out)


def _tail_seconds(pipe: EditPipeline, cfg: RunConfig, settings: list[tuple[str, int]], repeats: int) -> dict[tuple, list[float]]:
    """Per (sampler, steps): the wall seconds of 8 edits of one base as one tail, per round."""
    states, rows = {}, {}
    for sampler, steps in settings:
        base = dataclasses.replace(cfg.base, sampler=sampler, steps=steps)
        states[(sampler, steps)] = pipe.generate_base(base)
        start = steps - max(1, round(cfg.cache.default_tail_fraction * steps))
        rows[(sampler, steps)] = [TailRow(text, cfg.cache.default_strength, start, base.guidance) for text in EDITS]
    for key in settings:  # warm: bindings for these row counts made before timing
        pipe.run_tail(states[key], rows[key])
    seconds: dict[tuple, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for key in settings:
            t = time.perf_counter()
            pipe.run_tail(states[key], rows[key])
            seconds[key].append(time.perf_counter() - t)
    return seconds


def run_sampler_bench(cfg: RunConfig, prompts: int = 100, repeats: int = 5, out_dir: Optional[Path] = None,
                      advance: Callable[[int], None] = lambda n: None) -> dict[str, Any]:  # fmt: skip
    judge = judge_of(cfg.model_dir)
    rng = np.random.default_rng(1)
    scenes = [judge.scene(rng) for _ in range(prompts)]
    bases = [dataclasses.replace(cfg.base, prompt=prompt(s), seed=1000 + k) for k, s in enumerate(scenes)]
    everything = np.ones((cfg.base.height, cfg.base.width), dtype=bool)
    report: dict[str, Any] = {"model": str(cfg.model), "prompts": prompts, "guidance": cfg.base.guidance,
                              "references": {k: list(v) for k, v in REFERENCES.items()}, "bar": list(BAR), "settings": []}  # fmt: skip
    with EditPipeline(cfg.onnx_dir, cfg.model_dir, threads=cfg.threads, image_size=(cfg.base.height, cfg.base.width)) as pipe:
        t = time.perf_counter()
        references = {}
        for name, (sampler, steps) in REFERENCES.items():
            references[name] = generate(pipe, [dataclasses.replace(b, sampler=sampler, steps=steps) for b in bases])
            advance(1)
        between = [psnr(a, b, everything) for a, b in zip(references["ddim_100"], references["converged"])]
        report["ddim_100_to_converged_psnr"] = float(np.mean(between))
        for sampler, sweep in SWEEP.items():
            for steps in sweep:
                images = generate(pipe, [dataclasses.replace(b, sampler=sampler, steps=steps) for b in bases])
                hits: dict[str, list[bool]] = defaultdict(list)
                for image, scene in zip(images, scenes):
                    for f, ok in judge.follow(image, scene).items():
                        hits[f].append(ok)
                report["settings"].append({
                    "sampler": sampler, "steps": steps, "ancestral": schedule_for(sampler, pipe.manifest.scheduler_config, steps).ancestral,
                    "follow": {f: float(np.mean(v)) for f, v in hits.items()},
                    **{f"psnr_to_{name}": float(np.mean([psnr(a, b, everything) for a, b in zip(images, ref)]))
                       for name, ref in references.items()},
                })  # fmt: skip
                advance(1)
        report["generation_seconds"] = time.perf_counter() - t
        bar = next(s for s in report["settings"] if (s["sampler"], s["steps"]) == BAR)
        p = bar["follow"]["all"]
        report["follow_margin"] = margin = 2 * float(np.sqrt(p * (1 - p) / prompts))
        needed = {}
        for sampler in SWEEP:
            fits = [s["steps"] for s in report["settings"] if s["sampler"] == sampler and s["follow"]["all"] >= p - margin
                    and (s["ancestral"] or s["psnr_to_converged"] >= bar["psnr_to_converged"])]  # fmt: skip
            needed[sampler] = min(fits) if fits else None
        report["steps_needed"] = needed
        timed = [BAR] + [(s, n) for s, n in needed.items() if n is not None and (s, n) != BAR]
        seconds = _tail_seconds(pipe, cfg, timed, repeats)
        ddim = float(np.median(seconds[BAR]))
        report["tails"] = [{
            "sampler": s, "steps": n, "tail_steps": max(1, round(cfg.cache.default_tail_fraction * n)), "edits": len(EDITS),
            "median_seconds": float(np.median(seconds[(s, n)])), "vs_ddim_50": float(np.median(seconds[(s, n)])) / ddim,
            "generation_rows_vs_ddim_50": n / BAR[1],
        } for s, n in timed]  # fmt: skip
        advance(1)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "samplers.json").write_text(json.dumps(report, indent=2))
        _plot(report, out_dir / "samplers.png")
    return report


def progress_total() -> int:
    return len(REFERENCES) + 1 + sum(len(v) for v in SWEEP.values())


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bar = next(s for s in report["settings"] if (s["sampler"], s["steps"]) == tuple(report["bar"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for sampler in SWEEP:
        rows = [s for s in report["settings"] if s["sampler"] == sampler]
        steps = [s["steps"] for s in rows]
        axes[0].plot(steps, [s["follow"]["all"] for s in rows], marker="o", label=sampler)
        axes[1].plot(steps, [s["psnr_to_converged"] for s in rows], marker="o", label=sampler)
    axes[0].axhline(bar["follow"]["all"], color="grey", linestyle=":", label="DDIM 50")
    axes[1].axhline(bar["psnr_to_converged"], color="grey", linestyle=":", label="DDIM 50")
    axes[0].set(xlabel="steps", ylabel="prompt following (all attributes)", title=f"{report['prompts']} prompts")
    axes[1].set(xlabel="steps", ylabel="PSNR to DDIM 500 (dB)", title="distance to the converged image")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def steps_label(n: Optional[int]) -> str:
    return "-" if n is None else str(n)


def summary(report: dict) -> list[str]:
    """The lines the CLI prints."""
    out = []
    for s in report["settings"]:
        out.append(f"{s['sampler']:>16} {s['steps']:3d} steps: all {s['follow']['all']:.2f}, PSNR to DDIM-100 "
                   f"{s['psnr_to_ddim_100']:.1f} dB, to DDIM-500 {s['psnr_to_converged']:.1f} dB")  # fmt: skip
    out.append("steps needed for DDIM-50's quality: " + ", ".join(f"{k} {steps_label(v)}" for k, v in report["steps_needed"].items()))
    for t in report["tails"]:
        out.append(f"tail of {t['edits']} edits, {t['sampler']} {t['steps']} steps ({t['tail_steps']} tail steps): "
                   f"{t['median_seconds'] * 1000:.0f} ms, {t['vs_ddim_50']:.2f}x DDIM-50's")  # fmt: skip
    return out

