"""Every request bounded before it is expanded, and image work bounded by the served size
(issue 35, items 1 and 2): an edits body is counted on its parsed JSON and refused 413 before it
is validated, off the event loop; an A1111 mask is resized before it is blurred, and the blur is
OpenCV's as rendered independently with PyTorch (torch's reflect padding and conv1d).

Speed is `make bench`'s to measure: these tests check what is done (what is validated, at which
size the blur runs, who is answered), never how many seconds it took."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from unittest import mock

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from edit_rt.runtime.config.serve import Serve
from edit_rt.runtime.model.sweep import MAX_POINTS, expand_all, rows_of
from edit_rt.runtime.web.http_errors import ApiError
from edit_rt.runtime.web import a1111_masks, api_openai
from edit_rt.runtime.web.a1111_masks import a1111_pixel_mask, gaussian_blur
from edit_rt.runtime.web.api import EditsRequest

from .in_process_server import InProcessServer

LIMIT = Serve.__dataclass_fields__["max_edits_per_request"].default  # 64


def _body(edits: int, points: int | None, n: int = 1) -> dict:
    edit = {"prompt": "a cat", "tail_steps": 3}
    if points is not None:
        edit["sweep"] = {"from": -1, "to": 1, "n": points}
    return {"base_id": "0" * 16, "edits": [edit] * edits, "n": n}


# --- bounded before expanded ----------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.integers(1, 200), points=st.one_of(st.none(), st.integers(2, MAX_POINTS)), n=st.integers(1, 8),
       limit=st.sampled_from([1, 8, LIMIT, 128]))  # fmt: skip
def test_bodies_past_the_limit_are_refused_before_they_are_validated_or_expanded(edits, points, n, limit):
    rows = edits * (points or 1) * n
    validated = []
    original = EditsRequest.model_validate.__func__

    def spy(cls, payload, *args, **kwargs):
        validated.append(1)
        return original(cls, payload, *args, **kwargs)

    raw = json.dumps(_body(edits, points, n)).encode()
    with mock.patch.object(EditsRequest, "model_validate", classmethod(spy)):
        if rows > limit:
            with pytest.raises(ApiError) as err:
                api_openai.edits_request(raw, limit)
            assert err.value.status == 413 and err.value.param == "edits" and not validated
        else:
            body = api_openai.edits_request(raw, limit)
            assert validated and rows_of(body.edits) * body.n == rows == len(expand_all(body.edits)) * n


def test_a_huge_sweep_body_is_refused_without_validation():
    raw = json.dumps(_body(10_000, MAX_POINTS)).encode()  # 570 kB: 640,000 rows
    with mock.patch.object(EditsRequest, "model_validate", side_effect=AssertionError("validated")) as validate:
        with pytest.raises(ApiError) as err:
            api_openai.edits_request(raw, LIMIT)
    assert not validate.called and err.value.status == 413
    assert "edits" in err.value.message and f"at most {LIMIT}" in err.value.message


def test_the_docs_state_the_limits_the_code_declares():
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "serving.md").read_text()
    assert f"at most {LIMIT} rows" in text and f"{MAX_POINTS} points" in text


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = InProcessServer(tmp_path_factory.mktemp("bounds"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


def _health_while(client: httpx.Client, send) -> tuple[httpx.Response, list[int]]:
    """``send()`` in a thread while /health is asked every 50 ms: its answer and /health's statuses."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", send()))
    thread.start()
    statuses = []
    while thread.is_alive() or not statuses:
        statuses.append(client.get("/health", timeout=10).status_code)  # the timeout: a hang guard
        time.sleep(0.05)
    thread.join()
    return out["r"], statuses


@pytest.mark.parametrize("edits,points", [(10_000, MAX_POINTS), (100_000, None)])
def test_an_oversized_edits_body_is_refused_and_health_answers_meanwhile(server, edits, points):
    text = json.dumps(_body(edits, points))

    def send():
        return server.client.post("/v1/images/edits", content=text, headers={"content-type": "application/json"}, timeout=120)

    r, health = _health_while(server.client, send)
    assert r.status_code == 413 and r.json()["error"]["param"] == "edits", r.text
    assert set(health) == {200}, health


# --- image work bounded by the served size --------------------------------------------------------


def torch_blur_unrounded(mask: np.ndarray, sigma: int, axis: int) -> np.ndarray:
    """The reference: OpenCV's GaussianBlur along ``axis`` as A1111 calls it (2 * int(2.5 sigma +
    0.5) + 1 taps of exp(-d^2 / (2 sigma^2)), normalised; BORDER_REFLECT_101; 8-bit rounding),
    written with PyTorch's reflect padding and conv1d. Reflect padding takes at most n - 1 pixels
    a pass, so a kernel wider than the mask is padded in passes of whole mirror periods (every
    multiple of n - 1 is a mirror of the infinite reflected signal); one pixel mirrors to itself.
    Float64, before the 8-bit rounding."""
    import torch
    import torch.nn.functional as F

    if sigma <= 0:
        return mask.astype(np.float64)
    k = 2 * int(2.5 * sigma + 0.5) + 1
    d = torch.arange(k, dtype=torch.float64) - (k - 1) / 2
    g = torch.exp(-(d**2) / (2.0 * sigma**2))
    g = g / g.sum()
    x = torch.tensor(mask if axis == 1 else mask.T, dtype=torch.float64)[:, None, :]  # [lines, 1, n]
    left = k // 2
    while left:
        step = left if x.shape[-1] == 1 else min(left, x.shape[-1] - 1)
        x = F.pad(x, (step, step), mode="replicate" if x.shape[-1] == 1 else "reflect")
        left -= step
    out = F.conv1d(x, g.view(1, 1, k))[:, 0].numpy()
    return out if axis == 1 else out.T


