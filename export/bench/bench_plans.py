"""`make bench-plans` (issue 55): the plan-edit-evaluate loop's latency, side by side in one run.

For N = 1, 8, 32 variants (the behaviours x aggressiveness levels, cycled) on ``repeats`` seeded
scenes, each measured in the same process, interleaved scene by scene:

- ``stored``: the loop from a stored base plan (kept by an earlier call): N rows of ``tail_steps``,
  one batched tail, judged;
- ``fresh``: the same with the base plan generated first (a scene seen for the first time);
- ``from_noise``: every variant sampled from noise (rows of all ``steps`` from the base's own
  noise, the present and scene kept alike), judged: the diffusers-style baseline, batched too;
- ``expert``: the expert planner (runtime/model/driving.py) for the same variants, judged.

Reported: each one's p50 and p90 in milliseconds, the ratio stored / from_noise against the ideal
``tail_steps / steps``, and the speedup from_noise / stored. Writes ``bench_plans.json`` under
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from edit_rt.runtime.config.load import load_config
from edit_rt.runtime.model import driving
from edit_rt.runtime.pipeline.assemble import pipeline_of
from edit_rt.runtime.pipeline.plans import PlanLoop, Variant

SIZES = (1, 8, 32)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000.0


def bench(loop: PlanLoop, repeats: int, sizes=SIZES, seed: int = 1) -> dict:
    every = [Variant(b, a) for a in (0.0, 0.25, 0.5, 0.75, 1.0) for b in driving.BEHAVIOURS]
    rng = np.random.default_rng(seed)
    scenes = [driving.random_scene(rng) for _ in range(repeats)]
    warm = driving.random_scene(np.random.default_rng(seed + 1000))
    loop.run(warm, every[:8])  # sessions and buffers made before any timing
    times = {n: {"stored": [], "fresh": [], "from_noise": [], "expert": []} for n in sizes}
    for k, scene in enumerate(scenes):
        for n in sizes:
            variants = [every[i % len(every)] for i in range(n)]
            seed_k = 10_000 * n + k  # a base plan no earlier call kept
            times[n]["fresh"].append(_timed(lambda: loop.run(scene, variants, seed=seed_k)))
            times[n]["stored"].append(_timed(lambda: loop.run(scene, variants, seed=seed_k)))
            times[n]["from_noise"].append(_timed(lambda: loop.run(scene, variants, tail_steps=loop.steps, seed=seed_k)))
            times[n]["expert"].append(_timed(lambda: [driving.judge(scene, p.trajectory, v.behaviour) for v, p in
                                                      ((v, driving.expert(scene, v.behaviour, v.aggressiveness)) for v in variants)
                                                      if p.trajectory is not None]))  # fmt: skip
    out = {}
    for n in sizes:
        row = {name: {"p50_ms": round(float(np.median(t)), 2), "p90_ms": round(float(np.percentile(t, 90)), 2)}
               for name, t in times[n].items()}  # fmt: skip
        ratio = float(np.median(times[n]["stored"])) / float(np.median(times[n]["from_noise"]))
        row["stored_over_from_noise"] = round(ratio, 3)
        variants = [every[i % len(every)] for i in range(n)]
        ideal = sum(loop.tail_of(v) for v in variants) / (n * loop.steps)  # the tails' rows over sampling's
        row["ideal"] = round(ideal, 3)
        row["over_ideal"] = round(ratio / ideal, 3)
        row["speedup_vs_from_noise"] = round(1 / ratio, 2)
        out[str(n)] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, default=Path("out/bench-plans"))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cfg = load_config(args.config)
    steps = cfg.base.steps
    with pipeline_of(cfg) as pipe:
        loop = PlanLoop.of_config(pipe, cfg)
        start = time.perf_counter()
        report = {"sizes": bench(loop, args.repeats), "steps": steps, "tail_steps": loop.tail_steps, "behaviour_tails": loop.behaviour_tails,
                  "repeats": args.repeats, "backend": pipe.graph_set.backend, "threads": cfg.threads or "all",
                  "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                  "seconds": round(time.perf_counter() - start, 1), "config": str(args.config)}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_plans.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report["sizes"], indent=1))


if __name__ == "__main__":
    main()
