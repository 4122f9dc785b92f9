"""Rows with guidance off (issue 51, item 3): a row at guidance <= 1 is the conditional
prediction alone, as in diffusers, and the UNet runs its conditional half only.

- a generation at guidance 1 and 0.5 equals diffusers' pipeline at that guidance (which skips
  classifier-free guidance at <= 1);
- an unguided row equals the same row computed with both halves (``skip_unguided`` off);
- guided and unguided rows batched in one call equal each run alone;
- the UNet rows the step graph was fed (its ``deep_out`` output holds one row of features per
  UNet row, read from the bindings) are one per unguided row-step, and the counters say so: a
  call whose every row is unguided is given every row's unconditional prediction
  (``uncond_given``'s batch is the latents') and runs no unconditional UNet row, on ONNX Runtime,
  OpenVINO's static shapes and the simulated GPU's plans (a bucket's padding given too);
- an export without ``step_all_given`` (its manifest made before the step graph took E = N), and
  TensorRT plans built for one, keep one row of each call computing its half, with the same
  images;
- a guided edit of an unguided base computes its own unconditional prediction (the base kept
  none, not zeros).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from edit_rt.runtime.model.edit import Mask, TailRow

from .conftest import TEST_BASE
from .step_feeds import count_step_calls
from .test_gpu_rules import PROFILE, _trt, trt_dirs  # noqa: F401 (the simulated GPU's fixtures; gpu is conftest's)

EDIT = "a green circle on a blue background"
ATOL = 1e-5  # fp32, ONNX Runtime's batched rows against its own (test_pipeline's BATCH_ATOL)
REFERENCE_ATOL = 5e-5  # ONNX Runtime against torch over <= 6 steps (test_uncond_reuse's)


class FedRows:
    """The step graph's binds, wrapped: each run adds the UNet rows its ``deep_out`` output holds
    (the features of every UNet row, ``[uncond rows; cond rows]``), the rows its latents hold and
    the rows whose unconditional prediction it was given (``uncond_given``'s)."""

    def __init__(self, graph, sig):
        self.graph, self.deep_out, self.latents, self.uncond_given = graph, sig.deep_out, sig.latents, sig.entry_uncond
        self.unet_rows = self.rows = self.given = self.calls = 0

    def __getattr__(self, name):
        return getattr(self.graph, name)

    def bind(self, inputs, outputs):
        binding = self.graph.bind(inputs, outputs)
        unet_rows, rows, given = (outputs[self.deep_out].shape[0], inputs[self.latents].shape[0],
                                  inputs[self.uncond_given].shape[0])  # fmt: skip
        fed = self

        class Counted:
            def run(self) -> None:
                binding.run()
                fed.unet_rows += unet_rows
                fed.rows += rows
                fed.given += given
                fed.calls += 1

            def free(self) -> None:
                binding.free()

        return Counted()


def fed_rows(pipe, latent_shape, monkeypatch) -> FedRows:
    """Count what ``pipe``'s step graph is fed for latents of ``latent_shape`` while the test runs."""
    scheduler = pipe.batcher(latent_shape).scheduler
    scheduler.bindings.free()  # every binding made from here on is counted
    counter = FedRows(scheduler.graph, scheduler.sig)
    monkeypatch.setattr(scheduler, "graph", counter)
    return counter


@pytest.fixture
def fed(pipeline, base_state, monkeypatch):
    yield fed_rows(pipeline, base_state.latents.shape[1:], monkeypatch)
    pipeline.batcher(base_state.latents.shape[1:]).scheduler.bindings.free()


@pytest.mark.parametrize("guidance", [1.0, 0.5])
def test_an_unguided_generation_equals_diffusers_at_that_guidance(pipeline, model_dir, diffusers_reference, fed, guidance):
    base = dataclasses.replace(TEST_BASE, guidance=guidance)
    noise = pipeline.initial_noise(base)
    state = pipeline.generate_base(base, noise=noise)
    # its one row is given its unconditional prediction at every step: the UNet runs c alone
    assert fed.calls == base.steps and fed.given == fed.rows == fed.unet_rows == base.steps
    expected = diffusers_reference(model_dir, base, noise)  # StableDiffusionPipeline + DDIM
    # 1e-4 on images in [0, 1]: test_pipeline's tolerance for a full generation
    np.testing.assert_allclose(pipeline.decode(state.final_latent), expected, atol=1e-4)
    assert state.uncond_out is None  # it computed no unconditional prediction, so it keeps none


def test_an_unguided_row_equals_the_same_row_with_both_halves(pipeline, base_state):
    scheduler = pipeline.batcher(base_state.latents.shape[1:]).scheduler
    g = TEST_BASE.guidance
    rows = [TailRow("a blue square", 1.0, 4, g), TailRow(EDIT, 1.0, 4, 1.0), TailRow(EDIT, 0.7, 6, 0.5)]
    before = scheduler.stats.unguided_rows_skipped
    skipped = pipeline.run_tail(base_state, rows)
    assert scheduler.stats.unguided_rows_skipped - before == 6 + 4  # every unguided row-step skipped its half
    scheduler.skip_unguided = False
    try:
        before = scheduler.stats.unguided_rows_skipped
        both = pipeline.run_tail(base_state, rows)
        assert scheduler.stats.unguided_rows_skipped == before  # the two-halves path did run
    finally:
        scheduler.skip_unguided = True
    # u + 1 (c - u) against c: float rounding of one addition per step
    np.testing.assert_allclose(skipped, both, atol=ATOL)
    (guided,) = pipeline.run_tail(base_state, [TailRow(EDIT, 1.0, 4, g)])
    assert np.abs(skipped[1] - guided).max() > 1e-2  # guidance off is another image


def test_guided_and_unguided_rows_batched_equal_each_alone(pipeline, base_state):
    g = TEST_BASE.guidance
    rows = [
        TailRow("a blue square", 1.0, 2, 1.0),
        TailRow("a green circle", 0.5, 7, g),
        TailRow("a yellow triangle", 1.0, 4, 0.0, mask=Mask(0, 0, 16, 16)),
        TailRow("a blue square", 1.0, 4, g, mask=Mask(8, 8, 16, 16)),
        TailRow(EDIT, 1.5, 6, 1.0, seed=11),
        TailRow(EDIT, 1.0, 5, 3.0, uncond="base"),
    ]
    batched = pipeline.run_tail(base_state, rows)
    for row, final in zip(rows, batched):
        (alone,) = pipeline.run_tail(base_state, [row])
        np.testing.assert_allclose(final, alone, atol=ATOL)


def test_a_row_keeping_structure_with_a_seed_of_its_own_is_the_same_beside_an_unguided_row(pipeline, base_state):
    """A row that keeps structure and computes its own unconditional half at its entry step (a
    seed of its own) takes that half's self-attention pattern from its reference row, with or
    without an unguided row in the call. Until stop 65 the reference took its base's half as given
    at entry unless an unguided row was there: alone, the row fell back on its own pattern; beside
    one, it took the reference's (2.9e-2 apart; test_isolation's random mix found it)."""
    g = TEST_BASE.guidance
    for row in (TailRow("a green circle", 1.5, 2, 4.0, seed=40, structure=0.5), TailRow(EDIT, 1.0, 4, g, seed=7, structure=0.5)):
        (alone,) = pipeline.run_tail(base_state, [row])
        for partner in (TailRow("a cat", 1.5, 1, 1.0), TailRow("a cat", 0.5, 6, 1.0), TailRow("a cat", 1.0, 3, g)):
            beside = pipeline.run_tail(base_state, [row, partner])[0]
            np.testing.assert_allclose(beside, alone, atol=ATOL, err_msg=str(partner))


def test_the_step_graph_runs_one_unet_row_per_unguided_row_step(pipeline, base_state, fed):
    scheduler = pipeline.batcher(base_state.latents.shape[1:]).scheduler
    stats = scheduler.stats
    g = TEST_BASE.guidance
    # steps 4, 5: a guided row and an unguided one; 6..9: and a second unguided one
    rows = [TailRow("a blue square", 1.0, 4, g), TailRow(EDIT, 1.0, 4, 1.0), TailRow(EDIT, 1.0, 6, 0.0)]
    before = dataclasses.replace(stats)
    pipeline.run_tail(base_state, rows)
    guided_steps, unguided_steps = 6, 6 + 4
    assert fed.rows == guided_steps + unguided_steps  # (the count reads the feeds)
    assert fed.unet_rows == 2 * guided_steps + unguided_steps
    assert stats.unguided_row_steps - before.unguided_row_steps == unguided_steps
    assert stats.unguided_rows_skipped - before.unguided_rows_skipped == unguided_steps
    assert stats.uncond_rows_skipped == before.uncond_rows_skipped  # nothing taken from the base
    # every row unguided: every row is given its u (E = N), the UNet runs no unconditional row
    fed.unet_rows = fed.rows = fed.given = fed.calls = 0
    before = dataclasses.replace(stats)
    pipeline.run_tail(base_state, [TailRow(EDIT, 1.0, 6, 1.0), TailRow("a blue square", 1.0, 6, 1.0)])
    assert fed.calls == 4 and fed.rows == 8 and fed.given == 8 and fed.unet_rows == 8
    assert stats.unguided_rows_skipped - before.unguided_rows_skipped == fed.rows
    assert stats.unguided_row_steps - before.unguided_row_steps == fed.rows


def _diffusers_tail(pipe, state, prompt: str, start: int, guidance: float) -> np.ndarray:
    """diffusers' UNet (both halves) and DDIMScheduler from the base's x_start."""
    with torch.no_grad():
        cond, uncond = pipe.encode_prompt(prompt, "cpu", 1, True, TEST_BASE.negative_prompt)
        pipe.scheduler.set_timesteps(TEST_BASE.steps)
        x = torch.from_numpy(state.latent(start).copy())
        for t in pipe.scheduler.timesteps[start:]:
            u, c = pipe.unet(torch.cat([x, x]), t, encoder_hidden_states=torch.cat([uncond, cond])).sample.chunk(2)
            x = pipe.scheduler.step(u + guidance * (c - u), t, x, eta=0.0).prev_sample
    return x[0].numpy()


def test_a_guided_edit_of_an_unguided_base_computes_its_own_uncond(pipeline, diffusers_pipe):
    unguided = pipeline.generate_base(dataclasses.replace(TEST_BASE, guidance=1.0))
    scheduler = pipeline.batcher(unguided.latents.shape[1:]).scheduler
    g = TEST_BASE.guidance
    rows = [TailRow(EDIT, 1.0, 4, g, uncond="base"), TailRow(EDIT, 1.0, 6, g)]  # (entry reuse's default: compute)
    before = scheduler.stats.uncond_rows_skipped
    finals = pipeline.run_tail(unguided, rows)
    assert scheduler.stats.uncond_rows_skipped == before  # no u of the base taken, at entry or after
    for row, final in zip(rows, finals):
        expected = _diffusers_tail(diffusers_pipe, unguided, EDIT, row.start_step, g)
        np.testing.assert_allclose(final, expected, rtol=1e-5, atol=REFERENCE_ATOL)


def _bucketed_rows() -> list[TailRow]:
    """Five rows, three unguided: the pow2 bucket of 8 and three padding rows; E = 3 + 3 rounds
    down to 4, so one unguided row is given u = 0 and two compute theirs (exact, not free)."""
    g = TEST_BASE.guidance
    return [TailRow("a blue square", 1.0, 6, g), TailRow(EDIT, 1.0, 6, g, mask=Mask(0, 0, 16, 8)),
            TailRow(EDIT, 1.0, 6, 1.0), TailRow("a yellow triangle", 1.0, 6, 0.5), TailRow(EDIT, 0.5, 6, 1.0)]  # fmt: skip


def _check_bucketed(pipe, pipeline, base_state) -> None:
    stats = pipe.batcher(base_state.latents.shape[1:]).scheduler.stats
    before = dataclasses.replace(stats)
    ours = pipe.run_tail(base_state, _bucketed_rows())
    assert stats.rows_computed - before.rows_computed == 8 * 4  # the bucket of 8, 4 steps
    assert stats.unguided_row_steps - before.unguided_row_steps == 3 * 4
    assert stats.unguided_rows_skipped - before.unguided_rows_skipped == 1 * 4
    np.testing.assert_allclose(ours, pipeline.run_tail(base_state, _bucketed_rows()), atol=ATOL)


def _all_unguided_rows() -> list[TailRow]:
    """Three unguided rows: the pow2 bucket of 4, one padding row."""
    return [TailRow(EDIT, 1.0, 6, 1.0), TailRow("a yellow triangle", 1.0, 6, 0.5), TailRow("a blue square", 1.0, 6, 1.0)]


def _check_all_unguided(pipe, pipeline, base_state, monkeypatch, given: int) -> None:
    """4 calls at the bucket of 4, each given ``given`` rows' unconditional prediction (4: the
    padding row's and every real row's, so the UNet runs the 4 conditional rows alone)."""
    fed = fed_rows(pipe, base_state.latents.shape[1:], monkeypatch)
    ours = pipe.run_tail(base_state, _all_unguided_rows())
    assert fed.calls == 4 and fed.rows == 4 * 4 and fed.given == given * 4 and fed.unet_rows == (2 * 4 - given) * 4
    np.testing.assert_allclose(ours, pipeline.run_tail(base_state, _all_unguided_rows()), atol=ATOL)


def test_unguided_rows_at_pow2_buckets_on_openvino(onnx_dir, model_dir, pipeline, base_state, monkeypatch):
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    with EditPipeline(onnx_dir, model_dir, backend="openvino") as pipe:
        assert pipe.buckets is not None  # static shapes: pow2 buckets, E a power of two
        _check_bucketed(pipe, pipeline, base_state)
        _check_all_unguided(pipe, pipeline, base_state, monkeypatch, given=4)  # a compile with no uncond row


def test_unguided_rows_at_pow2_buckets_on_the_simulated_gpu(gpu, trt_dirs, onnx_dir, pipeline, base_state, monkeypatch):
    """Plans built without ``step_all_given`` (E < N in their profile): a call keeps its bucket's
    last row computing, floor_pow2(3 + 1 padding, at most 4 - 1) = 2 given: the runtime reads the
    plans' own profile (engines.json), not the manifest's flag."""
    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe:
        assert pipe.buckets == (1, 2, 4, 8) and not pipe.profile.step_all_given
        _check_bucketed(pipe, pipeline, base_state)
        _check_all_unguided(pipe, pipeline, base_state, monkeypatch, given=2)


@pytest.fixture(scope="module")
def all_given_trt_dir(onnx_dir, tmp_path_factory):
    """Simulated plans as `make engines` builds them for this export: E up to max_batch, U from N."""
    from edit_rt.runtime.engine.manifest import load_manifest

    from . import fakegpu

    manifest = load_manifest(onnx_dir)
    assert manifest.step_all_given
    out = tmp_path_factory.mktemp("sim-engines-all-given")
    fakegpu.write_trt_engines(manifest, out / "trt", dataclasses.replace(PROFILE, step_all_given=manifest.step_all_given))
    return out


def test_all_unguided_calls_on_the_simulated_gpu_run_no_uncond_row(gpu, all_given_trt_dir, onnx_dir, pipeline, base_state,
                                                                   monkeypatch):  # fmt: skip
    with _trt(onnx_dir, all_given_trt_dir) as pipe:
        assert pipe.profile.step_all_given
        _check_all_unguided(pipe, pipeline, base_state, monkeypatch, given=4)


@pytest.fixture
def unflagged_dir(onnx_dir, tmp_path):
    """``onnx_dir`` as an export from before the step graph took E = N: the same graphs, its
    manifest without ``step_all_given``."""
    out = tmp_path / "tiny-sd" / "onnx"
    out.mkdir(parents=True)
    for path in onnx_dir.iterdir():
        if path.name != "manifest.json":
            (out / path.name).symlink_to(path)
    data = json.loads((onnx_dir / "manifest.json").read_text())
    assert data.pop("step_all_given") is True
    (out / "manifest.json").write_text(json.dumps(data))
    return out


def test_an_export_without_step_all_given_keeps_one_computing_row(unflagged_dir, model_dir, pipeline, base_state,
                                                                  monkeypatch):  # fmt: skip
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    rows = [TailRow(EDIT, 1.0, 6, 1.0), TailRow("a blue square", 1.0, 6, 1.0)]
    with EditPipeline(unflagged_dir, model_dir) as old:
        assert not old.profile.step_all_given
        assert old.profile.dims("max")["E"] == old.max_batch - 1 and old.profile.dims("min")["U"] == old.profile.min_batch + 1
        fed = fed_rows(old, base_state.latents.shape[1:], monkeypatch)
        finals = old.run_tail(base_state, rows)
    assert fed.calls == 4 and fed.rows == 8 and fed.given == 8 - 4 and fed.unet_rows == 8 + 4  # one u computed a call
    np.testing.assert_allclose(finals, pipeline.run_tail(base_state, rows), atol=ATOL)
    assert pipeline.profile.dims("max")["E"] == pipeline.max_batch  # this export's: E up to every row
    assert pipeline.profile.dims("min")["U"] == pipeline.profile.min_batch


def test_report_counts_the_unguided_halves_the_step_graph_skipped(tmp_path, model_dir, onnx_dir, monkeypatch):
    """report.json's unguided rows against the step graph's own feeds: every call's rows (its
    latents' batch) and the rows whose unconditional half it was given (``uncond_given``'s)."""
    from edit_rt.runtime.apps import run as run_module
    from edit_rt.runtime.config.load import config_from_dict

    calls = count_step_calls(monkeypatch, run_module)
    cfg = {"model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path / "out"),
           "base": {"prompt": "a red circle", "negative_prompt": "blurry", "seed": 5, "steps": 8, "guidance": 7.5,
                    "width": 32, "height": 32},
           # a guided edit in every call, so each unguided row-step skips its half
           "edits": [{"prompt": "a green circle", "tail_steps": 4}, {"prompt": "a blue square", "tail_steps": 4, "guidance": 1.0},
                     {"prompt": "a yellow circle", "tail_steps": 3, "guidance": 0.0}]}  # fmt: skip
    rows = run_module.run_config(config_from_dict(cfg, tmp_path / "config.yaml"))["unet_rows"]
    assert rows["total"] == sum(n for n, _ in calls)
    assert rows["unguided_rows"] == rows["unguided_halves_skipped"] == sum(e for _, e in calls) == 4 + 3
    assert rows["half_rows_skipped"] == 0  # entry-step reuse is off while always-given rows are placed
    # every row unguided, the base's too: each call is given every row's u, none computes one
    calls.clear()
    for part in (cfg["base"], *cfg["edits"]):
        part["guidance"] = 1.0
    rows = run_module.run_config(config_from_dict(cfg, tmp_path / "config.yaml"))["unet_rows"]
    assert calls and all(e == n for n, e in calls)
    assert rows["unguided_rows"] == rows["unguided_halves_skipped"] == rows["total"] == sum(n for n, _ in calls) == 8 + 4 + 4 + 3