def torch_gaussian_blur(mask: np.ndarray, sigma: int, axis: int) -> np.ndarray:
    return np.floor(torch_blur_unrounded(mask, sigma, axis) + 0.5).clip(0, 255).astype(np.uint8)


@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 40), w=st.integers(1, 40), sigma=st.integers(0, 64), axis=st.sampled_from([0, 1]), seed=st.integers(0, 99))
def test_the_blur_is_opencvs_at_any_size_and_sigma(h, w, sigma, axis, seed):
    # test_masks.py holds the blur to PyTorch at small sigmas; here kernels up to 8x the mask
    # (radius 160 on 1..40 pixels), where the mirror folds the kernel onto the mask many times
    rng = np.random.default_rng(seed)
    mask = np.where(rng.random((h, w)) < 0.5, 255, 0).astype(np.uint8) if seed % 2 else rng.integers(0, 256, (h, w), dtype=np.uint8)
    ours, exact = gaussian_blur(mask, sigma, axis), torch_blur_unrounded(mask, sigma, axis)
    ref = np.floor(exact + 0.5).clip(0, 255)
    tie = np.abs(exact - np.floor(exact) - 0.5) < 1e-6  # x.5 may round either way (sums in another order)
    assert ours.shape == ref.shape and np.abs(ours - ref).max() <= 1 and (ours == ref)[~tie].all()


@pytest.mark.parametrize("sigma", [0, 4, 10, 64])
def test_a_large_mask_is_resized_first_and_blurs_as_a1111s(sigma):
    # A1111's order (OpenCV's blur at 160 px, then resize; rendered with PyTorch) against ours
    # (resize to 32, blur with sigma / 5): equal but for the 8-bit rounding and where the
    # mirrored border falls (a downscaled pixel's centre is not the original's), at most 6 grey
    # levels before doubling
    rng = np.random.default_rng(0)
    binary = np.zeros((160, 160), dtype=np.uint8)
    binary[40:120, 30:100] = 255
    binary[rng.random((160, 160)) < 0.01] = 255
    ref = torch_gaussian_blur(torch_gaussian_blur(binary, sigma, axis=1), sigma, axis=0)
    ref = np.asarray(Image.fromarray(ref).resize((32, 32), Image.LANCZOS), dtype=np.uint8)
    ref = np.clip(ref.astype(np.float32) * 2, 0, 255).astype(np.uint8).astype(np.float32)
    with mock.patch.object(a1111_masks, "gaussian_blur", wraps=a1111_masks.gaussian_blur) as blur:
        new = a1111_pixel_mask(binary, False, sigma, sigma, (32, 32), True) * 255
    assert [c.args[0].shape for c in blur.call_args_list] == [(32, 32)] * 2  # the blur's work is the served size's
    assert new.shape == (32, 32) and np.abs(new - ref).max() <= 12 and np.abs(new - ref).mean() <= 8


def _b64_png(array: np.ndarray) -> str:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def test_a_5000px_mask_is_served_and_another_upload_is_answered_meanwhile(server):
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    mask = _b64_png(np.full((5000, 5000), 255, dtype=np.uint8))  # ~35 kB, 25 Mpx
    body = {"prompt": "a cat", "init_images": [_b64_png(pixels)], "mask": mask, "mask_blur": 64, "steps": 6,
            "denoising_strength": 0.5}  # fmt: skip
    big = {}

    def send():
        big["r"] = server.client.post("/sdapi/v1/img2img", json=body, timeout=120)

    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(0.2)
    small = server.client.post("/v1/bases", json={"image": _b64_png(pixels), "source_prompt": "a cat"}, timeout=120)
    thread.join()
    assert small.status_code == 200, small.text
    assert big["r"].status_code == 200, big["r"].text


def test_a_sweep_within_the_limit_still_runs_as_its_rows(server):
    r = server.client.post("/v1/images/generations", json={"prompt": "a cat", "steps": 6, "seed": 1}, timeout=120)
    assert r.status_code == 200, r.text
    body = {"base_id": r.json()["id"], "edits": [{"prompt": "a dog", "tail_steps": 2, "sweep": {"from": 0, "to": 1, "n": 3}}]}
    r = server.client.post("/v1/images/edits", json=body, timeout=120)
    assert r.status_code == 200 and [d["index"] for d in r.json()["data"]] == [0, 1, 2], r.text
    body["edits"] *= 22  # 66 rows: past the limit by its sweeps, not its length
    r = server.client.post("/v1/images/edits", json=body, timeout=120)
    assert r.status_code == 413 and r.json()["error"]["param"] == "edits", r.text
