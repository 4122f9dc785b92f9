"""Single-file checkpoints: what a ``.safetensors`` file users hold is, read from its header alone.

A1111, Forge, ComfyUI and civitai keep Stable Diffusion as one file in the original ("ldm") key
layout: ``model.diffusion_model.*`` (the UNet), ``first_stage_model.*`` (the VAE) and the text
encoders as ``cond_stage_model.transformer.*`` (SD 1.x, OpenAI CLIP), ``cond_stage_model.model.*``
(SD 2.x, OpenCLIP ViT-H) or ``conditioner.embedders.0/1.*`` (SDXL's two). `edit-rt export`
converts such a file once into a diffusers folder (export/compile/checkpoint.py); this module is the part
the runtime needs too, so it reads only the safetensors header (an 8-byte length, then JSON: names,
dtypes, shapes) with no torch: which family the file is, every refusal in one line (a pickle, a
LoRA, an inpainting UNet, a VAE alone, ...), and whether the converted folder still matches the
file (its size, mtime and the header's sha256, recorded in ``single_file.json`` in the folder).

SD 2.x's 768-v (v-prediction) and 512-base (epsilon) checkpoints have the same keys and shapes, so
an SD 2.x file without a ``v_pred`` key is refused until ``family:`` says which it is: a wrong
guess would give noise-like images with no error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import ModelError

log = logging.getLogger(__name__)

FAMILIES = ("sd1", "sd2", "sd2-v", "sdxl")
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
STAMP = "single_file.json"  # in the converted folder: the source it was converted from
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header

_UNET = "model.diffusion_model."
_VAE = "first_stage_model."
_CLIP_SD1 = "cond_stage_model.transformer."
_OPENCLIP_SD2 = "cond_stage_model.model."
_CLIP_XL = "conditioner.embedders.0.transformer."
_OPENCLIP_XL = "conditioner.embedders.1.model."
_REFINER = "conditioner.embedders.0.model."
_NAMES = {"sd1": "SD 1.x", "sd2": "SD 2.x", "sdxl": "SDXL"}
# A UNet whose conv_in takes more than the 4 latent channels is another task's model.
_IN_CHANNELS = {9: "an inpainting checkpoint (its UNet's conv_in takes 9 channels: latent, mask, masked image)",
                8: "an InstructPix2Pix checkpoint (its UNet's conv_in takes 8 channels: latent and image)",
                5: "a depth-to-image checkpoint (its UNet's conv_in takes 5 channels: latent and depth)",
                7: "an x4 upscaler checkpoint (its UNet's conv_in takes 7 channels)"}  # fmt: skip
_LORA_MARKS = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_")
_LORA_PARTS = (".lora_down.", ".lora_up.", ".lora_A.", ".lora_B.", ".lora.down.", ".lora.up.", ".hada_w1_a", ".lokr_w1")


def is_single_file(model: Path) -> bool:
    """Whether ``model:`` names a file (one that exists, or a checkpoint's name) rather than a folder."""
    model = Path(model)
    return model.is_file() or (not model.is_dir() and model.suffix.lower() in SAFETENSORS_SUFFIXES + PICKLE_SUFFIXES)


@dataclass(frozen=True)
class Header:
    """A safetensors file's header: every tensor's dtype and shape, the metadata, the bytes' sha256."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    metadata: dict[str, str]
    sha256: str

    def shape(self, name: str) -> Optional[tuple[int, ...]]:
        entry = self.tensors.get(name)
        return None if entry is None else entry[1]

    def any_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.tensors)


def read_header(path: Path) -> Header:
    """The header of the safetensors file ``path``; anything else is refused in one line."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path} not found; fix the path")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = path.stat().st_size
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if 2 <= n <= min(_MAX_HEADER, size - 8):
                raw = f.read(n)
            else:
                raw = b""
    except OSError as err:
        raise ModelError(f"{path}: cannot be read ({err.strerror})") from None
    data = None
    if raw:
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            data = None
    if not isinstance(data, dict):
        raise _not_safetensors(path, head)
    metadata = data.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in data.items():
        if not (isinstance(entry, dict) and "dtype" in entry and isinstance(entry.get("shape"), list)):
            raise ModelError(f"{path}: its safetensors header is malformed at {name!r}; the file is damaged, "
                             "download or export it again")  # fmt: skip
        tensors[name] = (str(entry["dtype"]), tuple(int(v) for v in entry["shape"]))
    return Header(tensors, metadata if isinstance(metadata, dict) else {}, hashlib.sha256(head + raw).hexdigest())


