"""Single files at other shapes than the real families': their configs read from their tensor
shapes (export/compile/checkpoint_shapes.py), so a fine-tune or a distilled model of other widths
and depths converts without configs of its own.

The references are independent of the code under test: the shipped configs of the real families
(their shapes, built on the meta device and written in the ldm layout by tests/ldm_layout.py,
must give them back byte for byte), and diffusers pipelines of small models at non-standard
widths built here (their single files, converted, must give the same images, same seed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from edit_rt.runtime.errors import ModelError
from edit_rt.runtime.model.single_file import Header

from .ldm_layout import clip_to_ldm, open_clip_to_ldm, unet_to_ldm, vae_to_ldm, write_single_file

FAMILIES = ("sd1", "sd2", "sd2-v", "sdxl")


def _one_line(err: BaseException, *needles: str) -> str:
    text = str(err)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text
    return text


# --- the real families' shapes give the shipped configs ------------------------------------


def _real_header(family: str) -> Header:
    """The header a real ``family`` file has: its shipped configs' models on the meta device (no
    memory), in the ldm names; SD 2.x's OpenCLIP tower with its 24th layer, which real files hold
    and diffusers' 23-layer encoder leaves out."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from edit_rt.export.compile.family_configs import CONFIGS

    config = lambda part: json.loads((CONFIGS / family / part / "config.json").read_text())  # noqa: E731
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(config("unet")).state_dict()
        vae = AutoencoderKL.from_config(config("vae")).state_dict()
        text = CLIPTextModel(CLIPTextConfig(**config("text_encoder"))).state_dict()
        text_2 = CLIPTextModelWithProjection(CLIPTextConfig(**config("text_encoder_2"))).state_dict() if family == "sdxl" else None
    state = {"model.diffusion_model." + k: v for k, v in unet_to_ldm(unet, config("unet")).items()}
    state.update({"first_stage_model." + k: v for k, v in vae_to_ldm(vae, config("vae")).items()})
    if family == "sdxl":
        state.update(clip_to_ldm(text, "conditioner.embedders.0.transformer."))
        state.update(open_clip_to_ldm(text_2, "conditioner.embedders.1.model."))
    elif family.startswith("sd2"):
        state.update(open_clip_to_ldm(text, "cond_stage_model.model."))
        last = "cond_stage_model.model.transformer.resblocks."
        state.update({k.replace(f"{last}22.", f"{last}23."): v for k, v in state.items() if k.startswith(f"{last}22.")})
    else:
        state.update(clip_to_ldm(text, "cond_stage_model.transformer."))
    return Header({k: ("F16", tuple(v.shape)) for k, v in state.items()}, {}, "")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_real_familys_shapes_give_its_shipped_configs_unchanged(family, tmp_path):
    from edit_rt.export.compile.family_configs import config_folder
    from edit_rt.export.compile.checkpoint_shapes import configs_from_shapes

    shipped = config_folder(family, tmp_path / "shipped")
    derived = configs_from_shapes(tmp_path / "model.safetensors", _real_header(family), family, tmp_path / "derived")
    files = sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(derived) for p in derived.rglob("*") if p.is_file())
    unequal = [str(f) for f in files if (shipped / f).read_bytes() != (derived / f).read_bytes()]
    assert not unequal


# --- small models at non-standard widths -----------------------------------------------------

# SD 1.5's scheduler settings; both pipelines get this one, so the images compare the models
SCHEDULER = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                 set_alpha_to_one=False, steps_offset=1)  # fmt: skip


