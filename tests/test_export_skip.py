"""`edit-rt export` skips an export whose inputs did not change (a second `make demo` does not
export again), and exports again when any of them did: the weights, a setting, a graph file.

The reference is the file system: a skipped export leaves every file of the export folder as it
was (bytes and mtime), a needed one rewrites the manifest.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from typer.testing import CliRunner

from edit_rt.export.compile.export_inputs import export_inputs, why_export
from edit_rt.runtime.apps.cli import app

DEFAULTS = dict(opset=17, external_data_threshold_mb=1900.0, variant=None, adapter_slots=0, adapter_rank=16,
                attention_slicing="auto")  # fmt: skip


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_second_export_of_the_same_inputs_is_skipped_and_leaves_the_folder_as_it_was(tmp_path, model_dir, onnx_dir):
    build = tmp_path / "build"
    shutil.copytree(onnx_dir, build / model_dir.name / "onnx")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": str(model_dir), "build_dir": str(build), "output_dir": str(tmp_path / "out"),
                                      "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32}}))  # fmt: skip
    before = _files(build / model_dir.name / "onnx")
    result = CliRunner().invoke(app, ["export", str(config)])
    assert result.exit_code == 0, result.output
    assert "export skipped" in " ".join(result.output.split())
    assert _files(build / model_dir.name / "onnx") == before


def test_an_export_is_current_only_for_its_own_inputs(tmp_path, model_dir, onnx_dir):
    assert why_export(model_dir, onnx_dir, export_inputs(**DEFAULTS)) is None
    for key, value in (("opset", 16), ("adapter_slots", 2), ("attention_slicing", 1), ("variant", "fp16")):
        assert why_export(model_dir, onnx_dir, export_inputs(**{**DEFAULTS, key: value})) == "the export settings changed", key

    copy = tmp_path / "onnx"
    shutil.copytree(onnx_dir, copy)
    with open(copy / "vae_decoder.onnx", "ab") as f:  # a graph file not as the export wrote it
        f.write(b"\0")
    assert why_export(model_dir, copy, export_inputs(**DEFAULTS)) == "graph vae_decoder is missing or changed"
    (copy / "manifest.json").unlink()
    assert why_export(model_dir, copy, export_inputs(**DEFAULTS)) == "no complete export there"


def test_other_weights_in_the_model_folder_need_a_new_export(tmp_path, model_dir, onnx_dir):
    model = tmp_path / model_dir.name
    shutil.copytree(model_dir, model)
    # copied bytes: other stats, the same content, so the export is still theirs
    assert why_export(model, onnx_dir, export_inputs(**DEFAULTS)) is None
    weights = next((model / "vae").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last weight
    weights.write_bytes(bytes(data))
    assert why_export(model, onnx_dir, export_inputs(**DEFAULTS)) == "the model's weights changed"
