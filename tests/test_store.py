"""The base-state store: budgets, LRU, pins, persistence, damaged files, threads, precision."""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest

from edit_rt.runtime.errors import ArtifactError, StoreFullError, UnknownBaseError
from edit_rt.runtime.pipeline.edit_pipeline import KV, BaseState, TailRow
from edit_rt.runtime.storage.store import BaseStore, base_id

from .conftest import TEST_BASE

FP = "f" * 64


def fake_state(seed: int, negative: str = "", steps: int = 10, fingerprint: str = FP) -> BaseState:
    """A state with the real shapes of a small model and random contents, cheap to make."""
    rng = np.random.default_rng(seed)
    base = dataclasses.replace(TEST_BASE, seed=seed, negative_prompt=negative, steps=steps)
    # K/V in the step graph's layout (manifest kv_layout "heads-major"): K [1, heads, head_dim, 77],
    # V [1, heads, 77, head_dim]; int8 storage scales them per token (store._token_axis)
    shapes = [(1, 2, 16, 77), (1, 2, 77, 16), (1, 4, 16, 77), (1, 4, 77, 16)]
    kv = lambda r: KV([r.standard_normal(shape).astype(np.float32) for shape in shapes])  # noqa: E731
    latents = rng.standard_normal((steps + 1, 4, 16, 16)).astype(np.float32)
    # The unconditional K/V depend on the negative prompt alone, as the real ones do.
    uncond = kv(np.random.default_rng(sum(negative.encode())))
    return BaseState(base, fingerprint, 0, latents, kv(rng), uncond)


ONE = fake_state(0)
BASE_BYTES = ONE.latents.nbytes + ONE.cond_kv.nbytes  # per base; the uncond K/V is shared
UNCOND_BYTES = ONE.uncond_kv.nbytes


def _equal(a: BaseState, b: BaseState) -> None:
    assert a.base == b.base and a.window_start == b.window_start and a.fingerprint == b.fingerprint
    np.testing.assert_array_equal(a.latents, b.latents)
    for x, y in zip(a.cond_kv.tensors + a.uncond_kv.tensors, b.cond_kv.tensors + b.uncond_kv.tensors):
        np.testing.assert_array_equal(x, y)


def test_put_get_roundtrip_and_shared_uncond():
    store = BaseStore(FP, ram_bytes=10 * BASE_BYTES)
    states = [fake_state(i) for i in range(3)]
    ids = [store.put(s) for s in states]
    assert ids[0] == base_id(FP, states[0].base) and len(set(ids)) == 3
    for bid, s in zip(ids, states):
        got = store.get(bid)
        np.testing.assert_array_equal(got.latents, s.latents)
    # one uncond K/V set for the shared (empty) negative prompt, not three
    assert store.stats()["ram"]["bytes"] == 3 * BASE_BYTES + UNCOND_BYTES


def test_ram_lru_eviction_order_and_budget():
    budget = 3 * BASE_BYTES + UNCOND_BYTES
    store = BaseStore(FP, ram_bytes=budget)
    ids = [store.put(fake_state(i)) for i in range(3)]
    store.get(ids[0])  # 0 is now the most recent; 1 is the least
    ids.append(store.put(fake_state(3)))
    assert store.tier(ids[1]) is None and all(store.tier(b) == "ram" for b in (ids[0], ids[2], ids[3]))
    assert store.stats()["evictions_ram"] == 1
    for i in range(4, 20):
        store.put(fake_state(i))
        assert store.stats()["ram"]["bytes"] <= budget
    with pytest.raises(UnknownBaseError, match="unknown base id"):
        store.get(ids[1])
    assert store.stats()["misses"] == 1


def test_pinned_entries_are_never_evicted():
    store = BaseStore(FP, ram_bytes=2 * BASE_BYTES + UNCOND_BYTES)
    a, b = store.put(fake_state(0)), store.put(fake_state(1))
    with store.pinned(a), store.pinned(b):
        with pytest.raises(StoreFullError, match="in use"):
            store.put(fake_state(2))
        assert store.tier(a) == store.tier(b) == "ram"
        with pytest.raises(StoreFullError, match="in use by a running edit"):
            store.delete(a)
    store.put(fake_state(2))  # unpinned now: a, the least recent, goes
    assert store.tier(a) is None and store.tier(b) == "ram"


