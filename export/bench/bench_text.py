"""`make bench-text` (issue 56): the masked-diffusion model against its autoregressive baseline of
the same size and data, side by side in one run, on held-out files (export/eval/text_tasks.py).

Every decoding runs the same tasks one at a time (batch 1) in this process, on the exported graphs
(ONNX Runtime, ``--threads``):

- ``ar``: the autoregressive model, greedy, with its K/V cache;
- ``mdm one per step``: the diffusion model decoding one token a step (LLaDA's schedule, steps =
  tokens), the cache off: the quality every faster decoding is held to (within ``--tolerance``);
- ``mdm <k> per step <cache>``: LLaDA's fixed schedule at k tokens a step (``--per-step``), the
  cache off, prefix or dual;
- ``mdm t=<threshold> <cache>``: parallel decoding at each threshold, the cache off, prefix or
  dual, and with token-to-token editing (``edit``).

For each: the share of function bodies that parse, next-line exact matches, tokens per forward
(decoded tokens over graph calls, per row), tokens per second (decoded tokens over wall seconds),
and against the cache-off decoding at the same threshold the share of tokens it changed (the
error of reusing K/V). Then the batch and edit figures on the body tasks' prompts, at the fastest
decoding within the tolerance:

- N = 8 continuations of one prefix as one batch (their prefix's K/V shared) against the same
  8 run one by one;
- a span edit of 10% of a completion (re-masked and decoded, the dual cache: everything outside
  kept) against generating the completion again;
- what one graph call costs here (:func:`call_costs`): the bounds those figures meet on this machine.

Writes ``bench_text.json`` under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from edit_rt.runtime.pipeline.text_pipeline import Decoding, TextPipeline

from ..compile.text_export import export_text
from ..eval.text_tasks import body_parses, body_tasks, line_tasks, next_line_matches
from ..world.text_corpus import corpus_files, split

BODY_TOKENS, LINE_TOKENS = 64, 24


def run_decoding(pipe: TextPipeline, decoding: Decoding, bodies, lines) -> dict:
    """Every task once with ``decoding``: quality, tokens per forward and per second, the ids."""
    parsed, matched, decoded, forwards, seconds, ids = 0, 0, 0, 0, 0.0, []
    for tasks, budget in ((bodies, BODY_TOKENS), (lines, LINE_TOKENS)):
        for task in tasks:
            result = pipe.complete(task.prompt, budget, decoding=decoding)
            decoded += result.stats.decoded
            forwards += result.stats.forwards
            seconds += result.seconds
            ids.append(result.ids[0][result.starts[0]:])
            if tasks is bodies:
                parsed += body_parses(task, result.texts[0])
            else:
                matched += next_line_matches(task, result.texts[0])
    return {"body_parses": parsed / max(1, len(bodies)), "next_line_exact": matched / max(1, len(lines)),
            "quality": (parsed + matched) / max(1, len(bodies) + len(lines)), "tokens": decoded, "forwards": forwards,
            "tokens_per_forward": decoded / max(1, forwards), "tokens_per_s": decoded / max(seconds, 1e-9),
            "seconds": seconds, "_ids": ids}  # fmt: skip


def _changed(ids, reference) -> float:
    """The share of decoded tokens that differ from the reference decoding's (same tasks)."""
    diff = total = 0
    for a, b in zip(ids, reference):
        diff += int((a != b).sum())
        total += len(a)
    return diff / max(1, total)


