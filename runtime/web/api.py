"""The HTTP API's request and response models and its one error shape.

Bodies follow the OpenAI Images API where it has a field (:class:`OpenAiOptions`: ``model``,
``size``, ``response_format``, ``output_format``, ``quality``, ...; what each does here, honoured,
refused or accepted and reported, is openai_fields.py's) and AUTOMATIC1111's API otherwise
(``negative_prompt``, ``steps``, ``cfg_scale``, ``seed`` with -1 for random). Types are strict:
nothing is coerced, and an unknown field is refused. Every error is
``{"error": {"message", "type", "param", "code"}}`` with ``param`` a JSON path such as
``edits[3].strength``; an invalid body is 400 ``invalid_request_error``, as OpenAI answers.
"""

from __future__ import annotations

import base64
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ImageInputError
from ..model.edit import Edit
from ..model.samplers import SAMPLER_NAMES
from ..model.schema import Adapters, ClipSkip, Guidance, Int, SizeCond, Steps, between
from ..pipeline.uploads import decode_base64
from .http_errors import ApiError

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
BASE64 = {"format": "byte", "contentEncoding": "base64"}  # how OpenAPI says "an image as base64 text"
SIZE = r"^(\d{1,5}x\d{1,5}|auto)$"
SAMPLERS = ", ".join(SAMPLER_NAMES)
SAMPLER = (f"The sampler: {SAMPLERS}, or AUTOMATIC1111's name for one (\"DPM++ 2M Karras\", \"Euler a\"); the "
           "server's (its config's base.sampler, else the model's scheduler) if omitted. A base's edits run its sampler.")


DECODER = ("What decodes the images: vae (exact) or taesd (the tiny decoder, about 6% of the VAE's cost, approximate; "
           "400 where the model has none); the server's (its config's decoder, else vae) if omitted. Previews use taesd where there is one.")


class OpenAiOptions(BaseModel):
    """OpenAI's fields on how an image is made or delivered, with the vocabularies of the
    ``openai`` SDK's own types (so a value outside them is refused like any bad value); what
    each value does here is openai_fields.py's table."""

    model_config = STRICT

    model: Optional[str] = Field(None, description="The served model's name, or one of OpenAI's (meaning the served one).")
    size: Optional[str] = Field(None, pattern=SIZE, description="WxH in pixels: the served size (or auto, the default).")
    response_format: Literal["b64_json", "url"] = Field("b64_json", description="b64_json only: this server hosts no files.")
    output_format: Literal["png", "jpeg", "webp", "gif", "svg"] = Field(
        "png", description="png carries the generation parameters (jpeg, webp: as an EXIF UserComment); gif and svg are refused.")
    output_compression: Optional[between(Int, 0, 100)] = Field(None, description="jpeg, webp: the encoder's quality (100 by default).")
    background: Optional[Literal["transparent", "opaque", "auto"]] = Field(None, description="auto or opaque (the images are opaque); transparent is refused.")
    quality: Optional[Literal["low", "medium", "high", "xhigh", "max", "auto", "standard", "hd"]] = Field(
        None, description="auto or standard: the server's sampling steps (send steps to change them); others are refused.")
    moderation: Optional[Literal["low", "auto"]] = Field(None, description="Accepted: this server filters nothing (said in info.accepted).")
    complexity: Optional[Literal["low", "medium", "high"]] = Field(None, description="Refused: send steps.")
    frame_count: Optional[int] = Field(None, description="Refused: no GIF output.")
    frame_duration_ms: Optional[int] = Field(None, description="Refused: no GIF output.")
    svg: Optional[dict[str, Any]] = Field(None, description="Refused: no SVG output.")
    partial_images: Optional[between(Int, 0, 3)] = Field(None, description="With stream: that many decoded previews (image_*.partial_image events) before the image.")
    stream: Optional[bool] = Field(None, description="Server-Sent Events: partial images, then the completed images.")
    user: Optional[str] = Field(None, max_length=256, description="Metadata: echoed as safety_identifier, neither stored nor logged.")
    safety_identifier: Optional[str] = Field(None, max_length=256, description="Metadata: echoed, neither stored nor logged.")


