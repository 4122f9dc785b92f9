"""The OpenAI Images API's routes (and edit-rt's own fields on them): drop-in for the SDK.

``POST /v1/images/generations`` (``images.generate``: n bases from consecutive seeds),
``POST /v1/images/edits`` (edits of a stored base; JSON, or streamed as Server-Sent Events whose
data carry ``type``), ``GET /v1/models`` and ``/v1/models/{id}``.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from dataclasses import replace
from typing import AsyncIterator

from fastapi import APIRouter, Request as HttpRequest
import anyio
from fastapi.responses import StreamingResponse
from PIL import Image

from ..serving.errors import ApiError, validation_error
from .api import (
    OPENAI_MODELS,
    BaseUpload,
    EditsRequest,
    GenerationRequest,
    GenerationResponse,
    ModelCard,
    ModelList,
    b64,
    decode_base64_or_400,
    errors,
)
from ..serving.service import Event, Service
from .forms import edit_upload

COMMON_ERRORS = (400, 401, 408, 411, 413, 429, 499, 503, 507)
SSE = {"text/event-stream": {"schema": {"type": "string", "description": "Server-Sent Events (stream: true)"}}}


def sse(event: str, data: dict) -> str:
    """One Server-Sent Event; the data's ``type`` names it too (the OpenAI SDK reads that)."""
    return f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n"


def reencode(png: bytes, output_format: str) -> bytes:
    if output_format == "png":
        return png
    out = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").save(out, format=output_format.upper())
    return out.getvalue()


