"""Short autoencoder-only runs, read by the look round trip (issue 54, item 1: blur's crisp end).

`python scripts/ae_probe.py --steps 800 --blocks 16,32 --loss mse --edge-weight 1 --out /tmp/ae.json`

The looks model's stage 1 (export/world/train.py: scenes of world 1 rendered fresh each step,
each look drawn off its default with probability ``--looks``, AdamW with cosine decay over the
run, MSE or L1 + 1e-6 KL + the edge term) with one thing changed at a time, so candidates for
the next default's autoencoder can be compared before a 180-minute training commits to one:

- ``--blocks``: the autoencoder's channels per level (16,32 today; 32,32 is wider at full
  resolution only, where the crisp edge is drawn, and stays a plain ``AutoencoderKL`` config);
- ``--loss``: the pixel term, ``mse`` (today) or ``l1`` (which does not forgive the small,
  edge-sized errors that MSE squares away);
- ``--edge-weight``: the weight of the L1 of the image gradients (today 1);
- ``--decode-mean``: train on the posterior mean instead of a sample (the round trip decodes
  the mean; a sampled latent teaches the decoder to hedge, i.e. to blur);
- ``--latent-channels``: the latent's channels (4 today; more is more room per 2x2 pixels, at
  the cost of the UNet's first and last convolutions only).

Every ``--check-every`` steps and at the end the look round trip
(export/world/look_round_trip.py, ``--scenes`` scenes, seed 20,000) is read; the JSON written
to ``--out`` holds the seconds per step (the round trips excluded), the loss curve, and per check
and look the share of scenes in order, each level's error over the look's range and the worst.
The training code's defaults are not touched: this is a measuring tool, not a trainer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edit_rt.export.world.look_round_trip import look_round_trip, written
from edit_rt.export.world.train import TrainSpec, _batch, _edge_loss, _round_trip


def ae_probe(blocks: tuple[int, ...], loss: str, edge_weight: float, steps: int, lr: float, seed: int, looks: float,
             decode_mean: bool, check_every: int, scenes: int, max_minutes: float, latent_channels: int = 4,
             say=print) -> dict:  # fmt: skip
    """One short run of the autoencoder alone; the module docstring's report, as a dict."""
    from diffusers import AutoencoderKL

    if loss not in ("mse", "l1"):
        raise ValueError(f"--loss must be mse or l1, got {loss!r}")
    spec = TrainSpec.looks32(vae_steps=steps, vae_lr=lr, vae_edge_weight=edge_weight, looks=looks, seed=seed,
                             vae_block_out_channels=tuple(blocks))  # fmt: skip
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=spec.vae_block_out_channels,
                        norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        sample_size=spec.image_size)  # fmt: skip
    opt = torch.optim.AdamW(vae.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))
    pixel = F.mse_loss if loss == "mse" else F.l1_loss
    history, checks, train_seconds = [], [], 0.0

    def check(step: int) -> None:
        vae.eval()
        report = written(look_round_trip(vae, spec.world, spec.image_size, n=scenes))
        vae.train()
        looks_ = {look: {"order_kept": v["order_kept"], "off_of_range": v["off_of_range"], "worst": max(v["off_of_range"]),
                         "render": v["render"], "round_trip": v["round_trip"]} for look, v in report["looks"].items()}  # fmt: skip
        checks.append({"step": step, "seconds_training": round(train_seconds, 1), "looks": looks_})
        blur = looks_["blur"]["off_of_range"]
        say(f"step {step}: blur off/range at 0 and 0.375: {blur[0]:.3f} {blur[1]:.3f}; worst: "
            + ", ".join(f"{k} {v['worst']:.3f} (order {v['order_kept']:.2f})" for k, v in looks_.items()))

    vae.train()
    step = 0
    for step in range(steps):
        if max_minutes and train_seconds > 60 * max_minutes:
            say(f"stopped at step {step}: {max_minutes} min of training spent")
            break
        t0 = time.perf_counter()
        x, _ = _batch(rng, spec.batch, spec)
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.mean if decode_mean else posterior.sample()).sample
        total = pixel(recon, x) + 1e-6 * posterior.kl().mean()
        if edge_weight:
            total = total + edge_weight * _edge_loss(recon, x)
        opt.zero_grad()
        total.backward()
        opt.step()
        sched.step()
        train_seconds += time.perf_counter() - t0
        history.append(total.item())
        if step % 100 == 0:
            say(f"step {step}/{steps}: loss {total.item():.4f} ({train_seconds / (step + 1):.3f} s per step)")
        if check_every and step and step % check_every == 0:
            check(step)
    else:
        step = steps
    check(step)
    vae.eval()
    return {"blocks": list(blocks), "latent_channels": latent_channels, "loss": loss, "edge_weight": edge_weight,
            "decode_mean": decode_mean, "lr": lr, "seed": seed, "looks": looks, "steps_planned": steps, "steps_run": step, "batch": spec.batch,
            "threads": torch.get_num_threads(), "parameters": sum(p.numel() for p in vae.parameters()),
            "seconds_training": round(train_seconds, 1), "seconds_per_step": round(train_seconds / max(1, step), 4),
            "round_trip_200": _round_trip(vae, spec), "checks": checks, "loss_curve": history}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="16,32", help="channels per autoencoder level, comma-separated")
    parser.add_argument("--loss", choices=("mse", "l1"), default="mse")
    parser.add_argument("--edge-weight", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=800, help="steps of 32 scenes; the cosine decay spans them")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--looks", type=float, default=0.5)
    parser.add_argument("--decode-mean", action="store_true")
    parser.add_argument("--latent-channels", type=int, default=4)
    parser.add_argument("--check-every", type=int, default=0, help="also read the round trip every this many steps (0: at the end only)")
    parser.add_argument("--scenes", type=int, default=40)
    parser.add_argument("--max-minutes", type=float, default=0.0, help="stop training after this long (0: never)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = ae_probe(tuple(int(b) for b in args.blocks.split(",")), args.loss, args.edge_weight, args.steps, args.lr, args.seed,
                      args.looks, args.decode_mean, args.check_every, args.scenes, args.max_minutes, args.latent_channels)  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
