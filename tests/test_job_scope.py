"""Adapters past the slots queue (never 500), and A1111 job control scoped to its own door:
the served app, in this process over ASGI (issue 35, items 3 and 4)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .in_process_server import InProcessServer

STEPS = 6
BASE = {"prompt": "x", "steps": STEPS, "guidance": 7.5, "width": 32, "height": 32}
NAMES = ["a0", "a1", "a2", "a3", "a4"]


@pytest.fixture(scope="module")
def server(model_dir, adapter_onnx_dir, tmp_path_factory):
    from edit_rt.export.compile.adapters import convert_adapters
    from edit_rt.runtime.engine.manifest import load_manifest

    from .test_adapters import make_lora

    root = tmp_path_factory.mktemp("job-scope")
    loras = {n: make_lora(model_dir, root / n, seed=20 + k) for k, n in enumerate(NAMES)}
    convert_adapters(model_dir, load_manifest(adapter_onnx_dir), loras, adapter_onnx_dir.parent / "adapters")
    proc = InProcessServer(root, model_dir, adapter_onnx_dir, base=BASE, extra={"adapters": {n: str(p) for n, p in loras.items()}})
    yield proc
    assert proc.stop()


def _gen(client: httpx.Client, k: int) -> httpx.Response:
    body = {"prompt": f"a circle {k}", "size": "32x32", "steps": STEPS, "adapters": {NAMES[k % 5]: 0.8}}
    return client.post(f"/v1/images/generations", json=body, timeout=120)


def test_more_adapters_in_flight_than_slots_never_answer_500(server):
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda k: _gen(server.client, k), range(10)))
    codes = Counter(r.status_code for r in answers)
    assert all(r.status_code == 200 or (r.status_code == 429 and "retry-after" in r.headers) for r in answers), \
        (codes, [r.text[:200] for r in answers if r.status_code != 200])


def test_one_row_with_more_adapters_than_slots_is_400_on_both_doors(server):
    r = server.client.post(f"/v1/images/generations", timeout=60,
                   json={"prompt": "x", "size": "32x32", "steps": STEPS, "adapters": {n: 0.5 for n in NAMES[:4]}})
    assert r.status_code == 400, r.text
    tags = " ".join(f"<lora:{n}:0.5>" for n in NAMES[:4])
    r = server.client.post(f"/sdapi/v1/txt2img", json={"prompt": f"x {tags}", "steps": STEPS}, timeout=60)
    assert r.status_code == 400 and "prompt" in r.text, r.text


def test_interrupts_never_stop_another_doors_work(server):
    stop, progress = threading.Event(), []

    def storm():
        while not stop.is_set():
            server.client.post(f"/sdapi/v1/interrupt", timeout=30)
            server.client.post(f"/sdapi/v1/skip", timeout=30)
            progress.append(server.client.get(f"/sdapi/v1/progress", timeout=30).json())

    t = threading.Thread(target=storm)
    t.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda k: _gen(server.client, k % 3), range(8)))
    finally:
        stop.set()
        t.join()
    assert Counter(r.status_code for r in answers) == {200: 8}, [r.text[:200] for r in answers if r.status_code != 200]
    # A1111's progress shows its own door's jobs only: another door's are no job and no preview
    assert progress and all(p["state"]["job_count"] == 0 and p["current_image"] is None for p in progress)


def test_an_a1111_interrupt_stops_its_own_job_as_documented(server):
    answer = {}

    def run():
        answer["r"] = server.client.post(f"/sdapi/v1/txt2img", timeout=120,
                                 json={"prompt": "y", "steps": 120, "batch_size": 2, "n_iter": 2})  # fmt: skip

    t = threading.Thread(target=run)
    t.start()
    # a row in a step loop (sampling_steps): what waits in the queue is no current job to stop,
    # as A1111's interrupt before a job begins is lost (state.begin() clears it)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not server.client.get(f"/sdapi/v1/progress").json()["state"]["sampling_steps"]:
        time.sleep(0.02)
    assert server.client.post(f"/sdapi/v1/interrupt").json()["interrupted"] >= 1
    t.join(60)
    r = answer["r"]
    assert r.status_code in (200, 409), r.text  # its finished images, or 409 interrupted (docs/serving.md)
    if r.status_code == 409:
        assert r.json()["error"]["code"] == "interrupted"
    else:
        assert json.loads(r.json()["info"])["interrupted"]


def _active_rows(client: httpx.Client) -> float:
    for line in client.get(f"/metrics", timeout=30).text.splitlines():
        if line.startswith("edit_rt_active_rows "):
            return float(line.split()[1])
    return 0.0


def test_a1111_progress_counts_its_own_doors_requests_and_rows_only(server):
    """/progress's counts and textinfo while another door's rows share the step loop: the A1111
    door's one request and one row, never the OpenAI door's four."""
    busy = {"prompt": "busy", "size": "32x32", "steps": 60, "n": 4}
    with ThreadPoolExecutor(2) as pool:
        other = pool.submit(server.client.post, f"/v1/images/generations", json=busy, timeout=120)
        deadline = time.monotonic() + 60
        while _active_rows(server.client) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        ours = pool.submit(server.client.post, f"/sdapi/v1/txt2img", json={"prompt": "y", "steps": 150}, timeout=120)
        seen = None
        while time.monotonic() < deadline:
            seen = server.client.get(f"/sdapi/v1/progress", timeout=30).json()
            if seen["state"]["sampling_steps"]:
                break
            time.sleep(0.01)
        other_running = not other.done()
        server.client.post(f"/sdapi/v1/interrupt", timeout=30)
        assert ours.result().status_code in (200, 409) and other.result().status_code == 200
    assert other_running  # the other door's rows were in the step loop beside ours (60 steps x 4 rows)
    assert seen["state"]["job_count"] == 1, seen
    assert seen["textinfo"] == "1 requests running, 0 queued (1 rows in slots, 0 rows queued)", seen["textinfo"]
