"""The store's disk tier: one folder, shared safely by every process that names it.

Files: ``bases/<id>.safetensors`` (a base: latents, the entry steps' unconditional
predictions, its prompt's K/V) and ``uncond/<uid>.safetensors`` (a negative prompt's K/V,
shared by its bases). Each is written to a unique temporary name (mkstemp), fsynced and renamed
into place, so a reader sees the old file or the new one, never a torn one.

Several processes may use one folder (``make demo`` and ``make serve`` share
``build/bases``): every change happens under one lock file (``.lock``, the ``filelock``
library), and the budget is checked against the folder itself, under that lock, before each
write: the folder stays within ``store.disk_mb`` whichever process writes. A temporary file
is removed only when its writer is provably gone (its pid is not running, or it is over an
hour old); a restart with a smaller budget evicts at once.

Nothing read from disk is trusted: the checksum covers the header and the tensors, and the
base id is derived again from the key the file records; a file that fails is moved aside
(``*.corrupt``) and its base answered as damaged, never served.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable, Optional

from filelock import FileLock

from ..errors import ArtifactError, EditRtError
from .store_codec import from_bytes, read_header

log = logging.getLogger(__name__)

# A temporary file's name: .<target>.<pid>.<random>.tmp (mkstemp's prefix and suffix).
_TMP = re.compile(r"^\.(?P<target>[^.]+)\.(?P<pid>\d+)\..*\.tmp$")
ABANDONED_AFTER_S = 3600.0  # a temporary file this old is abandoned whoever wrote it


class UnknownBaseError(EditRtError):
    """No base with this id is in the store (never stored, deleted, or evicted)."""


class StoreFullError(EditRtError):
    """A base cannot be stored without breaking a budget (everything else is pinned)."""


class DamagedBaseError(ArtifactError):
    """The base's file failed verification: it was moved aside and is never served."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier:
    """The folder, its lock, and this process's view of it (refreshed under the lock)."""

    def __init__(self, folder: Path, budget: int, fingerprint: str):
        self.folder = Path(folder)
        self.budget = budget
        self.fingerprint = fingerprint
        if self.folder.exists() and not self.folder.is_dir():
            raise EditRtError(f"store.disk_dir: {self.folder} is a file, not a folder; point it at a folder")
        try:
            for sub in ("bases", "uncond"):
                (self.folder / sub).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise EditRtError(f"store.disk_dir: cannot create {self.folder} ({err.strerror}); pick a writable folder") from None
        self.lock = FileLock(str(self.folder / ".lock"))
        self.bases: OrderedDict[str, int] = OrderedDict()  # id -> file bytes, least recently used first
        self.unconds: dict[str, int] = {}  # uncond id -> file bytes
        self._headers: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> its uncond id
        self.evictions = 0
        with self.lock:
            self._rescan(clean=True)
            self._fit(0, set(), ())

    # --- paths and the folder's truth --------------------------------------------------------

    def path(self, bid: str) -> Path:
        return self.folder / ("uncond" if bid.startswith("u") else "bases") / f"{bid}.safetensors"

    @property
    def bytes(self) -> int:
        return sum(self.bases.values()) + sum(self.unconds.values())

    def _rescan(self, clean: bool = False) -> None:
        """Re-read the folder (sizes, LRU order by mtime); ``clean`` removes abandoned temps."""
        if clean:
            now = time.time()
            for sub in ("bases", "uncond"):
                for tmp in (self.folder / sub).glob(".*.tmp"):
                    m = _TMP.match(tmp.name)
                    try:
                        age = now - tmp.stat().st_mtime
                    except FileNotFoundError:
                        continue
                    if (m and not _alive(int(m["pid"]))) or age > ABANDONED_AFTER_S:
                        tmp.unlink(missing_ok=True)  # its writer died before the rename
        entries = []
        for p in (self.folder / "bases").glob("*.safetensors"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue  # another process evicted it just now
            entries.append((st.st_mtime_ns, p.stem, st.st_size))
        self.bases = OrderedDict((bid, size) for _, bid, size in sorted(entries))
        self.unconds = {}
        for p in (self.folder / "uncond").glob("*.safetensors"):
            try:
                self.unconds[p.stem] = p.stat().st_size
            except FileNotFoundError:
                continue

    def _uncond_of(self, bid: str) -> str:
        """The uncond id a base file refers to (its header; cached by size and mtime)."""
        p = self.path(bid)
        try:
            st = p.stat()
            key = (str(p), st.st_size, st.st_mtime_ns)
            if key not in self._headers:
                with open(p, "rb") as f:
                    head = f.read(8)
                    n = int.from_bytes(head, "little")
                    self._headers[key] = read_header(head + f.read(min(n, 1 << 20))).get("uncond", "")
            return self._headers[key]
        except (OSError, ValueError):
            return ""

    def _fit(self, incoming: int, pinned: set[str], keep: Iterable[str]) -> None:
        """Evict least recently used bases (not pinned, not in ``keep``) until ``incoming`` more
        bytes fit; unconds no remaining base refers to go with them. Under the lock."""
        keep = set(keep)
        while self.bytes + incoming > self.budget:
            victim = next((b for b in self.bases if b not in pinned and b not in keep), None)
            if victim is None:
                raise StoreFullError("the disk tier is full of bases in use; retry when they finish")
            self._remove(victim)
            self.evictions += 1
            self._collect_unconds(keep_uids=())

    def _collect_unconds(self, keep_uids: Iterable[str]) -> None:
        used = {self._uncond_of(b) for b in self.bases} | set(keep_uids)
        for uid in [u for u in self.unconds if u not in used]:
            self.unconds.pop(uid)
            self.path(uid).unlink(missing_ok=True)

    def _remove(self, bid: str) -> None:
        self.bases.pop(bid, None)
        self.path(bid).unlink(missing_ok=True)

    # --- writing ------------------------------------------------------------------------------

    def _write(self, path: Path, data: bytes) -> None:
        """Atomic and unique: mkstemp beside the target, fsync, rename, fsync the folder."""
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.{os.getpid()}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)  # ours, and we know it failed
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def put(self, bid: str, data: bytes, uid: str, uncond_bytes: Callable[[], bytes], pinned: set[str]) -> None:
        """Write a base (and its uncond file if the folder lacks it) within the folder's budget."""
        with self.lock:
            self._rescan()
            uncond_data = None if uid in self.unconds else uncond_bytes()
            new = len(data) + (len(uncond_data) if uncond_data else 0)
            if new > self.budget:
                raise StoreFullError(
                    f"store.disk_mb ({self.budget / 2**20:.1f} MiB) is smaller than one base "
                    f"({new / 2**20:.2f} MiB); raise store.disk_mb"
                )
            self._remove_for_rewrite(bid)
            self._fit(new, pinned, keep=())
            if uncond_data is not None:
                self._write(self.path(uid), uncond_data)
                self.unconds[uid] = len(uncond_data)
            self._write(self.path(bid), data)
            self.bases[bid] = len(data)
            self.bases.move_to_end(bid)

    def _remove_for_rewrite(self, bid: str) -> None:
        # The same base again replaces its file: its bytes do not count twice.
        self.bases.pop(bid, None)

    def delete(self, bid: str) -> None:
        with self.lock:
            self._remove(bid)
            self._rescan()
            self._collect_unconds(keep_uids=())

    def touch(self, bid: str) -> None:
        if bid in self.bases:
            self.bases.move_to_end(bid)
            try:
                os.utime(self.path(bid))  # LRU order survives a restart, and is shared, through mtimes
            except OSError:
                pass

    # --- reading ------------------------------------------------------------------------------

    def load(self, bid: str, expected_id: Callable[[dict], str]) -> tuple[dict, dict, Optional[dict]]:
        """(tensors, meta, uncond tensors) of ``bid``, verified; the uncond tensors are None when
        the caller has them already (pass a meta check). Raises UnknownBaseError when the file
        is gone (evicted, maybe by another process), DamagedBaseError when it fails."""
        path = self.path(bid)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.bases.pop(bid, None)
            raise UnknownBaseError(f"unknown base id {bid!r}: never stored, deleted or evicted; generate it again") from None
        try:
            tensors, meta = from_bytes(data, self.fingerprint, str(path))
            recorded = expected_id(meta)
            if recorded != bid:
                raise ArtifactError(f"{path}: the file records the key of base {recorded}, not {bid} (copied or renamed)")
        except (ArtifactError, KeyError, ValueError, TypeError) as err:
            self.quarantine(path)
            raise DamagedBaseError(f"base {bid} is damaged and was set aside ({err}); generate it again") from None
        return tensors, meta, None

    def load_uncond(self, uid: str, bid: str) -> dict:
        path = self.path(uid)
        try:
            tensors, _ = from_bytes(path.read_bytes(), self.fingerprint, str(path))
        except FileNotFoundError:
            raise DamagedBaseError(f"base {bid} is damaged: its negative prompt's file {path.name} is missing") from None
        except ArtifactError as err:
            self.quarantine(path)
            raise DamagedBaseError(f"base {bid} is damaged: {err}") from None
        return tensors

    def quarantine(self, path: Path) -> None:
        """Move a failed file aside (kept for a post-mortem, out of the store's names)."""
        with self.lock:
            if path.exists():
                os.replace(path, path.with_suffix(".corrupt"))
            self.bases.pop(path.stem, None)
            self.unconds.pop(path.stem, None)
        log.error("set aside %s", path)

    def header(self, bid: str) -> dict:
        with open(self.path(bid), "rb") as f:
            head = f.read(8)
            return read_header(head + f.read(min(int.from_bytes(head, "little"), 1 << 20)))

