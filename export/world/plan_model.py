"""The planner's model (issue 55, part 2): a trajectory laid out as a Stable Diffusion latent, and
the untrained diffusers folder its training starts from.

A trajectory of the driving world (``driving.py``: ``[STEPS, 3]``, x, y and speed at 0.1 s steps)
is the latent itself, ``[4, 8, 8]``: the 64 steps row-major (step t at row ``t // 8``, column
``t % 8``), one channel per quantity, normalised to about unit spread, and a fourth channel held
at 0 (SD's UNet has four). A one-row latent (time along the width) does not pass the compile
stage (its prompt-to-prompt maps are read at factor 2: docs/plans.md measures both), the grid
passes it unchanged, so the export, the engines, the step loop, the store and the masked-edit
machinery serve plans as they serve pictures: row 0, the present and the next 0.7 s, is what a
mask keeps.

The folder is an SD 1.x one (``StableDiffusionPipeline``): a UNet on the 8 x 8 grid with
cross-attention at full resolution, a CLIP text encoder over the world's words (each one token,
``driving.VOCAB``), DDIM with SD's schedule, and a one-level ``AutoencoderKL`` (factor 1) that the
folder's format needs and the planner never runs: a plan is read from the final latents.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .driving import STEPS

GRID = 8  # the latent's side: GRID * GRID == STEPS
CHANNELS = 4
# (offset, scale) per quantity: x over the horizon (0 to ~160 m at the fastest), y across the
# road (-1.75 to 5.25 m), speed (0 to 25 m/s); latent = (value - offset) / scale
NORMALISE = ((70.0, 45.0), (1.75, 2.0), (12.0, 7.0))
assert GRID * GRID == STEPS


def to_latents(trajectory: np.ndarray) -> np.ndarray:
    """``[STEPS, 3]`` (x, y, speed) -> ``[CHANNELS, GRID, GRID]`` float32, the spare channel 0."""
    trajectory = np.asarray(trajectory, dtype=np.float64)
    if trajectory.shape != (STEPS, 3):
        raise ValueError(f"a trajectory is [{STEPS}, 3] (x, y, speed), not {list(trajectory.shape)}")
    out = np.zeros((CHANNELS, GRID, GRID), dtype=np.float32)
    for c, (offset, scale) in enumerate(NORMALISE):
        out[c] = ((trajectory[:, c] - offset) / scale).reshape(GRID, GRID)
    return out


def from_latents(latents: np.ndarray) -> np.ndarray:
    """``[CHANNELS, GRID, GRID]`` -> ``[STEPS, 3]`` (x, y, speed); the spare channel is ignored."""
    latents = np.asarray(latents)
    if latents.shape != (CHANNELS, GRID, GRID):
        raise ValueError(f"a plan's latents are [{CHANNELS}, {GRID}, {GRID}], not {list(latents.shape)}")
    return np.stack([latents[c].reshape(STEPS).astype(np.float64) * scale + offset
                     for c, (offset, scale) in enumerate(NORMALISE)], axis=1)  # fmt: skip


def write_planner_model(out: Path, seed: int = 0, block_out_channels: tuple[int, ...] = (32, 64),
                        text_hidden_size: int = 32, text_layers: int = 2) -> Path:  # fmt: skip
    """The untrained planner, seeded, as a diffusers folder under ``out``."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from .driving import VOCAB
    from .tiny_model import write_tokenizer

    out = Path(out)
    torch.manual_seed(seed)
    levels = len(block_out_channels)
    unet = UNet2DConditionModel(
        sample_size=GRID, in_channels=CHANNELS, out_channels=CHANNELS, block_out_channels=block_out_channels,
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D",) + ("DownBlock2D",) * (levels - 1),
        up_block_types=("UpBlock2D",) * (levels - 1) + ("CrossAttnUpBlock2D",), mid_block_type="UNetMidBlock2DCrossAttn",
        cross_attention_dim=text_hidden_size, attention_head_dim=8, norm_num_groups=8,
    )  # fmt: skip
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), latent_channels=CHANNELS,
                        norm_num_groups=8, sample_size=GRID)  # fmt: skip
    vocab_size = write_tokenizer(out / "tokenizer", VOCAB)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=text_hidden_size, intermediate_size=4 * text_hidden_size,
        num_hidden_layers=text_layers, num_attention_heads=4, max_position_embeddings=77,
        bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1,
    ))  # fmt: skip
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)  # fmt: skip
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=CLIPTokenizer.from_pretrained(out / "tokenizer"),
                                   unet=unet, scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)  # fmt: skip
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out
