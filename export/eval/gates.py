"""The gates a shapes model passes before it replaces the embedded default (issue 26), each
measured on the model through edit-rt's runtime, from one run:

- **prompt following** over ``prompts`` generations (export/eval/judges.py ``follow``): colours and
  background >= 0.98, the first object's kind >= 0.90, position (one object: where it is; two:
  their relation) >= 0.80, the second object's attributes >= 0.90;
- **the oracle-mask ceiling** (``oracle_ceiling``): colour edits whose keep-mask is the reader's
  own segmentation of the base (an oracle no runtime has) keep the rest >= 0.90;
- **the maps**: the changed words' cross-attention maps (the maps graph's grid: 16x16 on the
  64x64 model) overlap the edited object with IoU >= 0.6: the ``preserve: auto`` region of a
  colour edit, thresholded as ``map_threshold`` of its min-max normalised map, against the
  latent cells the object covers at least half of.

``run_gates`` writes ``gates.json``; the model card's tables come from it.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from edit_rt.runtime.config.run_config import RunConfig
from edit_rt.runtime.model.automask import dilate
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline, TailRow

from .judges import World1, foreground, iou, judge_of
from .quality import Tally, _prompt_following, quality_bases

GOALS = {
    "colours_and_background": 0.98, "shape": 0.90, "position": 0.80, "second_object": 0.90,
    "oracle_colour_preserved": 0.90, "map_iou": 0.60,
}  # fmt: skip


def _cells(mask: np.ndarray, hw: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A pixel mask (bool, or coverage 0..1) on a latent grid ``hw``: the cells it touches, those
    it fills, and those it covers at least half of."""
    h, w = hw
    s = mask.shape[0] // h
    cells = np.asarray(mask, dtype=np.float64).reshape(h, s, w, s)
    return cells.max(axis=(1, 3)) > 0, cells.min(axis=(1, 3)) > 0, cells.mean(axis=(1, 3)) >= 0.5


