"""AUTOMATIC1111's API (``/sdapi/v1/*``), so its clients (``webuiapi`` and the tools built on it)
work unchanged, and nothing they send is silently dropped (every field: a1111_fields.py).

- ``txt2img``: ``batch_size x n_iter`` bases from seeds ``seed, seed + 1, ...`` (-1 picks the
  first), generated together; ``info`` (a JSON string, as A1111 returns it) has A1111's keys
  (``all_seeds``, ``all_subseeds``, ``infotexts``, ...) and edit-rt's ``base_id(s)``.
- ``img2img``: edits of a base: the one the init image's ``parameters`` name (every PNG edit-rt
  writes names its ``Base id``; the rule is the service's ``named_base``, the OpenAI door's too),
  or, for any other image or a base no longer stored, the image inverted into a new base
  (``info.base_reused`` says which, per init image);
  ``denoising_strength`` is the tail fraction K/T, as in img2img, ``prompt`` the edit prompt.
  Image ``j`` of ``batch_size x n_iter`` (several init images are the batch, as in A1111)
  re-enters the chain re-noised with seed ``seed + j``. ``mask`` (white may change; blurred,
  inverted as A1111 does: a1111_masks.py): outside it the reply's pixels are the init image's
  own.
- LoRA tags in a prompt (``<lora:name:0.8>``) are the bases' (txt2img) or the edits' (img2img)
  adapters; ``GET /loras`` and ``POST /refresh-loras`` list and reload them (a1111_loras.py).
- ``png-info``, ``sd-models``; job control, options and listings are a1111_jobs.py's; the
  routes of A1111's API that edit-rt has nothing behind answer as a1111_unserved.py's table says
  (an empty listing, null, or 501 naming the route and why), never a bare 404.

A request that ``POST /sdapi/v1/interrupt`` stops answers with the images that finished (its
``info.interrupted`` true), or 409 ``interrupted`` when none had.
"""

from __future__ import annotations

import asyncio
import io
import json
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np
from fastapi import APIRouter, Depends, Request as HttpRequest
from PIL import Image
from pydantic import BaseModel, Field, ValidationError

from .. import __version__
from ..errors import CancelledError, ClientGoneError
from ..model.edit import Edit
from ..model.samplers import a1111_label
from ..serving.generation import watch
from .http_errors import ApiError, validation_error
from ..serving.job_control import A1111, DOOR
from ..serving.inversion import kept_by_base
from ..serving.results import Edited
from ..serving.service import Service
from .a1111_fields import (Common, Img2Img, Settings, Txt2Img, accepted, check_off, eta_of, override, prompts_of, refuse,
                           requested_sampler)  # fmt: skip
from . import a1111_jobs, a1111_loras, a1111_unserved
from .a1111_jobs import TINY_VAE_NAME, model_names, vae_names
from .a1111_loras import PromptLoras, adapters_info, base_adapters, edit_adapters, prompt_loras
from .a1111_masks import a1111_pixel_mask, mask_from_bytes
from .api import b64, decode_base64_or_400, errors
from .dependencies import A1111SettingsDep, ServiceDep


class PngInfoRequest(BaseModel):
    image: str = Field(min_length=1)


class A1111Result(BaseModel):
    images: list[str]
    parameters: dict[str, Any]
    info: str


async def a1111_door() -> None:
    """A dependency of the A1111 routes: the requests they make are the A1111 door's."""
    DOOR.set(A1111)


# every route here runs as the A1111 door: its interrupt, skip and progress see its jobs only
router = APIRouter(prefix="/sdapi/v1", tags=["AUTOMATIC1111"], dependencies=[Depends(a1111_door)])
COMMON = errors(400, 401, 408, 409, 411, 413, 429, 499, 503, 507)


