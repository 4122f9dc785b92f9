"""Answers a client reads as it expects (issue 35, items 7 and 5), against the served app (in this process, over ASGI):

- a JSON edits stream's ``partial_images`` come per edit, spread over that edit's own tail: with
  tails of 12 and 6 steps and ``partial_images: 1`` each edit gets one, at the middle of its tail;
- a related reply does not hand out the stored base it started from (another client's: with its
  id one could read, edit or delete it) unless ``serve.related.share_bases`` says bases are
  shared: not in ``info.related``, the ``X-Edit-RT-Related`` header, the PNG's parameters, the
  related base's ``GET /v1/bases/{id}``, its edits' PNGs, nor the A1111 door's ``info``; the
  reply still says it was related and how many steps it skipped.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from PIL import Image

from .in_process_server import InProcessServer
from .test_related import _generate  # the same reply check

STEPS = 12
A = "a red circle on a blue background"
B = "a green circle on a blue background"


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    # every prompt of the tiny random model is "related" at this threshold (test_related.py)
    related = {"enabled": True, "thresholds": [{"similarity": 0.01, "skip": 0.5}]}
    proc = InProcessServer(tmp_path_factory.mktemp("door-answers"), model_dir, onnx_dir, serve={"related": related},
                         base={"prompt": "x", "steps": STEPS, "guidance": 7.5, "width": 32, "height": 32})  # fmt: skip
    yield proc
    assert proc.stop()


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def _parameters(b64: str) -> str:
    return Image.open(io.BytesIO(base64.b64decode(b64))).text["parameters"]


def test_each_edit_gets_its_partial_images_over_its_own_tail(server):
    bid = _generate(server, A, seed=3, related=False).json()["id"]
    body = {"base_id": bid, "stream": True, "partial_images": 1,
            "edits": [{"prompt": B, "tail_steps": 12}, {"prompt": B, "tail_steps": 6}]}  # fmt: skip
    r = server.client.post("/v1/images/edits", json=body, timeout=120)
    assert r.status_code == 200, r.text
    partial = [e for e in _events(r) if e["type"] == "image_edit.partial_image"]
    # one each, at the middle of its own tail (every ceil(tail / 2) steps, never the last)
    assert sorted((e["index"], e["step"], e["of"], e["partial_image_index"]) for e in partial) == [(0, 6, 12, 0), (1, 3, 6, 0)]
    done = [e for e in _events(r) if e["type"] == "image_edit.completed"]
    assert sorted(e["index"] for e in done) == [0, 1]


def test_a_related_reply_does_not_name_another_clients_base(server):
    theirs = _generate(server, A, seed=5, related=False).json()["id"]
    r = _generate(server, B, related=True)
    reply = r.json()
    (related,) = reply["info"]["related"]
    assert related is not None and related["skipped_steps"] == STEPS // 2  # it says so, and what it skipped
    assert "base_id" not in related
    assert theirs not in r.text and theirs not in r.headers.get("X-Edit-RT-Related", "")
    assert r.headers["X-Edit-RT-Related"].startswith(f"skipped={STEPS // 2};")
    params = _parameters(reply["data"][0]["b64_json"])
    assert theirs not in params and f"Skipped steps: {STEPS // 2}" in params
    ours = reply["id"]
    assert theirs not in server.client.get(f"/v1/bases/{ours}", timeout=30).text
    edit = server.client.post("/v1/images/edits", json={"base_id": ours, "edits": [{"prompt": A}]}, timeout=120)
    assert edit.status_code == 200 and theirs not in _parameters(edit.json()["data"][0]["b64_json"])
    # streamed, and at the A1111 door (one unseeded image: related as the server says)
    stream = _generate(server, B, related=True, stream=True)
    assert theirs not in stream.text and "skipped_steps" in stream.text
    a1111 = server.client.post("/sdapi/v1/txt2img", json={"prompt": B, "seed": -1, "width": 32, "height": 32,
                                                                "steps": STEPS}, timeout=120).json()  # fmt: skip
    info = json.loads(a1111["info"])
    assert info["related"][0] is not None and "base_id" not in info["related"][0]
    assert theirs not in a1111["info"] and theirs not in _parameters(a1111["images"][0])
