"""The OpenAI Images API's routes (and edit-rt's own fields on them): drop-in for the SDK.

``POST /v1/images/generations`` (``images.generate``: n bases from consecutive seeds, streamed
with ``stream`` and ``partial_images``), ``POST /v1/images/edits`` (edits of a stored base as
JSON, streamed as Server-Sent Events with ``stream``; or OpenAI's ``images.edit`` form:
forms.py; an uploaded edit-rt PNG re-enters its own stored base, as at the A1111 door:
openai_uploads.py), ``POST /v1/images/variations`` (``images.create_variation``: forms.py),
``POST /v1/bases``, ``GET /v1/models`` and ``/v1/models/{id}``, and edit-rt's ``GET
/v1/adapters`` (the LoRA adapters rows may name, for the page's sliders). What each of OpenAI's fields
does here is openai_fields.py's table; the request bodies FastAPI cannot see (the form, the
hand-parsed JSON) are documented by openapi_bodies.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from functools import partial

from fastapi import APIRouter, Request as HttpRequest, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from ..model.sweep import expand_all, rows_of
from .http_errors import ApiError, validation_error
from ..serving.related import related_header
from ..serving.fields import sampler_label
from ..serving.service import Service
from .api import AdapterList, BaseUpload, EditsRequest, EditsResponse, GenerationRequest, GenerationResponse, ModelCard, ModelList, b64, \
    decode_base64_or_400, errors  # fmt: skip
from .dependencies import ServiceDep
from .edit_counts import rows_asked
from .forms import edit_upload, seeds_of, variation_upload
from .openai_fields import Delivery, delivery_of
from .openai_uploads import found_bases, inverted
from .openapi_bodies import EDITS_BODY, VARIATIONS_BODY
from .streams import SSE, EventStream, Renderer, chained, first_of, merged

COMMON_ERRORS = (400, 401, 408, 411, 413, 429, 499, 503, 507)


router = APIRouter()


def served_size(service: Service) -> str:
    return f"{service.cfg.base.width}x{service.cfg.base.height}"


async def encoded(service: Service, delivery: Delivery, png: bytes) -> bytes:
    """``png`` in the delivery's format, encoded in the service's image pool (off the event loop)."""
    if delivery.output_format == "png":
        return png
    return await asyncio.get_running_loop().run_in_executor(service.images.pool, delivery.encode, png)


@router.post("/v1/images/generations", response_model=GenerationResponse, summary="Generate a base (and keep its state for edits)",
             responses={200: {"content": SSE}, **errors(*COMMON_ERRORS)})  # fmt: skip
async def generations(body: GenerationRequest, http: HttpRequest, response: Response, service: ServiceDep):
    service.choose_decoder(body.decoder)
    size = None if body.size == "auto" else body.size
    sizes = {k: getattr(body, k) for k in ("original_width", "original_height", "crop_top", "crop_left")}
    first = service.fields.base_of(body.prompt, body.negative_prompt, size, body.steps, body.cfg_scale, body.seed,
                            body.clip_skip, sizes, body.adapters, body.sampler)  # fmt: skip
    delivery = delivery_of(body, service.model_name, first.steps)
    if body.related and body.n > 1:
        raise ApiError(400, f"related: true serves one image (n of them would all come from the one related base's "
                       f"noise); send n=1, or related false (n={body.n})", param="related", code="unsupported_value")  # fmt: skip
    bases = [replace(first, seed=first.seed + k) for k in range(body.n)]
    related = dict(related=body.related if body.n == 1 else False, seed_given=body.seed >= 0)
    ran = {"model": service.model_name, "sampler": sampler_label(first.sampler), "steps": first.steps, "seeds": [b.seed for b in bases],
           "output_compression": delivery.output_compression, "accepted": delivery.accepted}  # fmt: skip
    size = f"{first.width}x{first.height}"
    if delivery.stream:
        return await generation_stream(service, bases, delivery, size, http, related)
    made = await asyncio.gather(*(service.generate(b, http, related=related["related"], seed_given=related["seed_given"]) for b in bases))
    base = made[0].base
    ran["seeds"] = [g.base.seed for g in made]  # a related result's is its related base's (its noise)
    if made[0].related is not None:  # served related: said in a header too
        response.headers["X-Edit-RT-Related"] = related_header(made[0].related)
    return {
        "id": made[0].id, "created": int(time.time()), "seed": base.seed, **delivery.reply_fields(size),
        "data": [{"b64_json": b64(await encoded(service, delivery, g.png))} for g in made],
        "parameters": {"prompt": base.prompt, "negative_prompt": base.negative_prompt, "steps": base.steps,
                       "cfg_scale": base.guidance, "seed": base.seed, "size": size},
        "info": {"seconds": round(max(g.seconds for g in made), 4), "store_tier": made[0].tier,
                 "base_ids": [g.id for g in made], "related": [g.related for g in made], **ran},
    }  # fmt: skip


async def generation_stream(service: Service, bases, delivery: Delivery, size: str, http: HttpRequest,
                            related: dict) -> EventStream:  # fmt: skip
    async def events():  # the n generations side by side (their rows batch together), each event indexed
        side_by_side = merged([service.generate_events(b, delivery.partial_images, **related) for b in bases])
        try:
            async for k, (kind, data) in side_by_side:
                yield kind, ({"index": k, "generated": data} if kind == "generated" else {**data, "index": k})
        finally:
            await side_by_side.aclose()

    stream = events()
    first = await first_of(stream, http)  # a refusal (a full queue) before the 200
    render = Renderer("image_generation", delivery, size, lambda png: encoded(service, delivery, png))
    return EventStream(render.stream(chained(first, stream)))


@router.post("/v1/images/edits", summary="Edit a stored base (JSON), or OpenAI's images.edit form: N edits as one batched tail",
             responses={200: {"model": EditsResponse, "content": SSE}, 404: errors(404)[404], 409: errors(409)[409],
                        **errors(*COMMON_ERRORS)}, openapi_extra=EDITS_BODY)  # fmt: skip
async def edits(http: HttpRequest, service: ServiceDep):
    # Parsed here rather than as a parameter: the same route takes OpenAI's multipart form.
    if http.headers.get("content-type", "").startswith("multipart/form-data"):
        return await edit_upload(service, http, partial(encoded, service))
    # Parsed, counted and validated in a worker thread: a 16 MB body takes the event loop
    # (and every other client's /health) for no longer than its read.
    body = await run_in_threadpool(edits_request, await http.body(), service.cfg.serve.max_edits_per_request)
    return await json_edits(service, body, http)


async def json_edits(service: Service, body: EditsRequest, http: HttpRequest):
    """A JSON ``/v1/images/edits``: its rows checked, its image (if any) found or inverted, then
    the edits run, answered at once or streamed."""
    service.choose_decoder(body.decoder)
    service.fields.check_edit_count(rows_of(body.edits) * body.n)  # counted before any sweep expands
    if any(edit.sweep is not None for edit in body.edits):  # a sweep is its rows (model/sweep.py)
        try:
            body = body.model_copy(update={"edits": expand_all(body.edits)})
        except ValueError as err:
            field = str(err).split(":", 1)[0]
            raise ApiError(400, str(err), param=field, code="out_of_range") from None
    service.fields.check_edit_count(len(body.edits) * body.n)
    if (body.base_id is None) == (body.image is None):
        raise ApiError(400, "base_id: give base_id (a stored base) or image (one to invert), not both or neither",
                       param="base_id", code="missing")  # fmt: skip
    if body.partial_images and not body.stream:
        raise ApiError(400, "partial_images: partial images are streamed: send stream true with it, or leave it out",
                       param="partial_images", code="unsupported_value")  # fmt: skip
    if body.sampler is not None and body.image is None:  # a base's edits run its sampler; another is refused
        ran = await base_sampler(service, body.base_id)
        service.fields.same_sampler(body.sampler, ran, "this base ran " + sampler_label(ran))
    uploaded = {}
    if body.image is not None:  # an edit-rt PNG re-enters its own stored base, any other image is inverted
        found = await found_bases(service, [decode_base64_or_400(body.image)], ["image"], body.sampler)
        kept = await inverted(service, found, body.source_prompt, body.negative_prompt, None, None)
        body = body.model_copy(update={"base_id": found[0].id})
        uploaded = {"base_reused": [found[0].reused], **({"info": {"accepted": kept}} if kept else {})}
    specs = variations(body.edits, body.n)
    seed_of = lambda i: {"seed": specs[i].seed}  # noqa: E731
    if not body.stream:
        done = await service.edit_base(body.base_id, specs, http)
        return {"created": int(time.time()), "base_id": body.base_id, **uploaded,
                "data": [{"index": e.index, "b64_json": b64(e.png), "info": {**e.info(), **seed_of(e.index)}} for e in done]}  # fmt: skip
    more = {"previews": body.partial_images} if body.partial_images else {}
    events = service.edit_events(body.base_id, specs, **more)
    first = await events.__anext__()  # refusals (unknown base, bad edit, full queue) before the 200 goes out
    render = Renderer("image_edit", Delivery(stream=True, partial_images=body.partial_images), served_size(service),
                      lambda png: encoded(service, Delivery(), png), everything=True, extra=seed_of)  # fmt: skip
    return EventStream(render.stream(chained(first, events)))


@router.post("/v1/images/variations", response_model=EditsResponse, responses=errors(*COMMON_ERRORS),
             summary="OpenAI's images.create_variation: seeded re-noisings of an uploaded image's base",
             openapi_extra=VARIATIONS_BODY)  # fmt: skip
async def image_variations(http: HttpRequest, service: ServiceDep):
    return await variation_upload(service, http, partial(encoded, service))


@router.post("/v1/bases", response_model=GenerationResponse, responses=errors(*COMMON_ERRORS),
             summary="A base from an image (its inversion), to edit like a generated one")  # fmt: skip
async def bases(body: BaseUpload, service: ServiceDep):
    upload = await service.images.upload(decode_base64_or_400(body.image), "image")
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
async def models(service: ServiceDep):
    return {"object": "list", "data": [{"id": service.model_name, "created": service.started}]}


@router.get("/v1/models/{model}", response_model=ModelCard, responses=errors(401, 404, 503), summary="One model")
async def model(model: str, service: ServiceDep):
    if model != service.model_name:
        raise ApiError(404, f"model: no model {model[:64]!r}; this server serves {service.model_name!r}",
                       "not_found_error", param="model", code="model_not_found")  # fmt: skip
    return {"id": model, "created": service.started}


@router.get("/v1/adapters", response_model=AdapterList, responses=errors(401, 503),
            summary="The LoRA adapters a base or an edit may name in adapters: {name: scale}")  # fmt: skip
async def adapters(service: ServiceDep):
    return adapter_list(service)


async def base_sampler(service: Service, bid: str) -> str:
    """The sampler stored base ``bid`` ran (and its edits run); 404 for an unknown base."""
    return (await service.base_info(bid))["base"].get("sampler") or service.fields.default_sampler


def adapter_list(service: Service) -> dict:
    """``GET /v1/adapters``: the adapters loaded and the slots a row has; on Ray Serve's ingress
    (no pipeline here) the config's names alone, which every replica loads."""
    served = service.adapters()
    data = [{"name": n} | ({"graphs": []} if a is None else {"rank": a.rank, "graphs": sorted(a.graphs), "text": a.text})
            for n, a in served.loaded.items()]  # fmt: skip
    return {"data": data, "slots": served.slots}


