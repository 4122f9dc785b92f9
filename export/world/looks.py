"""The continuous readers of the shapes world: a number from pixels alone for each look a
concept slider moves (``export/world/shapes.py`` renders them), and a reader of the scene that those
looks leave as it was. Monotone in their attribute on renders and steady under the other two;
tests/test_sliders_world.py checks both, in each world.

- ``saturation(image)``: mean chroma;
- ``stroke(image, world)``: ink darker, or lighter, than both the shape and the background, in
  pixels of outline;
- ``sharpness(image)``: edge steepness over local contrast, about 1 / the edge's width in
  pixels (blur lowers it);
- ``read_any_look(image, world)``: the scene, whatever saturation, an outline or a blur did to it.

Saturation and sharpness are the same in both worlds (a mean over the image, a ratio of local
contrasts). ``world=1`` (the default) reads the 32x32 world's one shape as before; ``world=2``
reads the 64x64 world's one or two objects of either size, found so that the looks leave them
whole (``_blobs``): the stroke is then the ink around them over their perimeter, the scene their
colours, kinds, sizes and places.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from edit_rt.runtime.model.automask import dilate

from .shapes import (_SIZE_SPLIT, COLOURS, DARK_INK, LIGHT_INK, LUMA, POSITIONS, Scene, Seen, _dilate, _erode, _kind,
                     _scene_of)  # fmt: skip


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


def stroke(image: np.ndarray, world: int = 1) -> float:
    """Signed outline strength, about the outline's width in pixels: the ink of the pixels
    darker than both the shape's fill and the background (each pixel's shortfall below the
    darker one, relative to it), less the light ink of those brighter than both (relative to the
    headroom above the brighter one), per ``_STROKE_PER_PX``. A plain edge, blurred or not, mixes
    the two colours and has none; desaturating keeps every luma. World 2: the same ink around
    each object, over the objects' perimeter (``_ring_width``)."""
    img = _as_float(image)
    if world == 2:
        bg, blobs = _blobs(img)
        return _ring_width(*np.sum(_rings(img, bg, blobs), axis=0)) if blobs else 0.0
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


def read_any_look(image: np.ndarray, world: int = 1) -> Optional[Scene]:
    """The scene, read so that saturation, an outline or a blur leave it as it was: colours
    named along their saturation curves (the background from the frame's median, the shape
    from its core, inside any outline), the shape segmented at half its contrast with the
    background (where a blurred edge keeps its place) with the outline's own pixels left out,
    its position and kind then judged as ``read`` judges them. None when nothing stands out.
    World 2: ``_read_any_look_2``, the scene ``canonical``."""
    img = _as_float(image)
    if world == 2:
        return _read_any_look_2(img)
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


# World 2. Objects are found by colour (``_blobs``): each pixel far from the background is named
# by the saturation curve it lies on, when it lies within ``_ON_CURVE`` of one (a fill does at any
# saturation; the dark ink, and most blends of two colours along an edge, lie farther), and each
# colour's connected pixels are an object when they hold ``_MIN_BLOB`` pixels and their own
# centroid (a ring of light ink, which is named white, or of a blend around a shape, does not).
_FAR = 24.0  # the world-1 reader's floor: a pixel this far from the background stands out
_ON_CURVE = 20.0
_MIN_BLOB = 8
# A blur makes a small object's every pixel a blend off the curves: pixels far from the
# background, more than ``_REACH`` px from every object found, and thick (two erosions) are one
# more object. ``_REACH`` also bounds where an object's outline lies: a 3-px outline centred on
# the edge, the fill inside it shrunk by half of it, and an anti-aliased pixel.
_REACH = 4
_MIN_LEFT = 4
# An object's perimeter over the root of its area, per kind (similar shapes: a fixed ratio), and
# the luma of the two inks a render draws outlines in (``_rings`` counts each ink pixel as one).
_PERIMETER_PER_ROOT_AREA = {"circle": 2 * np.sqrt(np.pi), "square": 4.0, "triangle": (2 + 2 * np.sqrt(5)) / np.sqrt(2)}
# How fast the side of an object's box grows with an outward offset of its edge: two offsets for a
# circle or a square; a triangle grows about its incentre, its side being (1 + sqrt 5) inradii.
_SIDE_PER_OFFSET = {"circle": 2.0, "square": 2.0, "triangle": 1 + np.sqrt(5)}
_DARK_LUMA, _LIGHT_LUMA = float(LUMA @ DARK_INK), float(LUMA @ LIGHT_INK)


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """The 4-connected components of ``mask``, each as a mask (labels spread as minima)."""
    big = mask.size
    labels = np.where(mask, np.arange(mask.size).reshape(mask.shape), big)
    while True:
        spread = labels.copy()
        spread[1:] = np.minimum(spread[1:], labels[:-1])
        spread[:-1] = np.minimum(spread[:-1], labels[1:])
        spread[:, 1:] = np.minimum(spread[:, 1:], labels[:, :-1])
        spread[:, :-1] = np.minimum(spread[:, :-1], labels[:, 1:])
        spread = np.where(mask, spread, big)
        if np.array_equal(spread, labels):
            return [labels == v for v in np.unique(labels[mask])]
        labels = spread