def test_with_a_disk_tier_a_put_past_pinned_ram_lands_on_disk(tmp_path):
    store = BaseStore(FP, ram_bytes=2 * BASE_BYTES + UNCOND_BYTES, disk_dir=tmp_path, disk_bytes=100 * BASE_BYTES)
    a, b = store.put(fake_state(0)), store.put(fake_state(1))
    with store.pinned(a), store.pinned(b):
        c = store.put(fake_state(2))
        assert (store.tier(a), store.tier(b), store.tier(c)) == ("ram", "ram", "disk")
        _equal(store.get(c), fake_state(2))  # served from disk while RAM is all pinned
        assert store.stats()["ram"]["bytes"] <= store.ram_budget


def test_a_budget_smaller_than_one_base_says_which_setting(tmp_path):
    with pytest.raises(StoreFullError, match="store.ram_mb"):
        BaseStore(FP, ram_bytes=BASE_BYTES // 2).put(ONE)
    with pytest.raises(StoreFullError, match="store.ram_mb"):
        BaseStore(FP, ram_bytes=BASE_BYTES // 2, disk_dir=tmp_path / "d", disk_bytes=100 * BASE_BYTES).put(ONE)
    with pytest.raises(StoreFullError, match="store.disk_mb"):
        BaseStore(FP, ram_bytes=10 * BASE_BYTES, disk_dir=tmp_path, disk_bytes=BASE_BYTES // 2).put(ONE)


def test_disk_tier_lru_budget_and_restart(tmp_path):
    disk_budget = 3 * BASE_BYTES + UNCOND_BYTES + 20_000  # room for 3 files and their headers
    store = BaseStore(FP, ram_bytes=BASE_BYTES + UNCOND_BYTES, disk_dir=tmp_path, disk_bytes=disk_budget)
    states = [fake_state(i) for i in range(5)]
    ids = [store.put(s) for s in states]
    stats = store.stats()
    assert stats["ram"]["entries"] == 1 and stats["disk"]["entries"] == 3 and stats["evictions_disk"] == 2
    assert stats["disk"]["bytes"] <= disk_budget
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
    assert on_disk == stats["disk"]["bytes"]
    assert [store.tier(b) for b in ids] == [None, None, "disk", "disk", "ram"]

    restarted = BaseStore(FP, ram_bytes=10 * BASE_BYTES, disk_dir=tmp_path, disk_bytes=disk_budget)
    for bid, s in zip(ids[2:], states[2:]):
        assert restarted.tier(bid) == "disk"
        _equal(restarted.get(bid), s)
        assert restarted.tier(bid) == "ram"
    stats = restarted.stats()
    assert stats["hits_disk"] == 3 and stats["disk_loads"] == 3 and stats["disk_load_seconds"] > 0
    restarted.delete(ids[2])
    assert not (tmp_path / "bases" / f"{ids[2]}.safetensors").exists()
    with pytest.raises(UnknownBaseError):
        restarted.get(ids[2])


def _stored(tmp_path, state=ONE):
    store = BaseStore(FP, ram_bytes=10 * BASE_BYTES, disk_dir=tmp_path, disk_bytes=100 * BASE_BYTES)
    bid = store.put(state)
    return bid, tmp_path / "bases" / f"{bid}.safetensors"


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "not a readable base-state file"),
        (lambda p: p.write_bytes(p.read_bytes()[:-10] + b"\x00" * 10), "checksum mismatch"),
        (lambda p: p.write_bytes(b"garbage"), "not a readable base-state file"),
    ],
)
def test_truncated_or_corrupt_files_are_refused_and_dropped(tmp_path, damage, message):
    bid, path = _stored(tmp_path)
    damage(path)
    store = BaseStore(FP, ram_bytes=10 * BASE_BYTES, disk_dir=tmp_path, disk_bytes=100 * BASE_BYTES)
    with pytest.raises(ArtifactError, match=message):
        store.get(bid)
    assert store.tier(bid) is None and store.stats()["refused_files"] == 1
    assert path.with_suffix(".corrupt").exists()  # kept aside for a post-mortem, never served
    with pytest.raises(UnknownBaseError):
        store.get(bid)


def test_a_file_from_another_model_is_refused(tmp_path):
    bid, _ = _stored(tmp_path)
    other = BaseStore("0" * 64, ram_bytes=10 * BASE_BYTES, disk_dir=tmp_path, disk_bytes=100 * BASE_BYTES)
    with pytest.raises(ArtifactError, match="belongs to another model"):
        other.get(bid)


