"""The planner's model (issue 55, part 2): a trajectory and its scene laid out as a Stable
Diffusion latent, and the untrained diffusers folder its training starts from.

The latent is ``[4, 10, 8]``. Rows 0-7 are the trajectory (``driving.py``: ``[STEPS, 3]``, x, y
and speed at 0.1 s steps): the 64 steps row-major (step t at row ``t // 8``, column ``t % 8``),
one channel per quantity, normalised to about unit spread, the fourth channel 0. Rows 8-9 are
the scene (``context``): its eight numbers (the ego's speed and offset, the lead's gap and speed,
whether it is stopped, the oncoming vehicle's presence, distance and speed), value k at column k
of both rows in every channel. What a planner knows exactly is then a set of positions: step 0
(the present, at row 0 column 0) and rows 8-9, which a mask keeps while the rest is generated or
edited (the masked-edit machinery, ``TailRow.pixel_mask``; a mask covers every channel of a
position, so the scene cannot share positions with the trajectory's later steps).

A one-row latent (time along the width) does not pass the compile stage (its prompt-to-prompt
maps are read at factor 2: docs/plans.md measures it); the grid passes it unchanged, so the
export, the engines, the step loop, the store and the masks serve plans as they serve pictures.

The folder is an SD 1.x one (``StableDiffusionPipeline``): a UNet on the grid with
cross-attention at full resolution, a CLIP text encoder over the world's words (each one token,
``driving.VOCAB``), DDIM with SD's schedule, and a one-level ``AutoencoderKL`` (factor 1) that the
folder's format needs and the planner never runs: a plan is read from the final latents.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .driving import STEPS, Scene

GRID = 8  # the trajectory's rows and the latent's width: GRID * GRID == STEPS
CONTEXT_ROWS = 2  # the scene's rows below it
HEIGHT, WIDTH = GRID + CONTEXT_ROWS, GRID  # the latent's sides (the "image" size: the autoencoder is factor 1)
CHANNELS = 4
# (offset, scale) per quantity: x over the horizon (0 to ~160 m at the fastest), y across the
# road (-1.75 to 5.25 m), speed (0 to 25 m/s); latent = (value - offset) / scale
NORMALISE = ((70.0, 45.0), (1.75, 2.0), (12.0, 7.0))
assert GRID * GRID == STEPS


def context(scene: Scene) -> np.ndarray:
    """The scene's eight numbers, normalised as the latent holds them: ego speed, ego offset, lead
    gap, lead speed, stopped lead (+1 / -1), oncoming vehicle (+1 / -1), its distance (0 without
    one), its speed."""
    distance = (scene.oncoming_distance - 220.0) / 180.0 if scene.oncoming else 0.0
    return np.array([(scene.ego_speed - 13.0) / 7.0, scene.ego_y / 0.5, (scene.lead_gap - 50.0) / 45.0,
                     (scene.lead_speed - 10.0) / 10.0, 1.0 if scene.obstacle else -1.0, 1.0 if scene.oncoming else -1.0,
                     distance, (scene.oncoming_speed - 10.0) / 10.0], dtype=np.float32)  # fmt: skip


def to_latents(trajectory: np.ndarray, scene: Scene) -> np.ndarray:
    """``[STEPS, 3]`` (x, y, speed) and its scene -> ``[CHANNELS, HEIGHT, WIDTH]`` float32."""
    trajectory = np.asarray(trajectory, dtype=np.float64)
    if trajectory.shape != (STEPS, 3):
        raise ValueError(f"a trajectory is [{STEPS}, 3] (x, y, speed), not {list(trajectory.shape)}")
    out = np.zeros((CHANNELS, HEIGHT, WIDTH), dtype=np.float32)
    for c, (offset, scale) in enumerate(NORMALISE):
        out[c, :GRID] = ((trajectory[:, c] - offset) / scale).reshape(GRID, GRID)
    out[:, GRID:] = context(scene)[None, None, :]
    return out


def from_latents(latents: np.ndarray) -> np.ndarray:
    """``[CHANNELS, HEIGHT, WIDTH]`` -> the trajectory ``[STEPS, 3]`` (x, y, speed)."""
    latents = np.asarray(latents)
    if latents.shape != (CHANNELS, HEIGHT, WIDTH):
        raise ValueError(f"a plan's latents are [{CHANNELS}, {HEIGHT}, {WIDTH}], not {list(latents.shape)}")
    return np.stack([latents[c, :GRID].reshape(STEPS).astype(np.float64) * scale + offset
                     for c, (offset, scale) in enumerate(NORMALISE)], axis=1)  # fmt: skip


def known(present: bool = True) -> np.ndarray:
    """``TailRow.pixel_mask`` of a plan, ``[HEIGHT, WIDTH]``: 1 where it may change, 0 where it is
    kept: the scene's rows and (``present``) step 0."""
    mask = np.ones((HEIGHT, WIDTH), dtype=np.float32)
    mask[GRID:] = 0.0
    if present:
        mask[0, 0] = 0.0
    return mask


@dataclass
class PlannerParts:
    """The planner's components, as a ``StableDiffusionPipeline`` holds them."""

    unet: Any
    vae: Any
    text_encoder: Any
    tokenizer: Any
    scheduler: Any


def planner_parts(tokenizer_dir: Path, seed: int = 0, block_out_channels: tuple[int, ...] = (32, 64),
                  text_hidden_size: int = 32, text_layers: int = 2) -> PlannerParts:  # fmt: skip
    """The untrained planner, seeded; its tokenizer (the world's words) written to ``tokenizer_dir``."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from .driving import VOCAB
    from .tiny_model import write_tokenizer

    torch.manual_seed(seed)
    levels = len(block_out_channels)
    unet = UNet2DConditionModel(
        sample_size=(HEIGHT, WIDTH), in_channels=CHANNELS, out_channels=CHANNELS, block_out_channels=block_out_channels,
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D",) + ("DownBlock2D",) * (levels - 1),
        up_block_types=("UpBlock2D",) * (levels - 1) + ("CrossAttnUpBlock2D",), mid_block_type="UNetMidBlock2DCrossAttn",
        cross_attention_dim=text_hidden_size, attention_head_dim=8, norm_num_groups=8,
    )  # fmt: skip
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), latent_channels=CHANNELS,
                        norm_num_groups=8, sample_size=(HEIGHT, WIDTH))  # fmt: skip
    vocab_size = write_tokenizer(Path(tokenizer_dir), VOCAB)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=text_hidden_size, intermediate_size=4 * text_hidden_size,
        num_hidden_layers=text_layers, num_attention_heads=4, max_position_embeddings=77,
        bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1,
    ))  # fmt: skip
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)  # fmt: skip
    return PlannerParts(unet, vae, text_encoder, CLIPTokenizer.from_pretrained(str(tokenizer_dir)), scheduler)


def save_planner(out: Path, parts: PlannerParts) -> Path:
    """``parts`` as a diffusers folder (``StableDiffusionPipeline``) under ``out``."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(vae=parts.vae, text_encoder=parts.text_encoder.eval(), tokenizer=parts.tokenizer,
                                   unet=parts.unet.eval(), scheduler=parts.scheduler, safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)  # fmt: skip
    pipe.save_pretrained(str(out), safe_serialization=True)
    return Path(out)


def write_planner_model(out: Path, seed: int = 0, **sizes) -> Path:
    """The untrained planner, seeded, as a diffusers folder under ``out``."""
    return save_planner(out, planner_parts(Path(out) / "tokenizer", seed, **sizes))
