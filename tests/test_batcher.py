"""The continuous batcher in-process: fairness, mixed rows in one call, deadlines, bases."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from edit_rt.runtime.errors import CancelledError
from edit_rt.runtime.loop.batcher import Batcher
from edit_rt.runtime.loop.jobs import Job, Request
from edit_rt.runtime.pipeline.edit_pipeline import TailRow

from .conftest import TEST_BASE


def _batcher(pipeline, base_state, max_rows: int) -> Batcher:
    return Batcher(pipeline.resolver, pipeline.new_scheduler(base_state.latents.shape[1:], max_rows), queue_limit=64).start()


def _edit(request, i, state, prompt="a blue square", start=5, **kw) -> Job:
    return Job(request, i, state.base, TailRow(prompt, 1.0, start, TEST_BASE.guidance, **kw), state=state)


def test_a_big_request_does_not_starve_a_later_small_one(pipeline, base_state):
    batcher = _batcher(pipeline, base_state, max_rows=2)
    order = []
    try:
        big, small = Request("big"), Request("small")
        big_jobs = [_edit(big, i, base_state) for i in range(8)]
        small_jobs = [_edit(small, 0, base_state, prompt="a red square")]
        for job in big_jobs + small_jobs:
            job.future.add_done_callback(lambda f, job=job: order.append((job.request.id, job.index)))
        batcher.submit(big, big_jobs)
        batcher.submit(small, small_jobs)
        for job in big_jobs + small_jobs:
            job.future.result(timeout=120)
    finally:
        batcher.stop()
    # Round robin between requests: the small request's row is admitted within the first
    # few slots, long before the big request's last rows.
    assert order.index(("small", 0)) < 4, order


def test_rows_of_different_bases_and_steps_share_calls_and_match_alone(pipeline, base_state):
    other = pipeline.generate_base(dataclasses.replace(TEST_BASE, prompt="a green triangle", seed=9, steps=7, negative_prompt="noise"))
    batcher = _batcher(pipeline, base_state, max_rows=8)
    try:
        request = Request("mixed")
        jobs = [
            _edit(request, 0, base_state, start=3),
            _edit(request, 1, other, prompt="a red square", start=2),
            _edit(request, 2, base_state, prompt="a cat", start=7, seed=4),
            _edit(request, 3, other, prompt="a dog", start=5, mask=None),
        ]
        batcher.submit(request, jobs)
        results = [j.future.result(timeout=120) for j in jobs]
    finally:
        batcher.stop()
    for job, result in zip(jobs, results):
        (alone,) = pipeline.run_tail(job.state, [job.row])
        np.testing.assert_allclose(result.latent, alone, atol=1e-5)
        assert result.image.shape == (32, 32, 3)
    counts = batcher.metrics.histogram_counts("edit_rt_batch_rows")
    assert sum(c for rows, c in counts.items() if rows >= 2) > 0


def test_generation_rows_record_the_same_state_as_the_pipeline(pipeline, base_state):
    batcher = _batcher(pipeline, base_state, max_rows=4)
    try:
        request = Request("gen")
        base = TEST_BASE
        job = Job(request, 0, base, TailRow(base.prompt, 1.0, 0, base.guidance), noise=pipeline.initial_noise(base))
        batcher.submit(request, [job])
        state = job.future.result(timeout=120).state
    finally:
        batcher.stop()
    np.testing.assert_allclose(state.latents, base_state.latents, atol=1e-5)
    np.testing.assert_allclose(state.uncond_out, base_state.uncond_out, atol=1e-5)
    for a, b in zip(state.uncond_kv.tensors + state.cond_kv.tensors, base_state.uncond_kv.tensors + base_state.cond_kv.tensors):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_expired_requests_are_dropped_at_the_next_step(pipeline, base_state):
    batcher = _batcher(pipeline, base_state, max_rows=4)
    try:
        late = Request("late", deadline=time.monotonic() - 1)
        jobs = [_edit(late, i, base_state) for i in range(3)]
        batcher.submit(late, jobs)
        for job in jobs:
            assert isinstance(job.future.exception(timeout=60), CancelledError)
        ok = Request("ok")
        (job,) = [_edit(ok, 0, base_state)]
        batcher.submit(ok, [job])
        job.future.result(timeout=60)
    finally:
        batcher.stop()
