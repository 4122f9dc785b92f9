"""The committed 64x64 shapes model of world 2 (export/models/shapes64-sd), through edit-rt's own
ONNX runtime: its generations equal diffusers' on the same weights, and the reader (pixel
statistics, not the model) finds what a small sample of prompts asked for, one object and two.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from edit_rt.export.eval.judges import World2, world_of
from edit_rt.export.world.shapes import prompt
from edit_rt.runtime.model.edit import Base
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

from .shapes_reference import assert_generation_equals_diffusers

MODEL = Path(__file__).resolve().parents[1] / "export" / "models" / "shapes64-sd"
BASE = Base(prompt="", negative_prompt="", seed=0, steps=30, guidance=4.0, width=64, height=64)
N_PROMPTS = 16
# Floors below the model card's 100-prompt measurement (gates.json), with room for 16 prompts; a
# model that ignores its prompt (colours at chance: 1/6 each) falls far below.
FLOORS = {"colours_and_background": 0.8, "shape": 0.5}


@pytest.fixture(scope="module")
def shapes64(tmp_path_factory):
    from edit_rt.export.compile.onnx_export import export_onnx

    onnx_dir = tmp_path_factory.mktemp("shapes64-sd") / "onnx"
    export_onnx(MODEL, onnx_dir)
    with EditPipeline(onnx_dir, MODEL, image_size=(64, 64)) as pipe:
        yield pipe


def test_the_model_card_holds_its_gates_and_world():
    assert world_of(MODEL) == 2
    gates = json.loads((MODEL / "gates.json").read_text())
    assert gates["prompts"] >= 100 and set(gates["gates"]) >= {"colours_and_background", "shape", "position", "second_object"}


def test_generation_equals_diffusers(shapes64):
    assert_generation_equals_diffusers(shapes64, MODEL, BASE, "a small yellow square left of a large red circle on a blue background")


@pytest.mark.slow  # ~10-20 s; the default run keeps the 32x32 model's (test_shapes_model.py)
def test_generations_follow_their_prompts(shapes64):
    judge = World2()
    rng = np.random.default_rng(7)
    hits: dict[str, list[bool]] = {}
    for k in range(N_PROMPTS):
        scene = judge.scene(rng)
        state = shapes64.generate_base(dataclasses.replace(BASE, prompt=prompt(scene), seed=k))
        for field, ok in judge.follow(shapes64.decode(state.final_latent)[0], scene).items():
            hits.setdefault(field, []).append(ok)
    assert len(hits["second_object"]) >= 4  # both kinds of prompt were asked
    for field, floor in FLOORS.items():
        assert np.mean(hits[field]) >= floor, (field, hits)
