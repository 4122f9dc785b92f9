"""The store against a hostile or unlucky folder (issue 23): whatever a name holds (a FIFO, a
directory, a symlink, another key's file), a disk that fills up, and servers sharing one folder.
Real files throughout; the server-facing promises against a real server on loopback."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import yaml

from edit_rt.runtime.errors import DamagedBaseError, DiskFullError, StoreBusyError, UnknownBaseError
from edit_rt.runtime.web.http_errors import api_error
from edit_rt.runtime.serving.bases import Bases
from edit_rt.runtime.storage import store_codec, store_disk
from edit_rt.runtime.storage.store import BaseStore, base_id

from .in_process_server import InProcessServer
from .server_process import ServerProcess
from .test_store import BASE_BYTES, FP, UNCOND_BYTES, fake_state

CLI = [sys.executable, "-m", "edit_rt.runtime.apps.cli"]
BIG = 100 * BASE_BYTES


def _store(folder: Path, ram: int = 10 * BASE_BYTES, disk: int = BIG, **kw) -> BaseStore:
    return BaseStore(FP, ram_bytes=ram, disk_dir=folder, disk_bytes=disk, **kw)


def _file(folder: Path, bid: str) -> Path:
    return folder / ("uncond" if bid.startswith("u") else "bases") / f"{bid}.safetensors"


def _uncond_id_of(folder: Path, bid: str) -> str:
    """The negative prompt file a base file names (its header)."""
    return store_codec.read_header(_file(folder, bid).read_bytes())["uncond"]


def _unblocked(fn, hang_guard: float = 60.0):
    """fn() run in a thread: its result or exception. The tests make a blocked call block for
    good (a FIFO without a writer, a read held until released), so the join's timeout is a hang
    guard, never a speed bound."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(_call(fn)), daemon=True)
    t.start()
    t.join(hang_guard)
    assert not t.is_alive(), f"still blocked after {hang_guard} s"
    return out[0]


def _call(fn):
    try:
        return fn()
    except Exception as err:  # handed to the test, which checks its type
        return err


# --- 1. a name may hold anything: refused, set aside, never a hang --------------------------


def test_a_fifo_in_place_of_a_base_file_is_refused_at_once_and_set_aside(tmp_path):
    bid = _store(tmp_path).put(fake_state(0))
    path = _file(tmp_path, bid)
    path.unlink()
    os.mkfifo(path)  # no writer: a plain open() would wait forever
    fresh = _store(tmp_path)  # a restart: the base is not in RAM
    err = _unblocked(lambda: fresh.get(bid))
    assert isinstance(err, DamagedBaseError) and "a FIFO" in str(err) and "set aside" in str(err), err
    assert not os.path.lexists(path) and path.with_suffix(".corrupt").exists()
    assert isinstance(_call(lambda: fresh.get(bid)), UnknownBaseError)


@pytest.mark.parametrize("make", [lambda p: p.mkdir(), lambda p: p.symlink_to(p.with_name("elsewhere.safetensors"))],
                         ids=["directory", "symlink"])  # fmt: skip
def test_a_directory_or_symlink_in_place_is_set_aside_then_unknown(tmp_path, make):
    store = _store(tmp_path)
    bid, other = store.put(fake_state(0)), store.put(fake_state(1))
    path = _file(tmp_path, bid)
    shutil.copy(_file(tmp_path, other), path.with_name("elsewhere.safetensors"))  # a symlink to a good file
    path.unlink()
    make(path)
    fresh = _store(tmp_path)
    assert fresh.tier(bid) is None  # not a file: not on disk as far as the store is concerned
    with pytest.raises(DamagedBaseError, match="set aside"):
        fresh.info(bid)
    assert not os.path.lexists(path) and os.path.lexists(path.with_suffix(".corrupt"))
    with pytest.raises(UnknownBaseError):
        fresh.get(bid)
    _equal_latents(fresh.get(other), fake_state(1))  # everyone else is still served
    fresh.put(fake_state(0))  # and the base can be stored again under its name
    _equal_latents(_store(tmp_path).get(bid), fake_state(0))


