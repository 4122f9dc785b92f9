"""Several sizes per server (engines.sizes): each served size generates what diffusers
generates at that size, edits of it run, and any other size is refused listing the served ones."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from edit_rt.runtime.model.edit import Base

from .in_process_server import InProcessServer

SIZES = ["64x32", "48x48"]  # besides the base's 32x32; the tiny model's multiple is 4


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = InProcessServer(tmp_path_factory.mktemp("sizes"), model_dir, onnx_dir, extra={"engines": {
        "min_batch": 1, "opt_batch": 8, "max_batch": 16, "sizes": SIZES}})  # fmt: skip
    yield proc
    assert proc.stop()


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


@pytest.mark.parametrize("size", ["32x32", *SIZES])
def test_each_served_size_generates_what_diffusers_generates(server, model_dir, diffusers_reference, size):
    body = {"prompt": "a red circle", "negative_prompt": "blurry", "seed": 11, "steps": 6, "size": size, "cfg_scale": 7.5}
    r = server.client.post("/v1/images/generations", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ours = _pixels(r.json()["data"][0]["b64_json"])
    width, height = map(int, size.split("x"))
    assert ours.shape == (height, width, 3)
    # the runtime's initial noise: numpy's PCG64 from the seed, [1, 4, h, w] (pipeline.initial_noise)
    latents = np.random.default_rng(11).standard_normal((1, 4, height // 2, width // 2), dtype=np.float32)
    base = Base(prompt="a red circle", negative_prompt="blurry", seed=11, steps=6, guidance=7.5, width=width, height=height)
    expected = diffusers_reference(model_dir, base, latents)[0]  # StableDiffusionPipeline + DDIM
    assert np.abs(ours.astype(int) - np.round(expected * 255).astype(int)).max() <= 1
    edit = {"base_id": r.json()["id"], "edits": [{"prompt": "a blue square", "tail_steps": 3}]}
    e = server.client.post("/v1/images/edits", json=edit, timeout=120)
    assert e.status_code == 200, e.text
    assert _pixels(e.json()["data"][0]["b64_json"]).shape == (height, width, 3)


def test_a1111_sizes_and_an_unserved_size(server):
    r = server.client.post("/sdapi/v1/txt2img", json={"prompt": "x", "width": 64, "height": 32, "steps": 4}, timeout=120)
    assert r.status_code == 200, r.text
    assert _pixels(r.json()["images"][0]).shape == (32, 64, 3)
    r = server.client.post("/v1/images/generations", json={"prompt": "x", "size": "40x40"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
    assert "32x32, 64x32, 48x48" in r.json()["error"]["message"]
