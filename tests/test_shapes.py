"""The shapes world's reader against rendered ground truth."""

from __future__ import annotations

import numpy as np

from edit_rt.export.world.shapes import (COLOURS, POSITIONS, RELATIONS, SHAPES, SIZES, Scene, Thing, canonical,
                                         placements, prompt, random_scene, read, render)  # fmt: skip


def test_reader_recovers_every_attribute_of_clean_renders():
    rng = np.random.default_rng(0)
    scenes = [random_scene(rng) for _ in range(300)]
    wrong = [(s, read(render(s, 32, rng))) for s in scenes]
    wrong = [(s, r) for s, r in wrong if r != s]
    assert len(wrong) <= 3, wrong[:5]  # >= 99% exact, all four attributes at once


def test_every_combination_reads_back_without_jitter():
    for colour in COLOURS:
        for background in COLOURS:
            if colour == background:
                continue
            for shape in SHAPES:
                for position in POSITIONS:
                    scene = Scene(colour, shape, background, position)
                    assert read(render(scene, 32)) == scene, scene


def test_prompt_and_empty_image():
    assert prompt(Scene("red", "circle", "blue", "top left")) == "a red circle on a blue background, top left"
    flat = np.full((32, 32, 3), COLOURS["blue"], dtype=np.uint8)
    assert read(flat) is None


# World 2 (issue 26): 64x64, sizes, one or two objects.


def test_world2_reader_reads_every_object_of_clean_renders():
    rng = np.random.default_rng(0)
    scenes = [random_scene(rng, world=2) for _ in range(600)]
    assert 200 < sum(s.other is not None for s in scenes) < 400
    wrong = [(s, r) for s in scenes if (r := read(render(s, None, rng), world=2)) != canonical(s)]
    assert not wrong, wrong[:5]  # 100%: every attribute of both objects, the relation included


def test_world2_every_object_reads_back_alone_and_in_every_relation():
    for colour, background, other in [("red", "blue", "yellow"), ("white", "green", "purple"), ("blue", "yellow", "red")]:
        for shape in SHAPES:
            for size in SIZES:
                for position in POSITIONS:
                    scene = Scene(colour, shape, background, position, size)
                    assert read(render(scene), world=2) == scene, scene
                for relation_ in RELATIONS:
                    for second in SHAPES:
                        scene = Scene(colour, shape, background, relation_, size, Thing(other, second, "small" if size == "large" else "large"))
                        assert read(render(scene), world=2) == canonical(scene), scene


def test_world2_prompts_and_canonical_form():
    one = Scene("red", "circle", "blue", "top left", "large")
    assert prompt(one) == "a large red circle on a blue background, top left"
    two = Scene("red", "circle", "yellow", "right of", "small", Thing("blue", "square", "large"))
    assert prompt(two) == "a small red circle right of a large blue square on a yellow background"
    assert canonical(two) == Scene("blue", "square", "yellow", "left of", "large", Thing("red", "circle", "small"))
    assert canonical(canonical(two)) == canonical(two) and canonical(one) == one
    assert render(one).shape == (64, 64, 3) and render(Scene("red", "circle", "blue", "top left")).shape == (32, 32, 3)
    # no object, or three: no scene
    assert read(np.full((64, 64, 3), COLOURS["blue"], dtype=np.uint8), world=2) is None
    three = render(two).copy()
    three[2:14, 26:38] = COLOURS["green"]
    assert read(three, world=2) is None


def test_world2_objects_never_touch_nor_leave_the_frame():
    rng = np.random.default_rng(1)
    for _ in range(2000):
        scene = random_scene(rng, world=2, two=1.0)
        (_, ax, ay, ar), (_, bx, by, br) = placements(scene, rng)
        assert max(abs(ax - bx), abs(ay - by)) - ar - br > 2 / 64
        assert all(0 < c - r and c + r < 1 for c, r in ((ax, ar), (ay, ar), (bx, br), (by, br)))
