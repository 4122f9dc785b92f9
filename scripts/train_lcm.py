"""Distil and measure the shapes model's LCM-LoRA (issue 51): `python scripts/train_lcm.py`.

Trains the LoRA by latent consistency distillation (export/world/lcm_distill.py) within a budget
(--minutes of steps in all), in pieces (--piece-minutes per run): a run stops at its piece's end,
writes its state to --checkpoint (export/checkpoints/shapes-lcm/state.pt, a few MB, committed),
and the next run resumes from it. After each run it saves the LoRA to --out
(export/models/shapes-sd/lcm-lora/: pytorch_lora_weights.safetensors, the layout `adapters:`
and diffusers' load_lora_weights take) and measures it with diffusers alone: on --bases world
bases, prompt following (the world's reader: colour, background, shape, position) of LCMScheduler
at 4, 2 and 1 steps, guidance 1, against the model's 30-step DDIM at guidance 4 (and, without the
LoRA, DDIM at 4 steps and LCMScheduler at 4: what the distillation adds), the same seeds and prompts; and edits as 1- and 2-step
tails of the 4-step chain (the prompt swapped for the last steps, the chain's own noise kept)
against the 30-step chain's default 12-step tail. Writes training.json (settings, seconds, loss
curve, every number), lcm-grid.png and README.md (the card) under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from edit_rt.export.eval.judges import judge_of  # noqa: E402
from edit_rt.export.world.lcm_distill import LcmSpec, train_lcm  # noqa: E402
from edit_rt.export.world.shapes import prompt  # noqa: E402

log = logging.getLogger("train_lcm")

# (label, scheduler, steps, guidance, LoRA on, edit tails measured: steps of the chain's end run on the edit prompt)
METHODS = (
    ("DDIM 30, guidance 4 (default)", "ddim", 30, 4.0, False, (12,)),
    ("DDIM 4, guidance 4 (no LoRA)", "ddim", 4, 4.0, False, ()),
    ("LCM 4, guidance 1", "lcm", 4, 1.0, True, (1, 2)),
    ("LCM 2, guidance 1", "lcm", 2, 1.0, True, (1,)),
    ("LCM 1, guidance 1", "lcm", 1, 1.0, True, ()),
    ("LCM 4, guidance 1, no LoRA (the teacher)", "lcm", 4, 1.0, False, ()),
)


def _images(pipe, embeds: torch.Tensor, seeds: list[int], steps: int, guidance: float, swap: tuple[int, torch.Tensor] | None = None) -> np.ndarray:
    """Generations ([n, H, W, 3] in [0, 1]) from prompt embeddings, one generator per seed (the
    initial latents and any per-step noise are the seed's), negative prompt "". ``swap`` = (k,
    edit embeddings): the last k steps run on the edit prompt, the chain before them unchanged."""
    negative = pipe.encode_prompt([""] * len(seeds), "cpu", 1, False)[0]

    def callback(p, i, t, kwargs):
        k, edit = swap
        if i == steps - k - 1:  # after this step the tail begins
            current = kwargs["prompt_embeds"]
            kwargs["prompt_embeds"] = torch.cat([current[: len(seeds)], edit]) if len(current) == 2 * len(seeds) else edit
        return kwargs

    out = pipe(prompt_embeds=embeds, negative_prompt_embeds=negative, num_inference_steps=steps, guidance_scale=guidance,
               height=pipe.unet.config.sample_size * pipe.vae_scale_factor, width=pipe.unet.config.sample_size * pipe.vae_scale_factor,
               generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="np",
               callback_on_step_end=callback if swap and swap[0] < steps else None, callback_on_step_end_tensor_inputs=["prompt_embeds"])  # fmt: skip
    return out.images


def consistency_gaps(pipe, embeds: torch.Tensor, seeds: list[int], guidance: float = 4.0, steps: int = 30) -> dict[str, float]:
    """What the distillation itself aims at, without a reader: the mean squared distance (scaled
    latents) from the teacher's deterministic ``steps``-step DDIM endpoint at ``guidance`` (the
    probability-flow ODE's solution from x_T) to the consistency function's 1-step answer
    f(x_T, 999), and to its 2-step one (f, re-noised to t = 499 with a fixed noise, f again),
    with the LoRA at scale 1 and at 0 (the teacher read as a consistency function)."""
    from diffusers import DDIMScheduler

    from edit_rt.export.world.lcm_distill import boundary_scalings

    ddim = DDIMScheduler.from_config(pipe.scheduler.config)
    ddim.set_timesteps(steps)
    a = ddim.alphas_cumprod
    c, size = pipe.unet.config.in_channels, pipe.unet.config.sample_size
    x_T = torch.cat([torch.randn((1, c, size, size), generator=torch.Generator().manual_seed(s)) for s in seeds])
    negative = pipe.encode_prompt([""] * len(seeds), "cpu", 1, False)[0]
    renoise = torch.randn(x_T.shape, generator=torch.Generator().manual_seed(1))

    def f(t: int, x_t: torch.Tensor) -> torch.Tensor:
        x0 = (x_t - (1 - a[t]).sqrt() * pipe.unet(x_t, t, embeds).sample) / a[t].sqrt()
        c_skip, c_out = boundary_scalings(torch.tensor([t]))
        return c_skip * x_t + c_out * x0

    out = {}
    with torch.no_grad():
        pipe.set_adapters(["lcm"], adapter_weights=[0.0])
        x = x_T
        for t in ddim.timesteps:
            eps_u, eps_c = pipe.unet(torch.cat([x, x]), t, torch.cat([negative, embeds])).sample.chunk(2)
            x = ddim.step(eps_u + guidance * (eps_c - eps_u), t, x).prev_sample
        for label, scale in (("teacher", 0.0), ("lora", 1.0)):
            pipe.set_adapters(["lcm"], adapter_weights=[scale])
            one = f(999, x_T)
            two = f(499, a[499].sqrt() * one + (1 - a[499]).sqrt() * renoise)
            out[f"{label}_1_step"] = float(((one - x) ** 2).mean())
            out[f"{label}_2_step"] = float(((two - x) ** 2).mean())
    out["endpoint_variance"] = float(x.var())
    return out


def evaluate_lcm(model_dir: Path, lora_dir: Path, n_bases: int = 50) -> tuple[dict, dict[str, np.ndarray]]:
    """Every METHODS row on the same ``n_bases`` world bases (scenes from rng 1, seeds 1000 + k,
    as `make quality`'s prompt following): prompt following per attribute, seconds per image, and
    per edit tail success / preservation / both over the judge's edits (colour, background,
    shape) of the bases the reader reads. Returns the numbers and each row's base images."""
    from diffusers import DDIMScheduler, LCMScheduler, StableDiffusionPipeline

    judge = judge_of(model_dir)
    rng = np.random.default_rng(1)
    scenes = [judge.scene(rng) for _ in range(n_bases)]
    seeds = [1000 + k for k in range(n_bases)]
    pipe = StableDiffusionPipeline.from_pretrained(str(model_dir), safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    ddim = DDIMScheduler.from_config(pipe.scheduler.config)
    lcm = LCMScheduler.from_config(pipe.scheduler.config)
    pipe.load_lora_weights(str(lora_dir), adapter_name="lcm")
    with torch.no_grad():
        embeds = pipe.encode_prompt([prompt(s) for s in scenes], "cpu", 1, False)[0]
    gaps = consistency_gaps(pipe, embeds, seeds)
    log.info("distance to the teacher's 30-step DDIM endpoint: %s", {k: round(v, 4) for k, v in gaps.items()})
    results, grids = {}, {}
    for label, kind, steps, guidance, lora, tails in METHODS:
        pipe.scheduler = lcm if kind == "lcm" else ddim
        pipe.set_adapters(["lcm"], adapter_weights=[1.0 if lora else 0.0])
        start = time.perf_counter()
        images = _images(pipe, embeds, seeds, steps, guidance)
        seconds = (time.perf_counter() - start) / n_bases
        follow = [judge.follow(im, s) for im, s in zip(images, scenes)]
        row = {"steps": steps, "guidance": guidance, "lora": lora, "seconds_per_image": seconds,
               "prompt_following": {f: float(np.mean([x[f] for x in follow])) for f in follow[0]}, "tails": {}}  # fmt: skip
        # edits of the bases the reader reads, one per kind, targets drawn per base (rng 2)
        edit_rng = np.random.default_rng(2)
        jobs = []  # (base k, kind, target, edit prompt)
        for k, (im, s) in enumerate(zip(images, scenes)):
            seen = judge.base_reading(im, s)
            if seen is None:
                continue
            for edit_kind, (target, text) in judge.edits(s, seen, edit_rng).items():
                jobs.append((k, edit_kind, seen, target, text))
        for tail in tails:
            if not jobs:
                break
            with torch.no_grad():
                edit_embeds = pipe.encode_prompt([j[4] for j in jobs], "cpu", 1, False)[0]
            edited = _images(pipe, embeds[[j[0] for j in jobs]], [seeds[j[0]] for j in jobs], steps, guidance, (tail, edit_embeds))
            scores = [judge.score(e, images[j[0]], j[2], j[3], j[1]) for e, j in zip(edited, jobs)]
            row["tails"][str(tail)] = {"edits": len(scores), "success": float(np.mean([s.success for s in scores])),
                                       "preserved": float(np.mean([s.preserved for s in scores])),
                                       "both": float(np.mean([s.success and s.preserved for s in scores])),
                                       "by_kind": {kd: float(np.mean([s.success and s.preserved for s, j in zip(scores, jobs) if j[1] == kd]))
                                                   for kd in sorted({j[1] for j in jobs})}}  # fmt: skip
        row["bases_read"] = len({j[0] for j in jobs}) / n_bases
        results[label] = row
        grids[label] = (np.clip(images, 0, 1) * 255).round().astype(np.uint8)
        log.info("%-32s %s  %.4f s/image  tails %s", label, {f: round(v, 2) for f, v in row["prompt_following"].items()}, seconds,
                 {t: round(v["both"], 2) for t, v in row["tails"].items()})  # fmt: skip
    return {"bases": n_bases, "methods": results, "consistency_gaps": gaps}, grids


def _grid(grids: dict[str, np.ndarray], path: Path, columns: int = 10) -> None:
    """One row per method, the first ``columns`` bases."""
    from PIL import Image

    rows = [np.concatenate(list(g[:columns]), axis=1) for g in grids.values()]
    sheet = np.concatenate(rows, axis=0)
    Image.fromarray(sheet).resize((sheet.shape[1] * 3, sheet.shape[0] * 3), Image.NEAREST).save(path)


def _card(training: dict) -> str:
    spec, ev = training["spec"], training["evaluation"]
    loss = training["loss"]
    head, tail = float(np.mean(loss[:50])), float(np.mean(loss[-50:]))
    done = "the whole budget" if training["finished"] else f"after piece {training['pieces']} (the budget is {training['minutes']:g} min; the next run resumes)"
    lines = [
        "# LCM-LoRA for shapes-sd",
        "",
        "A few-step LoRA for the embedded default model (issue 51), distilled from it by latent consistency",
        "distillation (Luo et al., *Latent Consistency Models* and *LCM-LoRA*, 2023; `export/world/lcm_distill.py`).",
        "Run it with diffusers' `LCMScheduler` at 1-4 steps and guidance 1:",
        "",
        "```python",
        "pipe = StableDiffusionPipeline.from_pretrained(\"export/models/shapes-sd\")",
        "pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)",
        "pipe.load_lora_weights(\"export/models/shapes-sd/lcm-lora\")",
        "pipe(prompt, num_inference_steps=4, guidance_scale=1.0)",
        "```",
        "",
        f"`pytorch_lora_weights.safetensors`: peft keys and config (rank {spec['rank']}, alpha {spec['alpha']:g}) on the UNet's",
        f"transformer-block Linears and 1x1 projections only ({len(training['adapted_modules'])} layers, {training['trainable_parameters']:,}",
        "parameters), what edit-rt's adapter slots carry (an export's `adapter_rank` >= 8).",
        "",
        "## Training",
        "",
        f"Trained by `{training['command']}` (`make train-lcm` resumes it); {done}.",
        "",
        f"- {training['platform']}; seed {spec['seed']}",
        f"- **{training['seconds'] / 60:.1f} min** of distillation steps ({training['steps']} steps of {spec['batch']}) in {training['pieces']} piece(s); "
        f"state in `export/checkpoints/shapes-lcm/state.pt`",
        f"- data: {spec['scenes']} shapes-world renders (jittered), encoded once by the model's VAE (posterior mean x scaling), with their prompts",
        f"- teacher: the model itself (the LoRA off), one DDIM step t_n -> t_n - {1000 // spec['ddim_timesteps']} on the {spec['ddim_timesteps']}-step grid, "
        f"classifier-free guidance at a scale drawn per sample from [{spec['guidance_min']:g}, {spec['guidance_max']:g}] (negative \"\")",
        "- student: the model + the LoRA; consistency function c_skip x_t + c_out x0(x_t) (sigma_data 0.5, timestep scaling 10,",
        "  as LCMScheduler); target: the student's own function at the teacher's step, no gradient, no EMA (the LoRA recipe)",
        f"- loss: {'pseudo-Huber, c = ' + format(spec['huber_c'], 'g') if spec['loss'] == 'huber' else 'L2'}; AdamW lr {spec['lr']:g}, constant",
        f"- loss (mean of 50 steps): first {head:.5f}, last {tail:.5f}. The target moves with the student, so the curve says",
        "  whether training is stable rather than how good the few-step images are; the table below says that.",
        "",
        "![loss](loss.png)",
        "",
        "## Measured (diffusers)",
        "",
        f"{ev['bases']} world bases (the scenes and seeds of `make quality`'s prompt following: rng 1, seeds 1000 + k), the",
        "same initial latents in every row; read by the shapes reader (pixel statistics, no learned judge). *Tails*: each",
        "readable base edited once per kind (colour, background, shape: the judge's edits), the prompt swapped for the",
        "chain's last k steps, the chain before it and its noise unchanged (a plain prompt swap, no edit-rt strength or",
        "preserve); *both*: the edit shows its target and every other attribute reads as in the base.",
        "",
        "| method | colour | background | shape | position | all four | s / image | tail | edits | success | preserved | both |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, row in ev["methods"].items():
        f = row["prompt_following"]
        first = f"| {label} | {f['colour']:.2f} | {f['background']:.2f} | {f['shape']:.2f} | {f['position']:.2f} | {f['all']:.2f} | {row['seconds_per_image']:.4f}"
        if not row["tails"]:
            lines.append(first + " | - | | | | |")
        for i, (k, t) in enumerate(row["tails"].items()):
            prefix = first if i == 0 else "| | | | | | | "
            lines.append(prefix + f" | last {k} | {t['edits']} | {t['success']:.2f} | {t['preserved']:.2f} | {t['both']:.2f} |")
    gaps = ev.get("consistency_gaps")
    if gaps:
        lines += ["", "What the distillation aims at, without a reader: the mean squared distance (scaled latents; the endpoints' own",
                  f"variance is {gaps['endpoint_variance']:.3f}) from the teacher's deterministic 30-step DDIM endpoint at guidance 4",
                  "(its ODE's solution from x_T, the same x_T) to the consistency function's answer at 1 step (f(x_T, 999)) and",
                  "at 2 steps (re-noised to t = 499 with a fixed noise, f again):", "",
                  "| | 1 step | 2 steps |", "| --- | --- | --- |",
                  f"| the teacher read as a consistency function (LoRA off) | {gaps['teacher_1_step']:.4f} | {gaps['teacher_2_step']:.4f} |",
                  f"| with the LCM-LoRA | {gaps['lora_1_step']:.4f} | {gaps['lora_2_step']:.4f} |"]  # fmt: skip
    lines += ["", f"Seconds per image: diffusers on this machine, batched {ev['bases']} at once (ratios within the run count, not the values).", "",
              "Bases of the first ten prompts, one row per method (in the table's order):", "", "![grid](lcm-grid.png)", "",
              "Edits through edit-rt (`make quality-lcm`: `make quality`'s bases and edit prompts, the LoRA as an adapter,",
              "1- and 2-step tails, against img2img with `LCMScheduler` and this LoRA): `quality.json` here, the table beside the",
              "30-step default's and what a few-step tail keeps and loses in docs/quality.md, \"The few-step model\".", ""]  # fmt: skip
    lines += training.get("verdict", [])
    return "\n".join(lines) + "\n"


def _plot_loss(loss: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(loss, lw=0.3, alpha=0.4)
    w = 50
    if len(loss) > w:
        ax.plot(np.arange(w - 1, len(loss)), np.convolve(loss, np.ones(w) / w, mode="valid"), lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("consistency loss")
    ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("export/models/shapes-sd"))
    parser.add_argument("--out", type=Path, default=Path("export/models/shapes-sd/lcm-lora"))
    parser.add_argument("--checkpoint", type=Path, default=Path("export/checkpoints/shapes-lcm"), help="resumable state; a cut run resumes here")
    parser.add_argument("--minutes", type=float, default=60.0, help="distillation steps' wall clock over all pieces")
    parser.add_argument("--piece-minutes", type=float, default=45.0, help="this run's steps' wall clock; it stops there and saves its state")
    parser.add_argument("--max-steps", type=int, default=0, help="stop at this step (0: the budget decides)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bases", type=int, default=50, help="world bases the LoRA is measured on")
    parser.add_argument("--skip-training", action="store_true", help="measure the LoRA already in --out and rewrite the card")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 on a machine shared with other jobs)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    spec = LcmSpec(seed=args.seed)
    training_path = args.out / "training.json"
    if args.skip_training:
        training = json.loads(training_path.read_text())
    else:
        report = train_lcm(args.model, spec, args.out, args.checkpoint, minutes=args.minutes, piece_minutes=args.piece_minutes,
                           max_steps=args.max_steps)  # fmt: skip
        training = {**report, "minutes": args.minutes, "piece_minutes": args.piece_minutes, "model": str(args.model),
                    "command": f"python scripts/train_lcm.py --minutes {args.minutes:g} --piece-minutes {args.piece_minutes:g} "
                               f"--seed {args.seed} --threads {args.threads}",
                    "platform": f"torch {torch.__version__} CPU, {args.threads} thread(s), {os.cpu_count()} cores, {platform.machine()}",
                    "verdict": json.loads(training_path.read_text()).get("verdict", []) if training_path.exists() else []}  # fmt: skip
    start = time.perf_counter()
    evaluation, grids = evaluate_lcm(args.model, args.out, args.bases)
    evaluation["seconds"] = round(time.perf_counter() - start, 1)
    training["evaluation"] = evaluation
    training_path.write_text(json.dumps(training))
    _plot_loss(training["loss"], args.out / "loss.png")
    _grid(grids, args.out / "lcm-grid.png")
    (args.out / "README.md").write_text(_card(training))
    log.info("measured in %.0f s; wrote %s", evaluation["seconds"], args.out)


if __name__ == "__main__":
    main()
