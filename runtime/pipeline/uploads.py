"""Images a user brings (an upload, a base64 string, a config's ``base.image``), made ready to invert.

``image_from_bytes`` reads them all, the same way for every route, and says clearly what is
wrong with a bad one. It is blocking work (a decode): the server runs it in its image pool,
each task within ``serve.image_timeout_s`` (serving/image_work.py); the checks below bound how
long one can take.

- Refused before a pixel is decoded: too many bytes (``serve.max_image_bytes``), or a declared
  width x height past ``serve.max_image_pixels`` (413: a few KB of PNG can declare gigapixels;
  the size comes from the header, ``Image.open`` being lazy). Pillow's own bomb check is off:
  this limit, from the config, is the one that holds.
- Not an image (400): not PNG, JPEG, WebP, GIF, TIFF or BMP, or damaged (whatever the decoder
  raises for it). Animated or multi-page images give their first frame.
- Turned upright by their EXIF orientation, then taken to RGB: ``1 L P RGBX CMYK YCbCr LAB HSV``
  by Pillow's conversion (CMYK by its plain formula; no ICC profile is applied to any mode);
  modes with alpha (``RGBA LA PA RGBa La``, or a transparency key) only when every pixel is
  opaque (what lies behind a transparent one is not known); 16-bit ``I;16*`` as 0..65535 ->
  0..1 (a 16-bit PNG, TIFF); 32-bit ``I`` the same when its values lie in 0..65535 (how Pillow
  holds 16-bit pixels) and refused otherwise, there being no scale a viewer agrees on; float
  ``F`` (a float TIFF) taken as 0..1 and refused outside it rather than clipped. High-bit
  pixels are rounded to 8 bits. Any other mode is refused by name.
- Another size than the served one: resized to it when ``serve.resize_uploads``, else refused
  with the size it must have.

The result's key is the sha256 of the 8-bit pixels inverted, so the same picture finds the
same base again; a base encoded by the tiny encoder (``taesd_encoder``, pipeline/decoders.py)
has its own key (:meth:`Upload.key_for`), its latents being another autoencoder's. ``text_of_image`` reads an image's text (AUTOMATIC1111's ``parameters``)
with the same checks and without decoding pixels; ``decode_base64`` reads what JSON carries.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
from dataclasses import dataclass, field

import numpy as np
from PIL import ExifTags, Image, ImageOps, PngImagePlugin

from ..errors import ImageInputError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "TIFF", "BMP")  # JPEG includes MPO, what phones write
CONVERTED = {"1", "L", "P", "RGBX", "CMYK", "YCbCr", "LAB", "HSV", "RGBA", "LA", "PA", "RGBa", "La"}
ALPHA = {"RGBA", "LA", "PA", "RGBa", "La"}  # the alpha band is the last
HIGH_BIT = {"I;16", "I;16B", "I;16L", "I;16N", "I", "F"}
# What Pillow's decoders raise for damaged or hostile files: each is a 400, never a 500.
DAMAGED = (OSError, ValueError, SyntaxError, struct.error, EOFError, IndexError, KeyError, TypeError, ZeroDivisionError)
BOMB = (Image.DecompressionBombError, Image.DecompressionBombWarning)
TEXT_CHUNKS = {b"tEXt", b"zTXt", b"iTXt"}
WHITESPACE = str.maketrans("", "", " \t\r\n")

# Pillow's bomb check is a process-wide constant: past 89 M pixels it *prints* a warning, past
# 179 M it raises, whatever serve.max_image_pixels says. opened_image checks that limit instead.
Image.MAX_IMAGE_PIXELS = None


@dataclass
class Upload:
    pixels: np.ndarray  # [H, W, 3] float32 in [0, 1]
    sha256: str
    notes: list[str] = field(default_factory=list)  # what was done to it (converted, resized)

    @property
    def key(self) -> str:
        return f"sha256:{self.sha256}"

    def key_for(self, encoder: str) -> str:
        """The key (``Base.image``) of the base these pixels invert into through ``encoder``
        (decoders.ENCODER_GRAPHS): the VAE's is :attr:`key` itself, the bases inverted before
        the tiny encoder existed keeping theirs; another encoder's latent is another base."""
        return self.key if encoder == "vae" else f"{self.key};encoder={encoder}"


