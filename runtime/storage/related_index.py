"""Stored bases by their prompt's text embedding: the lookup of related generations.

A related generation (runtime/serving/related.py) needs the stored base nearest to a new prompt
among the bases it could re-enter: the same model (the store's), size, steps, guidance,
negative prompt, sampler, clip_skip, adapters and size conditioning (its :func:`group`). The
index keeps one unit vector per base (``PromptEncoding.prompt_embeddings``) and answers by
brute-force cosine in numpy: a matrix product over a group's vectors, ~10 us per thousand
bases of SD's 768-wide embeddings, so no ANN library earns its place below ~10^5 bases
(docs/related.md).

It follows the store:

- with a disk tier, every entry is also a small file ``<disk_dir>/related/<id>.json`` (written
  through mkstemp + os.replace, as the store writes), removed with its base's file when the
  disk tier evicts or deletes it (store_disk.py); :meth:`refresh` re-reads the folder when it
  changed, so a restart, or another replica sharing the folder, finds the bases already there;
- an entry whose base the store no longer holds (evicted from a RAM-only store, deleted) is
  dropped when a lookup finds it gone (:meth:`nearest` takes the store's membership test).
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
from .store_files import follow_umask

log = logging.getLogger(__name__)


def group(base: Base) -> str:
    """What a related base must share with a request: everything but the prompt and the seed
    (and the markers of what it came from)."""
    fields = asdict(base)
    for name in ("prompt", "seed", "image", "related"):
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
        self.refresh()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, bid: str) -> bool:
        with self._lock:
            return bid in self._entries

    def add(self, bid: str, base: Base, vector: np.ndarray, window_start: int) -> None:
        entry = Entry(bid, group(base), np.asarray(vector, dtype=np.float32).reshape(-1), int(window_start))
        with self._lock:
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
        with self._lock:
            if key not in self._matrices:
                group_entries = [e for e in self._entries.values() if e.group == key]
                vectors = [e.vector for e in group_entries]
                self._matrices[key] = ([e.bid for e in group_entries],
                                       np.stack(vectors) if vectors else np.zeros((0, vector.size), np.float32),
                                       [e.window_start for e in group_entries])  # fmt: skip
            ids, matrix, windows = self._matrices[key]
        if not ids or matrix.shape[1] != vector.size:
            return None
        scores = matrix @ vector
        for k in np.argsort(-scores, kind="stable"):
            bid = ids[k]
            if bid in exclude:
                continue
            if holds(bid):
                return bid, float(scores[k]), windows[k]
            self.remove(bid)  # the store let it go
        return None

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
        on_disk = {p.stem: p for p in self.folder.glob("*.json") if not p.name.startswith(".")}
        with self._lock:
            gone = [bid for bid in self._entries if bid not in on_disk]
            new = [bid for bid in on_disk if bid not in self._entries]
        loaded = {}
        for bid in new:
            try:
                data = json.loads(on_disk[bid].read_text())
                if data.get("kind", "mean") != self.kind:
                    continue
                loaded[bid] = Entry(data["id"], data["group"], np.asarray(data["vector"], dtype=np.float32), int(data["window_start"]))
            except (OSError, ValueError, KeyError, TypeError) as err:  # being replaced, or damaged: skipped
                log.debug("related entry %s unreadable (%s)", bid, err)
        with self._lock:
            for bid in gone:
                self._entries.pop(bid, None)
            self._entries.update({bid: e for bid, e in loaded.items() if e.bid == bid})
            self._matrices.clear()
            self._seen_mtime = mtime
