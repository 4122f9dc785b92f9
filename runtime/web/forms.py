"""OpenAI's ``images.edit`` form (multipart): each uploaded image inverted into a base, then
edited; its text fields read as the one edit schema (model/edit.py) and refused in its words.
"""

from __future__ import annotations

import time

import numpy as np
from pydantic import ValidationError
from starlette.requests import Request as HttpRequest

from ..model.edit import Edit
from ..serving.errors import ApiError, echo, validation_error
from ..serving.service import Service
from .api import b64


async def edit_upload(service: Service, http: HttpRequest) -> dict:
    """OpenAI's ``images.edit`` form: each uploaded image is inverted into a base (or found
    again), then edited with ``prompt``; ``base_ids`` name the bases for further edits."""
    form = await http.form()
    files = [v for k, v in form.multi_items() if k in ("image", "image[]") and hasattr(v, "read")]
    if not files:
        raise ApiError(400, "image: required (a file field named image, as OpenAI's images.edit sends it)",
                       param="image", code="missing")  # fmt: skip
    text = {k: v for k, v in form.multi_items() if isinstance(v, str)}
    prompt = text.get("prompt", "")
    if not prompt:
        raise ApiError(400, "prompt: required field missing", param="prompt", code="missing")
    number = lambda name, kind: form_number(text, name, kind)  # noqa: E731
    n = number("n", int) or 1
    if not 1 <= n <= 8:
        raise ApiError(400, "n: must lie in [1, 8]", param="n", code="out_of_range")
    if text.get("response_format", "b64_json") != "b64_json":
        raise ApiError(400, "response_format: this server hosts no files; use b64_json (the default)",
                       param="response_format", code="unsupported_value")  # fmt: skip
    service.check_edit_count(n * len(files))
    out, bases = [], []
    for k, f in enumerate(files):
        upload = service.upload(await f.read(), "image" if len(files) == 1 else f"image[{k}]")
        made = await service.invert(upload, text.get("source_prompt", ""), text.get("negative_prompt"),
                                 number("steps", int), number("cfg_scale", float))  # fmt: skip
        bases.append(made.id)
        seed = number("seed", int)
        try:  # the form's fields as the one edit schema, refused in its words
            specs = [Edit(prompt=prompt, strength=number("strength", float), tail_steps=number("tail_steps", int),
                          seed=seed + j if seed is not None and n > 1 else seed, guidance=number("cfg_scale", float),
                          preserve=text.get("preserve")) for j in range(n)]  # fmt: skip
        except ValidationError as err:
            raise validation_error(err.errors(), Edit) from None
        out += await service.edit_base(made.id, specs, http)
    return {"created": int(time.time()), "base_id": bases[0], "base_ids": bases,
            "data": [{"index": i, "b64_json": b64(e.png), "info": e.info()} for i, e in enumerate(out)]}


def form_number(form: dict, name: str, kind: type):
    """A form field as a number (forms carry text), None when absent; a bad one is a 400."""
    if name not in form or form[name] == "":
        return None
    try:
        value = kind(form[name])
    except ValueError:
        raise ApiError(400, f"{name}: must be {'an integer' if kind is int else 'a number'}, got {echo(form[name])}",
                       param=name, code="invalid_type") from None  # fmt: skip
    if kind is float and not np.isfinite(value):
        raise ApiError(400, f"{name}: must be a finite number", param=name, code="invalid_type")
    return value
