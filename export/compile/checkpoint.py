"""Single-file checkpoints into diffusers folders, once and offline, and the CLIP tokenizer they lack.

A ``.safetensors`` checkpoint in the original ("ldm") layout, as A1111, ComfyUI and civitai keep
SD 1.x, SD 2.x and SDXL, is converted by diffusers' own single-file loaders
(``StableDiffusionPipeline.from_single_file`` / ``StableDiffusionXLPipeline.from_single_file``)
with ``config=`` a folder the project ships (``checkpoint_configs/<family>/``: the configs of SD
1.5, SD 2.1-base, SD 2.1 768-v and SDXL base 1.0), with what the file's tensor shapes tell (widths,
depths, vocabulary) written over them (checkpoint_shapes.py), and ``local_files_only``, so nothing
is looked up on a hub. A single file carries no tokenizer: the CLIP tokenizer is built from CLIP's BPE
vocabulary shipped in ``vocab/`` (from the open-clip-torch wheel, MIT licence), exactly as
open_clip's ``SimpleTokenizer`` reads it. What a file is, and every refusal, comes from its header
(``runtime/model/single_file.py``, which the torch-free runtime shares).

The converted folder is written to ``<out>.partial`` and moved into place (``os.replace``), with a
``single_file.json`` recording the source's size, mtime, ctime, inode and content sha256 and the
family: a second export of the same file is skipped, a changed file is converted again (one given
its old mtime back too). Every folder it writes, moves or deletes is ``<out>`` or a sibling of it
(``.partial``, ``.old``), and ``<out>`` never climbs out of the folder it names (``build/../x``).

``python -m edit_rt.export.compile.checkpoint FILE.ckpt [OUT.safetensors]`` turns a pickle checkpoint into
a safetensors one with ``torch.load(weights_only=True)``: only tensors are unpickled, no code runs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from edit_rt.runtime.errors import EditRtError, ModelError
from edit_rt.runtime.model.single_file import (STAMP, checkpoint_family, conversion_configs, conversion_current, read_header,
                                               source_stamp)  # fmt: skip

from .checkpoint_shapes import configs_from_shapes, conversion_refusal

log = logging.getLogger(__name__)

_OPENCLIP_XL = "conditioner.embedders.1.model."


def diffusers_from_single_file(path: Path, out_dir: Path, family: Optional[str] = None, config_dir: Optional[Path] = None,
                               say: Optional[Callable[[str], None]] = None) -> Path:  # fmt: skip
    """Convert the single-file checkpoint ``path`` into the diffusers folder ``out_dir`` (weights
    as safetensors, tokenizer(s) included) and return ``out_dir``; skipped when ``out_dir`` already
    holds the conversion of the file as it is now.

    ``family``: sd1, sd2, sd2-v or sdxl (default: detected from the keys; SD 2.x must be told).
    ``config_dir``: a diffusers folder whose configs, tokenizers and scheduler describe the file,
    used as it is (``checkpoint_config:``); default: the family's shipped ones with what the
    file's shapes tell written over them (checkpoint_shapes.py). ``say`` gets one line when a
    conversion ran.
    """
    path, out_dir = Path(path), _checked_destination(Path(out_dir))
    header = read_header(path)
    family = checkpoint_family(path, family, header)
    if conversion_current(path, out_dir, family, config_dir):
        log.info("%s: converted already into %s", path, out_dir)
        return out_dir
    stamp = {"source": str(path.resolve()), **source_stamp(path), "family": family}
    start = time.monotonic()
    partial = _beside(out_dir, ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s (%s) into %s", path, family, out_dir)
    with tempfile.TemporaryDirectory(prefix="edit-rt-configs-") as tmp:
        if config_dir is not None:
            config = Path(config_dir)
        else:
            config = configs_from_shapes(path, header, family, Path(tmp) / family)
        pipe = _pipeline_from_file(path, config, family, _stored_dtype(header))
        pipe.save_pretrained(str(partial), safe_serialization=True)
        del pipe
    seconds = time.monotonic() - start
    import diffusers

    stamp.update(config=conversion_configs(family, config_dir),
                 diffusers=diffusers.__version__, seconds=round(seconds, 1))  # fmt: skip
    (partial / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    _move_into_place(partial, out_dir)
    log.info("converted %s -> %s in %.1f s", path, out_dir, seconds)
    if say is not None:
        say(f"converted {path} -> {out_dir} ({family}, {seconds:.1f} s)")
    return out_dir


def _move_into_place(partial: Path, out_dir: Path) -> None:
    """``partial`` becomes ``out_dir``; a stale ``out_dir`` is moved aside first (a folder cannot
    be replaced while it holds files), so ``out_dir`` is never half written. Each path moved or
    deleted is checked to be ``out_dir`` or its sibling first."""
    if partial != _beside(out_dir, ".partial"):
        raise ModelError(f"{partial}: not {out_dir}'s .partial sibling; nothing moved")
    old = _beside(out_dir, ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(partial, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _checked_destination(out_dir: Path) -> Path:
    """``out_dir``, refused unless it names its folder without climbing out of a folder it named
    first: ``build/../diffusers`` (a checkpoint named ``...safetensors`` under ``build``) would
    put the conversion, and the move of whatever is there aside and its deletion, outside build."""
    parts = out_dir.parts[1:] if out_dir.anchor else out_dir.parts
    named = list(parts)
    while named and named[0] == "..":  # a path may start above the working folder (../build)
        named.pop(0)
    if not named or ".." in named:
        raise ModelError(f"{out_dir}: a conversion's folder must not climb out of the folder it names ('..'); "
                         "give a path without '..' in it, and rename a checkpoint whose stem is dots")  # fmt: skip
    return out_dir


def _beside(out_dir: Path, suffix: str) -> Path:
    """``out_dir``'s sibling ``<name><suffix>`` (the only other paths the conversion writes,
    moves or deletes), checked to resolve inside ``out_dir``'s parent: a link there would have
    the conversion write into, or move aside, a folder elsewhere."""
    sibling = out_dir.with_name(out_dir.name + suffix)
    inside = os.path.join(os.path.realpath(out_dir.parent), sibling.name)
    if os.path.realpath(sibling) != inside:
        raise ModelError(f"{sibling} resolves to {os.path.realpath(sibling)}, outside {out_dir.parent}; remove that "
                         "link (the conversion writes its folders beside its destination only)")  # fmt: skip
    return sibling


def _stored_dtype(header: Any) -> Optional[str]:
    """The one floating dtype of every weight in the file ("F16", "BF16"), which the folder keeps
    (the export casts to fp32 exactly); None, so fp32, when the file mixes them (an fp32 VAE
    beside an fp16 UNet must not lose bits)."""
    kinds = {dtype for dtype, _ in header.tensors.values() if dtype in ("F16", "BF16", "F32", "F64")}
    return next(iter(kinds)) if len(kinds) == 1 and kinds <= {"F16", "BF16"} else None


def _pipeline_from_file(path: Path, config: Path, family: str, stored: Optional[str] = None) -> Any:
    """diffusers' single-file loader on ``path`` with the configs in ``config``, offline; the
    weights in ``stored`` (F16, BF16) or fp32."""
    import diffusers
    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    from .family import quiet

    quiet()
    diffusers.utils.logging.disable_progress_bar()
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}.get(stored or "", torch.float32)
    common = {"config": str(config), "local_files_only": True, "torch_dtype": dtype}
    try:
        if family == "sdxl":
            # diffusers tells SDXL's two encoders apart by width (768 vs 1280); converting the
            # second by its own prefix holds for any size (the tests' tiny SDXL has one width).
            text_encoder_2 = _open_clip_encoder(path, config).to(dtype)
            return StableDiffusionXLPipeline.from_single_file(str(path), text_encoder_2=text_encoder_2, **common)
        return StableDiffusionPipeline.from_single_file(str(path), safety_checker=None, feature_extractor=None,
                                                        requires_safety_checker=False, **common)  # fmt: skip
    except (ValueError, KeyError, RuntimeError, OSError) as err:  # a layout the configs do not describe
        raise conversion_refusal(path, family, err, read_header(path)) from None


def _open_clip_encoder(path: Path, config: Path) -> Any:
    """SDXL's second text encoder (OpenCLIP bigG, ``conditioner.embedders.1.model.*``) with
    diffusers' own OpenCLIP converter."""
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint
    from safetensors import safe_open
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    with safe_open(str(path), framework="pt") as f:
        checkpoint = {k: f.get_tensor(k) for k in f.keys() if k.startswith(_OPENCLIP_XL)}
    model = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(str(config), subfolder="text_encoder_2",
                                                                       local_files_only=True))  # fmt: skip
    state = convert_open_clip_checkpoint(model, checkpoint, prefix=_OPENCLIP_XL)
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing:
        raise ModelError(f"{path}: its SDXL second text encoder ({_OPENCLIP_XL}*) lacks {len(missing)} weights "
                         f"(e.g. {missing[0]}); use the full checkpoint of that model")  # fmt: skip
    return model.eval()


