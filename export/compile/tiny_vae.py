"""The tiny autoencoder (TAESD, Bohan 2023; diffusers' ``AutoencoderTiny``): where its weights come
from and how they load.

A model has one when ``export.tiny_vae`` names it or its folder holds ``vae_tiny/``
(:data:`TINY_VAE_FOLDER`); `edit-rt export` then writes ``taesd_decoder`` (and, with an encoder,
``taesd_encoder``) beside the VAE's graphs. Accepted forms:

- a diffusers ``AutoencoderTiny`` folder (``config.json`` + ``diffusion_pytorch_model.safetensors``,
  as ``madebyollin/taesd`` ships for diffusers, or ``save_pretrained`` writes);
- the files its authors ship (``taesd_decoder.safetensors`` and ``taesd_encoder.safetensors``;
  TAESDXL's ``taesdxl_*``): a folder holding them, or the decoder file itself (its encoder is
  read from beside it when there). Their keys are ``nn.Sequential`` indices, the decoder's shifted
  by one against diffusers' (the authors' decoder starts with its clamp as a layer, diffusers'
  ``DecoderTiny`` clamps in ``forward``): diffusers' own
  ``scripts/convert_tiny_autoencoder_to_diffusers.py`` maps them the same way. The architecture
  (latent channels, widths, blocks per stage) is read from the tensors' shapes.

Pickles (``.pth``, ``.pt``, ``.ckpt``, ``.bin``) are refused: loading one runs the code it holds.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from edit_rt.runtime.errors import ModelError
from edit_rt.runtime.model.single_file import PICKLE_SUFFIXES

log = logging.getLogger(__name__)

TINY_VAE_FOLDER = "vae_tiny"  # a model folder's own tiny autoencoder (diffusers layout)
_FIX = "give a diffusers AutoencoderTiny folder or the authors' taesd_decoder.safetensors (export.tiny_vae)"


@dataclass(frozen=True)
class TinyVae:
    """A loaded tiny autoencoder: the module, where it came from, whether it has an encoder."""

    module: torch.nn.Module
    source: Path
    encoder: bool


def tiny_vae_source(model_dir: Path, configured: Optional[Path] = None) -> Optional[Path]:
    """The tiny autoencoder of a model: ``configured`` (``export.tiny_vae``), else the model
    folder's ``vae_tiny/``, else None (the model has none)."""
    if configured is not None:
        if not Path(configured).exists():
            raise ModelError(f"export.tiny_vae: {configured} does not exist; {_FIX}, or leave the field out")
        return Path(configured)
    own = Path(model_dir) / TINY_VAE_FOLDER
    return own if own.is_dir() else None


def _refuse_pickle(path: Path) -> None:
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelError(f"export.tiny_vae: {path} is a pickle ({path.suffix}), and loading one runs the code it "
                         f"holds; use the .safetensors files the authors ship beside it, or convert it once: "
                         f"python -m edit_rt.export.compile.checkpoint {path}")  # fmt: skip


def _authors_files(path: Path) -> tuple[Optional[Path], Optional[Path]]:
    """(decoder, encoder) files of the authors' layout at ``path`` (a folder or the decoder file)."""
    if path.is_file():
        _refuse_pickle(path)
        match = re.fullmatch(r"(.*)_decoder\.safetensors", path.name)
        if match is None:
            raise ModelError(f"export.tiny_vae: {path} is not a *_decoder.safetensors file; {_FIX}")
        encoder = path.with_name(f"{match.group(1)}_encoder.safetensors")
        return path, encoder if encoder.is_file() else None
    decoders = sorted(path.glob("*_decoder.safetensors"))
    if len(decoders) != 1:
        pickles = [p for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES]
        if pickles:
            _refuse_pickle(pickles[0])
        found = "none" if not decoders else ", ".join(p.name for p in decoders)
        raise ModelError(f"export.tiny_vae: {path} holds no config.json and {found} *_decoder.safetensors "
                         f"(one wanted); {_FIX}")  # fmt: skip
    return _authors_files(decoders[0])


