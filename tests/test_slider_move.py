"""A slider move costs its tail (issue 37, item 4): a prompt encoded once is kept (LRU within a
byte budget), so a new strength of the same edit mixes K/V with no text encoding, and gives the
same numbers as a fresh encoding.

The move as the bench measures it (export/bench/slider_move.py, issue 51 item 7) returns the image
`edit-rt run` writes for the same edit, in process and through the server, and its physical limit
is the UNet rows counted at the step graph itself x one row's GFLOP over the machine's GFLOP/s."""

from __future__ import annotations


import numpy as np
import pytest
import yaml
from PIL import Image

from edit_rt.runtime.model.edit import TailRow

from .conftest import TEST_BASE
from .step_feeds import count_step_calls


def _counting(pipeline, monkeypatch) -> list:
    calls: list = []
    real = pipeline.kv_from_prompts

    def counted(prompts, *args, **kwargs):
        calls.append(list(prompts))
        return real(prompts, *args, **kwargs)

    monkeypatch.setattr(pipeline, "kv_from_prompts", counted)
    return calls


def test_a_new_strength_reuses_the_encoded_prompt(pipeline, base_state, monkeypatch):
    calls = _counting(pipeline, monkeypatch)
    prompt = "a yellow triangle on a blue background"
    pipeline.resolver.encoded.clear()
    pipeline.run_tail(base_state, [TailRow(prompt, 1.0, 5, TEST_BASE.guidance)])
    assert calls == [[prompt]]
    moved = pipeline.run_tail(base_state, [TailRow(prompt, 0.6, 5, TEST_BASE.guidance)])
    assert calls == [[prompt]]  # the move: a K/V mix and the tail, no encoding
    pipeline.resolver.encoded.clear()
    fresh = pipeline.run_tail(base_state, [TailRow(prompt, 0.6, 5, TEST_BASE.guidance)])
    assert calls == [[prompt], [prompt]]
    np.testing.assert_array_equal(moved, fresh)


def test_the_kept_encodings_stay_within_their_budget(pipeline, base_state, monkeypatch):
    resolver = pipeline.resolver
    resolver.encoded.clear()
    resolver.encoded_bytes = 0
    prompts = [f"a red circle, edit {i}" for i in range(5)]
    pipeline.run_tail(base_state, [TailRow(prompts[0], 1.0, 8, TEST_BASE.guidance)])
    one = resolver.encoded_bytes
    monkeypatch.setattr(resolver, "encoded_limit", 3 * one)
    pipeline.run_tail(base_state, [TailRow(p, 1.0, 8, TEST_BASE.guidance) for p in prompts[1:]])
    assert resolver.encoded_bytes == sum(kv.nbytes for kv in resolver.encoded.values()) == 3 * one
    assert [key[0] for key in resolver.encoded] == prompts[2:]  # the least recently used went first


# --- the bench's measured move (export/bench/slider_move.py) ---------------------------------------

MOVE_EDIT = "a blue square on a blue background"
GFLOP, LIMIT, REPEATS = 0.25, 40.0, 2  # a row's GFLOP and the machine's GFLOP/s, as the probe gives them


@pytest.fixture(scope="module")
def moves_config(taesd_dir, taesd_onnx_dir, tmp_path_factory):
    """The session's tiny model with a random tiny decoder (TAESD's architecture, 16 channels) in
    its ``vae_tiny/``, exported (conftest.py); a config of it whose first edit is the moved one."""
    root = tmp_path_factory.mktemp("moves")
    base = {k: getattr(TEST_BASE, k) for k in ("prompt", "negative_prompt", "seed", "steps", "guidance", "width", "height")}
    cfg = {"model": str(taesd_dir), "build_dir": str(taesd_onnx_dir.parents[1]), "output_dir": str(root / "out"), "threads": 2,
           "base": base, "edits": [{"prompt": MOVE_EDIT}]}  # fmt: skip
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    return root / "config.yaml"


