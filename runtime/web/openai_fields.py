"""OpenAI's image fields that say how an image is made or delivered, each honoured, refused or
accepted and reported: nothing a client sends is silently dropped.

The fields are those of the ``openai`` SDK's ``images.generate``, ``images.edit`` and
``images.create_variation`` (its ``types/image_*_params.py``); their vocabularies are declared
on :class:`~edit_rt.runtime.web.api.OpenAiOptions`, so a value outside them is refused like any
bad value. What each value does here:

==================  =========================================================================
field               here
==================  =========================================================================
model               the served model's name, or one of OpenAI's (accepted: the served one ran,
                    reported in ``info.accepted``); anything else 400
size                the served size or ``auto``; anything else 400 (the routes check it)
n, prompt, stream   implemented (n: consecutive seeds; stream: Server-Sent Events)
partial_images      implemented with ``stream``: that many decoded previews; 400 without it
response_format     ``b64_json``; ``url`` 400 (this server hosts no files)
output_format       ``png`` (carries the parameters), ``jpeg``, ``webp``; ``gif``, ``svg`` 400
output_compression  implemented for jpeg and webp (the encoder's quality, 100 by default, as
                    OpenAI's); 400 with png unless 100 (png is lossless)
background          ``auto`` and ``opaque`` accepted (Stable Diffusion images are opaque);
                    ``transparent`` 400
quality             ``auto`` and ``standard`` (the default of the clients that send it)
                    accepted, reported as the sampling steps that ran; any other 400 (send steps)
moderation          accepted: this server filters nothing, which ``info.accepted`` says
input_fidelity      ``low`` (OpenAI's default) accepted and reported as the tail that ran;
                    ``high`` 400 (send fewer tail_steps or a lower strength)
user,               metadata: accepted, echoed as ``safety_identifier`` (as OpenAI does), never
safety_identifier   stored or logged
style               400 (DALL-E 3's vivid/natural: describe the style in the prompt)
complexity          400 (this server's effort is its steps: send steps)
frame_count,        400 (no GIF output)
frame_duration_ms
svg                 400 (no SVG output)
markup, mask        markup 400 (send a mask); mask implemented (openai_mask.py)
==================  =========================================================================
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Optional

from PIL import Image

from .http_errors import ApiError

# OpenAI's own image model names: a client that sends one means "the served model".
OPENAI_MODELS = frozenset({"dall-e-2", "dall-e-3", "gpt-image-1", "gpt-image-1-mini", "gpt-image-1.5", "gpt-image-2",
                           "chatgpt-image-latest"})  # fmt: skip
# Values a client library sends by default and this server runs as its own default.
DEFAULT_QUALITIES = frozenset({"auto", "standard"})
EXIF_IFD, USER_COMMENT = 0x8769, 0x9286


@dataclass
class Delivery:
    """How the images of one request are returned, and what the OpenAI fields it accepted
    without running them as OpenAI would became (``accepted``: field -> what ran)."""

    output_format: str = "png"
    output_compression: Optional[int] = None  # jpeg/webp: the encoder's quality
    stream: bool = False
    partial_images: int = 0
    safety_identifier: Optional[str] = None
    accepted: dict[str, str] = field(default_factory=dict)

    def encode(self, png: bytes) -> bytes:
        """``png`` (with its ``parameters`` text) in the requested format; jpeg and webp carry
        the parameters as an EXIF UserComment, where AUTOMATIC1111 writes them."""
        if self.output_format == "png":
            return png
        image = Image.open(io.BytesIO(png))
        text = image.text.get("parameters", "")
        exif = Image.Exif()
        exif.get_ifd(EXIF_IFD)[USER_COMMENT] = b"UNICODE\0" + text.encode("utf_16_be")
        out = io.BytesIO()
        image.convert("RGB").save(out, format=self.output_format.upper(), quality=self.output_compression, exif=exif)
        return out.getvalue()

    def reply_fields(self, size: str) -> dict[str, Any]:
        """OpenAI's top-level reply fields (its ImagesResponse): what this reply is."""
        reply = {"background": "opaque", "output_format": self.output_format, "size": size}
        if self.safety_identifier:
            reply["safety_identifier"] = self.safety_identifier
        return reply


