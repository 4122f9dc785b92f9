"""The base-state store: RAM and disk tiers with byte budgets, LRU eviction, pins, stats.

A base is keyed by (model fingerprint, prompt, negative prompt, seed, steps, guidance, size);
its id is a hash of that key, so the same request finds the same base after a restart. The
store keeps, per base, the cache-window latents (the last one is the final latent) and the
base's K/V; the unconditional K/V are kept once per negative prompt and shared.

Tiers are inclusive: with a disk tier every ``put`` writes the base's file first (atomically:
temporary file, fsync, rename), and RAM holds a most-recently-used subset. Evicting from RAM
drops the copy there; evicting from disk deletes the file. A budget is never exceeded, and a
pinned base (one a running tail uses) is never evicted. All methods are thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from .config import Base
from .errors import ArtifactError, EditRtError
from .state import KV, BaseState
from .store_codec import StoragePrecision, decode, encode, from_bytes, to_bytes

log = logging.getLogger(__name__)


class UnknownBaseError(EditRtError):
    """No base with this id is in the store (never stored, deleted, or evicted)."""


class StoreFullError(EditRtError):
    """A base cannot be stored without breaking a budget (everything else is pinned)."""


def base_id(fingerprint: str, base: Base) -> str:
    key = json.dumps({"fingerprint": fingerprint, **asdict(base)}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _header(path: Path) -> dict:
    """The metadata of a safetensors file, read without loading its tensors ({} if unreadable)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > min(path.stat().st_size, 100_000_000):  # not a safetensors header length
                return {}
            return json.loads(f.read(n)).get("__metadata__") or {}
    except (OSError, ValueError):
        return {}


def _token_axis(i: int) -> int:
    """K/V tensor i's token axis (K is [1, heads, head_dim, 77], V [1, heads, 77, head_dim])."""
    return -1 if i % 2 == 0 else -2


def _uncond_id(fingerprint: str, negative_prompt: str) -> str:
    return "u" + hashlib.sha256(f"{fingerprint}\0{negative_prompt}".encode()).hexdigest()[:23]


@dataclass
class _Entry:
    tensors: dict[str, np.ndarray]
    meta: dict[str, str]
    uncond: str

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass
class StoreStats:
    hits_ram: int = 0
    hits_disk: int = 0
    misses: int = 0
    evictions_ram: int = 0
    evictions_disk: int = 0
    disk_loads: int = 0
    disk_load_seconds: float = 0.0
    refused_files: int = 0


