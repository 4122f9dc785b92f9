"""`edit-rt bench`: edit throughput, side by side with diffusers, against the ideal ratio.

In one process, interleaved and repeated (the median of ``repeats`` runs is reported, so that
machine drift hits every method alike), for N edits and tail fractions K/T:

- (a) ``diffusers``: StableDiffusionPipeline regenerating the N edits from scratch (T steps,
  torch eager, the N prompts as one batch): what a user does today;
- (b) ``img2img``: StableDiffusionImg2ImgPipeline at strength K/T on the base image (K steps,
  batched): what a user would pick instead for an edit;
- (c) ``edit-rt full``: one full generation through the runtime (what a base costs);
- (d) ``edit-rt tail``: the N edits as one batched tail of K steps from the cached base.

The ideal speedup of (d) over (a) is T/K times the per-step cost ratio of torch eager to the
runtime at the same batch (both measured here, a CFG UNet step per row); efficiency is the
measured speedup over that ideal. Torch and ONNX Runtime get the same thread count.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import socket
import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import onnxruntime as ort
import torch

from edit_rt.runtime.model.config import RunConfig
from edit_rt.runtime.loop.jobs import Job, Request
from edit_rt.runtime.pipeline import EditPipeline
from edit_rt.runtime.assemble import pipeline_of
from edit_rt.runtime.model.edit import TailRow

log = logging.getLogger(__name__)

EDIT_WORDS = ["red", "blue", "green", "yellow", "at night", "in snow", "watercolor", "pixel art"]


class PeakRss:
    """The peak resident-memory increase of this process while the block runs (sampled)."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak_bytes = 0
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    @contextmanager
    def measure(self) -> Iterator["PeakRss"]:
        start, stop = self._rss(), threading.Event()
        peak = [start]

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], self._rss())
                stop.wait(self.interval)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.peak_bytes = max(peak[0], self._rss()) - start


def _timed(fn: Callable[[], Any]) -> tuple[float, int]:
    rss = PeakRss()
    with rss.measure():
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, rss.peak_bytes


