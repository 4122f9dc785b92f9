"""AUTOMATIC1111's inpainting mask (img2img's ``mask``) as the pixel mask an edit runs with.

As A1111 makes it (``modules/processing.py``, ``StableDiffusionProcessingImg2Img.init``, whole
picture):

1. ``create_binary_mask``: an RGBA mask with any transparent pixel is its alpha channel, cut at
   128 (``mask_round``); any other is its grey level (``convert("L")``): white may change;
2. ``inpainting_mask_invert``: 255 - the mask;
3. ``mask_blur_x`` / ``mask_blur_y``: OpenCV's ``GaussianBlur`` along x, then along y, each
   with a kernel of 2 * int(2.5 sigma + 0.5) + 1 taps and mirrored borders (BORDER_REFLECT_101),
   8-bit after each pass;
4. resized to the image's size ("just resize": Lanczos), then doubled and clipped: the overlay
   that pastes the init image back outside the mask (weight 1 from the blurred edge inward).

Here 3 and 4 run the other way round: a mask of another size is resized to the served size
first and blurred there with its sigmas scaled by the resize (both steps are linear, so only
the 8-bit rounding differs), so no per-pixel work is done at an upload's own size.

The result, [H, W] float32 in [0, 1], is the edit's ``pixel_mask``: where it is 0 (past the blur
band) the reply's pixels are the init image's own. Blocking work: the server decodes it in its
image pool, within the upload limits and ``serve.image_timeout_s`` (serving/image_work.py).
"""

from __future__ import annotations


import numpy as np
from PIL import Image, ImageOps

from ..errors import ImageInputError
from ..pipeline.uploads import DAMAGED, FORMATS, opened_image


def mask_from_bytes(data: bytes, param: str, max_bytes: int, max_pixels: int) -> np.ndarray:
    """Steps 1 of the module's docstring: ``data`` (any image this server reads) as A1111's
    binary mask, [h, w] uint8 at its own size (255: may change), upright by its EXIF orientation."""
    image = opened_image(data, param, max_bytes, max_pixels)  # the upload's own checks: bytes, declared size
    try:
        image = ImageOps.exif_transpose(image)
        if image.mode == "RGBA" and image.getextrema()[-1] != (255, 255):
            alpha = np.asarray(image.getchannel("A"))
            return np.where(alpha > 128, 255, 0).astype(np.uint8)
        return np.asarray(image.convert("L"), dtype=np.uint8)
    except DAMAGED as err:
        raise ImageInputError(f"{param}: not an image this server reads ({', '.join(FORMATS)}; {type(err).__name__})") from None


def gaussian_blur(mask: np.ndarray, sigma: float, axis: int) -> np.ndarray:
    """OpenCV's ``GaussianBlur`` of an 8-bit [h, w] mask along ``axis`` (1: x, 0: y) as A1111
    calls it: 2 * int(2.5 sigma + 0.5) + 1 taps of exp(-d^2 / (2 sigma^2)), normalised, the
    border mirrored without repeating its edge pixel (BORDER_REFLECT_101), rounded to 8 bits.

    One matrix product: the taps, folded onto the mask's own n pixels by the mirroring, are an
    [n, n] matrix (n the served size, as the mask is resized first), so the work is BLAS's,
    not a Python loop over taps."""
    if sigma <= 0:
        return mask
    radius = int(2.5 * sigma + 0.5)
    d = np.arange(-radius, radius + 1, dtype=np.float64)
    kernel = np.exp(-(d**2) / (2.0 * sigma**2))
    kernel /= kernel.sum()
    n = mask.shape[axis]
    taps = np.zeros((n, n), dtype=np.float64)  # taps[j, o]: source pixel j's weight in output o
    out_index = np.repeat(np.arange(n), len(kernel))
    source = out_index + np.tile(np.arange(-radius, radius + 1), n)
    if n > 1:  # BORDER_REFLECT_101 repeats with period 2 (n - 1): -1 -> 1, n -> n - 2
        period = 2 * (n - 1)
        source = np.mod(source, period)
        source = np.where(source >= n, period - source, source)
    else:
        source = np.zeros_like(source)
    np.add.at(taps, (source, out_index), np.tile(kernel, n))
    values = mask.astype(np.float64)
    out = values @ taps if axis == 1 else taps.T @ values
    return np.floor(out + 0.5).clip(0, 255).astype(np.uint8)


def a1111_pixel_mask(binary: np.ndarray, invert: bool, blur_x: float, blur_y: float, size: tuple[int, int],
                     resize: bool, param: str = "mask") -> np.ndarray:  # fmt: skip
    """Steps 2-4: the binary mask as the edit's pixel mask at ``size`` (width, height), [H, W]
    float32 in [0, 1]. A mask of another size is resized when ``resize`` (serve.resize_uploads,
    as its init image is), else refused naming ``param``."""
    mask = 255 - binary if invert else binary
    h, w = mask.shape
    if (w, h) != tuple(size):
        if not resize:
            raise ImageInputError(f"{param}: {w}x{h}; this server edits {size[0]}x{size[1]} "
                                  "images (send the mask at that size, or set serve.resize_uploads: true)")  # fmt: skip
        # Resized before any per-pixel work, the blur's sigma scaled with it (A1111 blurs at the
        # mask's own size, then resizes: both linear, so the order changes only the rounding);
        # a 5000x5000 mask costs what a served-size one does.
        mask = np.asarray(Image.fromarray(mask).resize(tuple(size), Image.LANCZOS), dtype=np.uint8)
        blur_x, blur_y = blur_x * size[0] / w, blur_y * size[1] / h
    mask = gaussian_blur(gaussian_blur(mask, blur_x, axis=1), blur_y, axis=0)
    overlay = np.clip(mask.astype(np.float32) * 2, 0, 255).astype(np.uint8)
    return overlay.astype(np.float32) / 255.0