def tiny_from_authors(decoder: dict[str, torch.Tensor], encoder: Optional[dict[str, torch.Tensor]] = None):
    """A diffusers ``AutoencoderTiny`` holding the authors' state dicts (``nn.Sequential``
    indices; the decoder's from 1, its layer 0 being the clamp)."""
    from diffusers import AutoencoderTiny

    dec = {}
    for key, value in decoder.items():
        index, rest = key.split(".", 1)
        dec[f"{int(index) - 1}.{rest}"] = value
    latent = int(dec["0.weight"].shape[1])
    # decoder: conv_in (0), its activation (1), then per stage: blocks, [upsample], conv
    dec_blocks, dec_channels, run = [], [], 0
    for i in sorted({int(k.split(".")[0]) for k in dec})[1:]:
        if f"{i}.conv.0.weight" in dec:
            run += 1
        else:
            dec_blocks.append(run)
            dec_channels.append(int(dec[f"{i}.weight"].shape[1]))
            run = 0
    config = dict(latent_channels=latent, decoder_block_out_channels=tuple(dec_channels),
                  num_decoder_blocks=tuple(dec_blocks))  # fmt: skip
    enc = {}
    if encoder is not None:
        enc_blocks, enc_channels = [], []
        indices = sorted({int(k.split(".")[0]) for k in encoder})
        for i in indices[:-1]:  # the last conv maps to the latent
            if f"{i}.conv.0.weight" in encoder:
                enc_blocks[-1] += 1
            else:
                enc_blocks.append(0)
                enc_channels.append(int(encoder[f"{i}.weight"].shape[0]))
        config.update(encoder_block_out_channels=tuple(enc_channels), num_encoder_blocks=tuple(enc_blocks))
        enc = {f"encoder.layers.{k}": v for k, v in encoder.items()}
    else:  # no encoder shipped: a placeholder of the decoder's widths, never exported
        config.update(encoder_block_out_channels=tuple(dec_channels), num_encoder_blocks=(1,) * len(dec_channels))
    module = AutoencoderTiny(**config)
    state = {**{f"decoder.layers.{k}": v for k, v in dec.items()}, **enc}
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if encoder is not None or not k.startswith("encoder.")]
    if missing or unexpected:
        raise ModelError(f"export.tiny_vae: the files are not TAESD's layout ({(missing or unexpected)[0]} "
                         f"{'missing' if missing else 'unexpected'}); {_FIX}")  # fmt: skip
    return module


def load_tiny_vae(path: Path) -> TinyVae:
    """The tiny autoencoder at ``path`` (any form the module docstring lists), in eval mode, fp32."""
    from diffusers import AutoencoderTiny
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        try:
            module = AutoencoderTiny.from_pretrained(str(path), use_safetensors=True)
        except (OSError, ValueError, EnvironmentError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModelError(f"export.tiny_vae: {path} cannot be loaded as an AutoencoderTiny ({first}); {_FIX}") from None
        return TinyVae(module.float().eval(), path, encoder=True)
    decoder, encoder = _authors_files(path)
    module = tiny_from_authors(load_file(str(decoder)), None if encoder is None else load_file(str(encoder)))
    log.info("tiny autoencoder from %s%s", decoder, "" if encoder else " (no encoder beside it: decoder only)")
    return TinyVae(module.float().eval(), decoder, encoder=encoder is not None)


def checked_for(tiny: TinyVae, vae: torch.nn.Module) -> TinyVae:
    """``tiny`` if it decodes ``vae``'s latents (same channels, same pixels per latent pixel);
    a one-line ModelError otherwise (TAESD is SD 1.x/2.x's, TAESDXL SDXL's, TAESD3/F1 16 channels)."""
    config = tiny.module.config
    factor = int(config.upsampling_scaling_factor) ** (len(config.decoder_block_out_channels) - 1)
    vae_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    if int(config.latent_channels) != int(vae.config.latent_channels) or factor != vae_factor:
        raise ModelError(f"export.tiny_vae: {tiny.source} decodes {config.latent_channels}-channel latents at "
                         f"{factor}x, this model's VAE {vae.config.latent_channels} channels at {vae_factor}x; give "
                         "the tiny autoencoder of this model's family (TAESD: SD 1.x/2.x, TAESDXL: SDXL)")  # fmt: skip
    return tiny
