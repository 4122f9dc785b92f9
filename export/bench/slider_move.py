"""A slider move measured on each CPU engine (issue 51, item 7): one edit row of an existing base
at a new strength, the exact image back (a PNG), beside the physical limit of the UNet rows it
ran.

A move is timed alone: its base is generated before, untimed, once per schedule (by the first
engine's process, saved, so every engine starts from the same latents and K/V, as
cpu_engines.py does), and reused by every repeat, each repeat at a new strength after a warm-up
move that encodes the edit prompt and makes the row's shapes (OpenVINO compiles them then). The
cases, side by side in one process per engine (``ort-cpu``, ``openvino`` fp32 and bf16; its
peak RSS, its load and compile its own):

- ``default``: today's defaults, a 30-step DDIM base at guidance 7.5, a 6-step tail, the VAE;
- ``few_step``: LCM at 4 steps, a 1-step tail, guidance off (1.0), the tiny decoder (TAESD;
  the VAE where the export has none, said in ``decoder``);
- ``server``: ``few_step`` through the server: the in-process app over a real loopback uvicorn,
  an edit POSTed over HTTP and its PNG back, timed at the client.

Each case's UNet rows are the step loop's counters, read around each move (the server's from its
``/metrics``): two per guided row-step, less the unconditional halves not computed (an edit's
entry step takes its base's; an unguided row needs none). Its physical limit is those rows x one
row's FLOPs (torch's ``FlopCounterMode``, cpu_engines.unet_flops) over the machine's measured
GFLOP/s in the engine's precision (cpu_engines.machine_limit); ``over_limit`` is the move's
seconds over that. ``decode_seconds`` is one decode of the move's latent by the case's decoder,
timed apart.

    python -m edit_rt.export.bench.slider_move configs/bench.yaml --out out/bench
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import gc
import json
import logging
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from edit_rt.runtime.config.run_config import RunConfig
from edit_rt.runtime.model.edit import Edit, resolve_edit
from edit_rt.runtime.pipeline.assemble import pipeline_of

from .cpu_engines import ENGINES, engine_name, peak_rss

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoveCase:
    """A base's schedule and the tail a slider move of it runs."""

    sampler: str
    steps: int
    guidance: float
    tail_steps: int
    decoder: str  # "taesd" falls back to the VAE where the export has no tiny decoder


CASES = {
    # what edit-rt does without being told: DDIM's usual 30 steps, guidance 7.5, a tail of a fifth
    "default": MoveCase("ddim", 30, 7.5, 6, "vae"),
    # what real-time users run: a consistency model's 4 steps, its last one the move, no CFG
    "few_step": MoveCase("lcm", 4, 1.0, 1, "taesd"),
}
SERVER = "server"  # the few_step case through HTTP


def move_strengths(repeats: int) -> tuple[float, list[float]]:
    """The warm-up's strength and each timed move's: every move a new one."""
    return 0.5, [round(0.5 + 0.1 * (r + 1), 2) for r in range(repeats)]


def edit_prompt(cfg: RunConfig) -> str:
    """The config's first edit prompt, else the base prompt with a style added."""
    if cfg.edits and cfg.edits[0].prompt:
        return cfg.edits[0].prompt
    return f"{cfg.base.prompt}, watercolor"


def unet_rows(before, after) -> int:
    """UNet rows the step loop ran between two copies of its counters: both halves of every row
    computed (bucket padding included), less the unconditional halves it did not compute."""
    return (2 * (after.rows_computed - before.rows_computed) - (after.uncond_rows_skipped - before.uncond_rows_skipped)
            - (after.unguided_rows_skipped - before.unguided_rows_skipped))  # fmt: skip


def _limit_fields(seconds: float, rows: int, gflop_per_row: float, limit_gflops: float) -> dict[str, Any]:
    limit = rows * gflop_per_row / limit_gflops
    return {"limit_seconds": limit, "over_limit": seconds / limit if limit > 0 else None}


