"""``tail.uncond`` (issue 37, item 1): an edit tail that takes its base's unconditional
prediction at every step, each mode against an independent reference.

- ``compute`` is today's tail (the default; the rest of the suite holds it to diffusers);
- ``base`` and ``base-corrected`` equal diffusers' UNet and DDIM stepping the same tail with
  ``u = u_b + k (x_e - x_b)`` (k = 0, or sqrt(1 - alpha-bar): runtime/loop/uncond_reuse.py),
  ``u_b`` and ``x_b`` the base's stored predictions and latents, the conditional half the
  edit prompt's (diffusers' own text encoding);
- on an identity edit both reproduce the base, with the rows' unconditional halves skipped;
- rows that differ from their base in guidance or seed compute (the base's u is not theirs);
- a bad mode is refused naming the field.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from edit_rt.runtime.config.load import load_config
from edit_rt.runtime.errors import ConfigError
from edit_rt.runtime.model.edit import Edit, TailRow

from .conftest import TEST_BASE

EDIT = "a green circle on a blue background"  # the base prompt's tokens, one word changed
ATOL = 1e-5  # fp32, ONNX Runtime's batched rows against its own (test_pipeline's BATCH_ATOL)
# ONNX Runtime against torch over <= 6 steps: this random model's latents reach |x| ~ 20, and fp32
# sums in another order differ by ~1e-6 of that per step (a wrong slope is off by > 1e-2)
REFERENCE_ATOL = 5e-5


def _reference_tail(pipe, state, prompt: str, start: int, slope) -> np.ndarray:
    """diffusers' UNet (conditional half only) and DDIMScheduler from x_b(start), the
    unconditional prediction ``u_b(i) + slope(a) (x - x_b(i))`` from the base's stored ones."""
    with torch.no_grad():
        cond, _ = pipe.encode_prompt(prompt, "cpu", 1, True, TEST_BASE.negative_prompt)
        pipe.scheduler.set_timesteps(TEST_BASE.steps)
        x = torch.from_numpy(state.latent(start).copy())
        for i in range(start, TEST_BASE.steps):
            t = pipe.scheduler.timesteps[i]
            a = float(pipe.scheduler.alphas_cumprod[int(t)])
            c = pipe.unet(x, t, encoder_hidden_states=cond).sample
            u = torch.from_numpy(state.entry_uncond(i)[None]) + slope(a) * (x - torch.from_numpy(state.latent(i)))
            x = pipe.scheduler.step(u + TEST_BASE.guidance * (c - u), t, x, eta=0.0).prev_sample
    return x[0].numpy()


SLOPES = {"base": lambda a: 0.0, "base-corrected": lambda a: float(np.sqrt(1.0 - a))}


@pytest.mark.parametrize("mode", ["base", "base-corrected"])
def test_a_tail_on_the_bases_uncond_equals_diffusers_fed_it(pipeline, base_state, diffusers_pipe, mode):
    """Three rows: one computes (another prompt, compute), two take the base's u at every step
    (the call's last two rows: the step graph skips their unconditional halves)."""
    g = TEST_BASE.guidance
    rows = [TailRow("a yellow square", 1.0, 4, g), TailRow(EDIT, 1.0, 4, g, uncond=mode),
            TailRow(EDIT, 1.0, 6, g, uncond=mode)]  # fmt: skip
    scheduler = pipeline.batcher(base_state.latents.shape[1:]).scheduler
    before = scheduler.stats.uncond_rows_skipped
    finals = pipeline.run_tail(base_state, rows)
    # steps 4, 5: one given row (the other is at its entry: compute mode's entry reuse is off while
    # always-given rows are placed); steps 6..9: two given rows
    assert scheduler.stats.uncond_rows_skipped - before == 2 * 1 + 4 * 2
    for row, final in zip(rows[1:], finals[1:]):
        expected = _reference_tail(diffusers_pipe, base_state, EDIT, row.start_step, SLOPES[mode])
        np.testing.assert_allclose(final, expected, rtol=1e-5, atol=REFERENCE_ATOL)
    (computed,) = pipeline.run_tail(base_state, [TailRow(EDIT, 1.0, 4, g)])
    np.testing.assert_allclose(finals[0], pipeline.run_tail(base_state, [rows[0]])[0], atol=ATOL)
    # the base's u is an approximation: the edit's own differs from it, and the two modes differ
    assert np.abs(finals[1] - computed).max() > 1e-2
    other = "base" if mode == "base-corrected" else "base-corrected"
    assert np.abs(finals[1] - _reference_tail(diffusers_pipe, base_state, EDIT, 4, SLOPES[other])).max() > 1e-2


@pytest.mark.parametrize("mode", ["base", "base-corrected"])
def test_an_identity_edit_on_the_bases_uncond_reproduces_the_base(pipeline, base_state, mode):
    """``base``: as exactly as batched rows agree; ``base-corrected``: the host folds ``u_b - k x_b``
    (|k x_b| ~ 20 here) and the graph adds ``k x_e`` back, so fp32 rounding of ~1e-6 relative
    enters each step and guidance 7.5 scales it by 6.5."""
    rows = [TailRow(TEST_BASE.prompt, 1.0, s, TEST_BASE.guidance, uncond=mode) for s in (3, 3, 5)]
    rtol, atol = (0.0, ATOL) if mode == "base" else (1e-5, REFERENCE_ATOL)
    for final in pipeline.run_tail(base_state, rows):
        np.testing.assert_allclose(final, base_state.final_latent[0], rtol=rtol, atol=atol)


