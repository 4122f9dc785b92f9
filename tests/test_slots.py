"""The step loop's resident slots: what a step writes, allocates and binds, and what it reads.

- a counting backend: bytes written into backend memory per step stay within N x (latent +
  step scalars) + the rows that joined x (their slot: K/V, guidance, set index, entry u);
- no array is allocated per step (tracemalloc, numpy's own domain) over 50 steps;
- bindings are bounded (LRU) over 100 tails of varying N and every evicted one is freed;
- the step graph reads each bound K/V block once (ONNX Runtime's profiler), the old layout's
  gathers and concatenations are gone;
- entry-step reuse gives the same latents as computing the unconditional half again;
- ort-cuda asks ONNX Runtime for one CUDA graph id per bucket and reuses it (the GPU path's
  rules are held against a simulated runtime in test_gpu_rules.py).
"""

from __future__ import annotations

import dataclasses
import math
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edit_rt.export.compile.kv_traffic import kv_traffic
from edit_rt.export.compile.parity import random_feeds
from edit_rt.runtime.engine.backend_ort import OrtGraph
from edit_rt.runtime.engine.device import HostTensor
from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.loop import row_scheduler
from edit_rt.runtime.loop.batcher import Batcher
from edit_rt.runtime.loop.jobs import Job, Request
from edit_rt.runtime.model.edit import TailRow

from .conftest import TEST_BASE


class CountingTensor:
    """A host tensor that counts the bytes the runtime writes into it (host -> backend)."""

    def __init__(self, inner: HostTensor, log: dict):
        self.inner, self.log = inner, log
        self.dtype, self.capacity, self.device = inner.dtype, inner.capacity, inner.device

    def write(self, host, offset=0):
        self.log["written"] += host.nbytes
        self.inner.write(host, offset)

    def read(self, out, offset=0):
        self.inner.read(out, offset)

    read_async = read

    def move(self, dst, src, count):
        self.log["moved"] += count * self.dtype.itemsize
        self.inner.move(dst, src, count)

    def copy_from(self, src, dst, src_offset, count):
        self.log["copied"] = self.log.get("copied", 0) + count * self.dtype.itemsize
        self.inner.copy_from(getattr(src, "inner", src), dst, src_offset, count)

    def view(self, shape):
        return self.inner.view(shape)

    def free(self):
        self.inner.free()


class CountingGraph:
    """The step graph with counted memory, and bindings whose free() is recorded."""

    def __init__(self, graph):
        self.graph = graph
        self.log = {"written": 0, "moved": 0, "freed": 0, "bound": 0}

    def allocate(self, capacity, dtype):
        return CountingTensor(self.graph.allocate(capacity, dtype), self.log)

    def dtype(self, name):
        return self.graph.dtype(name)

    def synchronize(self):
        self.graph.synchronize()

    def bind(self, inputs, outputs):
        binding = self.graph.bind(inputs, outputs)
        self.log["bound"] += 1
        original_free = binding.free

        def free():
            self.log["freed"] += 1
            original_free()

        binding.free = free
        return binding


def _edits(state, request, prompts, start, **kw):
    return [Job(request, i, state.base, TailRow(p, 1.0, start, TEST_BASE.guidance, **kw), state=state)
            for i, p in enumerate(prompts)]  # fmt: skip


def test_a_step_writes_latents_and_scalars_only_kv_once_per_row(pipeline, base_state):
    shape = base_state.latents.shape[1:]
    graph = CountingGraph(pipeline.graphs["unet_step"])
    scheduler = pipeline.new_scheduler(shape, max_rows=8, graph=graph)
    batcher = Batcher(pipeline.resolver, scheduler)
    latent = 4 * math.prod(shape)
    kv_row = sum(t[0].nbytes for t in base_state.cond_kv.tensors)
    set_bytes = base_state.uncond_kv.nbytes
    first, second = Request("a", decode=False), Request("b", decode=False)
    batcher.submit(first, _edits(base_state, first, ["a blue square", "a green circle", "a cat"], 1))
    steps = []
    for k in range(7):
        if k == 3:  # two rows join mid-tail
            batcher.submit(second, _edits(base_state, second, ["a dog", "a red square"], 4, seed=3))
        before, sets_before = graph.log["written"], scheduler.stats.set_writes
        batcher.work_once()
        stats = scheduler.stats
        new_sets = stats.set_writes - sets_before
        steps.append((graph.log["written"] - before, stats.last_rows, stats.last_joined, new_sets))
    keep = latent // shape[0]  # one float per latent pixel
    for written, n, joined, new_sets in steps:
        # per row its timestep, alpha_t and 7 coefficients; a joining row: its K/V, guidance, set
        # index, entry latent, entry u and its slope, mask, correction slot and solver history (2 latents)
        budget = n * 9 * 4 + joined * (kv_row + 4 + 8 + 5 * latent + 4 + keep) + new_sets * set_bytes
        assert written <= budget, (written, budget, n, joined)
    # steps where nobody joined write exactly the step scalars and coefficients per row (DDIM
    # rows: no noise): the latents and history stay in backend memory (latent_blend puts them
    # back), nothing else crosses
    steady = [(w, n) for w, n, joined, _ in steps if joined == 0]
    assert steady and all(w == n * 36 for w, n in steady)
    assert any(joined == 2 for _, _, joined, _ in steps)


