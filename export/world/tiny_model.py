"""The embedded default model: a small Stable-Diffusion-1.x-architecture model, built from a seed.

``edit-rt model --out DIR`` writes a complete diffusers directory (``unet/ text_encoder/
tokenizer/ vae/ scheduler/ model_index.json``) that ``StableDiffusionPipeline.from_pretrained``
loads offline, so everything downstream runs the same code as for a real SD 1.5 folder. The
weights are random (seeded), so images are noise-like; the point is the architecture: a UNet
with cross-attention at two resolutions and in the mid block, a CLIP text encoder and a CLIP
byte-level tokenizer built locally (no download). The ``bench`` preset also holds a random tiny
autoencoder in ``vae_tiny/`` (:func:`write_tiny_vae`: TAESD's architecture at the VAE's factor),
so that the tiny decoder's graphs are exported and measured like a real one's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from edit_rt.runtime.errors import ConfigError

from ..compile.family_configs import bytes_to_unicode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the generated model; ``tiny`` keeps the test suite within minutes on 2 cores."""

    # UNet channels per resolution (SD 1.x: 320, 640, 1280, 1280).
    block_out_channels: tuple[int, ...] = (32, 64)
    # Which resolutions have (self- and cross-) attention, highest first; None = all of them.
    # SD 1.x has it at 3 of 4 levels, not the lowest; the bench model skips the highest,
    # whose 1024-token self-attention would dominate a CPU benchmark.
    attention_levels: tuple[bool, ...] | None = None
    layers_per_block: int = 1
    attention_head_dim: int | tuple[int, ...] = 8
    cross_attention_dim: int = 32
    # Latent size the UNet is built for; the VAE's two blocks make the image 2x the latent.
    sample_size: int = 16
    text_hidden_size: int = 32
    text_layers: int = 2
    text_heads: int = 4
    vae_block_out_channels: tuple[int, ...] = (32, 64)
    norm_num_groups: int = 8
    # SD 2.x: linear projections in the transformers, fp32 attention scores, a v-prediction
    # scheduler, GELU in the text encoder (OpenCLIP)
    use_linear_projection: bool = False
    upcast_attention: bool = False
    prediction_type: str = "epsilon"
    text_hidden_act: str = "quick_gelu"
    # A random tiny autoencoder in vae_tiny/ of this width (TAESD's: 64); 0: none. No TAESD
    # weights exist offline; its cost, not its pictures, is what a random one shows.
    tiny_vae_channels: int = 0


PRESETS = {
    "tiny": TinyModelSpec(),
    # `make bench`: a UNet of ~13 M parameters at 32x32 latents, so the UNet dominates CPU time.
    "bench": TinyModelSpec(
        block_out_channels=(64, 128, 256),
        attention_levels=(False, True, True),
        attention_head_dim=8,
        cross_attention_dim=128,
        sample_size=32,
        text_hidden_size=128,
        text_layers=4,
        text_heads=4,
        norm_num_groups=32,
        tiny_vae_channels=64,
    ),
    # SD 2.x's architecture switches at tiny sizes (tests: upcast_attention, v-prediction)
    "tiny-sd2": TinyModelSpec(
        attention_head_dim=(4, 8),
        use_linear_projection=True,
        upcast_attention=True,
        prediction_type="v_prediction",
        text_hidden_act="gelu",
        text_layers=3,
    ),
}


def _byte_vocab() -> dict[str, int]:
    """The CLIP byte-level vocabulary without merges: 256 byte symbols, the same with </w>."""
    symbols = bytes_to_unicode()
    vocab = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab)}


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """CLIP's BPE on one word: repeatedly join the adjacent pair of lowest merge rank."""
    while len(symbols) > 1:
        pairs = [(ranks.get(p, 1 << 30), i) for i, p in enumerate(zip(symbols, symbols[1:]))]
        rank, i = min(pairs)
        if rank == 1 << 30:
            break
        symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2 :]
    return symbols


def _word_merges(words: list[str]) -> list[tuple[str, str]]:
    """BPE merges that make each of ``words`` (lowercase ASCII) one token.

    CLIP's BPE spells "red" as r, e, d</w>. Each word gets the merges that join, left to
    right, the pieces the merges before it already make of it: later merges rank lower, so
    they never split an earlier word differently.
    """
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in words:
        pieces = _bpe(list(word[:-1]) + [word[-1] + "</w>"], ranks)
        left = pieces[0]
        for right in pieces[1:]:
            ranks.setdefault((left, right), len(merges))
            if len(merges) < len(ranks):
                merges.append((left, right))
            left += right
    return merges


