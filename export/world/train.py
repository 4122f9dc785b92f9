"""Train the "shapes" model: a small SD-architecture model that follows prompts of the shapes world.

Two stages, seeded, on the CPU: (1) an AutoencoderKL (factor 2, 4 latent channels) learns to
reconstruct 32x32 scenes; (2) a CLIP text encoder and a UNet learn epsilon-prediction on its
latents (1000 scaled-linear steps, 10% empty prompts for classifier-free guidance), with an EMA
of the UNet's weights saved. The result is a diffusers folder like any SD 1.x one, plus
``training.json`` (steps, seconds, loss curve) and ``loss.png``. Run it with
``scripts/train.py``.

``TrainSpec.world64()`` is world 2's model (issue 26): 64x64 scenes of one or two objects, a
factor-4 autoencoder (three levels: 16x16x4 latents), a UNet with cross-attention at 16x16 and
8x8 and a 4x4 mid block, a 3-layer text encoder. A run with ``checkpoint`` set saves its state
there every ``checkpoint_every`` steps of either stage (and the encoded dataset once); run again
with the same folder, it resumes where it stopped, the wall-time budget counting the time already
spent. ``piece_minutes`` ends a run (a piece) in either stage, its state saved.

Two choices make prompt following appear within a CPU hour (measured, issue 7): the plain
epsilon loss weighs a high-noise step, where colour and layout are decided, by its SNR (~0.005
at t=999), so the text path learns slowly; each sample's loss is weighted by ``1 + 1/SNR(t)``,
which is the v-prediction loss (Salimans & Ho 2022, eq. 10) of the same epsilon model. And the
latents of a fixed rendered dataset are encoded once, so a step is only the UNet.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .looks import read_any_look
from .shapes import (COLOURS, POSITIONS, RELATIONS, SHAPES, SIZES, canonical, prompt, random_looks, random_scene, read,
                     render)  # fmt: skip
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
    world: int = 1  # export/world/shapes.py's world the scenes come from
    vae_down_levels: int = 2  # autoencoder levels: factor 2 ** (levels - 1)
    # UNet levels with cross-attention, from the top (world 1: only the second of two)
    cross_attention_levels: tuple[bool, ...] = (False, True)
    two_objects: float = 0.5  # world 2: the fraction of scenes with two objects
    checkpoint_every: int = 500
    # Issue 36: the probability that each look (shapes.LOOK_RANGES: saturation, stroke, blur) of a
    # training scene is drawn off its default, uniform over its range (0 = plain renders, as the
    # committed shapes-sd and shapes64-sd were trained). The prompt never names a look.
    looks: float = 0.0
    # the autoencoder's loss: MSE + this weight x the L1 of the difference of the image gradients
    # (an edge term: an outline or a blur is a small share of the pixels but all of the edges)
    vae_edge_weight: float = 0.0
    look_scenes: int = 40  # scenes the look round trip is measured on (export/world/look_round_trip.py)

    @classmethod
    def world64(cls, **overrides) -> "TrainSpec":
        """World 2's model: 64x64, VAE factor 4, cross-attention at 16x16 and 8x8, mid block at 4x4
        (3.2 M UNet parameters; ~0.4 s per step of 32 on 2 cores)."""
        spec = dict(world=2, image_size=64, vae_steps=3000, unet_steps=10_000, dataset_size=30_000,
                    block_out_channels=(32, 64, 128), vae_block_out_channels=(16, 32, 64), vae_down_levels=3,
                    cross_attention_levels=(True, True, False), text_layers=3)  # fmt: skip
        return cls(**{**spec, **overrides})

    @classmethod
    def looks32(cls, **overrides) -> "TrainSpec":
        """Issue 36's world-1 model: every look of a training scene off its default half the time,
        an autoencoder trained longer, faster and with an edge term so that it keeps them, a UNet
        trained longer on the richer scenes; ``max_minutes`` bounds the two stages together."""
        spec = dict(looks=0.5, vae_steps=4000, vae_lr=3e-3, vae_edge_weight=1.0, unet_steps=8000, max_minutes=120.0)
        return cls(**{**spec, **overrides})


def world_words(world: int = 1) -> tuple[str, ...]:
    words = {"a", "on", "background"}
    for name in (*COLOURS, *SHAPES, *POSITIONS, *((*SIZES, *RELATIONS) if world == 2 else ())):
        words.update(name.split())
    return tuple(sorted(words))


def _scenes(rng: np.random.Generator, n: int, spec: TrainSpec) -> tuple[list, np.ndarray]:
    """``n`` scenes of ``spec``'s world and their jittered renders (uint8 [n, H, W, 3]), each
    with its looks drawn at random when ``spec.looks``."""
    scenes = [random_scene(rng, spec.world, spec.two_objects) for _ in range(n)]
    return scenes, np.stack([render(s, spec.image_size, rng, **(random_looks(rng, spec.looks) if spec.looks else {})) for s in scenes])


def _edge_loss(recon: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The L1 distance of the horizontal and vertical image gradients."""
    dx = lambda t: t[..., :, 1:] - t[..., :, :-1]  # noqa: E731
    dy = lambda t: t[..., 1:, :] - t[..., :-1, :]  # noqa: E731
    return F.l1_loss(dx(recon), dx(x)) + F.l1_loss(dy(recon), dy(x))


