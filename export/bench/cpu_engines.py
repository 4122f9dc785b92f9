"""The CPU engines side by side (issue 40): ``ort-cpu``, ``openvino`` fp32 and ``openvino`` bf16 on
the same exported ONNX graphs, the same base, the same rows.

Each (engine, N) runs in a fresh process, so its peak RSS is its own (``VmHWM``: loading,
compiling and running N rows); the engines take turns at each N. A process loads the config's
model on the engine, warms up (OpenVINO compiles the row bucket's static shapes then), times
``repeats`` batched tails of N rows x K steps from one base (the first engine's, saved, so
every engine starts from the same latents and K/V), and runs one ``unet_step`` call on the
inputs the first engine's step loop fed its first call (captured as bound): its next latents
and its unconditional prediction (eps) are compared with ``ort-cpu``'s on the same inputs; so
are the tails' final latents (K chained steps).

GFLOP/s count the UNet's convolutions, linears and attention matmuls as torch's
``FlopCounterMode`` counts them on diffusers' own UNet (built on the meta device, weights never
loaded) for one UNet row, times the UNet rows the timed tails really ran (counted at each bound
call: ``2N - E``, N conditional rows and the unconditional ones of the rows not at their entry
step, whose prediction the base gave: ``uncond_given``), against the machine's measured limit:
the best matmul of 2048^2 that torch or OpenVINO runs in fp32, and in bf16, at the same thread
count.

    python -m edit_rt.export.bench.cpu_engines configs/bench.yaml --out out/bench
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

ENGINES: tuple[tuple[str, str], ...] = (("ort-cpu", "fp32"), ("openvino", "fp32"), ("openvino", "bf16"))
EDIT_WORDS = ["red", "blue", "green", "yellow", "at night", "in snow", "watercolor", "pixel art"]


def engine_name(backend: str, precision: str) -> str:
    return backend if backend == "ort-cpu" else f"{backend} {precision}"


def peak_rss() -> int:
    """This process's peak resident set: ``VmHWM``, which an exec starts afresh (``ru_maxrss``
    keeps the parent's peak across fork and exec on Linux, so a child would report the bench's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: an upper bound


def _child(config: str, backend: str, precision: str, n: int, k: int, repeats: int, threads: int,
           state_path: Path, out: Path, base_steps: Optional[int]) -> dict[str, Any]:  # fmt: skip
    """In its own process: load, warm up, time the tails, write the latents; the report."""
    import dataclasses
    import pickle

    from edit_rt.runtime.config.load import load_config
    from edit_rt.runtime.model.edit import TailRow
    from edit_rt.runtime.pipeline.assemble import pipeline_of

    cfg = load_config(Path(config))
    base = cfg.base if base_steps is None else dataclasses.replace(cfg.base, steps=base_steps)
    start = time.perf_counter()
    rt = pipeline_of(cfg, backend=backend, precision=precision, threads=threads,
                     batch_profile=(1, max(n, cfg.engines.opt_batch), max(n, cfg.engines.max_batch))).activate()  # fmt: skip
    loaded = time.perf_counter() - start
    rss_loaded = peak_rss()
    # bindings are made once per bucket: record before the first call (a base's, or the tail's)
    step = rt.graphs["unet_step"]
    feeds_path = state_path.with_name(f"feeds-{n}.npz")
    watch = _watch_calls(step, capture=not feeds_path.is_file())
    if state_path.is_file():
        state = pickle.loads(state_path.read_bytes())
    else:  # the first engine makes the base every engine starts from
        state = rt.generate_base(base)
        state_path.write_bytes(pickle.dumps(state))
    watch["armed"] = True  # from here on: the tail's first call, not the base's
    T = state.base.steps
    rows = [TailRow(f"{base.prompt}, {EDIT_WORDS[i % len(EDIT_WORDS)]} {i // len(EDIT_WORDS)}", 1.0, T - k, base.guidance)
            for i in range(n)]  # fmt: skip
    start = time.perf_counter()
    rt.run_tail(state, rows)  # the warm-up: OpenVINO compiles the bucket's shapes here
    warm = time.perf_counter() - start
    seconds = []
    watch["unet_rows"] = 0
    for _ in range(repeats):
        start = time.perf_counter()
        tail = rt.run_tail(state, rows)
        seconds.append(time.perf_counter() - start)
    if "feeds" in watch:
        np.savez(feeds_path, **watch["feeds"])
    feeds = dict(np.load(feeds_path))
    outputs = dict(zip(step.output_names, step.infer(feeds)))
    np.save(out / "tail.npy", tail)
    np.save(out / "step.npy", outputs["next_latents"])
    np.save(out / "eps.npy", outputs["uncond_out"])
    report = {"backend": rt.graph_set.backend, "reason": rt.graph_set.reason, "n": n, "tail_steps": k,
              "load_seconds": loaded, "warm_seconds": warm, "seconds": seconds,
              "unet_rows_per_tail": watch["unet_rows"] / repeats,
              "peak_rss_loaded_bytes": rss_loaded,
              "peak_rss_bytes": peak_rss()}  # fmt: skip
    rt.deactivate()
    return report


