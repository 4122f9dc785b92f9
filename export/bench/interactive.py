"""bench.json's ``interactive`` section: what a slider move costs at the sizes users run, each
measurement a function returning its own dict, side by side with its baseline in one process
(alternated, the median of the repeats). :func:`interactive` builds the section; a measurement
is one more key in it.

- ``unguided_vs_guided``: the same rows' tail at guidance 1 (the conditional prediction alone:
  each row's unconditional half is not computed, runtime/loop/row_scheduler.py) over the same tail at the
  base's guidance. The UNet rows each side ran (the step loop's counters) say what the ratio
  should be: N unguided rows run N UNet rows a step (no unconditional half at all: the step graph
  takes E = N, manifest ``step_all_given``; N + 1 on an export without it), N guided ones 2N.
- ``taesd_vs_vae``: one final latent decoded by the tiny decoder (``taesd_decoder``) over the same
  latent by the VAE (``vae_decoder``): what a preview costs against a final image (present where
  the export has a tiny decoder: the bench model's ``vae_tiny/``).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from edit_rt.runtime.model.edit import TailRow
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

from .side import _timed, ratios


def unguided_vs_guided(rt: EditPipeline, state, prompts: Sequence[str], k: int, repeats: int) -> dict[str, Any]:
    """``len(prompts)`` rows of a k-step tail at guidance 1 and at the base's guidance, alternated
    (which goes first alternates too); the first round warms both shapes up."""
    base, T = state.base, state.base.steps
    stats = rt.batcher(state.latents.shape[1:]).scheduler.stats
    sides = {"unguided": 1.0, "guided": base.guidance}
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    unet_rows: dict[str, int] = {}
    for r in range(repeats + 1):
        for side in sorted(sides, reverse=r % 2 == 1):
            rows = [TailRow(p, 1.0, T - k, sides[side]) for p in prompts]
            before = (stats.row_steps, stats.uncond_rows_skipped, stats.unguided_rows_skipped)
            seconds[side].append(_timed(lambda: rt.run_tail(state, rows))[0])
            row_steps, skipped, unguided = (stats.row_steps - before[0], stats.uncond_rows_skipped - before[1],
                                            stats.unguided_rows_skipped - before[2])  # fmt: skip
            unet_rows[side] = 2 * row_steps - skipped - unguided  # a row-step: both halves, less those skipped
    ratio = ratios(seconds["unguided"][1:], seconds["guided"][1:])
    return {"n": len(prompts), "tail_steps": k, "guidance": base.guidance,
            "seconds_unguided": statistics.median(seconds["unguided"][1:]),
            "seconds_guided": statistics.median(seconds["guided"][1:]),
            "ratio": ratio["median"], "ratio_spread": ratio["spread"],
            "unet_rows_unguided": unet_rows["unguided"], "unet_rows_guided": unet_rows["guided"],
            "unet_rows_ratio": unet_rows["unguided"] / unet_rows["guided"]}  # fmt: skip


def taesd_vs_vae(rt: EditPipeline, state, repeats: int) -> dict[str, Any]:
    """The base's final latent decoded by the tiny decoder and by the VAE, alternated (which goes
    first alternates too), at least 3 repeats after a first round that warms both up."""
    latents = state.final_latent
    seconds: dict[str, list[float]] = {"taesd": [], "vae": []}
    for r in range(max(3, repeats) + 1):
        for decoder in sorted(seconds, reverse=r % 2 == 1):
            seconds[decoder].append(_timed(lambda: rt.decode(latents, decoder))[0])
    ratio = ratios(seconds["taesd"][1:], seconds["vae"][1:])
    return {"latent_shape": list(latents.shape[1:]), "image_size": [state.base.width, state.base.height],
            "seconds_taesd": statistics.median(seconds["taesd"][1:]), "seconds_vae": statistics.median(seconds["vae"][1:]),
            "ratio": ratio["median"], "ratio_spread": ratio["spread"]}  # fmt: skip


def interactive(rt: EditPipeline, state, prompts: Sequence[str], k: int, repeats: int) -> dict[str, Any]:
    """The ``interactive`` section: each measurement under its own key."""
    section = {"unguided_vs_guided": unguided_vs_guided(rt, state, prompts, k, repeats)}
    if rt.decoders.preview_decoder == "taesd":  # an export with a tiny decoder
        section["taesd_vs_vae"] = taesd_vs_vae(rt, state, repeats)
    return section


def slider_move_keys(moves: dict[str, Any]) -> dict[str, Any]:
    """The section's keys from slider_move.py's report (each CPU engine in a process of its own):

    - ``few_step_move_seconds``: a slider move with LCM (4 steps, a 1-step tail, guidance off)
      and the tiny decoder on the default engine, the exact image back as a PNG;
    - ``few_step_move_over_limit``: that over its UNet rows' physical time (the rows the step loop
      counted x one row's GFLOP / the machine's measured GFLOP/s in the engine's precision);
    - ``default_move_seconds``: the same move with today's defaults (30 DDIM steps at guidance 7.5,
      a 6-step tail, the VAE), and ``server_move_seconds``: the few-step move through HTTP;
    - ``..._per_engine``: each per engine; ``slider_moves``: the whole report (every case's UNet
      rows, decode seconds, limit);
    - the default engine's own ``unguided_vs_guided`` and ``taesd_vs_vae`` where its process
      measured them (``sections``: a caller without a pipeline of its own, check_sd15.py)."""
    engines = moves["engines"]
    default = engines.get(moves["default_engine"], {}).get("cases", {})
    sections = engines.get(moves["default_engine"], {}).get("sections", {})

    def per_engine(case: str, key: str) -> dict[str, Any]:
        return {name: r["cases"][case][key] for name, r in engines.items() if case in r["cases"]}

    return {
        **sections,
        "few_step_move_seconds": default.get("few_step", {}).get("seconds"),
        "few_step_move_over_limit": default.get("few_step", {}).get("over_limit"),
        "default_move_seconds": default.get("default", {}).get("seconds"),
        "server_move_seconds": default.get("server", {}).get("seconds"),
        "few_step_move_seconds_per_engine": per_engine("few_step", "seconds"),
        "few_step_move_over_limit_per_engine": per_engine("few_step", "over_limit"),
        "default_move_seconds_per_engine": per_engine("default", "seconds"),
        "server_move_seconds_per_engine": per_engine("server", "seconds"),
        "slider_moves": moves,
    }
