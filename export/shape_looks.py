"""The continuous readers of the shapes world: a number from pixels alone for each look a
concept slider moves (``export/shapes.py`` renders them), and a reader of the scene that those
looks leave as it was. Monotone in their attribute on renders and steady under the other two;
tests/test_sliders_world.py checks both.

- ``saturation(image)``: mean chroma;
- ``stroke(image)``: ink darker, or lighter, than both the shape and the background, in pixels
  of outline;
- ``sharpness(image)``: edge steepness over local contrast, about 1 / the edge's width in
  pixels (blur lowers it);
- ``read_any_look(image)``: the scene, whatever saturation, an outline or a blur did to it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .shapes import COLOURS, LUMA, POSITIONS, Scene


def _luma(img: np.ndarray) -> np.ndarray:
    return img @ LUMA


def _border_colour(img: np.ndarray) -> np.ndarray:
    """The background's colour as the median of the frame's pixels (no palette: a slider may
    have moved it off the palette)."""
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    return np.median(border, axis=0)


def _core_colour(img: np.ndarray, bg: np.ndarray) -> np.ndarray:
    """The shape's fill: the median colour of the pixels within ~1 px of the centroid of what
    stands out from the background. The outline (centred on the edge, at most ~3 px wide) and
    the blurred edge never reach that core; an image where nothing stands out gives ``bg``."""
    dist = np.sqrt(((img - bg) ** 2).sum(axis=-1))
    far = dist > max(24.0, 0.5 * float(np.percentile(dist, 99)))
    if far.sum() < 4:
        return bg
    ys, xs = np.nonzero(far)
    yy, xx = np.mgrid[: img.shape[0], : img.shape[1]]
    near = (yy - ys.mean()) ** 2 + (xx - xs.mean()) ** 2 <= 1.5**2
    return np.median(img[near], axis=0)


def _as_float(image: np.ndarray) -> np.ndarray:
    img = np.asarray(image, dtype=np.float64)[..., :3]
    if img.ndim != 3:
        raise ValueError(f"expected an [H, W, 3] image in 0..255, got shape {np.shape(image)}")
    return img


def saturation(image: np.ndarray) -> float:
    """Mean chroma, ``|c - Y(c)|`` over the three channels, of every pixel, in 0..1 (0 = grey).
    Pulling every colour toward its luma by a factor scales it by exactly that factor (before
    clipping); an outline (grey) or a blur (mixes) changes it only along the edge."""
    img = _as_float(image)
    chroma = np.sqrt(((img - _luma(img)[..., None]) ** 2).sum(axis=-1))
    return float(chroma.mean() / 255.0)


# Pixels of outline that one fully dark pixel of ring stands for: the ring of a 1-px outline
# around the world's shape (radius 0.17 of 32 px) covers ~2 pi 5.4 = 34 pixels.
_STROKE_PER_PX = 34.0
_STROKE_MARGIN = 6.0  # luma levels of over/undershoot ignored (the decoder's ringing on plain edges)


def stroke(image: np.ndarray) -> float:
    """Signed outline strength, about the outline's width in pixels: the ink of the pixels
    darker than both the shape's fill and the background (each pixel's shortfall below the
    darker one, relative to it), less the light ink of those brighter than both (relative to the
    headroom above the brighter one), per ``_STROKE_PER_PX``. A plain edge, blurred or not, mixes
    the two colours and has none; desaturating keeps every luma."""
    img = _as_float(image)
    bg = _border_colour(img)
    lumas = sorted((float(LUMA @ bg), float(LUMA @ _core_colour(img, bg))))
    lo, hi = lumas[0] - _STROKE_MARGIN, lumas[1] + _STROKE_MARGIN
    y = _luma(img)
    dark = np.clip(lo - y, 0, None) / max(lo, 40.0)
    light = np.clip(y - hi, 0, None) / max(255.0 - hi, 40.0)
    return float((dark.sum() - light.sum()) / _STROKE_PER_PX)


def sharpness(image: np.ndarray, window: int = 7) -> float:
    """Edge steepness: the gradient-weighted mean, over the image, of each pixel's colour
    gradient (forward differences, Euclidean over RGB) divided by the colour range of the
    ``window`` x ``window`` neighbourhood around it. A clean anti-aliased step reads ~1 (it
    crosses its whole contrast in one pixel), a Gaussian blur of sigma ``b`` about
    1 / (1 + 2.5 b); dividing by the local range makes it blind to the contrast, so a greyer
    image or a darker outline leaves it nearly where it was."""
    img = _as_float(image)
    gx = np.diff(img, axis=1)[:-1]
    gy = np.diff(img, axis=0)[:, :-1]
    g = np.sqrt((gx**2).sum(axis=-1) + (gy**2).sum(axis=-1))
    h, w = img.shape[:2]
    k = window // 2
    padded = np.pad(img, ((k, k), (k, k), (0, 0)), mode="edge")
    views = np.stack([padded[dy : dy + h, dx : dx + w] for dy in range(window) for dx in range(window)])
    spread = np.sqrt(((views.max(axis=0) - views.min(axis=0)) ** 2).sum(axis=-1))[:-1, :-1]
    # flat regions (range under ~10 levels) carry only noise: neither steep nor soft
    use = spread > 10.0
    if not use.any() or g[use].sum() == 0:
        return 0.0
    return float((g[use] ** 2 / spread[use]).sum() / g[use].sum())


# Saturation factors a colour may have been moved by and still be named after its palette
# entry: below ~0.25 the palette's greys (red 94, blue 84, purple 99) are too close to tell.
_FACTORS = np.linspace(0.25, 2.0, 36)


def _palette_curves() -> np.ndarray:
    """[colours, factors, 3]: every palette colour at every factor of ``_FACTORS`` (clipped)."""
    palette = np.array(list(COLOURS.values()), dtype=np.float64)
    y = palette @ LUMA
    curves = y[:, None, None] + _FACTORS[None, :, None] * (palette - y[:, None])[:, None, :]
    return np.clip(curves, 0, 255)


_CURVES = _palette_curves()


def _name_any_saturation(rgb: np.ndarray) -> str:
    """The palette entry whose saturation curve passes nearest ``rgb``: the colour's name
    whatever a saturation slider did to it."""
    d = ((_CURVES - np.asarray(rgb, dtype=np.float64)) ** 2).sum(axis=-1).min(axis=1)
    return list(COLOURS)[int(np.argmin(d))]


def read_any_look(image: np.ndarray) -> Optional[Scene]:
    """The scene, read so that saturation, an outline or a blur leave it as it was: colours
    named along their saturation curves (the background from the frame's median, the shape
    from its core, inside any outline), the shape segmented at half its contrast with the
    background (where a blurred edge keeps its place) with the outline's own pixels left out,
    its position and kind then judged as ``read`` judges them. None when nothing stands out."""
    img = _as_float(image)
    h, w = img.shape[:2]
    bg = _border_colour(img)
    core = _core_colour(img, bg)
    contrast = float(np.sqrt(((core - bg) ** 2).sum()))
    if contrast < 24.0:
        return None
    background, colour = _name_any_saturation(bg), _name_any_saturation(core)
    if colour == background:
        return None
    # a pixel is the shape's when it lies nearer the core than the background along the line
    # between them; ink (an outline) projects anywhere, so pixels far off that line are dropped
    axis = (core - bg) / contrast
    along = (img - bg) @ axis
    off = np.sqrt(np.clip(((img - bg) ** 2).sum(axis=-1) - along**2, 0, None))
    mask = (along > 0.5 * contrast) & (off < 0.5 * contrast)
    if mask.sum() < 0.02 * h * w:
        return None
    ys, xs = np.nonzero(mask)
    cx, cy = xs.mean() / w, ys.mean() / h
    position = min(POSITIONS, key=lambda p: (POSITIONS[p][0] - cx) ** 2 + (POSITIONS[p][1] - cy) ** 2)
    # A blur rounds a triangle's corners until it fills its box like a circle, but its mass
    # stays low in the box (the centroid of an apex-up triangle sits 1/6 of the height below
    # the box's middle); a square keeps most of its box even blurred.
    height = ys.max() - ys.min() + 1
    low = (ys.mean() - (ys.max() + ys.min()) / 2) / height
    fill = mask.sum() / ((xs.max() - xs.min() + 1) * height)
    shape = "triangle" if low > 0.07 else "square" if fill > 0.88 else "circle"
    return Scene(colour, shape, background, position)
