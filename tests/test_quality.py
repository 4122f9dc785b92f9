"""`edit-rt quality` at its smallest size on the tiny random model: the report's shape."""

from __future__ import annotations

import dataclasses

from edit_rt.export.eval.judges import KINDS, World1, World2
from edit_rt.export.eval.quality import prompt_following, run_quality
from edit_rt.export.world.shapes import Scene, Thing, canonical, prompt, random_scene, read, render
from edit_rt.runtime.config.load import config_from_dict

import numpy as np


def test_edits_change_exactly_one_attribute_and_one_word():
    rng = np.random.default_rng(0)
    intended, seen = Scene("red", "circle", "blue", "top left"), Scene("red", "square", "blue", "top right")
    for _ in range(20):
        edits = World1().edits(intended, seen, rng)
        assert list(edits) == list(KINDS)
        for kind, (target, text) in edits.items():
            changed = [f for f in ("colour", "shape", "background", "position") if getattr(target, f) != getattr(seen, f)]
            assert changed == [kind] and target.colour != target.background
            assert getattr(target, kind) != getattr(intended, kind)
            old, new = prompt(intended).split(), text.split()
            assert sum(a != b for a, b in zip(old, new)) == 1 and len(old) == len(new)


def _edited_render(judge, scene: Scene, kind: str, value: str, seed: int) -> np.ndarray:
    return render(dataclasses.replace(scene, **{kind: value}), None, np.random.default_rng(seed)).astype(np.float32) / 255


def test_judges_score_exact_edits_of_renders_as_done_and_the_rest_kept():
    """A render of the edited scene (same jitter) is the perfect edit: success, everything else
    preserved, the untouched region and the other object identical; the base itself as the
    "edit" keeps everything and succeeds at nothing. Ground truth: the renders' own scenes."""
    for judge in (World1(), World2()):
        rng = np.random.default_rng(4)
        for j in range(40):
            scene = judge.scene(rng)
            base = render(scene, None, np.random.default_rng(j)).astype(np.float32) / 255
            seen = judge.base_reading(base, scene)
            if not judge.follow(base, scene)["all"]:
                assert judge.world == 1  # world 1's reader is 99%, world 2's exact (test_shapes.py)
                continue
            for kind, (target, text) in judge.edits(scene, seen, rng).items():
                field = kind.split(",")[0]
                value = target[field] if isinstance(target, dict) else getattr(target, field)
                assert text == prompt(dataclasses.replace(scene, **{field: value}))
                done = judge.score(_edited_render(judge, scene, field, value, j), base, seen, target, kind)
                assert done.success and done.preserved and not done.changed, (scene, kind, done)
                assert (done.iou is None) == (field == "shape")
                # world 1's region is "far from the background" (60 levels): the faint edge pixels
                # of the edited shape count as untouched and its silhouette moves with the colours;
                # world 2's objects carry their edge ring
                if judge.world == 2:
                    assert done.psnr >= 35 and (done.iou is None or done.iou >= 0.9), (scene, kind, done)
                if judge.world == 2 and scene.other is not None and field != "background":
                    assert done.other_kept and done.other_psnr >= 59
                same = judge.score(base, base, seen, target, kind)
                assert not same.success and same.preserved and same.psnr == 60


def test_world2_judge_matches_objects_by_place_and_finds_what_changed():
    judge = World2()
    scene = Scene("red", "circle", "yellow", "left of", "large", Thing("blue", "square", "small"))
    base = render(scene).astype(np.float32) / 255
    seen = judge.base_reading(base, scene)
    # the edit moved the other object's colour too: not preserved, the other not kept
    both = render(dataclasses.replace(scene, colour="green", other=Thing("white", "square", "small"))).astype(np.float32) / 255
    target = {**seen.fields(), "colour": "green"}
    score = judge.score(both, base, seen, target, "colour, 2 objects")
    assert score.success and not score.preserved and score.changed == ["other_colour"] and not score.other_kept
    # the objects swapped places: each place's object changed colour, kind and size
    swapped = render(Scene("blue", "square", "yellow", "left of", "small", Thing("red", "circle", "large"))).astype(np.float32) / 255
    assert not judge.score(swapped, base, seen, target, "colour, 2 objects").preserved
    # prompt following finds objects by colour: the same two objects, their relation wrong
    f = judge.follow(swapped, scene)
    assert f["colours_and_background"] and f["shape"] and f["size"] and f["second_object"]
    assert not f["position"] and not f["all"]
    assert canonical(scene) == read(render(scene), world=2) and random_scene(np.random.default_rng(0), 2).size is not None


