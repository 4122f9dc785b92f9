"""Limits on every door: JSON, multipart and AUTOMATIC1111 bodies meet the same ranges and
counts, refused (400/413, naming the field) before an image is decoded or inverted."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from .in_process_server import InProcessServer


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = InProcessServer(tmp_path_factory.mktemp("limits"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


def _png(seed: int = 0, parameters: str | None = None) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    info = None
    if parameters is not None:
        info = PngInfo()
        info.add_text("parameters", parameters)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def _inverted(client: httpx.Client) -> float:
    """Bases inverted so far (the store's puts show in edit_rt_store_* and the inversions in
    the step histogram; the plainest count is the metric of edit requests by tier)."""
    text = client.get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("edit_rt_step_seconds_count"))


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("steps", "-5", "steps: must lie in [1, 1000]"),
        ("steps", "100000", "steps: must lie in [1, 1000]"),
        ("strength", "1e308", "strength: must lie in [-4, 4]"),
        ("strength", "-50", "strength: must lie in [-4, 4]"),
        ("tail_steps", "0", "tail_steps: must lie in [1, 1000]"),
        ("n", "0", "n: must lie in [1, 8]"),
        ("n", "9", "n: must lie in [1, 8]"),
        ("preserve", "bogus", "preserve"),
        ("cfg_scale", "1e308", "cfg_scale: must lie in [0, 50]"),
        ("cfg_scale", "nan", "cfg_scale: must be a finite number"),
    ],
)
def test_the_multipart_form_meets_the_json_ranges_before_inverting(server, field, value, needle):
    before = _inverted(server.client)
    data = {"prompt": "a blue square", field: value}
    r = server.client.post("/v1/images/edits", data=data, files={"image": ("x.png", _png(), "image/png")}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and needle in error["message"], error
    assert _inverted(server.client) == before  # refused before a single step ran


def test_img2img_takes_at_most_the_edit_limit_of_images_before_decoding(server):
    # not images: had any been decoded before the count, the answer would be its 400
    images = [base64.b64encode(b"not an image %d" % k).decode() for k in range(65)]  # the limit is 64 edits
    r = server.client.post("/sdapi/v1/img2img", json={"prompt": "a cat", "init_images": images}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "edits", r.text
    assert "at most 64" in r.json()["error"]["message"]
    one = server.client.post("/sdapi/v1/img2img", json={"prompt": "a cat", "init_images": images[:1]}, timeout=60)
    assert one.status_code == 400 and one.json()["error"]["param"] == "init_images[0]", one.text  # what a decode answers


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "steps": 100000}, "steps"),
        ({"prompt": "x", "cfg_scale": 1e308}, "cfg_scale"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "width": 10**9}, "width"),
    ],
)
def test_txt2img_meets_the_same_ranges(server, body, param):
    r = server.client.post("/sdapi/v1/txt2img", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("base_id", ['"unterminated', '"bad \\q escape"', "a" * 10000, '"\\ud800"'])
def test_a_malformed_base_id_in_png_info_is_an_ordinary_image(server, base_id):
    """Not edit-rt's own PNG: it is inverted like any other image, never a 500."""
    png = _png(7, f"a prompt\nSteps: 6, Base id: {base_id}")
    r = server.client.post("/sdapi/v1/img2img", json={"prompt": "a cat", "init_images": [base64.b64encode(png).decode()],
                                                           "denoising_strength": 0.3}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text


@pytest.mark.slow  # ~20-50 s; the default run keeps test_bounds' huge mask beside a small upload
def test_uploads_inverting_together_never_starve_reads(server):
    """Eight uploads inverting at once (60 steps each): a read of another base answers meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    r = server.client.post("/v1/images/generations", json={"prompt": "a red circle", "seed": 5}, timeout=120)
    bid = r.json()["id"]
    uploads = [{"image": base64.b64encode(_png(100 + k)).decode(), "steps": 60} for k in range(8)]
    with ThreadPoolExecutor(9) as pool:
        started = time.monotonic()
        posted = [pool.submit(server.client.post, "/v1/bases", json=u, timeout=300) for u in uploads]
        time.sleep(1.0)  # the uploads are decoding and inverting
        slowest = 0.0
        while not all(f.done() for f in posted):
            start = time.monotonic()
            assert server.client.get(f"/v1/bases/{bid}", timeout=30).status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.2)
        inverting = time.monotonic() - started
        assert all(f.result().status_code == 200 for f in posted), [f.result().text for f in posted]
    # a ratio within the run: a read that waited for the inversions would take most of their time
    assert slowest < 0.25 * inverting, (slowest, inverting)