def _not_safetensors(path: Path, head: bytes) -> ModelError:
    """A file without a safetensors header: a pickle checkpoint, or something else."""
    pickled = head[:2] == b"PK" or head[:1] == b"\x80" or path.suffix.lower() in PICKLE_SUFFIXES
    if pickled:
        return ModelError(
            f"{path} is a pickle checkpoint ({path.suffix or 'no suffix'}), and loading a pickle runs whatever code "
            f"it holds; convert it once to safetensors (weights only, no code runs): python -m edit_rt.export.compile.checkpoint "
            f"{path}, then set model: to the .safetensors file it writes"
        )  # fmt: skip
    return ModelError(f"{path} is not a safetensors file (no valid header: the first 8 bytes give no JSON length); "
                      "give a .safetensors checkpoint (an interrupted download leaves such a file: fetch it again)")  # fmt: skip


def checkpoint_family(path: Path, family: Optional[str] = None, header: Optional[Header] = None) -> str:
    """The family (sd1, sd2, sd2-v, sdxl) of the single-file checkpoint ``path``: ``family`` when
    given and consistent with the file's keys, else detected from them; every file edit-rt cannot
    convert is refused in one line that says what it is and what to do instead."""
    path = Path(path)
    h = header or read_header(path)
    found = _detected(path, h)
    if found == "sdxl" and "v_pred" in h.tensors:
        raise ModelError(f"{path} is an SDXL v-prediction checkpoint (it has a v_pred key); edit-rt converts SDXL "
                         "with the epsilon base model's scheduler, so it would sample it wrongly: use an epsilon SDXL checkpoint")  # fmt: skip
    if family is not None:
        if family not in FAMILIES:
            raise ModelError(f"family: {family!r} is not one of {', '.join(FAMILIES)}")
        if family.split("-")[0] != found:
            raise ModelError(f"family: {family}, but {path} is an {_NAMES[found]} checkpoint ({_evidence(found)}); "
                             f"set family: {found if found != 'sd2' else 'sd2 or sd2-v'}, or remove family: to detect it")  # fmt: skip
        return family
    if found == "sd2":
        if "v_pred" in h.tensors:
            return "sd2-v"
        raise ModelError(f"{path} is an SD 2.x checkpoint (an OpenCLIP text encoder), and its keys do not say whether "
                         "it predicts v (768-v: SD 2.0-v, 2.1) or noise (512-base); set family: sd2-v for the 768 "
                         "models or family: sd2 for the 512-base ones")  # fmt: skip
    return found


def _evidence(family: str) -> str:
    return {"sd1": f"{_CLIP_SD1}*", "sd2": f"{_OPENCLIP_SD2}*", "sdxl": "conditioner.embedders.*"}[family]


def _detected(path: Path, h: Header) -> str:
    """sd1, sd2 (either kind) or sdxl from the key layout; a one-line ModelError for the rest."""
    keys = h.tensors
    lora = [k for k in keys if k.startswith(_LORA_MARKS) or any(p in k for p in _LORA_PARTS)]
    if lora:
        raise ModelError(f"{path} is a LoRA ({len(lora)} keys like {lora[0]}), not a model; set model: to the "
                         f"checkpoint it was trained for and put the LoRA under adapters: (adapters: {{name: {path}}})")  # fmt: skip
    if "emb_params" in keys or h.any_prefix("string_to_param") or (keys and set(keys) <= {"clip_l", "clip_g"}):
        raise ModelError(f"{path} is a textual-inversion embedding, not a model; edit-rt does not load embeddings: "
                         "set model: to a full checkpoint")  # fmt: skip
    if not h.any_prefix(_UNET):
        raise ModelError(_what_else(path, h))
    if h.any_prefix("control_model."):
        raise ModelError(f"{path} is a ControlNet checkpoint (control_model.*); edit-rt runs text-to-image models: "
                         "set model: to a Stable Diffusion checkpoint")  # fmt: skip
    conv_in = h.shape(_UNET + "input_blocks.0.0.weight")
    if conv_in is not None and len(conv_in) == 4 and conv_in[1] != 4:
        what = _IN_CHANNELS.get(conv_in[1], f"a checkpoint whose UNet's conv_in takes {conv_in[1]} channels, not 4")
        raise ModelError(f"{path} is {what}; edit-rt edits text-to-image models with 4 latent channels: use the "
                         "base (non-inpainting) checkpoint of that model")  # fmt: skip
    if h.any_prefix(_REFINER) and not h.any_prefix(_OPENCLIP_XL):
        raise ModelError(f"{path} is the SDXL refiner (one OpenCLIP encoder, {_REFINER}*, aesthetic-score "
                         "conditioning); edit-rt runs the SDXL base model: set model: to an SDXL base checkpoint")  # fmt: skip
    if not h.any_prefix(_VAE):
        raise ModelError(f"{path} holds a UNet but no VAE ({_VAE}* keys); use the full checkpoint (UNet, VAE "
                         "and text encoder in one file), e.g. the non-'no-VAE' download of that model")  # fmt: skip
    if h.any_prefix(_CLIP_XL) and h.any_prefix(_OPENCLIP_XL):
        return "sdxl"
    if h.any_prefix(_OPENCLIP_SD2):
        return "sd2"
    if h.any_prefix(_CLIP_SD1):
        return "sd1"
    raise ModelError(f"{path} holds a UNet and a VAE but no text encoder ({_CLIP_SD1}*, {_OPENCLIP_SD2}* or "
                     "conditioner.embedders.*); use the full checkpoint of that model")  # fmt: skip


