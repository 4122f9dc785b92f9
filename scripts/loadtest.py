"""`make loadtest`: edits/s and latency percentiles of `edit-rt serve` at 1, 8 and 32 clients.

Starts the server on a free loopback port with the given config, generates a few bases, then
for each concurrency level runs that many clients, each sending single-edit requests
(``--tail`` steps) against a random base until the level's request count is served. Writes
``<output_dir>/loadtest.json`` and prints a table. Bounded in count and time; loopback only.

    .venv/bin/python scripts/loadtest.py configs/demo.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--requests", type=int, default=32, help="requests per level (at least 2 per client)")
    parser.add_argument("--tail", type=int, default=6, help="tail steps per edit")
    parser.add_argument("--bases", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per level, at most")
    args = parser.parse_args()

    cfg = yaml.safe_load(args.config.read_text())
    port = free_port()
    cfg.setdefault("serve", {}).update(port=port, host="127.0.0.1", queue_limit=1024)
    for key in ("model", "build_dir", "output_dir"):
        if key in cfg and not Path(cfg[key]).is_absolute():
            cfg[key] = str((args.config.parent / cfg[key]).resolve())
    if cfg.get("store", {}).get("disk_dir"):
        cfg["store"]["disk_dir"] = str((args.config.parent / cfg["store"]["disk_dir"]).resolve())
    out_dir = Path(cfg.get("output_dir", "out")).parent / "loadtest"
    out_dir.mkdir(parents=True, exist_ok=True)
    config = Path(tempfile.mkdtemp()) / "loadtest.yaml"
    config.write_text(yaml.safe_dump(cfg))
    url = f"http://127.0.0.1:{port}"
    log = open(out_dir / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "edit_rt.runtime.cli", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit(f"server did not start; see {log.name}")
            time.sleep(0.3)
        ids = []
        for k in range(args.bases):
            r = httpx.post(url + "/v1/images/generations", json={"prompt": f"{cfg['base']['prompt']} {k}", "seed": k}, timeout=300)
            r.raise_for_status()
            ids.append(r.json()["id"])
        levels = []
        for clients in (int(c) for c in args.levels.split(",")):
            n = max(args.requests, 2 * clients)
            rng = random.Random(clients)
            work = [(rng.choice(ids), f"edit {i}", rng.choice([0.5, 1.0, 1.5])) for i in range(n)]
            level_deadline = time.monotonic() + args.timeout

            def one(item):
                bid, prompt, strength = item
                if time.monotonic() > level_deadline:
                    return None
                start = time.perf_counter()
                r = httpx.post(url + "/v1/images/edits", timeout=args.timeout,
                               json={"base_id": bid, "edits": [{"prompt": prompt, "strength": strength, "tail_steps": args.tail}]})  # fmt: skip
                return time.perf_counter() - start if r.status_code == 200 else float("nan")

            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                results = list(pool.map(one, work))
            wall = time.perf_counter() - start
            ok = [s for s in results if s is not None and s == s]
            levels.append({
                "clients": clients, "requests": n, "ok": len(ok), "failed": sum(1 for s in results if s is not None and s != s),
                "seconds": round(wall, 3), "edits_per_s": round(len(ok) / wall, 3),
                "latency_p50_s": round(percentile(ok, 50), 3), "latency_p95_s": round(percentile(ok, 95), 3),
                "latency_p99_s": round(percentile(ok, 99), 3), "latency_mean_s": round(statistics.mean(ok), 3),
            })  # fmt: skip
            print(f"{clients:>3} clients: {levels[-1]['edits_per_s']:.2f} edits/s, p50 {levels[-1]['latency_p50_s']:.2f} s, "
                  f"p95 {levels[-1]['latency_p95_s']:.2f} s, p99 {levels[-1]['latency_p99_s']:.2f} s ({len(ok)}/{n} ok)")  # fmt: skip
        metrics = httpx.get(url + "/metrics").text
        batch_lines = [l for l in metrics.splitlines() if l.startswith("edit_rt_batch_rows")]
        report = {"config": str(args.config), "tail_steps": args.tail, "cpus": os.cpu_count(), "levels": levels,
                  "batch_rows_histogram": batch_lines}  # fmt: skip
        (out_dir / "loadtest.json").write_text(json.dumps(report, indent=2))
        print(f"wrote {out_dir / 'loadtest.json'}")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        log.close()


if __name__ == "__main__":
    main()