def _text_config(vocab: int, hidden: int, layers: int, intermediate: int, act: str, **extra):
    """A CLIP text tower of CLIP's head width (64), its end token the vocabulary's last id as
    CLIP's is (the pooled output is read there)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                          num_attention_heads=hidden // 64, max_position_embeddings=77, bos_token_id=vocab - 2,
                          eos_token_id=vocab - 1, pad_token_id=vocab - 1, hidden_act=act, **extra)  # fmt: skip


def _vae(**extra):
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                         norm_num_groups=32, **extra)  # fmt: skip


def write_small_sd1(out: Path) -> Path:
    """SD 1.x's architecture at other widths and depths: three UNet levels of 32, 64, 96 channels
    (SD 1.5: four of 320 to 1280), one resnet each (SD 1.5: two), attention at the first two, 8
    heads; a two-level VAE; a 64-wide, two-layer text encoder (SD 1.5: 768, 12) with a 2.5x MLP
    and a byte-level vocabulary of 514 tokens."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    from edit_rt.export.world.tiny_model import write_tokenizer

    torch.manual_seed(5)
    unet = UNet2DConditionModel(sample_size=16, block_out_channels=(32, 64, 96), layers_per_block=1,
                                down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                                cross_attention_dim=64, attention_head_dim=8, norm_num_groups=32)  # fmt: skip
    vocab = write_tokenizer(out / "tokenizer")
    text = CLIPTextModel(_text_config(vocab, 64, 2, 160, "quick_gelu"))
    pipe = StableDiffusionPipeline(vae=_vae(), text_encoder=text, tokenizer=CLIPTokenizer.from_pretrained(str(out / "tokenizer")),
                                   unet=unet, scheduler=DDIMScheduler(**SCHEDULER), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)  # fmt: skip
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


def write_small_sdxl(out: Path) -> Path:
    """SDXL's architecture at other widths and depths: UNet levels of 64 and 128 channels (SDXL:
    320, 640, 1280), one resnet each, two transformer layers at the attention level (SDXL: 2 and
    10), a head per 64 channels; text encoders 64 wide x 2 layers (quick_gelu) and 128 wide x 3
    layers (gelu) with a 96-wide projection; an 8-wide time embedding (SDXL: 256)."""
    from diffusers import DDIMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from edit_rt.export.world.tiny_model import write_tokenizer

    torch.manual_seed(6)
    unet = UNet2DConditionModel(sample_size=16, block_out_channels=(64, 128), layers_per_block=1,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(1, 2),
                                use_linear_projection=True, transformer_layers_per_block=(1, 2),
                                addition_embed_type="text_time", addition_time_embed_dim=8,
                                projection_class_embeddings_input_dim=6 * 8 + 96, cross_attention_dim=64 + 128,
                                norm_num_groups=32)  # fmt: skip
    tokenizers = []
    for name, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):
        vocab = write_tokenizer(out / name, pad_token=pad)
        tokenizers.append(CLIPTokenizer.from_pretrained(str(out / name)))
    text = CLIPTextModel(_text_config(vocab, 64, 2, 256, "quick_gelu"))
    text_2 = CLIPTextModelWithProjection(_text_config(vocab, 128, 3, 512, "gelu", projection_dim=96))
    pipe = StableDiffusionXLPipeline(vae=_vae(scaling_factor=0.13025, force_upcast=True), text_encoder=text,
                                     text_encoder_2=text_2, tokenizer=tokenizers[0], tokenizer_2=tokenizers[1], unet=unet,
                                     scheduler=DDIMScheduler(**SCHEDULER), force_zeros_for_empty_prompt=True,
                                     add_watermarker=False)  # fmt: skip
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def small_sd1(tmp_path_factory) -> Path:
    return write_small_sd1(tmp_path_factory.mktemp("models") / "small-sd1")


@pytest.fixture(scope="module")
def small_sd1_file(small_sd1, tmp_path_factory) -> Path:
    return write_single_file(small_sd1, tmp_path_factory.mktemp("files") / "small-sd1.safetensors")


def _image(pipeline_cls, folder: Path) -> np.ndarray:
    from diffusers import DDIMScheduler

    from edit_rt.export.compile.family import quiet

    quiet()
    pipe = pipeline_cls.from_pretrained(str(folder), local_files_only=True)
    pipe.scheduler = DDIMScheduler(**SCHEDULER)
    pipe.set_progress_bar_config(disable=True)
    out = pipe("a red circle", negative_prompt="blurry", num_inference_steps=3, guidance_scale=5.0, height=32,
               width=32, generator=torch.Generator().manual_seed(4), output_type="np")  # fmt: skip
    return out.images[0]