def images_to_x(images: np.ndarray) -> torch.Tensor:
    """uint8 [n, H, W, 3] -> the VAE's input, [n, 3, H, W] in [-1, 1]."""
    return torch.from_numpy(images.astype(np.float32) / 127.5 - 1.0).permute(0, 3, 1, 2).contiguous()


def _batch(rng: np.random.Generator, n: int, spec: TrainSpec) -> tuple[torch.Tensor, list[str]]:
    scenes, images = _scenes(rng, n, spec)
    return images_to_x(images), [prompt(s) for s in scenes]


def _encoded_dataset(vae, tokenizer, rng: np.random.Generator, spec: TrainSpec, scaling: float):
    """Latents (posterior means, scaled) and token ids of ``spec.dataset_size`` rendered scenes."""
    latents, ids = [], []
    with torch.no_grad():
        for start in range(0, spec.dataset_size, 500):
            x, prompts = _batch(rng, min(500, spec.dataset_size - start), spec)
            latents.append(vae.encode(x).latent_dist.mean * scaling)
            ids.append(tokenizer(prompts, padding="max_length", max_length=77, return_tensors="pt").input_ids)
    return torch.cat(latents), torch.cat(ids)


def _round_trip(vae, spec: TrainSpec, n: int = 200) -> dict[str, float]:
    """The autoencoder on ``n`` fresh renders (their own seed): PSNR of the decoded round trip
    (8-bit) and how often the world's reader still reads the scene from it, the ceiling of
    every prompt-following number read from this model's images. A looks model's renders are
    read by ``read_any_look`` (the palette reader ``read`` misses a greyed colour), and
    ``reader_on_renders`` says how often it reads the renders themselves."""
    from .look_round_trip import round_trip

    scenes, images = _scenes(np.random.default_rng(10_000 + spec.seed), n, spec)
    out = round_trip(vae, images)
    mse = ((out.astype(np.float64) - images) ** 2).mean(axis=(1, 2, 3))
    reader = partial(read_any_look, world=spec.world) if spec.looks else partial(read, world=spec.world)
    report = {"psnr_db": float(np.mean(10 * np.log10(255.0**2 / np.maximum(mse, 1e-10)))),
              "reader": float(np.mean([reader(o) == canonical(s) for o, s in zip(out, scenes)])), "n": n}  # fmt: skip
    if spec.looks:
        report["reader_on_renders"] = float(np.mean([reader(im) == canonical(s) for im, s in zip(images, scenes)]))
    return report


def _same_spec(saved: dict, spec: TrainSpec) -> bool:
    """Whether a checkpoint's spec is ``spec``: a field added since it was written counts as
    its default (a run committed by an earlier version resumes under a later one)."""
    current = json.loads(json.dumps(asdict(spec)))
    defaults = json.loads(json.dumps(asdict(TrainSpec())))
    return set(saved) <= set(current) and all(saved.get(k, defaults[k]) == v for k, v in current.items())