def edits_request(raw: bytes, limit: int) -> EditsRequest:
    """A JSON ``/v1/images/edits`` body as its request: its rows counted on the parsed JSON first
    (edit_counts.py: at most ``limit`` steps), so an oversized body is refused 413 before it
    is validated or expanded. Blocking: run it off the event loop."""
    try:
        payload = json.loads(raw)
    except ValueError:  # JSONDecodeError, and undecodable bytes (UnicodeDecodeError)
        raise ApiError(400, "the body is not valid JSON", code="json_invalid") from None
    rows, sum_ = rows_asked(payload, limit)
    if rows > limit:
        raise ApiError(413, f"edits: {sum_} ask for more than {limit} rows (edits x sweep points x n), at most {limit} "
                       "per request", param="edits", code="too_many_edits")  # fmt: skip
    try:
        return EditsRequest.model_validate(payload)
    except ValidationError as err:
        raise validation_error(err.errors(), EditsRequest) from None


def variations(edits: list, n: int) -> list:
    """Each edit ``n`` times, with seeds seed, seed + 1, ... (its own seed, or a random one):
    edit ``i``'s variation ``j`` is index ``i * n + j``. With ``n`` 1 the edits are as given."""
    if n == 1:
        return list(edits)
    return [replace(edit, seed=seed) for edit in edits for seed in seeds_of(n, edit.seed)]
