"""`make demo`'s slider sweeps (issue 36): configs/demo.yaml, as it is, on the embedded model.

`edit-rt export` and `edit-rt run` (the commands make demo runs, in this process) write a sweep
row per slider, scales -2..2, in the one batched tail; the same sweeps asked for through the
Python API (`Editor.edit` with `sweep:`, at scales -2, 0, 2) give the same images, and the grid
lays each sweep on a row of its own (its cells read back from grid.png's pixels).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from .cli_in_process import edit_rt

ROOT = Path(__file__).resolve().parents[1]
SLIDERS = ("saturation", "stroke", "blur")
SCALES = (-2.0, -1.0, 0.0, 1.0, 2.0)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, dict]:
    """configs/demo.yaml with its folders moved into the test's, exported and run by the CLI."""
    tmp = tmp_path_factory.mktemp("demo-sweeps")
    configs = ROOT / "configs"
    cfg = yaml.safe_load((configs / "demo.yaml").read_text())
    cfg["model"] = str((configs / cfg["model"]).resolve())
    cfg["adapters"] = {name: str((configs / path).resolve()) for name, path in cfg["adapters"].items()}
    cfg.update(build_dir=str(tmp / "build"), output_dir=str(tmp / "out"), backend="ort-cpu", threads=2)
    cfg["store"]["disk_dir"] = str(tmp / "bases")
    path = tmp / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    for command in ("export", "run"):
        done = edit_rt(command, str(path))
        assert done.returncode == 0, done.stderr[-2000:]
    return path, json.loads((tmp / "out" / "report.json").read_text())


def _sweep_files(report: dict) -> dict[str, list[dict]]:
    """The report's sweep rows per slider, in order (their labels start "<slider>=<scale>: ")."""
    out: dict[str, list[dict]] = {name: [] for name in SLIDERS}
    for edit in report["edits"]:
        name = edit["label"].split("=", 1)[0]
        if name in out:
            out[name].append(edit)
    return out


def test_the_demo_runs_a_sweep_row_of_each_slider_in_its_one_tail(demo):
    _, report = demo
    sweeps = _sweep_files(report)
    for name, rows in sweeps.items():
        assert [float(r["label"].split("=", 1)[1].split(":", 1)[0]) for r in rows] == list(SCALES), name
        assert {r["tail_steps"] for r in rows} == {12}, name
    # the base's 30 rows, then every edit's tail rows (the sweeps' 15 x 12 among them)
    rows = report["unet_rows"]
    assert rows["base"] == 30 and rows["edit_tails"] == sum(e["tail_steps"] for e in report["edits"])


def test_the_sweeps_equal_the_same_sweeps_through_the_python_api(demo):
    from edit_rt.runtime.apps.editor import Editor

    path, report = demo
    out = path.parent / "out"
    base_prompt = report["base"]["prompt"]
    with Editor.from_config(path) as ed:
        base = ed.generate()  # from the store the run filled: the same base
        assert base.tier is not None
        # each slider's ends and middle (-2, 0, 2: the run's rows 0, 2 and 4), every slider's slot
        # and both signs of its scale; the five-point expansion is the run's (the test above) and
        # model/sweep.py's (test_adapters.py)
        results = ed.edit(base, [{"prompt": base_prompt, "sweep": {"adapter": name, "from": -2.0, "to": 2.0, "n": 3}}
                                 for name in SLIDERS])  # fmt: skip
    assert len(results) == 9
    for k, (name, rows) in enumerate(_sweep_files(report).items()):
        for j, row in enumerate(rows[::2]):
            ours = np.asarray(Image.open(out / row["file"]).convert("RGB"), dtype=int)
            api = results[3 * k + j].array.astype(int)
            # one tail of 26 rows against one of 9: the same rows, batched apart (ONNX Runtime's
            # kernels may sum in another order: at most one level after rounding)
            assert np.abs(ours - api).max() <= 1, (name, SCALES[2 * j])


def test_the_grid_puts_each_sweep_on_a_row_of_its_own(demo):
    path, report = demo
    out = path.parent / "out"
    grid = np.asarray(Image.open(out / "grid.png").convert("RGB"))
    base = np.asarray(Image.open(out / "base.png").convert("RGB"))
    zoom = -(-160 // base.shape[0])  # contact_sheet's cell: at least 160 px, nearest-neighbour
    cell, label_h = base.shape[0] * zoom, 28
    n_plain = len(report["edits"]) - 15
    first_sweep_row = -(-(1 + n_plain) // 4)  # the base and the plain edits, four to a row
    assert grid.shape[1] == 5 * cell  # the widest row: a sweep's five positions
    for k, (name, rows) in enumerate(_sweep_files(report).items()):
        y = (first_sweep_row + k) * (cell + label_h)
        for j, row in enumerate(rows):
            image = np.asarray(Image.open(out / row["file"]).convert("RGB"))
            assert np.array_equal(grid[y : y + cell : zoom, j * cell : (j + 1) * cell : zoom], image), (name, j)