@pytest.mark.slow  # ~20-50 s; the default run keeps test_bindings_are_reused_bounded_and_freed
def test_no_array_is_allocated_per_step(pipeline):
    base = dataclasses.replace(TEST_BASE, steps=60, width=64, height=64)  # 32x32 latents: 16 KiB each
    state = pipeline.generate_base(base)
    batcher = pipeline.batcher(state.latents.shape[1:])
    request = Request("steady", decode=False)
    jobs = [Job(request, i, base, TailRow(p, 1.0, 2, base.guidance), state=state) for i, p in enumerate(["a", "b", "c"])]
    batcher.submit(request, jobs)
    for _ in range(3):  # admission, the entry step, the first steady step: bindings made
        batcher.work_once()
    ours = [tracemalloc.Filter(True, str(Path(row_scheduler.__file__).parents[1] / "*"))]  # all of runtime/
    numpy_arrays = [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)]
    peaks = np.zeros(50, dtype=np.int64)  # each step's transient peak (made before tracing starts)
    tracemalloc.start()
    try:
        start = tracemalloc.take_snapshot()
        for k in range(50):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            batcher.scheduler.step()
            peaks[k] = tracemalloc.get_traced_memory()[1] - before
        end = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    for kept in (numpy_arrays, ours):  # nothing kept: no array anywhere, no object of ours
        print([str(d) for d in end.filter_traces(kept).compare_to(start.filter_traces(kept), "lineno") if d.size_diff])
        assert sum(s.size_diff for s in end.filter_traces(kept).compare_to(start.filter_traces(kept), "lineno")) == 0
    # Transients, step by step: Python views and small lists only, far below one 16 KiB latent
    # (~1.1 KiB a step here, 2.5 KiB at most). Per step, not over all 50: onnxruntime's binding
    # keeps ~124 B of its own per run in some runs (pybind11's bookkeeping, seen in
    # onnxruntime_inference_collection.py's run_with_iobinding: 12.1 KiB over 100 runs when
    # test_memory.py's imports came first), which is neither ours nor an array.
    assert peaks.max() < 8192, peaks.tolist()
    while not all(job.future.done() for job in jobs):
        batcher.work_once()


@pytest.mark.slow  # ~10-20 s; the default run keeps test_every_binding_reads_the_same_resident_slots
def test_bindings_are_reused_bounded_and_freed(pipeline, base_state):
    graph = CountingGraph(pipeline.graphs["unet_step"])
    scheduler = pipeline.new_scheduler(base_state.latents.shape[1:], max_rows=8, graph=graph)
    scheduler.max_bindings = 6
    batcher = Batcher(pipeline.resolver, scheduler)
    rng = np.random.default_rng(0)
    T = TEST_BASE.steps
    for k in range(100):
        n = int(rng.integers(1, 9))
        request = Request(f"t{k}", decode=False)
        batcher.run(request, _edits(base_state, request, [f"edit {j}" for j in range(n)], T - 2))
        assert len(scheduler.bindings) <= 6
    assert graph.log["bound"] == scheduler.stats.bindings_made
    assert graph.log["freed"] == scheduler.stats.bindings_freed == graph.log["bound"] - len(scheduler.bindings)
    # the same tail again binds nothing new
    made = scheduler.stats.bindings_made
    for _ in range(2):
        request = Request("again", decode=False)
        batcher.run(request, _edits(base_state, request, ["x", "y"], T - 2))
    assert scheduler.stats.bindings_made <= made + 2  # (2, 1, 1) and (2, 0, 1) at most once


