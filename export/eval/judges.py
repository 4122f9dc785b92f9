"""How `make quality` judges an edit in each shapes world: the bases it draws, how it reads them,
the edits it makes of them, and what it scores.

Both judges make the edits a user would (the base prompt with one word replaced, by a value that
neither the prompt nor the reader's view of the base has) and score each one as:

- *success*: the reader finds the edit's target attribute; *preservation*: every other
  attribute reads as in the base; an unreadable image fails both;
- *untouched PSNR*: PSNR (8-bit, capped at ``PSNR_CAP`` for identical pixels) of the region the
  edit should not touch, from the reader's segmentation of the base: everything but the edited
  shape for colour and shape edits (less the new shape, for shape edits), the shapes for
  background edits (world 2: the edited shape grown by a pixel, where its faint edge pixels
  lie; the shapes less their edge ring, which blends with the background);
- *silhouette IoU*: the edited shape's pixels (background edits: every shape's) in the base
  against the edit's (colour and background edits; a shape edit changes the silhouette on
  purpose); world 2 weighs each pixel by how much of it the shape covers (its coverage along
  the line from the background's colour to its own), so a small shape's anti-aliased edge
  counts by its share and not all or nothing.

World 2 (``World2``) bases may hold two objects; its kinds then end in ``", 2 objects"``, the
edit is on the prompt's first object, and two more scores say what happened to the other:
*other kept* (its colour, kind and size read as in the base) and *other PSNR* (over its pixels in
the base). The reader's objects are matched to the base's by place (centres), so an object
whose colour or kind an edit changed is still the same object.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import numpy as np

from edit_rt.runtime.pipeline.images import to_uint8

from ..world.looks import _border_colour, read_any_look
from ..world.shapes import (COLOURS, POSITIONS, SHAPES, Scene, Seen, _dilate, _erode, canonical, looks_of, prompt,
                            random_scene, read, read_objects, relation, world_of)  # fmt: skip

PSNR_CAP = 60.0  # dB given to identical regions (no error to take the log of)
KINDS = ("colour", "background", "shape")


def psnr(a: np.ndarray, b: np.ndarray, region: np.ndarray) -> float:
    """8-bit PSNR of ``a`` against ``b`` over ``region`` (PSNR_CAP when identical or empty)."""
    if not region.any():
        return PSNR_CAP
    mse = float(((to_uint8(a).astype(np.float64) - to_uint8(b).astype(np.float64))[region] ** 2).mean())
    return PSNR_CAP if mse == 0 else min(PSNR_CAP, 10 * np.log10(255.0**2 / mse))


def iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two masks, or of two coverages (0..1: the sums of their
    pixelwise min and max, so a shape's anti-aliased edge counts by how much it covers)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.minimum(a, b).sum() / max(1e-9, np.maximum(a, b).sum()))


def foreground(image: np.ndarray, background: str, looks: bool = False) -> np.ndarray:
    """[H, W] bool: the shapes' pixels, as the world-1 reader segments them (far from the
    background's palette colour; with ``looks``, from the frame's median colour, which a
    saturation look moves off the palette)."""
    img = to_uint8(image).astype(np.float64)
    bg = _border_colour(img) if looks else np.array(COLOURS[background], dtype=np.float64)
    return np.sqrt(((img - bg) ** 2).sum(axis=-1)) > 60


def _pick(kind: str, avoid: list[Scene], rng: np.random.Generator) -> str:
    """A value of ``kind`` that none of ``avoid`` has (a colour: in no role, so the world's
    colours stay distinct)."""
    if kind == "shape":
        return str(rng.choice([s for s in SHAPES if all(s != o.shape for o in avoid)]))
    taken = {c for o in avoid for c in (o.colour, o.background, *((o.other.colour,) if o.other is not None else ()))}
    return str(rng.choice([c for c in COLOURS if c not in taken]))


@dataclasses.dataclass
class Score:
    success: bool
    preserved: bool
    unreadable: bool
    changed: list
    psnr: float
    iou: Optional[float]
    other_kept: Optional[bool] = None
    other_psnr: Optional[float] = None


class World1:
    """One shape per image (32x32): the scene is the reading. A model trained with its scenes'
    looks drawn at random (issue 36: ``looks``) is read by ``read_any_look``, which names a
    colour along its saturation curve and reads through an outline or a blur."""

    world = 1
    fields = tuple(f.name for f in dataclasses.fields(Scene) if f.name not in ("size", "other"))

    def __init__(self, looks: bool = False):
        self.looks = looks

    def kinds(self) -> tuple[str, ...]:
        return KINDS

    def scene(self, rng: np.random.Generator) -> Scene:
        return random_scene(rng)

    def read(self, image: np.ndarray, like: Any = None) -> Optional[Scene]:
        """The reader on a decoded image ([H, W, 3] in [0, 1]), quantized as a saved PNG would be."""
        return read_any_look(to_uint8(image)) if self.looks else read(to_uint8(image))

    def base_reading(self, image: np.ndarray, intended: Scene) -> Optional[Scene]:
        return self.read(image)

    def follow(self, image: np.ndarray, intended: Scene) -> dict[str, bool]:
        """Which of the prompt's attributes the image shows (all four: ``all``)."""
        seen = self.read(image)
        out = {f: seen is not None and getattr(seen, f) == getattr(intended, f) for f in self.fields}
        return {**out, "all": seen == intended}

    def edits(self, intended: Scene, seen: Scene, rng: np.random.Generator) -> dict[str, tuple[Scene, str]]:
        """Per kind (what the edit should show, the edit prompt)."""
        out = {}
        for kind in KINDS:
            value = _pick(kind, [seen, intended], rng)
            out[kind] = dataclasses.replace(seen, **{kind: value}), prompt(dataclasses.replace(intended, **{kind: value}))
        return out

    def score(self, image: np.ndarray, base_image: np.ndarray, seen: Scene, target: Scene, kind: str) -> Score:
        result = self.read(image)
        if result is None:
            ok, kept, changed = False, False, []
        else:
            changed = [f for f in self.fields if f != kind and getattr(result, f) != getattr(seen, f)]
            ok, kept = getattr(result, kind) == getattr(target, kind), not changed
        shape_base = foreground(base_image, seen.background, self.looks)
        shape_edit = foreground(image, result.background if result else target.background, self.looks)
        region = {"background": shape_base, "shape": ~shape_base & ~shape_edit}.get(kind, ~shape_base)
        return Score(ok, kept, result is None, changed, psnr(base_image, image, region),
                     None if kind == "shape" else iou(shape_base, shape_edit))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Reading:
    """What the world-2 reader saw: the background and the objects, in the prompt's order."""

    background: str
    objects: tuple[Seen, ...]

    def fields(self) -> dict[str, Any]:
        first = self.objects[0]
        out = {"background": self.background, "colour": first.colour, "shape": first.shape, "size": first.size}
        if len(self.objects) == 1:
            out["position"] = min(POSITIONS, key=lambda p: (POSITIONS[p][0] - first.cx) ** 2 + (POSITIONS[p][1] - first.cy) ** 2)
        else:
            other = self.objects[1]
            out.update(position=relation(first, other), other_colour=other.colour, other_shape=other.shape, other_size=other.size)
        return out


