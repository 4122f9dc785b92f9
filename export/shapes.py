"""The "shapes" world: images of one coloured shape on a coloured background, with prompts,
and a reader that recovers the attributes from pixels (no learned judge).

``render(Scene)`` draws a scene; ``prompt(Scene)`` says it ("a red circle on a blue
background, top left"); ``read(image)`` recovers the scene by pixel statistics: the background
is the most common border colour, the shape is every pixel far from it, its colour the nearest
palette entry to their median, its position the quadrant (or centre) of their centroid, and its
kind the fraction of its bounding box it fills (square ~1, circle ~pi/4, triangle ~1/2).

Three continuous attributes that no prompt word names (the concept sliders of issue 25 move
them; ``export/sliders.py`` trains on pairs of renders that differ in one of them):

- ``render(..., saturation=s)``: every colour pulled toward its own grey (its luma), ``c' = Y +
  s (c - Y)``: 1 is the palette, 0 grey, above 1 more vivid (clipped to 0..255);
  ``background_saturation`` sets the background's apart (default: the same);
- ``render(..., stroke=w)``: an outline ``|w|`` pixels wide centred on the shape's edge, dark
  when ``w > 0``, light when ``w < 0``;
- ``render(..., blur=b)``: a Gaussian blur of sigma ``b`` pixels.

Their defaults draw exactly what ``render`` drew before they existed. Each has a reader that
needs no scene, for generated images as much as for renders: ``saturation(image)`` (mean
chroma), ``stroke(image)`` (ink darker, or lighter, than both the shape and the background, in
pixels of outline) and ``sharpness(image)`` (edge steepness over local contrast, about 1 / the
edge's width in pixels; blur lowers it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 215, 40),
    "purple": (140, 60, 190),
    "white": (245, 245, 245),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {
    "top left": (0.3, 0.3),
    "top right": (0.7, 0.3),
    "bottom left": (0.3, 0.7),
    "bottom right": (0.7, 0.7),
    "center": (0.5, 0.5),
}
# Outline inks: the dark one is below every palette colour's luma (blue's 84 is the lowest), so
# a dark outline reads as ink on any scene; the light one is above all but white's.
DARK_INK = (20, 20, 20)
LIGHT_INK = (252, 252, 252)
LUMA = np.array([0.299, 0.587, 0.114])  # ITU-R BT.601, the "grey" a colour is pulled toward


@dataclass(frozen=True)
class Scene:
    colour: str
    shape: str
    background: str
    position: str


def prompt(scene: Scene) -> str:
    return f"a {scene.colour} {scene.shape} on a {scene.background} background, {scene.position}"


def random_scene(rng: np.random.Generator) -> Scene:
    names = list(COLOURS)
    colour, background = rng.choice(len(names), size=2, replace=False)
    return Scene(names[colour], SHAPES[rng.integers(len(SHAPES))], names[background], list(POSITIONS)[rng.integers(len(POSITIONS))])


def saturated(rgb: tuple[int, int, int], factor: float) -> tuple[int, int, int]:
    """``rgb`` pulled toward its luma by ``factor`` (0 = grey, 1 = itself, > 1 more vivid)."""
    if factor == 1.0:
        return tuple(rgb)
    c = np.asarray(rgb, dtype=np.float64)
    y = float(LUMA @ c)
    return tuple(int(v) for v in np.clip(np.round(y + factor * (c - y)), 0, 255))


def _outline_points(shape: str, cx: float, cy: float, r: float, grow: float) -> list[tuple[float, float]]:
    """The shape (centre, half-size ``r``) with every edge moved outward by ``grow`` (inward when
    negative), as a polygon or a box: a square and a circle keep their centre, a triangle its
    incentre (moving each side by ``grow`` scales it about the incentre by (rho + grow) / rho)."""
    if shape != "triangle":
        q = r + grow
        return [(cx - q, cy - q), (cx + q, cy + q)]
    rho = 2 * r / (1 + np.sqrt(5))  # inradius of the base-2r, height-2r isosceles triangle
    iy = cy + r - rho
    k = (rho + grow) / rho
    return [(cx + k * (x - cx), iy + k * (y - iy)) for x, y in ((cx - r, cy + r), (cx + r, cy + r), (cx, cy - r))]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, points: list[tuple[float, float]], s: int, fill) -> None:
    xy = [(x * s, y * s) for x, y in points]
    if shape == "circle":
        draw.ellipse([xy[0][0], xy[0][1], xy[1][0], xy[1][1]], fill=fill)
    elif shape == "square":
        draw.rectangle([xy[0][0], xy[0][1], xy[1][0], xy[1][1]], fill=fill)
    else:
        draw.polygon(xy, fill=fill)


def gaussian_blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """[H, W, C] float blurred by a separable Gaussian of ``sigma`` pixels; the edge pixels
    continue outward (the background goes on past the frame)."""
    radius = max(1, int(np.ceil(3 * sigma)))
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    kernel = np.exp(-0.5 * (x / sigma) ** 2)
    kernel /= kernel.sum()
    out = np.asarray(image, dtype=np.float64)
    for axis in (0, 1):
        pad = [(0, 0)] * out.ndim
        pad[axis] = (radius, radius)
        padded = np.pad(out, pad, mode="edge")
        n = out.shape[axis]
        out = sum(w * np.take(padded, np.arange(i, i + n), axis=axis) for i, w in enumerate(kernel))
    return out


def render(
    scene: Scene,
    size: int = 32,
    rng: Optional[np.random.Generator] = None,
    *,
    saturation: float = 1.0,
    background_saturation: Optional[float] = None,
    stroke: float = 0.0,
    blur: float = 0.0,
) -> np.ndarray:
    """The scene as uint8 [size, size, 3]; ``rng`` jitters the shape's size and place a little.
    ``saturation``, ``stroke`` and ``blur`` are the continuous attributes (module docstring)."""
    # Draw at 4x and downsample: anti-aliased edges, as a generated image would have.
    scale = 4
    s = size * scale
    bg_factor = saturation if background_saturation is None else background_saturation
    image = Image.new("RGB", (s, s), saturated(COLOURS[scene.background], bg_factor))
    draw = ImageDraw.Draw(image)
    cx, cy = POSITIONS[scene.position]
    r = 0.17
    if rng is not None:
        cx, cy = cx + rng.uniform(-0.04, 0.04), cy + rng.uniform(-0.04, 0.04)
        r *= rng.uniform(0.85, 1.15)
    fill = saturated(COLOURS[scene.colour], saturation)
    if stroke:
        # the outline is the shape grown by half the width in the ink, the shape shrunk by half
        # the width drawn over it: centred on the edge, so the shape's place and size stay
        half = abs(stroke) / 2 / size
        _draw_shape(draw, scene.shape, _outline_points(scene.shape, cx, cy, r, half), s, DARK_INK if stroke > 0 else LIGHT_INK)
        inner = r - half if scene.shape != "triangle" else 2 * r / (1 + np.sqrt(5)) - half
        if inner > 0:
            _draw_shape(draw, scene.shape, _outline_points(scene.shape, cx, cy, r, -half), s, fill)
    else:
        box = [(cx - r) * s, (cy - r) * s, (cx + r) * s, (cy + r) * s]
        if scene.shape == "circle":
            draw.ellipse(box, fill=fill)
        elif scene.shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) / 2, box[1])], fill=fill)
    out = np.asarray(image.resize((size, size), Image.BOX))
    if blur > 0:
        out = np.clip(np.round(gaussian_blur(out, blur)), 0, 255).astype(np.uint8)
    return out


def _nearest_colour(rgb: np.ndarray) -> str:
    names = list(COLOURS)
    palette = np.array([COLOURS[n] for n in names], dtype=np.float64)
    return names[int(np.argmin(((palette - rgb) ** 2).sum(axis=1)))]


def read(image: np.ndarray) -> Optional[Scene]:
    """The scene an image shows, or None when no single shape stands out from the background."""
    img = np.asarray(image, dtype=np.float64)[..., :3]
    h, w = img.shape[:2]
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    votes = [_nearest_colour(p) for p in border]
    background = max(set(votes), key=votes.count)
    bg = np.array(COLOURS[background], dtype=np.float64)
    # A pixel belongs to the shape when it is nearer another palette colour than the background.
    far = np.sqrt(((img - bg) ** 2).sum(axis=-1)) > 60
    if far.sum() < 0.02 * h * w:
        return None
    ys, xs = np.nonzero(far)
    colour = _nearest_colour(np.median(img[far], axis=0))
    if colour == background:
        return None
    cx, cy = xs.mean() / w, ys.mean() / h
    position = min(POSITIONS, key=lambda p: (POSITIONS[p][0] - cx) ** 2 + (POSITIONS[p][1] - cy) ** 2)
    fill = far.sum() / ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1))
    shape = "square" if fill > 0.9 else "circle" if fill > 0.64 else "triangle"
    return Scene(colour, shape, background, position)


# The continuous readers: a number from pixels alone, monotone in its attribute on renders and
# steady under the other two; tests/test_sliders_world.py checks both.


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
