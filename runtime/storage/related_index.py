"""Stored bases by their prompt's text embedding: the lookup of related generations.

A related generation (runtime/serving/related.py) needs the stored base nearest to a new prompt
among the bases it could re-enter: the same model (the store's), size, steps, guidance,
negative prompt, sampler, clip_skip, adapters and size conditioning (its :func:`group`). The
index keeps one unit vector per base (``PromptEncoder.prompt_embeddings``) and answers by
brute-force cosine in numpy: a matrix product over a group's vectors, ~10 us per thousand
bases of SD's 768-wide embeddings, so no ANN library earns its place below ~10^5 bases
(docs/related.md).

It follows the store:

- with a disk tier, every entry is also a small file ``<disk_dir>/related/<id>.json`` (written
  through mkstemp + os.replace, as the store writes), removed with its base's file when the
  disk tier evicts or deletes it (store_disk.py); :meth:`refresh` re-reads the folder when it
  changed, so a restart, or another replica sharing the folder, finds the bases already there;
- an entry whose base the store no longer holds (evicted from a RAM-only store, deleted) is
  dropped when a lookup finds it gone (:meth:`nearest` takes the store's membership test), and
  in RAM-only mode :meth:`prune` drops every entry the store no longer holds (the service calls
  it as the index outgrows the store, so it stays within ~2x the store's bases).

Its files are untrusted input, like the store's (docs/related.md, "Trust"): only regular files
are read, without blocking and without following a symlink (store_files.read_regular); an
entry whose vector is not of the index's dimension, not finite or not of unit norm (within
:data:`NORM_TOLERANCE`) is skipped with a warning; a similarity is a real cosine, clipped to
[-1, 1]. An entry only proposes a base: serving/related.py checks the stored base itself (its
group, and that it is not an upload) before it is served.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..model.edit import Base
from .store_files import NotAFileError, follow_umask, read_regular

log = logging.getLogger(__name__)

NORM_TOLERANCE = 1e-3  # how far from 1 a stored vector's norm may be (float32 rounding, JSON)
ENTRY_LIMIT = 1 << 20  # bytes: an entry is ~10-30 kB of JSON; anything larger is not one


def valid_vector(vector, dim: Optional[int] = None) -> Optional[str]:
    """Why ``vector`` cannot be an entry's (None: it can)."""
    if vector.ndim != 1 or vector.size == 0:
        return f"a vector of shape {list(vector.shape)}"
    if dim is not None and vector.size != dim:
        return f"a {vector.size}-long vector where the index's are {dim}-long"
    if not np.all(np.isfinite(vector)):
        return "a vector with non-finite values"
    norm = float(np.linalg.norm(vector.astype(np.float64)))
    if abs(norm - 1.0) > NORM_TOLERANCE:
        return f"a vector of norm {norm:.6g}, not unit length"
    return None


def group(base: Base) -> str:
    """What a related base must share with a request: everything but the prompt and the seed
    (and the markers of what it came from)."""
    fields = asdict(base)
    for name in ("prompt", "seed", "image", "related", "known"):
        fields.pop(name, None)
    return json.dumps(fields, sort_keys=True)


@dataclass(frozen=True)
class Entry:
    bid: str
    group: str
    vector: np.ndarray  # [D] float32, unit length
    window_start: int


