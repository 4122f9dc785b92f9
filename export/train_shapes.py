"""Train the "shapes" model: a small SD-architecture model that follows prompts of the shapes world.

Two stages, seeded, on the CPU: (1) an AutoencoderKL (factor 2, 4 latent channels) learns to
reconstruct 32x32 scenes; (2) a CLIP text encoder and a UNet learn epsilon-prediction on its
latents (1000 scaled-linear steps, 10% empty prompts for classifier-free guidance), with an EMA
of the UNet's weights saved. The result is a diffusers folder like any SD 1.x one, plus
``training.json`` (steps, seconds, loss curve) and ``loss.png``. Run it with
``scripts/train_shapes.py``.

Two choices make prompt following appear within a CPU hour (measured, issue 7): the plain
epsilon loss weighs a high-noise step, where colour and layout are decided, by its SNR (~0.005
at t=999), so the text path learns slowly; each sample's loss is weighted by ``1 + 1/SNR(t)``,
which is the v-prediction loss (Salimans & Ho 2022, eq. 10) of the same epsilon model. And the
latents of a fixed rendered dataset are encoded once, so a step is only the UNet.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .shapes import COLOURS, POSITIONS, SHAPES, prompt, random_scene, render
from .tiny_model import write_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSpec:
    seed: int = 0
    vae_steps: int = 600
    unet_steps: int = 6000
    batch: int = 32
    vae_lr: float = 1e-3
    unet_lr: float = 1e-3
    ema_decay: float = 0.999
    dataset_size: int = 24_000  # rendered scenes (with jitter) whose latents are encoded once
    uncond_probability: float = 0.1  # prompts dropped to "" so classifier-free guidance works
    # Stop the UNet stage once this much wall time has passed (0 = run every step); the steps
    # actually run are recorded, and --unet-steps with that count reruns the same training.
    max_minutes: float = 0.0
    image_size: int = 32
    # ~1.0 M UNet parameters at 16x16 latents, cross-attention at 8x8 and in the mid block:
    # ~0.47 s per step of 32 on 2 cores.
    block_out_channels: tuple[int, ...] = (32, 64)
    vae_block_out_channels: tuple[int, ...] = (16, 32)
    text_hidden_size: int = 64
    text_layers: int = 2


def world_words() -> tuple[str, ...]:
    words = {"a", "on", "background"}
    for name in (*COLOURS, *SHAPES, *POSITIONS):
        words.update(name.split())
    return tuple(sorted(words))


def _batch(rng: np.random.Generator, n: int, size: int) -> tuple[torch.Tensor, list[str]]:
    scenes = [random_scene(rng) for _ in range(n)]
    images = np.stack([render(s, size, rng) for s in scenes]).astype(np.float32) / 127.5 - 1.0
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), [prompt(s) for s in scenes]


def _encoded_dataset(vae, tokenizer, rng: np.random.Generator, spec: TrainSpec, scaling: float):
    """Latents (posterior means, scaled) and token ids of ``spec.dataset_size`` rendered scenes."""
    latents, ids = [], []
    with torch.no_grad():
        for start in range(0, spec.dataset_size, 500):
            x, prompts = _batch(rng, min(500, spec.dataset_size - start), spec.image_size)
            latents.append(vae.encode(x).latent_dist.mean * scaling)
            ids.append(tokenizer(prompts, padding="max_length", max_length=77, return_tensors="pt").input_ids)
    return torch.cat(latents), torch.cat(ids)


def train_shapes(out: Path, spec: TrainSpec = TrainSpec(), say: Callable[[str], None] = print) -> dict:
    from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    out = Path(out)
    torch.manual_seed(spec.seed)
    rng = np.random.default_rng(spec.seed)
    start = time.perf_counter()
    vocab_size = write_tokenizer(out / "tokenizer", world_words())
    tokenizer = CLIPTokenizer.from_pretrained(str(out / "tokenizer"))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=spec.vae_block_out_channels, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        sample_size=spec.image_size,
    )  # fmt: skip
    history: dict[str, list[float]] = {"vae": [], "unet": []}

    # 1. the autoencoder: reconstruction + a small KL term (Rombach et al. 2022, sec. 3)
    opt = torch.optim.AdamW(vae.parameters(), lr=spec.vae_lr)
    for step in range(spec.vae_steps):
        x, _ = _batch(rng, spec.batch, spec.image_size)
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample()).sample
        loss = F.mse_loss(recon, x) + 1e-6 * posterior.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        history["vae"].append(loss.item())
        if step % 100 == 0:
            say(f"vae step {step}/{spec.vae_steps}: loss {loss.item():.4f}")
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        x, _ = _batch(rng, 256, spec.image_size)
        scaling = float(1.0 / vae.encode(x).latent_dist.mean.std())
    vae.register_to_config(scaling_factor=scaling)

    # 2. text encoder + UNet: epsilon prediction on scaled latents (Ho et al. 2020, eq. 14)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=spec.text_hidden_size, intermediate_size=4 * spec.text_hidden_size,
        num_hidden_layers=spec.text_layers, num_attention_heads=4, max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))  # fmt: skip
    levels = len(spec.block_out_channels)
    unet = UNet2DConditionModel(
        sample_size=spec.image_size // 2, in_channels=4, out_channels=4, block_out_channels=spec.block_out_channels,
        layers_per_block=1, down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (levels - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (levels - 1) + ("UpBlock2D",), cross_attention_dim=spec.text_hidden_size,
        attention_head_dim=8, norm_num_groups=8,
    )  # fmt: skip
    ema = [p.detach().clone() for p in unet.parameters()]
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    alphas_cumprod = noise_scheduler.alphas_cumprod
    latents, ids_all = _encoded_dataset(vae, tokenizer, rng, spec, scaling)
    empty_ids = tokenizer([""], padding="max_length", max_length=77, return_tensors="pt").input_ids[0]
    say(f"encoded {len(latents)} scenes in {time.perf_counter() - start:.0f} s")
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=spec.unet_lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, spec.unet_steps))
    generator = torch.Generator().manual_seed(spec.seed)
    for step in range(spec.unet_steps):
        if spec.max_minutes and time.perf_counter() - start > 60 * spec.max_minutes:
            say(f"time budget of {spec.max_minutes} min spent after {step} UNet steps")
            break
        idx = torch.randint(0, len(latents), (spec.batch,), generator=generator)
        ids = ids_all[idx].clone()
        ids[torch.rand(spec.batch, generator=generator) < spec.uncond_probability] = empty_ids
        x0 = latents[idx]
        noise = torch.randn(x0.shape, generator=generator)
        t = torch.randint(0, 1000, (spec.batch,), generator=generator)
        pred = unet(noise_scheduler.add_noise(x0, noise, t), t, text_encoder(ids)[0]).sample
        per_sample = ((pred - noise) ** 2).mean(dim=(1, 2, 3))
        weight = 1.0 / alphas_cumprod[t]  # 1 + 1/SNR(t): the v-prediction loss of an epsilon model
        loss = (weight * per_sample).sum() / weight.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in unet.parameters()], 1.0 - spec.ema_decay)
        history["unet"].append(loss.item())
        if step % 100 == 0:
            say(f"unet step {step}/{spec.unet_steps}: loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)")
    with torch.no_grad():
        for p, e in zip(unet.parameters(), ema):
            p.copy_(e)

    seconds = time.perf_counter() - start
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)  # fmt: skip
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder.eval(), tokenizer=tokenizer, unet=unet.eval(),
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)  # fmt: skip
    pipe.save_pretrained(str(out), safe_serialization=True)
    report = {"spec": asdict(spec), "seconds": round(seconds, 1), "vae_scaling_factor": scaling,
              "unet_steps_run": len(history["unet"]),
              "unet_parameters": sum(p.numel() for p in unet.parameters()),
              "final_loss": {k: float(np.mean(v[-50:])) if v else None for k, v in history.items()},
              "loss": history}  # fmt: skip
    (out / "training.json").write_text(json.dumps(report))
    _plot_loss(history, out / "loss.png")
    say(f"trained in {seconds / 60:.1f} min; wrote {out}")
    return report


def _plot_loss(history: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    for ax, (name, values) in zip(axes, history.items()):
        if values:
            k = max(1, len(values) // 100)
            smooth = np.convolve(values, np.ones(k) / k, mode="valid")
            ax.plot(smooth)
        ax.set(title=f"{name} loss", xlabel="step", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