def _same_weights(original: Path, converted: Path, parts: tuple[str, ...]) -> None:
    for part in parts:
        a = load_file(str(next((original / part).glob("*.safetensors"))))
        b = load_file(str(next((converted / part).glob("*.safetensors"))))
        assert a.keys() == b.keys(), (part, sorted(set(a) ^ set(b))[:5])
        unequal = [k for k in a if not torch.equal(a[k], b[k])]
        assert not unequal, (part, unequal[:5])


def test_a_small_sd1_file_converts_without_configs_to_its_folders_images(small_sd1, small_sd1_file, tmp_path):
    from diffusers import StableDiffusionPipeline

    from edit_rt.export.compile.checkpoint import diffusers_from_single_file

    out = diffusers_from_single_file(small_sd1_file, tmp_path / "conv")
    _same_weights(small_sd1, out, ("unet", "vae", "text_encoder"))
    assert json.loads((out / "unet" / "config.json").read_text())["block_out_channels"] == [32, 64, 96]
    expected, got = _image(StableDiffusionPipeline, small_sd1), _image(StableDiffusionPipeline, out)
    assert np.abs(expected - got).max() <= 1e-6


def test_a_small_sdxl_file_converts_without_configs_to_its_folders_images(tmp_path):
    from diffusers import StableDiffusionXLPipeline

    from edit_rt.export.compile.checkpoint import diffusers_from_single_file

    folder = write_small_sdxl(tmp_path / "small-sdxl")
    path = write_single_file(folder, tmp_path / "small-sdxl.safetensors")
    out = diffusers_from_single_file(path, tmp_path / "conv")
    _same_weights(folder, out, ("unet", "vae", "text_encoder", "text_encoder_2"))
    unet = json.loads((out / "unet" / "config.json").read_text())
    assert unet["transformer_layers_per_block"] == [1, 2] and unet["addition_time_embed_dim"] == 8
    expected, got = _image(StableDiffusionXLPipeline, folder), _image(StableDiffusionXLPipeline, out)
    assert np.abs(expected - got).max() <= 1e-6


# --- refusals ----------------------------------------------------------------------------


def test_a_file_whose_shapes_the_configs_cannot_describe_is_refused_naming_checkpoint_config(model_dir, tmp_path):
    """The session's tiny SD has a 32-wide text encoder of 4 heads: its heads are not CLIP's
    64 channels, which shapes cannot tell otherwise, so it needs its own configs."""
    from edit_rt.export.compile.checkpoint import diffusers_from_single_file

    path = write_single_file(model_dir, tmp_path / "tiny.safetensors")
    with pytest.raises(ModelError) as refused:
        diffusers_from_single_file(path, tmp_path / "conv")
    text = _one_line(refused.value, str(path), "32 wide", "checkpoint_config:", "model_index.json")
    assert "set family" not in text
    assert not (tmp_path / "conv").exists() and not (tmp_path / "conv.partial").exists()


def test_diffusers_refusal_is_whole_on_one_line_with_the_right_hint(small_sd1, small_sd1_file, tmp_path):
    """What a new user met: a small SD 1.x with SD 1.5's configs. diffusers' reason comes whole
    (its first sentence, not cut mid-word), and the hint names checkpoint_config:; "set family:"
    only when the keys hold another family's parts too."""
    from edit_rt.export.compile.checkpoint import diffusers_from_single_file
    from edit_rt.export.compile.family_configs import config_folder

    sd15 = config_folder("sd1", tmp_path / "sd15-configs")
    with pytest.raises(ModelError) as refused:
        diffusers_from_single_file(small_sd1_file, tmp_path / "conv", config_dir=sd15)
    text = _one_line(refused.value, f"{small_sd1_file}: diffusers could not convert it as sd1", "checkpoint_config:")
    assert "set family" not in text
    reason = text[text.index("(") + 1 : text.rindex("); ")]
    assert reason.endswith(".") and "expected shape" in reason, reason  # a whole sentence
    mixed = write_single_file(small_sd1, tmp_path / "mixed.safetensors",
                              **{"conditioner.embedders.0.transformer.text_model.final_layer_norm.weight": torch.ones(64)})  # fmt: skip
    with pytest.raises(ModelError) as refused:
        diffusers_from_single_file(mixed, tmp_path / "conv", config_dir=sd15)
    _one_line(refused.value, "set family: sdxl", "checkpoint_config:")


