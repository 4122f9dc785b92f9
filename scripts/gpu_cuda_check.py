"""The capture/replay path of ``runtime/cuda.py`` on a real GPU (cuda-python), for gpu_check.sh.

Checks, each against numpy on the host: pinned uploads and deferred reads on the one
non-blocking stream; a CUDA graph that captures a step's copies (the slot writes of a step go
through pinned staging, which capture allows) and replays them with new host values; another
thread allocating while this one captures (thread-local capture mode); a failed capture
reporting the enqueue's own error. Prints one JSON object.

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
    graph.free()
    for t in (a, b, staged, allocated.get("t")):
        if t is not None:
            t.free()
    stream.free()
    out["passed"] = all(v is True for k, v in out.items() if k != "replay_us")
    return out


if __name__ == "__main__":
    print(json.dumps(run_checks(), indent=2))
