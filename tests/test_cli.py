"""`edit-rt run` end to end, and every bad input it must refuse cleanly; then every command's
refusals (issue 35: a busy port, click's usage errors, options that are no numbers, a missing
model folder, a config that cannot be read) and Ctrl-C.

A refusal is exit code 2, one line on stderr that names the file/field and the fix, and no
traceback. Commands run in this process as the console script runs them (cli_in_process.py);
a real process only where one matters: the installed ``edit-rt`` script binding a port, a
fresh interpreter's imports, an interrupt.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from safetensors.numpy import load_file, save_file

from .cli_in_process import Ran, edit_rt
from .server_process import ENTRY_POINT, serve_to_its_end
from .step_feeds import count_step_calls

EDITS = [
    {"prompt": "a green circle", "strength": 0.5, "tail_steps": 4},
    {"prompt": "a green circle", "strength": 1.5, "tail_steps": 4},
    {"prompt": "a blue square", "start_step": 2, "guidance": 5.0},
    {"prompt": "a yellow circle", "tail_steps": 5, "mask": {"x": 0, "y": 0, "width": 16, "height": 16}},
    {"prompt": "a red circle", "tail_steps": 3, "seed": 9},
]


def _config(tmp_path: Path, model_dir: Path, onnx_dir: Path, **overrides) -> dict:
    cfg = {
        "model": str(model_dir),
        "build_dir": str(onnx_dir.parent.parent),
        "output_dir": str(tmp_path / "out"),
        "base": {"prompt": "a red circle", "negative_prompt": "blurry", "seed": 5, "steps": 8,
                 "guidance": 7.5, "width": 32, "height": 32},  # fmt: skip
        "edits": EDITS,
    }
    cfg.update(overrides)
    return cfg


def _run(tmp_path: Path, cfg: dict) -> Ran:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return edit_rt("run", str(path))


def test_run_writes_images_grid_and_report(tmp_path, model_dir, onnx_dir):
    result = _run(tmp_path, _config(tmp_path, model_dir, onnx_dir))
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    assert report["files"] == ["base.png"] + [f"edit_{k:02d}.png" for k in range(5)] + ["grid.png"]
    rows = report["unet_rows"]
    assert rows["base"] == 8 and rows["total"] == rows["base"] + rows["edit_tails"]  # a generation: one row a step
    assert rows["regenerating_every_edit"] == 8 * 6 and rows["padding_rows"] == 0
    assert set(report["seconds"]) == {"load", "base_generation", "edit_tail", "decode", "write"}
    params = Image.open(out / "edit_01.png").text["parameters"]
    lines = params.split("\n")
    assert lines[0] == "a green circle" and lines[1] == "Negative prompt: blurry"
    for field in ("Steps: 8", "Sampler: DDIM", "CFG scale: 7.5", "Seed: 5", "Size: 32x32",
                  "Edit strength: 1.5", "Tail steps: 4"):  # fmt: skip
        assert field in lines[2]
    assert Image.open(out / "base.png").size == (32, 32)
    assert Image.open(out / "grid.png").size[0] >= 4 * 128
    assert "regenerating every edit" in result.stdout


def test_report_counts_the_rows_the_step_graph_ran(tmp_path, model_dir, onnx_dir, monkeypatch):
    """report.json's UNet rows against a count taken at the step graph itself: every call's
    rows (its latents' batch) and the rows whose unconditional half it was given."""
    from edit_rt.runtime.apps import run as run_module
    from edit_rt.runtime.config.load import config_from_dict

    calls = count_step_calls(monkeypatch, run_module)
    cfg = _config(tmp_path, model_dir, onnx_dir)
    cfg["edits"] = [*EDITS, {"prompt": "a cat", "structure": 0.5}]  # a reference row rides along
    report = run_module.run_config(config_from_dict(cfg, tmp_path / "config.yaml"))
    rows = report["unet_rows"]
    assert rows["total"] == sum(n for n, _ in calls)
    assert rows["half_rows_skipped"] == sum(e for _, e in calls) > 0
    assert rows["reference_rows"] > 0 and rows["edit_tails"] > sum(8 - s for s in (4, 4, 2, 3, 5))


def test_second_run_takes_the_base_from_the_disk_store(tmp_path, model_dir, onnx_dir):
    store = {"disk_dir": str(tmp_path / "bases"), "ram_mb": 16, "disk_mb": 64}
    cfg = _config(tmp_path, model_dir, onnx_dir, edits=EDITS[:2], store=store)
    assert _run(tmp_path, cfg).returncode == 0
    first = json.loads((tmp_path / "out" / "report.json").read_text())
    edit_png = (tmp_path / "out" / "edit_01.png").read_bytes()
    assert first["base_source"] == "generated" and first["unet_rows"]["base"] == 8
    assert list((tmp_path / "bases" / "bases").glob(f"{first['base_id']}.safetensors"))
    assert _run(tmp_path, cfg).returncode == 0  # a new run makes a new store: only the disk tier remembers
    second = json.loads((tmp_path / "out" / "report.json").read_text())
    assert second["base_source"] == "store (disk)" and second["unet_rows"]["base"] == 0
    assert second["base_id"] == first["base_id"] and second["store"]["hits_disk"] == 1
    assert (tmp_path / "out" / "edit_01.png").read_bytes() == edit_png


def test_run_images_equal_the_pipeline(tmp_path, model_dir, onnx_dir, pipeline):
    """The CLI's PNGs are the pipeline's images (rounded to 8 bits), base included."""
    from edit_rt.runtime.model.edit import Base

    cfg = _config(tmp_path, model_dir, onnx_dir, edits=EDITS[:1])
    assert _run(tmp_path, cfg).returncode == 0
    state = pipeline.generate_base(Base(**cfg["base"]))
    expected = np.round(np.clip(pipeline.decode(state.final_latent)[0], 0, 1) * 255)
    png = np.asarray(Image.open(tmp_path / "out" / "base.png"), dtype=np.float64)
    assert np.abs(png - expected).max() <= 1


def test_runtime_does_not_import_torch(tmp_path, model_dir, onnx_dir):
    """A fresh interpreter (this one has torch loaded): a real process."""
    cfg = _config(tmp_path, model_dir, onnx_dir, edits=EDITS[:1])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code = (
        "import sys; from edit_rt.runtime.config.load import load_config; from edit_rt.runtime.apps.run import run_config;"
        f"run_config(load_config({str(path)!r}));"
        "bad = [m for m in ('torch', 'diffusers', 'transformers', 'onnx', 'polygraphy') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def _refused(result: Ran, *needles: str) -> None:
    """Exit 2 and one ``error:`` line, the last; before it only the progress lines a run prints
    without a terminal ("loading the graphs ...", a stage that failed says no "done")."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: "), result.stderr
    assert all(line.endswith(" ...") or ": done (" in line for line in lines[:-1]), result.stderr
    for needle in needles:
        assert needle in lines[-1], result.stderr


@pytest.mark.parametrize(
    "override,needles",
    [
        ({"edits": [{"prompt": "x", "strenght": 1.0}]}, ["config.yaml", "edits[0].strenght", "unknown key"]),
        ({"colour": "red"}, ["config.yaml", "colour: unknown key"]),
        ({"edits": [{"prompt": "x", "strength": "high"}]}, ["edits[0].strength", "must be a number"]),
        ({"edits": [{"prompt": "x", "start_step": 8}]}, ["edits[0].start_step", "outside the cache window", "[0, 7]"]),
        ({"edits": [{"prompt": "x", "tail_steps": 0}]}, ["edits[0].tail_steps", "must lie in [1, 1000]"]),
        ({"edits": [{"prompt": "x", "tail_steps": 2, "start_step": 2}]}, ["edits[0]", "not both"]),
        ({"cache": {"window_start": 4}, "edits": [{"prompt": "x", "start_step": 2}]}, ["[4, 7]"]),
        ({"edits": [{"prompt": "x", "mask": {"x": 20, "y": 0, "width": 16, "height": 8}}]}, ["edits[0].mask", "leaves"]),
        ({"base": {"prompt": "x", "steps": "ten"}}, ["base.steps", "must be an integer"]),
        ({"base": {"prompt": "x", "width": 30, "height": 32}}, ["base.width", "multiple of 4"]),
        ({"backend": "cuda"}, ["backend", "ort-cpu"]),
        ({"cache": {"default_strength": 9}}, ["cache.default_strength", "[-4, 4]"]),
    ],
)
def test_bad_config_is_refused_with_field_and_fix(tmp_path, model_dir, onnx_dir, override, needles):
    _refused(_run(tmp_path, _config(tmp_path, model_dir, onnx_dir, **override)), *needles)


def test_edits_without_strength_take_the_configured_default(tmp_path, model_dir, onnx_dir):
    from edit_rt.runtime.config.load import config_from_dict
    from edit_rt.runtime.apps.run import tail_rows

    edits = [{"prompt": "x"}, {"prompt": "x", "strength": 0.5}]
    assert [r.strength for r in tail_rows(config_from_dict(_config(tmp_path, model_dir, onnx_dir, edits=edits)))] == [1.0, 0.5]
    cfg = config_from_dict(_config(tmp_path, model_dir, onnx_dir, edits=edits, cache={"default_strength": 1.5}))
    assert [r.strength for r in tail_rows(cfg)] == [1.5, 0.5]


def test_export_refuses_a_size_no_step_row_fits_before_exporting(tmp_path, model_dir):
    """512x512 on the 32x32 test model: self-attention over its 256x256 latents needs hundreds of
    GB for one row on any machine, counted from the model's own configs, so the export is
    refused in one line before it writes anything."""
    cfg = {"model": str(model_dir), "build_dir": str(tmp_path / "build"),
           "base": {"prompt": "x", "steps": 4, "width": 512, "height": 512}}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    result = edit_rt("export", str(tmp_path / "config.yaml"))
    _one_error_line(result, "base.width/height: 512x512 needs about", "for one step row", "the model's own is 32x32",
                    "raise engines.max_memory_gb")  # fmt: skip
    assert not (tmp_path / "build").exists()


def test_missing_model_dir_is_refused(tmp_path, model_dir, onnx_dir):
    result = _run(tmp_path, _config(tmp_path, model_dir, onnx_dir, model=str(tmp_path / "nope")))
    _refused(result, "does not exist", "make model")


def test_missing_artifacts_are_refused(tmp_path, model_dir, onnx_dir):
    result = _run(tmp_path, _config(tmp_path, model_dir, onnx_dir, build_dir=str(tmp_path / "empty")))
    _refused(result, "manifest.json not found", "make export")


def test_artifacts_from_other_weights_are_refused(tmp_path, model_dir, onnx_dir):
    changed = tmp_path / "models" / model_dir.name
    shutil.copytree(model_dir, changed)
    weights = changed / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights)
    result = _run(tmp_path, _config(tmp_path, changed, onnx_dir))
    _refused(result, "exported from other weights", "make export")


def test_corrupt_graph_is_refused(tmp_path, model_dir, onnx_dir):
    build = tmp_path / "build" / model_dir.name / "onnx"
    shutil.copytree(onnx_dir, build)
    (build / "unet_step.onnx").write_bytes(b"not an onnx file")
    result = _run(tmp_path, _config(tmp_path, model_dir, build))
    _refused(result, "unet_step.onnx", "make export")


# --- every refusal of every command: one `error:` line, exit status 2 ----------------------------


def _one_error_line(result: Ran | subprocess.CompletedProcess, *needles: str) -> str:
    """Exactly one line on stderr, ``error: ...``, naming ``needles``; exit status 2."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def no_model_config(tmp_path) -> Path:
    """A valid config whose model folder does not exist (nothing here needs one)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"model": str(tmp_path / "no-model"), "build_dir": str(tmp_path / "build"),
                                    "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32}}))  # fmt: skip
    return path


def test_a_busy_port_is_the_only_line_the_installed_edit_rt_serve_prints(no_model_config):
    """The console script pip installed, as a shell runs it: the listening line comes once the
    port is bound, so a busy port prints no address it never served, and exits 2."""
    import socket

    assert Path(ENTRY_POINT[0]).is_file(), f"{ENTRY_POINT[0]}: edit-rt is not installed (pip install -e .)"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = serve_to_its_end(no_model_config, "--port", str(port), cli=ENTRY_POINT)
    _one_error_line(result, f"serve.port {port} on 127.0.0.1 is in use", "--port")


@pytest.mark.parametrize(
    "args,needles",
    [
        (["run"], ["Missing argument", "edit-rt run --help"]),
        (["run", "{config}", "extra"], ["unexpected extra argument", "edit-rt run --help"]),
        (["bogus"], ["No such command 'bogus'", "edit-rt --help"]),
        (["serve", "{config}", "--port", "abc"], ["--port", "edit-rt serve --help"]),
        (["run", "{config}", "--colour"], ["No such option", "--colour"]),
        (["bench", "{config}", "--repeats", "0"], ["--repeats", "1"]),
        (["quality", "{config}", "--bases", "-3"], ["--bases"]),
    ],
)  # fmt: skip
def test_a_usage_error_is_one_line(no_model_config, args, needles):
    """click's usage errors (a missing argument, an unknown option, a value that is no number)
    keep click's words and exit status 2, in one line that says where the usage is."""
    _one_error_line(edit_rt(*(a.replace("{config}", str(no_model_config)) for a in args)), *needles)


@pytest.mark.parametrize(
    "option,value",
    [("--ns", "abc"), ("--ns", "4,,8"), ("--ns", "0"), ("--fractions", "x"), ("--fractions", "2"), ("--fractions", "nan")],
)
def test_bench_options_that_are_no_numbers_are_one_line(no_model_config, option, value):
    _one_error_line(edit_rt("bench", str(no_model_config), option, value), option, repr(value))


@pytest.mark.parametrize("command", ["run", "bench", "quality"])
def test_a_missing_model_folder_is_one_line(no_model_config, command):
    _one_error_line(edit_rt(command, str(no_model_config)), "no-model does not exist", "make model")


@pytest.mark.parametrize(
    "text,needles",
    [
        (None, ["no such config file"]),
        ("model: [unclosed\n", ["line 2", "fix the YAML"]),
        ("just a string\n", ["must be a mapping"]),
        (b"\xff\xfe", ["not UTF-8"]),
        ("model: x\nmodel: y\n", ["model"]),
    ],
)  # fmt: skip
def test_a_config_that_cannot_be_read_is_one_line(tmp_path, text, needles):
    path = tmp_path / "config.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    _one_error_line(edit_rt("run", str(path)), "config.yaml", *needles)


@pytest.mark.parametrize("command", ["serve", "export", "engines", "adapters", "parity", "bench", "quality", "gates"])
def test_every_command_reads_its_config_the_same_way(tmp_path, command):
    (tmp_path / "config.yaml").write_text("model: [unclosed\n")
    _one_error_line(edit_rt(command, str(tmp_path / "config.yaml")), "config.yaml", "line 2", "fix the YAML")


def test_ctrl_c_ends_the_command_with_status_130_and_no_traceback(tmp_path):
    """An interrupt is the user's own act, not an error: nothing printed, 130 (128 + SIGINT),
    which shells and make read as interrupted. A real process: the signal is delivered to it."""
    # Python's own SIGINT handler, as in a terminal: a job started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then keeps it ignored
    code = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from edit_rt.runtime.apps import cli\n"
            "def interrupted(path):\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(30)\n"
            "cli.load_config = interrupted\n"
            "cli.is_text_config = lambda path: False\n"  # an image config's road
            "sys.argv = ['edit-rt', 'run', 'config.yaml']\n"
            "cli.main()\n")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 130 and result.stderr == "", (result.returncode, result.stderr)


def test_a_model_folder_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("not a folder")
    _one_error_line(edit_rt("model", "--out", str(tmp_path / "taken")), "--out", "taken", "is a file, not a folder")
