"""Single-file checkpoints: what a ``.safetensors`` file users hold is, read from its header alone.

A1111, Forge, ComfyUI and civitai keep Stable Diffusion as one file in the original ("ldm") key
layout: ``model.diffusion_model.*`` (the UNet), ``first_stage_model.*`` (the VAE) and the text
encoders as ``cond_stage_model.transformer.*`` (SD 1.x, OpenAI CLIP), ``cond_stage_model.model.*``
(SD 2.x, OpenCLIP ViT-H) or ``conditioner.embedders.0/1.*`` (SDXL's two). `edit-rt export`
converts such a file once into a diffusers folder (export/compile/checkpoint.py); this module is the part
the runtime needs too, so it reads only the safetensors header (an 8-byte length, then JSON: names,
dtypes, shapes) with no torch: which family the file is, every refusal in one line (a pickle, a
LoRA, an inpainting UNet, a VAE alone, ...), and whether the converted folder still matches the
file (its stats and content sha256, recorded in ``single_file.json`` in the folder, as the
manifest identifies weights: runtime/file_identity.py).

A header is a user's file, so every field is checked for type and range before use, against
the format safetensors itself enforces on load (known dtypes; shapes of non-negative integers
whose bytes equal the tensor's ``data_offsets``; the tensors tiling the data section exactly;
``__metadata__`` a flat map of strings), within bounds far above any checkpoint's header and far
below safetensors' own 100 MB (``MAX_HEADER_BYTES``, ``MAX_HEADER_TENSORS``, ``MAX_HEADER_VALUES``,
the last two counted before the JSON is parsed): anything else is
one line that names the file and what is wrong. A header is read once per state of its file
(path and stats), not on every config load.

SD 2.x's 768-v (v-prediction) and 512-base (epsilon) checkpoints have the same keys and shapes, so
an SD 2.x file without a ``v_pred`` key is refused until ``family:`` says which it is: a wrong
guess would give noise-like images with no error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import reprlib
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Optional, Union

import numpy as np

from ..errors import ModelError
from ..file_identity import STAT_FIELDS, file_stat, sha256_file

log = logging.getLogger(__name__)

FAMILIES = ("sd1", "sd2", "sd2-v", "sdxl")
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
STAMP = "single_file.json"  # in the converted folder: the source it was converted from
# An SDXL checkpoint's header is ~250 KB for ~2,500 tensors. 16 MiB is 64x that, room for
# metadata text (training logs, merge recipes), and with the counts below keeps the worst header's
# parse under ~2 s and ~130 MB; safetensors' own limit, 100 MB, cost 21.6 s and 1.06 GB.
MAX_HEADER_BYTES = 16 * 2**20
# 40x SDXL's tensors, bounded apart from the bytes: JSON's parse costs ~30-150 bytes of memory
# per value, so 16 MiB of short values ("[],", "0,") would parse into ~400 MB. Both are counted
# before parsing: the objects (a tensor's entry is one) and the values (a 4-D tensor's entry is
# ten: itself, dtype, shape and its 4 numbers, data_offsets and its 2), 16 per tensor.
MAX_HEADER_TENSORS = 100_000
MAX_HEADER_VALUES = 16 * MAX_HEADER_TENSORS
# Bits per element of every dtype safetensors 0.8 reads (its Rust Dtype enum).
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}  # fmt: skip
_CACHED_HEADERS = 8  # files whose headers stay parsed: a process serves one model, tests a few
_SCAN_CHUNK = 1 << 20  # bytes per numpy pass of _json_counts: ~20 MiB of working memory

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


def artifact_name(model: Path) -> str:
    """The folder name artifacts of ``model:`` are kept under (<build_dir>/<name>/...): a file's
    stem, a folder's own name. Refused in one line unless it is one plain folder name: a file
    named ``...safetensors`` has the stem ``..``, which would put its conversion beside
    build_dir, over whatever folder of the user's is there. Refused rather than mapped to a safe
    name: a mapped name hides where the artifacts are, and renaming the file is a one-step fix."""
    model = Path(model)
    single = is_single_file(model)
    name = model.stem if single else model.resolve().name
    problem = ("it is empty, or dots or spaces only" if not name.strip(". ")
               else "it holds a path separator" if any(c in name for c in ("/", "\\", os.sep, os.altsep or "/"))
               else "it holds a control character" if any(ord(c) < 32 or ord(c) == 127 for c in name)
               else None)  # fmt: skip
    if problem is not None:
        fix = "rename the file, e.g. to model.safetensors" if single else "give the folder a name"
        shown = str(model) if str(model).isprintable() else repr(str(model))  # one line, whatever the name holds
        raise ModelError(f"{shown}: its {'stem' if single else 'name'} {name!r} is not a plain folder name to keep "
                         f"its artifacts under in build_dir ({problem}); {fix}")  # fmt: skip
    return name


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
    """The header of the safetensors file ``path``, every field checked; anything else is refused
    in one line. Parsed once per state of the file: its path and stats (size, mtime, ctime,
    inode) key a small cache, refusals included."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path} not found; fix the path")
    try:
        with open(path, "rb") as f:
            key = (str(path.resolve()), *file_stat(f.fileno()))  # the open file's stats: no race with a rename
            with _LOCK:
                found = _HEADERS.get(key)
                if found is not None:
                    _HEADERS.move_to_end(key)
            if found is None:
                found = _header_or_refusal(path, f, key[1])
                with _LOCK:
                    _HEADERS[key] = found
                    while len(_HEADERS) > _CACHED_HEADERS:
                        _HEADERS.popitem(last=False)
    except OSError as err:
        raise ModelError(f"{path}: cannot be read ({err.strerror})") from None
    if isinstance(found, str):
        raise ModelError(found)
    return found