def _moves_report(case: MoveCase, decoder: str, strengths: list[float], warm: tuple[float, int],
                  runs: list[tuple[float, int]], png: bytes, png_out: Optional[Path], gflop_per_row: float,
                  limit_gflops: float) -> dict[str, Any]:  # fmt: skip
    """A case's report from its warm-up (seconds, UNet rows) and timed moves (the same), the
    median move beside its rows' limit; the last move's PNG written to ``png_out``."""
    if png_out is not None:
        png_out.parent.mkdir(parents=True, exist_ok=True)
        png_out.write_bytes(png)
    seconds, rows = statistics.median(r[0] for r in runs), runs[-1][1]
    return {**dataclasses.asdict(case), "decoder": decoder, "strengths": strengths, "seconds": seconds,
            "runs": [round(r[0], 4) for r in runs], "unet_rows": rows, "unet_rows_runs": [r[1] for r in runs],
            "warm_seconds": warm[0], "warm_unet_rows": warm[1],
            **_limit_fields(seconds, rows, gflop_per_row, limit_gflops)}  # fmt: skip


def time_moves(cfg: RunConfig, rt, state, case: MoveCase, repeats: int, gflop_per_row: float, limit_gflops: float,
               png_out: Optional[Path] = None) -> dict[str, Any]:  # fmt: skip
    """A warm-up move, then ``repeats`` timed moves of one row of ``state`` (each: the edit,
    decoded, as a PNG with its parameters); the report. ``png_out``: the last move's PNG."""
    from edit_rt.runtime.pipeline.images import png_bytes
    from edit_rt.runtime.pipeline.pnginfo import edit_fields, parameters_text
    from edit_rt.runtime.storage.store import base_id

    base = state.base
    decoder = case.decoder if case.decoder == "vae" or rt.decoders.preview_decoder == case.decoder else "vae"
    stats = rt.batcher(state.latents.shape[1:]).scheduler.stats
    prompt, bid = edit_prompt(cfg), base_id(state.fingerprint, base)

    def move(strength: float) -> tuple[float, int, float, Any, bytes]:
        # the edit as a config or a request gives it: the same defaults (preserve, tail.uncond)
        row = resolve_edit(Edit(prompt=prompt, strength=strength, tail_steps=case.tail_steps), base,
                           state.window_start, cfg.edit_defaults(), "slider move")  # fmt: skip
        before, unet_before = dataclasses.replace(stats), stats.step_seconds
        start = time.perf_counter()
        (result,) = rt.edit(state, [row], decoder=decoder)
        fields = edit_fields(base, row, cfg.model_name, state.fingerprint, bid, result.preserve, result.uncond)
        png = png_bytes(result.image, parameters_text(row.prompt, base.negative_prompt, fields))
        seconds = time.perf_counter() - start
        return seconds, unet_rows(before, stats), stats.step_seconds - unet_before, result, png

    warm_strength, strengths = move_strengths(repeats)
    warm = move(warm_strength)[:2]
    runs = [move(s) for s in strengths]
    start = time.perf_counter()
    rt.decode(runs[-1][3].latent[None], decoder)
    decode_seconds = time.perf_counter() - start
    report = _moves_report(case, decoder, strengths, warm, runs, runs[-1][4], png_out, gflop_per_row, limit_gflops)
    return {**report, "unet_seconds": statistics.median(r[2] for r in runs), "decode_seconds": decode_seconds}


def case_base(cfg: RunConfig, case: MoveCase):
    return dataclasses.replace(cfg.base, sampler=case.sampler, steps=case.steps, guidance=case.guidance)