def write_tokenizer(out: Path, words: tuple[str, ...] = (), pad_token: str = "<|endoftext|>") -> int:
    """Write a CLIP tokenizer to ``out`` (vocab.json, merges.txt, tokenizer.json); return vocab size.

    Without ``words`` every word is spelled byte by byte; each of ``words`` becomes one token.
    ``pad_token``: SD's and SDXL's first tokenizer pad with the end token, SDXL's second with "!".
    """
    from transformers import CLIPTokenizer

    out.mkdir(parents=True, exist_ok=True)
    vocab = _byte_vocab()
    merges = _word_merges(sorted(set(words)))
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77, pad_token=pad_token)
    tok.save_pretrained(str(out))
    return len(vocab)


def write_tiny_model(out: Path, seed: int = 0, preset: str = "tiny") -> Path:
    """Build the seeded model and save it in diffusers format under ``out``."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    if preset not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {preset!r}; choose one of {sorted(PRESETS) + ['tiny-sdxl']}")
    spec = PRESETS[preset]
    out = Path(out)
    torch.manual_seed(seed)
    attention = spec.attention_levels or (True,) * len(spec.block_out_channels)
    down = tuple("CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attention)
    up = tuple("CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attention))

    unet = UNet2DConditionModel(
        sample_size=spec.sample_size,
        in_channels=4,
        out_channels=4,
        block_out_channels=spec.block_out_channels,
        layers_per_block=spec.layers_per_block,
        down_block_types=down,
        up_block_types=up,
        mid_block_type="UNetMidBlock2DCrossAttn",
        cross_attention_dim=spec.cross_attention_dim,
        attention_head_dim=spec.attention_head_dim,
        norm_num_groups=spec.norm_num_groups,
        use_linear_projection=spec.use_linear_projection,
        upcast_attention=spec.upcast_attention,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(spec.vae_block_out_channels),
        up_block_types=("UpDecoderBlock2D",) * len(spec.vae_block_out_channels),
        block_out_channels=spec.vae_block_out_channels,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=spec.sample_size * 2,
    )
    tokenizer_dir = out / "tokenizer"
    vocab_size = write_tokenizer(tokenizer_dir)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=spec.text_hidden_size,
            intermediate_size=spec.text_hidden_size * 4,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=spec.text_heads,
            max_position_embeddings=77,
            bos_token_id=vocab_size - 2,
            eos_token_id=vocab_size - 1,
            pad_token_id=vocab_size - 1,
            hidden_act=spec.text_hidden_act,
        )
    )
    # Stable Diffusion 1.x's scheduler settings (scaled_linear betas, leading spacing, offset 1).
    scheduler = DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type=spec.prediction_type,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=CLIPTokenizer.from_pretrained(str(tokenizer_dir)),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(str(out), safe_serialization=True)
    if spec.tiny_vae_channels:
        write_tiny_vae(out / "vae_tiny", seed=seed, factor=2 ** (len(spec.vae_block_out_channels) - 1),
                       channels=spec.tiny_vae_channels)  # fmt: skip
    n_params = sum(p.numel() for p in unet.parameters())
    log.info("wrote %s: UNet %.2f M parameters, seed %d", out, n_params / 1e6, seed)
    return out


def tiny_vae_module(factor: int = 8, channels: int = 64, latent_channels: int = 4, seed: int = 0):
    """A random diffusers ``AutoencoderTiny`` of TAESD's architecture decoding latents ``factor``
    times smaller than the image: log2(factor) + 1 stages of ``channels``, the decoder's with 3
    blocks but the last (1), the encoder's with 3 but the first (1), as TAESD's (64 channels,
    (3, 3, 3, 1) and (1, 3, 3, 3) at factor 8)."""
    from diffusers import AutoencoderTiny

    stages = factor.bit_length()  # log2(factor) + 1 for a power of two
    if 2 ** (stages - 1) != factor:
        raise ValueError(f"factor {factor} is not a power of two")
    torch.manual_seed(seed)
    return AutoencoderTiny(
        latent_channels=latent_channels, encoder_block_out_channels=(channels,) * stages,
        decoder_block_out_channels=(channels,) * stages, num_encoder_blocks=(1,) + (3,) * (stages - 1),
        num_decoder_blocks=(3,) * (stages - 1) + (1,),
    ).eval()  # fmt: skip


def write_tiny_vae(out: Path, seed: int = 0, factor: int = 8, channels: int = 64, latent_channels: int = 4) -> Path:
    """Save :func:`tiny_vae_module`'s autoencoder as a diffusers folder (``vae_tiny/``)."""
    module = tiny_vae_module(factor, channels, latent_channels, seed)
    module.save_pretrained(str(out), safe_serialization=True)
    log.info("wrote %s: random tiny autoencoder, %.2f M parameters", out, sum(p.numel() for p in module.parameters()) / 1e6)
    return Path(out)


