"""`make quality-plans` (issue 55): the planner's plans judged on seeded scenes, beside the expert's.

For each of ``scenes`` scenes (``driving.random_scene`` from ``default_rng(seed)``) the loop of
runtime/pipeline/plans.py plans the base (keep lane, aggressiveness 0.5) and every behaviour at
every aggressiveness level as one batched tail, at each tail length asked (the longest, ``steps``,
re-runs the whole chain from the base's own noise: sampling every variant from noise, the
diffusers-style baseline at the same cost per row). Every plan is judged by the world's judge
(runtime/model/driving.py) and so is the expert's plan of the same variant. Reported per behaviour
and tail, over the variants the expert finds feasible (its plan exists):

- ``done``: the judge's ``behaviour_ok``; ``collision_free``; ``success`` (done, no collision, on
  the road); the expert's own on the same variants beside them;
- ``monotone``: the share of (scene, behaviour) where the expert is feasible at every level whose
  peak acceleration rises with aggressiveness (Spearman rho >= 0.9 over the levels), as the
  issue's bar reads; the expert's own share beside it;
- ``comfort``: median peak acceleration and jerk, the plan's and the expert's.

"default" is the config's own tails (``plan.tail_steps`` and ``plan.behaviour_tails``), what
`edit-rt run` and the server plan with.

Writes ``quality_plans.json`` under ``--out``; `make quality-plans` runs it on configs/plan.yaml.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from edit_rt.runtime.config.load import load_config
from edit_rt.runtime.model import driving
from edit_rt.runtime.pipeline.assemble import pipeline_of
from edit_rt.runtime.pipeline.plans import PlanLoop, Variant

LEVELS = (0.0, 0.25, 0.5, 0.75, 1.0)


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def evaluate(loop: PlanLoop, scenes: int, tails: tuple, seed: int = 0, say=print) -> dict:
    """``tails``: tail steps for every variant, or None: the loop's own (its default and
    behaviour tails), reported as "default"."""
    rng = np.random.default_rng(seed)
    variants = [Variant(b, a) for b in driving.BEHAVIOURS for a in LEVELS]
    records = {t: [] for t in tails}
    expert = []
    start = time.perf_counter()
    for k in range(scenes):
        scene = driving.random_scene(rng)
        plans = [driving.expert(scene, v.behaviour, v.aggressiveness) for v in variants]
        expert.append([None if p.trajectory is None else driving.judge(scene, p.trajectory, v.behaviour)
                       for p, v in zip(plans, variants)])  # fmt: skip
        for t in tails:
            outcome = loop.run(scene, variants, tail_steps=t)
            records[t].append([p.scores for p in outcome.variants])
        if (k + 1) % 20 == 0:
            say(f"{k + 1}/{scenes} scenes ({time.perf_counter() - start:.0f} s)")
    out = {"scenes": scenes, "seed": seed, "levels": list(LEVELS), "steps": loop.steps, "guidance": loop.guidance,
           "seconds": round(time.perf_counter() - start, 1), "tails": {}}  # fmt: skip
    for t in tails:
        out["tails"]["default" if t is None else str(t)] = _summary(records[t], expert, variants)
    out["expert"] = _summary(expert, expert, variants)
    return out


def _summary(scores: list[list], expert: list[list], variants: list[Variant]) -> dict:
    per = {}
    for b in driving.BEHAVIOURS:
        idx = [i for i, v in enumerate(variants) if v.behaviour == b]
        cells = [(s[i], e[i]) for s, e in zip(scores, expert) for i in idx if e[i] is not None]
        if not cells:
            continue
        mine = [c[0] for c in cells]
        rising = []
        for s, e in zip(scores, expert):
            if all(e[i] is not None for i in idx):
                rising.append(spearman([variants[i].aggressiveness for i in idx], [s[i]["peak_accel"] for i in idx]) >= 0.9)
        per[b] = {
            "n": len(cells),
            "done": round(float(np.mean([m["behaviour_ok"] for m in mine])), 4),
            "collision_free": round(float(np.mean([not m["collision"] for m in mine])), 4),
            "success": round(float(np.mean([m["success"] for m in mine])), 4),
            "monotone": round(float(np.mean(rising)), 4) if rising else None,
            "monotone_n": len(rising),
            "median_peak_accel": round(float(np.median([m["peak_accel"] for m in mine])), 3),
            "median_peak_jerk": round(float(np.median([m["peak_jerk"] for m in mine])), 2),
        }
    return per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, default=Path("out/quality-plans"))
    parser.add_argument("--scenes", type=int, default=200)
    parser.add_argument("--tails", type=str, default="", help="comma-separated tail steps (default: a quarter, half, "
                        "three quarters and all of base.steps)")
    args = parser.parse_args()
    cfg = load_config(args.config)
    steps = cfg.base.steps
    tails = tuple(int(t) for t in args.tails.split(",")) if args.tails else tuple(sorted({max(1, steps // 4), steps // 2,
                                                                                         3 * steps // 4, steps}))
    tails = (None, *tails)  # the config's own tails first
    with pipeline_of(cfg) as pipe:
        loop = PlanLoop.of_config(pipe, cfg)
        report = evaluate(loop, args.scenes, tails)
    report.update(config=str(args.config), model=str(cfg.model), default_tail=loop.tail_steps,
                  behaviour_tails=loop.behaviour_tails)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality_plans.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({t: {b: (v["done"], v["collision_free"], v["monotone"]) for b, v in per.items()}
                      for t, per in report["tails"].items()}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