def test_quality_report_shape(tmp_path, model_dir, onnx_dir):
    cfg = config_from_dict({
        "model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path),
        "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32},
    })  # fmt: skip
    report = run_quality(cfg, bases=1, fractions=(0.25, 0.5), strengths=(1.0, 1.5), default_fraction=0.5, prompts=0,
                         auto_knobs=((0.5, 1, "contrast"),), structures=(0.5,), real_images=1, say=lambda s: None)  # fmt: skip
    assert (tmp_path / "quality.json").is_file() and (tmp_path / "quality.png").is_file()
    settings = {(r["method"], r["tail_fraction"], r["strength"]) for r in report["rows"]}
    assert settings == {("edit-rt", 0.25, 1.0), ("edit-rt", 0.5, 1.0), ("edit-rt", 0.5, 1.5), ("img2img", 0.25, 1.0),
                        ("img2img", 0.5, 1.0), ("auto t0.5 d1 contrast", 0.5, 1.0), ("p2p", 0.5, 1.0),
                        ("structure 0.5", 0.5, 1.0), ("structure 0.5", 0.6, 1.0),
                        ("edit-rt (real)", 0.5, 1.0), ("img2img (real)", 0.5, 1.0),
                        *((m, f, s) for m in ("uncond base", "uncond base-corrected", "deepcache 2", "deepcache 3")
                          for f, s in ((0.25, 1.0), (0.5, 1.0), (0.5, 1.5)))}  # tail.uncond, tail.deepcache: each edit-rt setting  # fmt: skip
    generated = [r for r in report["rows"] if "(real)" not in r["method"]]
    assert len({r["n"] for r in generated}) == 1  # every setting scored once per edit
    assert {r["n"] for r in report["rows"] if "(real)" in r["method"]} == {1}
    for row in report["rows"]:
        assert 0 <= row["success"] <= 1 and 0 <= row["preservation"] <= 1 and 0 <= row["untouched_psnr"] <= 60
        assert (row["silhouette_iou"] is None) == (row["kind"] == "shape")
    assert report["world"] == 1 and report["kinds"] == list(KINDS)
    # every edit-rt setting's colour and background edits judged against the targets
    judged = {(t["method"], t["kind"]) for t in report["targets"]}
    assert ("edit-rt", "colour") in judged and ("edit-rt", "background") in judged and not any(m == "img2img" for m, _ in judged)
    for t in report["targets"]:
        assert t["all_met"] == all(c["met"] for c in t["checks"].values())
        assert {"success", "preservation", "over_img2img"} <= set(t["checks"])
    accuracy = prompt_following(cfg, n=2)
    assert set(accuracy) == {"colour", "shape", "background", "position", "all"}


def test_p2p_source_branch_retraces_the_base_tail(pipeline, base_state, torch_components):
    """The baseline's source branch is the base's own tail: an edit to the same prompt returns
    the base's final latent (PyTorch against the exported graphs: fp32 noise)."""
    from edit_rt.export.eval.p2p import p2p_tail

    unet, text_encoder, _, tokenizer, scheduler = torch_components
    latent = p2p_tail(unet, text_encoder, tokenizer, scheduler, base_state, base_state.base.prompt, 5)
    np.testing.assert_allclose(latent, base_state.final_latent[0], atol=1e-3, rtol=1e-3)


def test_gates_report(tmp_path, model_dir, onnx_dir):
    from edit_rt.export.eval.gates import GOALS, run_gates

    cfg = config_from_dict({
        "model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path),
        "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32},
    })  # fmt: skip
    report = run_gates(cfg, prompts=3, bases=2, out=tmp_path, say=lambda s: None)
    assert (tmp_path / "gates.json").is_file() and report["world"] == 1
    assert set(report["gates"]) == set(GOALS)
    for name, gate in report["gates"].items():
        assert gate["goal"] == GOALS[name]
        assert gate["met"] == (gate["measured"] is not None and gate["measured"] >= gate["goal"])
    # the random model draws no readable shape: its prompt following is measured, and low
    assert report["gates"]["colours_and_background"]["measured"] < 0.98 and not report["gates"]["shape"]["met"]


def test_targets_are_judged_against_img2img_at_the_same_tail():
    from edit_rt.export.eval.targets import judge_targets

    def row(method, kind, f, both, **extra):
        return {"method": method, "kind": kind, "tail_fraction": f, "strength": 1.0, "n": 50, "success": 0.96,
                "preservation": 0.97, "success_and_preserved": both, "untouched_psnr": 36.0, "silhouette_iou": 0.96, **extra}

    report = {"rows": [
        row("edit-rt", "colour", 0.4, 0.93), row("img2img", "colour", 0.4, 0.70), row("img2img", "colour", 0.2, 0.50),
        row("edit-rt", "colour", 0.2, 0.69), row("p2p", "colour", 0.4, 0.95),
        row("edit-rt", "shape, 2 objects", 0.4, 0.5, other_kept=0.96, other_psnr=34.0),
    ]}  # fmt: skip
    t = {(x["kind"], x["tail_fraction"]): x for x in judge_targets(report)}
    assert set(t) == {("colour", 0.4), ("colour", 0.2), ("shape, 2 objects", 0.4)}
    at4 = t["colour", 0.4]["checks"]
    assert at4["over_img2img"]["met"] and abs(at4["over_img2img"]["value"] - 0.23) < 1e-9
    assert not at4["over_p2p"]["met"] and not t["colour", 0.4]["all_met"]  # 0.93 < p2p's 0.95
    assert not t["colour", 0.2]["checks"]["over_img2img"]["met"] and "over_p2p" not in t["colour", 0.2]["checks"]
    two = t["shape, 2 objects", 0.4]["checks"]
    assert set(two) == {"other_psnr", "other_kept"} and two["other_kept"]["met"] and not two["other_psnr"]["met"]
