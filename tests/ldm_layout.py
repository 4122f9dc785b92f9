"""A diffusers folder written as one single-file checkpoint in the original ("ldm") key layout.

The tests' own writer of the files A1111, ComfyUI and civitai hold, independent of the converter
under test (export/compile/checkpoint.py, which reads them with diffusers' loaders). It follows diffusers'
scripts/convert_diffusers_to_original_stable_diffusion.py and convert_diffusers_to_original_sdxl.py,
with two differences: the block layout those scripts hard-code for the real sizes (4 or 3 levels,
2 resnets each, attention at fixed levels) is read from the model's config, so the tiny models
convert too; and each key is renamed by its one matching prefix instead of a chain of substring
replacements, and a key no rule covers is an error rather than passed through.

    ldm_state_dict(model_dir) -> {name: tensor}       write_single_file(model_dir, path) -> path
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_UNET_TOP = {  # (diffusers, ldm) of the UNet's keys outside its blocks
    "time_embedding.linear_1.": "time_embed.0.", "time_embedding.linear_2.": "time_embed.2.",
    "conv_in.": "input_blocks.0.0.", "conv_norm_out.": "out.0.", "conv_out.": "out.2.",
    "add_embedding.linear_1.": "label_emb.0.0.", "add_embedding.linear_2.": "label_emb.0.2.",  # SDXL
}  # fmt: skip
_UNET_RESNET = {"norm1.": "in_layers.0.", "conv1.": "in_layers.2.", "time_emb_proj.": "emb_layers.1.",
                "norm2.": "out_layers.0.", "conv2.": "out_layers.3.", "conv_shortcut.": "skip_connection."}  # fmt: skip
_VAE_ATTENTION = {"group_norm.": "norm.", "to_q.": "q.", "to_k.": "k.", "to_v.": "v.", "to_out.0.": "proj_out."}
_OPENCLIP = {"layer_norm1.": "ln_1.", "layer_norm2.": "ln_2.", "mlp.fc1.": "mlp.c_fc.", "mlp.fc2.": "mlp.c_proj.",
             "self_attn.out_proj.": "attn.out_proj."}  # fmt: skip


def _rename(state: dict, rules: list[tuple[str, str]], inner: dict[str, dict[str, str]], what: str) -> dict:
    """Each key renamed by the longest diffusers prefix in ``rules``; the rest of the key by
    ``inner[kind]`` when the prefix is of that kind (resnets, attentions)."""
    rules = sorted(rules, key=lambda r: -len(r[0]))
    out = {}
    for key, value in state.items():
        match = next(((hf, sd) for hf, sd in rules if key.startswith(hf)), None)
        if match is None:
            raise KeyError(f"{what}: no ldm name for {key}")
        hf, sd = match
        rest = key[len(hf):]
        for kind, table in inner.items():
            if f".{kind}." in hf:
                for old, new in table.items():
                    if rest.startswith(old):
                        rest = new + rest[len(old):]
                        break
        out[sd + rest] = value
    return out


def unet_to_ldm(state: dict, config: dict) -> dict:
    """A diffusers UNet2DConditionModel state dict under ldm's ``input_blocks``/``middle_block``/
    ``output_blocks`` names (openaimodel.UNetModel): per level ``layers_per_block`` (resnet,
    attention) input blocks then a downsampler; per up level one more; the upsampler after the
    last, at index 2 where the level has attention, else 1."""
    n, per = len(config["block_out_channels"]), config["layers_per_block"]
    down_attn = [t.startswith("CrossAttn") for t in config["down_block_types"]]
    up_attn = [t.startswith("CrossAttn") for t in config["up_block_types"]]
    rules = list(_UNET_TOP.items())
    for i in range(n):
        for j in range(per):
            k = i * (per + 1) + j + 1
            rules.append((f"down_blocks.{i}.resnets.{j}.", f"input_blocks.{k}.0."))
            if down_attn[i]:
                rules.append((f"down_blocks.{i}.attentions.{j}.", f"input_blocks.{k}.1."))
        if i < n - 1:
            rules.append((f"down_blocks.{i}.downsamplers.0.conv.", f"input_blocks.{(i + 1) * (per + 1)}.0.op."))
        for j in range(per + 1):
            k = i * (per + 1) + j
            rules.append((f"up_blocks.{i}.resnets.{j}.", f"output_blocks.{k}.0."))
            if up_attn[i]:
                rules.append((f"up_blocks.{i}.attentions.{j}.", f"output_blocks.{k}.1."))
        if i < n - 1:
            rules.append((f"up_blocks.{i}.upsamplers.0.", f"output_blocks.{i * (per + 1) + per}.{2 if up_attn[i] else 1}."))
    rules += [("mid_block.resnets.0.", "middle_block.0."), ("mid_block.attentions.0.", "middle_block.1."),
              ("mid_block.resnets.1.", "middle_block.2.")]  # fmt: skip
    return _rename(state, rules, {"resnets": _UNET_RESNET}, "unet")


def vae_to_ldm(state: dict, config: dict) -> dict:
    """A diffusers AutoencoderKL state dict under ldm's Encoder/Decoder names (up levels numbered
    from the lowest resolution, the mid attention's linear weights as 1x1 convolutions)."""
    n = len(config["block_out_channels"])
    per = config.get("layers_per_block", 1)
    rules = [(p, p) for p in ("encoder.conv_in.", "encoder.conv_out.", "decoder.conv_in.", "decoder.conv_out.",
                              "quant_conv.", "post_quant_conv.")]  # fmt: skip
    rules += [("encoder.conv_norm_out.", "encoder.norm_out."), ("decoder.conv_norm_out.", "decoder.norm_out.")]
    for part in ("encoder", "decoder"):
        rules += [(f"{part}.mid_block.resnets.0.", f"{part}.mid.block_1."), (f"{part}.mid_block.resnets.1.", f"{part}.mid.block_2."),
                  (f"{part}.mid_block.attentions.0.", f"{part}.mid.attn_1.")]  # fmt: skip
    for i in range(n):
        for j in range(per):
            rules.append((f"encoder.down_blocks.{i}.resnets.{j}.", f"encoder.down.{i}.block.{j}."))
        for j in range(per + 1):
            rules.append((f"decoder.up_blocks.{i}.resnets.{j}.", f"decoder.up.{n - 1 - i}.block.{j}."))
        if i < n - 1:
            rules.append((f"encoder.down_blocks.{i}.downsamplers.0.", f"encoder.down.{i}.downsample."))
            rules.append((f"decoder.up_blocks.{i}.upsamplers.0.", f"decoder.up.{n - 1 - i}.upsample."))
    out = _rename(state, rules, {"resnets": {"conv_shortcut.": "nin_shortcut."}, "attentions": _VAE_ATTENTION}, "vae")
    for key, value in out.items():
        if ".mid.attn_1." in key and key.endswith(".weight") and value.ndim == 2 and not key.endswith("norm.weight"):
            out[key] = value.reshape(*value.shape, 1, 1)  # ldm's attention projections are 1x1 convs
    return out


