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
    whole = run_config(_config(tmp_path, model_dir, onnx_dir, CATALOGUE))
    report = whole["catalogue"]
    assert report["rows"] == 6 and report["run"] == 6 and report["resumed"] == 0 and report["chunk"] == 4
    assert report["unet_rows"] == 6 * 4  # two chunks (4 + 2 rows) of 4-step tails
    rows = whole["unet_rows"]  # the run's own count takes them in, and what regenerating them would cost
    assert rows["catalogue"] == 6 * 4 and rows["total"] == rows["base"] + rows["edit_tails"] + 6 * 4
    assert rows["regenerating_every_edit"] == TEST_BASE.steps * (len(whole["edits"]) + 6 + 1)
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


def _counted(totals: dict):
    """A progress factory that adds up what each bar is advanced by."""

    def bar(total: int, description: str):
        totals[description] = {"total": total, "advanced": 0}

        def advance(n: int) -> None:
            totals[description]["advanced"] += n

        return advance

    return bar


def _catalogue_files(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.endswith((".png", ".json"))}


def test_a_tampered_catalogue_resumes_to_exactly_the_rows_of_a_clean_run(tmp_path, model_dir, onnx_dir):
    """Only a row's own PNG counts as done: a symlink (to a valid PNG of that very row), a
    damaged PNG, a directory under a row's name are run again without being followed, a stray
    row number past the last is neither counted nor touched. The reference is a clean run in
    another folder: the same files, byte for byte, read by the file system and Pillow."""
    clean = run_config(_config(tmp_path, model_dir, onnx_dir, CATALOGUE, out="clean"))["catalogue"]
    reference = _catalogue_files(tmp_path / "clean" / "catalogue")
    assert clean["run"] == 6 and Image.open(tmp_path / "clean" / "catalogue" / "00000.png").size == (32, 32)

    folder = tmp_path / "tampered" / "catalogue"
    folder.mkdir(parents=True)
    (folder / "catalogue.json").write_bytes(reference["catalogue.json"])
    (folder / "00000.png").write_bytes(reference["00000.png"])  # the one row that is whole
    outside = tmp_path / "outside.png"  # a valid PNG of row 1: followed, it would count as done
    outside.write_bytes(reference["00001.png"])
    (folder / "00001.png").symlink_to(outside)
    (folder / "00002.png").write_bytes(reference["00002.png"][:-40])  # cut short: no IEND, a bad CRC
    (folder / "00003.png").mkdir()
    (folder / "00003.png" / "kept.txt").write_text("inside a directory named like a row")
    stray = reference["00005.png"]
    (folder / "00099.png").write_bytes(stray)  # past the last row (6): no row of this catalogue

    totals: dict = {}
    again = run_config(_config(tmp_path, model_dir, onnx_dir, CATALOGUE, out="tampered"), progress=_counted(totals))
    assert again["catalogue"]["resumed"] == 1 and again["catalogue"]["run"] == 5
    assert totals["catalogue"] == {"total": 6, "advanced": 6}  # never "25/24"
    files = _catalogue_files(folder)
    assert files.pop("00099.png") == stray  # left as it was, not counted
    assert files == reference
    assert not (folder / "00001.png").is_symlink() and outside.read_bytes() == reference["00001.png"]
    assert (folder / "00003.png").is_file()
    index = json.loads(files["catalogue.json"])
    assert index["rows"] == index["written"] == 6


def test_raising_only_max_rows_resumes_the_same_rows(tmp_path, model_dir, onnx_dir):
    """The resume key is what the rows are, not a limit on them: a catalogue run again with a
    larger ``max_rows`` (above its 6 rows) skips the rows it wrote."""
    run_config(_config(tmp_path, model_dir, onnx_dir, CATALOGUE))
    (tmp_path / "out" / "catalogue" / "00004.png").unlink()
    again = run_config(_config(tmp_path, model_dir, onnx_dir, CATALOGUE + "  max_rows: 50\n"))["catalogue"]
    assert again["resumed"] == 5 and again["run"] == 1
