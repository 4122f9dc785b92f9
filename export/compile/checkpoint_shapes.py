"""The diffusers configs of a single-file checkpoint, read from its tensor shapes.

A single file carries weights, no configs; diffusers' single-file loader needs a folder of them
(``config=``). The project ships the real families' (``checkpoint_configs/<family>/``), and
fine-tunes, distilled and pruned models differ from them in widths and depths. This module
starts from the family's shipped folder and overrides every value the file's header (names and
shapes, ``runtime/model/single_file.py``'s ``read_header``; no weight is read) tells:

- UNet: ``in/out_channels``, ``block_out_channels``, ``layers_per_block``, which levels have
  cross-attention (``down/up_block_types``), ``cross_attention_dim``, ``use_linear_projection``
  (a linear ``proj_in`` rather than a 1x1 convolution), ``transformer_layers_per_block``, and for
  SDXL ``projection_class_embeddings_input_dim`` and ``addition_time_embed_dim`` (the added
  conditioning takes the pooled text projection and six time embeddings).
- VAE: ``block_out_channels``, ``layers_per_block``, ``latent_channels``, in/out channels.
- text encoders: ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
  ``max_position_embeddings``, ``vocab_size``, and SDXL's second encoder's ``projection_dim``.

What shapes cannot tell is the family's shipped value, assumed: the number of attention heads
(kept as the family's head layout: 8 heads at every UNet level for SD 1.x, 64 channels per head
for SD 2.x's and SDXL's UNets and for every CLIP text encoder), the normalization groups (32),
``sample_size``, the scheduler, the VAE's ``scaling_factor``, SD 2.x-v's ``upcast_attention``, and
the text encoders' ``hidden_act`` (quick_gelu for OpenAI CLIP, gelu for OpenCLIP), ``layer_norm_eps``
and token ids. A model that changed one of those converts without error into a model that
samples differently; such a model needs its own diffusers configs (``checkpoint_config:``).

SD 2.x's text encoder is the file's OpenCLIP tower less its last layer (SD 2 reads the
penultimate one, so diffusers' configs hold 23 of ViT-H's 24). A vocabulary smaller than CLIP's
49408 is taken as CLIP's byte symbols and first BPE merges, in CLIP's order (the tiny test
models' byte-level vocabulary is the case with no merges), and the tokenizer is written to match.

A file the configs cannot describe (levels of unequal depth, a width the heads or groups do not
divide, no mid-block attention, ...) is refused in one line naming ``checkpoint_config:``; so is a
conversion diffusers refuses (:func:`conversion_refusal`).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Optional

from edit_rt.runtime.errors import ModelError
from edit_rt.runtime.model.single_file import Header

from .family_configs import CONFIGS, TOKENIZERS, clip_tokenizer_files, config_folder

log = logging.getLogger(__name__)

UNET = "model.diffusion_model."
VAE = "first_stage_model."
CLIP_SD1 = "cond_stage_model.transformer."
OPENCLIP_SD2 = "cond_stage_model.model."
CLIP_XL = "conditioner.embedders.0.transformer."
OPENCLIP_XL = "conditioner.embedders.1.model."
# Channels per attention head of SD 2.x's and SDXL's UNets (num_head_channels: 64 in their ldm
# configs) and of every CLIP text tower SD uses (ViT-L 768/12, ViT-H 1024/16, bigG 1280/20).
HEAD_WIDTH = 64
CLIP_VOCAB = 49408
BYTE_VOCAB = 2 * 256 + 2  # the byte symbols, bare and word-final, and the two special tokens
# Longest part of diffusers' own message kept in a refusal: its first sentence says what did
# not fit; the rest is advice for diffusers' API (low_cpu_mem_usage=...) that does not apply.
_REASON_CHARS = 400
# diffusers' defaults of the keys a shipped config may leave out
_DEFAULTS = {"use_linear_projection": False, "transformer_layers_per_block": 1}
FIX = ("give its diffusers configs with checkpoint_config: (a diffusers folder of that model: model_index.json, "
       "unet/, vae/, text_encoder/ configs and tokenizer/)")  # fmt: skip


class ShapeError(ValueError):
    """Shapes no config of the family describes; :func:`configs_from_shapes` names the file."""


def configs_from_shapes(path: Path, header: Header, family: str, out_dir: Path) -> Path:
    """The family's shipped config folder copied to ``out_dir`` (``config_folder``), with every
    value the file's shapes tell written over it; a file whose shapes equal the family's gives
    the shipped folder byte for byte."""
    try:
        derived = part_configs(header, family)
    except ShapeError as err:
        raise ModelError(f"{path}: {err}, which the {family} configs cannot describe; {refusal_fix(header, family)}") from None
    folder = config_folder(family, Path(out_dir))
    for part, values in derived.items():
        file = folder / part / "config.json"
        shipped = json.loads(file.read_text())
        changed = {k: v for k, v in values.items() if shipped.get(k, _DEFAULTS.get(k)) != v}
        if changed:
            log.info("%s: %s differs from the shipped %s configs in %s", path, part, family, sorted(changed))
            file.write_text(json.dumps({**shipped, **changed}, indent=2, sort_keys=True) + "\n")
    for (name, pad), encoder in zip(TOKENIZERS[family], ("text_encoder", "text_encoder_2")):
        vocab = derived[encoder]["vocab_size"]
        if vocab != CLIP_VOCAB:
            shutil.rmtree(folder / name)
            clip_tokenizer_files(folder / name, pad_token=pad, vocab_size=vocab)
    return folder


def part_configs(header: Header, family: str) -> dict[str, dict[str, Any]]:
    """What the shapes tell of each part's config (unet, vae, text_encoder, text_encoder_2)."""
    shipped_unet = _shipped(family, "unet")
    if family == "sdxl":
        text = clip_config(header, CLIP_XL)
        text_2 = open_clip_config(header, OPENCLIP_XL, drop_last=False)
        parts = {"text_encoder": text, "text_encoder_2": text_2}
        unet = unet_config(header, shipped_unet, projection_dim=text_2["projection_dim"])
    else:
        openclip = family.startswith("sd2")
        parts = {"text_encoder": open_clip_config(header, OPENCLIP_SD2, drop_last=True) if openclip
                 else clip_config(header, CLIP_SD1)}  # fmt: skip
        unet = unet_config(header, shipped_unet)
    return {"unet": unet, "vae": vae_config(header, _shipped(family, "vae")), **parts}


