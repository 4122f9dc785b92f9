"""`make loadtest`: edits/s and latency percentiles of `edit-rt serve` at 1, 8 and 32 clients;
`make loadtest-ray`: the same at 1 and 2 Ray Serve replicas, and the routers side by side.

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


def start_server(cfg: dict, out_dir: Path, name: str, ray: bool) -> tuple[subprocess.Popen, str, object]:
    """`edit-rt serve` (or `serve --ray`) with ``cfg`` on a free loopback port, once ready."""
    port = free_port()
    cfg = {**cfg, "serve": {**cfg.get("serve", {}), "port": port, "host": "127.0.0.1", "queue_limit": 1024}}
    config = Path(tempfile.mkdtemp()) / "loadtest.yaml"
    config.write_text(yaml.safe_dump(cfg))
    url = f"http://127.0.0.1:{port}"
    log = open(out_dir / f"{name}.log", "w")
    command = [sys.executable, "-m", "edit_rt.runtime.apps.cli", "serve", str(config), *(["--ray"] if ray else [])]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server, url, log
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            server.kill()
            sys.exit(f"server did not start; see {log.name}")
        time.sleep(0.3)


def stop_server(server: subprocess.Popen, log) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(120)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()


def make_bases(url: str, prompt: str, n: int) -> list[str]:
    ids = []
    for k in range(n):
        r = httpx.post(url + "/v1/images/generations", json={"prompt": f"{prompt} {k}", "seed": k}, timeout=300)
        r.raise_for_status()
        ids.append(r.json()["id"])
    return ids


def run_level(url: str, ids: list[str], clients: int, args) -> dict:
    """``clients`` clients sending single-edit requests against random bases."""
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
    level = {
        "clients": clients, "requests": n, "ok": len(ok), "failed": sum(1 for s in results if s is not None and s != s),
        "seconds": round(wall, 3), "edits_per_s": round(len(ok) / wall, 3),
        "latency_p50_s": round(percentile(ok, 50), 3), "latency_p95_s": round(percentile(ok, 95), 3),
        "latency_p99_s": round(percentile(ok, 99), 3), "latency_mean_s": round(statistics.mean(ok), 3),
    }  # fmt: skip
    print(f"{clients:>3} clients: {level['edits_per_s']:.2f} edits/s, p50 {level['latency_p50_s']:.2f} s, "
          f"p95 {level['latency_p95_s']:.2f} s, p99 {level['latency_p99_s']:.2f} s ({len(ok)}/{n} ok)")  # fmt: skip
    return level


def edit_requests_by_tier(url: str) -> dict[str, float]:
    """Edit requests by where their replica found the base (ram: its owner), summed over replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=60).text):
        for sample in family.samples:
            if sample.name == "edit_rt_edit_requests_total":
                out[sample.labels["base_tier"]] = out.get(sample.labels["base_tier"], 0.0) + sample.value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--requests", type=int, default=32, help="requests per level (at least 2 per client)")
    parser.add_argument("--tail", type=int, default=6, help="tail steps per edit")
    parser.add_argument("--bases", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per level, at most")
    parser.add_argument("--ray", default=None, help="replica counts to compare on Ray Serve, e.g. 1,2 (`make loadtest-ray`)")
    parser.add_argument("--routing", default="affinity,affinity@100,power_of_two",
                        help="with --ray: routers to compare at the most replicas (affinity@B: load_bound B)")
    args = parser.parse_args()

    cfg = yaml.safe_load(args.config.read_text())
    for key in ("model", "build_dir", "output_dir"):
        if key in cfg and not Path(cfg[key]).is_absolute():
            cfg[key] = str((args.config.parent / cfg[key]).resolve())
    if cfg.get("store", {}).get("disk_dir"):
        cfg["store"]["disk_dir"] = str((args.config.parent / cfg["store"]["disk_dir"]).resolve())
    out_dir = Path(cfg.get("output_dir", "out")).parent / "loadtest"
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.levels.split(",")]
    if args.ray:
        ray_loadtest(cfg, out_dir, [int(n) for n in args.ray.split(",")], args.routing.split(","), levels, args)
        return
    server, url, log = start_server(cfg, out_dir, "server", ray=False)
    try:
        ids = make_bases(url, cfg["base"]["prompt"], args.bases)
        results = [run_level(url, ids, clients, args) for clients in levels]
        metrics = httpx.get(url + "/metrics").text
        batch_lines = [l for l in metrics.splitlines() if l.startswith("edit_rt_batch_rows")]
        report = {"config": str(args.config), "tail_steps": args.tail, "cpus": os.cpu_count(), "levels": results,
                  "batch_rows_histogram": batch_lines}  # fmt: skip
        (out_dir / "loadtest.json").write_text(json.dumps(report, indent=2))
        print(f"wrote {out_dir / 'loadtest.json'}")
    finally:
        stop_server(server, log)


