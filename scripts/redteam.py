"""`make redteam`: issue 35's attacks replayed against a real `edit-rt serve` on loopback, all
against one server, while another client asks `/health` every 50 ms.

The server runs configs/sliders.yaml's model with its three adapter slots and five adapters (the
three sliders, two of them also under a second name), related generations on (their replies
naming the base they came from, `share_bases`, so that a reply served from the planted upload
shows) and a disk store in a fresh folder. The attacks, each bounded in count and time:

- bodies: `/v1/images/edits` bodies of 2,000 and 10,000 edits x a 64-point sweep, 40,000 edits
  x a 64-point sweep and 100,000 plain edits (the limit is 64 rows);
- masks: an A1111 inpaint with a 5000x5000 mask and `mask_blur: 64`, twice at once, and another
  client's 32x32 upload meanwhile;
- adapters: 10 concurrent generations, each with one of the 5 adapters on 3 slots, and an
  A1111 txt2img with 4 `<lora:>` tags;
- interrupts: 300 A1111 interrupts and skips while 8 OpenAI generations run;
- related: a FIFO, an entry with a 3-long vector and a planted entry (an upload's base id, its
  vector x1000) in `<disk_dir>/related/`, then related generations; then a restart with the FIFO
  still there;
- answers: 405 before 415, lowercase `bearer`, odd methods, an unknown route.

It writes out/redteam/redteam.json: every answer's status per attack, the slowest `/health`
answer, hangs (a request past its client timeout) and the bars: 0 answers of 500 and above
(a 503 while draining or loading is not asked for here), 0 hangs, `/health` never past 1 s,
the 8 interrupted clients' generations all 200, no reply served from the planted upload.
Exit status 1 when a bar fails.

    python scripts/redteam.py configs/sliders.yaml --out out/redteam
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import yaml
from PIL import Image

from edit_rt.export.bench.related_replay import free_port, terminate, wait_healthy

MAX_POINTS = 64
HANG_S = 120.0  # a request not answered by then is a hang


class Record:
    """Every answer's status by attack, and the requests that hung."""

    def __init__(self):
        self.status: dict[str, Counter] = defaultdict(Counter)
        self.hangs: list[str] = []
        self.notes: dict[str, object] = {}
        self.lock = threading.Lock()

    def send(self, attack: str, method: str, url: str, **kwargs) -> httpx.Response | None:
        try:
            r = httpx.request(method, url, timeout=HANG_S, **kwargs)
        except httpx.TimeoutException:
            with self.lock:
                self.hangs.append(f"{attack}: {method} {url}")
            return None
        with self.lock:
            self.status[attack][r.status_code] += 1
        return r


