"""Single-file checkpoints: the files A1111 / ComfyUI users hold, converted once into a diffusers
folder equal to the one they came from, the real CLIP tokenizer built offline, and every file
edit-rt cannot take refused in one line that names the fix.

The checkpoints are written by the test itself (tests/ldm_layout.py, after diffusers' own
diffusers-to-original scripts) from the session's tiny random models; the converter reads them
with diffusers' single-file loaders. The tokenizer is checked against open_clip's SimpleTokenizer
algorithm re-implemented here on the shipped vocabulary, and against ids written down.
"""

from __future__ import annotations

import gzip
import html
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file

from edit_rt.runtime.config.load import config_from_dict, load_config
from edit_rt.runtime.errors import ConfigError, ModelError
from edit_rt.runtime.model.single_file import STAMP, checkpoint_family, conversion_current, read_header

from .cli_in_process import Ran, edit_rt
from .ldm_layout import write_single_file

PARTS = ("unet", "vae", "text_encoder", "text_encoder_2")


@pytest.fixture(scope="module")
def sd_file(model_dir, tmp_path_factory) -> Path:
    return write_single_file(model_dir, tmp_path_factory.mktemp("files") / "tiny-sd.safetensors")


def _same_weights(original: Path, converted: Path) -> None:
    """Every tensor of every part equal (torch.equal), and the parts' configs equal."""
    for part in PARTS:
        if not (original / part).is_dir():
            assert not (converted / part).exists(), part
            continue
        a = load_file(str(next((original / part).glob("*.safetensors"))))
        b = load_file(str(next((converted / part).glob("*.safetensors"))))
        assert a.keys() == b.keys(), (part, set(a) ^ set(b))
        unequal = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
        assert not unequal, (part, unequal[:5])
        config = lambda folder: {k: v for k, v in json.loads((folder / part / "config.json").read_text()).items()
                                 if not k.startswith("_")}  # fmt: skip # noqa: E731
        assert config(original) == config(converted), part


def _image(pipeline_cls, folder: Path) -> np.ndarray:
    from edit_rt.export.compile.family import quiet

    quiet()
    pipe = pipeline_cls.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    out = pipe("a red circle", negative_prompt="blurry", num_inference_steps=3, guidance_scale=5.0, height=32,
               width=32, generator=torch.Generator().manual_seed(4), output_type="np")  # fmt: skip
    return out.images[0]


def test_an_sd1_single_file_converts_to_the_folder_it_came_from(sd_file, model_dir, tmp_path):
    from diffusers import StableDiffusionPipeline

    from edit_rt.export.compile.checkpoint import diffusers_from_single_file

    said: list[str] = []
    out = diffusers_from_single_file(sd_file, tmp_path / "tiny-sd" / "diffusers", config_dir=model_dir, say=said.append)
    assert checkpoint_family(sd_file) == "sd1"
    _same_weights(model_dir, out)
    assert (out / "tokenizer" / "tokenizer.json").is_file() and (out / "scheduler" / "scheduler_config.json").is_file()
    assert len(said) == 1 and said[0].startswith(f"converted {sd_file} -> {out} (sd1, ")
    assert np.array_equal(_image(StableDiffusionPipeline, model_dir), _image(StableDiffusionPipeline, out))
    stamp = json.loads((out / STAMP).read_text())
    assert stamp["family"] == "sd1" and stamp["size"] == sd_file.stat().st_size
    assert not (tmp_path / "tiny-sd" / "diffusers.partial").exists()


def test_an_sdxl_single_file_converts_to_the_folder_it_came_from(sdxl_dir, tmp_path):
    """Both text encoders (CLIP-L under conditioner.embedders.0.transformer, OpenCLIP with its
    projection under embedders.1.model) and the second tokenizer's "!" padding come back."""
    from diffusers import StableDiffusionXLPipeline

    from edit_rt.export.compile.checkpoint import diffusers_from_single_file

    path = write_single_file(sdxl_dir, tmp_path / "tiny-sdxl.safetensors")
    assert checkpoint_family(path) == "sdxl"
    out = diffusers_from_single_file(path, tmp_path / "conv", config_dir=sdxl_dir)
    _same_weights(sdxl_dir, out)
    assert json.loads((out / "tokenizer_2" / "tokenizer_config.json").read_text())["pad_token"] == "!"
    assert np.array_equal(_image(StableDiffusionXLPipeline, sdxl_dir), _image(StableDiffusionXLPipeline, out))