def test_rows_unlike_their_base_compute_their_uncond(pipeline, base_state):
    """Another guidance or a seed: the base's chain is not theirs, so they run as compute."""
    g = TEST_BASE.guidance
    for change in ({"guidance": 3.0}, {"seed": 5}):
        rows = [dataclasses.replace(TailRow(EDIT, 1.0, 5, g), **change, uncond=u) for u in ("compute", "base")]
        computed, based = pipeline.run_tail(base_state, rows)
        np.testing.assert_allclose(based, computed, atol=ATOL)


def test_report_and_png_say_which_mode_ran(tmp_path, model_dir, onnx_dir):
    from PIL import Image

    from edit_rt.runtime.apps.run import run_config

    text = (f"model: {model_dir}\nbuild_dir: {onnx_dir.parents[1]}\noutput_dir: {tmp_path / 'out'}\n"
            f"base: {{prompt: {TEST_BASE.prompt}, seed: 3, steps: 10, width: 32, height: 32}}\n"
            f"tail: {{uncond: base-corrected}}\n"
            f"edits:\n  - {{prompt: {EDIT}}}\n  - {{prompt: {EDIT}, uncond: compute}}\n"
            f"  - {{prompt: {EDIT}, guidance: 3}}\n")  # fmt: skip
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(text)
    run_config(load_config(cfg_path))
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [e["uncond"] for e in report["edits"]] == ["base-corrected", "compute", "compute"]
    parameters = [Image.open(tmp_path / "out" / f"edit_0{k}.png").text["parameters"] for k in range(3)]
    assert "Tail uncond: base-corrected" in parameters[0]
    assert "Tail uncond" not in parameters[1] and "Tail uncond" not in parameters[2]


@pytest.mark.parametrize("where,text", [("tail.uncond", "tail: {uncond: exact}\n"),
                                        ("edits[0].uncond", "edits:\n  - {prompt: a cat, uncond: reuse}\n")])
def test_a_bad_mode_is_refused_naming_the_field(tmp_path, where, text):
    cfg_path = tmp_path / "bad.yaml"
    cfg_path.write_text("model: some/model\nbase: {prompt: a cat}\n" + text)
    with pytest.raises(ConfigError) as err:
        load_config(cfg_path)
    message = str(err.value)
    assert where in message and "compute" in message and "base-corrected" in message, message


def test_the_edit_field_takes_each_mode():
    for mode in ("compute", "base", "base-corrected"):
        assert Edit(prompt="a cat", uncond=mode).uncond == mode


def _check_slots(scheduler) -> None:
    """Each active row in its slot, the always-given rows last, and its slot holding its K/V."""
    active, p = scheduler.active, scheduler.persistent
    assert [row.slot for row in active] == list(range(len(active)))
    assert [row.given is not None for row in active] == [False] * (len(active) - p) + [True] * p
    name = scheduler.row_kv[0]
    elems = scheduler.row_elems[name]
    for r, row in enumerate(active):
        held = scheduler.dev[name].array[r * elems : (r + 1) * elems]
        np.testing.assert_array_equal(held, np.asarray(row.kv[0], dtype=held.dtype).ravel())


def test_rows_join_and_leave_around_the_always_given_ones(pipeline, base_state):
    """Computing rows join while base rows run (each takes the first one's slot, which moves to
    the end) and leave (a cancelled request) from between them: every row keeps its own slot's
    contents and the given rows stay last, step after step; the rest finish."""
    from edit_rt.runtime.loop.jobs import Job, Request

    g, T = TEST_BASE.guidance, TEST_BASE.steps
    batcher = pipeline.batcher(base_state.latents.shape[1:])
    scheduler = batcher.scheduler

    def submit(name: str, rows: list) -> tuple:
        request = Request(name, decode=False)
        jobs = [Job(request, i, TEST_BASE, row, state=base_state) for i, row in enumerate(rows)]
        batcher.submit(request, jobs)
        return request, jobs

    _, based = submit("based", [TailRow(p, 1.0, 2, g, uncond="base-corrected") for p in ("a cat", "a dog", EDIT)])
    batcher.work_once()
    _check_slots(scheduler)
    cancelled, _ = submit("computing", [TailRow(p, 1.0, 3, g) for p in ("a blue square", "a green circle")])
    _, later = submit("later", [TailRow(EDIT, 1.0, 3, g, uncond="base"), TailRow("a yellow square", 1.0, 3, g)])
    batcher.work_once()
    _check_slots(scheduler)
    assert scheduler.persistent == 4 and len(scheduler.active) == 7
    cancelled.cancelled.set()
    batcher.work_once()
    _check_slots(scheduler)
    assert scheduler.persistent == 4 and len(scheduler.active) == 5
    while not all(job.future.done() for job in based + later):
        batcher.work_once()
        _check_slots(scheduler)
    assert all(job.future.exception() is None for job in based + later)
    assert not scheduler.active and scheduler.persistent == 0
