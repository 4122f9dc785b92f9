"""The OpenAPI request bodies FastAPI cannot see, and the served sizes in every ``size``.

``POST /v1/images/edits`` reads its body by hand (JSON, or OpenAI's ``images.edit`` multipart
form: one route, two bodies) and ``POST /v1/images/variations`` reads a form; their operations
name both bodies here (``openapi_extra``), and :func:`body_schemas` gives the component schemas
they refer to: ``EditsRequest`` (JSON; images as base64 text), ``EditForm`` and
``VariationForm`` (multipart; ``image``, ``mask`` as binary files), and ``GenerationRequest``,
each ``size`` listing the sizes this server serves. server.py adds them to the document.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from ..config.run_config import RunConfig
from .api import EditsRequest, GenerationRequest
from .forms import EditForm, VariationForm

REF = "#/components/schemas/{model}"
BINARY = {"type": "string", "format": "binary"}


def _body(content: dict[str, str]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {kind: {"schema": {"$ref": REF.format(model=name)}}
                                                          for kind, name in content.items()}}}  # fmt: skip


EDITS_BODY = _body({"application/json": "EditsRequest", "multipart/form-data": "EditForm"})
VARIATIONS_BODY = _body({"multipart/form-data": "VariationForm"})


def served_sizes(cfg: RunConfig) -> list[str]:
    """Every "WxH" a generation may ask for (the base's size first, then engines.sizes)."""
    sizes = cfg.served_sizes() if hasattr(cfg, "served_sizes") else [(cfg.base.width, cfg.base.height)]
    return [f"{w}x{h}" for w, h in sizes]


def _size(sizes: list[str], what: str) -> dict[str, Any]:
    return {"anyOf": [{"type": "string", "enum": ["auto", *sizes]}, {"type": "null"}],
            "description": f"WxH in pixels: {', '.join(sizes)} ({what}), or auto (the default: {sizes[0]})."}  # fmt: skip


def body_schemas(cfg: RunConfig) -> dict[str, dict]:
    """Component schemas of the bodies above (and of the models they use), for ``cfg``."""
    models = [(m, "validation") for m in (EditsRequest, EditForm, VariationForm, GenerationRequest)]
    _, top = models_json_schema(models, ref_template=REF)
    schemas = top["$defs"]
    upload = [f"{cfg.base.width}x{cfg.base.height}"]
    schemas["GenerationRequest"]["properties"]["size"] = _size(served_sizes(cfg), "the served sizes")
    image = {**BINARY, "description": "The image (PNG, JPEG, WebP), resized to the served size."}
    mask = {**BINARY, "description": "A PNG (or WebP) of the image's size whose fully transparent pixels (alpha 0) "
                                     "mark where the (first) image may change."}  # fmt: skip
    markup = {**BINARY, "description": "Refused: send a mask."}
    for name, files, required in (("EditForm", {"image": image, "image[]": {"type": "array", "items": image},
                                                "mask": mask, "markup": markup}, ["image", "prompt"]),
                                  ("VariationForm", {"image": image}, ["image"])):  # fmt: skip
        form = schemas[name]
        form["properties"] = {**files, **form["properties"], "size": _size(upload, "uploads are edited at it")}
        form["required"] = required
    return schemas