def clip_to_ldm(state: dict, prefix: str) -> dict:
    """OpenAI CLIP (SD 1.x, SDXL's first encoder) keeps transformers' names under ``prefix``
    (transformers >= 5.6 saves CLIPTextModel without its ``text_model.`` level: put it back)."""
    out = {prefix + (k if k.startswith("text_model.") else "text_model." + k): v for k, v in state.items()}
    out[prefix + "text_model.embeddings.position_ids"] = torch.arange(77, dtype=torch.int64)[None]  # as A1111 saves it
    return out


def open_clip_to_ldm(state: dict, prefix: str) -> dict:
    """An OpenCLIP text tower (SD 2.x; SDXL's second, with its projection) under open_clip's names:
    ``transformer.resblocks.i`` with q, k, v fused into ``attn.in_proj_*``, ``text_projection`` as
    the (width, projection) matrix open_clip multiplies by."""
    state = {k.removeprefix("text_model."): v for k, v in state.items()}
    out, qkv = {}, {}
    for key, value in state.items():
        if key.startswith("encoder.layers."):
            i, rest = key.removeprefix("encoder.layers.").split(".", 1)
            base = f"{prefix}transformer.resblocks.{i}."
            if rest.startswith("self_attn.") and rest.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
                _, proj, kind = rest.split(".")
                qkv.setdefault((base, kind), {})[proj] = value
                continue
            for old, new in _OPENCLIP.items():
                if rest.startswith(old):
                    rest = new + rest[len(old):]
                    break
            else:
                raise KeyError(f"open_clip: no ldm name for {key}")
            out[base + rest] = value
        elif key == "embeddings.token_embedding.weight":
            out[prefix + "token_embedding.weight"] = value
        elif key == "embeddings.position_embedding.weight":
            out[prefix + "positional_embedding"] = value
        elif key.startswith("final_layer_norm."):
            out[prefix + "ln_final." + key.split(".")[-1]] = value
        elif key == "text_projection.weight":
            out[prefix + "text_projection"] = value.T.contiguous()
        elif key != "embeddings.position_ids":
            raise KeyError(f"open_clip: no ldm name for {key}")
    for (base, kind), parts in qkv.items():
        out[f"{base}attn.in_proj_{kind}"] = torch.cat([parts["q_proj"], parts["k_proj"], parts["v_proj"]])
    return out


def _weights(folder: Path) -> dict:
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise FileNotFoundError(f"{folder}: expected one .safetensors file, found {[f.name for f in files]}")
    return load_file(str(files[0]))


def ldm_state_dict(model_dir: Path) -> dict:
    """The whole diffusers folder ``model_dir`` (SD 1.x, SD 2.x or SDXL) as one ldm state dict."""
    model_dir = Path(model_dir)
    config = lambda part: json.loads((model_dir / part / "config.json").read_text())  # noqa: E731
    state = {"model.diffusion_model." + k: v for k, v in unet_to_ldm(_weights(model_dir / "unet"), config("unet")).items()}
    state.update({"first_stage_model." + k: v for k, v in vae_to_ldm(_weights(model_dir / "vae"), config("vae")).items()})
    text = _weights(model_dir / "text_encoder")
    if (model_dir / "text_encoder_2").is_dir():  # SDXL: CLIP-L, then OpenCLIP bigG
        state.update(clip_to_ldm(text, "conditioner.embedders.0.transformer."))
        state.update(open_clip_to_ldm(_weights(model_dir / "text_encoder_2"), "conditioner.embedders.1.model."))
    elif config("text_encoder").get("hidden_act") == "gelu":  # SD 2.x: OpenCLIP ViT-H (GELU, not quick_gelu)
        state.update(open_clip_to_ldm(text, "cond_stage_model.model."))
    else:
        state.update(clip_to_ldm(text, "cond_stage_model.transformer."))
    return state


def write_single_file(model_dir: Path, path: Path, dtype: torch.dtype | None = None, **extra: torch.Tensor) -> Path:
    """``model_dir`` saved as the single-file checkpoint ``path`` (``dtype``: cast floating
    weights, as fp16 downloads are; ``extra``: more tensors, e.g. a ``v_pred`` marker)."""
    state = ldm_state_dict(model_dir)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    state.update(extra)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return Path(path)
