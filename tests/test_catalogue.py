"""Catalogues (issue 37, item 5): hundreds of variants of one base from a few config lines,
streamed through the step loop a chunk at a time, each image written as it is decoded,
resumable, its size refused over its limit before any row is made.

Each catalogue image is held to the same edit run through the pipeline on its own (the edit
path the rest of the suite holds to diffusers), its PNG read back by Pillow.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from edit_rt.runtime.apps.run import run_config
from edit_rt.runtime.config.load import load_config
from edit_rt.runtime.errors import ConfigError
from edit_rt.runtime.model.edit import TailRow
from edit_rt.runtime.pipeline.images import to_uint8

from .conftest import TEST_BASE

EDITS = ["a green circle on a blue background", "a red square on a blue background"]


def _config(tmp_path, model_dir, onnx_dir, catalogue: str, out: str = "out"):
    text = (f"model: {model_dir}\nbuild_dir: {onnx_dir.parents[1]}\noutput_dir: {tmp_path / out}\n"
            f"base: {{prompt: {TEST_BASE.prompt}, negative_prompt: blurry, seed: 3, steps: 10, width: 32, height: 32}}\n"
            f"store: {{disk_dir: {tmp_path / 'store'}}}\n"
            f"catalogue:\n{catalogue}")  # fmt: skip
    path = tmp_path / f"{out}.yaml"
    path.write_text(text)
    return load_config(path)


CATALOGUE = (f"  edits: [{{prompt: {EDITS[0]}, tail_steps: 4}}, {{prompt: {EDITS[1]}, tail_steps: 4}}]\n"
             "  sliders: [{from: 0.5, to: 1.5, n: 3}]\n  chunk: 4\n")  # fmt: skip


def test_a_catalogue_writes_every_row_and_each_equals_the_edit_alone(tmp_path, model_dir, onnx_dir, pipeline):
    report = run_config(_config(tmp_path, model_dir, onnx_dir, CATALOGUE))["catalogue"]
    assert report["rows"] == 6 and report["run"] == 6 and report["resumed"] == 0 and report["chunk"] == 4
    assert report["unet_rows"] == 6 * 4  # two chunks (4 + 2 rows) of 4-step tails
    folder = tmp_path / "out" / "catalogue"
    index = json.loads((folder / "catalogue.json").read_text())
    assert index["rows"] == index["written"] == 6 and [e["file"] for e in index["entries"]] == [f"{i:05d}.png" for i in range(6)]
    state = pipeline.generate_base(TEST_BASE)
    for i, (prompt, strength) in enumerate((p, s) for p in EDITS for s in (0.5, 1.0, 1.5)):
        png = Image.open(folder / f"{i:05d}.png")
        assert f"Edit strength: {strength:g}" in png.text["parameters"] and png.text["parameters"].startswith(prompt)
        assert index["entries"][i]["label"].startswith(f"strength={strength:g}")
        (alone,) = pipeline.edit(state, [TailRow(prompt, strength, TEST_BASE.steps - 4, TEST_BASE.guidance)])
        assert np.abs(np.asarray(png, dtype=np.int16) - to_uint8(alone.image).astype(np.int16)).max() <= 1


def test_a_stopped_catalogue_resumes_from_the_store_and_its_files(tmp_path, model_dir, onnx_dir):
    cfg = _config(tmp_path, model_dir, onnx_dir, CATALOGUE)
    first = run_config(cfg)
    folder = tmp_path / "out" / "catalogue"
    before = {i: (folder / f"{i:05d}.png").read_bytes() for i in range(6)}
    for i in (1, 4):  # as if the run had stopped before writing them
        (folder / f"{i:05d}.png").unlink()
    again = run_config(cfg)
    assert first["base_source"] == "generated" and again["base_source"].startswith("store")
    assert again["catalogue"]["run"] == 2 and again["catalogue"]["resumed"] == 4
    assert again["unet_rows"]["base"] == 0  # the base came back from the store
    assert {i: (folder / f"{i:05d}.png").read_bytes() for i in range(6)} == before
    other = CATALOGUE.replace("n: 3", "n: 2")  # another spec in the same folder
    with pytest.raises(ConfigError, match="output_dir: .* holds another catalogue"):
        run_config(_config(tmp_path, model_dir, onnx_dir, other))


@pytest.mark.parametrize("text,where", [
    (CATALOGUE.replace("chunk: 4", "max_rows: 5"), "catalogue.max_rows=5"),
    ("  edits: [{prompt: x}]\n  sliders: [{direction: 0, from: 0, to: 1, n: 2}]\n", r"catalogue.sliders\[0\].direction"),
    ("  edits: [{prompt: x, sweep: {from: 0, to: 1, n: 2}}]\n", r"catalogue.edits\[0\].sweep"),
    ("  edits: []\n", "catalogue.edits"),
    ("  edits: [{prompt: x}]\n  max_rows: 100000\n", "catalogue.max_rows"),
])
def test_a_catalogue_is_refused_before_any_row_naming_the_field(tmp_path, model_dir, onnx_dir, text, where):
    with pytest.raises(ConfigError, match=where):
        _config(tmp_path, model_dir, onnx_dir, text)


def test_the_size_is_counted_without_making_rows():
    from edit_rt.runtime.config.catalogue import Catalogue

    spec = Catalogue(edits=[{"prompt": f"p{i}"} for i in range(20)],
                     sliders=[{"adapter": a, "from": -2, "to": 2, "n": 8} for a in ("a", "b", "c")], max_rows=480)  # fmt: skip
    assert spec.size() == 480
    rows = spec.rows()
    first = [next(rows) for _ in range(9)]  # lazily: the first rows without the other 471
    assert [i for i, _ in first] == list(range(9)) and first[8][1].adapters == {"b": -2.0}
