"""Configs that cannot hurt: a typo is refused in one line before anything is allocated."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from edit_rt.runtime.config.load import load_config
from edit_rt.runtime.engine.memory import step_row_bytes
from edit_rt.runtime.errors import ConfigError

from .test_hardening import CLI, _cli_run, _config

# Runs the command it is given and writes its peak RSS (KiB) last on stderr: the only child of
# this small parent, so RUSAGE_CHILDREN is that command's alone.
PEAK_OF_CHILD = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
                 "print(f'peak_kib={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', file=sys.stderr); "
                 "sys.exit(code)")  # fmt: skip


def _text(model_dir, onnx_dir, tmp_path) -> str:
    return yaml.safe_dump(_config(model_dir, onnx_dir, tmp_path), sort_keys=False)


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path, model_dir, onnx_dir):
    text = _text(model_dir, onnx_dir, tmp_path) + "base:\n  prompt: y\n"  # a second base: at the end
    first = 1 + text.splitlines().index("base:")
    second = len(text.splitlines()) - 1
    r = _cli_run(tmp_path, text)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"the key 'base' is given twice (lines {first} and {second})" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    (tmp_path / "flow.yaml").write_text("model: x\nbase: {prompt: a, prompt: b}\n")
    with pytest.raises(ConfigError, match=r"flow.yaml: line 2.*'prompt' is given twice"):
        load_config(tmp_path / "flow.yaml")


def test_a_yaml_syntax_error_is_one_line_with_its_place(tmp_path):
    (tmp_path / "bad.yaml").write_text("model: x\nbase: [1,\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "bad.yaml")
    assert "bad.yaml: line 3" in str(err.value) and "\n" not in str(err.value)


def test_a_size_the_machine_cannot_hold_is_refused_before_allocating(tmp_path, model_dir, onnx_dir):
    """512x512 on the 32x32 test model (a base: block that fell back to the default size): the
    run is refused in one line and never grows (it grew to 23 GB before): the peak RSS is the
    check; the subprocess timeout only guards against a hang."""
    cfg = _config(model_dir, onnx_dir, tmp_path, base={"prompt": "x", "steps": 4, "width": 512, "height": 512})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    # the run's own peak, as a parent of its own reads it (this process's children are every
    # subprocess its tests started, a browser among them)
    r = subprocess.run([sys.executable, "-c", PEAK_OF_CHILD, *CLI, "run", str(tmp_path / "config.yaml")],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    stderr, peak_kib = r.stderr.rsplit("peak_kib=", 1)
    assert r.returncode == 2 and "Traceback" not in stderr, stderr
    assert "base.width/height: 512x512 needs about" in stderr and "GiB" in stderr, stderr
    assert "for one step row" in stderr and "the model's own is 32x32" in stderr, stderr
    assert int(peak_kib) < 2 * 2**20, peak_kib  # KiB: the refused run stayed under 2 GiB


def test_the_estimate_grows_with_the_square_of_the_pixels_and_slicing_cuts_it():
    """Self-attention's scores: doubling each side is 16x their memory (4x the tokens, squared);
    one head at a time holds 1/heads of them. Written out here from the shapes, not the code."""
    layers = [{"name": "down_blocks.1.attentions.0.transformer_blocks.0.attn2", "heads": 8, "inner_dim": 64}]
    live = 40 * 64 * 4  # memory.LIVE_TENSORS activations of the finest width, per latent pixel
    small, big = step_row_bytes(layers, (32, 32)), step_row_bytes(layers, (64, 64))
    # down_blocks.1 sees 16x16 of a 32x32 latent: 256 tokens, 8 heads, 2 UNet rows, scores + softmax
    assert small == 2 * (8 * 256**2 * 4 * 2 + live * 32 * 32)
    assert big == 2 * (8 * 1024**2 * 4 * 2 + live * 64 * 64)
    assert step_row_bytes(layers, (64, 64), slice_heads=1) == 2 * (1 * 1024**2 * 4 * 2 + live * 64 * 64)


def test_a_stored_base_the_store_refuses_is_generated_again_by_run(tmp_path, model_dir, onnx_dir):
    """`edit-rt run` after an upgrade: the store's old-format file is set aside and the base is
    generated again (exit 0, one warning), not the end of the run."""
    import json

    from safetensors.numpy import load_file, save_file

    cfg = _config(model_dir, onnx_dir, tmp_path, store={"ram_mb": 64, "disk_dir": str(tmp_path / "store"), "disk_mb": 64})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    run = lambda: subprocess.run([*CLI, "run", str(tmp_path / "config.yaml")], capture_output=True, text=True, timeout=300)  # noqa: E731
    assert run().returncode == 0
    (path,) = (tmp_path / "store" / "bases").glob("*.safetensors")
    with open(path, "rb") as f:  # the same tensors under an older format's header
        head = f.read(8)
        meta = json.loads(f.read(int.from_bytes(head, "little")))["__metadata__"]
    save_file(load_file(path), path, metadata={**meta, "format": "edit-rt-base/3"})
    again = run()
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert "set aside" in again.stderr or "damaged" in again.stderr, again.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["base_source"] == "generated"


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_config_loads(path):
    """Each config the README and the Makefile name is one `edit-rt` accepts as committed (its
    fields, ranges and paths)."""
    from edit_rt.runtime.config.load import is_text_config, load_text_config

    if is_text_config(path):
        cfg = load_text_config(path)
        assert cfg.source == path and (cfg.model / "config.json").exists()
        return
    cfg = load_config(path)
    assert cfg.source == path and (cfg.plan is None or cfg.base.width * cfg.base.height == 80)
