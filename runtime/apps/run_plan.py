"""`edit-rt run CONFIG` for a plan config (``plan:``, config/plan.py): the scene's base plan, every
behaviour x aggressiveness as one batched tail of it, each judged (pipeline/plans.py).

Writes to ``output_dir``: ``plans.png`` (the road, the base and every variant labelled, the best
marked) and ``plans.json`` (every plan's trajectory and scores, the choice, seconds per stage, UNet
rows against sampling every variant from noise)."""

from __future__ import annotations

import json
from typing import Any

from ..config.run_config import RunConfig
from ..pipeline.assemble import pipeline_of
from ..pipeline.plans import PlanLoop, Variant
from .run import Timer, output_errors, writable_or_refuse


def run_plan(cfg: RunConfig) -> dict[str, Any]:
    """Plan ``cfg``'s scene; return the report (also written to plans.json)."""
    plan, base = cfg.plan, cfg.base
    writable_or_refuse(cfg.output_dir, "output_dir")
    variants = [Variant(b, a) for b in plan.behaviours for a in plan.aggressiveness]
    timer = Timer()
    with timer.stage("load"):
        pipe = pipeline_of(cfg)
        pipe.activate()
    try:
        loop = PlanLoop.of_config(pipe, cfg)
        outcome = loop.run(plan.the_scene(), variants, Variant(plan.base_behaviour, plan.base_aggressiveness))
    finally:
        pipe.deactivate()
    report = outcome.as_dict()
    n = len(variants)
    report["unet_rows"].update(total=sum(outcome.rows.values()), sampling_every_variant=base.steps * (n + 1))
    report.update(config=str(cfg.source) if cfg.source else None, model=str(cfg.model), backend=pipe.graph_set.backend,
                  steps=base.steps, guidance=base.guidance, seed=base.seed, tail_steps=loop.tail_steps,
                  behaviour_tails=loop.behaviour_tails,
                  files=["plans.png", "plans.json"])  # fmt: skip
    report["seconds"] = {**timer.stages, **report["seconds"]}
    with output_errors(cfg.output_dir):
        outcome.picture().save(cfg.output_dir / "plans.png")
        (cfg.output_dir / "plans.json").write_text(json.dumps(report, indent=2))
    return report