def _by_place(found: list[Seen], like: tuple[Seen, ...]) -> Optional[tuple[Seen, ...]]:
    """``found`` in the order of ``like``'s objects, each matched to the nearest (the order with the
    least total distance between centres); None when the counts differ."""
    if len(found) != len(like):
        return None
    if len(found) == 1:
        return tuple(found)
    a, b = found
    d = lambda x, y: (x.cx - y.cx) ** 2 + (x.cy - y.cy) ** 2  # noqa: E731
    return (a, b) if d(a, like[0]) + d(b, like[1]) <= d(b, like[0]) + d(a, like[1]) else (b, a)


class World2:
    """One or two objects per image (64x64)."""

    world = 2
    other_fields = ("other_colour", "other_shape", "other_size")

    def kinds(self) -> tuple[str, ...]:
        return (*KINDS, *(f"{k}, 2 objects" for k in KINDS))

    def scene(self, rng: np.random.Generator) -> Scene:
        return random_scene(rng, world=2)

    def read(self, image: np.ndarray, like: Optional[Reading] = None) -> Optional[Reading]:
        background, found = read_objects(to_uint8(image))
        if not found or len(found) > 2:
            return None
        if like is not None:
            ordered = _by_place(found, like.objects)
            return None if ordered is None else Reading(background, ordered)
        return Reading(background, tuple(found))

    def base_reading(self, image: np.ndarray, intended: Scene) -> Optional[Reading]:
        """The base read, its objects in the prompt's order (matched by colour); None unless it
        shows the prompt's objects in their colours on the prompt's background (a base to
        edit, as a user would keep it; its kinds, sizes and places may differ)."""
        background, found = read_objects(to_uint8(image))
        want = [t.colour for t in intended.things()]
        if background != intended.background or sorted(o.colour for o in found) != sorted(want):
            return None
        return Reading(background, tuple(next(o for o in found if o.colour == c) for c in want))

    def follow(self, image: np.ndarray, intended: Scene) -> dict[str, bool]:
        """Which of the prompt's attributes the image shows, each object found by its colour:
        ``colours_and_background`` (every object's colour and the background), ``shape`` and
        ``size`` (of the prompt's first object), ``position`` (one object: where it is; two: the
        first's relation to the second), ``second_object`` (two objects: the second's colour,
        kind and size), ``objects`` (as many as asked) and ``all`` (the reader's scene is the
        prompt's)."""
        background, found = read_objects(to_uint8(image))
        by_colour = {o.colour: o for o in found}
        things = intended.things()
        first = by_colour.get(things[0].colour)
        out = {
            "colours_and_background": background == intended.background and all(t.colour in by_colour for t in things),
            "shape": first is not None and first.shape == things[0].shape,
            "size": first is not None and first.size == things[0].size,
            "objects": len(found) == len(things),
        }
        if len(things) == 1:
            out["position"] = first is not None and Reading(background, (first,)).fields()["position"] == intended.position
        else:
            second = by_colour.get(things[1].colour)
            out["position"] = first is not None and second is not None and relation(first, second) == intended.position
            out["second_object"] = second is not None and (second.shape, second.size) == (things[1].shape, things[1].size)
        out["all"] = read(to_uint8(image), world=2) == canonical(intended)
        return out

    def edits(self, intended: Scene, seen: Reading, rng: np.random.Generator) -> dict[str, tuple[dict, str]]:
        """Per kind (the fields the edit should show, the edit prompt): the prompt's first object's
        colour or kind, or the background."""
        fields = seen.fields()
        shown = Scene(fields["colour"], fields["shape"], fields["background"], intended.position, fields["size"], intended.other)
        suffix = ", 2 objects" if intended.other is not None else ""
        out = {}
        for kind in KINDS:
            value = _pick(kind, [shown, intended], rng)
            out[kind + suffix] = {**fields, kind: value}, prompt(dataclasses.replace(intended, **{kind: value}))
        return out

    def score(self, image: np.ndarray, base_image: np.ndarray, seen: Reading, target: dict, kind: str) -> Score:
        kind, two = kind.split(",")[0], len(seen.objects) == 2
        result = self.read(image, like=seen)
        base = seen.fields()
        if result is None:
            ok, kept, changed, got = False, False, [], {}
        else:
            got = result.fields()
            changed = [f for f in base if f != kind and got.get(f) != base[f]]
            ok, kept = got[kind] == target[kind], not changed
        first = seen.objects[0].mask
        shapes = np.logical_or.reduce([o.mask for o in seen.objects])
        first_edit = result.objects[0].mask if result is not None else np.zeros_like(first)
        # an edit of a shape may redraw the faint edge pixels around it (within a pixel), a
        # background edit the shapes' anti-aliased edge ring: neither counts as untouched
        region = {"background": _erode(shapes), "shape": ~_dilate(first) & ~_dilate(first_edit)}.get(kind, ~_dilate(first))
        silhouette, nothing = None, np.zeros(first.shape)
        if kind == "colour":
            silhouette = iou(seen.objects[0].coverage, result.objects[0].coverage if result else nothing)
        elif kind == "background":
            silhouette = iou(np.maximum.reduce([o.coverage for o in seen.objects]),
                             np.maximum.reduce([o.coverage for o in result.objects]) if result else nothing)  # fmt: skip
        score = Score(ok, kept, result is None, changed, psnr(base_image, image, region), silhouette)
        if two and kind != "background":
            score.other_kept = result is not None and all(got[f] == base[f] for f in self.other_fields)
            score.other_psnr = psnr(base_image, image, seen.objects[1].mask)
        return score


def judge_for(world: int, looks: bool = False) -> World1 | World2:
    return World2() if world == 2 else World1(looks)


def judge_of(model: str | Path) -> World1 | World2:
    """The judge of a model folder's world, reading through the looks when it was trained with them."""
    return judge_for(world_of(model), looks_of(model))