def _scheduler_rows(client) -> dict[str, float]:
    """The server's step-loop counters, from its ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics").raise_for_status().text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("edit_rt_unet_")}  # fmt: skip


def _server_rows(before: dict[str, float], after: dict[str, float]) -> int:
    """As :func:`unet_rows`, from the server's counters (its rows exclude padding, counted apart)."""
    d = {k.removeprefix("edit_rt_unet_").removesuffix("_total"): after[k] - before.get(k, 0.0) for k in after}
    return int(2 * (d["rows"] + d["padding_rows"]) - d["uncond_halves_skipped"] - d["unguided_halves_skipped"])


def time_server_moves(cfg: RunConfig, case: MoveCase, decoder: str, repeats: int, gflop_per_row: float,
                      limit_gflops: float, png_out: Optional[Path] = None) -> dict[str, Any]:  # fmt: skip
    """``case`` through `edit-rt serve` (in this process, on a loopback port): its base
    generated by a request (untimed), a warm-up edit, then ``repeats`` edits each at a new
    strength, each POSTed and its PNG back, timed at the client."""
    import httpx

    from .side import server_in_process

    base = case_base(cfg, case)
    warm_strength, strengths = move_strengths(repeats)
    start = time.perf_counter()
    with server_in_process(cfg) as url, httpx.Client(base_url=url, timeout=3600) as client:
        loaded = time.perf_counter() - start
        body = {"prompt": base.prompt, "negative_prompt": base.negative_prompt, "seed": base.seed,
                "steps": base.steps, "cfg_scale": base.guidance, "sampler": base.sampler}  # fmt: skip
        bid = client.post("/v1/images/generations", json=body).raise_for_status().json()["id"]

        def move(strength: float) -> tuple[float, int, bytes]:
            edit = {"prompt": edit_prompt(cfg), "strength": strength, "tail_steps": case.tail_steps}
            counters = _scheduler_rows(client)
            start = time.perf_counter()
            answer = client.post("/v1/images/edits", json={"base_id": bid, "edits": [edit], "decoder": decoder})
            png = base64.b64decode(answer.raise_for_status().json()["data"][0]["b64_json"])
            seconds = time.perf_counter() - start
            return seconds, _server_rows(counters, _scheduler_rows(client)), png

        warm = move(warm_strength)[:2]
        runs = [move(s) for s in strengths]
    report = _moves_report(case, decoder, strengths, warm, runs, runs[-1][2], png_out, gflop_per_row, limit_gflops)
    return {**report, "load_seconds": loaded}


def engine_moves(cfg: RunConfig, backend: str, precision: str, threads: int, bases: Path, repeats: int,
                 gflop_per_row: float, limit_gflops: float, server: bool = True, images: Optional[Path] = None,
                 sections: bool = False) -> dict[str, Any]:  # fmt: skip
    """Every case on one engine, in this process: the report (``cases``, load and peak RSS).
    ``bases``: the folder the bases are saved to and read from; ``images``: each case's last
    PNG there; ``sections``: also interactive.py's ``unguided_vs_guided`` and ``taesd_vs_vae`` (on
    the default case's base), for a caller without them."""
    engines = dataclasses.replace(cfg.engines, precision=precision)
    cfg = dataclasses.replace(cfg, backend=backend, threads=threads, engines=engines)
    name = engine_name(backend, precision).replace(" ", "-")
    start = time.perf_counter()
    rt = pipeline_of(cfg).activate()
    report: dict[str, Any] = {"backend": rt.graph_set.backend, "reason": rt.graph_set.reason,
                              "load_seconds": time.perf_counter() - start, "cases": {}, "bases": {}}  # fmt: skip
    states = {}
    bases.mkdir(parents=True, exist_ok=True)
    for key, case in CASES.items():
        path = bases / f"{key}.pkl"
        if path.is_file():
            states[key] = pickle.loads(path.read_bytes())
            continue
        stats = rt.batcher(rt.latent_shape(case_base(cfg, case))).scheduler.stats
        before, start = dataclasses.replace(stats), time.perf_counter()
        states[key] = rt.generate_base(case_base(cfg, case), cfg.cache.window_start)
        report["bases"][key] = {"seconds": time.perf_counter() - start, "unet_rows": unet_rows(before, stats)}
        path.write_bytes(pickle.dumps(states[key]))
    for key, case in CASES.items():
        png = None if images is None else images / f"{name}-{key}.png"
        report["cases"][key] = time_moves(cfg, rt, states[key], case, repeats, gflop_per_row, limit_gflops, png)
    if sections:
        from .interactive import interactive

        report["sections"] = interactive(rt, states["default"], [edit_prompt(cfg)], 2, 1)
    rt.deactivate()
    del rt, states  # the server loads its own engines: these are not held beside them
    gc.collect()
    if server:
        few = report["cases"]["few_step"]
        png = None if images is None else images / f"{name}-{SERVER}.png"
        report["cases"][SERVER] = time_server_moves(cfg, CASES["few_step"], few["decoder"], repeats, gflop_per_row,
                                                    limit_gflops, png)  # fmt: skip
    report["peak_rss_bytes"] = peak_rss()
    return report


