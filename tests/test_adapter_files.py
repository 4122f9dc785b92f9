"""Adapter files are checked on load and at conversion (issue 35, item 6 and item 7's CLI
part): a converted file of a rank wider than the slots is refused (never written past its
slot), as are A/B halves that disagree and NaN/inf weights (absurd magnitudes warn);
malformed LoRA files make `edit-rt adapters` print one ``error:`` line naming the file and exit
2, as does a config without adapters."""

from __future__ import annotations

import logging
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from edit_rt.export.compile.adapters import check_safetensors
from edit_rt.runtime.errors import ArtifactError, ModelError
from edit_rt.runtime.model.adapters import ADAPTER_FORMAT, load_adapter

MANIFEST = SimpleNamespace(fingerprint="fp", adapters={"rank": 8, "slots": 2, "layers": [
    {"name": "unet.l", "in": 4, "out": 6, "graph": "unet_step", "down": "d", "up": "u"}]})  # fmt: skip


def _converted(tmp_path, down, up, rank=8, extra=None):
    path = tmp_path / "x.safetensors"
    tensors = {"unet.l.down": np.asarray(down, np.float32), "unet.l.up": np.asarray(up, np.float32)} | (extra or {})
    save_file(tensors, str(path), metadata={"format": ADAPTER_FORMAT, "fingerprint": "fp", "rank": str(rank)})
    return path


def test_a_sound_converted_file_loads(tmp_path):
    adapter = load_adapter(_converted(tmp_path, np.ones((8, 4)), np.ones((6, 8))), "x", MANIFEST)
    assert adapter.rank == 8 and adapter.layers["unet.l"][0].shape == (8, 4)


@pytest.mark.parametrize("down,up,rank,match", [
    (np.ones((16, 4)), np.ones((6, 16)), 16, "8 wide"),  # rewritten to rank 16: never past its slot
    (np.ones((16, 4)), np.ones((6, 16)), 8, "rank <= 8"),  # the metadata lies about it
    (np.ones((8, 4)), np.ones((6, 4)), 8, "not a rank"),  # A/B disagree
    (np.full((8, 4), np.nan), np.ones((6, 8)), 8, "NaN or infinite"),
    (np.ones((8, 4)), np.full((6, 8), np.inf), 8, "NaN or infinite"),
    (np.ones((8, 5)), np.ones((6, 8)), 8, "does not fit"),
])  # fmt: skip
def test_a_converted_file_that_does_not_fit_its_slot_is_refused(tmp_path, down, up, rank, match):
    with pytest.raises(ArtifactError, match=match) as err:
        load_adapter(_converted(tmp_path, down, up, rank), "x", MANIFEST)
    assert "\n" not in str(err.value) and "x.safetensors" in str(err.value)


def test_a_half_without_its_pair_is_refused(tmp_path):
    path = _converted(tmp_path, np.ones((8, 4)), np.ones((6, 8)), extra={"unet.m.down": np.ones((8, 4), np.float32)})
    with pytest.raises(ArtifactError, match="not an A/B pair"):
        load_adapter(path, "x", MANIFEST)


def test_absurd_magnitudes_load_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        load_adapter(_converted(tmp_path, np.ones((8, 4)), np.full((6, 8), 1e30)), "x", MANIFEST)
    assert "past 10000" in caplog.text


def _header(n: int) -> bytes:
    return n.to_bytes(8, "little")


def _malformed(tmp_path, kind):
    path = tmp_path / f"{kind}.safetensors"
    if kind == "random":
        path.write_bytes(os.urandom(4096))
    elif kind == "huge_header":
        path.write_bytes(_header(2**62) + b"{}")
    elif kind == "not_json":
        path.write_bytes(_header(8) + b"not json")
    elif kind == "absurd_shape":
        h = b'{"w":{"dtype":"F32","shape":[2147483648,2147483648],"data_offsets":[0,16]}}'
        path.write_bytes(_header(len(h)) + h + bytes(16))
    elif kind == "past_the_end":
        h = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16000]}}'
        path.write_bytes(_header(len(h)) + h + bytes(16))
    elif kind == "symlink":
        target = tmp_path / "notes.txt"
        target.write_text("hello, not a LoRA\n" * 10)
        path.symlink_to(target)
    return path


KINDS = ["random", "huge_header", "not_json", "absurd_shape", "past_the_end", "symlink"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_malformed_lora_file_is_refused_in_one_line_naming_it(tmp_path, kind):
    path = _malformed(tmp_path, kind)
    with pytest.raises(ModelError) as err:
        check_safetensors(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def _cli(monkeypatch, capsys, config):
    from edit_rt.runtime.apps import cli

    monkeypatch.setattr(sys, "argv", ["edit-rt", "adapters", str(config)])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    out = capsys.readouterr()
    return exit_.value.code, out.out + out.err


@pytest.mark.parametrize("kind", KINDS)
def test_edit_rt_adapters_on_a_malformed_file_prints_one_error_line_and_exits_2(tmp_path, model_dir, monkeypatch, capsys, kind):
    lora = _malformed(tmp_path, kind)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": str(model_dir), "build_dir": str(tmp_path / "build"),
                                      "base": {"prompt": "a", "steps": 4, "width": 32, "height": 32},
                                      "adapters": {"x": str(lora)}}))  # fmt: skip
    code, text = _cli(monkeypatch, capsys, config)
    lines = text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in text, text


def test_edit_rt_adapters_without_adapters_says_so_in_one_line_and_exits_2(tmp_path, model_dir, monkeypatch, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": str(model_dir), "build_dir": str(tmp_path / "build"),
                                      "base": {"prompt": "a", "steps": 4, "width": 32, "height": 32}}))  # fmt: skip
    code, text = _cli(monkeypatch, capsys, config)
    lines = text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "no adapters" in lines[0], text
