"""Train the shapes model (issue 7): `python scripts/train_shapes.py --out models/shapes-sd`.

Seeded and CPU-only; the defaults are sized for under an hour on 2 cores. Writes a diffusers
folder plus training.json (loss curve, seconds) and loss.png.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from edit_rt.export.train_shapes import TrainSpec, train_shapes  # noqa: E402


def main() -> None:
    defaults = TrainSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/shapes-sd"))
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--vae-steps", type=int, default=defaults.vae_steps)
    parser.add_argument("--unet-steps", type=int, default=defaults.unet_steps)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--max-minutes", type=float, default=defaults.max_minutes, help="stop the UNet stage after this (0 = never)")
    args = parser.parse_args()
    spec = TrainSpec(seed=args.seed, vae_steps=args.vae_steps, unet_steps=args.unet_steps, batch=args.batch,
                     max_minutes=args.max_minutes)  # fmt: skip
    train_shapes(args.out, spec)


if __name__ == "__main__":
    main()
