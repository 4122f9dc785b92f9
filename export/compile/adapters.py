"""`edit-rt adapters`: LoRA files -> edit-rt adapter files (``build/<model>/adapters/<name>.safetensors``).

A LoRA file in diffusers/peft format or kohya / AUTOMATIC1111 format is loaded by diffusers
itself (``pipe.load_lora_weights``: its own state-dict conversion of every format it knows),
then read back from the peft layers it made: per adapted layer ``lora_A`` ``[r, in]``,
``lora_B`` ``[out, r]`` and peft's scaling (alpha / r, rank and alpha patterns applied), which
is folded into ``up``. So what edit-rt applies is what diffusers applies, for any format
diffusers reads. The file is written with numpy (the runtime reads it without torch) and
records the model's fingerprint and the source file's sha256.

Refused in one line, naming the file and the layer: adapter types that are not a low-rank
branch (LoHa, LoKr, OFT/BOFT, (IA)^3, DoRA, full weight differences, LoCon's 3x3 convolutions),
a layer edit-rt's graphs do not carry, a LoRA for another architecture (a shape mismatch), and
a rank above the export's ``adapter_rank``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np

from edit_rt.runtime.engine.manifest import Manifest, sha256_file
from edit_rt.runtime.errors import ConfigError, ModelError
from edit_rt.runtime.model.adapters import ADAPTER_FORMAT, MAGNITUDE_WARN, lora_source

log = logging.getLogger(__name__)

_PEFT_NAME = "edit_rt"
# Key fragments of the adapter types edit-rt cannot apply as a low-rank branch.
_UNSUPPORTED = [
    (re.compile(r"hada_w[12]_[ab]"), "LoHa (LyCORIS Hadamard product)"),
    (re.compile(r"lokr_w[12]"), "LoKr (LyCORIS Kronecker product)"),
    (re.compile(r"oft_blocks|oft_diag|\.oft_r|boft_"), "OFT/BOFT (orthogonal fine-tuning)"),
    (re.compile(r"\.on_input|ia3_l"), "(IA)^3"),
    (re.compile(r"dora_scale|lora_magnitude_vector"), "DoRA (weight-decomposed LoRA)"),
    (re.compile(r"lora_mid"), "LoCon with Tucker decomposition (lora_mid)"),
    (re.compile(r"\.diff(_b)?$|\.w_norm|\.b_norm"), "a full weight difference (LyCORIS diff / norm)"),
    (re.compile(r"glora_"), "GLoRA"),
]


_DOWN = re.compile(r"\.(lora_A|lora\.down|lora_down|lora_linear_layer\.down)(\.[\w]+)?\.weight$")


HEADER_LIMIT = 100 << 20  # bytes of JSON header: safetensors' own limit
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


def check_safetensors(path: Path) -> None:
    """Refuse, in one line naming the file, anything that is not a sound safetensors file: not
    a regular file (a symlink is followed to what it names), a header length past the file, a
    header that is not a JSON object, a tensor of an unknown dtype, absurd shapes, offsets past
    the end or not matching the shape. Nothing is read past the header."""
    import json
    import os
    import stat as stat_

    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise ModelError(f"{path}: cannot be opened ({err.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat_.S_ISREG(st.st_mode):
            raise ModelError(f"{path}: not a regular file (a LoRA is a .safetensors file)")
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise ModelError(f"{path}: {st.st_size} bytes, too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n > HEADER_LIMIT or 8 + n > st.st_size:
            raise ModelError(f"{path}: not a safetensors file (header length {n} past its {st.st_size} bytes)")
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise ModelError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: not a safetensors file (its header is not a JSON object)")
    data = st.st_size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (dtype in _DTYPE_BYTES and isinstance(shape, list) and len(shape) <= 8
                  and all(isinstance(d, int) and 0 <= d < 1 << 31 for d in shape)
                  and isinstance(start, int) and isinstance(end, int))  # fmt: skip
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ModelError(f"{path}: tensor {str(key)[:80]} has no sound dtype/shape/data_offsets")
        if not 0 <= start <= end <= data:
            raise ModelError(f"{path}: tensor {str(key)[:80]} lies at bytes {start}..{end}, past the file's {data} bytes of data")
        size = _DTYPE_BYTES[dtype]
        for d in shape:
            size *= d
        if size != end - start:
            raise ModelError(f"{path}: tensor {str(key)[:80]} is {shape} {dtype} ({size} bytes) in {end - start} bytes")


def unsupported_type(path: Path) -> int:
    """Refuse, by name, an adapter type that is not a low-rank branch, from the file's keys;
    return how many LoRA layers the file holds."""
    from safetensors import safe_open

    check_safetensors(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            keys = list(f.keys())
    except Exception as err:  # safetensors' own error types: one line naming the file
        raise ModelError(f"{path}: unreadable as safetensors ({' '.join(str(err).split())[:200]})") from None
    for pattern, what in _UNSUPPORTED:
        hit = next((k for k in keys if pattern.search(k)), None)
        if hit is not None:
            raise ModelError(f"{path}: {what} adapter (key {hit}); edit-rt applies LoRA (low-rank A/B) adapters only")
    return len({_DOWN.split(k)[0] for k in keys if _DOWN.search(k)})


def _pipeline(model_dir: Path, family: str):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    from .family import quiet

    quiet()
    cls = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    return cls.from_pretrained(model_dir, safety_checker=None) if family == "sd" else cls.from_pretrained(model_dir)


def convert_adapter(model_dir: Path, manifest: Manifest, source: Path, name: str, out: Path, pipe=None) -> Path:
    """Convert the LoRA file ``source`` for the model of ``manifest`` into ``out``."""
    import torch
    from safetensors.numpy import save_file

    source = lora_source(source)
    spec = manifest.adapters
    if not spec["slots"]:
        raise ConfigError(f"adapters.{name}: this export has no adapter slots; set export.adapter_slots (e.g. 4) "
                          "and re-run `make export`")  # fmt: skip
    in_file = unsupported_type(source)
    pipe = pipe if pipe is not None else _pipeline(Path(model_dir), manifest.family["family"])
    by_name = {layer["name"]: layer for layer in spec["layers"]}
    try:
        pipe.load_lora_weights(str(source), adapter_name=_PEFT_NAME)
    except (RuntimeError, ValueError, KeyError) as err:  # peft: a size mismatch names the layer
        text = " ".join(str(err).split())
        mismatch = re.search(r"size mismatch for ([\w.]+)", text)
        where = f" (layer {mismatch.group(1)})" if mismatch else ""
        raise ModelError(f"{source}: this LoRA does not fit the model{where}: {text[:300]}") from None
    tensors: dict[str, np.ndarray] = {}
    try:
        rank = 0
        for component in ("unet", "text_encoder", "text_encoder_2"):
            module = getattr(pipe, component, None)
            if module is None:
                continue
            for path, layer in module.named_modules():
                if not hasattr(layer, "lora_A") or _PEFT_NAME not in layer.lora_A:
                    continue
                full = f"{component}.{path}"
                if getattr(layer, "use_dora", {}).get(_PEFT_NAME):
                    raise ModelError(f"{source}: layer {full} is DoRA; edit-rt applies plain LoRA only")
                a = layer.lora_A[_PEFT_NAME].weight.detach().to(torch.float32)
                b = layer.lora_B[_PEFT_NAME].weight.detach().to(torch.float32)
                if getattr(layer.lora_B[_PEFT_NAME], "bias", None) is not None:
                    raise ModelError(f"{source}: layer {full} has a LoRA bias; edit-rt applies plain LoRA only")
                if a.dim() == 4:
                    if a.shape[2:] != (1, 1):
                        raise ModelError(f"{source}: layer {full} is a {a.shape[2]}x{a.shape[3]} convolution LoRA (LoCon); "
                                         "edit-rt applies LoRA to linear and 1x1 layers only")  # fmt: skip
                    a, b = a[:, :, 0, 0], b[:, :, 0, 0]
                known = by_name.get(full)
                if known is None:
                    raise ModelError(f"{source}: layer {full} is not one edit-rt's graphs carry LoRA on (the UNet's "
                                     "transformer blocks and the text encoders' attention and MLP layers)")  # fmt: skip
                if a.shape[1] != known["in"] or b.shape[0] != known["out"]:
                    raise ModelError(f"{source}: layer {full} is {a.shape[1]} -> {b.shape[0]} in this LoRA but "
                                     f"{known['in']} -> {known['out']} in the model (a LoRA for another architecture)")  # fmt: skip
                scaling = float(layer.scaling[_PEFT_NAME])
                if not (torch.isfinite(a).all() and torch.isfinite(b).all()) or not np.isfinite(scaling):
                    raise ModelError(f"{source}: layer {full} holds NaN or infinite weights; edit-rt refuses to convert it")
                peak = max(float(a.abs().max()), float((b * scaling).abs().max()))
                if peak > MAGNITUDE_WARN:
                    log.warning("%s: layer %s has weights up to %.3g (past %g); its images may be garbage",
                                source, full, peak, MAGNITUDE_WARN)  # fmt: skip
                tensors[f"{full}.down"] = a.numpy().copy()
                tensors[f"{full}.up"] = (b * scaling).numpy().copy()
                rank = max(rank, a.shape[0])
    finally:
        pipe.delete_adapters(_PEFT_NAME)
    if not tensors:
        raise ModelError(f"{source}: diffusers found no LoRA layer of this model in it (a LoRA for another model?)")
    if len(tensors) // 2 < in_file:  # diffusers skips, with a warning only, keys it cannot place
        raise ModelError(f"{source}: {in_file} LoRA layers in the file, but diffusers placed only {len(tensors) // 2} "
                         "on this model's layers (keys of another architecture, or mixed key formats)")  # fmt: skip
    if rank > spec["rank"]:
        raise ModelError(f"{source}: rank {rank} is above this export's adapter_rank {spec['rank']}; raise "
                         "export.adapter_rank and re-run `make export`")  # fmt: skip
    graphs = sorted({by_name[k.rsplit(".", 1)[0]]["graph"] for k in tensors})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    save_file(tensors, str(partial), metadata={
        "format": ADAPTER_FORMAT, "name": name, "rank": str(rank), "graphs": ",".join(graphs),
        "fingerprint": manifest.fingerprint, "source": str(source.resolve()), "source_sha256": sha256_file(source),
    })  # fmt: skip
    partial.replace(out)
    log.info("adapter %s: %d layers, rank %d (%s) -> %s", name, len(tensors) // 2, rank, ", ".join(graphs), out)
    return out


def converted_current(manifest: Manifest, source: Path, out: Path, name: str) -> bool:
    """Whether ``out`` holds ``source`` converted for this export: it loads against the manifest
    (same model fingerprint, layers that fit the slots) and was converted from these bytes."""
    from edit_rt.runtime.errors import EditRtError
    from edit_rt.runtime.model.adapters import load_adapter

    try:
        adapter = load_adapter(out, name, manifest)
        return adapter.source_sha256 == sha256_file(lora_source(source))
    except (EditRtError, OSError):
        return False


def convert_adapters(model_dir: Path, manifest: Manifest, sources: dict[str, Path], out_dir: Path,
                     skip_current: bool = False) -> dict[str, Path]:  # fmt: skip
    """Every configured adapter converted (one pipeline loaded for all); name -> its file.
    ``skip_current``: leave out those whose converted file is current (:func:`converted_current`)."""
    from edit_rt.runtime.model.adapters import adapter_path

    if skip_current:
        sources = {name: src for name, src in sources.items()
                   if not converted_current(manifest, src, adapter_path(out_dir, name), name)}  # fmt: skip
    if not sources:
        return {}
    pipe = _pipeline(Path(model_dir), manifest.family["family"])
    return {name: convert_adapter(model_dir, manifest, src, name, adapter_path(out_dir, name), pipe)
            for name, src in sources.items()}  # fmt: skip