def _holds_centroid(mask: np.ndarray) -> bool:
    ys, xs = np.nonzero(mask)
    return bool(_dilate(mask)[int(round(ys.mean())), int(round(xs.mean()))])


@dataclass(frozen=True)
class _Blob:
    """An object ``_blobs`` found: its fill's colour, the pixels it was found by (``core``), its
    silhouette at half its contrast with the background (``mask``) and coverage (0..1)."""

    fill: np.ndarray
    core: np.ndarray
    mask: np.ndarray
    coverage: np.ndarray


def _blob(img: np.ndarray, bg: np.ndarray, core: np.ndarray) -> _Blob:
    """The object whose fill is ``core``'s median colour: the connected pixels, from ``core`` on,
    that lie past half the way from the background to the fill and near that line, with a luma
    between the two (so that neither a blend with a third colour nor the ink counts); ``core``
    itself when none of its pixels does (a blend throughout)."""
    fill = np.median(img[core], axis=0)
    contrast = max(float(np.sqrt(((fill - bg) ** 2).sum())), 1e-6)
    along = (img - bg) @ ((fill - bg) / contrast)
    off = np.sqrt(np.clip(((img - bg) ** 2).sum(axis=-1) - along**2, 0, None))
    y, lumas = _luma(img), sorted((float(LUMA @ fill), float(LUMA @ bg)))
    plain = (y > lumas[0] - _STROKE_MARGIN) & (y < lumas[1] + _STROKE_MARGIN)
    online = (off < 0.5 * contrast) & (along < 1.5 * contrast) & plain
    parts = [c for c in _components((along > 0.5 * contrast) & online) if (c & core).any()]
    if not parts:
        return _Blob(fill, core, core, core.astype(np.float64))
    mask = np.any(parts, axis=0)
    return _Blob(fill, core, mask, np.clip(along / contrast, 0, 1) * online * _dilate(mask))


def _blobs(img: np.ndarray) -> tuple[np.ndarray, list[_Blob]]:
    """World 2's objects under any look: (the background's colour, the objects, largest first).
    A colour's connected pixels (module notes above) give an object its fill from the pixels
    left when their edge ring is eroded; one that lies mostly inside a larger one's silhouette
    is that one; the thick pixels that no object explains are objects too."""
    h, w = img.shape[:2]
    bg = _border_colour(img)
    background = list(COLOURS).index(_name_any_saturation(bg))
    far = np.sqrt(((img - bg) ** 2).sum(axis=-1)) > _FAR
    d = ((img[far][:, None, None, :] - _CURVES[None]) ** 2).sum(axis=-1).min(axis=-1)
    label = np.full((h, w), -1)
    label[far] = np.where(d.min(axis=-1) < _ON_CURVE**2, d.argmin(axis=-1), -1)
    found = []
    for i in range(len(COLOURS)):
        if i == background:
            continue
        for part in _components(label == i):
            core = _erode(part)
            if core.any() and part.sum() >= _MIN_BLOB and _holds_centroid(part):
                found.append(_blob(img, bg, core))
    kept: list[_Blob] = []
    for b in sorted(found, key=lambda b: -int(b.mask.sum())):
        if not any((b.core & k.mask).sum() > 0.5 * b.core.sum() for k in kept):
            kept.append(b)
    explained = np.zeros((h, w), dtype=bool)
    for k in kept:
        explained |= dilate(k.mask, _REACH)
    kept += [_blob(img, bg, c) for c in _components(_erode(_erode(far & ~explained))) if c.sum() >= _MIN_LEFT]
    return bg, sorted(kept, key=lambda b: -int(b.mask.sum()))