# SDXL base 1.0's scheduler_config.json: Euler, which edit-rt runs as DDIM on the same betas
SDXL_SCHEDULER = {
    "_class_name": "EulerDiscreteScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear", "num_train_timesteps": 1000,
    "prediction_type": "epsilon", "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True,
    "steps_offset": 1, "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False,
}  # fmt: skip


def write_tiny_sdxl(out: Path, seed: int = 0) -> Path:
    """A tiny random SDXL (``StableDiffusionXLPipeline`` folder): two CLIP text encoders (the
    second with a projection, its tokenizer padding with "!"), a UNet with ``text_time`` added
    conditioning and two transformer layers at its attention level, SDXL's VAE scaling factor
    and force_upcast, and SDXL's Euler scheduler config. Built as diffusers' own SDXL tests
    build theirs, a little larger."""
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    out = Path(out)
    torch.manual_seed(seed)
    hidden, projection, time_dim = 32, 32, 8
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(4, 8), use_linear_projection=True, transformer_layers_per_block=(1, 2),
        addition_embed_type="text_time", addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=6 * time_dim + projection, cross_attention_dim=2 * hidden,
        norm_num_groups=8,
    )  # fmt: skip
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), latent_channels=4,
        norm_num_groups=8, sample_size=32, scaling_factor=0.13025, force_upcast=True,
    )  # fmt: skip
    tokenizers = []
    for name, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):
        vocab_size = write_tokenizer(out / name, pad_token=pad)
        tokenizers.append(CLIPTokenizer.from_pretrained(str(out / name)))
    config = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=77, bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1, hidden_act="gelu", projection_dim=projection,
    )  # fmt: skip
    from diffusers import DDIMScheduler

    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=CLIPTextModel(config), text_encoder_2=CLIPTextModelWithProjection(config),
        tokenizer=tokenizers[0], tokenizer_2=tokenizers[1], unet=unet, scheduler=DDIMScheduler(),
        force_zeros_for_empty_prompt=True, add_watermarker=False,
    )  # fmt: skip
    pipe.save_pretrained(str(out), safe_serialization=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SDXL_SCHEDULER, indent=2))
    index = json.loads((out / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "EulerDiscreteScheduler"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    log.info("wrote %s: tiny SDXL, UNet %.2f M parameters, seed %d", out, sum(p.numel() for p in unet.parameters()) / 1e6, seed)
    return out


def write_tiny_lcm(out: Path, seed: int = 0, time_cond_proj_dim: int | None = 32) -> Path:
    """A tiny random full LCM (a ``LatentConsistencyModelPipeline`` folder): the ``tiny`` model's
    parts, its UNet taking a guidance embedding of ``time_cond_proj_dim`` (None: none, as an SD
    model to run with an LCM-LoRA has), and ``LCMScheduler`` on SD's betas."""
    from diffusers import LatentConsistencyModelPipeline, LCMScheduler, UNet2DConditionModel

    out = Path(out)
    write_tiny_model(out, seed=seed)
    # the same UNet with the guidance embedding's projection (seeded apart from the rest)
    config = dict(UNet2DConditionModel.load_config(str(out / "unet")), time_cond_proj_dim=time_cond_proj_dim)
    torch.manual_seed(seed + 1)
    UNet2DConditionModel.from_config(config).save_pretrained(str(out / "unet"), safe_serialization=True)
    LCMScheduler.from_pretrained(str(out), subfolder="scheduler").save_pretrained(str(out / "scheduler"))
    index = json.loads((out / "model_index.json").read_text())
    index.update({"_class_name": LatentConsistencyModelPipeline.__name__, "scheduler": ["diffusers", "LCMScheduler"]})
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    log.info("wrote %s: tiny LCM, time_cond_proj_dim %s, seed %d", out, time_cond_proj_dim, seed)
    return out