def _probe(config: Path, latent_hw: tuple[int, int], threads: int, model_dir: Path) -> tuple[int, dict[str, Any]]:
    """One UNet row's FLOPs and the machine's limit, in a process of their own (cpu_engines.py's
    probe: torch's and OpenVINO's thread pools stay out of this process)."""
    probe = [sys.executable, "-m", "edit_rt.export.bench.cpu_engines", str(config), "--probe",
             json.dumps([str(model_dir), list(latent_hw), threads])]  # fmt: skip
    done = subprocess.run(probe, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"counting the UNet's FLOPs and the machine's limit failed:\n{done.stderr[-3000:]}")
    flops, limit = json.loads(done.stdout.strip().splitlines()[-1])
    return flops, limit


def default_engine(cfg: RunConfig) -> str:
    """The CPU engine the config runs on: its backend, ``auto`` resolved as a run resolves it."""
    from edit_rt.runtime.engine.backend import CPU_BACKENDS
    from edit_rt.runtime.engine.graph_set import backend_for
    from edit_rt.runtime.engine.manifest import load_manifest

    manifest = load_manifest(cfg.onnx_dir)
    scale = manifest.data["model"]["vae_scale_factor"]
    budget = None if cfg.engines.max_memory_gb is None else int(cfg.engines.max_memory_gb * 1e9)
    backend = backend_for(cfg.backend, set(), manifest, (cfg.base.height // scale, cfg.base.width // scale), budget)[0]
    if backend not in CPU_BACKENDS:  # a GPU machine: its CPU default
        backend = "ort-cpu"
    if backend != "openvino":
        return engine_name(backend, "fp32")
    from edit_rt.runtime.engine.backend_ov import openvino_precision

    return engine_name(backend, openvino_precision(cfg.backend, cfg.engines.precision)[0])


def measure_slider_moves(config: Path, engines: Sequence[tuple[str, str]] = ENGINES, repeats: int = 3,
                         threads: int = 0, server: bool = True, sections: bool = False, images: Optional[Path] = None,
                         flops_and_limit: Optional[tuple[float, dict]] = None,
                         say: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Every engine's moves, each engine in a process of its own; the report (``engines``: each
    one's :func:`engine_moves`, ``failed``). ``flops_and_limit``: one UNet row's FLOPs and the
    machine's limit where the caller measured them (cpu_engines' report), else measured here;
    ``sections``: interactive.py's own measurements too, on the default engine."""
    from edit_rt.runtime.config.load import load_config
    from edit_rt.runtime.engine.backend_ov import bf16_unavailable_reason
    from edit_rt.runtime.engine.manifest import load_manifest

    cfg = load_config(Path(config))
    threads = threads or cfg.threads or os.cpu_count() or 1
    if bf16_unavailable_reason() is not None:
        say(f"slider moves: no bf16 here ({bf16_unavailable_reason()})")
        engines = [e for e in engines if e[1] != "bf16"]
    if flops_and_limit is None:
        scale = load_manifest(cfg.onnx_dir).vae_scale_factor
        latent_hw = (cfg.base.height // scale, cfg.base.width // scale)
        flops_and_limit = _probe(Path(config), latent_hw, threads, cfg.require_model_dir())
    flops, limit = flops_and_limit
    gflop = flops / 1e9
    default = default_engine(cfg)
    say(f"slider moves: {gflop:.1f} GFLOP a UNet row; machine limit {limit['fp32']:.0f} GFLOP/s fp32, "
        f"{limit['bf16']:.0f} bf16; default engine {default}")  # fmt: skip
    reports: dict[str, dict[str, Any]] = {}
    failed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="edit-rt-moves-") as bases:
        for backend, precision in engines:
            name = engine_name(backend, precision)
            args = [sys.executable, "-m", "edit_rt.export.bench.slider_move", str(config), "--child",
                    json.dumps([backend, precision, threads, bases, repeats, gflop, limit[precision], server,
                                None if images is None else str(images), sections and name == default])]  # fmt: skip
            done = subprocess.run(args, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
            if done.returncode != 0:  # killed for memory (-9), say: kept as a row of its own
                failed.append({"engine": name, "returncode": done.returncode, "stderr": done.stderr[-2000:]})
                say(f"slider moves: {name} failed (exit {done.returncode}): {done.stderr[-500:]}")
                continue
            reports[name] = json.loads(done.stdout.strip().splitlines()[-1])
            cases = reports[name]["cases"]
            say(f"slider moves: {name}: " + ", ".join(f"{key} {c['seconds']:.2f} s ({c['unet_rows']} UNet rows, "
                                                      f"{c['over_limit']:.2f}x their limit)" for key, c in cases.items()))  # fmt: skip
    return {"model": str(cfg.model), "image_size": [cfg.base.width, cfg.base.height], "threads": threads,
            "repeats": repeats, "gflop_per_unet_row": gflop, "machine_limit_gflops": limit, "default_engine": default,
            "cases": {key: dataclasses.asdict(case) for key, case in CASES.items()}, "engines": reports,
            "failed": failed}  # fmt: skip


def print_table(report: dict[str, Any], say: Callable[[str], None] = print) -> None:
    say("| engine | case | s a move | UNet rows | their limit (s) | move / limit | UNet s | decode s | peak RSS |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in report["engines"].items():
        for key, c in r["cases"].items():
            unet = f"{c['unet_seconds']:.3f}" if "unet_seconds" in c else "-"
            decode = f"{c['decode_seconds']:.3f} ({c['decoder']})" if "decode_seconds" in c else f"- ({c['decoder']})"
            say(f"| {name} | {key} | {c['seconds']:.3f} | {c['unet_rows']} | {c['limit_seconds']:.3f} | "
                f"{c['over_limit']:.2f}x | {unet} | {decode} | {r['peak_rss_bytes'] / 1e9:.2f} GB |")  # fmt: skip
    for failure in report.get("failed", []):
        say(f"| {failure['engine']} | failed (exit {failure['returncode']}) | | | | | | | |")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path)
    p.add_argument("--out", type=Path, default=Path("out/bench"))
    p.add_argument("--repeats", type=int, default=3, help="timed moves per case and engine, each a new strength")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--no-server", action="store_true", help="leave out the moves through the server")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        from edit_rt.runtime.config.load import load_config

        backend, precision, threads, bases, repeats, gflop, limit, server, images, sections = json.loads(args.child)
        report = engine_moves(load_config(args.config), backend, precision, threads, Path(bases), repeats, gflop, limit,
                              server, None if images is None else Path(images), sections)  # fmt: skip
        print(json.dumps(report))
        return 0
    report = measure_slider_moves(args.config, repeats=args.repeats, threads=args.threads, server=not args.no_server,
                                  images=args.out / "slider-moves")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "slider-moves.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
