"""Samplers at equal image quality on a shapes model (export/bench/samplers.py): the steps each
sampler needs to reach 50-step DDIM's prompt following and distance to 100-step DDIM, and the
edit tail's cost there.

    .venv/bin/python scripts/measure_samplers.py [configs/shapes.yaml] [--prompts 100] [--out out/bench-samplers]

Writes samplers.json and samplers.png; prints one line per setting (docs/samplers.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edit_rt.export.bench.samplers import progress_total, run_sampler_bench, summary
from edit_rt.runtime.config.load import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="configs/shapes.yaml")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("out/bench-samplers"))
    args = parser.parse_args()
    cfg = load_config(args.config)
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        print(f"  {done[0]}/{progress_total()} settings", flush=True)

    report = run_sampler_bench(cfg, args.prompts, args.repeats, args.out, advance)
    print("\n".join(summary(report)))


if __name__ == "__main__":
    main()
