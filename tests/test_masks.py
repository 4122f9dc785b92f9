"""Pixel masks, the core both doors use (issue 24): an edit masked by any shape keeps every pixel
outside it exactly (the base's, an inverted base's uploaded pixels, or a backdrop's), its latent
outside the mask's latent footprint exactly the base's; AUTOMATIC1111's mask processing (binary,
invert, OpenCV's Gaussian blur, the overlay) against an independent PyTorch rendering of it."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from edit_rt.runtime.model.edit import Base, Mask, TailRow
from edit_rt.runtime.pipeline.images import checked_pixel_mask, to_uint8
from edit_rt.runtime.web.a1111_masks import a1111_pixel_mask, gaussian_blur, mask_from_bytes

from .conftest import TEST_BASE

H = W = 32


def _disc(cy: float, cx: float, r: float) -> np.ndarray:
    y, x = np.mgrid[0:H, 0:W]
    return (((y - cy) ** 2 + (x - cx) ** 2) <= r * r).astype(np.float32)


def _footprint(mask: np.ndarray, scale: int) -> np.ndarray:
    """Latent pixels any of whose pixels may change, by a plain loop (the reference)."""
    h, w = mask.shape[0] // scale, mask.shape[1] // scale
    out = np.zeros((h, w), dtype=bool)
    for i in range(h):
        for j in range(w):
            out[i, j] = (mask[i * scale : (i + 1) * scale, j * scale : (j + 1) * scale] > 0).any()
    return out


def test_a_pixel_mask_keeps_every_pixel_and_latent_outside_it_exactly(pipeline, base_state):
    mask = _disc(20, 11, 6.5)
    mask[2:6, 24:30] = 0.5  # a soft patch apart from the disc: blended, not kept
    (result,) = pipeline.edit(base_state, [TailRow("a yellow triangle", 1.0, 3, TEST_BASE.guidance, pixel_mask=mask)])
    base = to_uint8(pipeline.decode(base_state.final_latent)[0])
    out = to_uint8(result.image)
    assert np.array_equal(out[mask == 0], base[mask == 0])
    assert (out[mask == 1] != base[mask == 1]).any()
    free = _footprint(mask, pipeline.scale)
    assert np.array_equal(result.latent[:, ~free], base_state.final_latent[0][:, ~free])
    assert not np.array_equal(result.latent[:, free], base_state.final_latent[0][:, free])


def test_a_rectangular_pixel_mask_runs_the_rectangles_latents(pipeline, base_state):
    """The same region as a rectangle and as pixels: the same latent footprint, so the same
    latents (the composite differs only by the rectangle's feathering)."""
    rect = np.zeros((H, W), dtype=np.float32)
    rect[5:17, 3:14] = 1.0  # y 5..16, x 3..13: odd edges, whole latent pixels taken
    rows = [TailRow("a blue square", 1.0, 4, TEST_BASE.guidance, mask=Mask(3, 5, 11, 12)),
            TailRow("a blue square", 1.0, 4, TEST_BASE.guidance, pixel_mask=rect)]  # fmt: skip
    a, b = pipeline.edit(base_state, rows)
    assert np.array_equal(a.keep, b.keep) and np.array_equal(a.latent, b.latent)
    out = to_uint8(b.image)
    base = to_uint8(pipeline.decode(base_state.final_latent)[0])
    assert np.array_equal(out[rect == 0], base[rect == 0])


def test_a_rectangle_and_a_pixel_mask_together_change_only_where_both_allow(pipeline, base_state):
    disc = _disc(16, 16, 9)
    row = TailRow("a green circle", 1.5, 3, TEST_BASE.guidance, mask=Mask(0, 0, 16, 32), pixel_mask=disc)
    (result,) = pipeline.edit(base_state, [row])
    base = to_uint8(pipeline.decode(base_state.final_latent)[0])
    out = to_uint8(result.image)
    outside = disc == 0
    outside[:, 16:] = True
    assert np.array_equal(out[outside], base[outside]) and (out[~outside] != base[~outside]).any()


def _smooth_image(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((W, H), Image.BICUBIC))


def test_an_inverted_base_shows_its_uploaded_pixels_outside_the_mask_and_keeps_them_stored(pipeline, tmp_path):
    from edit_rt.runtime.storage.store import BaseStore, base_id

    image = _smooth_image(4)
    base = Base(prompt="a photo", steps=6, guidance=1.0, width=W, height=H, image="sha256:test")
    state = pipeline.invert(image.astype(np.float32) / 255.0, base)
    assert np.array_equal(state.source, image)
    round_trip = to_uint8(pipeline.decode(state.final_latent)[0])
    assert (round_trip != image).any()  # the VAE's round trip is not the upload: the test can tell them apart
    store = BaseStore(pipeline.manifest.fingerprint, 64 * 2**20, tmp_path, 64 * 2**20)
    bid = store.put(state)
    again = BaseStore(pipeline.manifest.fingerprint, 64 * 2**20, tmp_path, 64 * 2**20).get(bid)  # from disk
    assert bid == base_id(state.fingerprint, base) and np.array_equal(again.source, image)
    mask = _disc(10, 22, 7)
    (result,) = pipeline.edit(again, [TailRow("a red square", 1.0, 2, 3.0, pixel_mask=mask)])
    out = to_uint8(result.image)
    assert np.array_equal(out[mask == 0], image[mask == 0])
    assert (out[mask == 1] != image[mask == 1]).any()


def test_a_backdrop_is_what_a_masked_edit_is_composited_onto(pipeline, base_state):
    backdrop = _smooth_image(9)
    mask = _disc(8, 8, 5)
    row = TailRow("a blue square", 1.0, 4, TEST_BASE.guidance, pixel_mask=mask, backdrop=backdrop / np.float32(255))
    (result,) = pipeline.edit(base_state, [row])
    out = to_uint8(result.image)
    assert np.array_equal(out[mask == 0], backdrop[mask == 0])


@pytest.mark.parametrize(
    "mask,needle",
    [
        (np.zeros((32, 32, 3), np.float32), "one channel"),
        (np.zeros((16, 32), np.float32), "32x16, but the image is 32x32"),
        (np.full((32, 32), 2.0, np.float32), "[0, 1]"),
        (np.full((32, 32), np.nan, np.float32), "finite"),
        (np.full((32, 32), "x"), "finite"),
    ],
)
def test_a_pixel_mask_it_cannot_use_is_refused_saying_why(mask, needle):
    with pytest.raises(ValueError) as err:
        checked_pixel_mask(mask, (H, W))
    assert needle in str(err.value)


# --- AUTOMATIC1111's mask --------------------------------------------------------------------


def _torch_a1111_blur(mask: np.ndarray, sigma: int) -> np.ndarray:
    """OpenCV's GaussianBlur as A1111 calls it (x pass, 8 bits, y pass, 8 bits), written with
    PyTorch's conv2d and reflect padding: the independent rendering the blur is held to."""
    import torch
    import torch.nn.functional as F

    k = 2 * int(2.5 * sigma + 0.5) + 1
    d = torch.arange(k, dtype=torch.float64) - (k - 1) / 2
    g = torch.exp(-(d**2) / (2 * sigma**2))
    g = g / g.sum()
    x = torch.tensor(mask, dtype=torch.float64)[None, None]
    x = F.conv2d(F.pad(x, (k // 2, k // 2, 0, 0), mode="reflect"), g.view(1, 1, 1, k))
    x = torch.floor(x + 0.5).clamp(0, 255)
    x = F.conv2d(F.pad(x, (0, 0, k // 2, k // 2), mode="reflect"), g.view(1, 1, k, 1))
    return torch.floor(x + 0.5).clamp(0, 255)[0, 0].numpy().astype(np.uint8)


@pytest.mark.parametrize("sigma", [1, 2, 4])
def test_the_mask_blur_is_opencvs_gaussian_as_a1111_calls_it(sigma):
    mask = (_disc(12, 19, 6) * 255).astype(np.uint8)
    mask[28:, :5] = 255  # at the border: the mirrored edge
    ours = gaussian_blur(gaussian_blur(mask, sigma, axis=1), sigma, axis=0)
    ref = _torch_a1111_blur(mask, sigma)
    assert np.abs(ours.astype(int) - ref.astype(int)).max() <= 1  # ties rounded either way
    # past the kernel's reach nothing is blurred in: the band is bounded
    r = int(2.5 * sigma + 0.5)
    y, x = np.mgrid[0:H, 0:W]
    far = (((y - 12) ** 2 + (x - 19) ** 2) > (6 + r * np.sqrt(2) + 1) ** 2) & ~((y >= 28 - r - 1) & (x < 5 + r + 1))
    assert (ours[far] == 0).all()


def _png(array: np.ndarray, mode: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array, mode).save(out, format="PNG")
    return out.getvalue()


def test_a1111s_mask_reads_grey_or_alpha_inverts_and_doubles_into_the_overlay():
    grey = (_disc(16, 16, 8) * 255).astype(np.uint8)
    assert np.array_equal(mask_from_bytes(_png(grey, "L"), "mask", 10**6, 10**6), grey)
    rgb = np.dstack([grey] * 3)
    assert np.array_equal(mask_from_bytes(_png(rgb, "RGB"), "mask", 10**6, 10**6), grey)
    # RGBA with transparent pixels: its alpha, cut at 128 (create_binary_mask); colour is ignored
    alpha = np.where(grey > 0, 200, 100).astype(np.uint8)
    rgba = np.dstack([np.zeros_like(grey)] * 3 + [alpha])
    assert np.array_equal(mask_from_bytes(_png(rgba, "RGBA"), "mask", 10**6, 10**6), np.where(grey > 0, 255, 0))
    soft = np.full((H, W), 100, np.uint8)  # a grey of 100: the overlay doubles it (200/255)
    weight = a1111_pixel_mask(soft, False, 0, 0, (W, H), resize=False)
    assert np.allclose(weight, 200 / 255) and weight.dtype == np.float32
    inverted = a1111_pixel_mask(grey, True, 0, 0, (W, H), resize=False)
    assert np.array_equal(inverted == 0, grey == 255)
    with pytest.raises(Exception, match="16x16; this server edits 32x32"):
        a1111_pixel_mask(grey[:16, :16], False, 0, 0, (W, H), resize=False)
    assert a1111_pixel_mask(grey[::2, ::2], False, 0, 0, (W, H), resize=True).shape == (H, W)