def test_a_put_over_a_directory_at_its_name_sets_it_aside(tmp_path):
    store = _store(tmp_path)
    bid = base_id(FP, fake_state(0).base)
    (tmp_path / "bases" / f"{bid}.safetensors").mkdir()
    (tmp_path / "bases" / f"{bid}.safetensors" / "inside").write_bytes(b"x")
    assert store.put(fake_state(0)) == bid
    _equal_latents(_store(tmp_path).get(bid), fake_state(0))
    assert (tmp_path / "bases" / f"{bid}.corrupt" / "inside").exists()


def test_a_file_larger_than_the_whole_budget_is_refused_unread(tmp_path, monkeypatch):
    bid = _store(tmp_path).put(fake_state(0))
    fresh = _store(tmp_path)  # (a start evicts a file past the budget: grown after it)
    with open(_file(tmp_path, bid), "ab") as f:
        f.truncate(BIG + 1)  # sparse: no disk used, but a read would take it all
    monkeypatch.setattr(os, "read", lambda *a: pytest.fail("the file was read"))
    with pytest.raises(DamagedBaseError, match="more than the whole store.disk_mb budget"):
        fresh.get(bid)


def test_an_unreadable_file_is_refused_in_place_with_the_fix(tmp_path, monkeypatch):
    bid = _store(tmp_path).put(fake_state(0))
    path = _file(tmp_path, bid)
    path.chmod(0)
    if os.geteuid() == 0:  # root reads any file whatever its mode: its open refused as a user's would be
        real = os.open

        def as_a_user(p, *args, **kw):
            if str(p) == str(path):
                raise PermissionError(errno.EACCES, "Permission denied")
            return real(p, *args, **kw)

        monkeypatch.setattr(os, "open", as_a_user)
    with pytest.raises(DamagedBaseError, match="permission denied.*fix its owner or mode"):
        _store(tmp_path).get(bid)
    assert path.exists()  # maybe fine for its owner: not moved


# --- 2. every file is bound to its key ------------------------------------------------------


def test_a_swapped_negative_prompt_file_is_refused_set_aside_and_healed_by_a_put(tmp_path):
    store = _store(tmp_path)
    a, b = store.put(fake_state(0, negative="blurry")), store.put(fake_state(1, negative="dark"))
    ua, ub = _uncond_id_of(tmp_path, a), _uncond_id_of(tmp_path, b)
    assert ua != ub
    shutil.copy(_file(tmp_path, ub), _file(tmp_path, ua))  # another negative prompt's K/V, checksum intact
    fresh = _store(tmp_path)
    with pytest.raises(DamagedBaseError, match=f"base {a} is damaged: its negative prompt's file {ua}.*another negative prompt"):
        fresh.get(a)
    assert _file(tmp_path, ua).with_suffix(".corrupt").exists() and fresh.stats()["refused_files"] == 1
    with pytest.raises(DamagedBaseError, match="is missing; generate the base again"):
        fresh.get(a)  # never served, whatever is asked
    _equal_latents(fresh.get(b), fake_state(1, negative="dark"))
    fresh.put(fake_state(0, negative="blurry"))  # generating it again writes its file again
    got = _store(tmp_path).get(a)
    np.testing.assert_array_equal(got.uncond_kv.tensors[0], fake_state(0, negative="blurry").uncond_kv.tensors[0])


def test_a_negative_prompt_file_of_another_precision_is_refused(tmp_path):
    exact, small = _store(tmp_path / "fp32"), _store(tmp_path / "int8", kv_precision="int8")
    a = exact.put(fake_state(0, negative="blurry"))
    small.put(fake_state(0, negative="blurry"))
    (ua,) = [p.name for p in (tmp_path / "fp32" / "uncond").iterdir()]
    (ub,) = [p.name for p in (tmp_path / "int8" / "uncond").iterdir()]
    shutil.copy(tmp_path / "int8" / "uncond" / ub, tmp_path / "fp32" / "uncond" / ua)
    with pytest.raises(DamagedBaseError, match="another negative prompt or precision"):
        _store(tmp_path / "fp32").get(a)