def _watch_calls(graph, capture: bool) -> dict[str, Any]:
    """Counts the UNet rows of the step graph's bound calls once ``armed`` (``2N - E``, padding
    rows included: what the engine computed) and, with ``capture``, copies the inputs of the
    first armed call as it starts: what the step loop really feeds it (rows, K/V,
    coefficients), for every engine to run once more. A later call whose every row computes its
    unconditional prediction replaces it (an entry step's are given, so its ``uncond_out`` is
    the base's passed through, the same on every engine)."""
    from edit_rt.runtime.engine.backend_ov import host_array

    watch: dict[str, Any] = {"armed": False, "unet_rows": 0}
    bind = graph.bind

    def watched_bind(inputs, outputs):
        binding = bind(inputs, outputs)
        run = binding.run
        given = inputs["uncond_given"].shape[0]
        rows = 2 * inputs["latents"].shape[0] - given

        def watched_run() -> None:
            if watch["armed"]:
                watch["unet_rows"] += rows
                if capture and ("feeds" not in watch or (watch["feeds_given"] and not given)):
                    watch["feeds"] = {name: host_array(view).copy() for name, view in inputs.items()}
                    watch["feeds_given"] = given
            run()

        binding.run = watched_run
        return binding

    graph.bind = watched_bind
    return watch


def unet_flops(model_dir: Path, latent_hw: tuple[int, int]) -> int:
    """FLOPs of one UNet row (batch 1; a step row's CFG pair is two) as torch counts them."""
    import torch
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode

    config = UNet2DConditionModel.load_config(Path(model_dir) / "unet")
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
        x = torch.randn(1, unet.config.in_channels, *latent_hw)
        t = torch.full((1,), 500)
        text = torch.randn(1, 77, unet.config.cross_attention_dim)
        with FlopCounterMode(display=False) as counter:
            unet(x, t, encoder_hidden_states=text)
    return int(counter.get_total_flops())


