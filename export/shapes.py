"""The "shapes" world: images of one coloured shape on a coloured background, with prompts,
and a reader that recovers the attributes from pixels (no learned judge).

``render(Scene)`` draws a scene; ``prompt(Scene)`` says it ("a red circle on a blue
background, top left"); ``read(image)`` recovers the scene by pixel statistics: the background
is the most common border colour, the shape is every pixel far from it, its colour the nearest
palette entry to their median, its position the quadrant (or centre) of their centroid, and its
kind the fraction of its bounding box it fills (square ~1, circle ~pi/4, triangle ~1/2).
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


def render(scene: Scene, size: int = 32, rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """The scene as uint8 [size, size, 3]; ``rng`` jitters the shape's size and place a little."""
    # Draw at 4x and downsample: anti-aliased edges, as a generated image would have.
    scale = 4
    s = size * scale
    image = Image.new("RGB", (s, s), COLOURS[scene.background])
    draw = ImageDraw.Draw(image)
    cx, cy = POSITIONS[scene.position]
    r = 0.17
    if rng is not None:
        cx, cy = cx + rng.uniform(-0.04, 0.04), cy + rng.uniform(-0.04, 0.04)
        r *= rng.uniform(0.85, 1.15)
    box = [(cx - r) * s, (cy - r) * s, (cx + r) * s, (cy + r) * s]
    fill = COLOURS[scene.colour]
    if scene.shape == "circle":
        draw.ellipse(box, fill=fill)
    elif scene.shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) / 2, box[1])], fill=fill)
    return np.asarray(image.resize((size, size), Image.BOX))


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
