"""Train the planner (issue 55, part 2): the driving world's expert plans as latents
(plan_model.py), a UNet and a CLIP text encoder learning epsilon-prediction on them, seeded, on the
CPU, in resumable pieces.

The data: ``dataset_size`` scenes (``driving.random_scene`` from the seed), each with every
behaviour at an aggressiveness drawn from {0, 0.25, 0.5, 0.75, 1}; the expert's plan where it has
one (an infeasible behaviour is no example: the judge says so at run time), as
``to_latents(trajectory, scene)`` with ``driving.prompt(scene, behaviour, aggressiveness)``. The
latents are the data itself (no autoencoder), so a step is only the UNet and the text encoder.

The loss is the shapes model's (train.py): epsilon on SD's scaled-linear schedule, each sample
weighted by ``1 + 1/SNR(t)`` (the v-prediction loss of an epsilon model), 10% empty prompts for
classifier-free guidance, an EMA of the weights saved. A run with ``checkpoint`` saves its state
every ``checkpoint_every`` steps and at a piece's end; run again, it resumes (the dataset drawn
again from the seed: it is not saved) and ends with the weights of one uncut run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from edit_rt.runtime.model import driving
from edit_rt.runtime.model.plan_grid import to_latents

from .pieces import Pieces
from .plan_model import planner_parts, save_planner
from .train import DenoiserState, denoising_step

AGGRESSIVENESS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class PlannerSpec:
    seed: int = 0
    # measured: 0.41 s a step of 64 on one thread beside another training (33,422 plans from 8000
    # scenes); the 60 minutes on 2 cores are expected to hold ~12,000 (not yet measured)
    steps: int = 12_000
    batch: int = 64
    lr: float = 1e-3
    ema_decay: float = 0.999
    dataset_size: int = 8_000  # scenes; x 5 behaviours, the feasible plans kept (~85%)
    uncond_probability: float = 0.1
    block_out_channels: tuple[int, ...] = (32, 64)
    text_hidden_size: int = 32
    text_layers: int = 2
    checkpoint_every: int = 1000
    max_minutes: float = 60.0  # the budget, both cores; 0 = every step


def planner_dataset(spec: PlannerSpec) -> tuple[torch.Tensor, list[str]]:
    """The expert's feasible plans as latents ``[n, 4, 10, 8]`` and their prompts, from the seed."""
    rng = np.random.default_rng([spec.seed, 55])
    latents, prompts = [], []
    for _ in range(spec.dataset_size):
        scene = driving.random_scene(rng)
        for behaviour in driving.BEHAVIOURS:
            aggressiveness = float(AGGRESSIVENESS[rng.integers(len(AGGRESSIVENESS))])
            plan = driving.expert(scene, behaviour, aggressiveness)
            if plan.trajectory is not None:
                latents.append(to_latents(plan.trajectory, scene))
                prompts.append(driving.prompt(scene, behaviour, aggressiveness))
    return torch.from_numpy(np.stack(latents)), prompts


def train_planner(out: Path, spec: PlannerSpec = PlannerSpec(), say: Callable[[str], None] = print,
                  checkpoint: Optional[Path] = None, piece_minutes: float = 0.0) -> dict:  # fmt: skip
    """Train (or resume from ``checkpoint``) and write the planner to ``out`` with its
    ``training.json``; a piece that ends on ``piece_minutes`` saves its state and writes the model
    as of then (``report["finished"]`` False)."""
    from diffusers import DDPMScheduler

    out = Path(out)
    pieces = Pieces.open(checkpoint, asdict(spec), piece_minutes, spec.max_minutes, spec.checkpoint_every, say)
    parts = planner_parts(out / "tokenizer", spec.seed, spec.block_out_channels, spec.text_hidden_size, spec.text_layers)
    unet, text_encoder, tokenizer = parts.unet, parts.text_encoder, parts.tokenizer
    latents, prompts = planner_dataset(spec)
    ids_all = tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    empty_ids = tokenizer([""], padding="max_length", max_length=77, return_tensors="pt").input_ids[0]
    say(f"{len(latents)} plans from {spec.dataset_size} scenes")
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    params = list(unet.parameters()) + list(text_encoder.parameters())
    ema = [p.detach().clone() for p in params]  # the text encoder's too: both are trained here
    opt = torch.optim.AdamW(params, lr=spec.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, spec.steps))
    state = DenoiserState(unet, text_encoder, opt, sched, torch.Generator().manual_seed(spec.seed), ema)
    first, history = 0, []
    state_file = pieces.state_file
    if state_file is not None and state_file.exists():
        first, history, spent = state.load(state_file)
        pieces.resumed(spent)  # the clock counts the earlier pieces
        say(f"resumed at step {first} ({spent:.0f} s spent before)")

    def save_state(step: int) -> None:
        state.save(state_file, step, history, pieces.seconds())

    unet.train()
    text_encoder.train()
    for step in range(first, spec.steps):
        if pieces.stop_before(step, first, save_state):
            break
        history.append(denoising_step(state, params, latents, ids_all, empty_ids, spec.batch, spec.uncond_probability,
                                      noise_scheduler, spec.ema_decay, params))  # fmt: skip
        if step % 100 == 0:
            say(f"step {step}/{spec.steps}: loss {history[-1]:.4f} ({pieces.seconds():.0f} s)")
    pieces.end(len(history), first, save_state)
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    save_planner(out, parts)
    seconds = pieces.seconds()
    report = {"spec": asdict(spec), "seconds": round(seconds, 1), "finished": pieces.finished, "ended": pieces.ended,
              "steps_run": len(history),
              "plans": len(latents), "unet_parameters": sum(p.numel() for p in unet.parameters()),
              "final_loss": float(np.mean(history[-50:])) if history else None, "loss": history}  # fmt: skip
    (out / "training.json").write_text(json.dumps(report))
    say(f"trained {len(history)} steps in {seconds / 60:.1f} min; wrote {out}")
    return report
