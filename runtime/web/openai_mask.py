"""OpenAI's ``mask`` (``images.edit(mask=...)``) as the pixel mask an edit runs with.

OpenAI's mask is an image "whose fully transparent areas (where alpha is zero) indicate where
``image`` should be edited", of the image's own size. Here it becomes an [H, W] float32 array at
the served size, 1 where the image may change and 0 where the reply keeps the uploaded image's
pixels exactly. Refused (400, naming ``mask``): a mask without an alpha channel (it would mark
nothing, or everything, by accident), and one of another size than its image (after the image's
EXIF orientation, as the image is read). Where the image is resized to the served size
(``serve.resize_uploads``), the mask is resized with it (bilinear: its edge becomes a blend).
Blocking work (a decode): the server runs it in its image pool, within the upload limits.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import ExifTags, Image

from ..errors import ImageInputError
from ..pipeline.uploads import DAMAGED, FORMATS, opened_image

UPRIGHT_SWAPS = {5, 6, 7, 8}  # EXIF orientations that turn the image a quarter


def mask_from_bytes(data: bytes, image: bytes, served: tuple[int, int], max_bytes: int, max_pixels: int,
                    param: str = "mask") -> np.ndarray:  # fmt: skip
    """``data`` (a PNG or WebP with alpha) as [H, W] float32 at ``served`` (width, height): 1
    where its alpha is 0 (the image may change there), 0 elsewhere. ``image``: the bytes of the
    image it masks, whose size (upright) it must have."""
    mask = opened_image(data, param, max_bytes, max_pixels)  # the upload's own checks: bytes, declared size
    width, height = mask.size
    try:
        target = _upright_size(image)
        if (width, height) != target:
            raise ImageInputError(f"{param}: {width}x{height}, but its image is {target[0]}x{target[1]}; send a "
                                  "mask of the image's own size")  # fmt: skip
        mask.load()
        if mask.mode not in ("RGBA", "LA", "PA", "RGBa", "La") and "transparency" not in mask.info:
            raise ImageInputError(f"{param}: {mask.mode} pixels have no alpha channel; OpenAI's mask is a PNG whose "
                                  "fully transparent pixels (alpha 0) mark where the image may change")  # fmt: skip
        alpha = np.asarray(mask.convert("RGBA").getchannel("A"))
    except DAMAGED as err:
        raise ImageInputError(f"{param}: not an image this server reads ({', '.join(FORMATS)}; {type(err).__name__})") from None
    editable = (alpha == 0).astype(np.float32)
    if (width, height) != tuple(served):
        editable = np.asarray(Image.fromarray(editable, mode="F").resize(tuple(served), Image.BILINEAR), dtype=np.float32)
    return np.clip(editable, 0.0, 1.0)


def _upright_size(image: bytes) -> tuple[int, int]:
    """The size of ``image`` as it is edited: turned upright by its EXIF orientation."""
    opened = Image.open(io.BytesIO(image), formats=FORMATS)
    width, height = opened.size
    orientation = opened.getexif().get(ExifTags.Base.Orientation, 1)
    return (height, width) if orientation in UPRIGHT_SWAPS else (width, height)
