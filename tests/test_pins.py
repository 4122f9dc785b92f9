"""Pins are released on every exit path: a stream closed at any event, a client gone, a
failed or refused request. After each, the base can be deleted (a pinned base answers 409)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from .server_process import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = ServerProcess(tmp_path_factory.mktemp("pins"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


def _base(url: str, seed: int) -> str:
    r = httpx.post(url + "/v1/images/generations", json={"prompt": "a red circle", "seed": seed, "steps": 40}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _deleted_once_released(url: str, bid: str, tries: int = 1200) -> None:
    """DELETE ``bid`` until it is no longer pinned. The pin goes when the server has closed the
    request (a stream's generator, a plain request's disconnect watch), a moment after the
    client left, so it is polled; a leaked pin stays for good and fails after ``tries`` polls."""
    for _ in range(tries):
        r = httpx.delete(f"{url}/v1/bases/{bid}", timeout=10)
        if r.status_code == 200:
            return
        assert r.status_code == 409, r.text  # in use: pinned
        time.sleep(0.1)
    pytest.fail(f"{bid} still pinned after {tries} polls: {r.text}")


@pytest.mark.parametrize("close_after", ["headers", "edit_rt.queue", "edit_rt.progress", "image_edit.completed"])
def test_a_stream_closed_at_any_event_releases_its_base(server, close_after):
    bid = _base(server.url, seed=hash(close_after) % 1000)
    # two rows of a 35-step tail: every event comes (the rows run as one batch, so they end
    # together) and a stream closed before the last finds them running
    body = {"base_id": bid, "stream": True, "edits": [{"prompt": f"a blue square {k}", "tail_steps": 35} for k in range(2)]}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/images/edits", json=body) as r:
            assert r.status_code == 200
            if close_after != "headers":
                event = None
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        event = line[len("event: "):]
                    if line.startswith("data: ") and event == close_after:
                        json.loads(line[len("data: "):])
                        break
    # the rows leave at the next step boundary and the pin goes with the stream
    _deleted_once_released(server.url, bid)
    assert httpx.get(f"{server.url}/v1/bases/{bid}").status_code == 404


def test_a_client_that_leaves_a_plain_request_releases_its_base(server):
    """The rows of a plain request leave when its client does: the request ends as a 499 (the
    client gone), not a 200 after every step ran. Until stop 65 the server noticed no
    disconnect (the gate was Starlette's BaseHTTPMiddleware, whose receive hides it, and the
    watch asked only while no step's event came), and the rows ran to their end."""
    bid = _base(server.url, seed=77)
    server.log.flush()
    before = len(Path(server.log.name).read_text())  # the module's server: other tests' requests before this one
    # eight rows of a 35-step tail: seconds of work, so the client is gone (0.3 s) while they run;
    # the release is polled until the server lets go, however long the rows go on
    body = {"base_id": bid, "edits": [{"prompt": f"a cat {k}", "tail_steps": 35} for k in range(8)]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/images/edits", json=body, timeout=0.3)
    _deleted_once_released(server.url, bid)
    server.log.flush()
    log = Path(server.log.name).read_text()[before:]
    assert "POST /v1/images/edits 499" in log and "POST /v1/images/edits 200" not in log, log


def test_refused_and_failed_edits_release_their_base(server):
    bid = _base(server.url, seed=78)
    for edit in ({"prompt": "x", "tail_steps": 999}, {"prompt": "x", "mask": {"x": 31, "y": 0, "width": 8, "height": 8}}):
        r = httpx.post(server.url + "/v1/images/edits", json={"base_id": bid, "edits": [edit]}, timeout=60)
        assert r.status_code == 400, r.text
    info = httpx.get(f"{server.url}/v1/bases/{bid}").json()
    assert info["pinned"] is False, info
    r = httpx.delete(f"{server.url}/v1/bases/{bid}", timeout=10)  # answered: nothing left to wait for
    assert r.status_code == 200, r.text
