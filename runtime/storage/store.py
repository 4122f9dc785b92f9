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
answered as damaged; every file records its key, and a file whose key does not hash to its name
(a base's, or its negative prompt's K/V) is refused. A disk that stays full after evicting keeps
the base in RAM only (DiskFullError when RAM cannot hold it either). A DELETE leaves a tombstone
in the folder, so every process sharing it stops serving the base. All methods are thread-safe,
and none reads or writes a file while holding the in-process lock.
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

from ..errors import ArtifactError, DamagedBaseError, DiskFullError, StoreFullError, UnknownBaseError
from ..model.edit import Base
from ..model.schema import StoragePrecision
from ..model.state import KV, BaseState
from .store_codec import decode, encode, to_bytes
from .store_disk import DiskTier

__all__ = ["BaseStore", "base_id", "is_base_id"]

log = logging.getLogger(__name__)


def base_id(fingerprint: str, base: Base) -> str:
    fields = asdict(base)
    if fields.get("deepcache") == 1:  # every step full: left out, so ids already in PNGs and clients stay valid
        del fields["deepcache"]
    if fields.get("known") is None:  # likewise: only a plan's base has one
        del fields["known"]
    key = json.dumps({"fingerprint": fingerprint, **fields}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def is_base_id(bid: str) -> bool:
    """Whether ``bid`` has the form of a base id (24 hex digits, as :func:`base_id` makes them)."""
    return len(bid) == 24 and all(c in "0123456789abcdef" for c in bid)


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
    disk_full: int = 0  # puts the disk refused even after evicting (kept in RAM only, or refused)


class BaseStore:
    def __init__(
        self,
        fingerprint: str,
        ram_bytes: int,
        disk_dir: Optional[Path] = None,
        disk_bytes: int = 0,
        latents_precision: StoragePrecision = "fp32",
        kv_precision: StoragePrecision = "fp32",
        eviction: str = "lru",
    ):
        self.fingerprint = fingerprint
        self.ram_budget = ram_bytes
        self.latents_precision = latents_precision
        self.kv_precision = kv_precision
        if eviction not in ("lru", "lcbfu"):
            raise ValueError(f"store.eviction: {eviction!r} is not lru or lcbfu")
        self.eviction = eviction
        self._benefit: dict[str, float] = {}  # base id -> steps its related generations saved ("lcbfu")
        self._lock = threading.RLock()
        self._ram: OrderedDict[str, _Entry] = OrderedDict()  # LRU first
        self._uncond_ram: dict[str, dict[str, np.ndarray]] = {}
        self._pins: Counter[str] = Counter()
        self._stats = StoreStats()
        self.disk: Optional[DiskTier] = None if disk_dir is None else DiskTier(Path(disk_dir), disk_bytes, fingerprint)
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        self.disk_budget = disk_bytes if disk_dir is not None else 0

    # --- public API ---------------------------------------------------------------------------
    # File I/O (reading, verifying, writing, a tombstone's lstat) happens outside self._lock:
    # a slow or strange file delays its own request, never another base's or /metrics.

    def put(self, state: BaseState) -> str:
        """Store ``state``; return its id. Re-putting an existing base refreshes it (and undoes
        a DELETE for every process on the folder)."""
        if state.fingerprint != self.fingerprint:
            raise ArtifactError("this base state comes from another model than the store's")
        bid = base_id(self.fingerprint, state.base)
        uid = _uncond_id(self.fingerprint, state.base.negative_prompt, self.kv_precision)
        pixels = (2, 3)  # a latent stack [steps, c, h, w]: one scale per step and channel
        tensors = encode("latents", state.latents, self.latents_precision, pixels)
        if state.uncond_out is not None:
            tensors.update(encode("uncond_out", state.uncond_out, self.latents_precision, pixels))
        if state.x0 is not None:  # a multistep sampler's history: a latent per step, as the latents
            tensors.update(encode("x0", state.x0, self.latents_precision, pixels))
        if state.corrections is not None:  # small differences: kept in fp32 whatever the precision
            tensors.update(encode("corrections", state.corrections, "fp32", pixels))
        if state.source is not None:  # an inverted image's own pixels, as they came (uint8)
            tensors["source"] = np.ascontiguousarray(state.source, dtype=np.uint8)
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
            "kv_precision": self.kv_precision,  # with the key's negative prompt: what "uncond" must hash from
        }
        entry = _Entry(tensors, meta, uid)
        if self.disk is None or entry.nbytes > self.ram_budget:
            with self._lock:
                self._put_ram(bid, entry, uid, uncond)  # with a disk tier: raises, store.ram_mb is below one base
            return bid
        uncond_meta = {"fingerprint": self.fingerprint, "id": uid,
                       "negative_prompt": json.dumps(state.base.negative_prompt), "kv_precision": self.kv_precision}  # fmt: skip
        with self._lock:
            pinned = set(self._pins)
        try:
            self.disk.put(bid, to_bytes(entry.tensors, entry.meta), uid, lambda: to_bytes(uncond, uncond_meta), pinned)
        except DiskFullError as err:
            # Served from RAM by this process (not by siblings, not after a restart) rather than
            # thrown away after the work it cost; refused only when RAM cannot hold it either.
            with self._lock:
                self._stats.disk_full += 1
                self._stats.evictions_disk = self.disk.evictions
                try:
                    self._put_ram(bid, entry, uid, uncond)
                except StoreFullError:
                    raise err from None
            log.warning("base %s kept in RAM only: %s", bid, err)
            return bid
        with self._lock:
            self._stats.evictions_disk = self.disk.evictions
            try:
                self._put_ram(bid, entry, uid, uncond)
            except StoreFullError:
                # RAM is full of pinned bases: the base is stored (on disk) and loads on its first get.
                log.info("base %s kept on disk only: RAM holds only pinned bases", bid)
        return bid

    def get(self, bid: str) -> BaseState:
        """The state of base ``bid``, from RAM or (promoted from) disk."""
        held = self._from_ram(bid, promote=True)
        if held is not None:
            if self.disk is not None:
                self.disk.touch(bid)
            return self._state(*held)
        if self.disk is None:
            with self._lock:
                self._stats.misses += 1
            raise UnknownBaseError(f"unknown base id {bid!r}: never stored, deleted or evicted; generate it again")
        try:
            entry, uncond = self._load(bid)
        except UnknownBaseError:
            with self._lock:
                self._stats.misses += 1
            raise
        with self._lock:
            self._stats.hits_disk += 1
            try:
                self._put_ram(bid, entry, entry.uncond, uncond)
            except StoreFullError:
                log.warning("base %s served from disk: RAM is full of pinned bases", bid)
        self.disk.touch(bid)
        return self._state(entry, uncond)

    def tier(self, bid: str) -> Optional[str]:
        if self._deleted(bid):
            return None
        with self._lock:
            if bid in self._ram:
                return "ram"
        return "disk" if self.disk is not None and self.disk.has(bid) else None

    def info(self, bid: str) -> dict:
        """A base's metadata and tier; a file on disk is verified first (damaged: refused)."""
        held = self._from_ram(bid, promote=False)
        if held is not None:
            entry = held[0]
        elif self.disk is not None:
            entry, _ = self._load(bid)
        else:
            raise UnknownBaseError(f"unknown base id {bid!r}")
        with self._lock:
            pinned = self._pins[bid] > 0
        return {
            "id": bid,
            "tier": self.tier(bid),
            "base": json.loads(entry.meta["base"]),
            "window_start": int(entry.meta["window_start"]),
            "bytes": entry.nbytes,
            "pinned": pinned,
            "latents_precision": self.latents_precision,
            "kv_precision": self.kv_precision,
        }

    def __contains__(self, bid: str) -> bool:
        return self.tier(bid) is not None

    def pin(self, bid: str) -> BaseState:
        with self._lock:
            self._pins[bid] += 1  # first: the base cannot be evicted between the get and the pin
        try:
            return self.get(bid)
        except BaseException:
            self.unpin(bid)
            raise

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
        """Remove a base: from this process and, through the folder's tombstone, from every
        process sharing it (they drop their RAM copies at their next use of it)."""
        if bid not in self:
            raise UnknownBaseError(f"unknown base id {bid!r}")
        with self._lock:
            if self._pins[bid]:
                raise StoreFullError(f"base {bid} is in use by a running edit; delete it when that finishes")
            self._drop_ram(bid)
        if self.disk is not None:
            self.disk.delete(bid)

    def stats(self) -> dict:
        disk = {"entries": 0, "bytes": 0, "budget": 0}
        if self.disk is not None:
            disk = {"entries": self.disk.entries, "bytes": self.disk.bytes, "budget": self.disk_budget}
        with self._lock:
            return {
                "ram": {"entries": len(self._ram), "bytes": self._ram_bytes(), "budget": self.ram_budget},
                "disk": disk,
                "pinned": len(self._pins),
                **asdict(self._stats),
            }

    def _deleted(self, bid: str) -> bool:
        """A DELETE by any process on the folder took ``bid`` away; drops this RAM copy if so."""
        if self.disk is None or not self.disk.deleted(bid):
            return False
        with self._lock:
            if bid in self._ram and not self._pins[bid]:
                self._drop_ram(bid, count=False)
        return True

    def _from_ram(self, bid: str, promote: bool) -> Optional[tuple[_Entry, dict[str, np.ndarray]]]:
        """(entry, its uncond tensors) when RAM holds ``bid`` and no DELETE took it away."""
        if self._deleted(bid):
            with self._lock:
                self._stats.misses += promote
            raise UnknownBaseError(f"unknown base id {bid!r}: deleted; generate it again")
        with self._lock:
            entry = self._ram.get(bid)
            if entry is None:
                return None
            if promote:
                self._ram.move_to_end(bid)
                self._stats.hits_ram += 1
            return entry, self._uncond_ram[entry.uncond]

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
            victim = self._ram_victim()
            if victim is None:
                raise StoreFullError("the RAM tier is full of bases in use; retry when they finish")
            self._drop_ram(victim)
            need = entry.nbytes + (0 if uid in self._uncond_ram else sum(t.nbytes for t in uncond.values()))
        self._uncond_ram.setdefault(uid, uncond)
        self._ram[bid] = entry

    def _ram_victim(self) -> Optional[str]:
        """The unpinned base the RAM tier lets go first: the least recently used ("lru"), or the
        one whose related generations saved the fewest steps, least recent among equals ("lcbfu")."""
        free = (b for b in self._ram if not self._pins[b])  # least recently used first
        if self.eviction == "lru":
            return next(free, None)
        return min(free, key=lambda b: self._benefit.get(b, 0.0), default=None)  # min keeps the first of equals

    def credit(self, bid: str, steps: float) -> None:
        """``bid`` saved ``steps`` UNet steps (a related generation re-entered it): what "lcbfu"
        eviction keeps."""
        with self._lock:
            self._benefit[bid] = self._benefit.get(bid, 0.0) + steps

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
        """The id the base file's own recorded key gives (a copied or renamed file does not
        match), after checking that its uncond id is its negative prompt's."""
        base = Base(**json.loads(meta["base"]))
        if meta.get("uncond") != _uncond_id(self.fingerprint, base.negative_prompt, meta["kv_precision"]):
            raise ArtifactError("its negative prompt's file is not the one its key names")
        int(meta["window_start"]), int(meta["layers"])  # present and numbers, or ValueError
        return base_id(self.fingerprint, base)

    def _recorded_uncond_id(self, meta: dict) -> str:
        """The id an uncond file's recorded key (negative prompt, precision) gives."""
        return _uncond_id(self.fingerprint, json.loads(meta["negative_prompt"]), meta["kv_precision"])

    def _load(self, bid: str) -> tuple[_Entry, dict[str, np.ndarray]]:
        """Read and verify base ``bid`` from disk; called without self._lock."""
        start = time.perf_counter()
        try:
            tensors, meta = self.disk.load(bid, self._recorded_id)
            uid = meta["uncond"]
            with self._lock:
                uncond = self._uncond_ram.get(uid)
            if uncond is None:
                uncond = self.disk.load_uncond(uid, bid, self._recorded_uncond_id)
            entry = _Entry(tensors, meta, uid)
            self._state(entry, uncond)  # every tensor the header names is there, or KeyError
        except DamagedBaseError:
            with self._lock:
                self._stats.refused_files += 1
            raise
        except KeyError as err:
            with self._lock:
                self._stats.refused_files += 1
            self.disk.quarantine(self.disk.path(bid))
            raise DamagedBaseError(f"base {bid} is damaged and was set aside (no tensor {err}); generate it again") from None
        with self._lock:
            self._stats.disk_loads += 1
            self._stats.disk_load_seconds += time.perf_counter() - start
        return entry, uncond

    @staticmethod
    def _state(entry: _Entry, uncond: dict[str, np.ndarray]) -> BaseState:
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
            source=entry.tensors.get("source"),
            x0=decode("x0", entry.tensors) if "x0" in entry.tensors else None,
        )
