"""The GPU path held against a simulated CUDA / TensorRT / ONNX Runtime CUDA runtime.

``tests/fakegpu.py`` enforces the documented rules (stream ordering, capture modes, context
state and ownership, engine dtypes, ``user_compute_stream``) and computes every kernel with the
real ONNX graph, so breaking a rule shows up as a refusal or a wrong latent. Each test is named
after the rule it holds; the reference is ONNX Runtime's CPU provider on the same graphs (which
the exactness tests hold against diffusers).
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from PIL import Image

from edit_rt.runtime.engine import backend, backend_ort, cuda, graph_set
from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.engine.profiles import EditBatchProfile
from edit_rt.runtime.errors import ArtifactError, ConfigError
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline, TailRow

from . import fakegpu
from .conftest import TEST_BASE, sample_rows

PROFILE = EditBatchProfile(1, 4, 8, 16, 16, 4, 2, vae_max_batch=4)
FP16_KV = {g: {**{f"{k}_{i}": "float16" for i in range(8) for k in ("cond_k", "cond_v", "uncond_k", "uncond_v")}}
           for g in ("unet_step",)}  # fmt: skip


@pytest.fixture(scope="module")
def trt_dirs(onnx_dir, tmp_path_factory):
    """Simulated plans: fp32 as exported, and a strongly typed fp16 engine's K/V inputs."""
    manifest = load_manifest(onnx_dir)
    root = tmp_path_factory.mktemp("sim-engines")
    fakegpu.write_trt_engines(manifest, root / "fp32" / "trt", PROFILE)
    fakegpu.write_trt_engines(manifest, root / "fp16" / "trt", PROFILE, dtypes=FP16_KV)
    return {"fp32": root / "fp32", "fp16": root / "fp16"}


def _trt(onnx_dir, engines_dir, **kw) -> EditPipeline:
    return EditPipeline(onnx_dir, backend="trt", engines_dir=engines_dir, batch_profile=(1, 4, 8), image_size=(32, 32),
                        vae_max_batch=4, **kw)  # fmt: skip


# --- the simulator's own rules (so a test below can trust it) ------------------------------------


def test_simulator_a_host_read_before_the_stream_runs_sees_the_old_bytes(gpu):
    stream = cuda.CudaStream()
    tensor = cuda.CudaTensor(4, np.float32, stream)
    tensor.write(np.arange(4, dtype=np.float32))
    out = np.full(4, -1, dtype=np.float32)
    tensor.read_async(out)
    assert (out == -1).all()  # queued, not landed
    stream.synchronize()
    np.testing.assert_array_equal(out, np.arange(4))


def test_simulator_refuses_a_global_capture_while_another_thread_allocates(gpu):
    rt = gpu.cudart
    stream = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)[1]
    assert rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal)[0] is rt.cudaError_t.cudaSuccess
    result = {}
    thread = threading.Thread(target=lambda: result.update(err=rt.cudaMalloc(64)[0]))
    thread.start()
    thread.join()
    assert result["err"] is rt.cudaError_t.cudaErrorStreamCaptureUnsupported
    assert rt.cudaStreamEndCapture(stream)[0] is rt.cudaError_t.cudaErrorStreamCaptureInvalidated


# --- CUDA: capture ---------------------------------------------------------------------------------


def test_capture_is_thread_local_so_other_threads_may_allocate(gpu):
    stream = cuda.CudaStream()
    tensor = cuda.CudaTensor(4, np.float32, stream)
    other = {}

    def enqueue():
        tensor.move(0, 0, 4)
        worker = threading.Thread(target=lambda: other.update(t=cuda.CudaTensor(8, np.float32, stream)))
        worker.start()
        worker.join()

    graph = cuda.CudaGraph(stream, enqueue)  # runs once, then captures a second run
    graph.launch()
    stream.synchronize()
    assert other["t"].ptr and gpu.cudart.counts["captured"] == 1
    graph.free()


def test_a_failed_capture_reports_the_enqueue_error_not_the_capture_error(gpu):
    stream = cuda.CudaStream()
    calls = []

    def enqueue():
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("the engine refused this launch")

    with pytest.raises(ValueError, match="the engine refused this launch"):
        cuda.CudaGraph(stream, enqueue)
    assert all(s.capture is None for s in gpu.cudart.streams.values())  # the capture was ended