def openai_routes(service: Service) -> APIRouter:
    router = APIRouter()

    def check_model(model: str | None) -> None:
        if model is not None and model != service.model_name and model not in OPENAI_MODELS:
            raise ApiError(400, f"model: this server serves {service.model_name!r} (or send none, or one of OpenAI's "
                           f"names for it)", param="model", code="model_not_found")  # fmt: skip

    @router.post("/v1/images/generations", response_model=GenerationResponse, responses=errors(*COMMON_ERRORS),
                 summary="Generate a base (and keep its state for edits)")  # fmt: skip
    async def generations(body: GenerationRequest, http: HttpRequest):
        check_model(body.model)
        if body.response_format == "url":
            raise ApiError(400, "response_format: this server hosts no files; use b64_json (the default)",
                           param="response_format", code="unsupported_value")  # fmt: skip
        size = None if body.size == "auto" else body.size
        sizes = {k: getattr(body, k) for k in ("original_width", "original_height", "crop_top", "crop_left")}
        first = service.base_of(body.prompt, body.negative_prompt, size, body.steps, body.cfg_scale, body.seed,
                                body.clip_skip, sizes)  # fmt: skip
        bases = [replace(first, seed=first.seed + k) for k in range(body.n)]
        made = await asyncio.gather(*(service.generate(b, http) for b in bases))
        base = made[0].base
        return {
            "id": made[0].id,
            "created": int(time.time()),
            "seed": base.seed,
            "data": [{"b64_json": b64(reencode(g.png, body.output_format))} for g in made],
            "parameters": {"prompt": base.prompt, "negative_prompt": base.negative_prompt, "steps": base.steps,
                           "cfg_scale": base.guidance, "seed": base.seed, "size": f"{base.width}x{base.height}"},  # fmt: skip
            "info": {"seconds": round(max(g.seconds for g in made), 4), "store_tier": made[0].tier,
                     "base_ids": [g.id for g in made]},  # fmt: skip
        }

    @router.post("/v1/images/edits", responses={200: {"content": SSE}, 404: errors(404)[404], 409: errors(409)[409],
                                                 **errors(*COMMON_ERRORS)},  # fmt: skip
                 summary="Edit a stored base: N edits as one batched tail")
    async def edits(http: HttpRequest):
        # Parsed here rather than as a parameter: the same route takes OpenAI's multipart form.
        if http.headers.get("content-type", "").startswith("multipart/form-data"):
            return await edit_upload(service, http)
        try:
            payload = await http.json()
        except ValueError:
            raise ApiError(400, "the body is not valid JSON", code="json_invalid") from None
        from pydantic import ValidationError

        try:
            body = EditsRequest.model_validate(payload)
        except ValidationError as err:
            raise validation_error(err.errors(), EditsRequest) from None
        return await json_edits(body, http)

    async def json_edits(body: EditsRequest, http: HttpRequest):
        service.check_edit_count(len(body.edits))
        if (body.base_id is None) == (body.image is None):
            raise ApiError(400, "base_id: give base_id (a stored base) or image (one to invert), not both or neither",
                           param="base_id", code="missing")  # fmt: skip
        if body.image is not None:
            upload = await service.upload(decode_base64_or_400(body.image), "image")
            made = await service.invert(upload, body.source_prompt, body.negative_prompt)
            body = body.model_copy(update={"base_id": made.id})
        specs = body.edits  # already the one edit schema (edit.py)
        if not body.stream:
            done = await service.edit_base(body.base_id, specs, http)
            return {"created": int(time.time()), "base_id": body.base_id,
                    "data": [{"index": e.index, "b64_json": b64(e.png), "info": e.info()} for e in done]}  # fmt: skip
        events = service.edit_events(body.base_id, specs)
        first = await events.__anext__()  # refusals (unknown base, bad edit, full queue) before the 200 goes out
        return EventStream(stream(first, events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def stream(first: Event, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        try:
            yield sse(*first)
            async for kind, data in events:
                if kind == "error":
                    yield sse(kind, {"index": data["index"], **data["error"].body()})
                elif kind == "image_edit.completed":
                    yield sse(kind, {"index": data["index"], "b64_json": b64(data["png"]), "info": data["info"]})
                else:
                    yield sse(kind, data)
        except ApiError as err:  # after the 200: the rest of the request fails as one event
            yield sse("error", err.body())
        finally:
            await events.aclose()  # a client that left: its rows go at the next step

    @router.post("/v1/bases", response_model=GenerationResponse, responses=errors(*COMMON_ERRORS),
                 summary="A base from an image (its inversion), to edit like a generated one")  # fmt: skip
    async def bases(body: BaseUpload):
        upload = await service.upload(decode_base64_or_400(body.image), "image")
        made = await service.invert(upload, body.source_prompt, body.negative_prompt, body.steps, body.cfg_scale, body.clip_skip)
        base = made.base
        return {
            "id": made.id, "created": int(time.time()), "seed": base.seed, "data": [{"b64_json": b64(made.png)}],
            "parameters": {"prompt": base.prompt, "negative_prompt": base.negative_prompt, "steps": base.steps,
                           "cfg_scale": base.guidance, "seed": base.seed, "size": f"{base.width}x{base.height}",
                           "image": base.image, "notes": upload.notes},
            "info": {"seconds": round(made.seconds, 4), "store_tier": made.tier, "base_ids": [made.id]},
        }  # fmt: skip

    @router.get("/v1/models", response_model=ModelList, responses=errors(401, 503), summary="The served model")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "created": service.started}]}

    @router.get("/v1/models/{model}", response_model=ModelCard, responses=errors(401, 404, 503), summary="One model")
    async def model(model: str):
        if model != service.model_name:
            raise ApiError(404, f"model: no model {model[:64]!r}; this server serves {service.model_name!r}",
                           "not_found_error", param="model", code="model_not_found")  # fmt: skip
        return {"id": model, "created": service.started}

    return router


class EventStream(StreamingResponse):
    """A stream whose events are closed when the response ends, however it ends.

    A client that leaves mid-stream cancels the response while the event generator waits at a
    ``yield``; nothing would close it then but the garbage collector, and its base would stay
    pinned until then. Here it is closed at once (shielded: the cancelled response's scope
    would cancel the close too), so the rows leave the batch and the pin goes.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
