"""The capture/replay path of ``runtime/engine/cuda.py`` on a real GPU (cuda-python), for gpu_check.sh.

Checks, each against numpy on the host: pinned uploads and deferred reads on the one
non-blocking stream; a CUDA graph that captures a step's copies (the slot writes of a step go
through pinned staging, which capture allows) and replays them with new host values; another
thread allocating while this one captures (thread-local capture mode); a failed capture
reporting the enqueue's own error; the step loop's memory pattern for a few steps (rows written
at their slots, a masked row's base latent copied from a resident window, a generation's reads
queued and landing at one synchronization, a leave by swap-with-last), against the same
operations on numpy arrays. Prints one JSON object.

    python scripts/gpu_cuda_check.py              # needs cuda-python and an NVIDIA GPU
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np

from edit_rt.runtime.engine import cuda


def run_checks() -> dict:
    out: dict = {}
    stream = cuda.CudaStream()
    n = 1 << 16
    a = cuda.CudaTensor(n, np.float32, stream)
    b = cuda.CudaTensor(n, np.float32, stream)
    host = np.arange(n, dtype=np.float32)
    a.write(host)
    host[...] = -1  # reused at once: the staged copy must not see it
    got = np.empty(n, dtype=np.float32)
    a.read(got)
    out["pinned_upload_and_read"] = bool((got == np.arange(n)).all())

    # a step's shape: write two scalars' worth of rows, copy a into b, captured and replayed
    scalars = np.zeros(8, dtype=np.float32)
    staged = cuda.CudaTensor(8, np.float32, stream)

    def enqueue() -> None:
        b.move(0, 0, 8)  # within b: D2D
        stream.copy(b.ptr, a.ptr, n * 4)

    graph = cuda.CudaGraph(stream, enqueue)
    a.write(np.full(n, 7, dtype=np.float32))
    graph.launch()
    b.read(got)
    out["graph_replays_the_captured_copies"] = bool((got == 7).all())
    start = time.perf_counter()
    for _ in range(100):
        graph.launch()
    stream.synchronize()
    out["replay_us"] = 1e6 * (time.perf_counter() - start) / 100
    staged.write(scalars)

    allocated = {}

    def capture_while_another_thread_allocates() -> None:
        def enqueue2() -> None:
            b.move(0, 0, 8)
            t = threading.Thread(target=lambda: allocated.update(t=cuda.CudaTensor(1024, np.float32, stream)))
            t.start()
            t.join()

        cuda.CudaGraph(stream, enqueue2).free()

    try:
        capture_while_another_thread_allocates()
        out["thread_local_capture_lets_others_allocate"] = bool(allocated.get("t") is not None)
    except RuntimeError as err:
        out["thread_local_capture_lets_others_allocate"] = f"failed: {err}"

    def bad() -> None:
        bad.calls += 1
        if bad.calls == 2:
            raise ValueError("refused on purpose")

    bad.calls = 0
    try:
        cuda.CudaGraph(stream, bad)
        out["failed_capture_reports_its_own_error"] = False
    except ValueError:
        out["failed_capture_reports_its_own_error"] = True
    out.update(slot_pattern(stream))
    graph.free()
    for t in (a, b, staged, allocated.get("t")):
        if t is not None:
            t.free()
    stream.free()
    out["passed"] = all(v is True for k, v in out.items() if k != "replay_us")
    return out


def slot_pattern(stream: "cuda.CudaStream", rows: int = 4, steps: int = 6, elems: int = 4 * 64 * 64) -> dict:
    """What runtime/loop/row_scheduler.py does to device memory around its graphs, for ``steps`` steps
    of ``rows`` rows (latents of ``elems``, SD 1.5's at 512x512): the same writes, window copies,
    moves and reads on numpy arrays give the reference; one synchronization per run."""
    rng = np.random.default_rng(0)
    latents, base = cuda.CudaTensor(rows * elems, np.float32, stream), cuda.CudaTensor(rows * elems, np.float32, stream)
    window = cuda.CudaTensor(steps * elems, np.float32, stream)  # a masked base's x_{s+1}..x_{s+steps}
    ref_latents, ref_base = np.zeros(rows * elems, np.float32), np.zeros(rows * elems, np.float32)
    ref_window = rng.standard_normal(steps * elems).astype(np.float32)
    window.write(ref_window)
    record = np.empty((steps, elems), np.float32)  # a generation row's per-step reads
    for r in range(rows):  # admission: each row's entry latent at its slot
        x = rng.standard_normal(elems).astype(np.float32)
        latents.write(x, offset=r * elems)
        ref_latents[r * elems : (r + 1) * elems] = x
    syncs = stream.syncs
    for k in range(steps):
        base.copy_from(window, 1 * elems, k * elems, elems)  # row 1 is masked
        ref_base[elems : 2 * elems] = ref_window[k * elems : (k + 1) * elems]
        latents.read_async(record[k], offset=0)  # row 0 is a generation: queued, lands at the sync
    stream.synchronize()
    out = {"slot_pattern_one_sync": stream.syncs - syncs == 1,
           "slot_pattern_generation_reads": bool((record == ref_latents[:elems]).all())}
    latents.move(1 * elems, (rows - 1) * elems, elems)  # row 1 leaves: the last row takes its slot
    ref_latents[elems : 2 * elems] = ref_latents[(rows - 1) * elems : rows * elems]
    got_latents, got_base = np.empty_like(ref_latents), np.empty_like(ref_base)
    latents.read_async(got_latents)
    base.read_async(got_base)
    stream.synchronize()
    out["slot_pattern_matches_numpy"] = bool((got_latents == ref_latents).all() and (got_base == ref_base).all())
    for t in (latents, base, window):
        t.free()
    return out


if __name__ == "__main__":
    print(json.dumps(run_checks(), indent=2))