class GenerationRequest(OpenAiOptions):
    prompt: str = Field(min_length=1, description="The base prompt.")
    negative_prompt: Optional[str] = Field(None, description="Omitted or null: the model family's default (SDXL: zeros); \"\" is the empty prompt, encoded. Shared by the base and all its edits.")
    n: int = Field(1, ge=1, le=8, description="Bases to generate, from consecutive seeds (seed, seed + 1, ...).")
    style: Optional[Literal["vivid", "natural"]] = Field(None, description="Refused: describe the style in the prompt.")
    steps: Optional[Steps] = Field(None, description="Sampling steps; the server's default if omitted.")
    cfg_scale: Optional[Guidance] = Field(None, description="Classifier-free guidance; <= 1 turns it off.")
    seed: int = Field(-1, ge=-1, le=2**63 - 1, description="-1 picks a random seed (returned).")
    sampler: Optional[str] = Field(None, max_length=100, description=SAMPLER)
    related: Optional[bool] = Field(None, description="Serve it from a stored base whose prompt is close (its tail "
                                    "from a later step: cheaper, approximate; the reply's info.related says which and "
                                    "how many steps it skipped): true asks, false refuses; none follows the server's "
                                    "serve.related.enabled, except that a request with its own seed is exact. n must be 1.")
    clip_skip: Optional[ClipSkip] = Field(None, description="Text-encoder layers to skip from the end (diffusers' clip_skip).")
    original_width: Optional[SizeCond] = Field(None, description="SDXL: the size conditioning's original width.")
    original_height: Optional[SizeCond] = Field(None, description="SDXL: the size conditioning's original height.")
    crop_top: Optional[SizeCond] = Field(None, description="SDXL: the crop conditioning's top.")
    crop_left: Optional[SizeCond] = Field(None, description="SDXL: the crop conditioning's left.")
    adapters: Optional[Adapters] = Field(None, description="LoRA adapters of the base, {name: scale} (GET /v1/adapters lists them); its edits start from these.")
    decoder: Optional[Literal["vae", "taesd"]] = Field(None, description=DECODER)


class BaseUpload(BaseModel):
    model_config = STRICT

    image: str = Field(min_length=1, json_schema_extra=BASE64, description="The image, base64 (PNG, JPEG, WebP); resized to the served size.")
    source_prompt: str = Field("", description="What the image shows: the inversion's prompt (and the base's).")
    negative_prompt: Optional[str] = Field(None, description="Omitted or null: the model family's default (SDXL: zeros); \"\" is the empty prompt, encoded.")
    steps: Optional[Steps] = None
    cfg_scale: Optional[Guidance] = None
    clip_skip: Optional[ClipSkip] = None


class EditsRequest(BaseModel):
    model_config = STRICT

    base_id: Optional[str] = Field(None, min_length=1, max_length=64, description="A stored base (or send image).")
    image: Optional[str] = Field(None, min_length=1, json_schema_extra=BASE64, description="An image to edit, base64 (PNG, JPEG, WebP): inverted into a base (an edit-rt PNG: its own stored base, re-entered).")
    source_prompt: str = Field("", description="With image: what the image shows (the inversion's prompt).")
    negative_prompt: Optional[str] = Field(None, description="Omitted or null: the model family's default (SDXL: zeros); \"\" is the empty prompt, encoded. With image: the new base's.")
    edits: list[Edit] = Field(min_length=1, description="The edits: the same schema as a config's edits (edit.py).")
    n: int = Field(1, ge=1, le=8, description="Variations per edit: n > 1 runs each edit with n seeds (its seed, seed + 1, ..., or random ones), returned in each image's info.")
    stream: bool = Field(False, description="Server-Sent Events: queue, progress, image_edit.partial_image, image_edit.completed, done.")
    partial_images: int = Field(0, ge=0, le=3, description="With stream: that many decoded previews per edit (image_edit.partial_image events).")
    sampler: Optional[str] = Field(None, max_length=100, description="The base's sampler runs its edits (an image's: ddim); another is refused. Omit it, or send the base's (its info.sampler).")
    decoder: Optional[Literal["vae", "taesd"]] = Field(None, description=DECODER)


# --- responses -----------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class ImageData(BaseModel):
    b64_json: str = Field(description="The image, base64; a PNG carries its generation parameters.")
    revised_prompt: Optional[str] = None


class Ran(BaseModel):
    """What ran, where a request's OpenAI fields could have said otherwise."""

    model: Optional[str] = Field(None, description="The served model.")
    sampler: Optional[str] = Field(None, description=f"The sampler that ran: its name ({SAMPLERS}) and AUTOMATIC1111's, as \"dpmpp_2m_karras (DPM++ 2M Karras)\".")
    steps: Optional[int] = None
    seeds: Optional[list[Optional[int]]] = Field(None, description="Each image's seed (an edit without one: null, the deterministic edit).")
    output_compression: Optional[int] = None
    accepted: dict[str, str] = Field(default_factory=dict, description="OpenAI fields accepted without running as OpenAI's would: field -> what ran instead.")


