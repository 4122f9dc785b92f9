"""The shapes world's reader against rendered ground truth."""

from __future__ import annotations

import numpy as np

from edit_rt.export.shapes import COLOURS, POSITIONS, SHAPES, Scene, prompt, random_scene, read, render


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