@pytest.fixture(scope="module")
def measured(moves_config, tmp_path_factory):
    """ort-cpu's moves, in this process, and the UNet rows of each edit call as the step graph ran
    them (its latents' batch, less the rows whose unconditional half it was given)."""
    from edit_rt.export.bench import slider_move
    from edit_rt.runtime.config.load import load_config

    folder = tmp_path_factory.mktemp("measured")
    edits: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        calls = count_step_calls(patch, slider_move)
        spied = slider_move.pipeline_of

        def per_edit(cfg, **overrides):
            pipe = spied(cfg, **overrides)
            edit = pipe.edit

            def counted(*args, **kwargs):
                start = len(calls)
                results = edit(*args, **kwargs)
                edits.append(sum(2 * n - e for n, e in calls[start:]))
                return results

            pipe.edit = counted
            return pipe

        patch.setattr(slider_move, "pipeline_of", per_edit)
        report = slider_move.engine_moves(load_config(moves_config), "ort-cpu", "fp32", 2, folder / "bases", REPEATS,
                                          GFLOP, LIMIT, server=True, images=folder / "images")  # fmt: skip
    return report, edits, folder / "images"


@pytest.mark.parametrize("case", ["default", "few_step"])
def test_a_measured_move_is_the_image_edit_rt_run_writes(measured, moves_config, case, tmp_path):
    """The last move's PNG against `edit-rt run`'s for the same base and edit at that strength;
    the few-step move through the server too (its base generated by the server, from the seed)."""
    from edit_rt.export.bench.slider_move import CASES
    from edit_rt.runtime.apps.run import run_config
    from edit_rt.runtime.config.load import config_from_dict

    report, _, images = measured
    moved, schedule = report["cases"][case], CASES[case]
    assert moved["decoder"] == schedule.decoder  # the export has a tiny decoder: few_step runs it
    cfg = yaml.safe_load(moves_config.read_text())
    cfg["base"].update(sampler=schedule.sampler, steps=schedule.steps, guidance=schedule.guidance)
    cfg.update(output_dir=str(tmp_path), decoder=moved["decoder"],
               edits=[{"prompt": MOVE_EDIT, "strength": moved["strengths"][-1], "tail_steps": schedule.tail_steps}])
    run_config(config_from_dict(cfg))
    written = np.asarray(Image.open(tmp_path / "edit_00.png").convert("RGB"))
    for name in [case] + (["server"] if case == "few_step" else []):
        assert report["cases"][name]["strengths"] == moved["strengths"]
        np.testing.assert_array_equal(np.asarray(Image.open(images / f"ort-cpu-{name}.png").convert("RGB")), written)
    assert np.abs(written.astype(int) - np.asarray(Image.open(tmp_path / "base.png").convert("RGB"))).max() > 0  # it moved


def test_a_moves_limit_is_its_counted_rows_at_the_machines_rate(measured):
    """Each case's UNet rows are the rows the step graph ran (counted at the graph, not assumed),
    and the move over its limit is its seconds over those rows' GFLOP at the machine's GFLOP/s."""
    from edit_rt.export.bench.interactive import slider_move_keys

    report, edits, _ = measured
    default, few = report["cases"]["default"], report["cases"]["few_step"]
    # each case: a warm-up move, then the timed ones (in CASES' order)
    assert edits == [default["warm_unet_rows"], *default["unet_rows_runs"], few["warm_unet_rows"], *few["unet_rows_runs"]]
    assert default["unet_rows"] == 2 * 6 - 1  # 6 guided steps, both halves, but the entry's u: the base's
    assert report["cases"]["server"]["unet_rows"] == few["unet_rows"]  # the server's /metrics count the same rows
    for case in report["cases"].values():
        assert len(case["runs"]) == len(set(case["strengths"])) == REPEATS
        assert case["over_limit"] == pytest.approx(case["seconds"] / (case["unet_rows"] * GFLOP / LIMIT))
    keys = slider_move_keys({"engines": {"ort-cpu": report}, "default_engine": "ort-cpu"})
    assert keys["few_step_move_over_limit"] == pytest.approx(few["seconds"] / (edits[-1] * GFLOP / LIMIT))
    assert keys["few_step_move_seconds"] == few["seconds"] and keys["default_move_seconds"] == default["seconds"]
