"""OpenAI's ``images.edit`` form (multipart): each uploaded image inverted into a base, then
edited; its text fields read as the one edit schema (model/edit.py) and refused in its words.
"""

from __future__ import annotations

import time
from typing import Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request as HttpRequest

from ..model.edit import Edit
from ..model.schema import Guidance, Int, Steps, between
from ..serving.errors import ApiError, echo, validation_error
from ..serving.service import Service
from .api import b64


class EditForm(BaseModel):
    """The form's text fields, with the JSON bodies' types and ranges (api.py, model/schema.py)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # OpenAI's form has more fields

    prompt: str = Field(min_length=1)
    n: between(Int, 1, 8) = 1
    source_prompt: str = ""
    negative_prompt: Optional[str] = None
    steps: Optional[Steps] = None
    cfg_scale: Optional[Guidance] = None
    response_format: Literal["b64_json"] = "b64_json"


NUMBERS = {"n": int, "steps": int, "cfg_scale": float, "strength": float, "tail_steps": int, "seed": int}


async def edit_upload(service: Service, http: HttpRequest) -> dict:
    """OpenAI's ``images.edit`` form: each uploaded image is inverted into a base (or found
    again), then edited with ``prompt``; ``base_ids`` name the bases for further edits. Every
    field is checked before the first image is decoded."""
    form = await http.form()
    files = [v for k, v in form.multi_items() if k in ("image", "image[]") and hasattr(v, "read")]
    if not files:
        raise ApiError(400, "image: required (a file field named image, as OpenAI's images.edit sends it)",
                       param="image", code="missing")  # fmt: skip
    text = {k: v for k, v in form.multi_items() if isinstance(v, str)}
    values = {**text, **{name: form_number(text, name, kind) for name, kind in NUMBERS.items()}}
    values = {k: v for k, v in values.items() if v is not None}
    if values.get("response_format", "b64_json") != "b64_json":
        raise ApiError(400, "response_format: this server hosts no files; use b64_json (the default)",
                       param="response_format", code="unsupported_value")  # fmt: skip
    try:
        fields = EditForm(**values)
        seed = values.get("seed")
        specs = [Edit(prompt=fields.prompt, strength=values.get("strength"), tail_steps=values.get("tail_steps"),
                      seed=seed + j if seed is not None and fields.n > 1 else seed, guidance=fields.cfg_scale,
                      preserve=values.get("preserve")) for j in range(fields.n)]  # fmt: skip
    except ValidationError as err:  # the form's fields as the one schema, refused in its words
        raise validation_error(err.errors(), candidates=(EditForm, Edit)) from None
    service.check_edit_count(fields.n * len(files))
    out, bases = [], []
    for k, f in enumerate(files):
        upload = await service.upload(await f.read(), "image" if len(files) == 1 else f"image[{k}]")
        made = await service.invert(upload, fields.source_prompt, fields.negative_prompt, fields.steps, fields.cfg_scale)
        bases.append(made.id)
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