def safetensors_from_pickle(src: Path, dst: Optional[Path] = None) -> Path:
    """The tensors of the pickle checkpoint ``src`` (.ckpt, .pt, .bin) saved as ``dst`` (default:
    ``src`` with the suffix .safetensors). ``torch.load(weights_only=True)`` unpickles tensors and
    plain containers only: a file that needs more (code) is refused, not run. ``dst`` is checked
    before anything is read, and a failed write leaves nothing behind."""
    import pickle

    import torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    src = Path(src)
    dst = Path(dst) if dst is not None else src.with_suffix(".safetensors")
    if dst.is_dir():
        raise ModelError(f"{dst} is a folder; give the file to write, e.g. {dst / (src.stem + '.safetensors')}")
    if not dst.parent.is_dir():
        raise ModelError(f"{dst}: its folder {dst.parent} does not exist; create it, or give a path in a folder that exists")
    if not src.is_file():
        raise ModelError(f"{src} not found; fix the path")
    try:
        data = torch.load(str(src), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"{src}: weights-only loading refused it ({first[:160]}); it holds more than tensors, so only "
                         "convert it where you trust its source (e.g. A1111's Checkpoint Merger, safetensors format)") from None  # fmt: skip
    state = data.get("state_dict", data) if isinstance(data, dict) else None
    if not isinstance(state, dict):
        raise ModelError(f"{src}: holds a {type(data).__name__}, not a state dict of tensors")
    tensors, storages = {}, set()
    for name, value in state.items():
        if isinstance(name, str) and isinstance(value, torch.Tensor):
            ptr = value.untyped_storage().data_ptr()
            # safetensors refuses tensors that share memory (tied or viewed weights): copy repeats
            tensors[name] = value.clone().contiguous() if ptr in storages else value.contiguous()
            storages.add(ptr)
    if not tensors:
        raise ModelError(f"{src}: no tensors in it")
    tmp = dst.with_name(dst.name + ".partial")
    try:
        save_file(tensors, str(tmp), metadata={"converted_from": src.name})
        os.replace(tmp, dst)
    except BaseException as err:  # an interrupt too: a half-written file is never left behind
        tmp.unlink(missing_ok=True)
        if isinstance(err, (OSError, SafetensorError)):
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0][:160]
            raise ModelError(f"{dst}: cannot be written ({why}); free space or choose a path this user can write") from None
        raise
    log.info("wrote %s: %d tensors from %s", dst, len(tensors), src)
    return dst


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m edit_rt.export.compile.checkpoint FILE.ckpt [OUT.safetensors]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m edit_rt.export.compile.checkpoint",
                                     description="Save a pickle checkpoint's tensors as .safetensors (weights only, no code runs).")  # fmt: skip
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path, nargs="?")
    args = parser.parse_args(argv)
    try:
        dst = safetensors_from_pickle(args.src, args.dst)
    except EditRtError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