def test_a_capture_without_the_first_real_enqueue_is_refused(gpu, trt_dirs, onnx_dir, base_state, monkeypatch):
    """TensorRT's rule (enqueue once outside the capture first) holds in the simulator: the
    runtime's graphs (cuda.CudaGraph) keep it; a CudaGraph that skipped the first launch fails."""
    rows = [TailRow("a blue square", 1.0, 5, TEST_BASE.guidance)]
    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe:
        pipe.run_tail(base_state, rows)  # the runtime as it is: no violation
    original = cuda.CudaGraph.__init__

    def without_warm_up(self, stream, enqueue):
        calls = []
        original(self, stream, lambda: calls.append(1) if not calls else enqueue())  # the first "launch" does nothing

    monkeypatch.setattr(cuda.CudaGraph, "__init__", without_warm_up)
    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe, pytest.raises(Exception, match="enqueueV3 once before capturing"):
        pipe.run_tail(base_state, rows)


def test_the_stream_is_non_blocking_and_host_copies_are_pinned(gpu):
    stream = cuda.CudaStream()
    assert gpu.cudart.streams[stream.handle].blocking is False
    tensor = cuda.CudaTensor(16, np.float32, stream)
    host = np.arange(16, dtype=np.float32)
    tensor.write(host)
    host[...] = 0  # reusing the host array at once must not change what lands
    out = np.empty(16, dtype=np.float32)
    tensor.read(out)
    np.testing.assert_array_equal(out, np.arange(16))
    assert gpu.cudart.counts.get("memcpy_pageable_to_device", 0) == 0
    assert gpu.cudart.counts["memcpy_pinned_to_device"] >= 1 and gpu.cudart.counts["memcpy_device_to_pinned"] >= 1


# --- TensorRT: contexts, buckets, dtypes, one stream -----------------------------------------------


def test_a_graph_is_never_replayed_on_a_context_another_bucket_reshaped(gpu, trt_dirs, onnx_dir, pipeline, base_state):
    """Tails of 1..8 rows, each bucket captured once: every replay finds its own context's
    shapes and addresses (the simulator refuses any other), and the latents equal ort-cpu's."""
    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe:
        for n in (1, 3, 5, 2, 8, 3):
            rows = [TailRow(f"edit {k}", 1.0, TEST_BASE.steps - 3, TEST_BASE.guidance) for k in range(n)]
            np.testing.assert_allclose(pipe.run_tail(base_state, rows), pipeline.run_tail(base_state, rows), atol=1e-5)
        scheduler = pipe.batchers[tuple(base_state.latents.shape[1:])].scheduler
        assert gpu.cudart.counts["captured"] == len(scheduler.bindings) + len(scheduler.blend_bindings)
        assert gpu.cudart.counts["cudaGraphLaunch"] > gpu.cudart.counts["captured"]  # replays happened


def test_rows_run_at_padded_buckets_and_padding_changes_no_row(gpu, trt_dirs, onnx_dir, pipeline, base_state):
    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe:
        assert pipe.buckets == (1, 2, 4, 8)
        ours = pipe.run_tail(base_state, sample_rows())  # 5 rows: the 8 bucket, 3 padding rows
        stats = pipe.batchers[tuple(base_state.latents.shape[1:])].scheduler.stats
        assert stats.rows_computed > stats.row_steps
        np.testing.assert_allclose(ours, pipeline.run_tail(base_state, sample_rows()), atol=1e-5)


def test_every_context_uses_the_one_shared_device_memory_block(gpu, trt_dirs, onnx_dir, base_state):
    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe:
        pipe.run_tail(base_state, sample_rows())
        blocks = {c.device_memory for c in gpu.trt.contexts}
        assert len(gpu.trt.contexts) > 3 and len(blocks) == 1
        assert all(c.strategy == "USER_MANAGED" for c in gpu.trt.contexts)
    # deactivating frees every allocation and the shared stream: nothing leaks past the pipeline
    assert gpu.cudart.device == {} and gpu.cudart.pinned == {} and pipe.graph_set.device.stream is None


