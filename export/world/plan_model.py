"""The planner's model (issue 55, part 2): the untrained diffusers folder its training starts
from. Its latent is a plan laid out as a grid (runtime/model/plan_grid.py: the trajectory's 64 steps
as 8 x 8, the scene's numbers in two rows below).

The folder is an SD 1.x one (``StableDiffusionPipeline``): a UNet on the grid with
cross-attention at full resolution, a CLIP text encoder over the world's words (each one token,
``driving.VOCAB``), DDIM with SD's schedule, and a one-level ``AutoencoderKL`` (factor 1) that the
folder's format needs and the planner never runs: a plan is read from the final latents.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edit_rt.runtime.model.plan_grid import CHANNELS, HEIGHT, WIDTH

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

    from edit_rt.runtime.model.driving import VOCAB
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