def test_a_base_file_swapped_with_another_bases_is_refused(tmp_path):
    store = _store(tmp_path)
    a, b = store.put(fake_state(0)), store.put(fake_state(1))
    shutil.copy(_file(tmp_path, b), _file(tmp_path, a))
    with pytest.raises(DamagedBaseError, match=f"records the key of base {b}, not {a}"):
        _store(tmp_path).get(a)
    assert _file(tmp_path, a).with_suffix(".corrupt").exists()


def test_a_file_of_an_older_format_is_refused_naming_both_versions(tmp_path, monkeypatch):
    monkeypatch.setattr(store_codec, "FILE_FORMAT", "edit-rt-base/3")
    bid = _store(tmp_path).put(fake_state(0))
    monkeypatch.undo()
    with pytest.raises(DamagedBaseError, match=r"another edit-rt version \(edit-rt-base/3; this one reads edit-rt-base/5\)"):
        _store(tmp_path).get(bid)


def test_set_aside_files_count_in_the_budget_and_go_first(tmp_path):
    budget = 3 * BASE_BYTES + UNCOND_BYTES + 20_000  # three bases
    store = _store(tmp_path, disk=budget)
    ids = [store.put(fake_state(i)) for i in range(3)]
    _file(tmp_path, ids[0]).write_bytes(_file(tmp_path, ids[0]).read_bytes()[:-10] + b"\0" * 10)
    with pytest.raises(DamagedBaseError):
        _store(tmp_path, disk=budget).get(ids[0])
    assert _file(tmp_path, ids[0]).with_suffix(".corrupt").exists()
    store = _store(tmp_path, disk=budget)
    assert store.stats()["disk"]["bytes"] == sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()
                                                 and p.suffix in (".safetensors", ".corrupt"))  # fmt: skip
    store.put(fake_state(3))  # room for it: the set-aside file goes, not a good base
    assert not _file(tmp_path, ids[0]).with_suffix(".corrupt").exists()
    assert [store.tier(b) for b in ids[1:]] == ["disk", "disk"]


# --- 3. no file I/O under the store's lock --------------------------------------------------


def test_a_slow_file_delays_its_own_request_only(tmp_path, monkeypatch):
    store = _store(tmp_path)
    slow, quick = store.put(fake_state(0)), store.put(fake_state(1))
    fresh = _store(tmp_path)
    fresh.get(quick)  # in RAM
    real, started, release = store_disk.read_regular, threading.Event(), threading.Event()

    def stalled(path, limit):
        if slow in path.name:
            started.set()
            release.wait(120)  # a hung network filesystem, say: held until the others are answered
        return real(path, limit)

    monkeypatch.setattr(store_disk, "read_regular", stalled)
    reader = threading.Thread(target=fresh.get, args=(slow,))
    reader.start()
    assert started.wait(5)
    try:
        # each is answered while the read still stalls: under the store's lock they would wait for it
        got, stats, put = (_unblocked(fn, 30) for fn in (lambda: fresh.get(quick), fresh.stats, lambda: fresh.put(fake_state(2))))
    finally:
        release.set()
        reader.join()
    assert not any(isinstance(x, Exception) for x in (got, stats, put)), (got, stats, put)
    _equal_latents(got, fake_state(1))


