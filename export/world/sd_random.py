"""A random-weight Stable Diffusion 1.5 at its true size (or scaled down), for the real-size check.

``write_random_sd(out)`` writes a diffusers folder (``unet/ vae/ text_encoder/ tokenizer/
scheduler/ model_index.json``, safetensors) from the configs the project ships for single-file
checkpoints (``export/compile/checkpoint_configs/sd1/``: SD 1.5's), so its modules, parameter names and
shapes are SD 1.5's: UNet 859.5 M, VAE 83.7 M, CLIP text encoder 123.1 M parameters, and the
real 49408-token CLIP BPE tokenizer (``family_configs.clip_tokenizer_files``). Only the weights are
random (seeded; diffusers' and transformers' own initialisation, under which GroupNorm and
LayerNorm keep the activations in range: a generation is finite noise, not NaN).

``scale`` < 1 narrows every width and keeps the architecture (blocks, layers, attention
levels, vocabulary, context length): UNet and VAE channels become multiples of 32 (their
GroupNorms have 32 groups), UNet attention keeps head dims of at least 8, the text encoder
keeps its 12 heads with a narrower head. ``scripts/check_sd15.py`` runs the pipeline on it
at ``scale=1.0`` (``make check-sd15``) and its test at ``scale=0.1``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Optional

from edit_rt.runtime.errors import ConfigError, ModelError

from ..compile.family_configs import CONFIGS  # the configs the project ships for single-file checkpoints

log = logging.getLogger(__name__)

# family -> its shipped config folder (export/compile/checkpoint_configs/README.md: sd1 is SD 1.5's values)
FAMILIES = {"sd15": "sd1", "sd1": "sd1"}
PARTS = ("unet", "vae", "text_encoder")
GROUPS = 32  # the norm_num_groups of SD's UNet and VAE: every channel count a multiple of it
MIN_HEAD_DIM = 8  # the narrowest attention head a scaled model keeps (SD 1.5's are 40 to 160 wide)


def _width(channels: int, scale: float, multiple: int) -> int:
    """``channels * scale`` rounded to a multiple of ``multiple`` (at least one multiple)."""
    return max(multiple, int(round(channels * scale / multiple)) * multiple)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelError(f"{path}: unreadable ({err}); the shipped configs are under {CONFIGS}") from None


def shipped_configs(family: str = "sd15", config_dir: Optional[Path] = None) -> Path:
    """The diffusers config folder a random ``family`` model is built from (shipped by default)."""
    if family not in FAMILIES:
        raise ConfigError(f"family: {family!r} has no random-model recipe; choose one of {', '.join(FAMILIES)}")
    folder = Path(config_dir) if config_dir is not None else CONFIGS / FAMILIES[family]
    if not (folder / "unet" / "config.json").is_file():
        raise ModelError(f"{folder}: no unet/config.json; the {family} configs ship with export/compile/checkpoint.py "
                         "(export/compile/checkpoint_configs/) or pass config_dir=")  # fmt: skip
    return folder


def random_sd_configs(family: str = "sd15", scale: float = 1.0, config_dir: Optional[Path] = None) -> dict[str, dict]:
    """The unet, vae and text_encoder configs (diffusers / transformers dicts) of the model at
    ``scale``; at 1.0 exactly the shipped ones."""
    if not 0.0 < scale <= 1.0:
        raise ConfigError(f"scale: must be in (0, 1], got {scale}; 1.0 is the true size")
    folder = shipped_configs(family, config_dir)
    unet, vae, text = (_read(folder / part / "config.json") for part in PARTS)
    if scale == 1.0:
        return {"unet": unet, "vae": vae, "text_encoder": text}

    # 1. UNet: channels per level, and heads that keep each level's head dim >= MIN_HEAD_DIM
    # (SD 1.x's `attention_head_dim: 8` is diffusers' old name for 8 heads per layer).
    channels = [_width(c, scale, GROUPS) for c in unet["block_out_channels"]]
    heads = unet.get("attention_head_dim", 8)
    heads = [heads] * len(channels) if isinstance(heads, int) else list(heads)
    heads = [max(1, min(h, c // MIN_HEAD_DIM)) for h, c in zip(heads, channels)]
    unet["block_out_channels"] = channels
    unet["attention_head_dim"] = heads[0] if len(set(heads)) == 1 else heads

    # 2. Text encoder: as many heads (CLIP-L: 12), each narrower; the UNet's cross-attention reads it.
    n_heads = text["num_attention_heads"]
    head_dim = _width(text["hidden_size"] // n_heads, scale, MIN_HEAD_DIM)
    hidden = n_heads * head_dim
    text["intermediate_size"] = text["intermediate_size"] * hidden // text["hidden_size"]
    text["projection_dim"] = hidden
    text["hidden_size"] = hidden
    unet["cross_attention_dim"] = hidden

    # 3. VAE: channels per level (its mid-block attention is one head of the last width).
    vae["block_out_channels"] = [_width(c, scale, GROUPS) for c in vae["block_out_channels"]]
    return {"unet": unet, "vae": vae, "text_encoder": text}


def _module(part: str, config: dict):
    """The randomly initialised torch module of one part (on the current default device)."""
    if part == "text_encoder":
        from transformers import CLIPTextConfig, CLIPTextModel

        return CLIPTextModel(CLIPTextConfig.from_dict(config))
    from diffusers import AutoencoderKL, UNet2DConditionModel

    return (UNet2DConditionModel if part == "unet" else AutoencoderKL).from_config(config)


def parameter_counts(configs: dict[str, dict]) -> dict[str, int]:
    """Parameters per part of the model ``configs`` describe (built on the meta device: no memory)."""
    import torch

    with torch.device("meta"):
        return {part: sum(p.numel() for p in _module(part, configs[part]).parameters()) for part in PARTS}


def write_random_sd(out: Path, family: str = "sd15", seed: int = 0, scale: float = 1.0,
                    config_dir: Optional[Path] = None, tiny_vae: bool = True) -> Path:  # fmt: skip
    """Write the random ``family`` model at ``scale`` to ``out`` (a diffusers folder); return ``out``.

    One part at a time is built, saved and freed, so the peak memory is the UNet's weights
    (3.4 GB in fp32 at scale 1.0) plus its serialisation, not the whole model's. ``tiny_vae``:
    a random TAESD-size tiny autoencoder in ``vae_tiny/`` too."""
    import torch

    from ..compile.family_configs import clip_tokenizer_files
    from ..compile.family import quiet

    quiet()  # no "Writing model shards" bars from transformers
    configs = random_sd_configs(family, scale, config_dir)
    folder = shipped_configs(family, config_dir)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for i, part in enumerate(PARTS):
        torch.manual_seed(seed + i)  # each part from its own seed: one part's size never moves another's weights
        with torch.no_grad():
            module = _module(part, configs[part]).eval()
            counts[part] = sum(p.numel() for p in module.parameters())
            module.save_pretrained(str(out / part), safe_serialization=True)
        del module
        log.info("wrote %s/%s: %.1f M parameters", out, part, counts[part] / 1e6)
    clip_tokenizer_files(out / "tokenizer")
    (out / "scheduler").mkdir(exist_ok=True)
    shutil.copyfile(folder / "scheduler" / "scheduler_config.json", out / "scheduler" / "scheduler_config.json")
    index = _read(folder / "model_index.json")
    # A random model has nothing to censor, and no image processor ships with it.
    index.update(safety_checker=[None, None], feature_extractor=[None, None], requires_safety_checker=False)
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    if tiny_vae:  # TAESD's true architecture (no weights offline): the preview decoder's true cost
        from .tiny_model import write_tiny_vae

        write_tiny_vae(out / "vae_tiny", seed=seed + len(PARTS), factor=2 ** (len(configs["vae"]["block_out_channels"]) - 1),
                       latent_channels=int(configs["vae"]["latent_channels"]))  # fmt: skip
    log.info("wrote %s: random %s at scale %g, seed %d (%s)", out, family, scale, seed,
             ", ".join(f"{part} {n / 1e6:.1f} M" for part, n in counts.items()))  # fmt: skip
    return out