def _rings(img: np.ndarray, bg: np.ndarray, blobs: list[_Blob]) -> np.ndarray:
    """[objects, 3]: per object, the signed ink within ``_REACH`` of it, in pixels of ink (a
    pixel's shortfall below the darkest of the lumas around it, the background's and those of the
    fills within ``_REACH``, over that luma's distance from the dark ink's: 1 for a pixel of ink;
    less the light ink's excess likewise), its silhouette's perimeter, and how fast that
    perimeter grows with an outward offset of its edge (d perimeter / d offset)."""
    y = _luma(img)
    lo = np.full(y.shape, float(LUMA @ bg))
    hi = lo.copy()
    near = [dilate(b.mask, _REACH) for b in blobs]
    for b, n in zip(blobs, near):
        lo[n], hi[n] = np.minimum(lo[n], LUMA @ b.fill), np.maximum(hi[n], LUMA @ b.fill)
    lo, hi = lo - _STROKE_MARGIN, hi + _STROKE_MARGIN
    ink = np.clip(lo - y, 0, None) / np.maximum(lo - _DARK_LUMA, 40.0) - np.clip(y - hi, 0, None) / np.maximum(_LIGHT_LUMA - hi, 40.0)
    owner = np.full(y.shape, -1)
    for i in reversed(range(len(blobs))):
        owner[near[i]] = i
    out = []
    for i, b in enumerate(blobs):
        k = _PERIMETER_PER_ROOT_AREA[_kind(b.coverage)]
        out.append((float(ink[owner == i].sum()), k * np.sqrt(b.mask.sum()), k * k / 2))
    return np.array(out, dtype=np.float64).reshape(-1, 3)


def _ring_width(ink: float, perimeter: float, growth: float) -> float:
    """The signed width ``w`` of an outline centred on the edges whose area is ``|ink|``: the
    silhouette is the fill inside it, its edge ``w / 2`` in, so the ring's area is
    ``w perimeter + growth w^2 / 2``."""
    if growth <= 0:
        return 0.0
    return float(np.sign(ink) * (np.sqrt(perimeter**2 + 2 * growth * abs(ink)) - perimeter) / growth)


def _read_any_look_2(img: np.ndarray) -> Optional[Scene]:
    """World 2's scene under any look, ``canonical``: the objects of ``_blobs``, each named along
    the saturation curves, its kind read from its coverage as ``read`` reads it, its size from its
    silhouette's box grown back by half its own outline's width (the silhouette is the fill inside
    the outline, each edge half the width in), its place from the box's centre. None when no object,
    more than two, or two of one colour (the background's included) are found."""
    h, w = img.shape[:2]
    bg, blobs = _blobs(img)
    if not blobs or len(blobs) > 2:
        return None
    background, seen = _name_any_saturation(bg), []
    for b, ring in zip(blobs, _rings(img, bg, blobs)):
        ys, xs = np.nonzero(b.mask)
        kind = _kind(b.coverage)
        side = max(xs.max() - xs.min() + 1, ys.max() - ys.min() + 1) + _SIDE_PER_OFFSET[kind] * abs(_ring_width(*ring)) / 2
        cx, cy = (xs.max() + xs.min() + 1) / 2 / w, (ys.max() + ys.min() + 1) / 2 / h
        size = "small" if side / max(h, w) < _SIZE_SPLIT else "large"
        seen.append(Seen(_name_any_saturation(b.fill), kind, size, cx, cy, b.mask, b.coverage))
    if len({o.colour for o in seen} | {background}) < len(seen) + 1:
        return None
    return _scene_of(background, seen)