@router.post("/txt2img", response_model=A1111Result, responses=COMMON, summary="Bases (A1111's txt2img)")
async def txt2img(body: Txt2Img, http: HttpRequest, service: ServiceDep, settings: A1111SettingsDep):
    check_off(body)
    sent, body, stripped, loras = as_run(body)
    decoder_of(service, body)
    clip_skip, _ = clip_skip_of(service, settings, body)
    want = served_size(body, service.cfg.served_sizes())
    epoch = service.jobs.interrupts
    sampler, field = requested_sampler(body, service.fields.sampler_of(None))
    first = service.fields.base_of(body.prompt, body.negative_prompt, f"{want[0]}x{want[1]}", body.steps, body.cfg_scale,
                                   body.seed, clip_skip, sampler=sampler, sampler_param=field)  # fmt: skip
    first = replace(first, adapters=base_adapters(service, first.adapters, loras))
    service.fields.check_adapters(first.adapters, "prompt")  # more tags than slots: 400, as the OpenAI route
    bases = [replace(first, seed=first.seed + k) for k in range(body.batch_size * body.n_iter)]
    # related generations (docs/related.md) as the server's serve.related.enabled says, for one
    # image without its own seed (a batch asks for variety: exact)
    related = dict(related=None if len(bases) == 1 else False, seed_given=body.seed >= 0)
    results = await together([service.generate(b, http, previews=live_previews(b.steps), **related) for b in bases],
                             epoch, service)  # fmt: skip
    made = finished(results, epoch, service)
    info = info_of(service, body, first, [g.base.seed for g in made], [png_text(g.png) for g in made],
                   interrupted=len(made) < len(bases), clip_skip=first.clip_skip, sampler=first.sampler,
                   accepted_={**accepted(body, first.sampler), **stripped})  # fmt: skip
    info.update(base_id=made[0].id, base_ids=[g.id for g in made], related=[g.related for g in made],
                **({"adapters": adapters_info(loras)} if loras.uses else {}))  # fmt: skip
    return {"images": [b64(g.png) for g in made] if body.send_images else [], "parameters": sent.model_dump(),
            "info": json.dumps(info)}  # fmt: skip


@router.post("/img2img", response_model=A1111Result, responses={**COMMON, **errors(404)},
             summary="Edits of an edit-rt image's base, or of any image inverted (A1111's img2img)")  # fmt: skip
async def img2img(body: Img2Img, http: HttpRequest, service: ServiceDep, settings: A1111SettingsDep):
    check_off(body)
    sent, body, stripped, loras = as_run(body)
    adapters = edit_adapters(service, loras)
    check_mask_only(body)
    per_iter = images_per_iter(body)
    service.fields.check_edit_count(per_iter * body.n_iter)  # before any image is decoded
    decoder_of(service, body)
    clip_skip, clip_given = clip_skip_of(service, settings, body)
    binary = await binary_mask(service, body)
    seed = body.seed if body.seed >= 0 else secrets.randbelow(2**31)
    epoch = service.jobs.interrupts
    bases = [await init_base(service, body, i, data, clip_skip, clip_given, binary is not None, epoch)
             for i, data in enumerate(body.init_images)]  # fmt: skip
    ran = {**inpainting_accepted(body), **stripped}
    for b in bases:
        ran.update(b.kept)
    # what the edits run: the first image's base's sampler (an uploaded image's: DDIM)
    first = bases[0].found
    sampler = first.get("sampler") or service.fields.sampler_of(None)
    why = ("an uploaded image is inverted with DDIM, and its edits run DDIM" if first.get("image") else
           "this image's base's: an edit re-enters its base's chain with its sampler")  # fmt: skip
    ran = {**accepted(body, sampler, why), **ran}
    # image j of batch_size x n_iter: init image j % per_iter (or the one), seed + j
    where = [(0 if len(bases) == 1 else j % per_iter, j) for j in range(per_iter * body.n_iter)]
    specs = edit_specs(body, adapters, [seed + j for _, j in where])
    png_fields = {"Denoising strength": f"{body.denoising_strength:g}", **mask_fields(body, blur_of(body))}
    runs = [edits_of_image(service, body, b, [specs[j] for at, j in where if at == i], binary, png_fields, http, i)
            for i, b in enumerate(bases)]  # fmt: skip
    done: dict[int, Any] = {}
    for i, out in enumerate(await together(runs, epoch, service)):
        mine = [j for at, j in where if at == i]
        done.update(zip(mine, out if isinstance(out, list) else [out] * len(mine)))
    made = finished([done[j] for j in range(len(where))], epoch, service)
    seeds = [seed + j for j in range(len(where)) if isinstance(done[j], Edited)]
    info = info_of(service, body, None, seeds, [png_text(e.png) for e in made], interrupted=len(made) < len(where),
                   clip_skip=first["clip_skip"], steps=first["steps"], sampler=sampler, size=(first["width"], first["height"]),
                   accepted_=ran, extra=png_fields if binary is not None else {})  # fmt: skip
    info.update(base_ids=[b.id for b in bases], base_reused=[b.reused for b in bases], tail_steps=[e.tail_steps for e in made],
                denoising_strength=body.denoising_strength, **({"adapters": adapters_info(loras)} if loras.uses else {}))  # fmt: skip
    keep = None if body.include_init_images else {"init_images", "mask"}
    parameters = {**sent.model_dump(exclude=keep), **({} if keep is None else {"init_images": None, "mask": None})}
    return {"images": [b64(e.png) for e in made] if body.send_images else [], "parameters": parameters,
            "info": json.dumps(info)}  # fmt: skip