def test_buffers_take_the_engine_dtypes(gpu, trt_dirs, onnx_dir, pipeline, base_state):
    """An engine whose K/V inputs are fp16 gets fp16 slots: the same edit within fp16's error."""
    with _trt(onnx_dir, trt_dirs["fp16"]) as pipe:
        scheduler = pipe.batcher(base_state.latents.shape[1:]).scheduler
        assert scheduler.dev["cond_k_0"].dtype == np.float16 and scheduler.dev["latents"].dtype == np.float32
        ours = pipe.run_tail(base_state, sample_rows())
    reference = pipeline.run_tail(base_state, sample_rows())
    # fp16 K/V (10-bit mantissa) through up to 8 steps; wrong bytes would be O(1) off
    np.testing.assert_allclose(ours, reference, atol=5e-2)
    assert np.abs(ours - reference).max() > 0  # it did run in fp16


def test_maps_steps_and_slot_writes_share_one_stream(gpu, trt_dirs, onnx_dir, pipeline, base_state):
    """preserve: auto rows read the step's maps on the same stream the slots are written on."""
    rows = [TailRow("a red square on a blue background", 1.0, 3, TEST_BASE.guidance, preserve="auto"),
            TailRow("a blue square", 1.0, 4, TEST_BASE.guidance)]  # fmt: skip
    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe:
        ours = pipe.edit(base_state, rows, decode=False)
        assert pipe.graphs["unet_step"].device is pipe.graphs["latent_blend"].device
    reference = pipeline.edit(base_state, rows, decode=False)
    for a, b in zip(ours, reference):
        np.testing.assert_allclose(a.latent, b.latent, atol=1e-5)
        assert (a.keep is None) == (b.keep is None) and (a.keep is None or (a.keep == b.keep).all())


def test_latents_stay_on_the_device_between_steps(gpu, trt_dirs, onnx_dir, base_state):
    """A steady step sends only the per-row scalars and brings nothing back."""
    rows = [TailRow(f"e{k}", 1.0, 2, TEST_BASE.guidance) for k in range(4)]
    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe:
        batcher = pipe.batcher(base_state.latents.shape[1:])
        from edit_rt.runtime.loop.jobs import Job, Request

        request = Request("steady", decode=False)
        jobs = [Job(request, i, base_state.base, row, state=base_state) for i, row in enumerate(rows)]
        batcher.submit(request, jobs)
        batcher.work_once()  # admission and the entry step
        rt = gpu.cudart
        before = dict(rt.counts)
        batcher.work_once()  # a steady step: 4 rows in the 4 bucket
        after = rt.counts
        sent = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("memcpy")}
        assert sent.get("memcpy_pinned_to_device", 0) == 3  # timestep, alpha_t, coefs
        assert sent.get("memcpy_device_to_pinned", 0) == 0
        # and the host never waits on the device (the simulator's count: syncs, pageable reads, syncing Runs)
        assert after.get("host_waits", 0) == before.get("host_waits", 0), {k: v for k, v in after.items() if k.startswith("host_wait")}
        while not all(j.future.done() for j in jobs):
            batcher.work_once()
        assert all(j.future.result().latent.shape == base_state.latents.shape[1:] for j in jobs)


def test_a_masked_rows_base_latents_stay_on_the_device(gpu, trt_dirs, onnx_dir, pipeline, base_state):
    """Issue 38: masked rows' base latents go up once per base and steps (base_windows.py); a
    steady step of four masked rows sends the backend what a plain step does (the three step
    scalars) and copies each row's base latent device to device; the latents equal ort-cpu's."""
    from edit_rt.runtime.loop.jobs import Job, Request
    from edit_rt.runtime.model.edit import Mask

    masks = [Mask(0, 0, 16, 16), Mask(8, 8, 32, 32), Mask(0, 16, 32, 32), Mask(4, 0, 20, 12)]
    rows = [TailRow(f"a green circle {k}", 1.0, 2, TEST_BASE.guidance, mask=mask) for k, mask in enumerate(masks)]
    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe:
        batcher = pipe.batcher(base_state.latents.shape[1:])
        request = Request("masked", decode=False)
        jobs = [Job(request, i, base_state.base, row, state=base_state) for i, row in enumerate(rows)]
        batcher.submit(request, jobs)
        batcher.work_once()  # admission, the entry step and the window's upload
        windows = batcher.scheduler.windows
        assert windows.uploads == 1 and len(windows.windows) == 1  # one base, one range: shared
        rt = gpu.cudart
        before = dict(rt.counts)
        batcher.work_once()
        sent = {k: rt.counts.get(k, 0) - before.get(k, 0) for k in rt.counts if k.startswith("memcpy")}
        assert sent.get("memcpy_pinned_to_device", 0) == 3, sent  # timestep, alpha_t, coefs: no latent
        assert sent.get("memcpy_device_to_device", 0) == len(rows), sent  # each row's base latent
        assert rt.counts.get("host_waits", 0) == before.get("host_waits", 0)
        while not all(j.future.done() for j in jobs):
            batcher.work_once()
        assert windows.windows == {} and windows.by_row == {} and len(windows.spare) == 1  # gone with its last row
        ours = np.concatenate([j.future.result().latent[None] for j in jobs])
        mallocs = rt.counts["cudaMalloc"]
        again = [Job(Request("again", decode=False), 0, base_state.base, rows[0], state=base_state)]
        batcher.submit(again[0].request, again)
        while not again[0].future.done():
            batcher.work_once()
        assert rt.counts["cudaMalloc"] == mallocs and windows.uploads == 2  # the spare memory, written again
        np.testing.assert_allclose(again[0].future.result().latent, ours[0], atol=1e-6)
    np.testing.assert_allclose(ours, pipeline.run_tail(base_state, rows), atol=1e-5)