def test_an_sd2_single_file_needs_its_family_or_a_v_pred_key(sd2_dir, tmp_path):
    from edit_rt.export.compile.checkpoint import diffusers_from_single_file

    path = write_single_file(sd2_dir, tmp_path / "sd2.safetensors")
    with pytest.raises(ModelError) as refused:
        checkpoint_family(path)
    _one_line(refused.value, "SD 2.x checkpoint", "family: sd2-v", "family: sd2")
    out = diffusers_from_single_file(path, tmp_path / "conv", family="sd2-v", config_dir=sd2_dir)
    _same_weights(sd2_dir, out)
    marked = write_single_file(sd2_dir, tmp_path / "sd2v.safetensors", v_pred=torch.zeros(()))
    assert checkpoint_family(marked) == "sd2-v"


def test_a_conversion_is_done_once_and_again_when_the_file_changes(sd_file, model_dir, tmp_path):
    from edit_rt.export.compile.checkpoint import diffusers_from_single_file

    path = tmp_path / "m.safetensors"
    path.write_bytes(sd_file.read_bytes())
    out = diffusers_from_single_file(path, tmp_path / "m" / "diffusers", config_dir=model_dir)
    before = (out / STAMP).stat().st_mtime_ns
    said: list[str] = []
    assert diffusers_from_single_file(path, out, config_dir=model_dir, say=said.append) == out
    assert said == [] and (out / STAMP).stat().st_mtime_ns == before and conversion_current(path, out, "sd1", model_dir)
    assert not conversion_current(path, out, "sd1")  # converted with other configs than the shipped ones
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # touched: the same bytes
    assert diffusers_from_single_file(path, out, config_dir=model_dir, say=said.append) == out and said == []
    blob = sd_file.read_bytes()
    path.write_bytes(blob[:-4] + bytes(b ^ 0xFF for b in blob[-4:]))  # a new download of the name: other weights
    assert not conversion_current(path, out, config_dir=model_dir)
    diffusers_from_single_file(path, out, config_dir=model_dir, say=said.append)
    path.write_bytes(blob)  # and the first one again
    assert not conversion_current(path, out, config_dir=model_dir)
    diffusers_from_single_file(path, out, config_dir=model_dir, say=said.append)
    assert len(said) == 2 and conversion_current(path, out, "sd1", model_dir)
    assert not (tmp_path / "m" / "diffusers.old").exists() and not (tmp_path / "m" / "diffusers.partial").exists()
    _same_weights(model_dir, out)


def test_a_config_naming_a_file_puts_its_artifacts_under_the_stem(sd_file, tmp_path):
    cfg = config_from_dict({"model": str(sd_file), "build_dir": str(tmp_path / "build"), "base": {"prompt": "x"}})
    assert cfg.single_file and cfg.family == "sd1" and cfg.model_name == "tiny-sd"
    assert cfg.model_dir == tmp_path / "build" / "tiny-sd" / "diffusers"
    assert cfg.onnx_dir == tmp_path / "build" / "tiny-sd" / "onnx"
    folder = config_from_dict({"model": str(tmp_path), "base": {"prompt": "x"}})
    assert not folder.single_file and folder.model_dir == tmp_path and folder.model_name == tmp_path.name
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"model": str(tmp_path), "family": "sd1", "base": {"prompt": "x"}})
    _one_line(refused.value, "family: sd1", "is a folder", "remove family:")
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"model": str(sd_file), "family": "sd1.5", "base": {"prompt": "x"}})
    _one_line(refused.value, "family", "sd2-v")