_LOCK = threading.Lock()
_HEADERS: OrderedDict[tuple, Union[Header, str]] = OrderedDict()  # a Header, or the line refusing it


def _header_or_refusal(path: Path, f: BinaryIO, size: int) -> Union[Header, str]:
    """The header of the open file ``f`` (``size`` bytes), or the one line refusing it."""
    head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 2 <= n <= size - 8:
        return _not_safetensors(path, head)
    if n > MAX_HEADER_BYTES:
        return (f"{path}: its safetensors header is {n:,} bytes, more than the {MAX_HEADER_BYTES:,} edit-rt reads "
                "(MAX_HEADER_BYTES; an SDXL checkpoint's is ~250 KB); it is no Stable Diffusion checkpoint or is "
                "damaged: download or export it again")  # fmt: skip
    raw = f.read(n)
    objects, values = _json_counts(raw)
    if objects > MAX_HEADER_TENSORS + 2:  # + the header itself and __metadata__
        return _too_many(path, f"{objects:,} JSON objects")
    if values > MAX_HEADER_VALUES:
        return (f"{path}: its safetensors header holds {values:,} JSON values, more than the {MAX_HEADER_VALUES:,} "
                "edit-rt parses (MAX_HEADER_VALUES: 16 a tensor); it is no Stable Diffusion checkpoint or is damaged: "
                "download or export it again")  # fmt: skip
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return _not_safetensors(path, head)
    except RecursionError:  # json recurses once per level: it stops at the interpreter's limit
        return (f"{path}: its safetensors header nests deeper than Python's JSON parser goes (a header nests 3 "
                "levels: names, fields, lists); the file is damaged or hostile: download or export it again")  # fmt: skip
    if not isinstance(data, dict):
        return _not_safetensors(path, head)
    damaged = f"{path}: its safetensors header is damaged"
    again = "download or export the file again"
    metadata = data.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        return f"{damaged}: its __metadata__ is {_brief(metadata)}, not a flat map of strings to strings; {again}"
    if len(data) > MAX_HEADER_TENSORS:
        return _too_many(path, f"{len(data):,} tensors")
    data_bytes = size - 8 - n
    tensors, spans = {}, []
    for name, entry in data.items():
        found = _tensor_entry(entry, data_bytes)
        if isinstance(found, str):
            return f"{damaged} at {name[:80]!r}: {found}; {again}"
        tensors[name] = found[:2]
        spans.append((found[2], found[3], name))
    # the tensors tile the data section, in offset order, as safetensors checks on load
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            why = "overlap the tensor before it" if begin < end else f"leave bytes {end:,}..{begin:,} to no tensor"
            return f"{damaged} at {name[:80]!r}: its data_offsets [{begin}, {stop}] {why}; {again}"
        end = stop
    if end != data_bytes:
        return (f"{damaged}: its data section holds {data_bytes:,} bytes, and its tensors cover {end:,}; the file "
                f"is truncated or padded: {again}")  # fmt: skip
    return Header(tensors, metadata, hashlib.sha256(head + raw).hexdigest())


