"""The related index's files are untrusted input (issue 35, item 5): a FIFO in
``<disk_dir>/related/`` hangs neither a start nor a lookup; an entry with a vector of the wrong
length, not finite or not unit is skipped; a planted entry naming another base (another step
count, an upload's) with a scaled vector is not served, and a similarity stays in [-1, 1]; in
RAM-only mode the index is bounded by the store's bases."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from edit_rt.runtime.serving.bases import Bases
from edit_rt.runtime.serving.related import RelatedGenerations
from edit_rt.runtime.storage.related_index import RelatedIndex, group
from edit_rt.runtime.storage.store import BaseStore

from .test_store import BASE_BYTES, FP, fake_state


def _vector(k: int, d: int = 8) -> np.ndarray:
    v = np.random.default_rng(k).standard_normal(d).astype(np.float32)
    return v / np.linalg.norm(v)


def _within(seconds, fn, *args):
    """fn(*args) on a daemon thread; its result, failing the test if it takes longer (a hang
    guard: a FIFO blocks an open forever, so the bound only needs to end the test)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn(*args)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} blocked past {seconds} s"
    return out.get("r")


def _plant(folder, name, **fields):
    (folder / "related").mkdir(parents=True, exist_ok=True)
    (folder / "related" / f"{name}.json").write_text(json.dumps(fields))


def _store(tmp_path):
    folder = tmp_path / "bases"
    return folder, BaseStore(FP, ram_bytes=4 * BASE_BYTES, disk_dir=folder, disk_bytes=8 * BASE_BYTES)


def test_a_fifo_in_the_related_folder_hangs_neither_a_start_nor_a_lookup(tmp_path):
    folder, store = _store(tmp_path)
    index = RelatedIndex(folder)
    state = fake_state(0)
    bid = store.put(state)
    index.add(bid, state.base, _vector(0), 0)
    os.mkfifo(folder / "related" / ("f" * 32 + ".json"))
    again = _within(30, RelatedIndex, folder)  # a restart
    found = _within(30, index.nearest, state.base, _vector(0), store.__contains__)  # a lookup after the folder changed
    assert found is not None and found[0] == bid and bid in again and "f" * 32 not in again


@pytest.mark.parametrize("vector", [[0.5, 0.5, 0.5], [float("nan")] * 8, (_vector(1) * 1000).tolist(), [0.0] * 8, "abc", [[1.0]]])
def test_an_entry_with_a_bad_vector_is_skipped_and_lookups_still_answer(tmp_path, vector):
    folder, store = _store(tmp_path)
    index = RelatedIndex(folder)
    state = fake_state(0)
    bid = store.put(state)
    index.add(bid, state.base, _vector(0), 0)
    other = fake_state(1)
    other_bid = store.put(other)
    _plant(folder, other_bid, id=other_bid, group=group(state.base), window_start=0, kind="mean", vector=vector)
    found = index.nearest(state.base, _vector(1), store.__contains__)  # no exception: never a 500
    assert found is not None and found[0] == bid and -1.0 <= found[1] <= 1.0
    assert other_bid not in index and other_bid not in RelatedIndex(folder)


def test_a_bad_vector_is_not_indexed_and_a_similarity_is_a_cosine(tmp_path):
    index = RelatedIndex(None)
    state = fake_state(0)
    index.add("a" * 32, state.base, _vector(0) * 1000, 0)
    index.add("c" * 32, state.base, _vector(0), 0)
    index.add("b" * 32, state.base, _vector(0)[:3] / np.linalg.norm(_vector(0)[:3]), 0)
    assert "a" * 32 not in index and "c" * 32 in index and "b" * 32 not in index  # the dimension is the first's (8)
    found = index.nearest(state.base, _vector(0) * 1000, lambda bid: True)  # a query's scale does not matter
    assert found[0] == "c" * 32 and -1.0 <= found[1] <= 1.0 and found[1] == pytest.approx(1.0, abs=1e-6)