def _edited_pixels(judge, seen, base_image: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(the pixels a ``kind`` edit is about, as a mask; as a coverage): world 1 the shape (all
    of it, as its reader segments it); world 2 the prompt's first object, or every object for a
    background edit."""
    if isinstance(judge, World1):
        mask = foreground(base_image, seen.background, judge.looks)
        return mask, mask.astype(np.float64)
    objects = seen.objects if kind.startswith("background") else seen.objects[:1]
    return np.logical_or.reduce([o.mask for o in objects]), np.maximum.reduce([o.coverage for o in objects])


def oracle_ceiling(pipe: EditPipeline, cfg: RunConfig, bases: int = 50, advance: Callable[[int], None] = lambda n: None) -> list[dict]:
    """The ceiling of mask-based preservation: `make quality`'s bases and edits (same seeds),
    each run alone at the default tail with the keep-mask taken from the reader's segmentation of
    the base, through the runtime's own mask path (latents kept outside, pixels composited), at
    strengths 1 and 1.5. Colour edits may change the shape's latent cells (``d0``) or those grown
    by one cell (``d1``); background edits keep the cells that touch the shapes (``any``) or
    only those inside them (``all``). A row per (setting, kind, strength)."""
    judge = judge_of(cfg.model_dir)
    T = cfg.base.steps
    oracle: dict[str, Optional[np.ndarray]] = {"keep": None}
    own = pipe.keep_mask
    pipe.keep_mask = lambda mask, shape: oracle["keep"] if oracle["keep"] is not None else own(mask, shape)
    tallies: dict[tuple, Tally] = defaultdict(Tally)
    start = T - max(1, round(cfg.cache.default_tail_fraction * T))
    try:
        for _, base, state, base_image, seen, edits in quality_bases(pipe, cfg, judge, bases, advance):
            if seen is None:
                continue
            hw = state.latents.shape[-2:]
            for kind, (target, text) in edits.items():
                name = kind.split(",")[0]
                if name == "shape":
                    continue
                touching, inside, _ = _cells(_edited_pixels(judge, seen, base_image, kind)[0], hw)
                keeps = {"d0": ~touching, "d1": ~dilate(touching, 1)} if name == "colour" else {"any": touching, "all": inside}
                for label, keep in keeps.items():
                    for strength in (1.0, 1.5):
                        oracle["keep"] = keep[None]
                        (result,) = pipe.edit(state, [TailRow(text, strength, start, base.guidance)])
                        oracle["keep"] = None
                        tallies[f"oracle {label}", kind, strength].add(judge.score(result.image, base_image, seen, target, kind))
    finally:
        pipe.keep_mask = own
    return [{"setting": s, "kind": k, "strength": x, **t.row()} for (s, k, x), t in sorted(tallies.items())]


def map_overlap(pipe: EditPipeline, cfg: RunConfig, bases: int = 50, thresholds: tuple[float, ...] = (0.3, 0.5),
                advance: Callable[[int], None] = lambda n: None) -> dict[str, Any]:  # fmt: skip
    """IoU of the changed words' thresholded maps with the edited object's cells, over colour
    edits of `make quality`'s bases (default tail): ``preserve: auto`` with ``region: words`` and
    no dilation, per threshold; the object's cells are those it covers at least half of."""
    judge = judge_of(cfg.model_dir)
    T = cfg.base.steps
    start = T - max(1, round(cfg.cache.default_tail_fraction * T))
    scores: dict[str, list[float]] = defaultdict(list)
    own = pipe.preservation.preserve
    try:
        for _, base, state, base_image, seen, edits in quality_bases(pipe, cfg, judge, bases, advance):
            if seen is None:
                continue
            hw = state.latents.shape[-2:]
            for kind, (_, text) in edits.items():
                if not kind.startswith("colour"):
                    continue
                _, _, half = _cells(_edited_pixels(judge, seen, base_image, kind)[1], hw)
                for t in thresholds:
                    pipe.preservation.preserve = dataclasses.replace(own, threshold=t, dilate=0, region="words")
                    (result,) = pipe.edit(state, [TailRow(text, cfg.cache.default_strength, start, base.guidance, preserve="auto")])
                    if result.keep is None:
                        continue
                    scores[f"threshold {t:g}"].append(iou(~result.keep[0], half))
                    scores[f"threshold {t:g}, {kind}"].append(iou(~result.keep[0], half))
    finally:
        pipe.preservation.preserve = own
    return {"map_factor": pipe.map_factor, "n": {k: len(v) for k, v in scores.items()},
            "iou": {k: float(np.mean(v)) for k, v in scores.items()}}  # fmt: skip


def run_gates(cfg: RunConfig, prompts: int = 100, bases: int = 50, out: Optional[Path] = None,
              say: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Every gate on ``cfg``'s model; ``gates.json`` in ``out`` (default: the model folder)."""
    judge = judge_of(cfg.model_dir)
    with EditPipeline(cfg.onnx_dir, cfg.model_dir, threads=cfg.threads, image_size=(cfg.base.height, cfg.base.width)) as pipe:
        following = _prompt_following(pipe, cfg.base, prompts, judge)
        say(f"prompt following: {following}")
        oracle = oracle_ceiling(pipe, cfg, bases)
        say(f"oracle: {len(oracle)} rows")
        maps = map_overlap(pipe, cfg, bases)
        say(f"maps: {maps['iou']}")
    # per oracle setting and strength, colour edits of one-object and two-object bases together
    pooled: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in oracle:
        if r["kind"].startswith("colour"):
            pooled[r["setting"], r["strength"]][0] += r["preservation"] * r["n"]
            pooled[r["setting"], r["strength"]][1] += r["n"]
    best_oracle = max((kept / n for kept, n in pooled.values() if n), default=None)
    measured = {
        **{k: following.get(k) for k in ("colours_and_background", "shape", "position", "second_object")},
        "oracle_colour_preserved": best_oracle,
        "map_iou": max((v for k, v in maps["iou"].items() if "," not in k), default=None),
    }
    if isinstance(judge, World1):  # world 1's names for the same attributes
        measured["colours_and_background"] = min(following["colour"], following["background"])
        measured["second_object"] = None
    gates = {k: {"goal": GOALS[k], "measured": v, "met": v is not None and v >= GOALS[k]} for k, v in measured.items()}
    report = {"model": str(cfg.model), "world": judge.world, "prompts": prompts, "bases": bases, "steps": cfg.base.steps,
              "guidance": cfg.base.guidance, "gates": gates, "prompt_following": following, "oracle": oracle,
              "maps": maps}  # fmt: skip
    path = Path(out or cfg.model_dir) / "gates.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    say(f"wrote {path}")
    return report
