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

The result, [H, W] float32 in [0, 1], is the edit's ``pixel_mask``: where it is 0 (past the blur
band) the reply's pixels are the init image's own. Blocking work: the server decodes it in its
image pool, within the upload limits.
"""

from __future__ import annotations


import numpy as np
from PIL import Image, ImageOps

from ..uploads import DAMAGED, FORMATS, ImageInputError, opened_image


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


def gaussian_blur(mask: np.ndarray, sigma: int, axis: int) -> np.ndarray:
    """OpenCV's ``GaussianBlur`` of an 8-bit [h, w] mask along ``axis`` (1: x, 0: y) as A1111
    calls it: 2 * int(2.5 sigma + 0.5) + 1 taps of exp(-d^2 / (2 sigma^2)), normalised, the
    border mirrored without repeating its edge pixel (BORDER_REFLECT_101), rounded to 8 bits."""
    if sigma <= 0:
        return mask
    radius = int(2.5 * sigma + 0.5)
    d = np.arange(-radius, radius + 1, dtype=np.float64)
    kernel = np.exp(-(d**2) / (2.0 * sigma**2))
    kernel /= kernel.sum()
    pad = [(0, 0), (0, 0)]
    pad[axis] = (radius, radius)
    padded = np.pad(mask.astype(np.float64), pad, mode="reflect")
    n = mask.shape[axis]
    out = np.zeros(mask.shape, dtype=np.float64)
    for k, weight in enumerate(kernel):
        out += weight * (padded[k : k + n] if axis == 0 else padded[:, k : k + n])
    return np.floor(out + 0.5).clip(0, 255).astype(np.uint8)


def a1111_pixel_mask(binary: np.ndarray, invert: bool, blur_x: int, blur_y: int, size: tuple[int, int],
                     resize: bool, param: str = "mask") -> np.ndarray:  # fmt: skip
    """Steps 2-4: the binary mask as the edit's pixel mask at ``size`` (width, height), [H, W]
    float32 in [0, 1]. A mask of another size is resized when ``resize`` (serve.resize_uploads,
    as its init image is), else refused naming ``param``."""
    mask = 255 - binary if invert else binary
    mask = gaussian_blur(gaussian_blur(mask, blur_x, axis=1), blur_y, axis=0)
    if (mask.shape[1], mask.shape[0]) != tuple(size):
        if not resize:
            raise ImageInputError(f"{param}: {mask.shape[1]}x{mask.shape[0]}; this server edits {size[0]}x{size[1]} "
                                  "images (send the mask at that size, or set serve.resize_uploads: true)")  # fmt: skip
        mask = np.asarray(Image.fromarray(mask).resize(tuple(size), Image.LANCZOS), dtype=np.uint8)
    overlay = np.clip(mask.astype(np.float32) * 2, 0, 255).astype(np.uint8)
    return overlay.astype(np.float32) / 255.0
