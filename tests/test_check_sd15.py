"""The real-size check (scripts/check_sd15.py, `make check-sd15`): its measuring, its model's
true size, and the whole check at a reduced size (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_sd15.py"
MB = 10**6


def _script():
    """scripts/check_sd15.py as a module (scripts/ is no package)."""
    if "check_sd15" not in sys.modules:
        spec = importlib.util.spec_from_file_location("check_sd15", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["check_sd15"] = module  # its dataclasses look their module up while being made
        spec.loader.exec_module(module)
    return sys.modules["check_sd15"]


# A child that holds `n` MB, written (b"\x01" * n touches every page; a zeroed bytearray would
# be untouched pages that RSS does not count) for a second.
HOLD = "import time; b = b'\\x01' * ({n} * 10**6); time.sleep(1.0)"


def test_rss_sampler_measures_a_200_mb_child(tmp_path):
    check = _script()
    m = check.measure([sys.executable, "-c", HOLD.format(n=200)], tmp_path / "child.log")
    assert m.returncode == 0
    # the interpreter itself adds ~10 MB; within 20% of the 200 MB held
    assert abs(m.peak_rss_bytes - 200 * MB) <= 0.2 * 200 * MB, m
    assert m.sampled_peak_bytes >= 0.8 * 200 * MB, m  # the 0.2 s sampler saw it, not only wait4


def test_rss_sampler_sums_the_process_tree(tmp_path):
    """Two grandchildren of 150 MB each at once: the tree's peak is their sum, which no single
    process's own peak (wait4's) shows."""
    check = _script()
    spawn = ("import subprocess, sys; ps = [subprocess.Popen([sys.executable, '-c', {hold!r}]) for _ in range(2)]; "
             "[p.wait() for p in ps]").format(hold=HOLD.format(n=150))  # fmt: skip
    m = check.measure([sys.executable, "-c", spawn], tmp_path / "tree.log")
    assert m.returncode == 0
    assert m.sampled_peak_bytes >= 0.8 * 300 * MB, m
    assert m.own_peak_bytes < 0.8 * 300 * MB, m


def test_disk_use_counts_a_hard_linked_file_once(tmp_path):
    check = _script()
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    os.link(tmp_path / "a.bin", tmp_path / "b.bin")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.bin").write_bytes(b"y" * 10)
    assert check.tree_bytes(tmp_path) == 1010


def test_random_sd15_has_sd15s_true_size():
    """The shipped SD 1.5 configs build SD 1.5's parameter counts; scale 0.1 keeps the
    architecture (depth, vocabulary) with GroupNorm-divisible widths."""
    from edit_rt.export.world.sd_random import parameter_counts, random_sd_configs

    full = random_sd_configs("sd15", 1.0)
    assert parameter_counts(full) == {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480}
    small = random_sd_configs("sd15", 0.1)
    assert small["unet"]["block_out_channels"] == [32, 64, 128, 128]
    assert all(c % 32 == 0 for c in small["vae"]["block_out_channels"])
    assert small["unet"]["cross_attention_dim"] == small["text_encoder"]["hidden_size"]
    for key in ("layers_per_block", "down_block_types", "up_block_types", "sample_size"):
        assert small["unet"][key] == full["unet"][key]
    for key in ("vocab_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
        assert small["text_encoder"][key] == full["text_encoder"][key]


def test_check_refuses_an_unknown_stage(capsys):
    check = _script()
    with pytest.raises(SystemExit):
        check.parse_args(["--stages", "build,compile"])
    assert "compile" in capsys.readouterr().err


@pytest.mark.slow
def test_check_sd15_at_a_tenth_of_the_width(tmp_path):
    """The whole check at scale 0.1, 128x128, 2 steps: every stage ok, the single file's
    graphs byte-identical to the folder's, the base and 4 edits written, the JSON complete."""
    out = tmp_path / "check"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--scale", "0.1", "--size", "128", "--steps", "2"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600,
    )  # fmt: skip
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "check-sd15.json").read_text())

    assert report["ok"] is True
    assert list(report["stages"]) == ["build", "single_file", "convert", "export", "export_converted", "engines", "cpu_engines",
                                       "interactive", "run"]
    for name, stage in report["stages"].items():
        assert stage["ok"] and stage["error"] is None and stage["skipped"] is None, (name, stage)
        assert stage["seconds"] > 0 and stage["peak_rss_bytes"] > 10 * MB, (name, stage)
        assert stage["disk_bytes"] is not None, name
    # the stages run one after another inside the script: their seconds fit in the run's own
    assert sum(stage["seconds"] for stage in report["stages"].values()) <= seconds, (seconds, report["stages"])
    assert report["graphs"]["identical"] is True
    files = report["graphs"]["files"]
    assert {"text_encoder.onnx", "unet_step.onnx", "vae_decoder.onnx"} <= set(files)
    assert all(f["sha256"] == f["sha256_converted"] for f in files.values())

    assert sorted(report["images"]) == ["base.png", "edit_00.png", "edit_01.png", "edit_02.png", "edit_03.png"]
    for name, image in report["images"].items():
        assert (out / "run" / name).is_file() and image["size"] == [128, 128] and image["std"] > 0, name
    edits = report["config"]["edits"]
    assert [bool(e.get("mask")) for e in edits] == [False, True, False, False]
    assert [e.get("preserve") for e in edits] == [None, None, "auto", None]
    assert [e.get("strength") for e in edits] == [None, None, None, 0.5]
    assert report["config"]["engines"] == {"min_batch": 1, "opt_batch": 4, "max_batch": 4}

    params = report["model"]["parameters"]
    assert set(params) == {"unet", "vae", "text_encoder", "total"} and params["unet"] > 10**6
    assert {"cpu_count", "ram_bytes", "platform"} <= set(report["machine"])
    assert {b["name"] for b in report["bars"]} >= {"run peak RSS", "export peak RSS"}
    assert all(b["applies"] is False for b in report["bars"])  # bars hold at SD 1.5's size only
    # without --keep, the models and build/ are gone; the JSON, configs, logs and PNGs stay
    assert not (out / "models").exists() and not (out / "build").exists()
    assert (out / "logs" / "export.log").is_file()