class GenerationInfo(Ran):
    seconds: float
    store_tier: Optional[str]
    base_ids: list[str]
    related: list[Optional[dict[str, Any]]] = Field(default_factory=list, description="Per image: served related "
                                                    "({skipped_steps, similarity}, and the stored base's base_id where "
                                                    "serve.related.share_bases), or null: generated from scratch.")


class OpenAiReply(BaseModel):
    """OpenAI's top-level ImagesResponse fields: what the images are."""

    background: Optional[str] = None
    output_format: Optional[str] = None
    size: Optional[str] = None
    safety_identifier: Optional[str] = None


class GenerationResponse(OpenAiReply):
    id: str = Field(description="The (first) base's id: edit it with POST /v1/images/edits.")
    created: int
    seed: int
    data: list[ImageData]
    parameters: dict[str, Any]
    info: GenerationInfo


class EditInfo(BaseModel):
    seconds: float
    tail_steps: int
    strength: float
    directions: Optional[list[dict[str, Any]]] = Field(None, description="The edit's directions as they ran ({prompt, strength} each); absent for a plain edit.")
    preserve: str
    seed: Optional[int] = Field(None, description="The variation's seed (null: the deterministic edit).")
    sampler: Optional[str] = Field(None, description="The sampler it ran: its base's (an uploaded image's: ddim).")


class EditData(ImageData):
    index: int
    info: EditInfo


class EditsResponse(OpenAiReply):
    created: int
    base_id: str = Field(description="The edited base (for an uploaded image: the new base's id, to edit it again).")
    base_ids: Optional[list[str]] = Field(None, description="The form's and variations': each uploaded image's base.")
    base_reused: Optional[list[bool]] = Field(None, description="Per uploaded image (base_ids' order): true where it was an "
                                              "edit-rt PNG whose own stored base (its Base id) the edits re-entered, false "
                                              "where it was inverted into a new base.")  # fmt: skip
    data: list[EditData]
    info: Optional[Ran] = None


class BaseInfo(BaseModel):
    id: str
    tier: Optional[str]
    base: dict[str, Any]
    window_start: int
    bytes: int
    pinned: bool
    latents_precision: str
    kv_precision: str


class Deleted(BaseModel):
    id: str
    deleted: bool


class Health(BaseModel):
    status: str
    backend: Optional[str] = None
    error: Optional[str] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "edit-rt"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AdapterCard(BaseModel):
    name: str = Field(description="What a base's or an edit's adapters: {name: scale} names; a sweep's adapter.")
    rank: Optional[int] = Field(None, description="The LoRA's rank (null on Ray Serve's ingress: the replicas load it).")
    graphs: list[str] = Field(description="The graphs it changes: text_encoder, kv_proj, unet_step.")
    text: Optional[bool] = Field(None, description="Whether it changes what a prompt encodes to (its K/V), not only the UNet.")


class AdapterList(BaseModel):
    data: list[AdapterCard]
    slots: int = Field(description="Adapters one row may use at once (the export's adapter slots; 0: none).")


def errors(*statuses: int) -> dict[int, dict]:
    """OpenAPI ``responses`` entries: each status with the one error schema."""
    return {s: {"model": ErrorBody, "description": _STATUS.get(s, "error")} for s in statuses}


_STATUS = {
    400: "invalid request (a field, its type or its range)",
    401: "missing or wrong credentials: the bearer token, or an HTTP Basic user where serve.api_auth is set (see WWW-Authenticate)",
    404: "unknown base or route",
    405: "method not allowed (see Allow)",
    408: "the request body stalled",
    409: "the base is damaged or in use",
    411: "a POST without Content-Length",
    413: "too many edits, a body over serve.max_body_bytes, or an image over serve.max_image_bytes / max_image_pixels",
    429: "the queue is full (see Retry-After)",
    499: "the client disconnected",
    503: "loading, draining, shutting down, the store busy or full of bases in use, or an image not decoded within serve.image_timeout_s (see Retry-After)",
    507: "the store's disk is full and its RAM cannot hold the base (free space, or lower store.disk_mb)",
}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def decode_base64_or_400(data: str, param: str = "image") -> bytes:
    try:
        return decode_base64(data, param)
    except ImageInputError as err:
        raise ApiError(err.status, str(err), param=param, code="invalid_image") from None