def _too_many(path: Path, what: str) -> str:
    return (f"{path}: its safetensors header holds {what}, more than the {MAX_HEADER_TENSORS:,} tensors edit-rt reads "
            "(MAX_HEADER_TENSORS; an SDXL checkpoint has ~2,500); it is no Stable Diffusion checkpoint or is damaged: "
            "download or export it again")  # fmt: skip


def _json_counts(raw: bytes) -> tuple[int, int]:
    """How many ``{`` (the objects a parse makes) and how many ``{``, ``[`` and ``,`` (a bound on
    all its values: each container opens with a bracket, each other value but a container's first
    follows a comma) the JSON text ``raw`` holds outside its strings. Strings are found as
    web/json_depth.py finds them: escapes dropped (``\\\\`` pairs, then ``\\"``), after which a
    byte is inside one when an odd number of quotes precede it."""
    objects, values = raw.count(b"{"), raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    if objects <= MAX_HEADER_TENSORS + 2 and values <= MAX_HEADER_VALUES:
        return objects, values  # upper bounds, already within the limits: a real header is not scanned
    text = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    objects = values = quotes = 0
    for start in range(0, len(text), _SCAN_CHUNK):
        part = text[start : start + _SCAN_CHUNK]
        quote = part == ord('"')
        outside = (quotes + np.cumsum(quote, dtype=np.int64) - quote) % 2 == 0
        braces = int(np.count_nonzero((part == ord("{")) & outside))
        objects += braces
        values += braces + int(np.count_nonzero(((part == ord("[")) | (part == ord(","))) & outside))
        quotes += int(np.count_nonzero(quote))
    return objects, values


def _tensor_entry(entry: object, data_bytes: int) -> Union[tuple[str, tuple[int, ...], int, int], str]:
    """(dtype, shape, begin, end) of one tensor's entry, or what is wrong with it."""
    if not isinstance(entry, dict):
        return f"its entry is {_brief(entry)}, not an object of dtype, shape and data_offsets"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(dtype, str) and dtype in DTYPE_BITS):
        return f"dtype {_brief(dtype)} is none of safetensors' ({', '.join(DTYPE_BITS)})"
    if not (isinstance(shape, list) and all(_count(v) for v in shape)):
        return f"shape {_brief(shape)} is not a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(v) for v in offsets)
            and offsets[0] <= offsets[1] <= data_bytes):  # fmt: skip
        return f"data_offsets {_brief(offsets)} are not two integers begin <= end within the {data_bytes:,} bytes of data"
    begin, end = offsets
    bits = DTYPE_BITS[dtype]
    for dim in shape:  # stops once past the file, so a long shape of large numbers costs nothing
        bits *= dim
        if bits > 8 * data_bytes:
            return f"shape {_brief(shape)} of {dtype} is more bytes than the file's {data_bytes:,} bytes of data"
    if bits != 8 * (end - begin):
        return f"shape {_brief(shape)} of {dtype} is {bits / 8:,g} bytes, and its data_offsets span {end - begin:,}"
    return dtype, tuple(shape), begin, end


def _count(v: object) -> bool:
    """A dimension or an offset: an int (not a bool, float or string) in [0, 2**64), as Rust's usize."""
    return type(v) is int and 0 <= v < 2**64


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40


def _brief(value: object) -> str:
    """``value`` for a one-line message: reprlib's repr (a few items of each list, no newline),
    which costs the same for a list of ten million numbers as for one."""
    return _REPR.repr(value)


def _not_safetensors(path: Path, head: bytes) -> str:
    """The refusal of a file without a safetensors header: a pickle checkpoint, or something else."""
    pickled = head[:2] == b"PK" or head[:1] == b"\x80" or path.suffix.lower() in PICKLE_SUFFIXES
    if pickled:
        return (
            f"{path} is a pickle checkpoint ({path.suffix or 'no suffix'}), and loading a pickle runs whatever code "
            f"it holds; convert it once to safetensors (weights only, no code runs): python -m edit_rt.export.compile.checkpoint "
            f"{path}, then set model: to the .safetensors file it writes"
        )  # fmt: skip
    return (f"{path} is not a safetensors file (no valid header: an 8-byte length, then that many bytes of a JSON object); "
            "give a .safetensors checkpoint (an interrupted download leaves such a file: fetch it again)")


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