def test_the_text_encoders_assumed_values_are_documented():
    """What shapes cannot tell of a CLIP text encoder is the shipped value, and the module says
    so: each family's activation and CLIP's head width are the ones the docstring names."""
    from edit_rt.export.compile import checkpoint_shapes
    from edit_rt.export.compile.family_configs import CONFIGS

    doc = " ".join(checkpoint_shapes.__doc__.split())
    for family, part, act in (("sd1", "text_encoder", "quick_gelu"), ("sd2", "text_encoder", "gelu"),
                              ("sdxl", "text_encoder", "quick_gelu"), ("sdxl", "text_encoder_2", "gelu")):  # fmt: skip
        config = json.loads((CONFIGS / family / part / "config.json").read_text())
        assert config["hidden_act"] == act and config["hidden_size"] // config["num_attention_heads"] == 64
    for needle in ("hidden_act", "quick_gelu for OpenAI CLIP, gelu for OpenCLIP", "layer_norm_eps", "64 channels per head",
                   "number of attention heads", "checkpoint_config:"):  # fmt: skip
        assert needle in doc, needle


# --- checkpoint_config: in a config file ------------------------------------------------------


def test_checkpoint_config_in_a_config_file_is_what_edit_rt_export_converts_with(model_dir, tmp_path, monkeypatch):
    """The session's tiny SD converts only with its own configs (its shapes do not say its
    heads): named by `checkpoint_config:` (relative to the config file, as every path in it),
    `edit-rt export` converts it to the folder's very weights. The ONNX export after the
    conversion is not this test's: it is skipped as current."""
    from typer.testing import CliRunner

    from edit_rt.export.compile import export_inputs
    from edit_rt.runtime.apps.cli import app

    write_single_file(model_dir, tmp_path / "tiny.safetensors")
    monkeypatch.setattr(export_inputs, "why_export", lambda *args: None)
    config = tmp_path / "configs" / "config.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump({"model": "../tiny.safetensors", "build_dir": "../build",
                                      "checkpoint_config": os.path.relpath(model_dir, config.parent),
                                      "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32}}))  # fmt: skip
    result = CliRunner().invoke(app, ["export", str(config)])
    assert result.exit_code == 0, result.output
    converted = tmp_path / "build" / "tiny" / "diffusers"
    _same_weights(model_dir, converted, ("unet", "vae", "text_encoder"))
    heads = lambda folder: json.loads((folder / "text_encoder" / "config.json").read_text())["num_attention_heads"]  # noqa: E731
    assert heads(converted) == heads(model_dir) == 4


def test_checkpoint_config_is_refused_where_it_cannot_apply(small_sd1_file, tmp_path):
    from edit_rt.runtime.config.load import config_from_dict
    from edit_rt.runtime.errors import ConfigError

    base = {"base": {"prompt": "x"}}
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"model": str(small_sd1_file), "checkpoint_config": str(tmp_path), **base})
    _one_line(refused.value, f"checkpoint_config: {tmp_path} has no model_index.json", "diffusers folder")
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"model": str(tmp_path), "checkpoint_config": str(tmp_path), **base})
    _one_line(refused.value, "is a folder", "remove checkpoint_config:")
    cfg = config_from_dict({"model": str(small_sd1_file), "checkpoint_config": str(tmp_path), **base})
    assert cfg.checkpoint_config == tmp_path