class BaseStore:
    def __init__(
        self,
        fingerprint: str,
        ram_bytes: int,
        disk_dir: Optional[Path] = None,
        disk_bytes: int = 0,
        latents_precision: StoragePrecision = "fp32",
        kv_precision: StoragePrecision = "fp32",
    ):
        self.fingerprint = fingerprint
        self.ram_budget = ram_bytes
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.disk_budget = disk_bytes if disk_dir is not None else 0
        self.latents_precision = latents_precision
        self.kv_precision = kv_precision
        self._lock = threading.RLock()
        self._ram: OrderedDict[str, _Entry] = OrderedDict()  # LRU first
        self._uncond_ram: dict[str, dict[str, np.ndarray]] = {}
        self._disk: OrderedDict[str, tuple[int, str]] = OrderedDict()  # id -> (file bytes, uncond id), LRU first
        self._disk_uncond: dict[str, int] = {}  # uncond id -> file bytes
        self._pins: Counter[str] = Counter()
        self._stats = StoreStats()
        if self.disk_dir is not None:
            self._scan_disk()

    # --- public API ---------------------------------------------------------------------------

    def put(self, state: BaseState) -> str:
        """Store ``state``; return its id. Re-putting an existing base refreshes it."""
        if state.fingerprint != self.fingerprint:
            raise ArtifactError("this base state comes from another model than the store's")
        bid = base_id(self.fingerprint, state.base)
        uid = _uncond_id(self.fingerprint, state.base.negative_prompt)
        pixels = (2, 3)  # a latent stack [steps, c, h, w]: one scale per step and channel
        tensors = encode("latents", state.latents, self.latents_precision, pixels)
        if state.uncond_out is not None:
            tensors.update(encode("uncond_out", state.uncond_out, self.latents_precision, pixels))
        for i, t in enumerate(state.cond_kv.tensors):
            tensors.update(encode(f"cond_{i}", t, self.kv_precision, (_token_axis(i),)))
        uncond = {}
        for i, t in enumerate(state.uncond_kv.tensors):
            uncond.update(encode(f"uncond_{i}", t, self.kv_precision, (_token_axis(i),)))
        meta = {
            "fingerprint": self.fingerprint,
            "base": json.dumps(asdict(state.base)),
            "window_start": str(state.window_start),
            "layers": str(len(state.cond_kv.tensors)),
            "uncond": uid,
        }
        entry = _Entry(tensors, meta, uid)
        with self._lock:
            if self.disk_dir is None:
                self._put_ram(bid, entry, uid, uncond)
                return bid
            if entry.nbytes > self.ram_budget:
                self._put_ram(bid, entry, uid, uncond)  # raises: store.ram_mb is below one base
            self._put_disk(bid, entry, uid, uncond)
            try:
                self._put_ram(bid, entry, uid, uncond)
            except StoreFullError:
                # RAM is full of pinned bases: the base is stored (on disk) and loads on its first get.
                log.info("base %s kept on disk only: RAM holds only pinned bases", bid)
        return bid

    def get(self, bid: str) -> BaseState:
        """The state of base ``bid``, from RAM or (promoted from) disk."""
        with self._lock:
            if bid in self._ram:
                self._ram.move_to_end(bid)
                self._touch_disk(bid)
                self._stats.hits_ram += 1
                return self._state(self._ram[bid])
            if bid in self._disk:
                entry, uncond = self._load(bid)
                self._stats.hits_disk += 1
                self._touch_disk(bid)
                try:
                    self._put_ram(bid, entry, entry.uncond, uncond)
                except StoreFullError:
                    log.warning("base %s served from disk: RAM is full of pinned bases", bid)
                    return self._state(entry, uncond)
                return self._state(self._ram[bid])
            self._stats.misses += 1
            raise UnknownBaseError(f"unknown base id {bid!r}: never stored, deleted or evicted; generate it again")

    def tier(self, bid: str) -> Optional[str]:
        with self._lock:
            return "ram" if bid in self._ram else "disk" if bid in self._disk else None

    def info(self, bid: str) -> dict:
        """A base's metadata and tier, without loading its tensors."""
        with self._lock:
            if bid in self._ram:
                entry = self._ram[bid]
                meta, nbytes = entry.meta, entry.nbytes
            elif bid in self._disk:
                meta, nbytes = _header(self._path(bid)), self._disk[bid][0]
            else:
                raise UnknownBaseError(f"unknown base id {bid!r}")
            return {
                "id": bid,
                "tier": self.tier(bid),
                "base": json.loads(meta.get("base", "{}")),
                "window_start": int(meta.get("window_start", 0)),
                "bytes": nbytes,
                "pinned": self._pins[bid] > 0,
                "latents_precision": self.latents_precision,
                "kv_precision": self.kv_precision,
            }

    def __contains__(self, bid: str) -> bool:
        return self.tier(bid) is not None

    def pin(self, bid: str) -> BaseState:
        with self._lock:
            state = self.get(bid)
            self._pins[bid] += 1
            return state

    def unpin(self, bid: str) -> None:
        with self._lock:
            self._pins[bid] -= 1
            if self._pins[bid] <= 0:
                del self._pins[bid]

    @contextmanager
    def pinned(self, bid: str) -> Iterator[BaseState]:
        """``with store.pinned(id) as state:`` the base cannot be evicted inside the block."""
        state = self.pin(bid)
        try:
            yield state
        finally:
            self.unpin(bid)

    def delete(self, bid: str) -> None:
        with self._lock:
            if bid not in self:
                raise UnknownBaseError(f"unknown base id {bid!r}")
            if self._pins[bid]:
                raise StoreFullError(f"base {bid} is in use by a running edit; delete it when that finishes")
            self._drop_ram(bid)
            self._drop_disk(bid)

    def stats(self) -> dict:
        with self._lock:
            return {
                "ram": {"entries": len(self._ram), "bytes": self._ram_bytes(), "budget": self.ram_budget},
                "disk": {"entries": len(self._disk), "bytes": self._disk_bytes(), "budget": self.disk_budget},
                "pinned": len(self._pins),
                **asdict(self._stats),
            }

    # --- RAM tier -----------------------------------------------------------------------------

    def _ram_bytes(self) -> int:
        return sum(e.nbytes for e in self._ram.values()) + sum(
            sum(t.nbytes for t in u.values()) for u in self._uncond_ram.values()
        )

    def _put_ram(self, bid: str, entry: _Entry, uid: str, uncond: dict[str, np.ndarray]) -> None:
        self._drop_ram(bid, count=False)
        need = entry.nbytes + (0 if uid in self._uncond_ram else sum(t.nbytes for t in uncond.values()))
        if need > self.ram_budget:
            raise StoreFullError(
                f"store.ram_mb ({self.ram_budget / 2**20:.1f} MiB) is smaller than one base "
                f"({need / 2**20:.2f} MiB); raise store.ram_mb"
            )
        while self._ram_bytes() + need > self.ram_budget:
            victim = next((b for b in self._ram if not self._pins[b]), None)
            if victim is None:
                raise StoreFullError("the RAM tier is full of bases in use; retry when they finish")
            self._drop_ram(victim)
            need = entry.nbytes + (0 if uid in self._uncond_ram else sum(t.nbytes for t in uncond.values()))
        self._uncond_ram.setdefault(uid, uncond)
        self._ram[bid] = entry

    def _drop_ram(self, bid: str, count: bool = True) -> None:
        entry = self._ram.pop(bid, None)
        if entry is None:
            return
        if count:
            self._stats.evictions_ram += 1
        if not any(e.uncond == entry.uncond for e in self._ram.values()):
            self._uncond_ram.pop(entry.uncond, None)

    # --- disk tier ----------------------------------------------------------------------------

    def _path(self, bid: str) -> Path:
        return self.disk_dir / ("uncond" if bid.startswith("u") else "bases") / f"{bid}.safetensors"

    def _disk_bytes(self) -> int:
        return sum(size for size, _ in self._disk.values()) + sum(self._disk_uncond.values())

    def _scan_disk(self) -> None:
        for sub in ("bases", "uncond"):
            (self.disk_dir / sub).mkdir(parents=True, exist_ok=True)
            for tmp in (self.disk_dir / sub).glob("*.tmp"):
                tmp.unlink()  # a write that crashed before its rename: never part of the store
        files = sorted((self.disk_dir / "bases").glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
        for p in files:
            self._disk[p.stem] = (p.stat().st_size, _header(p).get("uncond", ""))
        for p in (self.disk_dir / "uncond").glob("*.safetensors"):
            self._disk_uncond[p.stem] = p.stat().st_size

    def _write(self, path: Path, data: bytes) -> None:
        """Atomic: a crash leaves either the old file or the new one, never a torn one."""
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _put_disk(self, bid: str, entry: _Entry, uid: str, uncond: dict[str, np.ndarray]) -> None:
        data = to_bytes(entry.tensors, entry.meta)
        uncond_data = None if uid in self._disk_uncond else to_bytes(uncond, {"fingerprint": self.fingerprint})
        new = len(data) + (len(uncond_data) if uncond_data else 0)
        if new > self.disk_budget:
            raise StoreFullError(
                f"store.disk_mb ({self.disk_budget / 2**20:.1f} MiB) is smaller than one base "
                f"({new / 2**20:.2f} MiB); raise store.disk_mb"
            )
        replaced = self._disk.get(bid, (0, ""))[0]
        while self._disk_bytes() - replaced + new > self.disk_budget:
            victim = next((b for b in self._disk if not self._pins[b] and b != bid), None)
            if victim is None:
                raise StoreFullError("the disk tier is full of bases in use; retry when they finish")
            self._drop_disk(victim, count=True)
            if uncond_data is None and uid not in self._disk_uncond:  # its only other user left
                uncond_data = to_bytes(uncond, {"fingerprint": self.fingerprint})
                new += len(uncond_data)
        if uncond_data is not None:
            self._write(self._path(uid), uncond_data)
            self._disk_uncond[uid] = len(uncond_data)
        self._write(self._path(bid), data)
        self._disk[bid] = (len(data), uid)
        self._disk.move_to_end(bid)

    def _drop_disk(self, bid: str, count: bool = False) -> None:
        if self._disk.pop(bid, None) is None:
            return
        if count:
            self._stats.evictions_disk += 1
        self._path(bid).unlink(missing_ok=True)
        # An uncond file goes with the last base on disk that uses it.
        used = {uid for _, uid in self._disk.values()}
        for uid in [u for u in self._disk_uncond if u not in used]:
            self._disk_uncond.pop(uid)
            self._path(uid).unlink(missing_ok=True)

    def _touch_disk(self, bid: str) -> None:
        if bid in self._disk:
            self._disk.move_to_end(bid)
            try:
                os.utime(self._path(bid))  # LRU order survives a restart through mtimes
            except OSError:
                pass

    def _load(self, bid: str) -> tuple[_Entry, dict[str, np.ndarray]]:
        path = self._path(bid)
        start = time.perf_counter()
        try:
            tensors, meta = from_bytes(path.read_bytes(), self.fingerprint, str(path))
            uid = meta.get("uncond", "")
            if uid in self._uncond_ram:
                uncond = self._uncond_ram[uid]
            else:
                upath = self._path(uid)
                if not uid or not upath.is_file():
                    raise ArtifactError(f"{path}: its unconditional K/V file {upath.name} is missing")
                uncond, _ = from_bytes(upath.read_bytes(), self.fingerprint, str(upath))
        except (OSError, ArtifactError) as err:
            # Never serve a damaged base: drop it from the index, keep the file for a post-mortem.
            self._disk.pop(bid, None)
            self._stats.refused_files += 1
            if path.exists():
                os.replace(path, path.with_suffix(".corrupt"))
            log.error("refused base %s: %s", bid, err)
            raise ArtifactError(f"base {bid} could not be restored from disk: {err}") from None
        self._stats.disk_loads += 1
        self._stats.disk_load_seconds += time.perf_counter() - start
        return _Entry(tensors, meta, uid), uncond

    def _state(self, entry: _Entry, uncond: Optional[dict[str, np.ndarray]] = None) -> BaseState:
        uncond = uncond if uncond is not None else self._uncond_ram[entry.uncond]
        layers = int(entry.meta["layers"])
        return BaseState(
            base=Base(**json.loads(entry.meta["base"])),
            fingerprint=entry.meta["fingerprint"],
            window_start=int(entry.meta["window_start"]),
            latents=decode("latents", entry.tensors),
            cond_kv=KV([decode(f"cond_{i}", entry.tensors) for i in range(layers)]),
            uncond_kv=KV([decode(f"uncond_{i}", uncond) for i in range(layers)]),
            uncond_out=decode("uncond_out", entry.tensors) if "uncond_out" in entry.tensors else None,
        )