def _what_else(path: Path, h: Header) -> str:
    """The refusal of a file without an ldm UNet: what its keys say it is."""
    keys = h.tensors
    if h.any_prefix(_VAE) or ("encoder.conv_in.weight" in keys and "decoder.conv_out.weight" in keys):
        return (f"{path} is a VAE alone (no {_UNET}* keys); edit-rt takes the VAE from the checkpoint itself: "
                "set model: to a full checkpoint (UNet, VAE, text encoder)")
    if any(k.startswith(("cond_stage_model.", "conditioner.", "text_model.", "encoder.layers.", "transformer.resblocks."))
           for k in keys):  # fmt: skip
        return (f"{path} is a text encoder alone (no {_UNET}* keys); set model: to a full checkpoint "
                "(UNet, VAE, text encoder)")
    if "conv_in.weight" in keys and h.any_prefix("down_blocks."):
        return (f"{path} is one diffusers component's weights (a UNet's diffusion_pytorch_model.safetensors), not a "
                "checkpoint; set model: to the diffusers folder that holds it (the one with model_index.json)")
    if any(k.startswith(("joint_blocks.", "double_blocks.", "model.diffusion_model.joint_blocks.")) for k in keys):
        return f"{path} is a flow-matching transformer (SD3 / Flux keys), no UNet; edit-rt runs SD 1.x, SD 2.x and SDXL"
    prefixes = sorted({k.split(".")[0] for k in keys})[:4]
    return (f"{path} is not a Stable Diffusion checkpoint: none of its {len(keys)} keys is {_UNET}* (they start with "
            f"{', '.join(prefixes) or 'nothing'}); give an SD 1.x, SD 2.x or SDXL .safetensors checkpoint")


def source_stamp(path: Path, header: Optional[Header] = None) -> dict:
    """What identifies the bytes of ``path`` cheaply: size, mtime and the header's sha256 (the
    header lists every tensor's byte range, so other weights of the same layout change only the
    mtime; a copy with the mtime kept is the same file)."""
    st = Path(path).stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": (header or read_header(path)).sha256}


def read_stamp(model_dir: Path) -> Optional[dict]:
    try:
        data = json.loads((Path(model_dir) / STAMP).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def conversion_current(path: Path, model_dir: Path, family: Optional[str] = None) -> bool:
    """Whether ``model_dir`` holds the conversion of the file ``path`` as it is now (and, when
    given, as ``family``)."""
    stamp = read_stamp(model_dir)
    if stamp is None or not (Path(model_dir) / "model_index.json").is_file():
        return False
    now = source_stamp(path)
    same = all(stamp.get(k) == v for k, v in now.items())
    return same and (family is None or stamp.get("family") == family)


def require_converted(path: Path, model_dir: Path, family: Optional[str], config: str = "CONFIG") -> Path:
    """``model_dir`` when it holds the current conversion of ``path``; otherwise the one-line
    refusal that names the command converting it (the runtime has no torch to convert with)."""
    if not (Path(model_dir) / STAMP).is_file():
        raise ModelError(f"model: {path} is a single-file checkpoint not yet converted; run `edit-rt export {config}` "
                         f"(converts it once into {model_dir})")  # fmt: skip
    if Path(path).is_file() and not conversion_current(path, model_dir, family):
        stamp = read_stamp(model_dir) or {}
        what = f"was converted as {stamp.get('family')}, and family: is {family}" if (
            family is not None and stamp.get("family") not in (None, family)) else "changed since it was converted"
        raise ModelError(f"model: {path} {what} into {model_dir}; run `edit-rt export {config}` (converts it again)")
    return Path(model_dir)
