"""`edit-rt quality` at its smallest size on the tiny random model: the report's shape."""

from __future__ import annotations

from edit_rt.export.quality import EDIT_KINDS, edited, prompt_following, run_quality
from edit_rt.export.shapes import Scene
from edit_rt.runtime.config import config_from_dict

import numpy as np


def test_edited_changes_exactly_one_attribute():
    rng = np.random.default_rng(0)
    scene = Scene("red", "circle", "blue", "top left")
    for kind in EDIT_KINDS:
        for _ in range(20):
            new = edited(scene, kind, rng)
            changed = [f for f in ("colour", "shape", "background", "position") if getattr(new, f) != getattr(scene, f)]
            assert changed == [kind] and new.colour != new.background


def test_quality_report_shape(tmp_path, model_dir, onnx_dir):
    cfg = config_from_dict({
        "model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path),
        "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32},
    })  # fmt: skip
    report = run_quality(cfg, bases=2, fractions=(0.25, 0.5), strengths=(1.0, 1.5), default_fraction=0.5, prompts=0,
                         say=lambda s: None)  # fmt: skip
    assert (tmp_path / "quality.json").is_file()
    settings = {(r["method"], r["tail_fraction"], r["strength"]) for r in report["rows"]}
    assert settings == {("edit-rt", 0.25, 1.0), ("edit-rt", 0.5, 1.0), ("edit-rt", 0.5, 1.5), ("img2img", 0.25, 1.0), ("img2img", 0.5, 1.0)}
    assert len({r["n"] for r in report["rows"]}) == 1  # every setting scored once per edit
    for row in report["rows"]:
        assert row["method"] in ("edit-rt", "img2img") and 0 <= row["success"] <= 1 and 0 <= row["preservation"] <= 1
    accuracy = prompt_following(cfg, n=2)
    assert set(accuracy) == {"colour", "shape", "background", "position", "all"}
