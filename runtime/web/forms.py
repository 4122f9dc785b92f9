"""OpenAI's multipart forms: ``images.edit`` and ``images.create_variation``.

``images.edit``: each uploaded image is inverted into a base (or found again; an edit-rt PNG
re-enters its own stored base: openai_uploads.py), then edited with ``prompt``, ``n`` times
(n > 1: seeded variations, seed, seed + 1, ...), the first image with ``mask`` where one is
sent (openai_mask.py); streamed as OpenAI's ``image_edit.*`` events with ``stream``.
``images.create_variation``: the image's base re-noised ``n`` times, seeded, with the base's own
prompt over the config's default tail. Every field is read as the JSON bodies' types
and ranges (api.py, model/schema.py) and checked before the first image is decoded: a field
neither OpenAI's nor edit-rt's is refused by name, never ignored; what OpenAI's fields do here
is openai_fields.py's.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import replace
from typing import Awaitable, Callable, Literal, Optional

import numpy as np
from pydantic import BaseModel, Field, ValidationError
from starlette.requests import Request as HttpRequest

from ..model.edit import Edit
from ..model.schema import Guidance, Int, PreserveMode, Seed, Steps, Strength, between
from ..errors import echo
from .http_errors import ApiError, validation_error
from ..serving.fields import sampler_label
from ..serving.service import Service
from .api import DECODER, OpenAiOptions, b64
from .openai_fields import Delivery, delivery_of
from .openai_mask import mask_from_bytes
from .openai_uploads import found_bases, inverted
from .streams import EventStream, Renderer, chained

Encode = Callable[[Delivery, bytes], Awaitable[bytes]]
# The variation of an image inverted without a description: its edit runs the base's own K/V
# (strength 0), which needs no prompt; an edit's prompt may not be blank, so it says this.
VARIATION_PROMPT = "(a variation: the base's own prompt)"


class EditForm(OpenAiOptions):
    """``images.edit``'s text fields (OpenAI's, then edit-rt's); files: ``image`` (or
    ``image[]``), ``mask``, ``markup`` (refused)."""

    prompt: str = Field(min_length=1, description="The edit prompt.")
    n: between(Int, 1, 8) = Field(1, description="Edits per image: n > 1 gives seeded variations (seed, seed + 1, ...).")
    input_fidelity: Optional[Literal["high", "low"]] = Field(None, description="low (OpenAI's default): the tail; high is refused (send tail_steps).")
    source_prompt: str = Field("", description="What the image shows: the inversion's prompt.")
    negative_prompt: Optional[str] = Field(None, description="The new base's negative prompt (omitted: the family's default).")
    steps: Optional[Steps] = Field(None, description="DDIM steps of the inversion (its edits run them too).")
    cfg_scale: Optional[Guidance] = Field(None, description="Guidance of the inversion and the edit.")
    strength: Optional[Strength] = Field(None, description="The edit's strength (cache.default_strength by default).")
    tail_steps: Optional[between(Int, 1, 1000)] = Field(None, description="The edit's tail (cache.default_tail_fraction by default).")
    seed: Optional[Seed] = Field(None, description="A variation's seed (n > 1: seed, seed + 1, ...; random if omitted).")
    preserve: Optional[PreserveMode] = Field(None, description="auto: only where the changed words attend may the image change.")
    sampler: Optional[str] = Field(None, max_length=100, description="ddim: an uploaded image is inverted with DDIM and its edits run DDIM (another is refused).")
    decoder: Optional[Literal["vae", "taesd"]] = Field(None, description=DECODER + " An image to invert is encoded by the same autoencoder where the model has its encoder.")


class VariationForm(OpenAiOptions):
    """``images.create_variation``'s text fields (OpenAI's, then edit-rt's); file: ``image``."""

    n: between(Int, 1, 8) = Field(1, description="Variations: seeds seed, seed + 1, ...")
    source_prompt: str = Field("", description="What the image shows: the inversion's prompt and the variations'.")
    negative_prompt: Optional[str] = Field(None, description="The new base's negative prompt (omitted: the family's default).")
    steps: Optional[Steps] = Field(None, description="DDIM steps of the inversion (its edits run them too).")
    cfg_scale: Optional[Guidance] = Field(None, description="Guidance of the inversion and the variations.")
    tail_steps: Optional[between(Int, 1, 1000)] = Field(None, description="The re-noised tail (cache.default_tail_fraction by default).")
    seed: Optional[Seed] = Field(None, description="The first variation's seed (random if omitted).")
    sampler: Optional[str] = Field(None, max_length=100, description="ddim: an uploaded image is inverted with DDIM and its variations run DDIM (another is refused).")
    decoder: Optional[Literal["vae", "taesd"]] = Field(None, description=DECODER + " The image is encoded by the same autoencoder where the model has its encoder.")


