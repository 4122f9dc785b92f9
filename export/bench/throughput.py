"""`edit-rt bench`: edit throughput, side by side with diffusers, against the ideal ratio.

In one process, interleaved and repeated (the median of ``repeats`` runs is reported, so that
machine drift hits every method alike), for N edits and tail fractions K/T:

- (a) ``diffusers``: StableDiffusionPipeline regenerating the N edits from scratch (T steps,
  torch eager, the N prompts as one batch): what a user does today;
- (b) ``img2img``: StableDiffusionImg2ImgPipeline at strength K/T on the base image (K steps,
  batched): what a user would pick instead for an edit;
- (c) ``edit-rt full``: one full generation through the runtime (what a base costs);
- (d) ``edit-rt tail``: the N edits as one batched tail of K steps from the cached base;
- (e) ``edit-rt tail, uncond base-corrected``: the same tail on the base's unconditional
  prediction (``tail.uncond``: the rows' unconditional halves skipped; ``base`` costs the same);
- (f) ``edit-rt tail, deepcache k`` (k in ``DEEPCACHE``): the same tail with every k-th step
  full and the others on the UNet's outer blocks (``tail.deepcache``); and ``edit-rt full,
  deepcache 3``: a generation so (``base.deepcache``);
- the CPU engines side by side (cpu_engines.py): ``ort-cpu``, ``openvino`` fp32 and bf16 at
  every N, a process each (its own peak RSS), with GFLOP/s against the machine's limit.

The ideal speedup of (d) over (a) is T/K times the per-row step cost ratio of diffusers' own
pipeline (its run (a) over its n x T row-steps) to the runtime's CFG step at the same batch;
efficiency is the measured speedup over that ideal. Every ratio is taken per repeat, between
methods that ran side by side, then its median and spread (min, max) reported. Torch and ONNX
Runtime get the same thread count.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import onnxruntime as ort
import torch

from edit_rt.runtime.config.run_config import RunConfig
from edit_rt.runtime.loop.jobs import Job, Request
from edit_rt.runtime.model.edit import TailRow
from edit_rt.runtime.pipeline.assemble import pipeline_of
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

from .side import (bucket_cost, catalogue_cost, entry_reuse, inversion_cost, preserve_cost, ratios, server_vs_run,
                   slider_move, structure_cost, _timed)  # fmt: skip
from .cpu_engines import measure_engines
from .cpu_engines import print_table as print_engines
from .interactive import interactive, slider_move_keys
from .slider_move import measure_slider_moves
from .slider_move import print_table as print_moves
from .sliders import slider_cost

log = logging.getLogger(__name__)

UNCOND_METHOD = "edit-rt tail, uncond base-corrected"
DEEPCACHE = {2: "edit-rt tail, deepcache 2", 3: "edit-rt tail, deepcache 3"}
DEEPCACHE_FULL = "edit-rt full, deepcache 3"
EDIT_WORDS = ["red", "blue", "green", "yellow", "at night", "in snow", "watercolor", "pixel art"]


def run_bench(
    cfg: RunConfig,
    ns: tuple[int, ...] = (1, 4, 16),
    fractions: tuple[float, ...] = (0.1, 0.2, 0.4),
    repeats: int = 3,
    say: Callable[[str], None] = print,
    progress: Optional[Callable[[int, str], Callable[[int], None]]] = None,
    sliders: Optional[dict] | bool = None,
    catalogue_sizes: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Run the benchmark; write bench.json and bench.png to ``cfg.output_dir``; return the report.

    ``progress(total, description)`` gives an ``advance(n)`` for the measured points;
    ``sliders``: the LoRA slots' section's options (sliders.py's slider_cost: slots, rank, points;
    None: its defaults; False: no section); ``catalogue_sizes``: the catalogues' rows (default:
    N, 4N and 16N for the largest N: 16, 64, 256)."""
    from diffusers import DDIMScheduler, StableDiffusionImg2ImgPipeline, StableDiffusionPipeline
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    threads = cfg.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    base, T = cfg.base, cfg.base.steps
    prompts = [f"{base.prompt}, {EDIT_WORDS[i % len(EDIT_WORDS)]} {i // len(EDIT_WORDS)}" for i in range(max(ns))]

    pipe = StableDiffusionPipeline.from_pretrained(cfg.model_dir, safety_checker=None, requires_safety_checker=False)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    img2img = StableDiffusionImg2ImgPipeline(**pipe.components)
    img2img.set_progress_bar_config(disable=True)
    rt = pipeline_of(cfg, threads=threads).activate()
    say(f"bench: backend {rt.graph_set.backend} ({rt.graph_set.reason}), {threads} threads, T={T}")

    noise = rt.initial_noise(base)
    state = rt.generate_base(base)
    base_image = rt.decode(state.final_latent)[0]
    ks = {f: max(1, round(f * T)) for f in fractions}

    def diffusers_full(n: int) -> None:
        negative = None if base.negative_prompt is None else [base.negative_prompt] * n
        pipe(prompts[:n], negative_prompt=negative, num_inference_steps=T,
             guidance_scale=base.guidance, height=base.height, width=base.width,
             latents=torch.from_numpy(np.repeat(noise, n, 0)), output_type="np")  # fmt: skip

    def diffusers_img2img(n: int, f: float) -> None:
        negative = None if base.negative_prompt is None else [base.negative_prompt] * n
        img2img(prompts[:n], image=[base_image] * n, strength=f, negative_prompt=negative,
                num_inference_steps=T, guidance_scale=base.guidance, output_type="np",
                generator=torch.Generator().manual_seed(0))  # fmt: skip

    def rt_full(deepcache: int = 1) -> None:
        rt.decode(rt.generate_base(dataclasses.replace(base, deepcache=deepcache)).final_latent)

    def rt_tail(n: int, f: float, uncond: str = "compute", deepcache: int = 1) -> None:
        rows = [TailRow(p, 1.0, T - ks[f], base.guidance, uncond=uncond, deepcache=deepcache) for p in prompts[:n]]
        rt.decode(rt.run_tail(state, rows))

    probes = _step_cost_probes(pipe, rt, state, base, ns)
    step_samples: dict[str, dict[int, list[float]]] = {kind: {n: [] for n in ns} for kind in probes}
    samples: dict[tuple, list[tuple[float, int]]] = {}
    points_per_repeat = 2 + len(ns) * (1 + (3 + len(DEEPCACHE)) * len(fractions)) + len(ns)
    advance = progress(repeats * points_per_repeat + 4, "bench points") if progress else (lambda n: None)
    for r in range(repeats):
        say(f"bench: repeat {r + 1}/{repeats}")
        samples.setdefault(("edit-rt full", 1, None), []).append(_timed(rt_full))
        samples.setdefault((DEEPCACHE_FULL, 1, None), []).append(_timed(lambda: rt_full(3)))
        advance(2)
        for n in ns:
            samples.setdefault(("diffusers", n, None), []).append(_timed(lambda: diffusers_full(n)))
            advance(1)
            for f in fractions:
                samples.setdefault(("img2img", n, f), []).append(_timed(lambda: diffusers_img2img(n, f)))
                samples.setdefault(("edit-rt tail", n, f), []).append(_timed(lambda: rt_tail(n, f)))
                samples.setdefault((UNCOND_METHOD, n, f), []).append(_timed(lambda: rt_tail(n, f, "base-corrected")))
                for k, method in DEEPCACHE.items():
                    samples.setdefault((method, n, f), []).append(_timed(lambda: rt_tail(n, f, deepcache=k)))
                advance(3 + len(DEEPCACHE))
        for n in ns:
            for kind, probe in probes.items():
                step_samples[kind][n].append(probe(n))
            advance(1)

    rows_of = {"diffusers": lambda n, f: n * T, "img2img": lambda n, f: n * ks[f],
               "edit-rt full": lambda n, f: T, "edit-rt tail": lambda n, f: n * ks[f],
               UNCOND_METHOD: lambda n, f: n * ks[f], DEEPCACHE_FULL: lambda n, f: T,
               **{method: lambda n, f: n * ks[f] for method in DEEPCACHE.values()}}  # fmt: skip
    points = []
    for (method, n, f), runs in samples.items():
        seconds = statistics.median(s for s, _ in runs)
        points.append({
            "method": method, "n": n, "tail_fraction": f, "tail_steps": ks.get(f) if f else None,
            "seconds": seconds, "runs": [round(s, 4) for s, _ in runs],
            "edits_per_s": n / seconds, "latency_per_edit_s": seconds / n,
            "unet_rows": rows_of[method](n, f), "peak_rss_mb": max(m for _, m in runs) / 2**20,
        })  # fmt: skip
    per_step = {kind: {n: statistics.median(v[n]) / n for n in ns} for kind, v in step_samples.items()}
    comparisons = []
    for n in ns:
        a = [s for s, _ in samples[("diffusers", n, None)]]
        steps = step_samples["runtime"][n]  # the runtime's CFG step of n rows, in the same repeats
        for f in fractions:
            k = ks[f]
            d = [s for s, _ in samples[("edit-rt tail", n, f)]]
            # Every ratio per repeat (its methods ran side by side), then the median and the spread.
            # The ideal divides T/K by the per-row step costs of the same repeat: diffusers' own
            # pipeline (its run (a) over n x T row-steps) against the runtime's step; "probe": torch's
            # UNet step timed apart, reported beside it only: timed alone it swung the efficiency
            # from 0.61 to 1.04 between runs, so the ideal takes the pipeline's own steps.
            speedup = ratios(a, d)
            ideal = [(T / k) * (sa / (n * T)) / (st / n) for sa, st in zip(a, steps)]
            probe = [(T / k) * st_torch / st for st_torch, st in zip(step_samples["torch"][n], steps)]
            efficiency = ratios(speedup["runs"], ideal)
            uncond = ratios(d, [s for s, _ in samples[(UNCOND_METHOD, n, f)]])
            comparisons.append({
                "n": n, "tail_fraction": f, "tail_steps": k,
                "speedup_vs_diffusers": speedup["median"], "speedup_vs_diffusers_spread": speedup["spread"],
                "speedup_vs_img2img": ratios([s for s, _ in samples[("img2img", n, f)]], d)["median"],
                "ideal_speedup_vs_diffusers": statistics.median(ideal),
                "efficiency": efficiency["median"], "efficiency_spread": efficiency["spread"],
                "efficiency_probe": ratios(speedup["runs"], probe)["median"],
                "step_cost_ratio_torch_over_runtime": per_step["torch"][n] / per_step["runtime"][n],
                # tail.uncond: the exact tail's seconds over the same tail's on the base's u
                "uncond_reuse_speedup": uncond["median"], "uncond_reuse_speedup_spread": uncond["spread"],
                # tail.deepcache k: the exact tail's seconds over the same tail's with DeepCache
                **{f"deepcache_{k}_speedup{key}": ratios(d, [s for s, _ in samples[(method, n, f)]])[stat]
                   for k, method in DEEPCACHE.items() for key, stat in (("", "median"), ("_spread", "spread"))},
            })  # fmt: skip
    tail_rows = [p for p in points if p["method"] == "edit-rt tail"]
    per_row = {(p["n"], p["tail_fraction"]): p["seconds"] / p["unet_rows"] for p in tail_rows}
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": threads,
                    "torch": torch.__version__, "onnxruntime": ort.__version__,
                    "torch_threads": torch.get_num_threads()},  # fmt: skip
        "model": str(cfg.model),
        "unet_parameters": sum(p.numel() for p in pipe.unet.parameters()),
        "latent": list(state.latents.shape[1:]),
        "steps": T,
        "guidance": base.guidance,
        "backend": rt.graph_set.backend,
        "repeats": repeats,
        "base_state_bytes": state.nbytes,
        "per_step_row_seconds": {k: {str(n): v for n, v in d.items()} for k, d in per_step.items()},
        "tail_seconds_per_row": {f"n={n},f={f}": v for (n, f), v in per_row.items()},
        "points": points,
        "comparisons": comparisons,
        # base.deepcache 3: a generation's seconds without over with it
        "deepcache_generation_speedup": ratios([s for s, _ in samples[("edit-rt full", 1, None)]],
                                               [s for s, _ in samples[(DEEPCACHE_FULL, 1, None)]]),  # fmt: skip
    }
    k_serve = ks[sorted(fractions)[len(fractions) // 2]]
    say(f"bench: the server against one run tail ({max(ns)} edits, {k_serve}-step tails)")
    report["server_vs_run"] = server_vs_run(cfg, rt, state, prompts[: max(ns)], k_serve, repeats, min(ks.values()))
    advance(1)
    say("bench: entry-step reuse on and off")
    report["entry_reuse"] = entry_reuse(rt, state, prompts[: max(ns)], min(ks.values()), repeats)
    advance(1)
    say("bench: a slider move (one row, its prompt encoded, a new strength) against its UNet calls")
    report["slider_move"] = slider_move(rt, state, prompts[0], min(ks.values()), max(3, repeats))
    # the page's drag -> exact image, through the server's HTTP and PNG (server_vs_run), against
    # the same move's UNet calls in the pipeline (the same tail, the same row)
    move = report["slider_move"]
    move.update({"page_drag_seconds": report["server_vs_run"]["page_drag_seconds"],
                 "page_drag_over_unet": report["server_vs_run"]["page_drag_seconds"] / move["seconds_move_unet"]})  # fmt: skip
    say("bench: interactive: an unguided tail against a guided one")
    report["interactive"] = interactive(rt, state, prompts[: max(ns)], min(ks.values()), repeats)
    say("bench: inverting an image into a base, against generating one")
    report["inversion"] = inversion_cost(rt, base, repeats)
    advance(1)
    say("bench: preserve: auto against none")
    report["preserve_cost"] = preserve_cost(rt, state, prompts[: max(ns)], max(ks.values()), repeats)
    report["structure_cost"] = structure_cost(rt, state, prompts[: max(ns) - 1], max(ks.values()), repeats)
    say("bench: padded row buckets (the GPU backends' pow2) against exact row counts")
    report["bucket_cost"] = bucket_cost(rt, state, prompts, min(ks.values()), repeats)
    advance(1)
    say("bench: catalogues of 16, 64 and 256 rows, each image written as it is decoded")
    report["catalogue"] = catalogue_cost(cfg, rt, state, prompts[: max(ns)], min(ks.values()),
                                         catalogue_sizes or (max(ns), 4 * max(ns), 16 * max(ns)))  # fmt: skip
    if sliders is not False:
        report["sliders"] = slider_cost(cfg, rt, state, pipe, max(ns), max(ks.values()), repeats, say, **(sliders or {}))
    rt.deactivate()
    if cfg.source is not None:  # each engine in a process of its own, from the config's file
        say("bench: the CPU engines side by side (ort-cpu, openvino fp32 and bf16), a process each")
        report["cpu_engines"] = measure_engines(cfg.source, ns, ks[sorted(fractions)[len(fractions) // 2]], repeats,
                                                threads, rounds=3, say=say)  # fmt: skip
        print_engines(report["cpu_engines"], say=say)
        say("bench: a slider move on each CPU engine: today's default, few-step with the tiny decoder, the server")
        probe = (report["cpu_engines"]["gflop_per_unet_row"] * 1e9, report["cpu_engines"]["machine_limit_gflops"])
        moves = measure_slider_moves(cfg.source, repeats=max(3, repeats), threads=threads, flops_and_limit=probe,
                                     images=Path(cfg.output_dir) / "slider-moves", say=say)  # fmt: skip
        print_moves(moves, say=say)
        report["interactive"].update(slider_move_keys(moves))
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "bench.png")
    return report


def _step_cost_probes(pipe, rt: EditPipeline, state, base, ns) -> dict[str, Callable[[int], float]]:
    """Seconds of one CFG UNet step for n rows: torch eager, and the runtime's row scheduler."""
    unet = pipe.unet
    shape = state.latents.shape[1:]
    text = torch.randn(2 * max(ns), 77, unet.config.cross_attention_dim)
    batcher = rt.batcher(shape)

    def torch_step(n: int) -> float:
        x = torch.randn(2 * n, *shape)
        t = torch.full((2 * n,), 500)
        with torch.no_grad():
            start = time.perf_counter()
            out = unet(x, t, encoder_hidden_states=text[: 2 * n]).sample
            u, c = out.chunk(2)
            _ = u + base.guidance * (c - u)
            return time.perf_counter() - start

    def runtime_step(n: int) -> float:
        # n seeded rows (no entry-step reuse: every half-row is computed), two steps each: the
        # calls the scheduler times are full CFG steps of n rows.
        request = Request("probe", decode=False)
        T = base.steps
        jobs = [Job(request, i, base, TailRow(base.prompt, 1.0, T - 2, base.guidance, seed=i), state=state) for i in range(n)]
        batcher.submit(request, jobs)
        seconds = []
        while not all(job.future.done() for job in jobs):
            batcher.work_once()
            seconds.append(batcher.scheduler.stats.last_seconds)
        return statistics.median(seconds)

    for n in ns:  # warm up every batch size once: first calls allocate
        torch_step(n)
        runtime_step(n)
    return {"torch": torch_step, "runtime": runtime_step}


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    points = report["points"]
    ns = sorted({p["n"] for p in points if p["method"] == "diffusers"})
    fractions = sorted({p["tail_fraction"] for p in points if p["tail_fraction"] is not None})
    full = {p["n"]: p["edits_per_s"] for p in points if p["method"] == "diffusers"}
    ax1.plot(ns, [full[n] for n in ns], "k-o", label="(a) diffusers, from scratch")
    for f in fractions:
        for method, style in (("img2img", "--s"), ("edit-rt tail", "-^")):
            eps = {p["n"]: p["edits_per_s"] for p in points if p["method"] == method and p["tail_fraction"] == f}
            ax1.plot(ns, [eps[n] for n in ns], style, label=f"{'(b)' if method == 'img2img' else '(d)'} {method}, K/T={f}")
    ax1.set(xscale="log", yscale="log", xlabel="edits per batch N", ylabel="edits / s", title="Edit throughput")
    ax1.set_xticks(ns, [str(n) for n in ns])
    ax1.legend(fontsize=7)
    for n in ns:
        comps = [c for c in report["comparisons"] if c["n"] == n]
        ax2.plot([c["tail_fraction"] for c in comps], [c["speedup_vs_diffusers"] for c in comps], "-o", label=f"N={n} measured")
        ax2.plot([c["tail_fraction"] for c in comps], [c["ideal_speedup_vs_diffusers"] for c in comps], ":x", label=f"N={n} ideal")
    ax2.set(xlabel="tail fraction K/T", ylabel="speedup of (d) over (a)", yscale="log", title="Speedup vs. ideal")
    ax2.legend(fontsize=7)
    for axis in (ax1.xaxis, ax1.yaxis, ax2.yaxis):
        axis.set_minor_formatter(NullFormatter())
    fig.suptitle(f"edit-rt bench: {report['unet_parameters'] / 1e6:.1f} M-parameter UNet, T={report['steps']}, "
                 f"{report['machine']['threads']} threads, {report['backend']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