def _steady_waits(gpu, pipe, jobs) -> int:
    """The host waits (simulator-counted) of one steady step of ``jobs``, after their entry step."""

    batcher = pipe.batcher(jobs[0].noise.shape[1:] if jobs[0].state is None else jobs[0].state.latents.shape[1:])
    batcher.submit(jobs[0].request, jobs)
    batcher.work_once()
    batcher.work_once()
    before = gpu.cudart.counts.get("host_waits", 0)
    batcher.work_once()
    waits = gpu.cudart.counts.get("host_waits", 0) - before
    while not all(j.future.done() for j in jobs):
        batcher.work_once()
    return waits


def test_a_steady_step_waits_on_the_device_at_most_once(gpu, trt_dirs, onnx_dir, base_state):
    """Issue 38: per row kind, the host waits of one steady step, counted by the simulator (a
    cudaStreamSynchronize after every replay would show here): a plain or masked tail none, a
    generation none (its latent and u read back for the store land at a later synchronization,
    at the latest its last step's), ``preserve: auto`` collecting maps one."""
    from edit_rt.runtime.loop.jobs import Job, Request
    from edit_rt.runtime.model.edit import Mask

    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe:
        def tail(row, name):
            request = Request(name, decode=False)
            return [Job(request, 0, base_state.base, row, state=base_state)]

        g = TEST_BASE.guidance
        assert _steady_waits(gpu, pipe, tail(TailRow("a blue square", 1.0, 2, g), "plain")) == 0
        assert _steady_waits(gpu, pipe, tail(TailRow("a blue square", 1.0, 2, g, mask=Mask(0, 0, 16, 16)), "masked")) == 0
        assert _steady_waits(gpu, pipe, tail(TailRow("a green circle on a blue background", 1.5, 2, g, preserve="auto"), "auto")) == 1
        request = Request("generation", decode=False)
        noise = pipe.initial_noise(TEST_BASE)
        generation = [Job(request, 0, TEST_BASE, TailRow(TEST_BASE.prompt, 1.0, 0, g), noise=noise)]
        assert _steady_waits(gpu, pipe, generation) == 0
        # and what it read back is its chain: the same base as ort-cpu's
        np.testing.assert_allclose(pipe.generate_base(TEST_BASE).latents, base_state.latents, atol=1e-5)


def test_the_trt_build_meets_the_builders_rules_and_its_plans_run(gpu, onnx_dir, pipeline, base_state, tmp_path, monkeypatch):
    """export/compile/engines.py's TensorRT path (issue 38), run through a builder that holds it to
    TensorRT's documented rules (fakegpu.FakeTrtBuilder: strongly typed, no precision flags, a
    profile per dynamic input with min <= opt <= max), for fp16 and fp32; the fp32 plans then
    run on the simulated GPU and equal ort-cpu. A profile with opt past max is refused."""
    from edit_rt.export.compile.engines import trt_engines
    from edit_rt.runtime.engine.engines import GRAPHS

    manifest = load_manifest(onnx_dir)
    builder = fakegpu.FakeTrtBuilder(tmp_path / "plans-sources").install(monkeypatch)
    trt_engines(manifest, tmp_path / "fp16" / "trt", PROFILE, "fp16")
    assert sorted(builder.built) == sorted(GRAPHS)
    trt_engines(manifest, tmp_path / "fp32" / "trt", PROFILE, "fp32")
    rows = sample_rows()[:3]
    with _trt(onnx_dir, tmp_path / "fp32") as pipe:
        np.testing.assert_allclose(pipe.run_tail(base_state, rows), pipeline.run_tail(base_state, rows), atol=1e-5)
    broken = dataclasses.replace(PROFILE, opt_batch=PROFILE.max_batch + 1)
    with pytest.raises(fakegpu.RuleViolation, match="min <= opt <= max"):
        trt_engines(manifest, tmp_path / "broken" / "trt", broken, "fp32")