def test_a_crash_between_write_and_rename_loses_nothing(tmp_path, monkeypatch):
    bid, path = _stored(tmp_path)
    before = path.read_bytes()
    store = BaseStore(FP, ram_bytes=10 * BASE_BYTES, disk_dir=tmp_path, disk_bytes=100 * BASE_BYTES)

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        store.put(fake_state(0, steps=10))  # the same base again: would overwrite its file
    with pytest.raises(OSError, match="simulated crash"):
        store.put(fake_state(1))
    monkeypatch.undo()
    assert path.read_bytes() == before
    restarted = BaseStore(FP, ram_bytes=10 * BASE_BYTES, disk_dir=tmp_path, disk_bytes=100 * BASE_BYTES)
    assert not list(tmp_path.rglob("*.tmp"))  # half-written files are cleaned up on start
    _equal(restarted.get(bid), ONE)
    assert restarted.tier(base_id(FP, fake_state(1).base)) is None


def test_many_threads_put_and_get_without_lost_or_torn_entries(tmp_path):
    # RAM holds 6 bases and 8 threads pin at once: puts then go to disk only, gets load from it.
    store = BaseStore(FP, ram_bytes=6 * BASE_BYTES + UNCOND_BYTES, disk_dir=tmp_path, disk_bytes=1000 * BASE_BYTES)
    states = {i: fake_state(i) for i in range(24)}
    errors, stored, stored_lock = [], [], threading.Lock()

    def worker(k: int) -> None:
        try:
            for i in range(k, 24, 8):
                bid = store.put(states[i])
                with stored_lock:
                    stored.append(i)
                    seen = list(stored)
                with store.pinned(bid) as got:
                    np.testing.assert_array_equal(got.latents, states[i].latents)
                for j in seen[::3]:  # bases any thread has finished storing
                    got = store.get(base_id(FP, states[j].base))
                    np.testing.assert_array_equal(got.cond_kv.tensors[2], states[j].cond_kv.tensors[2])
        except Exception as err:  # collected and reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    for i, s in states.items():
        _equal(store.get(base_id(FP, s.base)), s)
    assert store.stats()["ram"]["bytes"] <= store.ram_budget


def test_edit_from_a_disk_restored_base_equals_the_in_memory_one(tmp_path, pipeline, base_state):
    store = BaseStore(base_state.fingerprint, 64 * 2**20, tmp_path, 64 * 2**20)
    bid = store.put(base_state)
    restored = BaseStore(base_state.fingerprint, 64 * 2**20, tmp_path, 64 * 2**20).get(bid)
    rows = [TailRow("a blue square", 1.0, 4, TEST_BASE.guidance), TailRow("a green circle", 0.7, 6, 3.0)]
    np.testing.assert_array_equal(pipeline.run_tail(restored, rows), pipeline.run_tail(base_state, rows))


@pytest.mark.parametrize(
    "latents,kv,max_abs,mean_abs",
    # Bounds ~4x what was measured on the tiny test model (docs/store.md).
    [("fp16", "fp16", 1e-3, 1.2e-4), ("int8", "int8", 2.5e-2, 3.5e-3), ("fp32", "int8", 2.5e-4, 3e-5)],
)
def test_storage_precision_error_on_an_edited_image(pipeline, base_state, latents, kv, max_abs, mean_abs):
    """What fp16 / int8 storage does to an edited image, against the exact fp32 store."""
    rows = [TailRow("a blue square", 1.0, 4, TEST_BASE.guidance), TailRow("a green circle", 1.5, 2, TEST_BASE.guidance)]
    exact = pipeline.decode(pipeline.run_tail(base_state, rows))
    store = BaseStore(base_state.fingerprint, 64 * 2**20, latents_precision=latents, kv_precision=kv)
    lossy = store.get(store.put(base_state))
    images = pipeline.decode(pipeline.run_tail(lossy, rows))
    err = np.abs(images - exact)
    print(f"\nstorage {latents}/{kv}: max abs {err.max():.2e}, mean abs {err.mean():.2e} (images in [0, 1])")
    assert err.max() < max_abs and err.mean() < mean_abs
    assert store.stats()["ram"]["bytes"] < base_state.nbytes