def source_stamp(path: Path) -> dict:
    """What identifies the bytes of ``path`` as the manifest identifies weights: size, mtime, ctime
    and inode, and the content's sha256 (runtime/file_identity.py). Its stats are taken before
    its bytes are hashed, so a file changed meanwhile never matches them again."""
    stat = dict(zip(STAT_FIELDS, file_stat(path)))
    return {**stat, "sha256": sha256_file(path)}


def read_stamp(model_dir: Path) -> Optional[dict]:
    try:
        data = json.loads((Path(model_dir) / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def conversion_configs(family: str, config_dir: Optional[Path]) -> str:
    """What a conversion's configs were, as its stamp records them: ``checkpoint_config:``'s
    folder, or the family's shipped ones (with the file's own shapes written over them)."""
    return str(Path(config_dir).resolve()) if config_dir is not None else f"shipped:{family}"


def _same_configs(stamp: dict, config_dir: Optional[Path]) -> bool:
    recorded = str(stamp.get("config", ""))
    if config_dir is None:
        return recorded.startswith("shipped:")
    return recorded == conversion_configs("", config_dir)


def conversion_current(path: Path, model_dir: Path, family: Optional[str] = None, config_dir: Optional[Path] = None) -> bool:
    """Whether ``model_dir`` holds the conversion of the file ``path`` as it is now (and, when
    given, as ``family``), with the configs of ``config_dir`` (None: the shipped ones): its
    stats as recorded, or else its content's sha256 as recorded (a copy with the same bytes:
    the stamp then takes its new stats, so the next check is a stat)."""
    stamp = read_stamp(model_dir)
    if stamp is None or not (Path(model_dir) / "model_index.json").is_file():
        return False
    if (family is not None and stamp.get("family") != family) or not isinstance(stamp.get("sha256"), str):
        return False
    if not _same_configs(stamp, config_dir):
        return False
    now = dict(zip(STAT_FIELDS, file_stat(path)))
    if all(stamp.get(k) == v for k, v in now.items()):
        return True
    if stamp.get("size") != now["size"] or sha256_file(path) != stamp["sha256"]:
        return False
    _restamp(Path(model_dir), {**stamp, **now})
    return True


def _restamp(model_dir: Path, stamp: dict) -> None:
    """``stamp`` written over the folder's, whole or not at all; a folder this process cannot
    write keeps the old one (the next check hashes the file again)."""
    tmp = model_dir / f".{STAMP}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(stamp, indent=2) + "\n")
        os.replace(tmp, model_dir / STAMP)
    except OSError as err:
        log.info("%s: stamp not refreshed (%s)", model_dir / STAMP, err.strerror)
        tmp.unlink(missing_ok=True)


def require_converted(path: Path, model_dir: Path, family: Optional[str], config: str = "CONFIG",
                      config_dir: Optional[Path] = None) -> Path:  # fmt: skip
    """``model_dir`` when it holds the current conversion of ``path`` (with ``config_dir``'s
    configs: ``checkpoint_config:``); otherwise the one-line refusal that names the command
    converting it (the runtime has no torch to convert with)."""
    if not (Path(model_dir) / STAMP).is_file():
        raise ModelError(f"model: {path} is a single-file checkpoint not yet converted; run `edit-rt export {config}` "
                         f"(converts it once into {model_dir})")  # fmt: skip
    if Path(path).is_file() and not conversion_current(path, model_dir, family, config_dir):
        stamp = read_stamp(model_dir) or {}
        if family is not None and stamp.get("family") not in (None, family):
            what = f"was converted as {stamp.get('family')}, and family: is {family},"
        elif not _same_configs(stamp, config_dir):
            what = (f"was converted with the configs {stamp.get('config')}, and checkpoint_config: is "
                    f"{config_dir if config_dir is not None else 'not set (the shipped ones)'},")
        elif not isinstance(stamp.get("sha256"), str):
            what = f"was converted by an older edit-rt ({STAMP} records no content sha256)"
        else:
            what = "changed since it was converted"
        raise ModelError(f"model: {path} {what} into {model_dir}; run `edit-rt export {config}` (converts it again)")
    return Path(model_dir)