def test_vae_decodes_in_chunks_of_its_own_profile(gpu, trt_dirs, onnx_dir, pipeline, base_state):
    latents = np.repeat(base_state.final_latent, 6, axis=0)  # 6 rows; the VAE profile takes 4
    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe:
        images = pipe.decode(latents)
    np.testing.assert_allclose(images, pipeline.decode(latents), atol=1e-5)


def test_exactness_holds_on_the_simulated_gpu(gpu, trt_dirs, onnx_dir, pipeline, base_state):
    """Generation equals ort-cpu's (which equals diffusers'), an identity edit reproduces the
    base, and a batch equals its rows run alone."""
    with _trt(onnx_dir, trt_dirs["fp32"]) as pipe:
        state = pipe.generate_base(TEST_BASE)
        np.testing.assert_allclose(state.latents, base_state.latents, atol=1e-5)
        identity = pipe.run_tail(state, [TailRow(TEST_BASE.prompt, 0.0, s, TEST_BASE.guidance) for s in (2, 5)])
        np.testing.assert_allclose(identity, np.repeat(state.final_latent, 2, axis=0), atol=1e-5)
        batched = pipe.run_tail(state, sample_rows())
        alone = np.concatenate([pipe.run_tail(state, [row]) for row in sample_rows()])
        np.testing.assert_allclose(batched, alone, atol=1e-5)


def test_a_plan_serves_each_size_from_its_own_optimization_profile(gpu, onnx_dir, pipeline, tmp_path):
    """engines.sizes on `trt`: one optimization profile per latent size in the spatial graphs;
    each binding (and the VAE's infer) selects the profile its shapes fit, before its shapes,
    and a generation at either size equals ort-cpu's at that size. Plans built without a size
    the run needs are refused in one line."""
    import dataclasses

    manifest = load_manifest(onnx_dir)
    wide = dataclasses.replace(PROFILE, extra_sizes=((16, 32),))  # 32x64 images besides 32x32
    fakegpu.write_trt_engines(manifest, tmp_path / "two" / "trt", wide)
    fakegpu.write_trt_engines(manifest, tmp_path / "one" / "trt", PROFILE)
    base = dataclasses.replace(TEST_BASE, width=64, height=32)
    with _trt(onnx_dir, tmp_path / "two", extra_image_sizes=[(32, 64)]) as pipe:
        for b in (TEST_BASE, base):
            state = pipe.generate_base(b)
            np.testing.assert_allclose(state.latents, pipeline.generate_base(b).latents, atol=1e-5)
            assert pipe.decode(state.final_latent).shape == (1, b.height, b.width, 3)
    used = {(c.engine.name, c.profile_index) for c in gpu.trt.contexts}
    assert ("unet_step", 0) in used and ("unet_step", 1) in used and ("vae_decoder", 1) in used, used
    assert all(c.engine.num_optimization_profiles == 1 for c in gpu.trt.contexts if c.engine.name == "text_encoder")
    with pytest.raises(ArtifactError, match="was built for 16x16 latents, this run needs 16x32 too"):
        _trt(onnx_dir, tmp_path / "one", extra_image_sizes=[(32, 64)])


# --- ONNX Runtime's CUDA provider ------------------------------------------------------------------


def test_ort_cuda_computes_on_the_runtime_stream(gpu, onnx_dir, pipeline, base_state):
    """With cuda-python the slots are copied on the runtime's stream, which every session is
    given as user_compute_stream: a session on its own stream would read unwritten slots."""
    with EditPipeline(onnx_dir, backend="ort-cuda", image_size=(32, 32), batch_profile=(1, 4, 8)) as pipe:
        streams = {s.stream.handle for s in gpu.ort.sessions}
        assert streams == {pipe.graphs["unet_step"].device.stream.handle}
        ours = pipe.run_tail(base_state, sample_rows())
        images = pipe.decode(ours)
    np.testing.assert_allclose(ours, pipeline.run_tail(base_state, sample_rows()), atol=1e-5)
    np.testing.assert_allclose(images, pipeline.decode(ours), atol=1e-5)