EDIT_FILES = ("image", "image[]", "mask", "markup")
VARIATION_FILES = ("image",)
INTS = {"n", "steps", "tail_steps", "seed", "output_compression", "partial_images", "frame_count", "frame_duration_ms"}
FLOATS = {"cfg_scale", "strength"}


async def read_form(http: HttpRequest, model: type[BaseModel], file_fields: tuple[str, ...]):
    """The form's files by field (``image[]`` as ``image``) and its text fields as ``model``:
    a field the form does not have, a file where text belongs (or text where a file does), a
    field given twice, each a 400 naming it."""
    form = await http.form()
    files: dict[str, list] = {}
    text: dict[str, object] = {}
    for key, value in form.multi_items():
        is_file = hasattr(value, "read")
        if key in file_fields:
            if not is_file:
                raise ApiError(400, f"{key}: must be a file (multipart with a filename)", param=key, code="invalid_type")
            files.setdefault(key.removesuffix("[]"), []).append(value)
            continue
        name = "svg" if key.startswith("svg[") else key
        if name not in model.model_fields or is_file:
            takes = ", ".join([*file_fields, *model.model_fields])
            raise ApiError(400, f"{echo(key)}: not a {'file ' if is_file else ''}field of this form (it takes {takes}); "
                           "leave it out", param=key[:64], code="unknown_field")  # fmt: skip
        if name == "svg":
            text.setdefault("svg", {})[key] = value  # refused by name with the rest (openai_fields.py)
        elif key in text:
            raise ApiError(400, f"{key}: given twice; send it once", param=key, code="duplicate_field")
        elif value != "":
            text[key] = form_value(key, value)
    try:
        return files, model(**text)
    except ValidationError as err:
        raise validation_error(err.errors(), model) from None


def form_value(name: str, value: str):
    """A form field's text as its type (forms carry text): a number, a boolean, or the text."""
    if name == "stream":
        if value not in ("true", "false"):
            raise ApiError(400, f"stream: must be true or false, got {echo(value)}", param=name, code="invalid_type")
        return value == "true"
    if name not in INTS | FLOATS:
        return value
    try:
        number = int(value) if name in INTS else float(value)
    except ValueError:
        raise ApiError(400, f"{name}: must be {'an integer' if name in INTS else 'a number'}, got {echo(value)}",
                       param=name, code="invalid_type") from None  # fmt: skip
    if name in FLOATS and not np.isfinite(number):
        raise ApiError(400, f"{name}: must be a finite number", param=name, code="invalid_type")
    return number


def check_size(service: Service, size: Optional[str]) -> str:
    """The served size (uploads are resized to it), which ``size`` must name if given."""
    served = f"{service.cfg.base.width}x{service.cfg.base.height}"
    if size not in (None, "auto", served):
        raise ApiError(400, f"size: uploads are edited at this server's {served}; send size {served} or auto, or "
                       "leave it out", param="size", code="unsupported_size")  # fmt: skip
    return served


def seeds_of(n: int, seed: Optional[int], always: bool = False) -> list[Optional[int]]:
    """n seeds: seed, seed + 1, ... (random from a random start when none is given). One edit
    without a seed stays the deterministic edit (None) unless ``always``."""
    if n == 1 and not always:
        return [seed]
    start = seed if seed is not None else secrets.randbelow(2**31)
    return [start + j for j in range(n)]