def run_bench(
    cfg: RunConfig,
    ns: tuple[int, ...] = (1, 4, 16),
    fractions: tuple[float, ...] = (0.1, 0.2, 0.4),
    repeats: int = 3,
    say: Callable[[str], None] = print,
    progress: Optional[Callable[[int, str], Callable[[int], None]]] = None,
) -> dict[str, Any]:
    """Run the benchmark; write bench.json and bench.png to ``cfg.output_dir``; return the report.

    ``progress(total, description)`` gives an ``advance(n)`` for the measured points."""
    from diffusers import DDIMScheduler, StableDiffusionImg2ImgPipeline, StableDiffusionPipeline
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    threads = cfg.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    base, T = cfg.base, cfg.base.steps
    prompts = [f"{base.prompt}, {EDIT_WORDS[i % len(EDIT_WORDS)]} {i // len(EDIT_WORDS)}" for i in range(max(ns))]

    pipe = StableDiffusionPipeline.from_pretrained(cfg.model, safety_checker=None, requires_safety_checker=False)
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

    def rt_full() -> None:
        rt.decode(rt.generate_base(base).final_latent)

    def rt_tail(n: int, f: float) -> None:
        rows = [TailRow(p, 1.0, T - ks[f], base.guidance) for p in prompts[:n]]
        rt.decode(rt.run_tail(state, rows))

    probes = _step_cost_probes(pipe, rt, state, base, ns)
    step_samples: dict[str, dict[int, list[float]]] = {kind: {n: [] for n in ns} for kind in probes}
    samples: dict[tuple, list[tuple[float, int]]] = {}
    points_per_repeat = 1 + len(ns) * (1 + 2 * len(fractions)) + len(ns)
    advance = progress(repeats * points_per_repeat + 4, "bench points") if progress else (lambda n: None)
    for r in range(repeats):
        say(f"bench: repeat {r + 1}/{repeats}")
        samples.setdefault(("edit-rt full", 1, None), []).append(_timed(rt_full))
        advance(1)
        for n in ns:
            samples.setdefault(("diffusers", n, None), []).append(_timed(lambda: diffusers_full(n)))
            advance(1)
            for f in fractions:
                samples.setdefault(("img2img", n, f), []).append(_timed(lambda: diffusers_img2img(n, f)))
                samples.setdefault(("edit-rt tail", n, f), []).append(_timed(lambda: rt_tail(n, f)))
                advance(2)
        for n in ns:
            for kind, probe in probes.items():
                step_samples[kind][n].append(probe(n))
            advance(1)

    rows_of = {"diffusers": lambda n, f: n * T, "img2img": lambda n, f: n * ks[f],
               "edit-rt full": lambda n, f: T, "edit-rt tail": lambda n, f: n * ks[f]}  # fmt: skip
    points = []
    for (method, n, f), runs in samples.items():
        seconds = statistics.median(s for s, _ in runs)
        points.append({
            "method": method, "n": n, "tail_fraction": f, "tail_steps": ks.get(f) if f else None,
            "seconds": seconds, "runs": [round(s, 4) for s, _ in runs],
            "edits_per_s": n / seconds, "latency_per_edit_s": seconds / n,
            "unet_rows": rows_of[method](n, f), "peak_rss_mb": max(m for _, m in runs) / 2**20,
        })  # fmt: skip
    by = {(p["method"], p["n"], p["tail_fraction"]): p for p in points}
    per_step = {kind: {n: statistics.median(v[n]) / n for n in ns} for kind, v in step_samples.items()}
    comparisons = []
    for n in ns:
        for f in fractions:
            d = by[("edit-rt tail", n, f)]
            speedup_a = by[("diffusers", n, None)]["seconds"] / d["seconds"]
            ideal = (T / ks[f]) * per_step["torch"][n] / per_step["runtime"][n]
            comparisons.append({
                "n": n, "tail_fraction": f, "tail_steps": ks[f],
                "speedup_vs_diffusers": speedup_a,
                "speedup_vs_img2img": by[("img2img", n, f)]["seconds"] / d["seconds"],
                "ideal_speedup_vs_diffusers": ideal, "efficiency": speedup_a / ideal,
                "step_cost_ratio_torch_over_runtime": per_step["torch"][n] / per_step["runtime"][n],
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
    }
    k_serve = ks[sorted(fractions)[len(fractions) // 2]]
    say(f"bench: the server against one run tail ({max(ns)} edits, {k_serve}-step tails)")
    report["server_vs_run"] = _server_vs_run(cfg, rt, state, prompts[: max(ns)], k_serve, repeats)
    advance(1)
    say("bench: entry-step reuse on and off")
    report["entry_reuse"] = _entry_reuse(rt, state, prompts[: max(ns)], min(ks.values()), repeats)
    advance(1)
    say("bench: inverting an image into a base, against generating one")
    report["inversion"] = _inversion_cost(rt, base, repeats)
    advance(1)
    say("bench: preserve: auto against none")
    report["preserve_cost"] = _preserve_cost(rt, state, prompts[: max(ns)], max(ks.values()), repeats)
    report["structure_cost"] = _structure_cost(rt, state, prompts[: max(ns) - 1], max(ks.values()), repeats)
    say("bench: padded row buckets (the GPU backends' pow2) against exact row counts")
    report["bucket_cost"] = _bucket_cost(rt, state, prompts, min(ks.values()), repeats)
    advance(1)
    rt.deactivate()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "bench.png")
    return report


@contextmanager
def _server_in_process(cfg: RunConfig) -> Iterator[str]:
    """`edit-rt serve` on a free loopback port in this process (RAM store); yields its URL."""
    import httpx
    import uvicorn

    from edit_rt.runtime.web.server import create_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, disk_dir=None),
                              serve=dataclasses.replace(cfg.serve, host="127.0.0.1", port=port))  # fmt: skip
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def _server_vs_run(cfg: RunConfig, rt: EditPipeline, state, prompts: list[str], k: int, repeats: int) -> dict[str, Any]:
    """The same edits of one base: N concurrent single-edit requests to the server against one
    ``edit-rt run`` tail (run_tail + decode), interleaved, median of ``repeats``."""
    import httpx

    base, T = state.base, state.base.steps
    rows = [TailRow(p, 1.0, T - k, base.guidance) for p in prompts]

    def one_tail() -> None:
        rt.decode(rt.run_tail(state, rows))

    with _server_in_process(cfg) as url, httpx.Client(base_url=url, timeout=600) as client:
        body = {"prompt": base.prompt, "negative_prompt": base.negative_prompt, "seed": base.seed,
                "steps": T, "cfg_scale": base.guidance}  # fmt: skip
        bid = client.post("/v1/images/generations", json=body).raise_for_status().json()["id"]

        def post(prompt: str) -> None:
            edit = {"prompt": prompt, "strength": 1.0, "tail_steps": k}
            client.post("/v1/images/edits", json={"base_id": bid, "edits": [edit]}).raise_for_status()

        def concurrent() -> None:
            threads = [threading.Thread(target=post, args=(p,)) for p in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        concurrent()  # warm up: the server's first calls at each row count allocate
        one_tail()
        served, ran = [], []
        for _ in range(repeats):
            served.append(_timed(concurrent)[0])
            ran.append(_timed(one_tail)[0])
    n = len(prompts)
    server_eps, run_eps = n / statistics.median(served), n / statistics.median(ran)
    return {"n": n, "tail_steps": k, "server_edits_per_s": server_eps, "run_edits_per_s": run_eps,
            "ratio": server_eps / run_eps, "server_runs": served, "run_runs": ran}  # fmt: skip


def _entry_reuse(rt: EditPipeline, state, prompts: list[str], k: int, repeats: int) -> dict[str, Any]:
    """One N-row tail of k steps with the entry step's unconditional prediction taken from the
    base (the default) and computed again (off), interleaved."""
    base, T = state.base, state.base.steps
    scheduler = rt.batcher(state.latents.shape[1:]).scheduler
    rows = [TailRow(p, 1.0, T - k, base.guidance) for p in prompts]
    seconds: dict[bool, list[float]] = {True: [], False: []}
    skipped = 0
    for _ in range(repeats + 1):  # the first round warms up both shapes
        for reuse in (True, False):
            scheduler.reuse_entry = reuse
            before = scheduler.stats.uncond_rows_skipped
            seconds[reuse].append(_timed(lambda: rt.run_tail(state, rows))[0])
            if reuse:
                skipped = scheduler.stats.uncond_rows_skipped - before
    scheduler.reuse_entry = True
    with_reuse, without = statistics.median(seconds[True][1:]), statistics.median(seconds[False][1:])
    n = len(rows)
    return {"n": n, "tail_steps": k, "seconds_with": with_reuse, "seconds_without": without,
            "half_rows_skipped": skipped, "half_rows": 2 * n * k,
            # every row skips its entry step's unconditional half, but one per call is computed
            # (ONNX Runtime's MatMul cannot broadcast over an empty batch): (n - 1) / (2 n k)
            "expected_saving": skipped / (2 * n * k), "measured_saving": 1 - with_reuse / without}  # fmt: skip


def _bucket_cost(rt: EditPipeline, state, prompts: list[str], k: int, repeats: int) -> dict[str, Any]:
    """Tails of row counts that are not powers of two, run at the pow2 buckets the GPU backends
    use (padded rows computed and ignored) and at exact counts, interleaved: rows computed
    against rows asked, and seconds. On the CPU a padded row costs a real row's time."""
    from edit_rt.runtime.loop.rows import pow2_buckets

    scheduler = rt.batcher(state.latents.shape[1:]).scheduler
    base, T = state.base, state.base.steps
    sizes = [n for n in (3, 5, 6, 12) if n <= min(len(prompts), scheduler.max_rows)]
    if not sizes:  # a bench of fewer rows (a smoke run): nothing to pad
        return {}
    kept = scheduler.buckets
    modes = {"pow2": pow2_buckets(1, scheduler.max_rows), "exact": None}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    rows: dict[str, tuple[int, int]] = {}
    for r in range(repeats + 1):  # the first round warms every shape up
        for mode, buckets in modes.items():
            scheduler.buckets = buckets
            computed, asked = scheduler.stats.rows_computed, scheduler.stats.row_steps
            total = 0.0
            for n in sizes:
                total += _timed(lambda: rt.run_tail(state, [TailRow(p, 1.0, T - k, base.guidance) for p in prompts[:n]]))[0]
            seconds[mode].append(total)
            rows[mode] = (scheduler.stats.rows_computed - computed, scheduler.stats.row_steps - asked)
    scheduler.buckets = kept
    pow2, exact = statistics.median(seconds["pow2"][1:]), statistics.median(seconds["exact"][1:])
    return {"sizes": sizes, "tail_steps": k, "rows_asked": rows["exact"][1], "rows_computed_pow2": rows["pow2"][0],
            "rows_computed_exact": rows["exact"][0], "seconds_pow2": pow2, "seconds_exact": exact,
            "ratio": pow2 / exact, "rows_ratio": rows["pow2"][0] / rows["exact"][0]}  # fmt: skip


def _inversion_cost(rt: EditPipeline, base, repeats: int) -> dict[str, Any]:
    """Seconds to make a base from an image (pipeline.invert: T rows backwards, one at a time,
    then T one-step rows forward in one tail) against generating one (T rows), interleaved."""
    from .shapes import Scene, render

    picture = render(Scene("red", "circle", "blue", "top left"), base.width).astype(np.float32) / 255
    seconds: dict[str, list[float]] = {"invert": [], "generate": []}
    for _ in range(repeats):
        seconds["invert"].append(_timed(lambda: rt.invert(picture, dataclasses.replace(base, image="sha256:bench")))[0])
        seconds["generate"].append(_timed(lambda: rt.generate_base(base))[0])
    invert, generate = statistics.median(seconds["invert"]), statistics.median(seconds["generate"])
    T = base.steps
    return {"steps": T, "rows_backwards": T, "rows_forward": T, "seconds_invert": invert, "seconds_generate": generate,
            "ratio": invert / generate}  # fmt: skip


def _tail_seconds(rt: EditPipeline, state, prompts: list[str], k: int, repeats: int, modes: dict[str, dict]) -> dict[str, float]:
    """Median seconds of one N-row tail of k steps for each mode (the TailRow fields it sets),
    the modes interleaved; a first round warms every mode up and is not counted."""
    base, T = state.base, state.base.steps
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(repeats + 1):
        for mode, fields in modes.items():
            rows = [TailRow(p, 1.0, T - k, base.guidance, **fields) for p in prompts]
            seconds[mode].append(_timed(lambda: rt.run_tail(state, rows))[0])
    return {mode: statistics.median(runs[1:]) for mode, runs in seconds.items()}


def _structure_cost(rt: EditPipeline, state, prompts: list[str], k: int, repeats: int, fraction: float = 0.5) -> dict[str, Any]:
    """One N-row tail of k steps keeping structure for ``fraction`` of it (one reference row,
    N + 1 rows for those steps) against the same tail without, interleaved."""
    seconds = _tail_seconds(rt, state, prompts, k, repeats, {"structure": {"structure": fraction}, "none": {}})
    kept, none = seconds["structure"], seconds["none"]
    n, steps = len(prompts), math.ceil(fraction * k)
    return {"n": n, "tail_steps": k, "structure_steps": steps, "seconds_structure": kept, "seconds_none": none,
            "ratio": kept / none, "row_steps_ratio": (n * k + steps) / (n * k)}  # fmt: skip


def _preserve_cost(rt: EditPipeline, state, prompts: list[str], k: int, repeats: int) -> dict[str, Any]:
    """One N-row tail of k steps with ``preserve: auto`` on every row against the same tail
    without it, interleaved: the maps graph's first steps and the masks are the difference."""
    seconds = _tail_seconds(rt, state, prompts, k, repeats, {"auto": {"preserve": "auto"}, "none": {}})
    auto, none = seconds["auto"], seconds["none"]
    return {"n": len(prompts), "tail_steps": k, "map_steps": rt.preserve.steps, "seconds_auto": auto,
            "seconds_none": none, "ratio": auto / none}  # fmt: skip


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
