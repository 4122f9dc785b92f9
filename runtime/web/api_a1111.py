"""AUTOMATIC1111's API (``/sdapi/v1/*``), so its clients (``webuiapi`` and the tools built on it)
work unchanged.

- ``txt2img``: ``batch_size x n_iter`` bases from consecutive seeds; ``info`` (a JSON string,
  as A1111 returns it) names their ids.
- ``img2img``: edits of a base: the one the init image's ``parameters`` name (every PNG edit-rt
  writes names its ``Base id``), or, for any other image, the image inverted into a new base;
  ``denoising_strength`` is the tail fraction K/T, as in img2img, ``prompt`` the edit prompt.
- ``png-info``, ``sd-models``, ``options`` (read), ``progress``.

Fields A1111 has and edit-rt does not use (samplers, hires fix, scripts, ...) are accepted and
ignored: one model, one sampler (DDIM).
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from typing import Any, Optional

from fastapi import APIRouter, Request as HttpRequest
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from ..model.edit import Edit
from ..model.schema import Guidance, Steps, bounds_of
from ..pnginfo import base_id_of
from ..serving.errors import ApiError
from ..serving.service import Service
from .api import b64, decode_base64_or_400, errors

LAX = ConfigDict(extra="ignore")  # A1111 clients send every field their UI has


class Txt2Img(BaseModel):
    model_config = LAX
    prompt: str = Field(min_length=1)
    negative_prompt: Optional[str] = None  # omitted or null: the family's default; "" is encoded
    seed: int = Field(-1, ge=-1, le=2**63 - 1)
    steps: Optional[int] = Field(None, **bounds_of(Steps))
    cfg_scale: Optional[float] = Field(None, **bounds_of(Guidance))
    width: Optional[int] = Field(None, ge=1, le=16384)
    height: Optional[int] = Field(None, ge=1, le=16384)
    batch_size: int = Field(1, ge=1, le=8)
    n_iter: int = Field(1, ge=1, le=8)
    # A1111's per-request settings; edit-rt reads CLIP_stop_at_last_layers (1: the last layer)
    override_settings: dict[str, Any] = Field(default_factory=dict)

    def clip_skip(self) -> Optional[int]:
        """A1111's ``CLIP_stop_at_last_layers`` n as diffusers' clip_skip n - 1."""
        stop = self.override_settings.get("CLIP_stop_at_last_layers")
        if stop is None:
            return None
        if not isinstance(stop, int) or isinstance(stop, bool) or stop < 1:
            raise ApiError(400, f"override_settings.CLIP_stop_at_last_layers: a whole number >= 1, got {stop!r}",
                           param="override_settings.CLIP_stop_at_last_layers", code="out_of_range")  # fmt: skip
        return stop - 1


class Img2Img(BaseModel):
    model_config = LAX
    init_images: list[str] = Field(min_length=1)
    prompt: str = Field(min_length=1)
    negative_prompt: Optional[str] = None  # omitted or null: the family's default; "" is encoded
    denoising_strength: float = Field(0.4, gt=0, le=1)
    cfg_scale: Optional[float] = Field(None, **bounds_of(Guidance))
    seed: int = Field(-1, ge=-1, le=2**63 - 1)


class PngInfoRequest(BaseModel):
    model_config = LAX
    image: str = Field(min_length=1)


class A1111Result(BaseModel):
    images: list[str]
    parameters: dict[str, Any]
    info: str


def a1111_routes(service: Service) -> APIRouter:
    router = APIRouter(prefix="/sdapi/v1", tags=["AUTOMATIC1111"])
    common = errors(400, 401, 408, 411, 413, 429, 499, 503, 507)

    @router.post("/txt2img", response_model=A1111Result, responses=common, summary="Bases (A1111's txt2img)")
    async def txt2img(body: Txt2Img, http: HttpRequest):
        served = service.cfg.base
        size = f"{body.width or served.width}x{body.height or served.height}"
        first = service.base_of(body.prompt, body.negative_prompt, size, body.steps, body.cfg_scale, body.seed,
                                body.clip_skip())  # fmt: skip
        made = [await service.generate(replace(first, seed=first.seed + k), http) for k in range(body.batch_size * body.n_iter)]
        info = {"prompt": first.prompt, "negative_prompt": first.negative_prompt or "", "seed": first.seed,
                "all_seeds": [g.base.seed for g in made], "steps": first.steps, "cfg_scale": first.guidance,
                "width": first.width, "height": first.height, "sampler_name": "DDIM",
                "sd_model_name": service.model_name, "base_id": made[0].id, "base_ids": [g.id for g in made],
                "infotexts": [Image.open(io.BytesIO(g.png)).text["parameters"] for g in made]}  # fmt: skip
        return {"images": [b64(g.png) for g in made], "parameters": body.model_dump(), "info": json.dumps(info)}

    @router.post("/img2img", response_model=A1111Result, responses={**common, **errors(404, 409)},
                 summary="Edits of an edit-rt image's base (A1111's img2img)")  # fmt: skip
    async def img2img(body: Img2Img, http: HttpRequest):
        service.check_edit_count(len(body.init_images))  # each image is an edit (and maybe an inversion)
        bids = []
        for k, data in enumerate(body.init_images):
            param = f"init_images[{k}]"
            raw = decode_base64_or_400(data, param)
            parameters = (await service.image_text(raw, param)).get("parameters")
            bid = base_id_of(parameters) if isinstance(parameters, str) else None
            if bid is None or not await service.has_base(bid):
                # any other image: inverted into a base (A1111's prompt is the target; the
                # image's own description is unknown, so the inversion's prompt is empty)
                made = await service.invert(await service.upload(raw, param), "", body.negative_prompt)
                bid = made.id
            bids.append(bid)
        out = []
        for k, bid in enumerate(bids):
            spec = Edit(prompt=body.prompt, guidance=body.cfg_scale, tail_fraction=body.denoising_strength)
            out += await service.edit_base(bid, [spec], http, f"init_images[{k}]")
        info = {"prompt": body.prompt, "denoising_strength": body.denoising_strength, "base_ids": bids,
                "tail_steps": [e.tail_steps for e in out],
                "infotexts": [Image.open(io.BytesIO(e.png)).text["parameters"] for e in out]}  # fmt: skip
        return {"images": [b64(e.png) for e in out], "parameters": body.model_dump(exclude={"init_images"}), "info": json.dumps(info)}

    @router.post("/png-info", responses=errors(400, 401), summary="An image's generation parameters")
    async def png_info(body: PngInfoRequest):
        items = await service.image_text(decode_base64_or_400(body.image), "image")
        return {"info": items.get("parameters", ""), "items": items, "parameters": {}}

    @router.get("/sd-models", responses=errors(401), summary="The served model")
    async def sd_models():
        fingerprint = service.fingerprint
        return [{"title": f"{service.model_name} [{fingerprint[:10]}]", "model_name": service.model_name,
                 "hash": fingerprint[:10], "sha256": fingerprint, "filename": str(service.cfg.model), "config": None}]  # fmt: skip

    @router.get("/options", responses=errors(401), summary="Settings (read only)")
    async def options():
        base = service.cfg.base
        return {"sd_model_checkpoint": service.model_name, "samples_format": "png", "CLIP_stop_at_last_layers": base.clip_skip + 1,
                "eta_ddim": 0.0, "edit_rt_default_steps": base.steps, "edit_rt_size": f"{base.width}x{base.height}"}  # fmt: skip

    @router.get("/progress", responses=errors(401), summary="The step loop's progress")
    async def progress():
        rows = await service.progress()
        active, queued = rows["active"], rows["queued"]
        done = 0.0 if active or queued else 1.0
        return {"progress": done, "eta_relative": 0.0, "current_image": None, "textinfo": f"{active} rows running, {queued} queued",
                "state": {"job_count": active + queued, "sampling_steps": service.cfg.base.steps, "interrupted": False,
                          "skipped": False, "job": "", "job_no": 0, "sampling_step": 0}}  # fmt: skip

    return router