async def edit_upload(service: Service, http: HttpRequest, encode: Encode):
    """OpenAI's ``images.edit`` form (see the module's docstring)."""
    files, fields = await read_form(http, EditForm, EDIT_FILES)
    service.choose_decoder(fields.decoder)  # before the upload is inverted: it is encoded by the same pair
    images, masks = files.get("image", []), files.get("mask", [])
    if not images:
        raise ApiError(400, "image: required (a file field named image, as OpenAI's images.edit sends it)",
                       param="image", code="missing")  # fmt: skip
    if "markup" in files:
        raise ApiError(400, "markup: not supported; send a mask (transparent where the image may change)",
                       param="markup", code="unsupported_value")  # fmt: skip
    if len(masks) > 1:
        raise ApiError(400, "mask: one mask (it applies to the first image, as OpenAI's does)", param="mask", code="too_many")
    size = check_size(service, fields.size)
    cfg = service.cfg
    strength = cfg.cache.default_strength if fields.strength is None else fields.strength

    def delivered(steps: int) -> Delivery:  # what quality and input_fidelity are reported as, at the base's steps
        tail = fields.tail_steps or max(1, round(cfg.cache.default_tail_fraction * steps))
        return delivery_of(fields, service.model_name, steps, f"{tail} of {steps} steps at strength {strength:g}")

    steps = fields.steps or cfg.base.steps
    delivery = delivered(steps)
    seeds = seeds_of(fields.n, fields.seed)
    try:
        specs = [Edit(prompt=fields.prompt, strength=fields.strength, tail_steps=fields.tail_steps, seed=s,
                      guidance=fields.cfg_scale, preserve=fields.preserve) for s in seeds]  # fmt: skip
    except ValidationError as err:
        raise validation_error(err.errors(), Edit) from None
    service.fields.check_edit_count(fields.n * len(images))
    raw = [await f.read() for f in images]
    # an edit-rt PNG re-enters its own stored base, any other image is inverted (openai_uploads.py)
    found = await found_bases(service, raw, ["image" if len(raw) == 1 else f"image[{k}]" for k in range(len(raw))],
                              fields.sampler)  # fmt: skip
    pixel_mask = await mask_of(service, await masks[0].read(), raw[0]) if masks else None
    kept = await inverted(service, found, fields.source_prompt, fields.negative_prompt, fields.steps, fields.cfg_scale)
    first, bids = found[0].base, [f.id for f in found]
    if found[0].reused:  # what runs is that base's: its steps, its size
        steps, size = first["steps"], f"{first['width']}x{first['height']}"
        delivery = delivered(steps)
    delivery.accepted.update(kept)
    # The mask is the first image's (as OpenAI's); outside it the reply is that upload's own
    # pixels (an inverted base composites onto its source pixels: pipeline.base_image; a
    # re-entered one onto the upload, which may be an edit of it).
    backdrop = {"backdrops": [found[0].upload.pixels] * len(specs)} if found[0].reused else {}
    masked = lambda k: {} if k or pixel_mask is None else {"pixel_masks": [pixel_mask] * len(specs), "mask_param": "mask",  # noqa: E731
                                                           **backdrop}  # fmt: skip
    ran = {"model": service.model_name, "sampler": sampler_label(first["sampler"] or service.fields.default_sampler), "steps": steps,
           "seeds": seeds * len(bids), "output_compression": delivery.output_compression, "accepted": delivery.accepted}  # fmt: skip
    extra = lambda index: {"seed": seeds[index % len(seeds)]}  # noqa: E731
    if delivery.stream:
        return await edit_stream(service, bids, specs, masked, delivery, size, encode, extra)
    out = []
    for k, bid in enumerate(bids):
        out += await service.edit_base(bid, specs, http, **masked(k))
    return {"created": int(time.time()), "base_id": bids[0], "base_ids": bids, "base_reused": [f.reused for f in found],
            **delivery.reply_fields(size), "info": ran,
            "data": [{"index": i, "b64_json": b64(await encode(delivery, e.png)), "info": {**e.info(), **extra(i)}}
                     for i, e in enumerate(out)]}  # fmt: skip