def _shipped(family: str, part: str) -> dict[str, Any]:
    return json.loads((CONFIGS / family / part / "config.json").read_text())


def _indices(header: Header, prefix: str) -> list[int]:
    """The integers ``i`` of the keys ``prefix<i>.*``, ascending."""
    found = {k[len(prefix):].split(".", 1)[0] for k in header.tensors if k.startswith(prefix)}
    return sorted(int(i) for i in found if i.isdigit())


def _need(header: Header, name: str) -> tuple[int, ...]:
    shape = header.shape(name)
    if shape is None:
        raise ShapeError(f"it lacks {name}")
    return shape


def _depth(header: Header, block: str) -> int:
    """Transformer layers of the ldm attention ``block`` (``<...>.1``): 0 where it has none."""
    return len(_indices(header, f"{block}.transformer_blocks."))


def unet_config(h: Header, shipped: dict[str, Any], projection_dim: Optional[int] = None) -> dict[str, Any]:
    """The UNet's values from ldm's ``input_blocks`` (conv_in, then per level ``layers_per_block``
    resnet(+attention) blocks and a downsampler but after the last), ``middle_block`` and
    ``output_blocks`` (per level one block more)."""
    conv_in = _need(h, UNET + "input_blocks.0.0.weight")
    out = _need(h, UNET + "out.2.weight")
    levels: list[list[tuple[int, int]]] = [[]]  # per level: (channels, transformer depth) per block
    for k in _indices(h, UNET + "input_blocks.")[1:]:
        if h.shape(f"{UNET}input_blocks.{k}.0.op.weight") is not None:
            levels.append([])
            continue
        channels = _need(h, f"{UNET}input_blocks.{k}.0.out_layers.3.weight")[0]
        levels[-1].append((channels, _depth(h, f"{UNET}input_blocks.{k}.1")))
    per = len(levels[0])
    if per == 0 or any(len(level) != per for level in levels):
        raise ShapeError(f"its UNet has {[len(level) for level in levels]} resnet blocks per level (diffusers needs "
                         "the same number at every level)")  # fmt: skip
    if any(len(set(level)) != 1 for level in levels):
        raise ShapeError("its UNet's blocks differ in width or attention depth within a level")
    channels = [level[0][0] for level in levels]
    down_depth = [level[0][1] for level in levels]
    outputs = _indices(h, UNET + "output_blocks.")
    if len(outputs) != len(levels) * (per + 1):
        raise ShapeError(f"its UNet has {len(outputs)} output blocks for {len(levels)} levels of {per} (diffusers "
                         f"needs {len(levels) * (per + 1)})")  # fmt: skip
    up = [[(_need(h, f"{UNET}output_blocks.{k}.0.out_layers.3.weight")[0], _depth(h, f"{UNET}output_blocks.{k}.1"))
           for k in outputs[i * (per + 1) : (i + 1) * (per + 1)]] for i in range(len(levels))]  # fmt: skip
    if [list(level) for level in up] != [[b] * (per + 1) for b in zip(channels[::-1], down_depth[::-1])]:
        raise ShapeError("its UNet's up levels do not mirror its down levels in width and attention depth")
    mid_depth = _depth(h, UNET + "middle_block.1")
    depths = [d or 1 for d in down_depth]  # a level without attention: diffusers' default of 1
    if mid_depth == 0:
        raise ShapeError("its UNet's middle block has no attention (diffusers' mid block has one)")
    if mid_depth != depths[-1]:
        raise ShapeError(f"its UNet's middle block has {mid_depth} transformer layers and its lowest level "
                         f"{depths[-1]} (diffusers gives the middle block the lowest level's)")  # fmt: skip
    time_embed = _need(h, UNET + "time_embed.0.weight")
    if time_embed != (4 * channels[0], channels[0]):
        raise ShapeError(f"its UNet's time embedding is {time_embed}, not 4 x its first width ({channels[0]})")
    attention = [k for k in h.tensors if k.startswith(UNET) and k.endswith(".attn2.to_k.weight")]
    proj_in = [k for k in h.tensors if k.startswith(UNET) and k.endswith(".proj_in.weight")]
    if not attention or not proj_in:
        raise ShapeError("its UNet's attention has no cross-attention (attn2) or no proj_in")
    values: dict[str, Any] = {
        "in_channels": conv_in[1], "out_channels": out[0], "block_out_channels": channels, "layers_per_block": per,
        "down_block_types": ["CrossAttnDownBlock2D" if d else "DownBlock2D" for d in down_depth],
        "up_block_types": ["CrossAttnUpBlock2D" if d else "UpBlock2D" for d in down_depth[::-1]],
        "cross_attention_dim": _need(h, attention[0])[1],
        "use_linear_projection": len(_need(h, proj_in[0])) == 2,
    }  # fmt: skip
    if "transformer_layers_per_block" in shipped or any(d != 1 for d in depths):
        values["transformer_layers_per_block"] = depths
    heads = shipped["attention_head_dim"]
    attended = [c for c, d in zip(channels, down_depth) if d] + channels[-1:]  # the mid block's is the lowest level's
    if isinstance(heads, list):  # SD 2.x, SDXL: a head per 64 channels at every level
        values["attention_head_dim"] = [max(c // HEAD_WIDTH, 1) for c in channels]
        uneven = [c for c in attended if c % HEAD_WIDTH]
        if uneven:
            raise ShapeError(f"its UNet's attention widths {uneven} are not multiples of the {HEAD_WIDTH} channels "
                             "a head has in this family")  # fmt: skip
    elif any(c % heads for c in attended):  # SD 1.x: 8 heads at every level
        raise ShapeError(f"its UNet's attention widths {attended} do not split into the family's {heads} heads")
    groups = shipped["norm_num_groups"]
    if any(c % groups for c in channels):
        raise ShapeError(f"its UNet's widths {channels} are not multiples of the {groups} normalization groups")
    label = h.shape(UNET + "label_emb.0.0.weight")
    if (label is not None) != (projection_dim is not None):
        raise ShapeError("its UNet's added conditioning (label_emb) does not match the family's")
    if label is not None and projection_dim is not None:
        time_dim, rest = divmod(label[1] - projection_dim, 6)
        if rest or time_dim <= 0:
            raise ShapeError(f"its UNet's added conditioning takes {label[1]} values, not the text projection "
                             f"({projection_dim}) and six time embeddings")  # fmt: skip
        values.update(projection_class_embeddings_input_dim=label[1], addition_time_embed_dim=time_dim)
    return values


def vae_config(h: Header, shipped: dict[str, Any]) -> dict[str, Any]:
    """The VAE's values from ldm's ``encoder.down.<level>.block.<j>`` and ``decoder.up.*``."""
    levels = _indices(h, VAE + "encoder.down.")
    if not levels:
        raise ShapeError(f"its VAE has no {VAE}encoder.down.* blocks")
    blocks = [_indices(h, f"{VAE}encoder.down.{i}.block.") for i in levels]
    per = len(blocks[0])
    up = [len(_indices(h, f"{VAE}decoder.up.{i}.block.")) for i in levels]
    if any(len(b) != per for b in blocks) or up != [per + 1] * len(levels):
        raise ShapeError(f"its VAE has {[len(b) for b in blocks]} encoder and {up} decoder blocks per level (diffusers "
                         "needs n and n + 1 at every level)")  # fmt: skip
    channels = [_need(h, f"{VAE}encoder.down.{i}.block.0.conv2.weight")[0] for i in levels]
    latent = _need(h, VAE + "decoder.conv_in.weight")[1]
    if _need(h, VAE + "encoder.conv_out.weight")[0] != 2 * latent:
        raise ShapeError(f"its VAE's encoder does not give a mean and a variance for its {latent} latent channels")
    if h.shape(VAE + "encoder.mid.attn_1.q.weight") is None:
        raise ShapeError("its VAE has no mid-block attention (diffusers' AutoencoderKL has one)")
    groups = shipped["norm_num_groups"]
    if any(c % groups for c in channels):
        raise ShapeError(f"its VAE's widths {channels} are not multiples of the {groups} normalization groups")
    n = len(levels)
    return {"in_channels": _need(h, VAE + "encoder.conv_in.weight")[1], "out_channels": _need(h, VAE + "decoder.conv_out.weight")[0],
            "block_out_channels": channels, "layers_per_block": per, "latent_channels": latent,
            "down_block_types": ["DownEncoderBlock2D"] * n, "up_block_types": ["UpDecoderBlock2D"] * n}  # fmt: skip


def _text_values(what: str, vocab: tuple[int, ...], positions: tuple[int, ...], layers: int, mlp: tuple[int, ...]) -> dict:
    hidden = vocab[1]
    if hidden % HEAD_WIDTH:
        raise ShapeError(f"its {what} is {hidden} wide, not a multiple of the {HEAD_WIDTH} channels a CLIP head has")
    if not BYTE_VOCAB <= vocab[0] <= CLIP_VOCAB:
        raise ShapeError(f"its {what} has {vocab[0]} tokens, more than CLIP's {CLIP_VOCAB} (or fewer than its "
                         f"{BYTE_VOCAB} byte symbols), so CLIP's tokenizer does not fit it")  # fmt: skip
    return {"hidden_size": hidden, "intermediate_size": mlp[0], "num_hidden_layers": layers,
            "num_attention_heads": hidden // HEAD_WIDTH, "max_position_embeddings": positions[0], "vocab_size": vocab[0]}  # fmt: skip


def clip_config(h: Header, prefix: str) -> dict[str, Any]:
    """An OpenAI CLIP text tower in transformers' names under ``prefix`` (``text_model.`` or not:
    files saved by old transformers lack it)."""
    inner = prefix + "text_model." if h.any_prefix(prefix + "text_model.") else prefix
    layers = len(_indices(h, inner + "encoder.layers."))
    return _text_values(f"text encoder ({prefix}*)", _need(h, inner + "embeddings.token_embedding.weight"),
                        _need(h, inner + "embeddings.position_embedding.weight"), layers,
                        _need(h, inner + "encoder.layers.0.mlp.fc1.weight"))  # fmt: skip


def open_clip_config(h: Header, prefix: str, drop_last: bool) -> dict[str, Any]:
    """An OpenCLIP text tower under open_clip's names; ``drop_last``: SD 2.x, whose diffusers
    encoder stops at the penultimate layer (diffusers' converter drops resblock 23 of 24)."""
    layers = len(_indices(h, prefix + "transformer.resblocks."))
    if drop_last and layers > 24:
        raise ShapeError(f"its text encoder has {layers} layers; diffusers' SD 2.x converter drops the 24th, so "
                         "only towers of up to 24 convert")  # fmt: skip
    values = _text_values(f"text encoder ({prefix}*)", _need(h, prefix + "token_embedding.weight"),
                          _need(h, prefix + "positional_embedding"), layers - 1 if drop_last else layers,
                          _need(h, prefix + "transformer.resblocks.0.mlp.c_fc.weight"))  # fmt: skip
    if not drop_last:  # SDXL's second encoder: the pooled output's projection, (width, projection)
        values["projection_dim"] = _need(h, prefix + "text_projection")[1]
    return values


def _families_in_keys(header: Header) -> set[str]:
    """Every family some of the file's keys belong to (a merge can leave another's behind)."""
    found = set()
    if header.any_prefix(CLIP_SD1):
        found.add("sd1")
    if header.any_prefix(OPENCLIP_SD2):
        found.add("sd2")
    if header.any_prefix("conditioner.embedders.") or header.any_prefix(UNET + "label_emb."):
        found.add("sdxl")
    return found


def refusal_fix(header: Header, family: str) -> str:
    """What to do about a file that does not convert as ``family``: ``family:`` when its keys
    hold another family's too, else its own configs."""
    others = sorted(_families_in_keys(header) - {family.split("-")[0]})
    if others:
        names = " or ".join("sd2 or sd2-v" if f == "sd2" else f for f in others)
        return f"its keys hold {', '.join(others)} parts too: if it is that model, set family: {names}; else {FIX}"
    return FIX


def one_line(text: str, limit: int = _REASON_CHARS) -> str:
    """``text`` on one line: whole when short, else its first sentence, else cut at a word."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    first = re.match(r"(.+?[.!?])(\s|$)", text)
    if first and len(first.group(1)) <= limit:
        return first.group(1)
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def conversion_refusal(path: Path, family: str, err: BaseException, header: Header) -> ModelError:
    """The one-line refusal of a conversion diffusers' loader raised ``err`` on."""
    reason = one_line(str(err)) or type(err).__name__
    return ModelError(f"{path}: diffusers could not convert it as {family} ({type(err).__name__}: {reason}); "
                      f"{refusal_fix(header, family)}")  # fmt: skip