def test_ort_cuda_graphs_wait_on_the_host_every_replay(gpu, onnx_dir, pipeline, base_state):
    """ONNX Runtime's CUDA graph Replay() synchronizes its stream (cuda_graph.cc), so on ort-cuda
    every replayed step waits on the host, run options or not (docs/engines.md says so); trt's
    plain tail waits on nothing (test_a_steady_step_waits_on_the_device_at_most_once)."""
    rows = [TailRow("a blue square", 1.0, 4, TEST_BASE.guidance)]
    with EditPipeline(onnx_dir, backend="ort-cuda", image_size=(32, 32), batch_profile=(1, 4, 8)) as pipe:
        pipe.run_tail(base_state, rows)  # captures each bucket's graph
        before = dict(gpu.cudart.counts)
        ours = pipe.run_tail(base_state, rows)
        after = gpu.cudart.counts
    replays = TEST_BASE.steps - 4  # one step graph and one blend per step, both replayed
    assert after["host_wait:ort Run"] - before.get("host_wait:ort Run", 0) >= replays
    np.testing.assert_allclose(ours, pipeline.run_tail(base_state, rows), atol=1e-5)


def test_ort_cuda_captures_in_global_mode(gpu, onnx_dir, base_state):
    """ONNX Runtime's CUDA graph capture is in global mode (cuda_graph.cc CaptureBegin): a
    cudaMalloc by any other thread while it lasts invalidates it and the Run fails, which is
    why every CUDA call of a serving pipeline is on the engine thread (the server test above)."""
    seen = []

    def another_thread_allocates():
        worker = threading.Thread(target=lambda: seen.append(gpu.cudart.cudaMalloc(256)[0]))
        worker.start()
        worker.join()

    rows = [TailRow("a blue square", 1.0, 4, TEST_BASE.guidance)]
    with EditPipeline(onnx_dir, backend="ort-cuda", image_size=(32, 32), batch_profile=(1, 4, 8)) as pipe:
        gpu.ort.during_capture = another_thread_allocates
        with pytest.raises(Exception, match="cudaMalloc during a global capture"):
            pipe.run_tail(base_state, rows)
    assert seen and seen[0] is not fakegpu.OK  # the allocation itself was refused too


def test_ort_cuda_without_graphs_where_a_node_would_run_on_the_cpu(gpu, onnx_dir, pipeline, base_state, caplog):
    """ONNX Runtime refuses enable_cuda_graph when a node is not on the CUDA EP; the runtime then
    runs that graph without CUDA graphs, says so, and computes the same."""
    gpu.ort.cpu_ops = {"Softmax"}  # the step graph's attention: as if the CUDA EP lacked it
    with caplog.at_level("WARNING"), EditPipeline(onnx_dir, backend="ort-cuda", image_size=(32, 32), batch_profile=(1, 4, 8)) as pipe:
        ours = pipe.run_tail(base_state, sample_rows())
        assert not pipe.graphs["unet_step"].cuda_graphs and pipe.graphs["latent_blend"].cuda_graphs
    assert "unet_step.onnx: no CUDA graphs (This session cannot use the CUDA Graph feature" in caplog.text
    np.testing.assert_allclose(ours, pipeline.run_tail(base_state, sample_rows()), atol=1e-5)


def test_ort_cuda_runs_without_cuda_python(gpu, onnx_dir, pipeline, base_state):
    cuda.use_cudart(None)  # as with onnxruntime-gpu alone: cuda-python is not installed here
    assert not backend.cuda_python_available()
    with EditPipeline(onnx_dir, backend="ort-cuda", image_size=(32, 32), batch_profile=(1, 4, 8)) as pipe:
        assert pipe.graphs["unet_step"].device.stream is None
        ours = pipe.run_tail(base_state, sample_rows())
    np.testing.assert_allclose(ours, pipeline.run_tail(base_state, sample_rows()), atol=1e-5)


