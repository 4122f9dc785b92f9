"""The routes are module-level handlers that every app ``create_app`` builds shares (a server's,
a test's, Ray Serve's ingress); what one app holds, its service and its A1111 door's options, is
that app's alone. Two apps over one loaded service, in this process over ASGI.
"""

from __future__ import annotations

import asyncio

import httpx

from edit_rt.runtime.config.load import config_from_dict
from edit_rt.runtime.serving.service import Service
from edit_rt.runtime.web.server import create_app


def test_a1111_options_set_through_one_app_leave_another_apps_as_configured(model_dir, onnx_dir):
    cfg = config_from_dict({"model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "store": {"ram_mb": 16},
                            "base": {"prompt": "x", "steps": 4, "guidance": 7.5, "width": 32, "height": 32}})  # fmt: skip
    service = Service(cfg)
    service.load()
    assert service.ready.is_set(), service.load_error
    one, other = create_app(cfg, service), create_app(cfg, service)
    configured = cfg.base.clip_skip + 1  # A1111's CLIP_stop_at_last_layers is clip_skip + 1

    async def calls():
        clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8188")
                   for app in (one, other)]  # fmt: skip
        async with clients[0] as a, clients[1] as b:
            set_ = await a.post("/sdapi/v1/options", json={"CLIP_stop_at_last_layers": configured + 1})
            return set_, (await a.get("/sdapi/v1/options")).json(), (await b.get("/sdapi/v1/options")).json()

    try:
        set_, mine, theirs = asyncio.run(calls())
    finally:
        service.shutdown()
    assert set_.status_code == 200, set_.text
    assert mine["CLIP_stop_at_last_layers"] == configured + 1
    assert theirs["CLIP_stop_at_last_layers"] == configured
