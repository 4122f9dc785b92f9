"""A config's ``catalogue:`` (config/catalogue.py), run by `edit-rt run` after its edits: the
rows streamed through the step loop one chunk (a batched tail) at a time, each image written to
``<output_dir>/catalogue/NNNNN.png`` as it is decoded, and an index, ``catalogue.json``.

Memory is bounded by a chunk: its rows, their latents and images (the spec's rows are made
lazily). A run that is stopped resumes: its base comes back from the store (a disk store keeps
it across restarts), and a row is skipped only when its PNG is there as this run would leave
it: a regular file (never a symlink followed), a PNG that Pillow verifies, of the base's size,
named by one of this catalogue's row numbers. Anything else under a row's name (a symlink, a
directory, a damaged file) is removed without being followed and the row is run again; a
number past the last row is no row and is left alone. (A PNG is written as the store writes
its files, storage/store_files.py's ``write_atomic``: to a temporary name, fsynced and renamed,
so one this run wrote is whole.) The index's key is what the rows are (the base, the model and
every row as it runs, not limits such as ``max_rows``; the tiny decoder where it decodes): it
refuses a folder that holds another catalogue.

Its images are decoded by ``catalogue.decoder``, else the run's ``decoder`` (:func:`catalogue_decoder`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from PIL import Image, UnidentifiedImageError

from ..config.catalogue import Catalogue
from ..config.run_config import RunConfig
from ..errors import ConfigError
from ..model.edit import Base, Edit
from ..storage.store_files import write_atomic
from .images import png_bytes
from .pnginfo import edit_fields, parameters_text

log = logging.getLogger(__name__)
ROW_NAME = re.compile(r"(\d{5})\.png")  # file_name's: five digits cover MAX_ROWS (65,536)


def file_name(index: int) -> str:
    return f"{index:05d}.png"


def _index(folder: Path, key: str, total: int, entries: Sequence[dict]) -> None:
    text = json.dumps({"key": key, "rows": total, "written": sum(e["file"] is not None for e in entries), "entries": list(entries)},
                      indent=1)  # fmt: skip
    write_atomic(folder / "catalogue.json", text.encode())


def _done(folder: Path, key: str, total: int, size: tuple[int, int]) -> set[int]:
    """The rows a previous run of the same catalogue wrote whole (:func:`_whole`); anything else
    under a row's name is removed. A folder of another catalogue is refused."""
    index = folder / "catalogue.json"
    if not index.is_file():
        return set()
    try:
        old = json.loads(index.read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        old = None
    if old != key:
        raise ConfigError(f"output_dir: {folder} holds another catalogue (another base or spec); choose another "
                          "output_dir or delete that folder")  # fmt: skip
    done = set()
    for entry in os.scandir(folder):
        match = ROW_NAME.fullmatch(entry.name)
        if match is None or int(match.group(1)) >= total:
            continue  # not a row of this catalogue: neither counted nor touched
        if _whole(Path(entry.path), size):
            done.add(int(match.group(1)))
        else:
            _remove(Path(entry.path))
    return done


def _whole(path: Path, size: tuple[int, int]) -> bool:
    """Whether ``path`` is a row's PNG as a run writes it: a regular file, opened without
    following a symlink (O_NOFOLLOW, then fstat: nothing swapped in between), that Pillow
    verifies (its chunks' CRCs, its end) as a PNG of ``size`` (width, height)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))  # a FIFO does not block
    except OSError:  # a symlink (ELOOP), gone since
        return False
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory, a FIFO
        os.close(fd)
        return False
    with os.fdopen(fd, "rb") as file:
        try:
            with Image.open(file, formats=["PNG"]) as image:
                image.verify()
                return image.size == size
        except (OSError, SyntaxError, ValueError, UnidentifiedImageError, Image.DecompressionBombError):
            return False


def _remove(path: Path) -> None:
    """What stands under a row's name and is not its PNG, gone without being followed: a
    symlink is unlinked (its target left as it is), a directory removed with what it holds
    (rmtree never follows a link inside it), a damaged file unlinked."""
    log.warning("catalogue: %s is not a whole row PNG; removing it to write the row again", path)
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def catalogue_decoder(cfg: RunConfig, pipe: Any) -> str:
    """What decodes ``cfg.catalogue``'s images: its own ``decoder``, else the run's; checked
    against the export (a one-line ConfigError naming ``catalogue.decoder`` where it has no tiny
    decoder), so a run refuses it before its base and edits, not after."""
    own = cfg.catalogue.decoder
    return pipe.check_decoder(own, "catalogue.decoder") if own is not None else pipe.check_decoder(cfg.decoder)


def run_catalogue(cfg: RunConfig, pipe: Any, state: Any, base: Base, bid: str,
                  progress: Callable[[int, str], Callable[[int], None]]) -> dict:  # fmt: skip
    """Run ``cfg.catalogue`` on ``state`` (the base ``base``, id ``bid``); return its report."""
    spec: Catalogue = cfg.catalogue
    folder = cfg.output_dir / "catalogue"
    folder.mkdir(parents=True, exist_ok=True)
    total = spec.size()
    decoder = catalogue_decoder(cfg, pipe)
    # the decoder enters the key only when not the VAE: folders of VAE images written without
    # the field keep their key, and resume
    identity = {"base": bid, "model": cfg.model_name, **({"decoder": decoder} if decoder != "vae" else {})}
    key = spec.key(identity, lambda i, edit: cfg.tail_row(edit, f"catalogue row {i}"))
    done = _done(folder, key, total, (base.width, base.height))
    entries: list[dict] = []
    chunk = spec.chunk or pipe.batcher(state.latents.shape[1:]).scheduler.max_rows
    advance = progress(total, "catalogue")
    advance(len(done))
    _index(folder, key, total, [])
    seconds, rows_run = time.perf_counter(), 0
    pending: list[tuple[int, Edit]] = []

    def run_chunk() -> None:
        nonlocal rows_run
        rows = [cfg.tail_row(edit, f"catalogue row {i}") for i, edit in pending]
        results = pipe.edit(state, rows, decode=False)
        for (i, _), row, result, image in zip(pending, rows, results, pipe.render_each(state, rows, results, decoder)):
            fields = edit_fields(base, row, cfg.model_name, state.fingerprint, bid, result.preserve, result.uncond)
            text = parameters_text(row.prompt, base.negative_prompt, fields)
            write_atomic(folder / file_name(i), png_bytes(image, text))
            entries[i]["file"] = file_name(i)
            advance(1)
        rows_run += len(pending)
        pending.clear()

    try:
        for i, edit in spec.rows():
            entries.append({"index": i, "label": edit.label or edit.prompt or "edit", "file": file_name(i) if i in done else None})
            if i not in done:
                pending.append((i, edit))
                if len(pending) == chunk:
                    run_chunk()
        if pending:
            run_chunk()
    finally:  # what was written, whatever stopped the run
        _index(folder, key, total, entries)
    seconds = time.perf_counter() - seconds
    return {"rows": total, "run": rows_run, "resumed": len(done), "chunk": chunk, "decoder": decoder, "seconds": round(seconds, 4),
            "edits_per_s": round(rows_run / seconds, 4) if rows_run else None, "folder": str(folder)}  # fmt: skip
