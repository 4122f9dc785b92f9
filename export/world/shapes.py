"""The "shapes" world: images of coloured shapes on a coloured background, with prompts, and
a reader that recovers the attributes from pixels (no learned judge).

Two worlds share the palette, the shapes and the reader's rules:

- **world 1** (the 32x32 model): one circle, square or triangle, in a colour, on a background,
  at one of five positions: ``a red circle on a blue background, top left``;
- **world 2** (the 64x64 model, issue 26): one or two objects, each with a size (small or
  large): ``a large red circle on a blue background, top left`` and ``a small red circle left of
  a large blue square on a yellow background``. Two objects never share a colour with each
  other or the background, so the reader tells them apart by colour alone.

A ``Scene`` says which world it is in: ``size`` is None in world 1. ``render(Scene)`` draws it;
``prompt(Scene)`` says it; ``read(image)`` (world 1) and ``read(image, world=2)`` recover it:
the background is the most common border colour, an object is every pixel far from it (in
world 2: of one palette colour, its one-pixel edge ring left out), its colour the nearest
palette entry to their median, its position the quadrant (or centre) of its centre, its kind
the fraction of its bounding box it fills (square ~1, circle ~pi/4, triangle ~1/2), its size
its bounding box's side. Two objects' relation ("left of", "above") is read from their
centres; ``canonical`` writes "right of" and "below" the other way round, as the reader does.

Three continuous attributes that no prompt word names (the concept sliders of issue 25 move
them; ``export/world/slider_training.py`` trains on pairs of renders that differ in one of them):

- ``render(..., saturation=s)``: every colour pulled toward its own grey (its luma), ``c' = Y +
  s (c - Y)``: 1 is the palette, 0 grey, above 1 more vivid (clipped to 0..255);
  ``background_saturation`` sets the background's apart (default: the same);
- ``render(..., stroke=w)``: an outline ``|w|`` pixels wide centred on each shape's edge, dark
  when ``w > 0``, light when ``w < 0``;
- ``render(..., blur=b)``: a Gaussian blur of sigma ``b`` pixels.

Their defaults draw exactly what ``render`` drew before they existed; their readers, which need
no scene, are in ``export/world/looks.py``. ``random_looks`` draws them for a model that learns
them (issue 36): each off its default with a probability, uniform over ``LOOK_RANGES``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
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


# World 2: object sizes (half the side of the box, as a fraction of the image), two objects'
# relations (the side of the pair the subject sits on, as a unit step in x and y), and how far
# apart a pair's centres sit.
SIZES = {"small": 0.09, "large": 0.16}
RELATIONS = {"left of": (-1, 0), "right of": (1, 0), "above": (0, -1), "below": (0, 1)}
PAIR_HALF_GAP = 0.22  # each object's centre this far from the pair's middle along the relation
WORLD_SIZES = {1: 32, 2: 64}  # image side of each world's model
_R1 = 0.17  # world 1's one size


@dataclass(frozen=True)
class Thing:
    """The second object of a world-2 scene."""

    colour: str
    shape: str
    size: str


@dataclass(frozen=True)
class Scene:
    colour: str
    shape: str
    background: str
    position: str  # one of POSITIONS, or with ``other`` one of RELATIONS (subject to other)
    size: Optional[str] = None  # world 2's SIZES; None in world 1
    other: Optional[Thing] = None

    @property
    def world(self) -> int:
        return 1 if self.size is None else 2

    def things(self) -> tuple[Thing, ...]:
        first = Thing(self.colour, self.shape, self.size or "large")
        return (first,) if self.other is None else (first, self.other)


def canonical(scene: Scene) -> Scene:
    """The same picture said as the reader says it: "right of" as "left of" and "below" as
    "above", the two objects swapped."""
    flip = {"right of": "left of", "below": "above"}
    if scene.other is None or scene.position not in flip:
        return scene
    o = scene.other
    return Scene(o.colour, o.shape, scene.background, flip[scene.position], o.size, Thing(scene.colour, scene.shape, scene.size))


def prompt(scene: Scene) -> str:
    if scene.size is None:
        return f"a {scene.colour} {scene.shape} on a {scene.background} background, {scene.position}"
    subject = f"a {scene.size} {scene.colour} {scene.shape}"
    if scene.other is None:
        return f"{subject} on a {scene.background} background, {scene.position}"
    o = scene.other
    return f"{subject} {scene.position} a {o.size} {o.colour} {o.shape} on a {scene.background} background"


# A world-1 scene's attributes, in prompt order of importance (what a one-word variation changes)
ATTRIBUTES = ("colour", "shape", "background", "position")


def vary(scene: Scene, attribute: str, rng: np.random.Generator) -> Scene:
    """``scene`` with ``attribute`` set to another value (a colour never the background's, a
    background never the colour: the world draws them distinct)."""
    if attribute == "shape":
        values = [s for s in SHAPES if s != scene.shape]
    elif attribute == "position":
        values = [p for p in POSITIONS if p != scene.position]
    else:
        values = [c for c in COLOURS if c not in (scene.colour, scene.background)]
    return replace(scene, **{attribute: values[rng.integers(len(values))]})


def random_scene(rng: np.random.Generator, world: int = 1, two: float = 0.5) -> Scene:
    """A scene of ``world`` with every attribute uniform; in world 2, two objects with
    probability ``two``."""
    names = list(COLOURS)
    if world == 1:
        colour, background = rng.choice(len(names), size=2, replace=False)
        return Scene(names[colour], SHAPES[rng.integers(len(SHAPES))], names[background], list(POSITIONS)[rng.integers(len(POSITIONS))])
    colour, background, other = (names[i] for i in rng.choice(len(names), size=3, replace=False))
    size = list(SIZES)[rng.integers(len(SIZES))]
    shape = SHAPES[rng.integers(len(SHAPES))]
    if rng.random() >= two:
        return Scene(colour, shape, background, list(POSITIONS)[rng.integers(len(POSITIONS))], size)
    second = Thing(other, SHAPES[rng.integers(len(SHAPES))], list(SIZES)[rng.integers(len(SIZES))])
    return Scene(colour, shape, background, list(RELATIONS)[rng.integers(len(RELATIONS))], size, second)


def placements(scene: Scene, rng: Optional[np.random.Generator] = None) -> list[tuple[Thing, float, float, float]]:
    """Each object of ``scene`` as (thing, cx, cy, r) in fractions of the image; ``rng``
    jitters places and sizes a little (world 2: never enough for a pair to touch)."""
    if scene.world == 1:
        cx, cy = POSITIONS[scene.position]
        r = _R1
        if rng is not None:
            cx, cy = cx + rng.uniform(-0.04, 0.04), cy + rng.uniform(-0.04, 0.04)
            r *= rng.uniform(0.85, 1.15)
        return [(scene.things()[0], cx, cy, r)]
    things = scene.things()
    jitter = (lambda a: rng.uniform(-a, a)) if rng is not None else (lambda a: 0.0)
    grow = (lambda: rng.uniform(0.9, 1.1)) if rng is not None else (lambda: 1.0)
    if scene.other is None:
        cx, cy = POSITIONS[scene.position]
        return [(things[0], cx + jitter(0.04), cy + jitter(0.04), SIZES[things[0].size] * grow())]
    dx, dy = RELATIONS[scene.position]
    # the pair's middle moves across the relation's axis more than along it
    mx, my = 0.5 + jitter(0.03 if dx else 0.08), 0.5 + jitter(0.08 if dx else 0.03)
    out = []
    for thing, sign in zip(things, (1, -1)):
        cx = mx + sign * dx * PAIR_HALF_GAP + jitter(0.02)
        cy = my + sign * dy * PAIR_HALF_GAP + jitter(0.02)
        out.append((thing, cx, cy, SIZES[thing.size] * grow()))
    return out


# The looks' ranges: the concept sliders' pairs (export/world/slider_training.py PAIRS), which a looks model's
# training scenes draw them over (``random_looks``).
LOOK_RANGES: dict[str, tuple[float, float]] = {"saturation": (0.4, 1.6), "stroke": (-2.0, 2.0), "blur": (0.0, 1.5)}
LOOK_DEFAULTS: dict[str, float] = {"saturation": 1.0, "stroke": 0.0, "blur": 0.0}


def random_looks(rng: np.random.Generator, p: float) -> dict[str, float]:
    """``render``'s look keywords for one scene: each look, independently, uniform over its
    ``LOOK_RANGES`` with probability ``p``, else at its default (so a scene is plain with
    probability (1 - p) ** 3). Always draws the same numbers from ``rng``, whatever ``p``."""
    out = {}
    for name, (low, high) in LOOK_RANGES.items():
        on, value = rng.random() < p, rng.uniform(low, high)
        out[name] = float(value) if on else LOOK_DEFAULTS[name]
    return out


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
    size: Optional[int] = None,
    rng: Optional[np.random.Generator] = None,
    *,
    saturation: float = 1.0,
    background_saturation: Optional[float] = None,
    stroke: float = 0.0,
    blur: float = 0.0,
) -> np.ndarray:
    """The scene as uint8 [size, size, 3] (default: its world's size); ``rng`` jitters the
    shapes' sizes and places a little.
    ``saturation``, ``stroke`` and ``blur`` are the continuous attributes (module docstring)."""
    # Draw at 4x and downsample: anti-aliased edges, as a generated image would have.
    size = size or WORLD_SIZES[scene.world]
    scale = 4
    s = size * scale
    bg_factor = saturation if background_saturation is None else background_saturation
    image = Image.new("RGB", (s, s), saturated(COLOURS[scene.background], bg_factor))
    draw = ImageDraw.Draw(image)
    for thing, cx, cy, r in placements(scene, rng):
        fill = saturated(COLOURS[thing.colour], saturation)
        if stroke:
            # the outline is the shape grown by half the width in the ink, the shape shrunk by
            # half the width drawn over it: centred on the edge, so the shape's place and size stay
            half = abs(stroke) / 2 / size
            _draw_shape(draw, thing.shape, _outline_points(thing.shape, cx, cy, r, half), s, DARK_INK if stroke > 0 else LIGHT_INK)
            inner = r - half if thing.shape != "triangle" else 2 * r / (1 + np.sqrt(5)) - half
            if inner > 0:
                _draw_shape(draw, thing.shape, _outline_points(thing.shape, cx, cy, r, -half), s, fill)
        else:
            box = [(cx - r) * s, (cy - r) * s, (cx + r) * s, (cy + r) * s]
            if thing.shape == "circle":
                draw.ellipse(box, fill=fill)
            elif thing.shape == "square":
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


def read(image: np.ndarray, world: int = 1) -> Optional[Scene]:
    """The scene an image shows, or None when no shape stands out from the background (world
    2: or more than two do); world 2's scenes come back ``canonical``."""
    if world == 2:
        return _scene_of(*read_objects(image))
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


@dataclass(frozen=True)
class Seen:
    """An object the world-2 reader found: its attributes, centre (fractions of the image), its
    pixels (its edge ring included) and its coverage (0..1 per pixel: its anti-aliased silhouette)."""

    colour: str
    shape: str
    size: str
    cx: float
    cy: float
    mask: np.ndarray
    coverage: np.ndarray


def _erode(mask: np.ndarray) -> np.ndarray:
    """``mask`` less every pixel with a 4-neighbour outside it."""
    out = mask.copy()
    out[1:] &= mask[:-1]
    out[:-1] &= mask[1:]
    out[:, 1:] &= mask[:, :-1]
    out[:, :-1] &= mask[:, 1:]
    return out


def _dilate(mask: np.ndarray) -> np.ndarray:
    out = mask.copy()
    out[1:] |= mask[:-1]
    out[:-1] |= mask[1:]
    out[:, 1:] |= mask[:, :-1]
    out[:, :-1] |= mask[:, 1:]
    return out


# an object's eroded core covers at least this fraction of the image: a small triangle's is ~0.9%
_MIN_CORE = 0.003
_SIZE_SPLIT = 0.25  # box side between a small object's (~0.18) and a large one's (~0.32)


def _kind(alpha: np.ndarray) -> str:
    """The kind from the object's coverage ``alpha`` (0..1 per pixel, anti-aliased edges
    partly): a triangle (apex up) keeps its mass low in its box, its centroid 1/6 of the height
    below the box's middle; between a square and a circle, the fill of the box decides (1
    against pi/4), with the edge pixels counted by their coverage (a small shape is mostly edge)."""
    inside = alpha > 0.5
    ys, xs = np.nonzero(inside)
    height = ys.max() - ys.min() + 1
    yy = np.arange(alpha.shape[0])[:, None]
    low = (float((alpha * yy).sum() / alpha.sum()) - (ys.max() + ys.min()) / 2) / height
    # the box's sides as coverage: the widest row's and the tallest column's sums
    fill = alpha.sum() / (alpha.sum(axis=1).max() * alpha.sum(axis=0).max())
    return "triangle" if low > 0.08 else "square" if fill > 0.88 else "circle"


def read_objects(image: np.ndarray) -> tuple[str, list[Seen]]:
    """World 2's segmentation: (the background's colour, every object, largest first). Each
    pixel far from the background is named by its nearest palette colour; a colour is an object
    when its pixels, less their one-pixel edge ring (where two colours blend into a third), keep
    a core of ``_MIN_CORE`` of the image; its pixels are then its core grown back by one ring,
    within the pixels far from the background."""
    img = np.asarray(image, dtype=np.float64)[..., :3]
    h, w = img.shape[:2]
    names = list(COLOURS)
    palette = np.array([COLOURS[n] for n in names], dtype=np.float64)
    label = np.argmin(((img[:, :, None, :] - palette) ** 2).sum(axis=-1), axis=-1)
    border = np.concatenate([label[0], label[-1], label[:, 0], label[:, -1]])
    bg_index = int(np.bincount(border, minlength=len(names)).argmax())
    far = np.sqrt(((img - palette[bg_index]) ** 2).sum(axis=-1)) > 60
    found = []
    for i, name in enumerate(names):
        if i == bg_index:
            continue
        core = _erode(far & (label == i))
        if core.sum() < _MIN_CORE * h * w:
            continue
        mask = _dilate(_dilate(core)) & far & (label == i) | _dilate(core) & far
        # coverage: where a pixel lies between the background and the object's colour
        axis = palette[i] - palette[bg_index]
        alpha = np.clip((img - palette[bg_index]) @ axis / (axis @ axis), 0, 1) * _dilate(mask)
        ys, xs = np.nonzero(mask)
        side = max(xs.max() - xs.min() + 1, ys.max() - ys.min() + 1) / max(h, w)
        cx, cy = (xs.max() + xs.min() + 1) / 2 / w, (ys.max() + ys.min() + 1) / 2 / h
        found.append(Seen(name, _kind(alpha), "small" if side < _SIZE_SPLIT else "large", cx, cy, mask, alpha))
    found.sort(key=lambda o: -int(o.mask.sum()))
    return names[bg_index], found


def relation(subject: Seen, other: Seen) -> str:
    """Where ``subject`` sits seen from ``other``: along the axis their centres differ most on."""
    dx, dy = subject.cx - other.cx, subject.cy - other.cy
    if abs(dx) >= abs(dy):
        return "left of" if dx < 0 else "right of"
    return "above" if dy < 0 else "below"


def _scene_of(background: str, objects: list[Seen]) -> Optional[Scene]:
    if not objects or len(objects) > 2:
        return None
    if len(objects) == 1:
        o = objects[0]
        position = min(POSITIONS, key=lambda p: (POSITIONS[p][0] - o.cx) ** 2 + (POSITIONS[p][1] - o.cy) ** 2)
        return Scene(o.colour, o.shape, background, position, o.size)
    a, b = objects
    scene = Scene(a.colour, a.shape, background, relation(a, b), a.size, Thing(b.colour, b.shape, b.size))
    return canonical(scene)


def _world_json(model: str | Path) -> dict:
    path = Path(model) / "world.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def world_of(model: str | Path) -> int:
    """The shapes world a model folder was trained on: its ``world.json`` (written by
    export/world/train.py), world 1 when it has none."""
    return int(_world_json(model).get("world", 1))


def looks_of(model: str | Path) -> bool:
    """Whether its training scenes drew their looks at random (``world.json``'s ``looks`` > 0)."""
    return float(_world_json(model).get("looks", 0.0)) > 0
