"""The base-state store: RAM and disk tiers with byte budgets, LRU eviction, pins, stats.

A base is keyed by (model fingerprint, prompt, negative prompt, seed, steps, guidance, size);
its id is a hash of that key, so the same request finds the same base after a restart. The
store keeps, per base, the cache-window latents (the last one is the final latent), the
unconditional prediction at each window step and the base's K/V; the unconditional K/V are kept
once per negative prompt and shared.

Tiers are inclusive: with a disk tier every ``put`` writes the base's file first (store_disk.py:
atomic, checksummed, within the folder's budget whichever process writes), and RAM holds a
most-recently-used subset. A budget is never exceeded, and a pinned base (one a running tail
uses) is never evicted from RAM. A file that fails verification is set aside and its base
answered as damaged. All methods are thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ..errors import ArtifactError
from ..model.edit import Base
from ..model.schema import StoragePrecision
from ..model.state import KV, BaseState
from .store_codec import decode, encode, to_bytes
from .store_disk import DamagedBaseError, DiskTier, StoreFullError, UnknownBaseError

__all__ = ["BaseStore", "base_id", "UnknownBaseError", "StoreFullError", "DamagedBaseError"]

log = logging.getLogger(__name__)


def base_id(fingerprint: str, base: Base) -> str:
    key = json.dumps({"fingerprint": fingerprint, **asdict(base)}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _token_axis(i: int) -> int:
    """K/V tensor i's token axis (K is [1, heads, head_dim, 77], V [1, heads, 77, head_dim])."""
    return -1 if i % 2 == 0 else -2