def decode_base64(data: str, param: str) -> bytes:
    """Base64, with or without a ``data:image/...;base64,`` prefix, line breaks and spaces
    allowed (the ``base64`` tool wraps at 76 characters). Linear in ``len(data)``, which the
    body limit (``serve.max_body_bytes``) bounds."""
    if data.startswith("data:"):
        head, comma, data = data.partition(",")
        if not comma or not head.endswith(";base64"):
            raise ImageInputError(f"{param}: a data: URL must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(data.translate(WHITESPACE), validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(f"{param}: not base64 (send the image's bytes base64-encoded)") from None


def image_from_bytes(data: bytes, size: tuple[int, int], param: str, max_bytes: int, resize: bool, max_pixels: int) -> Upload:
    """``data`` (PNG, JPEG, WebP, GIF, TIFF, BMP) as the served ``size`` (width, height) RGB
    pixels; at most ``max_bytes`` bytes and ``max_pixels`` pixels, checked before decoding."""
    image, notes = opened_image(data, param, max_bytes, max_pixels), []
    try:
        if getattr(image, "is_animated", False):
            notes.append(f"took the first frame of an animated or multi-page {image.format}")
        image.load()
        orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
        if orientation in range(2, 9):
            ImageOps.exif_transpose(image, in_place=True)
            notes.append(f"turned upright (EXIF orientation {orientation})")
        image = _rgb(image, param, notes)
    except DAMAGED as err:
        raise _not_an_image(param, err) from None
    if image.size != tuple(size):
        if not resize:
            raise ImageInputError(f"{param}: {image.size[0]}x{image.size[1]}; this server edits {size[0]}x{size[1]} images "
                                  "(resize it, or set serve.resize_uploads: true)")  # fmt: skip
        notes.append(f"resized from {image.size[0]}x{image.size[1]} to {size[0]}x{size[1]}")
        image = image.resize(tuple(size), Image.LANCZOS)
    pixels = np.asarray(image, dtype=np.uint8)
    return Upload(pixels.astype(np.float32) / 255.0, hashlib.sha256(pixels.tobytes()).hexdigest(), notes)


def text_of_image(data: bytes, param: str, max_bytes: int, max_pixels: int) -> dict[str, str]:
    """The text an image carries (PNG text chunks wherever they lie, other formats' string
    info, a JPEG's comment), with ``parameters`` taken, as AUTOMATIC1111 does, from the EXIF
    UserComment or the comment when no PNG chunk holds it. No pixel is decoded: damage in the
    pixel data goes unnoticed here (``image_from_bytes`` finds it)."""
    image = opened_image(data, param, max_bytes, max_pixels)
    text = {k: v for k, v in image.info.items() if isinstance(v, str)}
    try:
        if image.format == "PNG":
            text.update(_png_text(data))
        elif "parameters" not in text:
            comment = image.getexif().get_ifd(ExifTags.IFD.Exif).get(ExifTags.Base.UserComment)
            if isinstance(comment, bytes) and comment[8:]:
                encoding = "utf_16_be" if comment.startswith(b"UNICODE\0") else "utf-8"  # as A1111 writes it
                text["parameters"] = comment[8:].decode(encoding, errors="replace")
    except DAMAGED as err:
        raise _not_an_image(param, err) from None
    if isinstance(image.info.get("comment"), bytes):
        text["comment"] = image.info["comment"].decode("utf-8", errors="replace")
        text.setdefault("parameters", text["comment"])
    return text


def opened_image(data: bytes, param: str, max_bytes: int, max_pixels: int) -> Image.Image:
    """``data`` opened (its header read, no pixel decoded) and its declared size checked."""
    if len(data) > max_bytes:
        raise ImageInputError(f"{param}: {len(data)} bytes, at most {max_bytes} (serve.max_image_bytes)", 413)
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except BOMB:  # only if someone set Image.MAX_IMAGE_PIXELS again
        raise _too_many_pixels(param, "too many", max_pixels) from None
    except DAMAGED as err:
        raise _not_an_image(param, err) from None
    width, height = image.size
    if width * height > max_pixels:
        raise _too_many_pixels(param, f"{width}x{height} is {width * height}", max_pixels)
    return image


def _rgb(image: Image.Image, param: str, notes: list[str]) -> Image.Image:
    """Loaded pixels of any mode as RGB, or the error naming why they cannot be."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in HIGH_BIT:
        notes.append(f"converted from {mode} to RGB ({'0..1' if mode == 'F' else '0..65535'} as 0..255)")
        return _eight_bit(image, param).convert("RGB")
    if mode not in CONVERTED:
        raise ImageInputError(f"{param}: pixels of mode {mode}, which this server does not read (save it as RGB)")
    if mode in ALPHA or "transparency" in image.info:
        alpha = image.getchannel(len(image.getbands()) - 1) if mode in ALPHA else image.convert("RGBA").getchannel("A")
        _refuse_transparent(sum(alpha.histogram()[:255]), param)
        notes.append(f"dropped an opaque alpha channel ({mode})")
    else:
        notes.append(f"converted from {mode} to RGB" + (" (its color profile not applied)" if mode == "CMYK" else ""))
    return (image.convert("LA") if mode == "La" else image).convert("RGB")


def _eight_bit(image: Image.Image, param: str) -> Image.Image:
    """16-bit, 32-bit integer or float grey pixels as 8-bit ``L`` (see the module's docstring)."""
    values = np.asarray(image)
    low, high = values.min(), values.max()
    if image.mode == "F":
        if not (0.0 <= low and high <= 1.0):  # NaN fails this too
            raise ImageInputError(f"{param}: float pixels from {low:g} to {high:g}; this server reads float images "
                                  "(mode F) as 0..1: scale it there, or save it as an 8- or 16-bit image")  # fmt: skip
        return Image.fromarray(np.rint(values * 255.0).astype(np.uint8))
    if not (0 <= low and high <= 65535):
        raise ImageInputError(f"{param}: 32-bit integer pixels from {low} to {high}; this server reads integer pixels "
                              "as 16-bit (0..65535): save it as an 8- or 16-bit image")  # fmt: skip
    if "transparency" in image.info:  # a PNG's 16-bit transparency key, which Pillow's convert ignores
        _refuse_transparent(int((values == image.info["transparency"]).sum()), param)
    wide = values.astype(np.uint32)
    wide *= 255
    wide += 32767  # rounds: v * 255 / 65535 to the nearest integer
    wide //= 65535
    return Image.fromarray(wide.astype(np.uint8))


def _png_text(data: bytes) -> dict[str, str]:
    """Every text chunk of a PNG, walked past IDAT without decompressing it (text written
    after the pixels is only read by Pillow's ``load()``); Pillow's chunk handlers keep their
    limits on decompressed text."""
    stream = PngImagePlugin.PngStream(io.BytesIO(data[8:]))
    while True:
        cid, pos, length = stream.read()
        if cid == b"IEND":
            return dict(stream.im_text)
        if cid in TEXT_CHUNKS:
            stream.crc(cid, stream.call(cid, pos, length))
        else:
            stream.fp.seek(pos + length + 4)  # the chunk and its CRC, unread


def _refuse_transparent(count: int, param: str) -> None:
    if count:
        raise ImageInputError(f"{param}: {count} transparent pixels; flatten the image onto a background first "
                              "(what lies behind them is not known)")  # fmt: skip


def _too_many_pixels(param: str, found: str, max_pixels: int) -> ImageInputError:
    return ImageInputError(f"{param}: {found} pixels, at most {max_pixels} (serve.max_image_pixels); "
                           "resize it before sending", 413)  # fmt: skip


def _not_an_image(param: str, err: Exception) -> ImageInputError:
    return ImageInputError(f"{param}: not an image this server reads ({', '.join(FORMATS)}; {type(err).__name__})")
