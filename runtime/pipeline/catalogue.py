"""A config's ``catalogue:`` (config/catalogue.py), run by `edit-rt run` after its edits: the
rows streamed through the step loop one chunk (a batched tail) at a time, each image written to
``<output_dir>/catalogue/NNNNN.png`` as it is decoded, and an index, ``catalogue.json``.

Memory is bounded by a chunk: its rows, their latents and images (the spec's rows are made
lazily). A run that is stopped resumes: its base comes back from the store (a disk store keeps
it across restarts), every row whose PNG is there is skipped (a PNG is written as the store
writes its files, storage/store_files.py's ``write_atomic``: to a temporary name, fsynced and
renamed, so one that exists is whole), and the index's key (the base and the spec)
refuses a folder that holds another catalogue.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config.catalogue import Catalogue
from ..config.run_config import RunConfig
from ..errors import ConfigError
from ..model.edit import Base, Edit
from ..storage.store_files import write_atomic
from .images import png_bytes
from .pnginfo import edit_fields, parameters_text


def file_name(index: int) -> str:
    return f"{index:05d}.png"


def _index(folder: Path, key: str, total: int, entries: Sequence[dict]) -> None:
    text = json.dumps({"key": key, "rows": total, "written": sum(e["file"] is not None for e in entries), "entries": list(entries)},
                      indent=1)  # fmt: skip
    write_atomic(folder / "catalogue.json", text.encode())


def _done(folder: Path, key: str) -> set[int]:
    """The rows a previous run of the same catalogue wrote; a folder of another one is refused."""
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
    return {int(p.stem) for p in folder.glob("[0-9][0-9][0-9][0-9][0-9].png")}


def run_catalogue(cfg: RunConfig, pipe: Any, state: Any, base: Base, bid: str,
                  progress: Callable[[int, str], Callable[[int], None]]) -> dict:  # fmt: skip
    """Run ``cfg.catalogue`` on ``state`` (the base ``base``, id ``bid``); return its report."""
    spec: Catalogue = cfg.catalogue
    folder = cfg.output_dir / "catalogue"
    folder.mkdir(parents=True, exist_ok=True)
    key, total = spec.key(bid), spec.size()
    done = _done(folder, key)
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
        for (i, _), row, result, image in zip(pending, rows, results, pipe.render_each(state, rows, results)):
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
    return {"rows": total, "run": rows_run, "resumed": len(done), "chunk": chunk, "seconds": round(seconds, 4),
            "edits_per_s": round(rows_run / seconds, 4) if rows_run else None, "folder": str(folder)}  # fmt: skip