def _uncond_id(fingerprint: str, negative_prompt: Optional[str], precision: str) -> str:
    # The stored precision is part of what a file holds: an int8 copy is another set of values.
    # JSON tells the family's default (null) from any text, "None" included.
    key = f"{fingerprint}\0{json.dumps(negative_prompt)}\0{precision}"
    return "u" + hashlib.sha256(key.encode()).hexdigest()[:23]


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
        self.latents_precision = latents_precision
        self.kv_precision = kv_precision
        self._lock = threading.RLock()
        self._ram: OrderedDict[str, _Entry] = OrderedDict()  # LRU first
        self._uncond_ram: dict[str, dict[str, np.ndarray]] = {}
        self._pins: Counter[str] = Counter()
        self._stats = StoreStats()
        self.disk: Optional[DiskTier] = None if disk_dir is None else DiskTier(Path(disk_dir), disk_bytes, fingerprint)
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        self.disk_budget = disk_bytes if disk_dir is not None else 0

    # --- public API ---------------------------------------------------------------------------

    def put(self, state: BaseState) -> str:
        """Store ``state``; return its id. Re-putting an existing base refreshes it."""
        if state.fingerprint != self.fingerprint:
            raise ArtifactError("this base state comes from another model than the store's")
        bid = base_id(self.fingerprint, state.base)
        uid = _uncond_id(self.fingerprint, state.base.negative_prompt, self.kv_precision)
        pixels = (2, 3)  # a latent stack [steps, c, h, w]: one scale per step and channel
        tensors = encode("latents", state.latents, self.latents_precision, pixels)
        if state.uncond_out is not None:
            tensors.update(encode("uncond_out", state.uncond_out, self.latents_precision, pixels))
        if state.corrections is not None:  # small differences: kept in fp32 whatever the precision
            tensors.update(encode("corrections", state.corrections, "fp32", pixels))
        for i, t in enumerate(state.cond_kv.tensors):
            tensors.update(encode(f"cond_{i}", t, self.kv_precision, (_token_axis(i),)))
        uncond = {}
        for i, t in enumerate(state.uncond_kv.tensors):
            uncond.update(encode(f"uncond_{i}", t, self.kv_precision, (_token_axis(i),)))
        for name, t in state.cond_kv.extras.items():  # SDXL's pooled embedding: one vector, kept fp32
            tensors[f"cond_x_{name}"] = np.ascontiguousarray(t, dtype=np.float32)
        for name, t in state.uncond_kv.extras.items():
            uncond[f"uncond_x_{name}"] = np.ascontiguousarray(t, dtype=np.float32)
        meta = {
            "fingerprint": self.fingerprint,
            "id": bid,
            "base": json.dumps(asdict(state.base)),
            "window_start": str(state.window_start),
            "layers": str(len(state.cond_kv.tensors)),
            "extras": ",".join(sorted(state.cond_kv.extras)),
            "uncond": uid,
        }
        entry = _Entry(tensors, meta, uid)
        with self._lock:
            if self.disk is None:
                self._put_ram(bid, entry, uid, uncond)
                return bid
            if entry.nbytes > self.ram_budget:
                self._put_ram(bid, entry, uid, uncond)  # raises: store.ram_mb is below one base
            data = to_bytes(entry.tensors, entry.meta)
            self.disk.put(bid, data, uid, lambda: to_bytes(uncond, {"fingerprint": self.fingerprint, "id": uid}),
                          set(self._pins))  # fmt: skip
            self._stats.evictions_disk = self.disk.evictions
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
                if self.disk is not None:
                    self.disk.touch(bid)
                self._stats.hits_ram += 1
                return self._state(self._ram[bid])
            if self.disk is not None:
                try:
                    entry, uncond = self._load(bid)
                except UnknownBaseError:
                    self._stats.misses += 1
                    raise
                self._stats.hits_disk += 1
                self.disk.touch(bid)
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
            if bid in self._ram:
                return "ram"
            return "disk" if self.disk is not None and self.disk.path(bid).is_file() else None

    def info(self, bid: str) -> dict:
        """A base's metadata and tier; a file on disk is verified first (damaged: refused)."""
        with self._lock:
            if bid in self._ram:
                entry = self._ram[bid]
            elif self.disk is not None:
                entry, _ = self._load(bid)
            else:
                raise UnknownBaseError(f"unknown base id {bid!r}")
            return {
                "id": bid,
                "tier": self.tier(bid),
                "base": json.loads(entry.meta["base"]),
                "window_start": int(entry.meta["window_start"]),
                "bytes": entry.nbytes,
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
            if self.disk is not None:
                self.disk.delete(bid)

    def stats(self) -> dict:
        with self._lock:
            disk = {"entries": 0, "bytes": 0, "budget": 0}
            if self.disk is not None:
                disk = {"entries": len(self.disk.bases), "bytes": self.disk.bytes, "budget": self.disk_budget}
            return {
                "ram": {"entries": len(self._ram), "bytes": self._ram_bytes(), "budget": self.ram_budget},
                "disk": disk,
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

    def _recorded_id(self, meta: dict) -> str:
        """The id the file's own recorded key gives (a copied or renamed file does not match)."""
        if meta.get("id") != base_id(self.fingerprint, Base(**json.loads(meta["base"]))):
            raise ArtifactError("its recorded id does not match its recorded key")
        int(meta["window_start"]), int(meta["layers"])  # present and numbers, or ValueError
        return meta["id"]

    def _load(self, bid: str) -> tuple[_Entry, dict[str, np.ndarray]]:
        start = time.perf_counter()
        try:
            tensors, meta, _ = self.disk.load(bid, self._recorded_id)
            uid = meta.get("uncond", "")
            uncond = self._uncond_ram.get(uid)
            if uncond is None:
                uncond = self.disk.load_uncond(uid, bid)
            entry = _Entry(tensors, meta, uid)
            self._state(entry, uncond)  # every tensor the header names is there, or KeyError
        except DamagedBaseError:
            self._stats.refused_files += 1
            raise
        except KeyError as err:
            self._stats.refused_files += 1
            self.disk.quarantine(self.disk.path(bid))
            raise DamagedBaseError(f"base {bid} is damaged and was set aside (no tensor {err}); generate it again") from None
        self._stats.disk_loads += 1
        self._stats.disk_load_seconds += time.perf_counter() - start
        return entry, uncond

    def _state(self, entry: _Entry, uncond: Optional[dict[str, np.ndarray]] = None) -> BaseState:
        uncond = uncond if uncond is not None else self._uncond_ram[entry.uncond]
        layers = int(entry.meta["layers"])
        extras = [name for name in entry.meta.get("extras", "").split(",") if name]
        return BaseState(
            base=Base(**json.loads(entry.meta["base"])),
            fingerprint=entry.meta["fingerprint"],
            window_start=int(entry.meta["window_start"]),
            latents=decode("latents", entry.tensors),
            cond_kv=KV([decode(f"cond_{i}", entry.tensors) for i in range(layers)],
                       {name: entry.tensors[f"cond_x_{name}"] for name in extras}),
            uncond_kv=KV([decode(f"uncond_{i}", uncond) for i in range(layers)],
                         {name: uncond[f"uncond_x_{name}"] for name in extras}),
            uncond_out=decode("uncond_out", entry.tensors) if "uncond_out" in entry.tensors else None,
            corrections=decode("corrections", entry.tensors) if "corrections" in entry.tensors else None,
        )