def ray_loadtest(cfg: dict, out_dir: Path, replicas: list[int], routings: list[str], levels: list[int], args) -> None:
    """edits/s at each replica count (the affinity router), and the routers side by side at the
    most replicas; each replica gets cpus / replicas cores and as many ONNX Runtime threads."""
    cpus = os.cpu_count() or 1
    # a routing is "affinity", "affinity@<load_bound>" or "power_of_two"
    runs = [(n, "affinity") for n in replicas] + [(max(replicas), r) for r in routings if r != "affinity"]
    report = {"config": str(args.config), "tail_steps": args.tail, "cpus": cpus, "runs": []}
    print("--- edit-rt serve, one process (no Ray)")
    server, url, log = start_server({**cfg, "threads": cpus}, out_dir, "plain", ray=False)
    try:
        ids = make_bases(url, cfg["base"]["prompt"], args.bases)
        report["plain"] = {"threads": cpus, "levels": [run_level(url, ids, clients, args) for clients in levels]}
    finally:
        stop_server(server, log)
    for n, routing in runs:
        run_cfg = {**cfg, "threads": max(1, cpus // n),
                   "store": {**cfg.get("store", {}), "disk_dir": cfg.get("store", {}).get("disk_dir") or tempfile.mkdtemp()},
                   "serve": {**cfg.get("serve", {}), "ray": {"replicas": n, "cpus_per_replica": cpus / n,
                                                             "routing": routing.split("@")[0]}}}  # fmt: skip
        if "@" in routing:
            run_cfg["serve"]["ray"]["load_bound"] = float(routing.split("@")[1])
        print(f"--- Ray Serve, {n} replica(s), {routing} routing")
        server, url, log = start_server(run_cfg, out_dir, f"ray-{n}-{routing}", ray=True)
        try:
            ids = make_bases(url, cfg["base"]["prompt"], args.bases)
            before = edit_requests_by_tier(url)
            results = [run_level(url, ids, clients, args) for clients in levels]
            after = edit_requests_by_tier(url)
        finally:
            stop_server(server, log)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        total = sum(delta.values())
        owner = delta.get("ram", 0.0) / total if total else float("nan")
        print(f"    edits served by their base's owner: {owner:.3f} ({delta})")
        report["runs"].append({"replicas": n, "routing": routing, "threads_per_replica": run_cfg["threads"],
                               "levels": results, "edits_by_base_tier": delta, "owner_share": round(owner, 4)})  # fmt: skip
    top = {r["replicas"]: r for r in report["runs"] if r["routing"] == "affinity"}
    if len(top) > 1:
        lo, hi = min(top), max(top)
        report["speedup"] = {str(c["clients"]): round(b["edits_per_s"] / c["edits_per_s"], 3)
                             for c, b in zip(top[lo]["levels"], top[hi]["levels"])}  # fmt: skip
        print(f"edits/s at {hi} vs {lo} replicas: {report['speedup']}")
    (out_dir / "loadtest-ray.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out_dir / 'loadtest-ray.json'}")


if __name__ == "__main__":
    main()