class HealthPoller(threading.Thread):
    """GET /health every 50 ms; the slowest answer, and any that failed."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.times, self.failures = url, [], 0
        self.phase = "setup"  # the attack running now: the slowest answer is kept per attack
        self.slowest: dict[str, float] = defaultdict(float)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                ok = httpx.get(self.url + "/health", timeout=30).status_code == 200
            except httpx.HTTPError:
                ok = False
            took = time.monotonic() - start
            self.times.append(took)
            self.slowest[self.phase] = max(self.slowest[self.phase], round(took, 3))
            self.failures += not ok
            self.stop.wait(0.05)


def png_b64(array: np.ndarray) -> str:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def edits_body(base_id: str, edits: int, points: int | None) -> str:
    edit = {"prompt": "a blue circle"}
    if points:
        edit["sweep"] = {"adapter": "saturation", "from": -2.0, "to": 2.0, "n": points}
    return json.dumps({"base_id": base_id, "edits": [edit] * edits})


# --- the attacks ----------------------------------------------------------------------------------


def bodies(url: str, rec: Record, base_id: str) -> None:
    for edits, points in ((2_000, MAX_POINTS), (10_000, MAX_POINTS), (40_000, MAX_POINTS), (100_000, None)):
        start = time.monotonic()
        rec.send("bodies", "POST", url + "/v1/images/edits", content=edits_body(base_id, edits, points),
                 headers={"content-type": "application/json"})  # fmt: skip
        rec.notes[f"bodies {edits}x{points or 1} s"] = round(time.monotonic() - start, 3)


def masks(url: str, rec: Record) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    body = {"prompt": "a circle", "init_images": [png_b64(pixels)], "mask": png_b64(np.full((5000, 5000), 255, np.uint8)),
            "mask_blur": 64, "steps": 6, "denoising_strength": 0.5}  # fmt: skip
    with ThreadPoolExecutor(3) as pool:
        big = [pool.submit(rec.send, "masks", "POST", url + "/sdapi/v1/img2img", json=body) for _ in range(2)]
        time.sleep(0.2)
        start = time.monotonic()
        rec.send("masks", "POST", url + "/v1/bases", json={"image": png_b64(pixels), "source_prompt": "a circle"})
        rec.notes["masks: the small upload's s"] = round(time.monotonic() - start, 3)
        for f in big:
            f.result()


def adapters(url: str, rec: Record, names: list[str]) -> None:
    def gen(k: int):
        body = {"prompt": f"a circle {k}", "size": "32x32", "steps": 6, "adapters": {names[k % len(names)]: 0.8}}
        return rec.send("adapters", "POST", url + "/v1/images/generations", json=body)

    with ThreadPoolExecutor(10) as pool:
        list(pool.map(gen, range(10)))
    tags = " ".join(f"<lora:{n}:0.5>" for n in names[:4])
    r = rec.send("adapters", "POST", url + "/sdapi/v1/txt2img", json={"prompt": f"a circle {tags}", "steps": 6})
    rec.notes["adapters: 4 tags on 3 slots"] = None if r is None else r.status_code


def interrupts(url: str, rec: Record) -> None:
    done = threading.Event()

    def storm():
        for k in range(300):
            if done.is_set():
                break
            rec.send("interrupts", "POST", url + ("/sdapi/v1/interrupt" if k % 2 == 0 else "/sdapi/v1/skip"))

    thread = threading.Thread(target=storm)
    thread.start()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda k: rec.send("interrupts", "POST", url + "/v1/images/generations",
                                                   json={"prompt": f"a square {k}", "size": "32x32", "steps": 30}),
                                range(8)))  # fmt: skip
    done.set()
    thread.join()
    rec.notes["interrupts: generations answered 200"] = sum(r is not None and r.status_code == 200 for r in answers)


def related(url: str, rec: Record, disk_dir: Path) -> None:
    prompt = "a red circle on a blue background, top left"
    rec.send("related", "POST", url + "/v1/images/generations", json={"prompt": prompt, "size": "32x32", "related": False})
    folder = disk_dir / "related"
    entries = sorted(folder.glob("*.json"))
    pixels = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    upload = rec.send("related", "POST", url + "/v1/bases", json={"image": png_b64(pixels), "source_prompt": prompt})
    upload_id = upload.json()["id"] if upload is not None and upload.status_code == 200 else None
    os.mkfifo(folder / "fifo.json")
    if entries:
        genuine = json.loads(entries[0].read_text())
        (folder / "short.json").write_text(json.dumps({**genuine, "id": "short", "vector": [1.0, 0.0, 0.0]}))
        if upload_id:
            planted = {**genuine, "id": upload_id, "vector": [v * 1000 for v in genuine["vector"]]}
            (folder / f"{upload_id}.json").write_text(json.dumps(planted))
    served = []
    for k, p in enumerate([prompt, "a red circle on a blue background, top right", "a green square"]):
        r = rec.send("related", "POST", url + "/v1/images/generations",
                     json={"prompt": p, "size": "32x32", "related": True, "seed": 100 + k})  # fmt: skip
        if r is not None and r.status_code == 200:
            served.append(r.headers.get("x-edit-rt-related", ""))
    rec.notes["related: served from the upload"] = sum(bool(upload_id) and upload_id in s for s in served)
    rec.notes["related: related replies"] = len([s for s in served if s])


def answers(url: str, rec: Record) -> None:
    for method, path in (("PUT", "/sdapi/v1/options"), ("POST", "/health"), ("PATCH", "/v1/images/generations"),
                         ("DELETE", "/sdapi/v1/txt2img"), ("GET", "/no/such/route"), ("BREW", "/v1/models")):  # fmt: skip
        rec.send("answers", method, url + path)
    rec.send("answers", "GET", url + "/v1/models", headers={"authorization": "bearer nothing-is-set"})


# --- the run --------------------------------------------------------------------------------------


def server_config(config: Path, folder: Path, port: int) -> tuple[Path, list[str]]:
    """configs/sliders.yaml's model, slots and adapters (each slider, two also under a second
    name: five adapters on three slots), related generations on, a fresh disk store."""
    raw = yaml.safe_load(config.read_text())
    for key in ("model", "build_dir"):
        raw[key] = str((config.parent / raw[key]).resolve())
    sliders = {n: (config.parent / p).resolve() for n, p in raw["adapters"].items()}
    extra = {f"{n}_again": p for n, p in list(sliders.items())[:2]}
    raw["adapters"] = {n: str(p) for n, p in {**sliders, **extra}.items()}
    raw["build_dir"] = str(Path(raw["build_dir"]).parent / "redteam")
    raw.pop("edits", None)
    raw["output_dir"] = str(folder / "out")
    raw["store"] = {"ram_mb": 64, "disk_dir": str(folder / "bases"), "disk_mb": 512}
    raw["serve"] = {"host": "127.0.0.1", "port": port,
                    "related": {"enabled": True, "thresholds": [{"similarity": 0.9, "skip": 0.5}],
                                "share_bases": True}}  # fmt: skip (shared: the replies name the base served)
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, list(raw["adapters"])


def start(path: Path, folder: Path, port: int) -> tuple[subprocess.Popen, float]:
    log = folder / f"serve-{time.time_ns()}.log"
    proc = subprocess.Popen([sys.executable, "-m", "edit_rt.runtime.apps.cli", "serve", str(path)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)  # fmt: skip
    begin = time.monotonic()
    wait_healthy(proc, f"http://127.0.0.1:{port}", log, 180)
    return proc, time.monotonic() - begin


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path, nargs="?", default=Path("configs/sliders.yaml"))
    ap.add_argument("--out", type=Path, default=Path("out/redteam"))
    args = ap.parse_args()
    folder = args.out.resolve()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    path, names = server_config(args.config.resolve(), folder, port)
    for command in ("export", "engines"):
        subprocess.run([sys.executable, "-m", "edit_rt.runtime.apps.cli", command, str(path)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    proc, _ = start(path, folder, port)
    rec, health = Record(), HealthPoller(url)
    health.start()
    try:
        first = rec.send("setup", "POST", url + "/v1/images/generations", json={"prompt": "a red circle", "size": "32x32"})
        base_id = first.json()["id"] if first is not None and first.status_code == 200 else "missing"
        attacks = {"bodies": lambda: bodies(url, rec, base_id), "masks": lambda: masks(url, rec),
                   "adapters": lambda: adapters(url, rec, names), "interrupts": lambda: interrupts(url, rec),
                   "related": lambda: related(url, rec, folder / "bases"), "answers": lambda: answers(url, rec)}  # fmt: skip
        for name, attack in attacks.items():
            health.phase = name
            attack()
    finally:
        health.stop.set()
        health.join()
        terminate(proc, 60)
    # a restart with the FIFO still in the related folder: ready, and related lookups answer
    proc, ready_s = start(path, folder, port)
    try:
        rec.send("restart", "POST", url + "/v1/images/generations",
                 json={"prompt": "a red circle on a blue background, top left", "size": "32x32", "related": True})  # fmt: skip
    finally:
        terminate(proc, 60)
    fivexx = {a: sum(n for s, n in c.items() if s >= 500) for a, c in rec.status.items()}
    report = {
        "status": {a: dict(sorted(c.items())) for a, c in rec.status.items()},
        "requests": sum(sum(c.values()) for c in rec.status.values()),
        "answers_5xx": fivexx,
        "hangs": rec.hangs,
        "health": {"polls": len(health.times), "max_s": round(max(health.times), 3), "failures": health.failures,
                   "max_s_by_attack": dict(health.slowest)},
        "restart_ready_s": round(ready_s, 2),
        "notes": rec.notes,
    }
    report["bars"] = {
        "no 5xx": sum(fivexx.values()) == 0,
        "no hang": not rec.hangs,
        "health within 1 s": report["health"]["max_s"] < 1.0 and health.failures == 0,
        "interrupted clients' generations all 200": rec.notes.get("interrupts: generations answered 200") == 8,
        "nothing served from the planted upload": rec.notes.get("related: served from the upload") == 0,
    }
    (folder / "redteam.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0 if all(report["bars"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