def refuse(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="unsupported_value")


def delivery_of(body: Any, served_model: str, steps: int, tail: Optional[str] = None) -> Delivery:
    """``body``'s OpenAI fields (an :class:`~edit_rt.runtime.web.api.OpenAiOptions`) checked
    and read as a :class:`Delivery`. ``steps``: the sampling steps that will run (what ``quality``
    is reported as); ``tail``: what the edit's tail is (what ``input_fidelity`` is reported as)."""
    got = lambda name: getattr(body, name, None)  # noqa: E731 (not every route has every field)
    out = Delivery(stream=bool(got("stream")))
    model = got("model")
    if model is not None and model != served_model:
        if model not in OPENAI_MODELS:
            raise ApiError(400, f"model: this server serves {served_model!r} (or send none, or one of OpenAI's "
                           "names for it)", param="model", code="model_not_found")  # fmt: skip
        out.accepted["model"] = f"{served_model} (the served model; {model} is taken to mean it)"
    if got("response_format") == "url":
        raise refuse("response_format", "this server hosts no files; use b64_json (the default)")
    fmt = got("output_format") or "png"
    if fmt in ("gif", "svg"):
        raise refuse("output_format", f"{fmt} is not supported; send png (it carries the parameters), jpeg or webp")
    out.output_format = fmt
    compression = got("output_compression")
    if fmt == "png" and compression not in (None, 100):
        raise refuse("output_compression", "png is lossless; send output_format jpeg or webp with it, or leave it out")
    out.output_compression = None if fmt == "png" else (100 if compression is None else compression)
    partial = got("partial_images") or 0
    if partial and not out.stream:
        raise refuse("partial_images", "partial images are streamed: send stream true with it, or leave it out")
    out.partial_images = partial
    if got("background") == "transparent":
        raise refuse("background", "transparent is not supported (Stable Diffusion images are opaque); send opaque "
                     "or auto, or leave it out")  # fmt: skip
    if got("background") is not None:
        out.accepted["background"] = "opaque (Stable Diffusion images have no alpha)"
    quality = got("quality")
    if quality is not None:
        if quality not in DEFAULT_QUALITIES:
            raise refuse("quality", f"{quality!r} is not supported: quality here is the number of sampling steps; send "
                         "steps (extra_body) and quality auto, or leave it out")  # fmt: skip
        out.accepted["quality"] = f"{steps} sampling steps (the server's; send steps to change them)"
    if got("moderation") is not None:
        out.accepted["moderation"] = "none: this server filters nothing"
    fidelity = got("input_fidelity")
    if fidelity == "high":
        raise refuse("input_fidelity", "high is not supported; keep closer to the image with fewer tail_steps or a "
                     "lower strength (extra_body), or leave it out")  # fmt: skip
    if fidelity is not None:
        out.accepted["input_fidelity"] = f"the tail that ran: {tail}" if tail else "the default tail"
    for name, why in (("style", "DALL-E 3's vivid/natural are not supported; describe the style in the prompt"),
                      ("complexity", "not supported; the effort here is the number of sampling steps: send steps"),
                      ("frame_count", "GIF output is not supported"), ("frame_duration_ms", "GIF output is not supported"),
                      ("svg", "SVG output is not supported")):  # fmt: skip
        if got(name) is not None:
            raise refuse(name, f"{why}; leave it out")
    who = got("safety_identifier") or got("user")
    if who:
        out.safety_identifier = who
        for name in ("user", "safety_identifier"):
            if got(name):
                out.accepted[name] = "metadata: echoed as safety_identifier, neither stored nor logged"
    return out