@router.post("/png-info", responses=errors(400, 401, 503), summary="An image's generation parameters")
async def png_info(body: PngInfoRequest, service: ServiceDep):
    items = await service.images.text(decode_base64_or_400(body.image), "image")
    return {"info": items.get("parameters", ""), "items": items, "parameters": {}}


@router.get("/sd-models", responses=errors(401), summary="The served model")
async def sd_models(service: ServiceDep):
    fingerprint = service.fingerprint
    return [{"title": f"{service.model_name} [{fingerprint[:10]}]", "model_name": service.model_name,
             "hash": fingerprint[:10], "sha256": fingerprint, "filename": str(service.cfg.model), "config": None}]  # fmt: skip


router.include_router(a1111_jobs.router)
router.include_router(a1111_loras.router)
router.include_router(a1111_unserved.router)


def clip_skip_of(service: Service, settings: Settings, body: Common) -> tuple[Optional[int], bool]:
    """(diffusers' clip_skip, whether the request itself set it): A1111's
    ``CLIP_stop_at_last_layers`` n is clip_skip n - 1; None: the served config's."""
    names = model_names(service)
    given = override(body, names, vae_names(service, tiny=True)).get("CLIP_stop_at_last_layers")
    stop = given if given is not None else settings.clip_stop
    return (None if stop is None else stop - 1), given is not None


def decoder_of(service: Service, body: Common) -> None:
    """``override_settings.sd_vae: taesd``: this request's images by the tiny decoder (400
    where the export has none); its previews take it anyway when there is one."""
    if (body.override_settings or {}).get("sd_vae") == TINY_VAE_NAME:
        service.choose_decoder("taesd", "override_settings.sd_vae")


def size_of(body: Common, served: tuple[int, int], what: str) -> tuple[int, int]:
    """``width`` x ``height``: ``served`` (their default) or refused naming the field."""
    for field, value, own in (("width", body.width, served[0]), ("height", body.height, served[1])):
        if value not in (None, own):
            raise ApiError(400, f"{field}: {value}, but {what} is {served[0]}x{served[1]}; send width={served[0]}, "
                           f"height={served[1]}", param=field, code="unsupported_size")  # fmt: skip
    return served


# --- img2img's steps ---------------------------------------------------------------------------------


def check_mask_only(body: Img2Img) -> None:
    """What only a mask is for, sent without one: 400 naming the field."""
    if body.mask is not None:
        return
    for field, defaults in (("mask_blur", (None, 4)), ("mask_blur_x", (4,)), ("mask_blur_y", (4,)),
                            ("inpainting_mask_invert", (0,))):  # fmt: skip
        if getattr(body, field) not in defaults:
            raise refuse(field, getattr(body, field), "applies to an inpainting mask; send mask too, or leave it out")


def images_per_iter(body: Img2Img) -> int:
    """The images of one of ``n_iter``: ``batch_size`` of the one init image, or one per init
    image (several are the batch, as in A1111, which takes at most batch_size of them)."""
    k = len(body.init_images)
    if k > 1 and 1 < body.batch_size < k:
        raise refuse("batch_size", body.batch_size, f"{k} init_images are the batch (as in A1111, which takes at most "
                     f"batch_size images): send batch_size {k} (or 1)")  # fmt: skip
    return body.batch_size if k == 1 else k


def blur_of(body: Img2Img) -> tuple[int, int]:
    """The mask's blur (x, y): ``mask_blur`` for both where it is sent."""
    return (body.mask_blur, body.mask_blur) if body.mask_blur is not None else (body.mask_blur_x, body.mask_blur_y)


