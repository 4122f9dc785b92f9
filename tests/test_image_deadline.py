"""A deadline per image task (issue 35, item 2): an upload's or a mask's decode that runs past
``serve.image_timeout_s`` is answered 503 ``image_timeout`` naming the field, while another
client's small upload is answered; a task still waiting for a worker at its deadline never runs.

The slow decode is made so (the uploads module's decode, monkeypatched to wait on an event) in
this process, through the real app and its middleware over ASGI, with the tiny model's engines
loaded: the small upload is inverted into a base for real.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from edit_rt.runtime.config.load import config_from_dict
from edit_rt.runtime.serving import image_work
from edit_rt.runtime.errors import ImageTimeoutError
from edit_rt.runtime.web.http_errors import api_error
from edit_rt.runtime.serving.service import Service

DEADLINE = 0.5  # seconds: far below a real decode's bound, far above this test's small ones


def _png(size: int, seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _config(tmp_path, model_dir, onnx_dir, workers: int):
    return config_from_dict({
        "model": str(model_dir), "build_dir": str(onnx_dir.parent.parent),
        "base": {"prompt": "x", "steps": 4, "guidance": 7.5, "width": 32, "height": 32},
        "store": {"ram_mb": 16},
        "serve": {"image_workers": workers, "image_timeout_s": DEADLINE},
    })  # fmt: skip


class SlowDecode:
    """The uploads' decode, held on an event for the images in ``slow`` (a decode stuck in a
    worker as a hostile image could hold one), counting the calls that started."""

    def __init__(self, monkeypatch, slow: set[bytes]):
        self.real = image_work.image_from_bytes
        self.slow = slow
        self.release = threading.Event()
        self.started: list[bytes] = []
        monkeypatch.setattr(image_work, "image_from_bytes", self)

    def __call__(self, data: bytes, *args):
        self.started.append(data)
        if data in self.slow:
            self.release.wait(10)  # today's code waits it out: the test then fails, not hangs
        return self.real(data, *args)


def test_a_slow_upload_is_answered_at_its_deadline_while_another_clients_upload_is_served(
        tmp_path, model_dir, onnx_dir, monkeypatch):  # fmt: skip
    slow_png, small_png = _png(48, 1), _png(32, 2)
    decode = SlowDecode(monkeypatch, {slow_png})
    service = Service(_config(tmp_path, model_dir, onnx_dir, workers=2))
    service.load()
    assert service.ready.is_set(), service.load_error
    from edit_rt.runtime.web.server import create_app

    app = create_app(service.cfg, service)

    async def clients():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8188", timeout=60) as client:

            async def post(png: bytes):
                start = time.monotonic()
                r = await client.post("/v1/bases", json={"image": base64.b64encode(png).decode(), "source_prompt": "x"})
                return r, time.monotonic() - start

            slow = asyncio.create_task(post(slow_png))
            await asyncio.sleep(0.05)  # the slow decode holds its worker first
            return await asyncio.gather(slow, post(small_png))

    try:
        (slow, slow_s), (small, small_s) = asyncio.run(clients())
        assert small.status_code == 200, small.text
        assert small.json()["id"]
        assert slow.status_code == 503, slow.text
        error = slow.json()["error"]
        assert error["code"] == "image_timeout" and error["param"] == "image", error
        assert "serve.image_timeout_s" in error["message"] and slow.headers["retry-after"]
        assert slow_s >= DEADLINE  # not before its deadline
        assert not decode.release.is_set()  # ... and before its decode ended (it waits for the release)
    finally:
        decode.release.set()
        service.shutdown()


def test_a_task_still_queued_at_its_deadline_never_runs(tmp_path, monkeypatch):
    """One worker, held by a stuck decode: the upload queued behind it is answered 503 at its
    deadline and its decode is dropped from the queue, so a backed-up pool does not grow a
    backlog of work nobody waits for. Once the stuck decode ends, the worker serves again."""
    stuck, queued, later = _png(40, 3), _png(32, 4), _png(32, 5)
    decode = SlowDecode(monkeypatch, {stuck})
    service = Service(_config(tmp_path, tmp_path / "model", tmp_path / "build" / "m" / "onnx", workers=1))  # decodes only

    async def uploads():
        first = asyncio.create_task(service.images.upload(stuck, "image"))
        await asyncio.sleep(0.05)
        outcomes = await asyncio.gather(first, service.images.upload(queued, "image"), return_exceptions=True)
        decode.release.set()  # the stuck decode ends; its result is discarded
        await asyncio.sleep(0.2)
        return outcomes, await service.images.upload(later, "image")

    try:
        (first, second), after = asyncio.run(uploads())
        for outcome in (first, second):
            assert isinstance(outcome, ImageTimeoutError) and outcome.field == "image", outcome
            assert api_error(outcome).status == 503 and api_error(outcome).code == "image_timeout"
        assert queued not in decode.started  # dropped before it ran
        assert after.pixels.shape == (32, 32, 3)  # the worker is free again
    finally:
        decode.release.set()
        service.shutdown()


@pytest.mark.parametrize("value", [0, -1, float("inf")])
def test_the_deadline_must_be_a_positive_finite_number(tmp_path, value):
    from edit_rt.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"serve\.image_timeout_s: must"):
        config_from_dict({"model": str(tmp_path), "base": {"prompt": "x"}, "serve": {"image_timeout_s": value}})