def _service(store, index):
    metrics = SimpleNamespace(counts={}, inc=lambda name, v=1.0: metrics.counts.__setitem__(name, metrics.counts.get(name, 0) + v))
    cfg = SimpleNamespace(serve=SimpleNamespace(related=SimpleNamespace(
        enabled=True, thresholds=[SimpleNamespace(similarity=0.5, skip=0.4)], embedding="mean")))
    bases = Bases(metrics)
    bases.store = store
    svc = RelatedGenerations(cfg, metrics, bases)
    svc.attach(index, embed=None)  # the tests give the prompt vectors themselves
    return svc


@pytest.mark.parametrize("planted_as", ["other_steps", "upload"])
def test_a_planted_entry_naming_another_base_is_not_served(tmp_path, planted_as):
    folder, store = _store(tmp_path)
    index = RelatedIndex(folder)
    request = fake_state(0).base
    if planted_as == "other_steps":
        victim = fake_state(7, steps=12, negative=request.negative_prompt or "")
    else:
        victim = fake_state(7)
        victim = dataclasses.replace(victim, base=dataclasses.replace(victim.base, image="sha256:" + "0" * 64))
    vbid = store.put(victim)
    # the planted file claims the request's group and a vector x1000 (a similarity of ~1000)
    _plant(folder, vbid, id=vbid, group=group(request), window_start=0, kind="mean", vector=(_vector(5) * 1000).tolist())
    svc = _service(store, index)
    assert asyncio.run(svc.plan(request, _vector(5))) is None
    # a valid-looking vector but the stored base's key differs: still a miss, and unpinned
    _plant(folder, vbid, id=vbid, group=group(request), window_start=0, kind="mean", vector=_vector(5).tolist())
    os.utime(folder / "related", (time.time() + 5, time.time() + 5))
    index._seen_mtime = -1.0
    assert asyncio.run(svc.plan(request, _vector(5))) is None
    assert svc.metrics.counts.get("edit_rt_related_hits_total", 0) == 0
    store.delete(vbid)  # not pinned any longer


def test_a_genuine_entry_is_served_with_a_similarity_of_at_most_one(tmp_path):
    folder, store = _store(tmp_path)
    index = RelatedIndex(folder)
    state = fake_state(0)
    bid = store.put(state)
    svc = _service(store, index)
    svc.add(bid, state, _vector(0))
    plan = asyncio.run(svc.plan(dataclasses.replace(state.base, prompt="another", seed=9), _vector(0)))
    assert plan is not None and plan.bid == bid and plan.similarity <= 1.0
    svc.done(plan, True)


def test_an_upload_base_is_never_indexed(tmp_path):
    folder, store = _store(tmp_path)
    state = fake_state(0)
    state = dataclasses.replace(state, base=dataclasses.replace(state.base, image="sha256:" + "1" * 64))
    svc = _service(store, RelatedIndex(folder))
    svc.add(store.put(state), state, _vector(0))
    assert len(svc.index) == 0


def test_a_ram_only_index_is_bounded_by_the_stores_bases():
    store = BaseStore(FP, ram_bytes=2 * BASE_BYTES)
    svc = _service(store, RelatedIndex(None))
    for k in range(300):
        state = fake_state(k, steps=2)
        svc.add(store.put(state), state, _vector(k))
    assert len(svc.index) <= 2 * 64 + 2


def test_a_client_that_leaves_while_its_related_base_is_being_pinned_lets_the_pin_go(tmp_path):
    """The pin runs in the store's pool; a request cancelled while it runs (its client left)
    must not leave the base pinned (a pinned base is never evicted or deleted)."""
    folder, store = _store(tmp_path)
    state = fake_state(0)
    bid = store.put(state)
    svc = _service(store, RelatedIndex(folder))
    svc.add(bid, state, _vector(0))
    pinned, release = threading.Event(), threading.Event()
    pin = store.pin

    def slow_pin(b):
        out = pin(b)
        pinned.set()
        release.wait(5)  # the client leaves while the pool's thread is still here
        return out

    store.pin = slow_pin

    async def leave() -> bool:
        task = asyncio.ensure_future(svc.plan(dataclasses.replace(state.base, prompt="another", seed=9), _vector(0)))
        assert await asyncio.get_running_loop().run_in_executor(None, pinned.wait, 5)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 2
        while store.info(bid)["pinned"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return store.info(bid)["pinned"]

    assert asyncio.run(leave()) is False
    store.delete(bid)  # deletable: nothing holds it
    assert bid not in store