def test_readers_never_wait_for_a_stuck_sibling_and_writers_give_up_clearly(tmp_path, monkeypatch):
    bid = _store(tmp_path).put(fake_state(0))
    fresh = _store(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from filelock import FileLock; "
                               f"l = FileLock({str(tmp_path / '.lock')!r}); l.acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)  # a stopped sibling, its lock still held
        # a reader that took the lock would give up with StoreBusyError after 0.5 s, not the latents
        monkeypatch.setattr(store_disk, "LOCK_TIMEOUT_S", 0.5)
        got = _unblocked(lambda: fresh.get(bid))
        _equal_latents(got, fake_state(0))
        err = _unblocked(lambda: fresh.put(fake_state(1)))
        assert isinstance(err, StoreBusyError) and "lsof" in str(err), err
        os.kill(holder.pid, signal.SIGKILL)  # a sibling's death releases its lock
        holder.wait()
        fresh.put(fake_state(1))
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_siblings_temporary_files_go_at_the_next_write(tmp_path):
    store = _store(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / "bases" / f".abc.{dead.pid}.x9.tmp"
    left.write_bytes(b"half a base")
    store.put(fake_state(0))
    assert not left.exists()


# --- 4. a full disk -------------------------------------------------------------------------


def _small_disk(monkeypatch, folder: Path, capacity: int) -> None:
    """A simulated filesystem of ``capacity`` bytes under ``folder``: os.write of a file there
    raises ENOSPC once the folder's files and the write would not fit (writes elsewhere pass)."""
    real = os.write

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return real(fd, data)
        if target.startswith(str(folder)):
            used = sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file())
            if used + len(data) > capacity:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_evicts_the_least_recently_used_and_retries(tmp_path, monkeypatch):
    _store(tmp_path / "scratch").put(fake_state(0))
    base_file, uncond_file = (next((tmp_path / "scratch" / sub).iterdir()).stat().st_size for sub in ("bases", "uncond"))
    folder = tmp_path / "store"
    store = _store(folder, ram=20 * BASE_BYTES)  # the budget allows 100 bases; the disk holds 3
    _small_disk(monkeypatch, folder, 3 * base_file + uncond_file + base_file // 2)
    ids = [store.put(fake_state(i)) for i in range(6)]
    stats = store.stats()
    assert stats["evictions_disk"] >= 3 and stats["disk_full"] == 0
    assert [store.tier(b) for b in ids] == ["ram"] * 6  # evicted from disk, still served from RAM
    assert _file(folder, ids[-1]).exists() and not _file(folder, ids[0]).exists()
    assert not list(folder.rglob("*.tmp"))  # the refused writes left nothing behind
    _equal_latents(_store(folder).get(ids[-1]), fake_state(5))


def test_a_disk_that_stays_full_keeps_bases_in_ram_and_then_says_what_to_do(tmp_path, monkeypatch):
    store = _store(tmp_path, ram=BASE_BYTES + UNCOND_BYTES)  # RAM holds one base
    _small_disk(monkeypatch, tmp_path, 0)  # not a byte: nothing to evict either
    a = store.put(fake_state(0))
    assert store.tier(a) == "ram" and store.stats()["disk_full"] == 1
    _equal_latents(store.get(a), fake_state(0))
    with store.pinned(a):  # RAM full of a base in use: nowhere to keep the next one
        with pytest.raises(DiskFullError, match="is full.*free space on that disk, or lower store.disk_mb"):
            store.put(fake_state(1))
    assert not list(tmp_path.rglob("*.tmp"))


def test_keep_answers_a_full_disk_507_naming_the_fix():
    """Bases.keep's refusal as the server answers it (the 507 needs RAM full of pinned bases
    too, which a real server reaches only by timing; the server tests below check the 200s a
    full disk still gives)."""
    import asyncio

    class Full:
        def put(self, state):
            raise DiskFullError("the disk holding store.disk_dir (x) is full (No space left on device; ...): "
                                "free space on that disk, or lower store.disk_mb")  # fmt: skip

    bases = Bases(SimpleNamespace())
    bases.store = Full()
    with pytest.raises(DiskFullError) as caught:
        asyncio.run(bases.keep(fake_state(0)))
    bases.close()
    answer = api_error(caught.value)  # RFC 4918's Insufficient Storage, no Retry-After (the operator's fix)
    assert answer.status == 507 and answer.code == "disk_full" and "store.disk_mb" in answer.message
    assert "Retry-After" not in answer.headers


# --- 5. shared folders: a DELETE is everyone's ----------------------------------------------


def test_a_delete_through_one_store_is_seen_by_another_and_a_put_revives(tmp_path):
    a, b = _store(tmp_path), _store(tmp_path)
    bid = a.put(fake_state(0))
    _equal_latents(b.get(bid), fake_state(0))  # now in b's RAM
    a.delete(bid)
    assert (tmp_path / "deleted" / bid).exists()
    for call in (b.get, b.pin, b.info, b.delete):
        with pytest.raises(UnknownBaseError):
            call(bid)
    assert b.tier(bid) is None and b.stats()["ram"]["entries"] == 0 and not b.stats()["pinned"]
    a.put(fake_state(0))
    assert not (tmp_path / "deleted" / bid).exists()
    _equal_latents(b.get(bid), fake_state(0))


def test_a_file_evicted_by_a_siblings_budget_leaves_ram_copies_valid(tmp_path):
    a = _store(tmp_path)
    bid = a.put(fake_state(0))
    small = _store(tmp_path, disk=2 * BASE_BYTES + UNCOND_BYTES + 20_000)
    for i in (1, 2):  # the folder's budget is now small's: 0 goes
        small.put(fake_state(i))
    assert not _file(tmp_path, bid).exists()
    _equal_latents(a.get(bid), fake_state(0))
    assert a.tier(bid) == "ram"


def _equal_latents(got, want) -> None:
    assert got.base == want.base
    np.testing.assert_array_equal(got.latents, want.latents)


# --- 6. against the served app ---------------------------------------------------------------


def _gen(client: httpx.Client, seed: int = 1, **extra) -> httpx.Response:
    body = {"prompt": "a red circle", "negative_prompt": "blurry", "seed": seed, **extra}
    return client.post("/v1/images/generations", json=body, timeout=120)


def _edit(client: httpx.Client, bid: str) -> httpx.Response:
    return client.post("/v1/images/edits", json={"base_id": bid, "edits": [{"prompt": "a cat", "tail_steps": 3}]}, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = InProcessServer(tmp_path_factory.mktemp("store-hard"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


def _folder(server: InProcessServer) -> Path:
    return Path(yaml.safe_load(server.config.read_text())["store"]["disk_dir"])


def test_a_fifo_for_a_base_answers_409_at_once_and_blocks_no_one(server):
    known = _gen(server.client, seed=31).json()["id"]
    stray = "0123456789abcdef0123fff0"
    fifo = _folder(server) / "bases" / f"{stray}.safetensors"
    os.mkfifo(fifo)
    with ThreadPoolExecutor(4) as pool:
        fifo_edit = pool.submit(_edit, server.client, stray)
        metrics = pool.submit(server.client.get, "/metrics", timeout=10)
        gen = pool.submit(_gen, server.client, seed=32)
        edit = pool.submit(_edit, server.client, known)
        # a FIFO opened in the way would block for good (no writer): the timeout is a hang guard
        r, m, g, e = (f.result(timeout=60) for f in (fifo_edit, metrics, gen, edit))
    assert r.status_code == 409 and r.json()["error"]["code"] == "base_damaged" and "a FIFO" in r.text, r.text
    assert m.status_code == g.status_code == e.status_code == 200
    assert server.client.get(f"/v1/bases/{stray}").status_code == 404  # set aside: unknown now
    assert not os.path.lexists(fifo)


def test_a_directory_for_a_base_answers_409_is_set_aside_then_404(server):
    stray = "0123456789abcdef0123fff1"
    folder = _folder(server) / "bases"
    (folder / f"{stray}.safetensors").mkdir()
    r = server.client.get(f"/v1/bases/{stray}")
    assert r.status_code == 409 and "a directory" in r.json()["error"]["message"], r.text
    assert (folder / f"{stray}.corrupt").is_dir()
    assert server.client.get(f"/v1/bases/{stray}").status_code == 404
    assert _edit(server.client, stray).status_code == 404


def test_a_swapped_negative_prompt_file_is_never_served(server, pipeline):
    """Two bases written by another process sharing the folder (never in this server's RAM);
    one's negative prompt file replaced by the other's: the edit answers 409, never an image."""
    from .conftest import TEST_BASE

    folder = _folder(server)
    writer = BaseStore(pipeline.manifest.fingerprint, 1 << 26, folder, 256 << 20)
    base = dataclasses.replace(TEST_BASE, steps=6, seed=41)
    a = writer.put(pipeline.generate_base(dataclasses.replace(base, negative_prompt="blurry, dark")))
    b = writer.put(pipeline.generate_base(dataclasses.replace(base, negative_prompt="bright")))
    ua, ub = _uncond_id_of(folder, a), _uncond_id_of(folder, b)
    shutil.copy(_file(folder, ub), _file(folder, ua))
    r = _edit(server.client, a)
    assert r.status_code == 409 and "another negative prompt" in r.json()["error"]["message"], r.text
    assert _file(folder, ua).with_suffix(".corrupt").exists()
    assert _edit(server.client, a).status_code == 409  # still never served
    assert _edit(server.client, b).status_code == 200


def test_two_servers_on_one_folder_a_delete_on_one_is_a_404_on_the_other(tmp_path, model_dir, onnx_dir):
    store = {"ram_mb": 64, "disk_dir": str(tmp_path / "shared"), "disk_mb": 256}
    # two services with a store each, on one folder (in this process: the folder is what they share)
    a, b = (InProcessServer(tmp_path / name, model_dir, onnx_dir, store=store) for name in ("a", "b"))
    try:
        bid = _gen(a.client, seed=51).json()["id"]
        assert _edit(b.client, bid).status_code == 200  # b loads it from the folder into its RAM
        assert b.client.get(f"/v1/bases/{bid}").json()["tier"] == "ram"
        assert a.client.delete(f"/v1/bases/{bid}").status_code == 200
        assert b.client.get(f"/v1/bases/{bid}").status_code == 404
        assert _edit(b.client, bid).status_code == 404
        assert _gen(a.client, seed=51).json()["id"] == bid  # generated again: back for everyone
        assert _edit(b.client, bid).status_code == 200
    finally:
        assert a.stop() and b.stop()


# --- 7. a real full filesystem (a tmpfs in a user namespace: no root needed) -----------------


def _userns_tmpfs() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_tmpfs = pytest.mark.skipif(not _userns_tmpfs(), reason="unshare -rm (user namespaces) is not available")


def _on_small_disk(folder: Path, size_kb: int, fill_kb: int, cmd: list[str]) -> list[str]:
    """``cmd`` run with ``folder`` a fresh tmpfs of ``size_kb``, ``fill_kb`` of it taken by a
    file that is not the store's."""
    folder.mkdir(parents=True, exist_ok=True)
    script = (f'mount -t tmpfs -o size={size_kb}k tmpfs "$0" && head -c {fill_kb * 1024} /dev/zero > "$0/other-data" '
              '&& exec "$@"')  # fmt: skip
    return ["unshare", "-rm", "sh", "-c", script, str(folder), *cmd]


@needs_tmpfs
def test_a_run_on_a_full_disk_succeeds_and_says_so_in_one_line(tmp_path, model_dir, onnx_dir):
    folder = tmp_path / "store"
    cfg = {"model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path / "out"),
           "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32}, "edits": [{"prompt": "y", "tail_steps": 2}],
           "store": {"ram_mb": 64, "disk_dir": str(folder), "disk_mb": 256}}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    r = subprocess.run(_on_small_disk(folder, 256, 252, [*CLI, "run", str(tmp_path / "run.yaml")]),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    warned = [line for line in r.stderr.splitlines() if "kept in RAM only" in line]
    assert len(warned) == 1 and "No space left on device" in warned[0] and "store.disk_mb" in warned[0], r.stderr
    assert (tmp_path / "out" / "report.json").exists()


@needs_tmpfs
def test_a_server_on_a_filling_disk_evicts_then_serves_from_ram_never_500(tmp_path, model_dir, onnx_dir, monkeypatch):
    folder = tmp_path / "store"
    real = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: real(_on_small_disk(folder, 2000, 200, cmd), **kw))
    proc = ServerProcess(tmp_path, model_dir, onnx_dir, store={"ram_mb": 64, "disk_dir": str(folder), "disk_mb": 256})
    monkeypatch.undo()
    try:
        made = [_gen(proc.client, seed=s) for s in range(12)]  # ~1.8 MiB free: three or four bases (0.4 MiB each), then evictions
        assert [r.status_code for r in made] == [200] * 12, [r.text for r in made if r.status_code != 200]
        ids = [r.json()["id"] for r in made]
        assert all(_edit(proc.client, bid).status_code == 200 for bid in (ids[0], ids[-1]))
        text = proc.client.get("/metrics").text
        evicted = [line for line in text.splitlines() if line.startswith("edit_rt_store_evictions") and "disk" in line]
        assert evicted and float(evicted[0].split()[-1]) > 0, text
    finally:
        assert proc.stop()
    log = Path(proc.log.name).read_text()
    assert "Traceback" not in log and " 500 " not in log
