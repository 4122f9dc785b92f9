"""Hardening (issue 13), one test per class of failure found by trying the service as a hostile
or clumsy user would: the server keeps serving others while the bad request gets its error."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import httpx
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edit_rt.runtime.config.load import config_from_dict
from edit_rt.runtime.errors import ConfigError, DamagedBaseError, ShuttingDownError
from edit_rt.runtime.loop.batcher import Batcher
from edit_rt.runtime.loop.jobs import Job, Request
from edit_rt.runtime.model.edit import TailRow
from edit_rt.runtime.storage.store import BaseStore

from .conftest import TEST_BASE
from .cli_in_process import Ran, edit_rt
from .in_process_server import InProcessServer
from .server_process import ServerProcess

STEPS = 6
CLI = [sys.executable, "-m", "edit_rt.runtime.apps.cli"]


def _gen(client: httpx.Client, seed: int = 1, **extra) -> httpx.Response:
    body = {"prompt": "a red circle", "negative_prompt": "blurry", "seed": seed, **extra}
    return client.post("/v1/images/generations", json=body, timeout=120)


def _edit(client: httpx.Client, bid: str, prompt: str = "a blue square", **extra) -> httpx.Response:
    body = {"base_id": bid, "edits": [{"prompt": prompt, "tail_steps": 3, **extra}]}
    return client.post("/v1/images/edits", json=body, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = InProcessServer(tmp_path_factory.mktemp("hard"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


# --- 1. a request that fails at admission fails alone -----------------------------------------


def test_a_prompt_the_tokenizer_cannot_take_fails_alone(server):
    bid = _gen(server.client).json()["id"]
    # JSON "\ud800": a lone UTF-16 surrogate, which the tokenizer cannot take
    bad = '{"base_id": "%s", "edits": [{"prompt": "a \\ud800 square", "tail_steps": 3}]}' % bid
    bad_gen = '{"prompt": "a red circle", "negative_prompt": "x \\udfff", "seed": 3}'
    with ThreadPoolExecutor(6) as pool:
        good = [pool.submit(_edit, server.client, bid, f"a {c} square") for c in ("blue", "green", "white")]
        refused = pool.submit(server.client.post, "/v1/images/edits", content=bad,
                              headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
        refused_gen = pool.submit(server.client.post, "/v1/images/generations", content=bad_gen,
                                  headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
        for r in (refused.result(), refused_gen.result()):
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert "unicode" in error["message"].lower() and error["param"] in ("edits[0].prompt", "negative_prompt")
        assert all(f.result().status_code == 200 for f in good)


def test_a_row_whose_encoding_fails_in_the_batcher_fails_alone(pipeline, base_state):
    """Past the API's checks, a row the text encoder refuses resolves with its own error while
    the rows admitted with it finish."""
    batcher = Batcher(pipeline.resolver, pipeline.new_scheduler(base_state.latents.shape[1:], 8)).start()
    try:
        request = Request("mixed")
        jobs = [Job(request, i, base_state.base, TailRow(p, 1.0, 6, TEST_BASE.guidance), state=base_state)
                for i, p in enumerate(["a blue square", "a \ud800 square", "a cat"])]  # fmt: skip
        batcher.submit(request, jobs)
        assert "cannot be encoded" in str(jobs[1].future.exception(timeout=60))
        assert jobs[0].future.result(timeout=60).latent is not None and jobs[2].future.result(timeout=60) is not None
        late = Request("late", deadline=time.monotonic() + 0.01)
        waiting = [Job(late, 0, base_state.base, TailRow("x", 1.0, 6, TEST_BASE.guidance), state=base_state)]
        time.sleep(0.05)
        batcher.submit(late, waiting)
        assert "deadline" in str(waiting[0].future.exception(timeout=30))
    finally:
        batcher.stop()
    assert not batcher.alive  # stopped on request, not by an error


# --- 2. the store trusts nothing it did not verify --------------------------------------------


def test_a_base_file_copied_under_another_id_is_refused_as_damaged(tmp_path, base_state):
    store = BaseStore(base_state.fingerprint, 1 << 26, tmp_path, 1 << 28)
    a = store.put(base_state)
    other = dataclasses.replace(base_state, base=dataclasses.replace(base_state.base, seed=99))
    b = store.put(other)
    (tmp_path / "bases" / f"{a}.safetensors").write_bytes((tmp_path / "bases" / f"{b}.safetensors").read_bytes())
    fresh = BaseStore(base_state.fingerprint, 1 << 26, tmp_path, 1 << 28)
    with pytest.raises(DamagedBaseError, match=f"base {a} is damaged.*records the key of base {b}"):
        fresh.get(a)
    assert (tmp_path / "bases" / f"{a}.corrupt").exists() and fresh.tier(a) is None


def test_an_edited_header_fails_the_checksum(tmp_path, base_state):
    store = BaseStore(base_state.fingerprint, 1 << 26, tmp_path, 1 << 28)
    bid = store.put(base_state)
    path = tmp_path / "bases" / f"{bid}.safetensors"
    data = path.read_bytes()
    edited = data.replace(b'"window_start":"0"', b'"window_start":"3"')
    assert edited != data and len(edited) == len(data)
    path.write_bytes(edited)
    fresh = BaseStore(base_state.fingerprint, 1 << 26, tmp_path, 1 << 28)
    with pytest.raises(DamagedBaseError, match="checksum mismatch"):
        fresh.info(bid)  # GET /v1/bases/{id} verifies too


def test_damaged_and_stray_bases_answer_409_never_500(server):
    bid = _gen(server.client, seed=21).json()["id"]
    other = _gen(server.client, seed=22).json()["id"]
    folder = Path(yaml.safe_load(server.config.read_text())["store"]["disk_dir"]) / "bases"
    (folder / f"{bid}.safetensors").write_bytes((folder / f"{other}.safetensors").read_bytes())
    server.client.delete(f"/v1/bases/{other}")  # not in RAM any more either
    # the damaged base is in this server's RAM: a restarted server would read the file; here a
    # stray copy under a third id does (it was never in RAM)
    stray = "0123456789abcdef01234567"
    for route in (lambda: server.client.get(f"/v1/bases/{stray}"), lambda: _edit(server.client, stray)):
        (folder / f"{stray}.safetensors").write_bytes((folder / f"{bid}.safetensors").read_bytes())
        r = route()
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "base_damaged" and stray in r.json()["error"]["message"]
        assert server.client.get(f"/v1/bases/{stray}").status_code == 404  # set aside: unknown now
    assert _edit(server.client, bid).status_code == 200  # everyone else is still served


# --- 3. processes sharing a store folder ------------------------------------------------------


def test_temporary_files_are_removed_only_when_their_writer_is_gone(tmp_path, base_state):
    store = BaseStore(base_state.fingerprint, 1 << 26, tmp_path, 1 << 28)
    alive = tmp_path / "bases" / f".abc.{os.getpid()}.x1.tmp"  # a write in flight in this process
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / "bases" / f".abc.{dead.pid}.x2.tmp"  # its writer was killed mid-write
    alive.write_bytes(b"half")
    gone.write_bytes(b"half")
    BaseStore(base_state.fingerprint, 1 << 26, tmp_path, 1 << 28)  # a second process starting
    assert alive.exists() and not gone.exists()
    del store


def test_a_restart_with_a_smaller_budget_evicts_at_once(tmp_path, base_state):
    store = BaseStore(base_state.fingerprint, 1 << 26, tmp_path, 1 << 28)
    for seed in range(4):
        store.put(dataclasses.replace(base_state, base=dataclasses.replace(base_state.base, seed=seed)))
    one = store.stats()["disk"]["bytes"] // 4 + 1
    smaller = BaseStore(base_state.fingerprint, 1 << 26, tmp_path, 2 * one)
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
    assert on_disk <= 2 * one and smaller.stats()["disk"]["entries"] < 4


@pytest.mark.slow  # ~20-50 s; the default run keeps the store's budget tests (test_store.py)
def test_a_server_and_a_run_sharing_a_store_folder_keep_its_budget(tmp_path, model_dir, onnx_dir):
    folder = tmp_path / "shared"
    budget_mb = 2.0  # room for a handful of the tiny model's bases
    proc = ServerProcess(tmp_path, model_dir, onnx_dir, base={"prompt": "x", "steps": STEPS, "width": 32, "height": 32},
                         store={"ram_mb": 64, "disk_dir": str(folder), "disk_mb": budget_mb})  # fmt: skip
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            size = 0
            for p in folder.rglob("*.safetensors"):
                try:
                    size += p.stat().st_size
                except FileNotFoundError:
                    pass
            peak[0] = max(peak[0], size)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    runs = []
    try:
        for k in range(3):  # `edit-rt run` on the same folder, between the server's writes
            cfg = {"model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path / f"out{k}"),
                   "base": {"prompt": f"run {k}", "steps": STEPS, "width": 32, "height": 32, "seed": k},
                   "store": {"ram_mb": 64, "disk_dir": str(folder), "disk_mb": budget_mb},
                   "edits": [{"prompt": "a cat", "tail_steps": 2}]}  # fmt: skip
            (tmp_path / f"run{k}.yaml").write_text(yaml.safe_dump(cfg))
            runs.append(subprocess.Popen([*CLI, "run", str(tmp_path / f"run{k}.yaml")], stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda s: _gen(proc.client, seed=s), range(24)))
        codes = [r.status_code for r in responses]
        for run in runs:
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, err.decode()
    finally:
        stop.set()
        watcher.join()
        assert proc.stop()
    assert codes == [200] * 24  # no failed write
    assert peak[0] <= budget_mb * 2**20, peak[0]
    print(f"shared folder: 24 server bases + 3 runs, peak {peak[0]} bytes of a {int(budget_mb * 2**20)}-byte budget")
    assert not list(folder.rglob("*.tmp"))


# --- 4. quantised stores do not mix precisions by timing --------------------------------------


def test_a_base_made_beside_int8_edits_equals_the_base_made_alone(tmp_path, pipeline, base_state):
    store = BaseStore(base_state.fingerprint, 1 << 26, kv_precision="int8")
    stored = store.get(store.put(base_state))  # its negative prompt's K/V, int8 round trip
    new_base = dataclasses.replace(TEST_BASE, seed=41)  # same negative prompt
    alone = pipeline.generate_base(new_base)
    batcher = pipeline.batcher(base_state.latents.shape[1:])
    request = Request("both", decode=False)
    edits = [Job(request, i, stored.base, TailRow("a cat", 1.0, 2, TEST_BASE.guidance), state=stored) for i in range(3)]
    gen = Job(request, 3, new_base, TailRow(new_base.prompt, 1.0, 0, new_base.guidance), noise=pipeline.initial_noise(new_base))
    results = batcher.run(request, [*edits, gen])
    np.testing.assert_array_equal(results[3].state.latents, alone.latents)


# --- 5. names from the wire stay bounded -------------------------------------------------------


@pytest.mark.slow  # ~10-20 s; the default run keeps test_answers.py's methods x routes
def test_odd_methods_and_huge_ids_stay_bounded(server):
    from prometheus_client.parser import text_string_to_metric_families

    def series() -> set:
        text = server.client.get("/metrics").text  # parsable: M-SEARCH and all
        return {(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(text) for s in f.samples}

    for k in range(40):
        server.client.request(f"X-ODD{k}", "/health")
    series(), series()  # the scrapes' own series are in from here on
    before = series()
    for k in range(40, 300):
        server.client.request(f"X-ODD{k}", "/health")
    server.client.request("M-SEARCH", "/health")
    after = series()
    assert after == before  # 260 more odd methods: not one more series
    methods = {dict(labels).get("method") for _, labels in after} - {None}
    assert methods <= {"GET", "POST", "DELETE", "HEAD", "OPTIONS", "PUT", "PATCH", "OTHER"}
    huge = "f" * 10_000  # (h11 refuses a request line past 16 KiB itself)
    r = server.client.get(f"/v1/bases/{huge}")
    assert r.status_code == 404 and len(r.text) < 1000


# --- 6. strict types, at the edge, for config and API alike -----------------------------------


@pytest.mark.parametrize("edit", [{"tail_steps": "3"}, {"strength": "1"}, {"tail_steps": True}, {"seed": 1.5}])
def test_the_api_coerces_nothing(server, edit):
    bid = _gen(server.client).json()["id"]
    r = _edit(server.client, bid, **edit)
    assert r.status_code == 400 and r.json()["error"]["param"] == f"edits[0].{next(iter(edit))}"


@pytest.mark.parametrize("steps", ["10", True])
def test_steps_must_be_an_integer(server, steps):
    r = _gen(server.client, steps=steps)
    assert r.status_code == 400 and r.json()["error"]["param"] == "steps"


def _config(model_dir, onnx_dir, tmp_path, **over) -> dict:
    return {"model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path / "out"),
            "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32}, "edits": [{"prompt": "y"}], **over}  # fmt: skip


def _cli_run(tmp_path, text: bytes | str) -> Ran:
    path = tmp_path / "config.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return edit_rt("run", str(path))


@pytest.mark.parametrize(
    "over,needle",
    [
        ({"store": {"ram_mb": float("nan")}}, "store.ram_mb: must be a finite number"),
        ({"serve": {"request_timeout_s": float("inf")}}, "serve.request_timeout_s: must be a finite number"),
        ({"threads": 10**20}, "threads: must lie in [0, 1024]"),
        ({"base": {"prompt": "x", "steps": True}}, "base.steps: must be an integer"),
        ({"serve": {"token": ""}}, "serve.token: empty"),
    ],
)
def test_bad_values_are_one_line_naming_the_field(tmp_path, model_dir, onnx_dir, over, needle):
    r = _cli_run(tmp_path, yaml.safe_dump(_config(model_dir, onnx_dir, tmp_path, **over)))
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_broken_files_and_folders_are_one_line(tmp_path, model_dir, onnx_dir):
    r = _cli_run(tmp_path, b"model: \xff\xfe\n")
    assert r.returncode == 2 and "not UTF-8" in r.stderr
    (tmp_path / "afile").write_text("x")
    r = _cli_run(tmp_path, yaml.safe_dump(_config(model_dir, onnx_dir, tmp_path, store={"disk_dir": str(tmp_path / "afile")})))
    assert r.returncode == 2 and "store.disk_dir" in r.stderr and "is a file" in r.stderr
    store = tmp_path / "store"
    r = _cli_run(tmp_path, yaml.safe_dump(_config(model_dir, onnx_dir, tmp_path, output_dir=str(tmp_path / "afile" / "out"),
                                                  store={"disk_dir": str(store)})))  # fmt: skip
    assert r.returncode == 2 and "output_dir" in r.stderr and "not a writable folder" in r.stderr
    # refused before the work, not after it: no base was generated into the store
    assert "Traceback" not in r.stderr and not list(store.rglob("*.safetensors")), r.stderr


def _drop_layers(build: Path) -> None:
    manifest = json.loads((build / "manifest.json").read_text())
    del manifest["layers"]
    (build / "manifest.json").write_text(json.dumps(manifest))


def _manifest_edit(edit):
    """A damage of manifest.json: ``edit`` changes its JSON, or is bytes to write instead."""

    def damage(build: Path) -> None:
        path = build / "manifest.json"
        if isinstance(edit, bytes):
            path.write_bytes(edit)
            return
        manifest = json.loads(path.read_text())
        edit(manifest)
        path.write_text(json.dumps(manifest))

    return damage


@pytest.mark.parametrize(
    "damage,needle",
    [
        (_drop_layers, "manifest.json: layers is missing"),
        (lambda build: (build / "tokenizer.json").unlink(), "tokenizer.json"),
        (_manifest_edit(b"\xff\xfe garbage"), "is unreadable"),
        (_manifest_edit(lambda m: m.__setitem__("graphs", 5)), "graphs is not valid"),
        (_manifest_edit(lambda m: m.__setitem__("model", None)), "model is not valid"),
        (_manifest_edit(lambda m: m["layers"][0].__setitem__("heads", "x")), "layers.0.heads is not valid"),
        (_manifest_edit(lambda m: m["graphs"]["unet_step"]["inputs"][0].__setitem__("name", 5)), "inputs.0.name is not valid"),
        (_manifest_edit(lambda m: m["graphs"]["unet_step"]["inputs"][0].__setitem__("dtype", "float99")), "'float99' is not a dtype"),
    ],
)
def test_damaged_artifacts_are_one_line(tmp_path, model_dir, onnx_dir, damage, needle):
    import shutil

    build = tmp_path / "build" / model_dir.name / "onnx"
    shutil.copytree(onnx_dir, build)
    damage(build)
    cfg = _config(model_dir, onnx_dir, tmp_path, build_dir=str(tmp_path / "build"))
    r = _cli_run(tmp_path, yaml.safe_dump(cfg))
    assert r.returncode == 2 and needle in r.stderr and "make export" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_weights_changed_with_the_same_size_and_mtime_are_caught(tmp_path, model_dir, onnx_dir):
    import shutil

    changed = tmp_path / "models" / model_dir.name
    shutil.copytree(model_dir, changed)
    build = tmp_path / "build" / model_dir.name / "onnx"
    shutil.copytree(onnx_dir, build)
    # the copy's manifest must trust the copy's stats first: refresh them the way export would
    from edit_rt.runtime.engine.manifest import model_fingerprint

    manifest = json.loads((build / "manifest.json").read_text())
    manifest["model"]["fingerprint"], manifest["model"]["file_stats"] = model_fingerprint(changed)
    (build / "manifest.json").write_text(json.dumps(manifest))
    weights = changed / "unet" / "diffusion_pytorch_model.safetensors"
    st_before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of one weight, same size
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))  # and the old mtime
    cfg = _config(changed, onnx_dir, tmp_path, build_dir=str(tmp_path / "build"))
    r = _cli_run(tmp_path, yaml.safe_dump(cfg))
    assert r.returncode == 2 and "exported from other weights" in r.stderr, r.stderr


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-16", categories=None, exclude_categories=()), max_size=700))
def test_fuzzed_prompts_never_get_a_5xx_or_a_traceback(server, model_dir, onnx_dir, tmp_path_factory, text):
    r = server.client.post("/v1/images/generations", content=json.dumps({"prompt": text or "x", "steps": 2}),
                   headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert r.status_code in (200, 400), r.text
    assert "error" in r.json() or "id" in r.json()
    try:
        config_from_dict(_config(model_dir, onnx_dir, tmp_path_factory.getbasetemp(), base={"prompt": text, "steps": 4, "width": 32, "height": 32}))
    except ConfigError:
        pass


# --- 7. shutdown drains ------------------------------------------------------------------------


def test_shutdown_answers_503_then_fails_what_runs_with_a_proper_error(tmp_path, model_dir, onnx_dir):
    proc = ServerProcess(tmp_path, model_dir, onnx_dir, serve={"drain_timeout_s": 1.0, "max_steps": 900},
                         base={"prompt": "x", "steps": STEPS, "width": 32, "height": 32})  # fmt: skip
    bid = _gen(proc.client).json()["id"]
    with ThreadPoolExecutor(3) as pool:
        long_run = pool.submit(_gen, proc.client, 7, steps=900)  # ~4 s of work: past the drain
        stream_lines = []

        def stream() -> None:
            body = {"base_id": bid, "stream": True, "edits": [{"prompt": "a cat", "tail_steps": 5}] * 8}
            with httpx.stream("POST", proc.url + "/v1/images/edits", json=body, timeout=60) as r:
                stream_lines.extend(r.iter_lines())

        streamed = pool.submit(stream)
        time.sleep(1.0)
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        during = _gen(proc.client, seed=8)
        assert during.status_code == 503 and during.headers.get("retry-after") == "5"
        assert during.json()["error"]["code"] == "shutting_down"
        r = long_run.result(timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        streamed.result(timeout=60)
    text = "\n".join(stream_lines)
    assert "event: edit_rt.done" in text and ("event: image_edit.completed" in text or "event: error" in text)
    proc.proc.wait(timeout=60)  # a hang guard; that the exit waits one timeout, not two, is the test below
    assert proc.stop()


def test_a_second_batcher_stop_returns_without_waiting(pipeline, base_state):
    """The drain's stop (timeout 0) fails what runs; the shutdown's stop after it (timeout 30)
    must neither wait on the loop's condition nor call the engine thread again: the process
    exits one timeout after SIGTERM, not two."""
    batcher = Batcher(pipeline.resolver, pipeline.new_scheduler(base_state.latents.shape[1:], 8)).start()
    request = Request("long")
    jobs = [Job(request, 0, base_state.base, TailRow("a cat", 1.0, 6, TEST_BASE.guidance), state=base_state)]
    batcher.submit(request, jobs)
    batcher.stop(timeout=0)
    assert isinstance(jobs[0].future.exception(timeout=60), ShuttingDownError)
    with mock.patch.object(batcher._cv, "wait", side_effect=AssertionError("the second stop waited")) as wait, \
         mock.patch.object(batcher.engine, "call", side_effect=AssertionError("the second stop called the engine")) as call:
        batcher.stop(timeout=30)
    assert not wait.called and not call.called


TOKEN = "tökén-sécret"


@pytest.fixture(scope="module")
def socket_server(tmp_path_factory, model_dir, onnx_dir):
    """One real process for what only a socket and a process show: slow clients timed out, and
    what reaches its access log."""
    proc = ServerProcess(tmp_path_factory.mktemp("hard-socket"), model_dir, onnx_dir, env={"EDIT_RT_TOKEN": TOKEN},
                         serve={"host": "127.0.0.1", "header_timeout_s": 1.0, "body_timeout_s": 1.0})  # fmt: skip
    yield proc
    assert proc.stop()


def test_slow_clients_are_timed_out(socket_server):
    proc = socket_server
    with socket.create_connection(("127.0.0.1", proc.port), timeout=10) as s:
        # closed by the server (uvicorn has no timer before a first request: without ours
        # the client's own 10 s timeout would raise here instead)
        assert s.recv(100) == b""
    with socket.create_connection(("127.0.0.1", proc.port), timeout=10) as s:
        s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + TOKEN.encode() + b"\r\ncontent-length: 100\r\n\r\n{\"prompt\"")  # fmt: skip
        reply = b""
        while b"}}" not in reply:
            chunk = s.recv(1000)
            if not chunk:
                break
            reply += chunk
        assert b" 408 " in reply.split(b"\r\n")[0] and b"body_timeout" in reply
    assert proc.client.get("/health").status_code == 200


# --- 8. access ---------------------------------------------------------------------------------


def test_tokens_never_reach_the_log_and_hosts_are_checked(socket_server):
    proc = socket_server
    proc.client.get(f"/?token={TOKEN}")
    auth = {"authorization": b"Bearer " + TOKEN.encode()}
    assert proc.client.get("/v1/bases/0123456789abcdef01234567", headers=auth).status_code == 404
    assert proc.client.get("/v1/bases/0123456789abcdef01234567", headers={"authorization": b"Bearer x"}).status_code == 401
    r = proc.client.get("/health", headers={"host": "evil.example"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "untrusted_host"
    assert proc.client.get("/health", headers={"host": f"localhost:{proc.port}"}).status_code == 200
    time.sleep(0.3)  # the access line is written after the response
    log = Path(proc.log.name).read_text()
    assert "GET / 200" in log and TOKEN not in log and "token=" not in log


# --- kill -9 ----------------------------------------------------------------------------------


@pytest.mark.slow  # ~20-50 s; the default run keeps the store's simulated crash (test_store.py)
def test_kill_9_loses_no_acknowledged_base(tmp_path, model_dir, onnx_dir):
    folder = tmp_path / "bases"
    acknowledged = []
    for round_ in range(3):
        proc = ServerProcess(tmp_path, model_dir, onnx_dir, store={"ram_mb": 64, "disk_dir": str(folder), "disk_mb": 256})
        stop = threading.Event()

        def client(offset: int) -> None:
            k = 0
            while not stop.is_set():
                try:
                    r = _gen(proc.client, seed=1000 * round_ + 100 * offset + k)
                except httpx.HTTPError:
                    return
                if r.status_code == 200:
                    acknowledged.append(r.json()["id"])
                k += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.5 + round_ * 0.37)
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait()
        stop.set()
        for t in threads:
            t.join()
        proc.log.close()
    assert len(acknowledged) >= 3
    proc = ServerProcess(tmp_path, model_dir, onnx_dir, store={"ram_mb": 64, "disk_dir": str(folder), "disk_mb": 256})
    try:
        for bid in acknowledged:
            assert proc.client.get(f"/v1/bases/{bid}").status_code == 200, bid
        assert _edit(proc.client, acknowledged[-1]).status_code == 200
    finally:
        assert proc.stop()
    assert not list(folder.rglob("*.corrupt"))
    print(f"kill -9: 3 rounds, {len(acknowledged)} acknowledged bases, all served after restart")