def test_a_single_file_config_loads_without_torch(sd_file, tmp_path):
    code = ("import sys; from edit_rt.runtime.config.load import config_from_dict;"
            f"cfg = config_from_dict({{'model': {str(sd_file)!r}, 'base': {{'prompt': 'x'}}}}); assert cfg.family == 'sd1';"
            "bad = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]; assert not bad, bad")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _cli(tmp_path: Path, command: str, cfg: dict) -> Ran:
    """`edit-rt COMMAND config` in this process, as the console script runs it (tests/cli_in_process.py)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return edit_rt(command, str(path))


def _refused_by_cli(result: Ran, *needles: str) -> None:
    """Exit code 2 and one ``error:`` line, the last (progress lines may come before it)."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], result.stderr
    for needle in needles:
        assert needle in lines[-1], result.stderr


@pytest.mark.parametrize("command", ["run", "engines"])
def test_a_file_not_yet_converted_is_refused_naming_the_export(sd_file, tmp_path, command):
    cfg = {"model": str(sd_file), "build_dir": str(tmp_path / "build"), "base": {"prompt": "x", "steps": 4}}
    result = _cli(tmp_path, command, cfg)
    converted = tmp_path / "build" / "tiny-sd" / "diffusers"
    _refused_by_cli(result, f"model: {sd_file} is a single-file checkpoint not yet converted",
                    f"run `edit-rt export {tmp_path / 'config.yaml'}`", f"(converts it once into {converted})")


@pytest.mark.slow
def test_edit_rt_export_and_run_take_a_single_file(sd_file, model_dir, tmp_path):
    """`edit-rt export` on a config naming the file converts it (here beforehand, with the tiny
    model's configs, which the config names as checkpoint_config: its 32-wide text encoder is
    no CLIP width the shapes can describe) and exports the converted folder under
    build/<stem>/onnx; `edit-rt run` fingerprints that folder."""
    from edit_rt.export.compile.checkpoint import diffusers_from_single_file
    from edit_rt.runtime.engine.manifest import load_manifest, model_fingerprint

    path = tmp_path / "tiny-sd.safetensors"
    path.write_bytes(sd_file.read_bytes())
    cfg = {"model": str(path), "build_dir": str(tmp_path / "build"), "output_dir": str(tmp_path / "out"),
           "base": {"prompt": "a red circle", "steps": 4, "width": 32, "height": 32},
           "edits": [{"prompt": "a blue circle", "tail_steps": 2}], "checkpoint_config": str(model_dir)}  # fmt: skip
    converted = diffusers_from_single_file(path, tmp_path / "build" / "tiny-sd" / "diffusers", config_dir=model_dir)
    exported = _cli(tmp_path, "export", cfg)
    assert exported.returncode == 0, exported.stderr
    assert "converted" not in exported.stderr  # converted once, above
    manifest = load_manifest(tmp_path / "build" / "tiny-sd" / "onnx")
    assert manifest.fingerprint == model_fingerprint(converted)[0]
    ran = _cli(tmp_path, "run", cfg)
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "out" / "edit_00.png").is_file()
    blob = path.read_bytes()
    path.write_bytes(blob[:-4] + bytes(b ^ 0xFF for b in blob[-4:]))  # other weights under the same name
    _refused_by_cli(_cli(tmp_path, "run", cfg), "changed since it was converted", "edit-rt export")


# --- the real CLIP tokenizer ---------------------------------------------------------------

