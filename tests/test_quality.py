"""`edit-rt quality` at its smallest size on the tiny random model: the report's shape."""

from __future__ import annotations

from edit_rt.export.quality import EDIT_KINDS, edit_of, edited, prompt_following, run_quality
from edit_rt.export.shapes import Scene, prompt
from edit_rt.runtime.model.config import config_from_dict

import numpy as np


def test_edited_changes_exactly_one_attribute():
    rng = np.random.default_rng(0)
    scene = Scene("red", "circle", "blue", "top left")
    for kind in EDIT_KINDS:
        for _ in range(20):
            new = edited(scene, kind, rng)
            changed = [f for f in ("colour", "shape", "background", "position") if getattr(new, f) != getattr(scene, f)]
            assert changed == [kind] and new.colour != new.background


def test_edit_of_replaces_one_word_of_the_base_prompt():
    rng = np.random.default_rng(0)
    intended, seen = Scene("red", "circle", "blue", "top left"), Scene("red", "square", "blue", "top right")
    for kind in EDIT_KINDS:
        for _ in range(10):
            target, text = edit_of(intended, seen, kind, rng)
            old, new = prompt(intended).split(), text.split()
            assert sum(a != b for a, b in zip(old, new)) == 1 and len(old) == len(new)
            assert getattr(target, kind) not in (getattr(seen, kind), getattr(intended, kind))


def test_quality_report_shape(tmp_path, model_dir, onnx_dir):
    cfg = config_from_dict({
        "model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path),
        "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32},
    })  # fmt: skip
    report = run_quality(cfg, bases=2, fractions=(0.25, 0.5), strengths=(1.0, 1.5), default_fraction=0.5, prompts=0,
                         auto_knobs=((0.5, 1, "contrast"),), structures=(0.5,), real_images=1, say=lambda s: None)  # fmt: skip
    assert (tmp_path / "quality.json").is_file() and (tmp_path / "quality.png").is_file()
    settings = {(r["method"], r["tail_fraction"], r["strength"]) for r in report["rows"]}
    assert settings == {("edit-rt", 0.25, 1.0), ("edit-rt", 0.5, 1.0), ("edit-rt", 0.5, 1.5), ("img2img", 0.25, 1.0),
                        ("img2img", 0.5, 1.0), ("auto t0.5 d1 contrast", 0.5, 1.0), ("p2p", 0.5, 1.0),
                        ("structure 0.5", 0.5, 1.0), ("structure 0.5", 0.6, 1.0),
                        ("edit-rt (real)", 0.5, 1.0), ("img2img (real)", 0.5, 1.0)}  # fmt: skip
    generated = [r for r in report["rows"] if "(real)" not in r["method"]]
    assert len({r["n"] for r in generated}) == 1  # every setting scored once per edit
    assert {r["n"] for r in report["rows"] if "(real)" in r["method"]} == {1}
    for row in report["rows"]:
        assert 0 <= row["success"] <= 1 and 0 <= row["preservation"] <= 1 and 0 <= row["untouched_psnr"] <= 60
        assert (row["silhouette_iou"] is None) == (row["kind"] == "shape")
    accuracy = prompt_following(cfg, n=2)
    assert set(accuracy) == {"colour", "shape", "background", "position", "all"}


def test_p2p_source_branch_retraces_the_base_tail(pipeline, base_state, torch_components):
    """The baseline's source branch is the base's own tail: an edit to the same prompt returns
    the base's final latent (PyTorch against the exported graphs: fp32 noise)."""
    from edit_rt.export.p2p import p2p_tail

    unet, text_encoder, _, tokenizer, scheduler = torch_components
    latent = p2p_tail(unet, text_encoder, tokenizer, scheduler, base_state, base_state.base.prompt, 5)
    np.testing.assert_allclose(latent, base_state.final_latent[0], atol=1e-3, rtol=1e-3)