async def binary_mask(service: Service, body: Img2Img) -> Optional[np.ndarray]:
    """The request's ``mask`` decoded (white may change), before any init image; None: no mask."""
    if body.mask is None:
        return None
    s = service.cfg.serve
    raw = decode_base64_or_400(body.mask, "mask")
    return await service.images.run("mask", mask_from_bytes, raw, "mask", s.max_image_bytes, s.max_image_pixels)


@dataclass(frozen=True)
class InitBase:
    """The base one init image's edits re-enter."""

    id: str
    found: dict  # its Base fields (width, height, steps, clip_skip, sampler, image, ...)
    pixels: Optional[np.ndarray]  # the init image's own, where a mask keeps them outside it
    reused: bool  # its PNG's own stored base (else a new inversion of it)
    kept: dict[str, str]  # info.accepted: what the base runs instead of what the request sent


async def init_base(service: Service, body: Img2Img, i: int, data: str, clip_skip: Optional[int], clip_given: bool,
                    masked: bool, epoch: int) -> InitBase:  # fmt: skip
    """Init image ``i``'s base: the stored one its PNG names (its size and CLIP skip the
    request's, or 400), or the image inverted into a new one at this server's size."""
    param = f"init_images[{i}]"
    raw = decode_base64_or_400(data, param)
    named = await service.named_base(raw, param)  # an edit-rt PNG's own stored base, or None
    if named is not None:
        bid, found = named["id"], named["base"]
        size_of(body, (found["width"], found["height"]), f"this image's base ({bid})")
        if clip_given and clip_skip != found["clip_skip"]:
            raise refuse("override_settings.CLIP_stop_at_last_layers", clip_skip + 1, f"this image's base ({bid}) "
                         f"was made with {found['clip_skip'] + 1}; send that, or leave it out")  # fmt: skip
        pixels = (await service.images.upload(raw, param)).pixels if masked else None
        return InitBase(bid, found, pixels, True, kept_by_base(found, body.steps, body.negative_prompt, clip_skip=clip_skip,
                                                               clip_field="CLIP_stop_at_last_layers"))  # fmt: skip
    # any other image: inverted into a base (A1111's prompt is the target; the image's own
    # description is unknown, so the inversion's prompt is empty)
    size_of(body, (service.cfg.base.width, service.cfg.base.height), "this server's size")
    upload = await service.images.upload(raw, param)
    made = await inverted(service, upload, body, clip_skip, epoch)
    found = {"width": made.base.width, "height": made.base.height, "steps": made.base.steps,
             "clip_skip": made.base.clip_skip, "sampler": made.base.sampler, "image": made.base.image}  # fmt: skip
    return InitBase(made.id, found, upload.pixels, False, {})


def edit_specs(body: Img2Img, adapters: Optional[dict[str, float]], seeds: list[int]) -> list[Edit]:
    """One edit per seed: the request's prompt, guidance and denoising strength (K/T)."""
    try:
        return [Edit(prompt=body.prompt, guidance=body.cfg_scale, tail_fraction=body.denoising_strength, seed=seed,
                     adapters=adapters) for seed in seeds]  # fmt: skip
    except ValidationError as err:
        raise validation_error(err.errors(), Edit) from None


async def edits_of_image(service: Service, body: Img2Img, base: InitBase, specs: list[Edit], binary: Optional[np.ndarray],
                         png_fields: dict[str, str], http: HttpRequest, i: int) -> list[Any]:  # fmt: skip
    """Init image ``i``'s edits of its base, each its :class:`Edited` or its row's error, masked
    where the request sent a mask."""
    masks = {} if binary is None else await masks_of(service, body, binary, base, len(specs), png_fields)
    return await edits_or_errors(service, base.id, specs, http, f"init_images[{i}]", masks)


