"""Train issue 56's text models on the standard library's source:
`python scripts/train_text.py --kind mdm --out export/models/text-mdm --checkpoint export/checkpoints/text-mdm --piece-minutes 60`.

Seeded and CPU-only (export/world/train_text.py); in pieces with --checkpoint, each piece's state
saved to resume from. Both kinds share one tokenizer (trained once, kept in --tokenizer-dir).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from edit_rt.export.world.train_text import KINDS, TextTrainSpec, train_text


def main() -> None:
    defaults = TextTrainSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, required=True, help="mdm: masked diffusion; ar: the autoregressive baseline")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("export/checkpoints/text-tokenizer"),
                        help="the corpus tokenizer both kinds share (trained here the first time)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="save the run's state here and resume from it")
    parser.add_argument("--piece-minutes", type=float, default=0.0,
                        help="with --checkpoint: end this run after this long, its state saved; run again to resume")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--max-minutes", type=float, default=defaults.max_minutes, help="stop after this (0 = never)")
    parser.add_argument("--rope", action="store_true", help="rotary positions besides the learned ones (the diffusion model's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (two kinds side by side: one each)")
    args = parser.parse_args()
    if args.piece_minutes and args.checkpoint is None:
        parser.error("--piece-minutes needs --checkpoint (the folder the next piece resumes from)")
    import torch

    torch.set_num_threads(args.threads)
    spec = dataclasses.replace(defaults, kind=args.kind, seed=args.seed, steps=args.steps, max_minutes=args.max_minutes,
                               rope=args.rope)
    train_text(args.out, spec, checkpoint=args.checkpoint, piece_minutes=args.piece_minutes, tokenizer_dir=args.tokenizer_dir)


if __name__ == "__main__":
    main()