# Prompts and the ids CLIP's tokenizer gives them (open_clip's SimpleTokenizer, re-implemented
# below on the same vocabulary, gives these too): plain words, capitals and extra spaces,
# punctuation, a contraction, digits (one token each), a word BPE splits, non-ASCII letters.
CLIP_IDS = {
    "a photo of a cat": [49406, 320, 1125, 539, 320, 2368, 49407],
    "A  Red   CIRCLE on a blue background, top left": [49406, 320, 736, 7117, 525, 320, 1746, 5994, 267, 1253, 1823, 49407],
    "it's a dog's life!!": [49406, 585, 568, 320, 1929, 568, 970, 748, 49407],
    "4k photo, 1920x1080, f/2.8": [49406, 275, 330, 1125, 267, 272, 280, 273, 271, 343, 272, 271, 279, 271, 267, 325, 270,
                                   273, 269, 279, 49407],
    "photorealistic astronaut riding a horse on mars": [49406, 1153, 16157, 18376, 6765, 320, 4558, 525, 7496, 49407],
    "café crème brûlée": [49406, 15304, 1075, 12138, 614, 711, 127, 119, 75, 13489, 49407],
    "(masterpiece:1.2), best quality, ultra-detailed": [49406, 263, 12066, 281, 272, 269, 273, 2361, 949, 3027, 267, 8118,
                                                        268, 12609, 49407],
    "a cyberpunk city at night, neon lights": [49406, 320, 36896, 1305, 536, 930, 267, 13919, 3073, 49407],
}  # fmt: skip


def _reference_ids(text: str, vocab_path: Path) -> list[int]:
    """open_clip's SimpleTokenizer (tokenizer.py, open-clip-torch 3.3.0) on ``text``: the same
    byte table, merges, regex and BPE loop; basic_clean without ftfy (the prompts are clean)."""
    import regex

    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    byte_encoder = dict(zip(bs, [chr(c) for c in cs]))
    merges = gzip.open(vocab_path).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    merges = [tuple(m.split()) for m in merges]
    vocab = list(byte_encoder.values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    encoder = {t: i for i, t in enumerate(vocab)}
    ranks = {m: i for i, m in enumerate(merges)}

    def bpe(token: str) -> list[str]:
        word = tuple(token[:-1]) + (token[-1] + "</w>",)
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:])}
            first, second = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if (first, second) not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        return list(word)

    text = " ".join(html.unescape(html.unescape(text)).strip().split()).lower()
    pattern = regex.compile(r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
                            regex.IGNORECASE)  # fmt: skip
    ids = [encoder["<|startoftext|>"]]
    for token in pattern.findall(text):
        ids += [encoder[t] for t in bpe("".join(byte_encoder[b] for b in token.encode("utf-8")))]
    return ids + [encoder["<|endoftext|>"]]


@pytest.fixture(scope="module")
def clip_tokenizer(tmp_path_factory):
    from transformers import CLIPTokenizer

    from edit_rt.export.compile.family_configs import clip_tokenizer_files

    return CLIPTokenizer.from_pretrained(str(clip_tokenizer_files(tmp_path_factory.mktemp("tok") / "tokenizer")))


@pytest.mark.parametrize("prompt", list(CLIP_IDS))
def test_the_shipped_vocabulary_gives_clip_ids(clip_tokenizer, prompt):
    from edit_rt.export.compile.family_configs import VOCAB

    assert _reference_ids(prompt, VOCAB) == CLIP_IDS[prompt]
    assert clip_tokenizer(prompt).input_ids == CLIP_IDS[prompt]


def test_the_tokenizer_files_are_clips(clip_tokenizer, tmp_path):
    from tokenizers import Tokenizer
    from transformers import CLIPTokenizer

    from edit_rt.export.compile.family_configs import clip_tokenizer_files

    folder = Path(clip_tokenizer.name_or_path)
    vocab = json.loads((folder / "vocab.json").read_text())
    assert len(vocab) == 49408 and vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407
    assert len((folder / "merges.txt").read_text().splitlines()) == 1 + 48894
    ids = clip_tokenizer("a photo of a cat", padding="max_length", max_length=77).input_ids
    assert len(ids) == 77 and ids[7:] == [49407] * 70  # SD 1.x pads with the end token
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))  # what the runtime loads
    assert raw.encode("a photo of a cat").ids == CLIP_IDS["a photo of a cat"]
    bang = CLIPTokenizer.from_pretrained(str(clip_tokenizer_files(tmp_path / "tokenizer_2", pad_token="!")))
    assert bang("a photo of a cat", padding="max_length", max_length=77).input_ids[7:] == [0] * 70  # SDXL's second