def test_only_backends_that_can_start_are_listed(gpu, monkeypatch):
    report = backend.backend_report()
    assert report["ort-cuda"][0] and report["trt"][0] and report["ort-cpu"][0]

    def no_device(*args, **kwargs):
        raise RuntimeError("CUDA failure 100: no CUDA-capable device is detected")

    # onnxruntime-gpu installed (the provider is listed) on a machine without a usable GPU
    monkeypatch.setattr(gpu.ort.OrtValue, "ortvalue_from_shape_and_type", staticmethod(no_device))
    monkeypatch.setattr(gpu.cudart, "cudaGetDeviceCount", lambda: (fakegpu.cudaError_t.cudaErrorNoDevice, 0))
    report = backend.backend_report()
    assert "CUDAExecutionProvider" in gpu.ort.get_available_providers()
    assert not report["ort-cuda"][0] and "cannot reach a CUDA device" in report["ort-cuda"][1]
    assert not report["trt"][0] and "no usable NVIDIA GPU" in report["trt"][1]
    assert set(backend.available_backends()) == {"openvino", "ort-cpu"}  # the CPU engines


def test_auto_takes_the_fastest_backend_that_starts_and_has_engines(gpu):
    assert backend.select_backend("auto", built={"trt"})[0] == "trt"
    # no trt engines built: the fastest one that needs none (ort-tensorrt is not in this onnxruntime)
    chosen, why = backend.select_backend("auto", built=set())
    assert chosen == "ort-cuda" and "not available here: ort-tensorrt" in why
    with pytest.raises(ConfigError, match="ort-tensorrt is not available on this machine"):
        backend.select_backend("ort-tensorrt", built=set())


def test_ort_tensorrt_takes_each_graphs_precision(monkeypatch, onnx_dir):
    manifest = load_manifest(onnx_dir)
    monkeypatch.setattr(graph_set, "select_backend", lambda requested, built: ("ort-tensorrt", "test"))
    monkeypatch.setitem(manifest.data["family"], "vae_force_upcast", True)
    graphs = graph_set.graphs_from_artifacts(manifest, None, "ort-tensorrt", 0, PROFILE, precision="fp16").graphs
    fp16 = {g: graph.provider_options["trt_fp16_enable"] for g, graph in graphs.items()}
    assert fp16 == {"text_encoder": "True", "kv_proj": "True", "unet_step": "True", "unet_step_shallow": "True",
                    "latent_blend": "False", "vae_decoder": "False", "vae_encoder": "False"}  # fmt: skip
    monkeypatch.setitem(manifest.data["family"], "upcast_attention", True)  # SD 2.x: no per-layer pinning in the EP
    graphs = graph_set.graphs_from_artifacts(manifest, None, "ort-tensorrt", 0, PROFILE, precision="fp32").graphs
    assert {graph.provider_options["trt_fp16_enable"] for graph in graphs.values()} == {"False"}