async def edit_stream(service: Service, bids: list[str], specs: list[Edit], masked, delivery: Delivery, size: str,
                      encode: Encode, extra) -> EventStream:  # fmt: skip
    """The edits of every base as one stream of OpenAI's ``image_edit.*`` events; image ``k``'s
    edits are indices ``k * n ...``. Refusals of the first base come before the 200."""
    previews = {"previews": delivery.partial_images} if delivery.partial_images else {}

    async def events():
        for k, bid in enumerate(bids):
            source = service.edit_events(bid, specs, **previews, **masked(k))
            try:
                async for kind, data in source:
                    yield kind, ({**data, "index": k * len(specs) + data["index"]} if "index" in data else data)
            finally:
                await source.aclose()

    stream = events()
    first = await stream.__anext__()  # the first base's refusals (a bad edit, a full queue) before the 200
    render = Renderer("image_edit", delivery, size, lambda png: encode(delivery, png), extra=extra)
    return EventStream(render.stream(chained(first, stream)))


async def mask_of(service: Service, data: bytes, image: bytes) -> np.ndarray:
    """OpenAI's mask as the edit's pixel mask, decoded in the image pool (openai_mask.py)."""
    cfg = service.cfg
    return await service.images.run("mask", mask_from_bytes, data, image, (cfg.base.width, cfg.base.height),
                                       cfg.serve.max_image_bytes, cfg.serve.max_image_pixels)  # fmt: skip


async def variation_upload(service: Service, http: HttpRequest, encode: Encode):
    """OpenAI's ``images.create_variation`` form: the image inverted into a base (or found
    again; an edit-rt PNG's own stored base, re-entered), then ``n`` seeded re-noisings of it,
    each an edit with the base's own prompt over ``tail_steps`` (the config's default tail by
    default)."""
    files, fields = await read_form(http, VariationForm, VARIATION_FILES)
    service.choose_decoder(fields.decoder)
    images = files.get("image", [])
    if len(images) != 1:
        raise ApiError(400, "image: one file field named image (create_variation takes one image)", param="image",
                       code="missing" if not images else "too_many")  # fmt: skip
    size = check_size(service, fields.size)
    steps = fields.steps or service.cfg.base.steps
    delivery = delivery_of(fields, service.model_name, steps)
    if delivery.stream:
        raise ApiError(400, "stream: images.create_variation does not stream; leave it out", param="stream",
                       code="unsupported_value")  # fmt: skip
    seeds = seeds_of(fields.n, fields.seed, always=True)
    described = fields.source_prompt.strip() != ""
    try:
        specs = [Edit(prompt=fields.source_prompt if described else VARIATION_PROMPT, strength=1.0 if described else 0.0,
                      tail_steps=fields.tail_steps, seed=s, guidance=fields.cfg_scale) for s in seeds]  # fmt: skip
    except ValidationError as err:
        raise validation_error(err.errors(), Edit) from None
    service.fields.check_edit_count(fields.n)
    (found,) = await found_bases(service, [await images[0].read()], ["image"], fields.sampler)
    delivery.accepted.update(await inverted(service, [found], fields.source_prompt, fields.negative_prompt, fields.steps,
                                            fields.cfg_scale))  # fmt: skip
    if found.reused:  # a stored base re-entered: its own prompt (its K/V), its steps, its size
        specs = [replace(spec, prompt=VARIATION_PROMPT, strength=0.0) for spec in specs]
        steps, size = found.base["steps"], f"{found.base['width']}x{found.base['height']}"
    done = await service.edit_base(found.id, specs, http)
    ran = {"model": service.model_name, "sampler": sampler_label(found.base["sampler"] or service.fields.default_sampler),
           "steps": steps, "seeds": seeds, "output_compression": delivery.output_compression, "accepted": delivery.accepted}  # fmt: skip
    return {"created": int(time.time()), "base_id": found.id, "base_ids": [found.id], "base_reused": [found.reused],
            **delivery.reply_fields(size), "info": ran,
            "data": [{"index": e.index, "b64_json": b64(await encode(delivery, e.png)), "info": {**e.info(), "seed": seeds[e.index]}}
                     for e in done]}  # fmt: skip
