"""The store's disk tier: one folder, shared safely by every process that names it.

Files: ``bases/<id>.safetensors`` (a base: latents, the entry steps' unconditional
predictions, its prompt's K/V), ``uncond/<uid>.safetensors`` (a negative prompt's K/V, shared
by its bases) and ``deleted/<id>`` (a tombstone: an empty file saying a DELETE took the base
away; every process sharing the folder drops its RAM copy when it sees one, and a new put of
the base removes it). Each file is written to a unique temporary name (mkstemp), fsynced and
renamed into place, so a reader sees the old file or the new one, never a torn one.

Several processes may use one folder (``make demo`` and ``make serve`` share
``build/bases``): every change happens under one lock file (``.lock``, the ``filelock``
library), and the budget is checked against the folder itself, under that lock, before each
write: the folder stays within ``store.disk_mb`` whichever process writes. Readers never take
the lock (a file appears by rename, whole). A temporary file is removed only when its writer is
provably gone (its pid is not running, or it is over an hour old); a restart with a smaller
budget evicts at once. A disk that refuses a write (full, or over a quota) although the budget
has room makes the tier evict least recently used files until the write fits, once; then
:class:`DiskFullError`.

Nothing read from disk is trusted (store_files.py: regular files only, never a blocking open);
the checksum covers the header and the tensors, and the caller derives the file's name again
from the key it records; a file that fails is moved aside (``*.corrupt``, counted in the budget
and the first to go when room is needed) and its base answered as damaged, never served.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from filelock import FileLock, Timeout

from ..errors import (ArtifactError, DamagedBaseError, DiskFullError, EditRtError, StoreBusyError, StoreFullError,
                      UnknownBaseError)  # fmt: skip
from .store_codec import from_bytes, read_header
from .store_files import (NotAFileError, alive, is_disk_full, read_head, read_regular, regular_files, set_aside,
                          write_atomic)  # fmt: skip

log = logging.getLogger(__name__)

# A temporary file's name: .<target>.<pid>.<random>.tmp (mkstemp's prefix and suffix).
_TMP = re.compile(r"^\.(?P<target>[^.]+)\.(?P<pid>\d+)\..*\.tmp$")
ABANDONED_AFTER_S = 3600.0  # a temporary file this old is abandoned whoever wrote it
LOCK_TIMEOUT_S = 30.0  # one write takes milliseconds: a holder this slow is stopped or hung
SET_ASIDE_WAIT_S = 2.0  # a reader moving a bad file aside waits this long, then refuses it in place


class DiskTier:
    """The folder, its lock, and this process's view of it (refreshed under the lock)."""

    def __init__(self, folder: Path, budget: int, fingerprint: str):
        self.folder = Path(folder)
        self.budget = budget
        self.fingerprint = fingerprint
        if self.folder.exists() and not self.folder.is_dir():
            raise EditRtError(f"store.disk_dir: {self.folder} is a file, not a folder; point it at a folder")
        try:
            for sub in ("bases", "uncond", "deleted"):
                (self.folder / sub).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise EditRtError(f"store.disk_dir: cannot create {self.folder} ({err.strerror}); pick a writable folder") from None
        self.lock = FileLock(str(self.folder / ".lock"))
        # This process's view of the folder, read from any thread (stats, tier): only ever
        # touched under _mem, which is never held across file I/O.
        self._mem = threading.Lock()
        self.bases: OrderedDict[str, int] = OrderedDict()  # id -> file bytes, least recently used first
        self.unconds: dict[str, int] = {}  # uncond id -> file bytes
        self.corrupt: OrderedDict[Path, int] = OrderedDict()  # set-aside files, oldest first
        self._headers: dict[str, tuple[int, int, str]] = {}  # base id -> (size, mtime, its uncond id)
        self.evictions = 0
        self.disk_was_full = False
        with self._locked():
            self._rescan()
            self._fit(0, set())

    # --- paths and the folder's truth --------------------------------------------------------

    def path(self, bid: str) -> Path:
        return self.folder / ("uncond" if bid.startswith("u") else "bases") / f"{bid}.safetensors"

    def tombstone(self, bid: str) -> Path:
        return self.folder / "deleted" / bid

    @property
    def bytes(self) -> int:
        with self._mem:
            return sum(self.bases.values()) + sum(self.unconds.values()) + sum(self.corrupt.values())

    @property
    def entries(self) -> int:
        with self._mem:
            return len(self.bases)

    def has(self, bid: str) -> bool:
        """A regular file holds base ``bid`` (not verified: a get does that)."""
        try:
            return stat.S_ISREG(os.lstat(self.path(bid)).st_mode)
        except OSError:
            return False

    def deleted(self, bid: str) -> bool:
        """A DELETE (by any process on the folder) took base ``bid`` away: one lstat, no lock."""
        return os.path.lexists(self.tombstone(bid))

    @contextmanager
    def _locked(self, timeout: Optional[float] = None) -> Iterator[None]:
        timeout = LOCK_TIMEOUT_S if timeout is None else timeout
        try:
            self.lock.acquire(timeout=timeout)
        except Timeout:
            raise StoreBusyError(
                f"the store folder {self.folder} has been locked by another process for over {timeout:.0f} s "
                f"(stopped, or its filesystem hangs); retry, or find the holder with: lsof {self.lock.lock_file}"
            ) from None
        try:
            yield
        finally:
            self.lock.release()

    def _clean_temps(self) -> int:
        """Remove temporary files whose writer is gone; the bytes freed. Under the lock."""
        now, freed = time.time(), 0
        for sub in ("bases", "uncond"):
            for tmp in (self.folder / sub).glob(".*.tmp"):
                m = _TMP.match(tmp.name)
                try:
                    st = tmp.lstat()
                except FileNotFoundError:
                    continue
                if (m and not alive(int(m["pid"]))) or now - st.st_mtime > ABANDONED_AFTER_S:
                    try:
                        tmp.unlink()  # its writer died before the rename
                        freed += st.st_size
                    except OSError:
                        pass
        return freed

    def _rescan(self) -> None:
        """Re-read the folder (sizes, LRU order by mtime), removing dead writers' temporaries."""
        self._clean_temps()
        bases, corrupt = OrderedDict(), OrderedDict()
        for _, name, size in regular_files(self.folder / "bases"):
            if name.endswith(".safetensors"):
                bases[name[: -len(".safetensors")]] = size
            elif name.endswith(".corrupt"):
                corrupt[self.folder / "bases" / name] = size
        unconds = {}
        for _, name, size in regular_files(self.folder / "uncond"):
            if name.endswith(".safetensors"):
                unconds[name[: -len(".safetensors")]] = size
            elif name.endswith(".corrupt"):
                corrupt[self.folder / "uncond" / name] = size
        with self._mem:
            self.bases, self.unconds, self.corrupt = bases, unconds, corrupt

    def _uncond_of(self, bid: str) -> str:
        """The uncond id a base file refers to (its header; cached while its size and mtime hold)."""
        p = self.path(bid)
        try:
            st = p.lstat()
            cached = self._headers.get(bid)
            if cached is None or cached[:2] != (st.st_size, st.st_mtime_ns):
                cached = (st.st_size, st.st_mtime_ns, read_header(read_head(p)).get("uncond", ""))
                self._headers[bid] = cached
            return cached[2]
        except (OSError, NotAFileError, ValueError):
            return ""

    # --- eviction -----------------------------------------------------------------------------

    def _fit(self, incoming: int, pinned: set[str], keep_uid: Optional[str] = None) -> None:
        """Evict until ``incoming`` more bytes fit the budget. Under the lock."""
        while self.bytes + incoming > self.budget:
            if not self._evict_one(pinned, keep_uid):
                raise StoreFullError("the disk tier is full of bases in use; retry when they finish")

    def _evict_one(self, pinned: set[str], keep_uid: Optional[str]) -> bool:
        """Remove the least valuable file: a set-aside one, else the least recently used base
        not pinned (and the uncond files no base refers to any more). False: nothing can go."""
        with self._mem:
            junk = next(iter(self.corrupt), None)
            victim = None if junk is not None else next((b for b in self.bases if b not in pinned), None)
            if junk is not None:
                self.corrupt.pop(junk)
        if junk is not None:
            self._unlink(junk)
            return True
        if victim is None:
            return False
        self._remove(victim)
        self.evictions += 1
        self._collect_unconds(keep_uid)
        return True

    def _collect_unconds(self, keep_uid: Optional[str]) -> None:
        with self._mem:
            bases = list(self.bases)
        used = {self._uncond_of(b) for b in bases} | {keep_uid}
        self._headers = {b: self._headers[b] for b in bases if b in self._headers}
        with self._mem:
            unused = [u for u in self.unconds if u not in used]
            for uid in unused:
                self.unconds.pop(uid)
        for uid in unused:
            self._unlink(self.path(uid))

    def _remove(self, bid: str) -> None:
        with self._mem:
            self.bases.pop(bid, None)
        self._unlink(self.path(bid))
        self._unlink(self.folder / "related" / f"{bid}.json")  # its related-index entry (related_index.py)

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as err:  # a directory where a file was: a get sets it aside
            log.warning("cannot remove %s (%s)", path, err.strerror)

    # --- writing ------------------------------------------------------------------------------

    def put(self, bid: str, data: bytes, uid: str, uncond_bytes: Callable[[], bytes], pinned: set[str]) -> None:
        """Write a base (and its uncond file if the folder lacks it) within the folder's budget,
        and lift a DELETE's tombstone: the base is back for every process."""
        with self._locked():
            self._rescan()
            self._lift_tombstone(bid)  # first: removing needs no space, and a RAM copy must not be shadowed
            with self._mem:
                self.bases.pop(bid, None)  # the same base again replaces its file: its bytes do not count twice
                have_uncond = uid in self.unconds
            uncond_data = None if have_uncond else uncond_bytes()
            new = len(data) + (len(uncond_data) if uncond_data else 0)
            if new > self.budget:
                raise StoreFullError(
                    f"store.disk_mb ({self.budget / 2**20:.1f} MiB) is smaller than one base "
                    f"({new / 2**20:.2f} MiB); raise store.disk_mb"
                )
            self._fit(new, pinned, uid)
            try:
                self._write(bid, data, uid, uncond_data)
            except OSError as err:
                if not is_disk_full(err):
                    raise
                self._make_room(new, pinned, uid, err)
                try:
                    self._write(bid, data, uid, uncond_data)
                except OSError as again:
                    if not is_disk_full(again):
                        raise
                    raise self._disk_full(new, again) from None

    def _write(self, bid: str, data: bytes, uid: str, uncond_data: Optional[bytes]) -> None:
        for name, payload in ((uid, uncond_data), (bid, data)):
            if payload is None or (name == uid and uid in self.unconds):
                continue  # the folder has it (or the first try wrote it)
            path = self.path(name)
            try:
                odd = not stat.S_ISREG(os.lstat(path).st_mode)
            except FileNotFoundError:
                odd = False
            if odd and set_aside(path) is None:  # a directory there would fail the rename
                raise DamagedBaseError(f"cannot store base {bid}: {path} is not a file and cannot be moved; remove it")
            write_atomic(path, payload)
            with self._mem:
                if name == uid:
                    self.unconds[uid] = len(payload)
                else:
                    self.bases[bid] = len(payload)
                    self.bases.move_to_end(bid)

    def _make_room(self, need: int, pinned: set[str], uid: str, err: OSError) -> None:
        """The disk refused a write the budget allows (it is smaller than store.disk_mb, or
        others fill it): free at least what the write needs, dead writers' temporaries first,
        then set-aside files, then least recently used bases. Under the lock."""
        freed = self._clean_temps()
        while freed < need:
            before = self.bytes
            if not self._evict_one(pinned, uid):
                break
            freed += before - self.bytes
        if freed == 0:
            raise self._disk_full(need, err)
        # Once a warning: from then on the disk, not store.disk_mb, bounds the folder, and every put evicts.
        log.log(logging.INFO if self.disk_was_full else logging.WARNING,
                "the disk holding %s is full (%s): evicted %d bytes to write a base; it holds less than "
                "store.disk_mb, which could be lowered to what it holds", self.folder, err.strerror, freed)  # fmt: skip
        self.disk_was_full = True

    def _disk_full(self, need: int, err: OSError) -> DiskFullError:
        try:
            st = os.statvfs(self.folder)
            free = f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        return DiskFullError(
            f"the disk holding store.disk_dir ({self.folder}) is full ({err.strerror}; {free}, a base needs "
            f"{need / 2**20:.2f} MiB, nothing more of the store's can be evicted): free space on that disk, "
            f"or lower store.disk_mb ({self.budget / 2**20:.1f} MiB) to what it can hold"
        )

    def _lift_tombstone(self, bid: str) -> None:
        path = self.tombstone(bid)
        try:
            path.unlink(missing_ok=True)
        except OSError:  # a directory there: moved, so that the name is free
            set_aside(path)

    def delete(self, bid: str) -> None:
        """Remove a base for every process on the folder: its file, and a tombstone that makes
        the others drop their RAM copies."""
        with self._locked():
            self._remove(bid)  # first: the tombstone may need the space this frees
            try:
                fd = os.open(self.tombstone(bid), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                os.close(fd)
            except OSError as err:
                if self.deleted(bid):
                    pass  # something at the name says deleted already
                elif is_disk_full(err):
                    raise DiskFullError(f"base {bid} was removed from {self.folder}, but its tombstone could not be written "
                                        f"({err.strerror}): other servers on the folder may serve it from RAM until they "
                                        "restart; free space on that disk and delete it again") from None  # fmt: skip
                else:
                    raise
            self._rescan()
            self._collect_unconds(None)

    def touch(self, bid: str) -> None:
        with self._mem:
            if bid not in self.bases:
                return
            self.bases.move_to_end(bid)
        try:
            os.utime(self.path(bid), follow_symlinks=False)  # LRU order survives a restart, and is shared, through mtimes
        except OSError:
            pass

    # --- reading ------------------------------------------------------------------------------

    def load(self, bid: str, recorded_id: Callable[[dict], str]) -> tuple[dict, dict]:
        """(tensors, meta) of ``bid``, verified: ``recorded_id(meta)`` is the id the file's own
        key gives. Raises UnknownBaseError when the file is gone (evicted, maybe by another
        process), DamagedBaseError when it fails (and was set aside where it could be)."""

        def gone() -> Exception:
            with self._mem:
                self.bases.pop(bid, None)
            return UnknownBaseError(f"unknown base id {bid!r}: never stored, deleted or evicted; generate it again")

        return self._verified(bid, bid, recorded_id, gone,
                              lambda path, recorded: f"{path}: the file records the key of base {recorded}, not {bid} "
                                                     "(copied or renamed)")  # fmt: skip

    def load_uncond(self, uid: str, bid: str, recorded_id: Callable[[dict], str]) -> dict:
        """The unconditional K/V of ``uid`` for base ``bid``, verified like :meth:`load`: a
        file holding another negative prompt's K/V (or another precision's) is refused."""

        def gone() -> Exception:
            return DamagedBaseError(f"base {bid} is damaged: its negative prompt's file {self.path(uid).name} is missing; "
                                    "generate the base again")  # fmt: skip

        tensors, _ = self._verified(uid, bid, recorded_id, gone,
                                    lambda path, recorded: f"it records the key of {recorded}, another negative prompt "
                                                           "or precision (copied or renamed)")  # fmt: skip
        return tensors

    def _verified(self, key: str, bid: str, recorded_id: Callable[[dict], str], gone: Callable[[], Exception],
                  mismatch: Callable[[Path, str], str]) -> tuple[dict, dict]:  # fmt: skip
        """The file of ``key`` (a base's or an uncond's id) read as a regular file and verified,
        its recorded key hashing to ``key``; ``gone()`` is the error of a missing file,
        ``mismatch(path, recorded)`` the words for a file that records another key."""
        path = self.path(key)
        try:
            data, seen = read_regular(path, self.budget)
        except FileNotFoundError:
            raise gone() from None
        except NotAFileError as err:
            raise self._refused(path, bid, f"{path.name} {err}", err.identity, err.movable) from None
        try:
            tensors, meta = from_bytes(data, self.fingerprint, str(path))
            recorded = recorded_id(meta)
            if recorded != key:
                raise ArtifactError(mismatch(path, recorded))
        except (ArtifactError, KeyError, ValueError, TypeError) as err:
            raise self._refused(path, bid, err, seen) from None
        return tensors, meta

    def _refused(self, path: Path, bid: str, err: object, seen: Optional[tuple[int, int]] = None,
                 movable: bool = True) -> DamagedBaseError:  # fmt: skip
        """The error for a refused file of base ``bid`` (its own or its negative prompt's), set
        aside first where it can be."""
        own = path.parent.name == "bases"
        aside = self.quarantine(path, seen) if movable else None
        if aside is not None:
            if own:
                return DamagedBaseError(f"base {bid} is damaged and was set aside ({err}); generate it again")
            return DamagedBaseError(f"base {bid} is damaged: its negative prompt's file {path.name} was set aside "
                                    f"({err}); generate the base again")  # fmt: skip
        if not movable:
            return DamagedBaseError(f"base {bid} cannot be served: {err} (in {path.parent})")
        return DamagedBaseError(f"base {bid} is damaged: {path} is refused ({err}) and could not be set aside; remove it")

    def quarantine(self, path: Path, seen: Optional[tuple[int, int]] = None) -> Optional[Path]:
        """Move a refused file aside (kept for a post-mortem, out of the store's names, the first
        file evicted when room is needed); None when it could not be moved."""
        try:
            with self._locked(SET_ASIDE_WAIT_S):
                aside = set_aside(path, seen)
                st = aside.lstat() if aside is not None else None
                with self._mem:
                    (self.bases if path.parent.name == "bases" else self.unconds).pop(path.stem, None)
                    if st is not None and stat.S_ISREG(st.st_mode):
                        self.corrupt[aside] = st.st_size  # counted in the budget until evicted
        except (StoreBusyError, OSError):
            return None
        if aside is not None:
            log.error("set aside %s as %s", path, aside.name)
        return aside
