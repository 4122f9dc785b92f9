"""The samplers through the whole runtime (the step graph's linear update, the history slots, the
ancestral noise), against diffusers' own pipelines with its own schedulers:

- a generation with Euler, Euler ancestral (the same noise), DPM-Solver++ 2M (Karras on and
  off) and UniPC equals diffusers' StableDiffusionPipeline with EulerDiscreteScheduler,
  EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler and UniPCMultistepScheduler, on
  the tiny SD 1.x model (epsilon) and the tiny SD 2.x model (v-prediction);
- an identity edit on every sampler reproduces its base from any window step (the tail takes
  the base's solver history and, for Euler a, its noise);
- rows of different samplers' bases batched in one call equal each run alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edit_rt.runtime.loop.jobs import Job, Request
from edit_rt.runtime.model.edit import TailRow
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline
from edit_rt.runtime.storage.store import BaseStore, base_id

from .conftest import TEST_BASE

BATCH_ATOL = 1e-5  # as tests/test_pipeline.py: fp32 reordering across batch sizes

SAMPLERS = ["euler", "euler_karras", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "unipc"]


@pytest.fixture(scope="module")
def openvino_pipeline(onnx_dir, model_dir):
    """The conftest's pipeline on the other CPU engine: OpenVINO (fp32) on the same graphs."""
    with EditPipeline(onnx_dir, model_dir, backend="openvino") as pipe:
        yield pipe


# OpenVINO's run of every sampler is in make test-all; the default run holds it by each graph
# against its torch source and one generation per family (tests/test_openvino.py).
OPENVINO = pytest.param("openvino", marks=pytest.mark.slow)


@pytest.fixture(scope="module", params=["ort-cpu", OPENVINO])
def sd2(request, sd2_onnx_dir, sd2_dir):
    with EditPipeline(sd2_onnx_dir, sd2_dir, backend=request.param) as pipe:
        yield pipe, sd2_dir


@pytest.mark.parametrize("backend", ["ort-cpu", OPENVINO])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_generation_equals_diffusers_with_its_scheduler(request, backend, model_dir, sampler, diffusers_reference):
    """diffusers' StableDiffusionPipeline with the sampler's scheduler (tests/diffusers_reference.py:
    Euler, Euler a with edit-rt's per-step noise, DPM-Solver++ 2M, UniPC) from the same latents."""
    pipeline = request.getfixturevalue("pipeline" if backend == "ort-cpu" else "openvino_pipeline")
    assert pipeline.graph_set.backend == backend
    base = dataclasses.replace(TEST_BASE, sampler=sampler)
    noise = pipeline.initial_noise(base)
    ours = pipeline.decode(pipeline.generate_base(base, noise=noise).final_latent)
    # 1e-4 on images in [0, 1], as for DDIM (tests/test_pipeline.py): fp32 differences of the
    # graphs and of the coefficients (float64 on the host, float32 in torch) through 10 steps
    np.testing.assert_allclose(ours, diffusers_reference(model_dir, base, noise, sampler), atol=1e-4)


@pytest.mark.parametrize("sampler", ["euler_a", "dpmpp_2m_karras", "unipc"])
def test_a_v_prediction_generation_equals_diffusers_with_its_scheduler(sd2, sampler, diffusers_reference):
    pipe, model_dir = sd2
    base = dataclasses.replace(TEST_BASE, sampler=sampler, steps=8)
    noise = pipe.initial_noise(base)
    ours = pipe.decode(pipe.generate_base(base, noise=noise).final_latent)
    np.testing.assert_allclose(ours, diffusers_reference(model_dir, base, noise, sampler), atol=1e-4)


@pytest.fixture(scope="module")
def sampler_states(pipeline):
    return {s: pipeline.generate_base(dataclasses.replace(TEST_BASE, sampler=s)) for s in ("euler_a", "dpmpp_2m_karras", "unipc")}


@pytest.mark.parametrize("sampler", ["euler_a", "dpmpp_2m_karras", "unipc"])
def test_an_identity_edit_reproduces_its_base_on_every_sampler(pipeline, sampler_states, sampler):
    state = sampler_states[sampler]
    g = TEST_BASE.guidance
    rows = [row for s in (1, 2, 5, 9) for row in (TailRow("a green square", 0.0, s, g), TailRow(TEST_BASE.prompt, 1.0, s, g))]
    for final in pipeline.run_tail(state, rows):
        np.testing.assert_allclose(final, state.final_latent[0], atol=BATCH_ATOL)


def test_rows_of_different_samplers_batched_equal_each_alone(pipeline, sampler_states, base_state):
    g = TEST_BASE.guidance
    states = [base_state, *sampler_states.values()]  # DDIM and the three others
    edits = [TailRow("a blue square", 1.0, 3, g), TailRow("a green circle", 0.7, 6, 3.0)]
    alone = [pipeline.run_tail(state, [row])[0] for state in states for row in edits]
    request = Request("mixed", decode=False)
    jobs = [Job(request, k, state.base, row, state=state)
            for k, (state, row) in enumerate((s, r) for s in states for r in edits)]  # fmt: skip
    batcher = pipeline.batcher(base_state.latents.shape[1:])
    before = dataclasses.replace(batcher.scheduler.stats)
    together = batcher.run(request, jobs)
    stats = batcher.scheduler.stats
    # every call ran rows of several bases: 8 rows' 46 tail steps in 7 calls (the longest tail)
    assert stats.calls - before.calls == 7 and stats.row_steps - before.row_steps == 4 * (7 + 4)
    for result, expected in zip(together, alone):
        np.testing.assert_allclose(result.latent, expected, atol=BATCH_ATOL)
    # and they differ by sampler: the same edit of another sampler's base is another image
    assert np.abs(alone[0] - alone[2]).max() > 1e-2


def test_a_multistep_base_keeps_its_history_through_the_disk_tier(pipeline, sampler_states, tmp_path):
    """A windowed DPM++ base written to the store's disk tier and read back by a fresh store
    (another process, a restart) still reproduces itself from the window's first step: its x_0
    per step (from two steps before the window) came back with it."""
    state = sampler_states["dpmpp_2m_karras"].windowed(4)
    assert state.x0.shape[0] == TEST_BASE.steps - 4 + 2
    BaseStore(pipeline.manifest.fingerprint, 1 << 26, tmp_path, 1 << 28).put(state)
    again = BaseStore(pipeline.manifest.fingerprint, 1 << 26, tmp_path, 1 << 28).get(base_id(pipeline.manifest.fingerprint, state.base))
    np.testing.assert_array_equal(again.x0, state.x0)
    g = TEST_BASE.guidance
    for final in pipeline.run_tail(again, [TailRow(TEST_BASE.prompt, 1.0, 4, g), TailRow("a cat", 0.0, 6, g)]):
        np.testing.assert_allclose(final, state.final_latent[0], atol=BATCH_ATOL)
    # without its history the same tail is another image: the test can tell
    lost = dataclasses.replace(again, x0=np.zeros_like(again.x0))
    assert np.abs(pipeline.run_tail(lost, [TailRow(TEST_BASE.prompt, 1.0, 4, g)])[0] - state.final_latent[0]).max() > 1e-3
