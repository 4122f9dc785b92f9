"""Train the shapes model (issue 7; world 2, issue 26): `python scripts/train.py --out models/shapes-sd`.

Seeded and CPU-only; the defaults are sized for under an hour on 2 cores. Writes a diffusers
folder plus training.json (loss curve, seconds) and loss.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from edit_rt.export.world.train import TrainSpec, train_shapes  # noqa: E402


def main() -> None:
    world = 2 if "--world" in sys.argv and sys.argv[sys.argv.index("--world") + 1] == "2" else 1
    preset = sys.argv[sys.argv.index("--preset") + 1] if "--preset" in sys.argv else "plain"
    defaults = TrainSpec.world64() if world == 2 else TrainSpec.looks32() if preset == "looks" else TrainSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, choices=(1, 2), default=1, help="1: the 32x32 one-object world; 2: 64x64, one or two objects (issue 26)")
    parser.add_argument("--preset", choices=("plain", "looks"), default="plain",
                        help="looks: issue 36's world-1 model, its scenes' looks drawn at random (TrainSpec.looks32)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="save the run's state here and resume from it")
    parser.add_argument("--snapshot", action="store_true", help="with --checkpoint: write the model as of the last checkpoint, train nothing")
    parser.add_argument("--out", type=Path, default=Path("models/shapes-sd"))
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--vae-steps", type=int, default=defaults.vae_steps)
    parser.add_argument("--unet-steps", type=int, default=defaults.unet_steps)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--vae-lr", type=float, default=defaults.vae_lr)
    parser.add_argument("--max-minutes", type=float, default=defaults.max_minutes, help="stop the UNet stage after this (0 = never)")
    parser.add_argument("--looks", type=float, default=defaults.looks,
                        help="issue 36: each look (saturation, stroke, blur) of a training scene drawn at random with this probability")
    parser.add_argument("--vae-edge-weight", type=float, default=defaults.vae_edge_weight, help="the autoencoder's edge term (0 = MSE only)")
    parser.add_argument("--piece-minutes", type=float, default=0.0,
                        help="with --checkpoint: end this run after this long, its state saved; run again to resume")
    args = parser.parse_args()
    spec = dataclasses.replace(defaults, seed=args.seed, vae_steps=args.vae_steps, unet_steps=args.unet_steps, batch=args.batch,
                               max_minutes=args.max_minutes, looks=args.looks, vae_lr=args.vae_lr, vae_edge_weight=args.vae_edge_weight)  # fmt: skip
    if args.piece_minutes and args.checkpoint is None:
        parser.error("--piece-minutes needs --checkpoint (the folder the next piece resumes from)")
    train_shapes(args.out, spec, checkpoint=args.checkpoint, stop_at=0 if args.snapshot else None, piece_minutes=args.piece_minutes)


if __name__ == "__main__":
    main()