def machine_limit(threads: int, size: int = 2048, repeats: int = 5) -> dict[str, Any]:
    """The machine's GFLOP/s in fp32 and bf16: the best matmul of ``size``^2 that torch (oneDNN /
    MKL) or OpenVINO (oneDNN's JIT kernels) runs at ``threads`` threads, the best of ``repeats``
    each. Neither library alone reaches the peak everywhere (measured here: torch's fp32 matmul
    222 GFLOP/s against OpenVINO's 421; torch's bf16 959 against 759), so the limit is the
    better of the two; ``by_library`` keeps both."""
    import torch

    torch.set_num_threads(threads)
    by_library: dict[str, dict[str, float]] = {"torch": {}, "openvino": {}}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b
        by_library["torch"][name] = 2 * size**3 / min(_seconds(lambda: a @ b) for _ in range(repeats)) / 1e9
    try:
        import openvino as ov
        from openvino import opset13 as ops
    except ImportError:
        del by_library["openvino"]
    else:
        x, y = ops.parameter([size, size], np.float32), ops.parameter([size, size], np.float32)
        model = ov.Model([ops.matmul(x, y, False, False)], [x, y])
        feeds = [np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)] * 2
        for name, hint in (("fp32", "f32"), ("bf16", "bf16")):
            request = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": hint,
                                                             "INFERENCE_NUM_THREADS": str(threads)}).create_infer_request()  # fmt: skip
            request.infer(feeds)
            by_library["openvino"][name] = 2 * size**3 / min(_seconds(lambda: request.infer(feeds)) for _ in range(repeats)) / 1e9
    return {name: max(lib[name] for lib in by_library.values()) for name in ("fp32", "bf16")} | {"by_library": by_library}


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_engines(config: Path, ns: Sequence[int] = (1, 4, 16), k: int = 10, repeats: int = 3,
                    threads: int = 0, engines: Sequence[tuple[str, str]] = ENGINES, base_steps: Optional[int] = None,
                    rounds: int = 1, say: Callable[[str], None] = print, probe_size: int = 2048) -> dict[str, Any]:  # fmt: skip
    """Every engine at every N, side by side; the report (``engines``, ``points``, ``failed``).
    ``probe_size``: the side of the matmul the machine's limit is measured on (a test's smaller:
    the limit is then a lower bound, the bench's 2048 near the peak).

    ``rounds``: the whole sweep that many times, the engines' order rotated each round (a shared
    machine drifts between processes: one round's ratios moved 2x between two runs here); a
    point's time is the median of all its rounds' tails, its peak RSS the largest."""
    from edit_rt.runtime.config.load import load_config
    from edit_rt.runtime.engine.backend_ov import bf16_unavailable_reason
    from edit_rt.runtime.engine.manifest import load_manifest

    cfg = load_config(Path(config))
    threads = threads or cfg.threads or os.cpu_count() or 1
    if bf16_unavailable_reason() is not None:
        say(f"bench engines: no bf16 here ({bf16_unavailable_reason()})")
        engines = [e for e in engines if e[1] != "bf16"]
    scale = load_manifest(cfg.onnx_dir).vae_scale_factor
    latent_hw = (cfg.base.height // scale, cfg.base.width // scale)
    # counted and measured in a process of their own, as each engine runs: OpenVINO's and torch's
    # thread pools stay out of the caller's process (a test's, a server's)
    probe = [sys.executable, "-m", "edit_rt.export.bench.cpu_engines", str(config), "--probe",
             json.dumps([str(cfg.require_model_dir()), list(latent_hw), threads, probe_size])]  # fmt: skip
    done = subprocess.run(probe, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"counting the UNet's FLOPs and the machine's limit failed:\n{done.stderr[-3000:]}")
    flops, limit = json.loads(done.stdout.strip().splitlines()[-1])
    say(f"bench engines: {flops / 1e9:.1f} GFLOP a UNet row; machine limit {limit['fp32']:.0f} GFLOP/s fp32, "
        f"{limit['bf16']:.0f} bf16 ({threads} threads)")  # fmt: skip
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    latents: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    failed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="edit-rt-engines-") as tmp:
        state_path = Path(tmp) / "base.pkl"
        for r, n in ((r, n) for r in range(rounds) for n in ns):
            for backend, precision in [*engines[r % len(engines):], *engines[: r % len(engines)]]:
                name = engine_name(backend, precision)
                out = Path(tmp) / f"{name.replace(' ', '-')}-{n}"
                out.mkdir(exist_ok=True)
                args = [sys.executable, "-m", "edit_rt.export.bench.cpu_engines", str(config), "--child",
                        json.dumps([backend, precision, n, k, repeats, threads, str(state_path), str(out), base_steps])]  # fmt: skip
                done = subprocess.run(args, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
                if done.returncode != 0:  # killed for memory (-9), say: kept as a row of its own
                    failed.append({"engine": name, "n": n, "returncode": done.returncode, "stderr": done.stderr[-2000:]})
                    say(f"bench engines: {name} N={n} failed (exit {done.returncode}): {done.stderr[-500:]}")
                    continue
                report = json.loads(done.stdout.strip().splitlines()[-1])
                if (name, n) in runs:  # another round: its tails join the earlier ones'
                    earlier = runs[(name, n)]
                    report["seconds"] = earlier["seconds"] + report["seconds"]
                    report["peak_rss_bytes"] = max(earlier["peak_rss_bytes"], report["peak_rss_bytes"])
                runs[(name, n)] = report
                latents[(name, n)] = {kind: np.load(out / f"{kind}.npy") for kind in ("tail", "step", "eps")}
                say(f"bench engines: {name} N={n}: {statistics.median(report['seconds']):.3f} s a {k}-step tail, "
                    f"peak RSS {report['peak_rss_bytes'] / 1e9:.2f} GB")  # fmt: skip
    points = []
    for (name, n), report in runs.items():
        seconds = statistics.median(report["seconds"])
        ours = latents[(name, n)]
        reference = latents.get(("ort-cpu", n))  # None where ort-cpu failed at this N

        def diff(kind: str) -> Optional[float]:
            return None if reference is None else float(np.abs(ours[kind] - reference[kind]).max())


        precision = "bf16" if name.endswith("bf16") else "fp32"
        gflops = flops * report["unet_rows_per_tail"] / seconds / 1e9
        points.append({
            "engine": name, "backend": report["backend"], "n": n, "tail_steps": k, "seconds": seconds, "runs": [round(s, 4) for s in report["seconds"]],
            "edits_per_s": n / seconds, "seconds_per_step_call": seconds / k, "unet_rows_per_tail": report["unet_rows_per_tail"],
            "gflops_per_s": gflops, "fraction_of_limit": gflops / limit[precision],
            "max_abs_diff_step_vs_ort": diff("step"), "max_abs_diff_eps_vs_ort": diff("eps"),
            "max_abs_diff_tail_vs_ort": diff("tail"), "latent_scale": float(np.abs(ours["step"]).max()),
            "peak_rss_bytes": report["peak_rss_bytes"], "peak_rss_loaded_bytes": report["peak_rss_loaded_bytes"],
            "load_seconds": report["load_seconds"], "warm_seconds": report["warm_seconds"], "reason": report["reason"],
        })  # fmt: skip
    speed = {(p["engine"], p["n"]): p["seconds"] for p in points}
    for p in points:
        p["speedup_vs_ort"] = speed[("ort-cpu", p["n"])] / p["seconds"] if ("ort-cpu", p["n"]) in speed else None
    return {"model": str(cfg.model), "latent": list(latent_hw), "threads": threads, "tail_steps": k,
            "repeats": repeats, "rounds": rounds, "gflop_per_unet_row": flops / 1e9, "machine_limit_gflops": limit,
            "engines": [engine_name(*e) for e in engines], "points": points, "failed": failed}  # fmt: skip


def print_table(report: dict[str, Any], say: Callable[[str], None] = print) -> None:
    say("| engine | N | s a step call | edits/s | GFLOP/s (% of limit) | vs ort-cpu | max abs diff vs ort-cpu: latent / eps of one call; tail | peak RSS |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- |")
    def f(value: Optional[float], spec: str, unit: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{unit}"

    for p in sorted(report["points"], key=lambda p: (p["n"], report["engines"].index(p["engine"]))):
        say(f"| {p['engine']} | {p['n']} | {p['seconds_per_step_call']:.3f} | {p['edits_per_s']:.2f} | "
            f"{p['gflops_per_s']:.0f} ({100 * p['fraction_of_limit']:.0f}%) | {f(p['speedup_vs_ort'], '.2f', 'x')} | "
            f"{f(p['max_abs_diff_step_vs_ort'], '.1e')} / {f(p['max_abs_diff_eps_vs_ort'], '.1e')}; "
            f"{f(p['max_abs_diff_tail_vs_ort'], '.1e')} | {p['peak_rss_bytes'] / 1e9:.2f} GB |")  # fmt: skip
    for failure in report.get("failed", []):
        say(f"| {failure['engine']} | {failure['n']} | failed (exit {failure['returncode']}) | | | | | |")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path)
    p.add_argument("--out", type=Path, default=Path("out/bench"))
    p.add_argument("--ns", default="1,4,16")
    p.add_argument("--tail-steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="timed tails per engine, N and round")
    p.add_argument("--rounds", type=int, default=3, help="sweeps over every engine and N, the order rotated")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--base-steps", type=int, default=None, help="the base's steps (default: the config's)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--probe", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        model_dir, latent_hw, threads, size = json.loads(args.probe)
        print(json.dumps([unet_flops(Path(model_dir), tuple(latent_hw)), machine_limit(threads, size)]))
        return 0
    if args.child:
        backend, precision, n, k, repeats, threads, state, out, base_steps = json.loads(args.child)
        report = _child(str(args.config), backend, precision, n, k, repeats, threads, Path(state), Path(out), base_steps)
        print(json.dumps(report))
        return 0
    report = measure_engines(args.config, tuple(int(n) for n in args.ns.split(",")), args.tail_steps, args.repeats,
                             args.threads, base_steps=args.base_steps, rounds=args.rounds)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engines.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