def _save(obj, path: Path) -> None:
    """``torch.save`` through a temporary file in the same folder: a cut run leaves the last
    whole checkpoint, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    os.close(fd)
    torch.save(obj, tmp)
    os.replace(tmp, path)


@dataclass
class DenoiserState:
    """A text-conditioned UNet's training state (the shapes model's UNet stage, the planner's):
    the modules, the optimiser and its schedule, the batch generator and the EMA weights. Saved
    and loaded whole, so that a run resumed from a checkpoint draws and steps as an uncut one."""

    unet: torch.nn.Module
    text_encoder: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator
    ema: list

    def save(self, path: Path, step: int, history: list[float], seconds: float) -> None:
        _save({"unet": self.unet.state_dict(), "text_encoder": self.text_encoder.state_dict(), "opt": self.opt.state_dict(),
               "sched": self.sched.state_dict(), "generator": self.generator.get_state(), "ema": self.ema, "step": step,
               "history": history, "seconds": seconds}, path)  # fmt: skip

    def load(self, path: Path) -> tuple[int, list[float], float]:
        """The saved state into these objects; returns (step, loss history, seconds spent)."""
        saved = torch.load(path, weights_only=False)
        self.unet.load_state_dict(saved["unet"])
        self.text_encoder.load_state_dict(saved["text_encoder"])
        self.opt.load_state_dict(saved["opt"])
        self.sched.load_state_dict(saved["sched"])
        self.generator.set_state(saved["generator"])
        with torch.no_grad():
            for e, v in zip(self.ema, saved["ema"]):
                e.copy_(v)
        return saved["step"], saved["history"], saved["seconds"]


def denoising_step(state: DenoiserState, params: list, latents: torch.Tensor, ids_all: torch.Tensor, empty_ids: torch.Tensor,
                   batch: int, uncond_probability: float, noise_scheduler, ema_decay: float, ema_params: list) -> float:  # fmt: skip
    """One optimisation step of epsilon-prediction (Ho et al. 2020, eq. 14) on a batch drawn
    with ``state.generator``: ``uncond_probability`` of the prompts dropped to "" (classifier-free
    guidance), each sample's loss weighted by 1 + 1/SNR(t) (the v-prediction loss of an epsilon
    model), gradients clipped to 1, the EMA of ``ema_params`` updated. Returns the loss."""
    g = state.generator
    idx = torch.randint(0, len(latents), (batch,), generator=g)
    ids = ids_all[idx].clone()
    ids[torch.rand(batch, generator=g) < uncond_probability] = empty_ids
    x0 = latents[idx]
    noise = torch.randn(x0.shape, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    pred = state.unet(noise_scheduler.add_noise(x0, noise, t), t, state.text_encoder(ids)[0]).sample
    per_sample = ((pred - noise) ** 2).mean(dim=tuple(range(1, pred.dim())))
    weight = 1.0 / noise_scheduler.alphas_cumprod[t]
    loss = (weight * per_sample).sum() / weight.sum()
    state.opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    state.opt.step()
    state.sched.step()
    with torch.no_grad():
        torch._foreach_lerp_(state.ema, [p.detach() for p in ema_params], 1.0 - ema_decay)
    return loss.item()


def _unet_blocks(levels: tuple[bool, ...]) -> dict[str, tuple[str, ...]]:
    down = tuple("CrossAttnDownBlock2D" if x else "DownBlock2D" for x in levels)
    up = tuple("CrossAttnUpBlock2D" if x else "UpBlock2D" for x in reversed(levels))
    return {"down_block_types": down, "up_block_types": up}


def train_shapes(
    out: Path, spec: TrainSpec = TrainSpec(), say: Callable[[str], None] = print, checkpoint: Optional[Path] = None,
    stop_at: Optional[int] = None, piece_minutes: float = 0.0,
) -> dict:
    """Train (or resume from ``checkpoint``) and write the model to ``out``. ``stop_at`` ends the
    UNet stage at that step without saving a checkpoint there: with a checkpoint of a run still
    going, ``stop_at=0`` writes that run's model as of its last checkpoint (its EMA weights).
    ``piece_minutes`` (with ``checkpoint``) ends this run once it has taken that long, in
    whichever stage it is, saving the state there: the next run resumes from it (a training in
    pieces, each committed; ``report["finished"]`` says whether the UNet stage is done, and a run
    that ended in the autoencoder stage writes no model, ``report["stage"]`` "autoencoder")."""
    from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    out = Path(out)
    torch.manual_seed(spec.seed)
    rng = np.random.default_rng(spec.seed)
    start = run_start = time.perf_counter()  # run_start: this run's own clock (its piece)
    spent = 0.0  # seconds of earlier runs this one resumes
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        checkpoint.mkdir(parents=True, exist_ok=True)
        marker = checkpoint / "spec.json"
        if marker.exists() and not _same_spec(json.loads(marker.read_text()), spec):
            raise ValueError(f"{checkpoint} holds a run of another spec ({marker}); give another --checkpoint folder or delete it")
        marker.write_text(json.dumps(asdict(spec)))
    vocab_size = write_tokenizer(out / "tokenizer", world_words(spec.world))
    tokenizer = CLIPTokenizer.from_pretrained(str(out / "tokenizer"))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=spec.vae_block_out_channels, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * spec.vae_down_levels, up_block_types=("UpDecoderBlock2D",) * spec.vae_down_levels,
        sample_size=spec.image_size,
    )  # fmt: skip
    history: dict[str, list[float]] = {"vae": [], "unet": []}
    looks_curve: list[dict] = []  # the look round trip every 1000 autoencoder steps (a looks model)
    vae_file = checkpoint / "vae.pt" if checkpoint else None

    if vae_file is not None and vae_file.exists():
        saved = torch.load(vae_file, weights_only=False)
        vae.load_state_dict(saved["vae"])
        history["vae"], scaling, spent = saved["history"], saved["scaling"], saved["seconds"]
        looks_curve = saved.get("looks_curve", [])
        vae.eval().requires_grad_(False)
        say(f"resumed the autoencoder from {vae_file}")
    else:
        # 1. the autoencoder: reconstruction + a small KL term (Rombach et al. 2022, sec. 3)
        opt = torch.optim.AdamW(vae.parameters(), lr=spec.vae_lr)
        cosine = spec.world == 2 or spec.looks
        vae_sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, spec.vae_steps)) if cosine else None
        # a long autoencoder stage is cut into pieces too: its state every checkpoint_every steps
        # and at a piece's end (the scenes' and the sampling's generators with it, so a resumed
        # run draws what an uncut one would)
        partial_file = checkpoint / "vae_partial.pt" if checkpoint else None
        vae_first = 0
        if partial_file is not None and partial_file.exists():
            saved = torch.load(partial_file, weights_only=False)
            vae.load_state_dict(saved["vae"])
            opt.load_state_dict(saved["opt"])
            if vae_sched is not None:
                vae_sched.load_state_dict(saved["sched"])
            torch.set_rng_state(saved["torch_rng"])
            rng.bit_generator.state = saved["rng"]
            vae_first, history["vae"], looks_curve = saved["step"], saved["history"], saved["looks_curve"]
            start -= saved["seconds"]  # the stage's clock counts its earlier pieces
            say(f"resumed the autoencoder at step {vae_first} ({saved['seconds']:.0f} s spent before)")

        def save_vae_state(step: int) -> None:
            _save({"vae": vae.state_dict(), "opt": opt.state_dict(), "sched": vae_sched.state_dict() if vae_sched else None,
                   "torch_rng": torch.get_rng_state(), "rng": rng.bit_generator.state, "step": step,
                   "history": history["vae"], "looks_curve": looks_curve, "seconds": time.perf_counter() - start},
                  partial_file)  # fmt: skip

        for step in range(vae_first, spec.vae_steps):
            if partial_file is not None and step > vae_first:
                if piece_minutes and time.perf_counter() - run_start > 60 * piece_minutes:
                    save_vae_state(step)
                    say(f"this piece's {piece_minutes} min spent at autoencoder step {step}: saved {partial_file}; "
                        "run again to resume")  # fmt: skip
                    return {"spec": asdict(spec), "finished": False, "stage": "autoencoder", "vae_steps_run": step,
                            "unet_steps_run": 0}  # fmt: skip
                if step % spec.checkpoint_every == 0:
                    save_vae_state(step)
            x, _ = _batch(rng, spec.batch, spec)
            posterior = vae.encode(x).latent_dist
            recon = vae.decode(posterior.sample()).sample
            loss = F.mse_loss(recon, x) + 1e-6 * posterior.kl().mean()
            if spec.vae_edge_weight:
                loss = loss + spec.vae_edge_weight * _edge_loss(recon, x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if vae_sched is not None:
                vae_sched.step()
            history["vae"].append(loss.item())
            if step % 100 == 0:
                say(f"vae step {step}/{spec.vae_steps}: loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)")
            if spec.looks and step and step % 1000 == 0:
                looks_curve.append({"step": step, **_looks_verdict(vae, spec)})
                say(f"  look round trip at vae step {step} (share in order, worst level off): {looks_curve[-1]}")
        vae.eval().requires_grad_(False)
        with torch.no_grad():
            x, _ = _batch(rng, 256, spec)
            scaling = float(1.0 / vae.encode(x).latent_dist.mean.std())
        if vae_file is not None:
            _save({"vae": vae.state_dict(), "history": history["vae"], "scaling": scaling, "looks_curve": looks_curve,
                   "seconds": time.perf_counter() - start}, vae_file)  # fmt: skip
            if partial_file.exists():
                partial_file.unlink()  # the finished stage's file holds it now
    vae.register_to_config(scaling_factor=scaling)
    round_trip = _round_trip(vae, spec)
    say(f"autoencoder round trip: {round_trip}")
    looks_kept = _look_round_trip(vae, spec, out, checkpoint, say) if spec.looks else None

    # 2. text encoder + UNet: epsilon prediction on scaled latents (Ho et al. 2020, eq. 14)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=spec.text_hidden_size, intermediate_size=4 * spec.text_hidden_size,
        num_hidden_layers=spec.text_layers, num_attention_heads=4, max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))  # fmt: skip
    latent_size = spec.image_size // 2 ** (spec.vae_down_levels - 1)
    unet = UNet2DConditionModel(
        sample_size=latent_size, in_channels=4, out_channels=4, block_out_channels=spec.block_out_channels,
        layers_per_block=1, cross_attention_dim=spec.text_hidden_size, attention_head_dim=8, norm_num_groups=8,
        **_unet_blocks(spec.cross_attention_levels),
    )  # fmt: skip
    ema = [p.detach().clone() for p in unet.parameters()]
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    data_file = checkpoint / "data.pt" if checkpoint else None
    if data_file is not None and data_file.exists():
        latents, ids_all = torch.load(data_file, weights_only=False)
    else:
        # a looks model draws its dataset from a stream of its own, so that a run resumed from a
        # committed checkpoint (which leaves out the 98 MB dataset) renders the same one again;
        # the plain models keep the stream their committed weights were trained with
        data_rng = np.random.default_rng([spec.seed, 1]) if spec.looks else rng
        latents, ids_all = _encoded_dataset(vae, tokenizer, data_rng, spec, scaling)
        if data_file is not None:
            _save((latents, ids_all), data_file)
    empty_ids = tokenizer([""], padding="max_length", max_length=77, return_tensors="pt").input_ids[0]
    say(f"encoded {len(latents)} scenes in {spent + time.perf_counter() - start:.0f} s")
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=spec.unet_lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, spec.unet_steps))
    state = DenoiserState(unet, text_encoder, opt, sched, torch.Generator().manual_seed(spec.seed), ema)
    first = 0
    state_file = checkpoint / "state.pt" if checkpoint else None
    if state_file is not None and state_file.exists():
        first, history["unet"], spent = state.load(state_file)
        say(f"resumed the UNet stage at step {first} ({spent:.0f} s spent before)")
    # the clock from here on counts the whole training: this run's stages so far and, resumed,
    # the earlier runs' seconds (``spent``: the autoencoder's, or everything up to the checkpoint)
    start = time.perf_counter() - spent if first else start - spent
    last = spec.unet_steps if stop_at is None else max(first, min(stop_at, spec.unet_steps))
    finished = True

    def save_state(step: int) -> None:
        state.save(state_file, step, history["unet"], time.perf_counter() - start)

    for step in range(first, last):
        if spec.max_minutes and time.perf_counter() - start > 60 * spec.max_minutes:
            say(f"time budget of {spec.max_minutes} min spent after {step} UNet steps")
            break
        if state_file is not None and piece_minutes and time.perf_counter() - run_start > 60 * piece_minutes:
            save_state(step)
            finished = False
            say(f"this piece's {piece_minutes} min spent at UNet step {step}: saved {state_file}; run again to resume")
            break
        if state_file is not None and step > first and step % spec.checkpoint_every == 0:
            save_state(step)
        loss = denoising_step(state, params, latents, ids_all, empty_ids, spec.batch, spec.uncond_probability,
                              noise_scheduler, spec.ema_decay, list(unet.parameters()))  # fmt: skip
        history["unet"].append(loss)
        if step % 100 == 0:
            say(f"unet step {step}/{spec.unet_steps}: loss {loss:.4f} ({time.perf_counter() - start:.0f} s)")
    if state_file is not None and finished and stop_at is None and len(history["unet"]) > first:
        save_state(len(history["unet"]))  # the end too: the checkpoint then holds the finished run
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
    report = {"spec": asdict(spec), "seconds": round(seconds, 1), "vae_scaling_factor": scaling, "vae_round_trip": round_trip,
              **({"look_round_trip": looks_kept, "look_round_trip_curve": looks_curve} if looks_kept is not None else {}),
              "finished": finished,
              "unet_steps_run": len(history["unet"]),
              "unet_parameters": sum(p.numel() for p in unet.parameters()),
              "final_loss": {k: float(np.mean(v[-50:])) if v else None for k, v in history.items()},
              "loss": history}  # fmt: skip
    (out / "training.json").write_text(json.dumps(report))
    # which world's prompts and reader the model goes with (export/world/shapes.py world_of)
    looks = {"looks": spec.looks} if spec.looks else {}  # a looks model is read through its looks (judges.judge_of)
    (out / "world.json").write_text(json.dumps({"world": spec.world, "image_size": spec.image_size, **looks}) + "\n")
    _plot_loss(history, out / "loss.png")
    say(f"trained in {seconds / 60:.1f} min; wrote {out}")
    return report


def _looks_verdict(vae, spec: TrainSpec) -> dict:
    """Per look (share of scenes in order, worst level's error over the range), mid-training."""
    from .look_round_trip import look_round_trip

    vae.eval()
    report = look_round_trip(vae, spec.world, spec.image_size, n=max(1, spec.look_scenes // 2))
    vae.train()
    return {look: [round(v["order_kept"], 3), round(max(v["off_of_range"]), 3)] for look, v in report["looks"].items()}


def _look_round_trip(vae, spec: TrainSpec, out: Path, checkpoint: Optional[Path], say: Callable[[str], None]) -> dict:
    """The autoencoder's look round trip (export/world/look_round_trip.py), written to ``out`` (and to
    ``checkpoint``, which is committed between pieces) before any UNet step: the table as
    ``look_round_trip.json``, the picture as ``look_round_trip.png``."""
    from .look_round_trip import look_round_trip, plot_look_round_trip, written

    report = look_round_trip(vae, spec.world, spec.image_size, n=spec.look_scenes)
    out.mkdir(parents=True, exist_ok=True)
    plot_look_round_trip(report, out / "look_round_trip.png")
    kept = written(report)
    for folder in (out, checkpoint):
        if folder is not None:
            (Path(folder) / "look_round_trip.json").write_text(json.dumps(kept, indent=1) + "\n")
    verdicts = {look: (v["order_kept"], max(v["off_of_range"])) for look, v in kept["looks"].items()}
    keeps = "keeps" if kept["passes"] else "does NOT keep"
    say(f"the autoencoder {keeps} the looks (share of scenes in order, worst level's error over the range): {verdicts}")
    return kept


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
