"""Related generations on the shapes world (export/bench/related_workload.py): a stream of near-repeat
prompts replayed against `edit-rt serve`, related off vs on at several threshold settings; UNet
rows saved, hit rate, latency, throughput, prompt following vs exact, the leftover rate, and the
prompt embedding's similarity distributions.

    .venv/bin/python scripts/measure_related.py [configs/shapes.yaml] [--requests 150] [--out out/related]

Writes related.json and related.png; prints one line per setting (docs/related.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edit_rt.export.bench.related_workload import SETTINGS, run_related, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="configs/shapes.yaml")
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--scenes", type=int, default=12, help="popular base scenes (Zipf popularity)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=300, help="prompt pairs per kind for the embedding study")
    parser.add_argument("--settings", type=str, default=None,
                        help="JSON {name: thresholds or null}, the first null (off); default: the module's SETTINGS")
    parser.add_argument("--out", type=Path, default=Path("out/related"))
    args = parser.parse_args()
    settings = SETTINGS if args.settings is None else json.loads(args.settings)
    report = run_related(Path(args.config), args.requests, args.scenes, args.clients, args.seed, args.out, settings, args.pairs)
    print("\n".join(summary(report)))


if __name__ == "__main__":
    main()
