"""Images a user brings (an upload, a base64 string, a config's ``base.image``), made ready to invert.

One function reads them all and says clearly what is wrong with a bad one: not an image, too
many bytes (``serve.max_image_bytes``), transparent pixels (flatten first: what is behind them is
not known), another size than the served one (resized to it when ``serve.resize_uploads``, else
refused with the size it must have). Grayscale and fully opaque RGBA images are converted to
RGB. The result's key is the sha256 of the pixels inverted, so the same picture finds the same
base again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, UnidentifiedImageError

from .errors import EditRtError


class ImageInputError(EditRtError):
    """An image that cannot be edited as given; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Upload:
    pixels: np.ndarray  # [H, W, 3] float32 in [0, 1]
    sha256: str
    notes: list[str] = field(default_factory=list)  # what was done to it (converted, resized)

    @property
    def key(self) -> str:
        return f"sha256:{self.sha256}"


def decode_base64(data: str, param: str) -> bytes:
    """Base64, with or without a ``data:image/...;base64,`` prefix."""
    if data.startswith("data:"):
        data = data.split(",", 1)[-1]
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(f"{param}: not base64 (send the image's bytes base64-encoded)") from None


def image_from_bytes(data: bytes, size: tuple[int, int], param: str, max_bytes: int, resize: bool) -> Upload:
    """``data`` (PNG, JPEG, WebP, ...) as the served ``size`` (width, height) RGB pixels."""
    if len(data) > max_bytes:
        raise ImageInputError(f"{param}: {len(data)} bytes, at most {max_bytes} (serve.max_image_bytes)", 413)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise ImageInputError(f"{param}: not an image this server reads (PNG, JPEG, WebP; {type(err).__name__})") from None
    notes = []
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        alpha = np.asarray(image.convert("RGBA"))[..., 3]
        if (alpha < 255).any():
            raise ImageInputError(f"{param}: {int((alpha < 255).sum())} transparent pixels; flatten the image onto a "
                                  "background first (what lies behind them is not known)")  # fmt: skip
        notes.append(f"dropped an opaque alpha channel ({image.mode})")
    elif image.mode != "RGB":
        notes.append(f"converted from {image.mode} to RGB")
    image = image.convert("RGB")
    if image.size != tuple(size):
        if not resize:
            raise ImageInputError(f"{param}: {image.size[0]}x{image.size[1]}; this server edits {size[0]}x{size[1]} images "
                                  "(resize it, or set serve.resize_uploads: true)")  # fmt: skip
        notes.append(f"resized from {image.size[0]}x{image.size[1]} to {size[0]}x{size[1]}")
        image = image.resize(tuple(size), Image.LANCZOS)
    pixels = np.asarray(image, dtype=np.uint8)
    return Upload(pixels.astype(np.float32) / 255.0, hashlib.sha256(pixels.tobytes()).hexdigest(), notes)