class RelatedIndex:
    """Every indexed base's embedding, by group; thread-safe (the server's event loop and the
    store's threads both reach it)."""

    def __init__(self, folder: Optional[Path] = None, kind: str = "mean"):
        """``folder``: the disk tier's (entries persist in ``folder/related``); None: RAM only.
        ``kind``: the embedding its vectors are (entries of another kind in the folder, from a
        server configured otherwise, are not comparable: left alone)."""
        self.kind = kind
        self.folder = None if folder is None else Path(folder) / "related"
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        # group -> (ids, [n, D] vectors, window starts), rebuilt when the group changes
        self._matrices: dict[str, tuple[list[str], np.ndarray, list[int]]] = {}
        self._seen_mtime = -1.0
        self.dim: Optional[int] = None  # the vectors' length: the first valid entry's
        self.refresh()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, bid: str) -> bool:
        with self._lock:
            return bid in self._entries

    def add(self, bid: str, base: Base, vector: np.ndarray, window_start: int) -> None:
        entry = Entry(bid, group(base), np.asarray(vector, dtype=np.float32).reshape(-1), int(window_start))
        why = valid_vector(entry.vector, self.dim)
        if why is not None:
            log.warning("related entry of %s not indexed: %s", bid, why)
            return
        with self._lock:
            if self.dim is None:
                self.dim = entry.vector.size
            self._entries[bid] = entry
            self._matrices.pop(entry.group, None)
        if self.folder is not None:
            self._write(entry)

    def remove(self, bid: str) -> None:
        with self._lock:
            entry = self._entries.pop(bid, None)
            if entry is not None:
                self._matrices.pop(entry.group, None)
        if self.folder is not None:
            try:
                (self.folder / f"{bid}.json").unlink(missing_ok=True)
            except OSError as err:
                log.warning("cannot remove the related entry of %s (%s)", bid, err.strerror)

    def nearest(self, base: Base, vector: np.ndarray, holds: Callable[[str], bool], exclude: frozenset = frozenset()
                ) -> Optional[tuple[str, float, int]]:  # fmt: skip
        """The indexed base of ``base``'s group nearest to ``vector`` that the store ``holds``
        (entries it no longer holds are dropped on the way): (id, cosine similarity, its window
        start), or None."""
        self.refresh()
        key = group(base)
        vector = np.asarray(vector, dtype=np.float32).reshape(-1)
        norm = float(np.linalg.norm(vector)) if vector.size else 0.0
        if not np.isfinite(norm) or norm == 0.0:
            return None
        vector = vector / norm  # a query's scale does not change a cosine
        with self._lock:
            if key not in self._matrices:
                group_entries = [e for e in self._entries.values() if e.group == key and e.vector.size == vector.size]
                vectors = [e.vector for e in group_entries]
                self._matrices[key] = ([e.bid for e in group_entries],
                                       np.stack(vectors) if vectors else np.zeros((0, vector.size), np.float32),
                                       [e.window_start for e in group_entries])  # fmt: skip
            ids, matrix, windows = self._matrices[key]
        if not ids or matrix.shape[1] != vector.size:
            return None
        scores = np.clip(matrix @ vector, -1.0, 1.0)  # unit vectors: a cosine; clipped for rounding
        for k in np.argsort(-scores, kind="stable"):
            bid = ids[k]
            if bid in exclude:
                continue
            if holds(bid):
                return bid, float(scores[k]), windows[k]
            self.remove(bid)  # the store let it go
        return None

    def prune(self, holds: Callable[[str], bool]) -> int:
        """Drop every entry whose base the store no longer ``holds`` (RAM-only mode's bound);
        the number dropped."""
        with self._lock:
            gone = [bid for bid in self._entries if not holds(bid)]
        for bid in gone:
            self.remove(bid)
        return len(gone)

    # --- the disk side ---------------------------------------------------------------------------

    def _write(self, entry: Entry) -> None:
        data = json.dumps({"id": entry.bid, "group": entry.group, "window_start": entry.window_start, "kind": self.kind,
                           "vector": [float(v) for v in entry.vector]})  # fmt: skip
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".json")
            follow_umask(fd)
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, self.folder / f"{entry.bid}.json")
        except OSError as err:  # the index is an optimisation: a base it misses is generated exactly
            log.warning("cannot write the related entry of %s (%s)", entry.bid, err.strerror)

    def refresh(self) -> None:
        """Re-read the folder's entries when it changed (a restart, another replica's bases,
        its evictions)."""
        if self.folder is None:
            return
        try:
            mtime = self.folder.stat().st_mtime
        except OSError:
            return
        if mtime == self._seen_mtime:
            return
        try:
            on_disk = {p.stem: p for p in self.folder.glob("*.json") if not p.name.startswith(".")}
        except OSError as err:
            log.warning("cannot list the related entries (%s)", err.strerror)
            return
        with self._lock:
            gone = [bid for bid in self._entries if bid not in on_disk]
            new = [bid for bid in on_disk if bid not in self._entries]
        loaded = {}
        for bid in new:
            path = on_disk[bid]
            try:
                raw, _ = read_regular(path, ENTRY_LIMIT)  # never a FIFO, a device or a symlink; never blocks
                data = json.loads(raw)
                if data.get("kind", "mean") != self.kind:
                    continue
                vector = np.asarray(data["vector"], dtype=np.float32)
                entry = Entry(str(data["id"]), str(data["group"]), vector, int(data["window_start"]))
            except FileNotFoundError:  # removed since the listing
                continue
            except NotAFileError as err:
                log.warning("related entry %s skipped: it %s", path, err)
                continue
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # being replaced, or damaged
                log.warning("related entry %s skipped: unreadable (%s)", path, err)
                continue
            why = valid_vector(entry.vector, self.dim)
            if why is None and entry.window_start < 0:
                why = f"a window start of {entry.window_start}"
            if why is not None:
                log.warning("related entry %s skipped: %s", path, why)
                continue
            if self.dim is None:
                self.dim = entry.vector.size
            loaded[bid] = entry
        with self._lock:
            for bid in gone:
                self._entries.pop(bid, None)
            self._entries.update({bid: e for bid, e in loaded.items() if e.bid == bid})
            self._matrices.clear()
            self._seen_mtime = mtime
