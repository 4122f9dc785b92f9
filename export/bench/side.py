"""`make bench`'s side-by-side measurements beside the main table (throughput.py), each interleaved
with its baseline in one process: the server against one run tail, entry-step reuse on and off,
padded buckets against exact counts, inversion against generation, preserve: auto and
structure keeping against the plain tail; and the timing helpers they and throughput.py share.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from edit_rt.runtime.config.run_config import RunConfig
from edit_rt.runtime.model.edit import TailRow
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline


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


def ratios(top: Sequence[float], bottom: Sequence[float]) -> dict[str, Any]:
    """``top[r] / bottom[r]`` per repeat r (the two ran side by side in it): the runs, their
    median and their spread (min, max)."""
    runs = [a / b for a, b in zip(top, bottom)]
    return {"median": statistics.median(runs), "spread": [min(runs), max(runs)], "runs": runs}


def _timed(fn: Callable[[], Any]) -> tuple[float, int]:
    rss = PeakRss()
    with rss.measure():
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, rss.peak_bytes


@contextmanager
def server_in_process(cfg: RunConfig) -> Iterator[str]:
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


def server_vs_run(cfg: RunConfig, rt: EditPipeline, state, prompts: list[str], k: int, repeats: int,
                  drag_steps: int = 0) -> dict[str, Any]:  # fmt: skip
    """The same edits of one base: N concurrent single-edit requests to the server against one
    ``edit-rt run`` tail (run_tail + decode), interleaved, median of ``repeats``; and the page's
    slider drag (one edit of ``drag_steps`` steps, 0: k, a new strength, the PNG back) timed."""
    import httpx

    base, T = state.base, state.base.steps
    rows = [TailRow(p, 1.0, T - k, base.guidance) for p in prompts]

    def one_tail() -> None:
        rt.decode(rt.run_tail(state, rows))

    with server_in_process(cfg) as url, httpx.Client(base_url=url, timeout=600) as client:
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

        def drag(strength: float) -> None:  # the page's slider move: one edit, a new strength, its PNG back
            edit = {"prompt": prompts[0], "strength": strength, "tail_steps": drag_steps or k}
            client.post("/v1/images/edits", json={"base_id": bid, "edits": [edit]}).raise_for_status()

        concurrent()  # warm up: the server's first calls at each row count allocate
        one_tail()
        drag(0.5)
        served, ran, dragged = [], [], []
        for r in range(repeats):
            served.append(_timed(concurrent)[0])
            ran.append(_timed(one_tail)[0])
            dragged.append(_timed(lambda: drag(0.75 + 0.25 * r))[0])
    n = len(prompts)
    server_eps, run_eps = n / statistics.median(served), n / statistics.median(ran)
    return {"n": n, "tail_steps": k, "server_edits_per_s": server_eps, "run_edits_per_s": run_eps,
            "ratio": server_eps / run_eps, "server_runs": served, "run_runs": ran,
            "page_drag_seconds": statistics.median(dragged), "page_drag_runs": dragged}  # fmt: skip


def entry_reuse(rt: EditPipeline, state, prompts: list[str], k: int, repeats: int) -> dict[str, Any]:
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
            # every row skips its entry step's unconditional half: n / (2 n k) (n - 1 on an export
            # without step_all_given, where one per call is computed)
            "expected_saving": skipped / (2 * n * k), "measured_saving": 1 - with_reuse / without}  # fmt: skip


def slider_move(rt: EditPipeline, state, prompt: str, k: int, repeats: int) -> dict[str, Any]:
    """A slider move on the page: one row, its edit prompt already encoded, a new strength. Each
    move's seconds (K/V mix, the k-step tail, the decode) against its UNet calls' own (the step
    loop's clock), and the first edit's (which encodes the prompt) for comparison; per repeat."""
    base, T = state.base, state.base.steps
    stats = rt.batcher(state.latents.shape[1:]).scheduler.stats
    rt.resolver.encoded.pop((prompt, base.clip_skip, False, ()), None)
    first = _timed(lambda: rt.decode(rt.run_tail(state, [TailRow(prompt, 1.0, T - k, base.guidance)])))[0]
    moves, unet = [], []
    for r in range(repeats + 1):  # the first move warms the one-row shapes
        row = TailRow(prompt, 0.5 + 0.25 * r, T - k, base.guidance)
        before = stats.step_seconds
        moves.append(_timed(lambda: rt.decode(rt.run_tail(state, [row])))[0])
        unet.append(stats.step_seconds - before)
    over = ratios(moves[1:], unet[1:])
    return {"tail_steps": k, "seconds_first_edit": first, "seconds_move": statistics.median(moves[1:]),
            "seconds_move_unet": statistics.median(unet[1:]), "move_over_unet": over["median"],
            "move_over_unet_spread": over["spread"]}  # fmt: skip


def bucket_cost(rt: EditPipeline, state, prompts: list[str], k: int, repeats: int) -> dict[str, Any]:
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


def inversion_cost(rt: EditPipeline, base, repeats: int) -> dict[str, Any]:
    """Seconds to make a base from an image (pipeline.invert: T rows backwards, one at a time,
    then T one-step rows forward in one tail) against generating one (T rows), interleaved."""
    from ..world.shapes import Scene, render

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


def structure_cost(rt: EditPipeline, state, prompts: list[str], k: int, repeats: int, fraction: float = 0.5) -> dict[str, Any]:
    """One N-row tail of k steps keeping structure for ``fraction`` of it (one reference row,
    N + 1 rows for those steps) against the same tail without, interleaved."""
    seconds = _tail_seconds(rt, state, prompts, k, repeats, {"structure": {"structure": fraction}, "none": {}})
    kept, none = seconds["structure"], seconds["none"]
    n, steps = len(prompts), math.ceil(fraction * k)
    return {"n": n, "tail_steps": k, "structure_steps": steps, "seconds_structure": kept, "seconds_none": none,
            "ratio": kept / none, "row_steps_ratio": (n * k + steps) / (n * k)}  # fmt: skip


def preserve_cost(rt: EditPipeline, state, prompts: list[str], k: int, repeats: int) -> dict[str, Any]:
    """One N-row tail of k steps with ``preserve: auto`` on every row against the same tail
    without it, interleaved: the maps graph's first steps and the masks are the difference."""
    seconds = _tail_seconds(rt, state, prompts, k, repeats, {"auto": {"preserve": "auto"}, "none": {}})
    auto, none = seconds["auto"], seconds["none"]
    return {"n": len(prompts), "tail_steps": k, "map_steps": rt.preservation.preserve.steps, "seconds_auto": auto,
            "seconds_none": none, "ratio": auto / none}  # fmt: skip


def catalogue_cost(cfg: RunConfig, rt: EditPipeline, state, prompts: list[str], k: int,
                   sizes: Sequence[int] = (16, 64, 256)) -> dict[str, Any]:  # fmt: skip
    """Catalogues of ``sizes`` rows (the prompts, each at ``size / len(prompts)`` strengths) run
    as `edit-rt run` runs them, each image decoded and written as a PNG: edits/s and the
    process's peak memory per size (a catalogue holds one chunk of rows at a time)."""
    import tempfile
    from pathlib import Path

    from edit_rt.runtime.pipeline.catalogue import run_catalogue
    from edit_rt.runtime.config.catalogue import Catalogue
    from edit_rt.runtime.storage.store import base_id

    out: dict[str, Any] = {"tail_steps": k, "sizes": {}}
    bid = base_id(state.fingerprint, state.base)
    for n in sizes:
        per = max(1, n // len(prompts))
        edits = [{"prompt": p, "tail_steps": k} for p in prompts[: min(n, len(prompts))]]
        spec = Catalogue(edits=edits, sliders=[{"from": 0.5, "to": 1.5, "n": per}] if per > 1 else [], max_rows=max(n, 1))
        with tempfile.TemporaryDirectory() as folder:
            run = dataclasses.replace(cfg, output_dir=Path(folder), catalogue=spec)
            seconds, peak = _timed(lambda: run_catalogue(run, rt, state, state.base, bid, lambda total, what: lambda m: None))
        out["sizes"][str(spec.size())] = {"seconds": seconds, "edits_per_s": spec.size() / seconds, "peak_rss_mb": peak / 2**20}
    first = out["sizes"][str(min(int(s) for s in out["sizes"]))]["edits_per_s"]
    out["edits_per_s_over_smallest"] = {s: v["edits_per_s"] / first for s, v in out["sizes"].items()}
    return out