async def masks_of(service: Service, body: Img2Img, binary: np.ndarray, base: InitBase, n: int,
                   png_fields: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """The edit rows' mask fields for ``n`` edits of ``base``: A1111's mask (blurred, inverted
    as asked) at the base's size, and the init image's pixels kept outside it."""
    size, resize = (base.found["width"], base.found["height"]), service.cfg.serve.resize_uploads
    pixel_mask = await service.images.run("mask", a1111_pixel_mask, binary, bool(body.inpainting_mask_invert),
                                          *blur_of(body), size, resize)  # fmt: skip
    return {"pixel_masks": [pixel_mask] * n, "backdrops": [base.pixels] * n, "png_fields": [png_fields] * n,
            "mask_param": "mask"}  # fmt: skip


# --- shared by txt2img and img2img -------------------------------------------------------------------


def as_run(body) -> tuple[Any, Any, dict[str, str], PromptLoras]:
    """(the body as sent, the body as it runs: its prompts without extra-network tags, what
    ``disable_extra_networks`` took out for ``info.accepted``, the prompt's LoRA tags: none
    with ``disable_extra_networks``, as in A1111)."""
    prompt, negative, stripped = prompts_of(body)
    loras = PromptLoras(prompt) if body.disable_extra_networks else prompt_loras(prompt)
    return body, body.model_copy(update={"prompt": loras.prompt, "negative_prompt": negative}), stripped, loras


def served_size(body: Common, sizes: list[tuple[int, int]]) -> tuple[int, int]:
    """txt2img's ``width`` x ``height`` (by default the first served size), or 400 naming the
    field that no served size has."""
    want = (body.width or sizes[0][0], body.height or sizes[0][1])
    if want not in sizes:
        field = "width" if want[0] not in {w for w, _ in sizes} else "height"
        served = ", ".join(f"{w}x{h}" for w, h in sizes)
        raise ApiError(400, f"{field}: {want[0]}x{want[1]} is not served; this server's engines serve {served}: send one "
                       "of them as width and height", param=field, code="unsupported_size")  # fmt: skip
    return want


async def inverted(service: Service, upload, body: Img2Img, clip_skip: Optional[int], epoch: int):
    """``upload`` inverted into a base at the request's steps and guidance; an interrupt during
    the inversion is 409 ``interrupted``."""
    try:
        return await service.invert(upload, "", body.negative_prompt, body.steps, body.cfg_scale, clip_skip)
    except CancelledError:
        if service.jobs.interrupts != epoch:
            raise interrupted_error() from None
        raise


def inpainting_accepted(body: Img2Img) -> dict[str, str]:
    """A mask's fields every client sends by default that ran as edit-rt inpaints: reported."""
    out = {}
    if body.mask is not None and body.inpainting_fill == 0:
        out["inpainting_fill"] = "1 (original: the image's own content re-enters its chain under the mask)"
    if body.mask is not None and body.inpaint_full_res:
        out["inpaint_full_res"] = ("false (whole picture: the edit re-enters its base's chain over the whole image; "
                                   f"inpaint_full_res_padding {body.inpaint_full_res_padding} unused)")  # fmt: skip
    return out


def mask_fields(body: Img2Img, blur: tuple[int, int]) -> dict[str, str]:
    """A1111's infotext fields of an inpainting, as they ran."""
    if body.mask is None:
        return {}
    out = {"Mask blur": f"{blur[0]}" if blur[0] == blur[1] else f"{blur[0]}x{blur[1]}"}
    if body.inpainting_mask_invert:
        out["Mask mode"] = "Inpaint not masked"
    out.update({"Masked content": "original", "Inpaint area": "Whole picture"})
    return out


# A1111 shows a live preview every 10 steps by default (show_progress_every_n_steps); the
# latest is /progress's current_image. Each costs one VAE decode of its row (docs/serving.md).
PREVIEW_EVERY = 10


def live_previews(steps: int) -> int:
    """How many previews a job of ``steps`` makes: one per PREVIEW_EVERY steps, the last excepted."""
    return max(0, (steps - 1) // PREVIEW_EVERY)


async def edits_or_errors(service: Service, bid: str, specs: list[Edit], http: Optional[HttpRequest], param: str,
                          masks: dict) -> list[Any]:  # fmt: skip
    """Each edit's :class:`Edited` or its row's error, in order (a refusal of the request, an
    unknown base or a bad mask, is raised)."""
    out: list[Any] = [None] * len(specs)
    async for kind, data in watch(service.edit_events(bid, specs, param, live_previews(service.cfg.base.steps), **masks), http):
        if kind == "error":
            out[data["index"]] = data["error"]
        elif kind == "image_edit.completed":
            out[data["index"]] = Edited.from_info(data["index"], data["png"], data["info"])
    return out


async def together(calls: list, epoch: int, service: Service) -> list[Any]:
    """Run ``calls`` (coroutines) at once, each its result or its exception; an interrupt that
    stops one of them stops the others (A1111's interrupt ends the whole job: parts of it still
    queued would otherwise go on)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if service.jobs.interrupts != epoch and any(_stopped(t.exception() or t.result()) for t in done):
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                pending = set()
    finally:
        for task in tasks:  # the client left, or the route failed: nothing goes on without it
            task.cancel()
    return [interrupted_error() if t.cancelled() else (t.exception() or t.result()) for t in tasks]


def _stopped(result: Any) -> bool:
    """Whether ``result`` (an error, or a list of edits and errors) holds a cancelled row."""
    items = result if isinstance(result, list) else [result]
    return any((isinstance(x, CancelledError) and not isinstance(x, ClientGoneError))
               or (isinstance(x, ApiError) and x.code == "interrupted") for x in items)  # fmt: skip


def finished(results: list[Any], epoch: int, service: Service) -> list[Any]:
    """The results that finished, in order. A row that failed is the request's error, unless an
    interrupt stopped it (then the others are the answer; 409 ``interrupted`` if none finished)."""
    errors_ = [r for r in results if isinstance(r, BaseException)]
    stopped = service.jobs.interrupts != epoch
    for err in errors_:
        if not (stopped and _stopped(err)):
            raise err
    made = [r for r in results if not isinstance(r, BaseException)]
    if not made:
        raise interrupted_error()
    return made


def interrupted_error() -> ApiError:
    return ApiError(409, "interrupted (POST /sdapi/v1/interrupt or /skip) before any image of this request finished; "
                    "send it again", code="interrupted")  # fmt: skip


def png_text(png: bytes) -> str:
    return Image.open(io.BytesIO(png)).text["parameters"]


def info_of(service: Service, body: Common, base, seeds: list[int], infotexts: list[str], interrupted: bool,
            clip_skip: Optional[int], sampler: str, steps: Optional[int] = None, size: Optional[tuple[int, int]] = None,
            accepted_: Optional[dict] = None, extra: Optional[dict] = None) -> dict[str, Any]:  # fmt: skip
    """A1111's ``info`` of a job (its ``Processed.js()`` keys) as it ran here: ``sampler`` the
    canonical one that ran, ``accepted_`` what ran instead of what the request said."""
    sampler_name, scheduler = a1111_label(sampler)
    cfg = service.cfg.base
    steps = steps if steps is not None else (base.steps if base is not None else cfg.steps)
    width, height = size or ((base.width, base.height) if base is not None else (cfg.width, cfg.height))
    negative = body.negative_prompt or ""
    n = len(seeds)
    return {
        "prompt": body.prompt, "all_prompts": [body.prompt] * n, "negative_prompt": negative,
        "all_negative_prompts": [negative] * n, "seed": seeds[0], "all_seeds": seeds, "subseed": -1,
        "all_subseeds": [-1] * n, "subseed_strength": 0, "width": width, "height": height,
        "sampler_name": sampler_name, "scheduler": scheduler, "eta": eta_of(sampler),
        "cfg_scale": body.cfg_scale if body.cfg_scale is not None else (base.guidance if base is not None else cfg.guidance),
        "steps": steps, "batch_size": body.batch_size, "n_iter": body.n_iter, "restore_faces": False,
        "face_restoration_model": None, "sd_model_name": service.model_name, "sd_model_hash": service.fingerprint[:10],
        "sd_vae_name": None, "sd_vae_hash": None, "seed_resize_from_w": -1, "seed_resize_from_h": -1,
        "denoising_strength": getattr(body, "denoising_strength", None), "extra_generation_params": extra or {},
        "index_of_first_image": 0, "infotexts": infotexts, "styles": [], "job_timestamp": time.strftime("%Y%m%d%H%M%S"),
        "clip_skip": (clip_skip if clip_skip is not None else cfg.clip_skip) + 1, "is_using_inpainting_conditioning": False,
        "version": f"edit-rt {__version__}", "accepted": dict(accepted_ or {}), "interrupted": interrupted,
    }  # fmt: skip