def test_every_binding_reads_the_same_resident_slots(pipeline, base_state):
    views = []
    graph = pipeline.graphs["unet_step"]

    class Spy:
        def allocate(self, capacity, dtype):
            return graph.allocate(capacity, dtype)

        def dtype(self, name):
            return graph.dtype(name)

        def synchronize(self):
            graph.synchronize()

        def bind(self, inputs, outputs):
            views.append({**inputs, **outputs})
            return graph.bind(inputs, outputs)

    scheduler = pipeline.new_scheduler(base_state.latents.shape[1:], max_rows=8, graph=Spy())
    batcher = Batcher(pipeline.resolver, scheduler)
    for n in (1, 3, 5):
        request = Request(f"n{n}", decode=False)
        batcher.run(request, _edits(base_state, request, [f"e{j}" for j in range(n)], 6))
    assert len(views) >= 3
    for name in ("latents", "cond_k_0", "uncond_v_0", "uncond_given", "next_latents"):
        assert {v[name].ptr for v in views} == {scheduler.dev[name].view((1,)).ptr}


@pytest.mark.parametrize("optimize", [True, False])
def test_the_step_reads_each_bound_kv_block_once(onnx_dir, optimize):
    manifest = load_manifest(onnx_dir)
    feeds = random_feeds(manifest, "unet_step", 4, 2, np.random.default_rng(0), hw=16)
    kv = [n for n, role in manifest.step_roles.items() if role in ("row_kv", "set_kv")]
    traffic = kv_traffic(manifest.path("unet_step"), feeds, kv, optimize=optimize)
    # the bar is 2x; reading K and V where they are bound gives exactly 1x
    assert traffic["ratio"] <= 2.0, traffic
    assert traffic["touched_bytes"] >= traffic["bound_bytes"]


def test_entry_step_reuse_equals_computing_it(pipeline, base_state):
    rows = [TailRow(p, 1.0, 4, TEST_BASE.guidance) for p in ("a blue square", "a green circle", "a cat")]
    scheduler = pipeline.batcher(base_state.latents.shape[1:]).scheduler
    before = scheduler.stats.uncond_rows_skipped
    with_reuse = pipeline.run_tail(base_state, rows)
    # three rows joined at once: all three take u from the base (the step graph takes E = N)
    assert scheduler.stats.uncond_rows_skipped - before == 3
    scheduler.reuse_entry = False
    try:
        without = pipeline.run_tail(base_state, rows)
    finally:
        scheduler.reuse_entry = True
    np.testing.assert_allclose(with_reuse, without, atol=1e-5)


def test_more_negative_prompts_than_sets_wait_and_match_alone(pipeline, base_state):
    others = [pipeline.generate_base(dataclasses.replace(TEST_BASE, negative_prompt=neg, seed=s))
              for neg, s in (("noise", 4), ("dark", 5))]  # fmt: skip
    scheduler = pipeline.new_scheduler(base_state.latents.shape[1:], max_rows=8)
    scheduler.max_sets = 2
    batcher = Batcher(pipeline.resolver, scheduler)
    request = Request("sets", decode=False)
    jobs = [Job(request, i, s.base, TailRow("a green triangle", 1.0, 3, TEST_BASE.guidance), state=s)
            for i, s in enumerate([base_state, *others])]  # fmt: skip
    results = batcher.run(request, jobs)
    for job, result in zip(jobs, results):
        (alone,) = pipeline.run_tail(job.state, [job.row])
        # one set or three side by side: the same softmax, summed with more exact zeros
        np.testing.assert_allclose(result.latent, alone, atol=1e-5, rtol=1e-6)


# --- CUDA graph ids on ort-cuda --------------------------------------------------------------


def test_ort_cuda_graph_ids_are_per_bucket_and_recycled(tmp_path):
    graph = OrtGraph(tmp_path / "unet_step.onnx", "ort-cuda", cuda_graphs=True)
    # every node must run on the CUDA EP to be captured: no CPU fallback provider
    assert graph.session_providers() == [("CUDAExecutionProvider", {"enable_cuda_graph": "1"})]
    assert OrtGraph(tmp_path / "x.onnx", "ort-cuda").session_providers() == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    # ort-tensorrt: what TensorRT declines runs on the CUDA EP (issue 38), the CPU last
    assert OrtGraph(tmp_path / "x.onnx", "ort-tensorrt").session_providers() == [
        "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]

    class FakeIO:
        def bind_input(self, *a):
            pass

        bind_output = bind_input

    runs = []
    graph.session = SimpleNamespace(io_binding=FakeIO, run_with_iobinding=lambda io, options: runs.append(options))
    tensor = HostTensor(16, np.float32)
    graph.MAX_CUDA_GRAPHS = 2
    for rows in (1, 2, 4, 1, 2):  # three buckets, then the first two bound again
        view = tensor.view((rows, 4))
        graph.bind({"latents": view}, {"next_latents": view}).run()
    ids = [options.get_run_config_entry("gpu_graph_id") for options in runs]
    # past the cap a bucket runs without capture (ONNX Runtime's -1); a bucket bound again
    # replays the graph kept under its id
    assert ids == ["1", "2", "-1", "1", "2"]