def batch_and_edit(pipe: TextPipeline, decoding: Decoding, prompts: list[str], n: int = 8) -> dict:
    """N continuations as one batch against one by one; a 10% span edit against generating again.
    ``decoding``: a threshold, or a fixed schedule's tokens a step in ``steps`` (as the runs above)."""
    batched, alone, edit, regen = [], [], [], []
    seeds = list(range(n))
    width = max(1, round(0.1 * BODY_TOKENS))
    per_step = decoding.steps
    span_decoding = decoding if per_step is None else dataclasses.replace(decoding, steps=max(1, width // per_step))
    if per_step is not None:
        decoding = dataclasses.replace(decoding, steps=max(1, BODY_TOKENS // per_step))
    sampling = dataclasses.replace(decoding, temperature=0.8)
    for prompt in prompts:
        t0 = time.perf_counter()
        pipe.complete(prompt, BODY_TOKENS, n=n, decoding=sampling, seeds=seeds)
        batched.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for s in seeds:
            pipe.complete(prompt, BODY_TOKENS, n=1, decoding=sampling, seeds=[s])
        alone.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        base = pipe.complete(prompt, BODY_TOKENS, decoding=decoding)
        regen.append(time.perf_counter() - t0)
        if base.tokens[0] < 2 * width:  # ended almost at once: no 10% span to edit
            regen.pop()
            continue
        a = min(BODY_TOKENS // 2, base.tokens[0] - width)
        t0 = time.perf_counter()
        pipe.span_edit(base, 0, (a, a + width), dataclasses.replace(span_decoding, cache="dual"), seeds=[1])
        edit.append(time.perf_counter() - t0)
    return {"n": n, "batched_s": float(np.sum(batched)), "one_by_one_s": float(np.sum(alone)),
            "batch_speedup": float(np.sum(alone) / np.sum(batched)), "span_fraction": 0.1,
            "span_edit_s": float(np.sum(edit)), "regenerate_s": float(np.sum(regen)),
            "span_edit_cost": float(np.sum(edit) / np.sum(regen)), "prompts": len(prompts)}  # fmt: skip


def call_costs(ar: TextPipeline, mdm: TextPipeline, prompt: int = 150, block: int = 32, n: int = 8, repeats: int = 20) -> dict:
    """What one graph call costs here, at the bench's shapes (a 150-token prompt, a 32-token block):
    the autoregressive model's step (one token over its cache), the diffusion model's dual-cache
    step at 1 and ``n`` rows and its full pass. From them, the tokens a diffusion call must decode
    to give 2x the autoregressive tokens/s, and the most ``n`` rows a call can gain over ``n``
    calls of one row on this machine (``n`` x the one-row call over the ``n``-row call)."""
    rng = np.random.default_rng(0)
    m = mdm.manifest

    def timed(call) -> float:
        for _ in range(3):
            call()
        t0 = time.perf_counter()
        for _ in range(repeats):
            call()
        return (time.perf_counter() - t0) / repeats * 1000

    past = lambda rows, p: rng.standard_normal((m.layers, 2, rows, m.heads, p, m.head_dim)).astype(np.float32)  # noqa: E731
    ids = lambda rows, length: rng.integers(3, m.vocab_size, (rows, length))  # noqa: E731
    ar_past, one, many = past(1, prompt), past(1, prompt + BODY_TOKENS - block), ids(n, block)
    query = np.arange(prompt, prompt + block)
    ms = {"ar_step": timed(lambda: ar.cached(ids(1, 1), np.array([prompt]), ar_past)),
          "mdm_dual_step_1_row": timed(lambda: mdm.cached(many[:1], query, one)),
          f"mdm_dual_step_{n}_rows": timed(lambda: mdm.cached(many, query, one)),
          "mdm_full_1_row": timed(lambda: mdm.full(ids(1, prompt + BODY_TOKENS), np.arange(prompt + BODY_TOKENS)))}  # fmt: skip
    return {"ms": ms, "tokens_per_call_for_2x_ar": 2 * ms["mdm_dual_step_1_row"] / ms["ar_step"],
            f"batch_ceiling_{n}_rows": n * ms["mdm_dual_step_1_row"] / ms[f"mdm_dual_step_{n}_rows"]}  # fmt: skip


def bench(mdm_dir: Path, ar_dir: Path, build: Path, bodies_n: int, lines_n: int, thresholds, threads: int,
          tolerance: float, per_step=(2, 4), say=print) -> dict:  # fmt: skip
    folders = {kind: export_text(src, build / f"text-{kind}" / "onnx") for kind, src in (("mdm", mdm_dir), ("ar", ar_dir))}
    _, held = split(corpus_files())
    report: dict = {"machine": {"cpus": os.cpu_count(), "threads": threads, "python": platform.python_version()},
                    "tolerance": tolerance, "decodings": {}}  # fmt: skip
    with TextPipeline(folders["ar"], threads=threads) as ar, TextPipeline(folders["mdm"], threads=threads) as mdm:
        bodies = body_tasks(held, mdm.tokenizer, bodies_n)
        lines = line_tasks(held, mdm.tokenizer, lines_n)
        report["tasks"] = {"bodies": len(bodies), "lines": len(lines), "reference_bodies_parse": sum(
            body_parses(t, "\n" + t.body) for t in bodies) / max(1, len(bodies))}  # fmt: skip
        mdm.complete("def f(x):\n", 8, decoding=Decoding(cache="dual"))  # sessions made before timing
        ar.complete("def f(x):\n", 8)
        runs = {"ar": (ar, Decoding(threshold=None, steps=1))}
        for k in (1, *per_step):  # LLaDA's fixed schedule, k tokens a step: steps = budget / k on each task kind
            name = "mdm one per step" if k == 1 else f"mdm {k} per step"
            for cache in ("none",) if k == 1 else ("none", "prefix", "dual"):
                runs[name + ("" if k == 1 else f" {cache}")] = (mdm, Decoding(block_length=32, threshold=None, steps=k, cache=cache))
        for t in thresholds:
            for cache in ("none", "prefix", "dual"):
                runs[f"mdm t={t} {cache}"] = (mdm, Decoding(block_length=32, threshold=t, cache=cache))
            runs[f"mdm t={t} dual edit"] = (mdm, Decoding(block_length=32, threshold=t, cache="dual", edit_threshold=0.9))
        ids = {}
        for name, (pipe, decoding) in runs.items():
            if pipe is mdm and decoding.steps is not None:
                # k tokens a step on both task kinds: steps = each kind's budget / k (the schedule is per call)
                k = decoding.steps
                result = run_decoding(pipe, dataclasses.replace(decoding, steps=BODY_TOKENS // k), bodies, [])
                lines_result = run_decoding(pipe, dataclasses.replace(decoding, steps=LINE_TOKENS // k), [], lines)
                result = _merged(result, lines_result, len(bodies), len(lines))
            else:
                result = run_decoding(pipe, decoding, bodies, lines)
            ids[name] = result.pop("_ids")
            base = name.replace(" prefix", " none").replace(" dual edit", " none").replace(" dual", " none")
            result["changed_vs_cache_off"] = _changed(ids[name], ids[base]) if base in ids and base != name else 0.0
            report["decodings"][name] = result
            say(f"{name:24s} quality {result['quality']:.3f} (parse {result['body_parses']:.3f}, line {result['next_line_exact']:.3f})"
                f"  {result['tokens_per_forward']:.2f} tok/fwd  {result['tokens_per_s']:.0f} tok/s")  # fmt: skip
        floor = report["decodings"]["mdm one per step"]["quality"] - tolerance
        within = [(v["tokens_per_s"], k) for k, v in report["decodings"].items()
                  if k.startswith("mdm") and k != "mdm one per step" and v["quality"] >= floor]  # fmt: skip
        best = max(within)[1] if within else "mdm one per step"
        report["fastest_within_tolerance"] = best
        b, a = report["decodings"][best], report["decodings"]["ar"]
        report["vs_ar"] = {"tokens_per_forward": b["tokens_per_forward"], "speedup_tokens_per_s": b["tokens_per_s"] / a["tokens_per_s"],
                           "quality_mdm": b["quality"], "quality_ar": a["quality"]}  # fmt: skip
        decoding = runs[best][1] if best != "mdm one per step" else Decoding(block_length=32, threshold=0.9, cache="dual")
        report["batch_and_edit"] = batch_and_edit(mdm, decoding, [t.prompt for t in bodies[:8]])
        report["call_costs"] = call_costs(ar, mdm)
        costs = report["call_costs"]
        say(f"fastest within {tolerance}: {best}; vs ar {report['vs_ar']['speedup_tokens_per_s']:.2f}x tokens/s; "
            f"8 continuations batched {report['batch_and_edit']['batch_speedup']:.2f}x one by one; "
            f"a 10% span edit {report['batch_and_edit']['span_edit_cost']:.2f}x generating again")  # fmt: skip
        say(f"calls here: ar step {costs['ms']['ar_step']:.2f} ms, mdm dual step {costs['ms']['mdm_dual_step_1_row']:.2f} ms "
            f"(2x the ar's tokens/s needs {costs['tokens_per_call_for_2x_ar']:.1f} tokens a call); 8 rows a call gain at most "
            f"{costs['batch_ceiling_8_rows']:.2f}x over 8 calls")  # fmt: skip
    return report


def _merged(bodies: dict, lines: dict, nb: int, nl: int) -> dict:
    out = {k: bodies[k] + lines[k] for k in ("tokens", "forwards", "seconds")}
    out.update(body_parses=bodies["body_parses"], next_line_exact=lines["next_line_exact"],
               quality=(bodies["body_parses"] * nb + lines["next_line_exact"] * nl) / max(1, nb + nl),
               tokens_per_forward=out["tokens"] / max(1, out["forwards"]), tokens_per_s=out["tokens"] / max(out["seconds"], 1e-9),
               _ids=bodies["_ids"] + lines["_ids"])  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mdm", type=Path, default=Path("export/models/text-mdm"))
    parser.add_argument("--ar", type=Path, default=Path("export/models/text-ar"))
    parser.add_argument("--build", type=Path, default=Path("build"))
    parser.add_argument("--out", type=Path, default=Path("out/bench-text"))
    parser.add_argument("--bodies", type=int, default=60)
    parser.add_argument("--lines", type=int, default=100)
    parser.add_argument("--thresholds", type=float, nargs="*", default=[0.9, 0.7, 0.5, 0.3, 0.2, 0.1])
    parser.add_argument("--per-step", type=int, nargs="*", default=[2, 3, 4], help="LLaDA's fixed schedule at these tokens a step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=0.02, help="quality a faster decoding may lose against one token a step")
    args = parser.parse_args()
    report = bench(args.mdm, args.ar, args.build, args.bodies, args.lines, args.thresholds, args.threads, args.tolerance,
                   args.per_step)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_text.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out / 'bench_text.json'}")


if __name__ == "__main__":
    main()