# --- refusals --------------------------------------------------------------------------------


def _one_line(err: BaseException, *needles: str) -> None:
    text = str(err)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text


def _header_file(path: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    """A safetensors file with these tensor names and shapes (zeros; only the header is read)."""
    save_numpy({k: np.zeros(s, dtype=np.float16) for k, s in shapes.items()}, str(path))
    return path


_UNET = {"model.diffusion_model.input_blocks.0.0.weight": (8, 4, 3, 3), "model.diffusion_model.out.2.weight": (4, 8, 3, 3)}
_VAE = {"first_stage_model.encoder.conv_in.weight": (8, 3, 3, 3)}
_SD1_TEXT = {"cond_stage_model.transformer.text_model.final_layer_norm.weight": (8,)}
_SD2_TEXT = {"cond_stage_model.model.ln_final.weight": (8,)}
_XL_TEXT = {"conditioner.embedders.0.transformer.text_model.final_layer_norm.weight": (8,),
            "conditioner.embedders.1.model.ln_final.weight": (8,)}  # fmt: skip

REFUSED = {  # name: (tensors, needles of the one line)
    "kohya LoRA": ({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": (4, 8), "lora_unet_x.alpha": ()},
                   ["is a LoRA", "lora_unet_", "adapters:"]),
    "peft LoRA": ({"unet.down_blocks.0.attentions.0.to_q.lora_A.weight": (4, 8)}, ["is a LoRA", "adapters:"]),
    "inpainting": ({**_UNET, "model.diffusion_model.input_blocks.0.0.weight": (8, 9, 3, 3), **_VAE, **_SD1_TEXT},
                   ["inpainting checkpoint", "9 channels", "non-inpainting"]),
    "instruct-pix2pix": ({**_UNET, "model.diffusion_model.input_blocks.0.0.weight": (8, 8, 3, 3), **_VAE, **_SD1_TEXT},
                         ["InstructPix2Pix", "8 channels"]),
    "VAE alone (ldm)": ({**_VAE, "first_stage_model.decoder.conv_out.weight": (3, 8, 3, 3)}, ["VAE alone", "full checkpoint"]),
    "VAE alone (diffusers)": ({"encoder.conv_in.weight": (8, 3, 3, 3), "decoder.conv_out.weight": (3, 8, 3, 3)},
                              ["VAE alone", "full checkpoint"]),
    "text encoder alone": ({**_SD1_TEXT}, ["text encoder alone", "full checkpoint"]),
    "UNet without VAE": ({**_UNET, **_SD1_TEXT}, ["no VAE", "full checkpoint"]),
    "UNet and VAE, no text encoder": ({**_UNET, **_VAE}, ["no text encoder", "full checkpoint"]),
    "a diffusers UNet file": ({"conv_in.weight": (8, 4, 3, 3), "down_blocks.0.resnets.0.conv1.weight": (8, 8, 3, 3)},
                              ["diffusers component", "model_index.json"]),
    "SDXL refiner": ({**_UNET, **_VAE, "conditioner.embedders.0.model.ln_final.weight": (8,)}, ["SDXL refiner", "base"]),
    "SD 2.x without family": ({**_UNET, **_VAE, **_SD2_TEXT}, ["SD 2.x", "family: sd2-v", "family: sd2"]),
    "SDXL v-prediction": ({**_UNET, **_VAE, **_XL_TEXT, "v_pred": ()}, ["SDXL v-prediction", "epsilon"]),
    "textual inversion": ({"emb_params": (2, 8)}, ["textual-inversion embedding"]),
    "something else": ({"weight": (2, 2)}, ["not a Stable Diffusion checkpoint", "SD 1.x, SD 2.x or SDXL"]),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_file_edit_rt_cannot_take_is_refused_in_one_line(tmp_path, name):
    tensors, needles = REFUSED[name]
    path = _header_file(tmp_path / "model.safetensors", tensors)
    with pytest.raises(ModelError) as refused:
        checkpoint_family(path)
    _one_line(refused.value, str(path), *needles)
    with pytest.raises(ConfigError) as in_config:  # the same line, named by the config's field
        config_from_dict({"model": str(path), "base": {"prompt": "x"}})
    _one_line(in_config.value, f"model: {path}", *needles)


def test_a_family_the_keys_contradict_is_refused(tmp_path):
    path = _header_file(tmp_path / "xl.safetensors", {**_UNET, **_VAE, **_XL_TEXT})
    assert checkpoint_family(path) == "sdxl" and checkpoint_family(path, "sdxl") == "sdxl"
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"model": str(path), "family": "sd1", "base": {"prompt": "x"}})
    _one_line(refused.value, "family: sd1", "SDXL checkpoint", "set family: sdxl")
    sd2 = _header_file(tmp_path / "sd2.safetensors", {**_UNET, **_VAE, **_SD2_TEXT})
    assert config_from_dict({"model": str(sd2), "family": "sd2", "base": {"prompt": "x"}}).family == "sd2"


@pytest.mark.parametrize("content,needles", [
    (b"\x00" * 4, ["not a safetensors file"]),
    ((10**9).to_bytes(8, "little") + b"{}", ["not a safetensors file"]),
    ((12).to_bytes(8, "little") + b"{not json!!}", ["not a safetensors file"]),
    (b"<!DOCTYPE html><html>rate limited</html>", ["not a safetensors file", "download"]),
])  # fmt: skip
def test_a_file_that_is_not_safetensors_is_refused(tmp_path, content, needles):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(ModelError) as refused:
        read_header(path)
    _one_line(refused.value, str(path), *needles)


def test_a_pickle_checkpoint_is_refused_and_converted_weights_only(tmp_path):
    from edit_rt.export.compile.checkpoint import main, safetensors_from_pickle

    tensors = {"model.diffusion_model.out.2.weight": torch.randn(4, 8, 3, 3), "first_stage_model.x": torch.randn(3)}
    ckpt = tmp_path / "model.ckpt"
    torch.save({"state_dict": tensors, "global_step": 470000}, ckpt)
    with pytest.raises(ModelError) as refused:
        read_header(ckpt)
    _one_line(refused.value, "pickle checkpoint", "runs whatever code", f"python -m edit_rt.export.compile.checkpoint {ckpt}")
    result = _cli(tmp_path, "export", {"model": str(ckpt), "base": {"prompt": "x"}})
    _refused_by_cli(result, "model: ", "pickle checkpoint", "python -m edit_rt.export.compile.checkpoint")
    assert main([str(ckpt)]) == 0
    back = load_file(str(tmp_path / "model.safetensors"))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())

    class Payload:  # a pickle that needs code to load (what weights_only refuses to run)
        def __reduce__(self):
            return (print, ("this would run",))

    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": tensors, "callback": Payload()}, evil)
    with pytest.raises(ModelError) as unsafe:
        safetensors_from_pickle(evil)
    _one_line(unsafe.value, "weights-only loading refused it")
    assert not (tmp_path / "evil.safetensors").exists()


def test_a_folder_without_model_index_is_refused_naming_the_fix(tmp_path, sd_file):
    from edit_rt.runtime.engine.manifest import model_files

    with pytest.raises(ModelError) as refused:
        model_files(tmp_path)
    _one_line(refused.value, "lacks model_index.json", "point model: at a diffusers folder", "single-file")
    (tmp_path / "dreamshaper_8.safetensors").write_bytes(sd_file.read_bytes())
    with pytest.raises(ModelError) as refused:
        model_files(tmp_path)
    _one_line(refused.value, "it holds dreamshaper_8.safetensors", "set model: to that single-file checkpoint")


def test_a_missing_file_is_refused_at_load(tmp_path):
    (tmp_path / "c.yaml").write_text("model: nope.safetensors\nbase: {prompt: x}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(tmp_path / "c.yaml")
    _one_line(refused.value, "c.yaml: model: ", "nope.safetensors not found; fix the path")