def test_every_provider_option_edit_rt_passes_is_one_onnx_runtime_documents(gpu, monkeypatch, onnx_dir, tmp_path):
    """Issue 39: the option names of every session edit-rt opens on ort-tensorrt (both precisions,
    the engine cache) and ort-cuda (the shared stream, CUDA graphs), and the run-option keys it
    sets, against ONNX Runtime's documented names (tests/ort_options.py, cited there), not
    against strings the code produces."""
    from .ort_options import PROVIDERS, RUN_OPTION_KEYS

    manifest = load_manifest(onnx_dir)
    select = graph_set.select_backend
    monkeypatch.setattr(graph_set, "select_backend", lambda requested, built: ("ort-tensorrt", "test"))
    seen = []
    for precision in ("fp16", "fp32"):
        graphs = graph_set.graphs_from_artifacts(manifest, tmp_path / "engines", "ort-tensorrt", 0, PROFILE, precision=precision).graphs
        seen += [provider for graph in graphs.values() for provider in graph.session_providers()]
    monkeypatch.setattr(graph_set, "select_backend", select)
    with EditPipeline(onnx_dir, backend="ort-cuda", image_size=(32, 32), batch_profile=(1, 4, 8)) as pipe:
        seen += [provider for graph in pipe.graphs.values() for provider in graph.session_providers()]
        assert pipe.graphs["unet_step"].cuda_graphs  # the step graph's options include enable_cuda_graph
    options = [(p, o) for p, o in (x if isinstance(x, tuple) else (x, {}) for x in seen) if p != "CPUExecutionProvider"]
    assert {p for p, _ in options} == {"TensorrtExecutionProvider", "CUDAExecutionProvider"}
    undocumented = {(p, k) for p, o in options for k in o if k not in PROVIDERS[p]}
    assert undocumented == set()
    assert {"trt_profile_min_shapes", "trt_fp16_enable", "user_compute_stream", "enable_cuda_graph"} <= {k for _, o in options for k in o}
    source = (Path(backend_ort.__file__)).read_text()
    keys = {n.args[0].value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", "") == "add_run_config_entry"}  # fmt: skip
    assert keys and keys <= RUN_OPTION_KEYS, keys


def test_the_simulated_onnx_runtime_refuses_an_undocumented_provider_option(gpu, onnx_dir):
    """As ONNX Runtime's ProviderOptionsParser does: a misspelled option fails the session."""
    with pytest.raises(RuntimeError, match="Unknown provider option: \"enable_cuda_graphs\""):
        gpu.ort.InferenceSession(str(Path(onnx_dir) / "latent_blend.onnx"), None,
                                 providers=[("CUDAExecutionProvider", {"enable_cuda_graphs": "1"})])  # fmt: skip


# --- one engine thread -------------------------------------------------------------------------------


def _png(array: np.ndarray) -> str:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


@pytest.mark.parametrize("backend_name", ["trt", "ort-cuda"])
def test_every_graph_call_runs_on_the_engine_thread(gpu, trt_dirs, onnx_dir, model_dir, tmp_path, backend_name):
    """A real server on loopback on the simulated trt and ort-cuda backends, with concurrent
    generations, uploads (inversion) and edits: every context is made and used on one thread
    (the simulator refuses any other), and every kernel was launched from it. On ort-cuda each
    bucket's CUDA graph is captured in global mode while the server runs (a capture lasting
    20 ms here, so that a request thread's allocation, free or sync would land in it and fail
    the Run): every request succeeds."""
    import time

    from edit_rt.export.bench.side import server_in_process
    from edit_rt.runtime.config.load import load_config

    if backend_name == "ort-cuda":
        gpu.ort.during_capture = lambda: time.sleep(0.02)
    build = tmp_path / "build"
    (build / model_dir.name).mkdir(parents=True)
    (build / model_dir.name / "onnx").symlink_to(onnx_dir)
    if backend_name == "trt":
        (build / model_dir.name / "engines").symlink_to(trt_dirs["fp32"])
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir), "build_dir": str(build), "backend": backend_name,
        "base": {"prompt": "x", "steps": 6, "guidance": 7.5, "width": 32, "height": 32},
        "engines": {"min_batch": 1, "opt_batch": 4, "max_batch": 8, "vae_max_batch": 4},
    }))  # fmt: skip
    cfg = load_config(config)
    with server_in_process(cfg) as url:  # the bench's in-process server (export/bench/side.py)
        rng = np.random.default_rng(0)
        uploads = [_png(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(2)]

        def generate(k):
            r = httpx.post(url + "/v1/images/generations", json={"prompt": f"a red circle {k}", "seed": k}, timeout=120)
            assert r.status_code == 200, r.text
            bid = r.json()["id"]
            r = httpx.post(url + "/v1/images/edits", json={"base_id": bid, "edits": [{"prompt": "a blue square"},
                           {"prompt": "a green circle", "strength": 0.5}]}, timeout=120)  # fmt: skip
            assert r.status_code == 200, r.text
            return len(r.json()["data"])

        def upload(k):
            r = httpx.post(url + "/v1/images/edits", json={"image": uploads[k], "source_prompt": "a circle",
                           "edits": [{"prompt": "a square"}]}, timeout=120)  # fmt: skip
            assert r.status_code == 200, r.text
            return len(r.json()["data"])

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(generate, k) for k in range(4)] + [pool.submit(upload, k) for k in range(2)]
            assert [f.result() for f in futures] == [2, 2, 2, 2, 1, 1]
    assert {c.owner_name for c in gpu.trt.contexts} == ({"edit-rt-engine"} if backend_name == "trt" else set())
    assert gpu.cudart.kernel_threads == {"edit-rt-engine"}
    if backend_name == "ort-cuda":
        assert gpu.cudart.counts["captured"] >= 2 and not gpu.cudart.last_invalidation


def test_the_prepared_gpu_check_passes_on_the_simulator(gpu):
    """scripts/gpu_cuda_check.py (run by scripts/gpu_check.sh on a real GPU) on the simulator."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_cuda_check.py"
    spec = importlib.util.spec_from_file_location("gpu_cuda_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.run_checks()
    assert report["passed"], report
