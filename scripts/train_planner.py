"""Train the driving world's planner (issue 55, part 2):
`python scripts/train_planner.py --out export/models/planner --checkpoint export/checkpoints/planner --piece-minutes 85`.

Seeded and CPU-only (export/world/train_planner.py); in pieces with --checkpoint, each piece's
state saved to resume from. Writes a diffusers folder plus training.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from edit_rt.export.world.train_planner import PlannerSpec, train_planner  # noqa: E402


def main() -> None:
    defaults = PlannerSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("export/models/planner"))
    parser.add_argument("--checkpoint", type=Path, default=None, help="save the run's state here and resume from it")
    parser.add_argument("--piece-minutes", type=float, default=0.0,
                        help="with --checkpoint: end this run after this long, its state saved; run again to resume")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--dataset-size", type=int, default=defaults.dataset_size, help="scenes (x 5 behaviours)")
    parser.add_argument("--max-minutes", type=float, default=defaults.max_minutes, help="stop after this (0 = never)")
    args = parser.parse_args()
    if args.piece_minutes and args.checkpoint is None:
        parser.error("--piece-minutes needs --checkpoint (the folder the next piece resumes from)")
    spec = dataclasses.replace(defaults, seed=args.seed, steps=args.steps, batch=args.batch, dataset_size=args.dataset_size,
                               max_minutes=args.max_minutes)  # fmt: skip
    train_planner(args.out, spec, checkpoint=args.checkpoint, piece_minutes=args.piece_minutes)


if __name__ == "__main__":
    main()
