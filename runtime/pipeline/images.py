"""Pixels out: compositing an edit with its base outside its mask, PNGs carrying their
generation parameters, and a labelled contact sheet.

A mask says per pixel how much of the edit shows: a rectangle (feathered inside its edge), a
pixel mask (any shape, [H, W] in [0, 1]), or ``preserve: auto``'s latent region (upsampled).
Where the weight is 0 the base's pixels come back exactly; the latent keep mask that the step
loop holds to the base's latents is made from the same mask, conservatively (``latent_keep``).
The ``parameters`` text chunk is AUTOMATIC1111's format (pnginfo.py).
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path
from typing import BinaryIO, Optional, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from PIL.PngImagePlugin import PngInfo


def to_uint8(image: np.ndarray) -> np.ndarray:
    """[H, W, 3] float in [0, 1] -> uint8, rounding as diffusers' ``numpy_to_pil`` does."""
    return (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)


def feathered_rectangle(mask, image_hw: tuple[int, int], feather_px: int) -> np.ndarray:
    """[H, W] weight of an explicit mask: 0 outside the rectangle, rising to 1 over
    ``feather_px`` pixels inside its edge (so no pixel outside it can change)."""
    h, w = image_hw
    ys, xs = np.arange(h)[:, None], np.arange(w)[None, :]
    inside = np.minimum(np.minimum(ys - mask.y + 1, mask.y + mask.height - ys), np.minimum(xs - mask.x + 1, mask.x + mask.width - xs))
    return np.clip(inside / (feather_px + 1), 0.0, 1.0).astype(np.float32)


def upsample_weight(region: np.ndarray, image_hw: tuple[int, int]) -> np.ndarray:
    """[h, w] bool latent region -> [H, W] weight, bilinear: 0 wherever no region pixel is near,
    a soft edge about one latent pixel wide."""
    field = Image.fromarray(region.astype(np.float32))  # mode "F"
    return np.asarray(field.resize((image_hw[1], image_hw[0]), Image.BILINEAR), dtype=np.float32).clip(0.0, 1.0)


def latent_keep(pixel_mask: np.ndarray, latent_hw: tuple[int, int]) -> np.ndarray:
    """[H, W] pixel mask (> 0: may change) -> [1, h, w] bool, True where a latent pixel keeps the
    base's latent: where every pixel of its (H/h x W/w) block is 0. Conservative, as a rectangle
    grows to whole latent pixels: nothing the mask lets change is held back."""
    h, w = latent_hw
    H, W = pixel_mask.shape
    blocks = np.asarray(pixel_mask).reshape(h, H // h, w, W // w)
    return (blocks.max(axis=(1, 3)) <= 0.0)[None]


def checked_pixel_mask(mask, image_hw: tuple[int, int]) -> np.ndarray:
    """``mask`` as a pixel mask of an ``image_hw`` (H, W) image: [H, W] float32 in [0, 1]. Raises
    ValueError saying what it must be instead (one channel, the image's size, finite values in
    [0, 1])."""
    array = np.asarray(mask)
    h, w = image_hw
    if array.ndim != 2:
        raise ValueError(f"a pixel mask has one channel ([height, width]); got shape {list(array.shape)}: "
                         "send one grey level (or alpha) per pixel")  # fmt: skip
    if array.shape != (h, w):
        raise ValueError(f"{array.shape[1]}x{array.shape[0]}, but the image is {w}x{h}; send a mask of the image's size")
    if not np.issubdtype(array.dtype, np.number) or not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
        raise ValueError("values must be finite and lie in [0, 1] (1: may change, 0: kept)")
    return np.ascontiguousarray(array, dtype=np.float32)


def composite(edit: np.ndarray, base: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``base + weight * (edit - base)`` per pixel ([H, W, 3] images, [H, W] weight): the base
    exactly where the weight is 0, the edit exactly where it is 1."""
    out = edit.copy()
    band = weight < 1.0
    w = weight[band][:, None]
    out[band] = base[band] + w * (edit[band] - base[band])
    return out


def save_png(path: Path | BinaryIO, image: np.ndarray, parameters: str) -> None:
    """Write ``image`` ([H, W, 3] in [0, 1]) as PNG with its ``parameters`` text chunk."""
    info = PngInfo()
    info.add_text("parameters", parameters)
    Image.fromarray(to_uint8(image)).save(path, format="PNG", pnginfo=info)


def png_bytes(image: np.ndarray, parameters: str) -> bytes:
    out = io.BytesIO()
    save_png(out, image, parameters)
    return out.getvalue()


def contact_sheet(images: Sequence[np.ndarray], labels: Sequence[str], min_cell: int = 160,
                  rows: Optional[Sequence[Sequence[int]]] = None) -> Image.Image:  # fmt: skip
    """A grid of images, each upscaled (nearest) to at least ``min_cell`` px with its label under
    it: ``rows`` lists the images' indices on each row (default: four to a row, in order)."""
    if rows is None:
        rows = [range(k, min(k + 4, len(images))) for k in range(0, len(images), 4)]
    cols = max(len(r) for r in rows)
    h, w = images[0].shape[:2]
    zoom = max(1, -(-min_cell // max(h, w)))
    cw, ch = w * zoom, h * zoom
    font = ImageFont.load_default()
    label_h = 28
    sheet = Image.new("RGB", (cols * cw, len(rows) * (ch + label_h)), "white")
    draw = ImageDraw.Draw(sheet)
    chars_per_line = max(8, cw // 6)  # the default bitmap font is ~6 px per character
    places = {k: (j * cw, i * (ch + label_h)) for i, row in enumerate(rows) for j, k in enumerate(row)}
    for k, (image, label) in enumerate(zip(images, labels)):
        x, y = places[k]
        sheet.paste(Image.fromarray(to_uint8(image)).resize((cw, ch), Image.NEAREST), (x, y))
        lines = textwrap.wrap(label, chars_per_line)
        if len(lines) > 2:
            lines = [lines[0], lines[1][: chars_per_line - 3] + "..."]
        draw.multiline_text((x + 3, y + ch + 2), "\n".join(lines), fill="black", font=font)
    return sheet
