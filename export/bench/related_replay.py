"""The replay of export/bench/related_workload.py: ``edit-rt serve`` as a subprocess on a fresh store
with a setting's ``serve.related``, a stream of generation requests from concurrent clients,
each request's latency, reply and image, and the counters of ``/metrics`` around it."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import yaml

ROWS = "edit_rt_unet_rows_total"
COUNTERS = (ROWS, "edit_rt_unet_padding_rows_total", "edit_rt_related_hits_total", "edit_rt_related_misses_total",
            "edit_rt_related_steps_saved_total", "edit_rt_bases_generated_total")  # fmt: skip


# --- the server --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_config(config: Path, folder: Path, port: int, thresholds: Optional[list[dict]]) -> Path:
    """A config for ``edit-rt serve`` derived from ``config``: its paths absolute, a fresh
    store under ``folder``, related generations on at ``thresholds`` (None: off)."""
    config = Path(config).resolve()
    raw = yaml.safe_load(config.read_text())
    for key in ("model", "build_dir"):
        if key in raw:
            path = Path(raw[key])
            raw[key] = str(path if path.is_absolute() else (config.parent / path).resolve())
    raw["output_dir"] = str(folder / "out")
    raw["store"] = {**raw.get("store", {}), "ram_mb": 512, "disk_dir": str(folder / "bases"), "disk_mb": 2048}
    # share_bases: the study follows each hit to the base it came from (its replies' base_id)
    related = {"enabled": thresholds is not None, "share_bases": True}
    if isinstance(thresholds, dict):  # the whole section ({thresholds, embedding}), and "store": its overrides
        section = dict(thresholds)
        store = {**raw["store"], **section.pop("store", {})}
        raw["store"] = {k: v for k, v in store.items() if v is not None}  # disk_dir: null, RAM only
        related.update(section)
    elif thresholds is not None:
        related["thresholds"] = thresholds
    raw["serve"] = {**raw.get("serve", {}), "host": "127.0.0.1", "port": port, "related": related}
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class Server:
    """``edit-rt serve`` as a subprocess (its log in the folder), ready once /health answers."""

    def __init__(self, config: Path, folder: Path, thresholds: Optional[list[dict]], timeout: float = 180):
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = server_config(config, folder, self.port, thresholds)
        self.log = open(folder / "serve.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "edit_rt.runtime.apps.cli", "serve", str(self.config)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        try:
            wait_healthy(self.proc, self.url, Path(self.log.name), timeout, interval=0.3)
        except TimeoutError:
            self.stop()
            raise

    def stop(self, timeout: float = 60) -> bool:
        """SIGTERM and wait: True when it shut down gracefully."""
        terminate(self.proc, timeout)
        self.log.close()
        return "Application shutdown complete" in Path(self.log.name).read_text()


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float, interval: float = 0.2) -> None:
    """Until ``url``/health answers 200: RuntimeError (with the end of ``log``) if ``proc`` exits
    first, TimeoutError after ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"edit-rt serve exited with {proc.returncode}; its log ({log}) ends:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"edit-rt serve not ready after {timeout} s; see {log}")


def terminate(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (a server drains and shuts down), then wait; killed if it does not end in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def read_metrics(url: str) -> dict[str, float]:
    """The counters of :data:`COUNTERS`, summed over their labels."""
    import httpx

    out = dict.fromkeys(COUNTERS, 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        name = name.split("{", 1)[0]
        if name in out:
            out[name] += float(value)
    return out


# --- the replay ------------------------------------------------------------------------------


def decode_png(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.float32) / 255.0


async def _replay(url: str, items: list[Any], clients: int, size: str) -> tuple[list[dict], float]:
    import httpx

    records: list[Optional[dict]] = [None] * len(items)
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)

    async def client(http: httpx.AsyncClient) -> None:
        while True:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t = time.perf_counter()
            r = await http.post(url + "/v1/images/generations", json={"prompt": item.prompt, "size": size, "n": 1})
            seconds = time.perf_counter() - t
            if r.status_code != 200:
                raise RuntimeError(f"request {item.index} got {r.status_code}: {r.text[:300]}")
            reply = r.json()
            records[item.index] = {"index": item.index, "id": reply["id"], "seconds": seconds, "seed": reply["seed"],
                                   "related": reply["info"]["related"][0], "header": r.headers.get("X-Edit-RT-Related"),
                                   "png": reply["data"][0]["b64_json"]}  # fmt: skip

    t = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return records, time.perf_counter() - t  # type: ignore[return-value]


def warm_up(url: str, size: str, steps: int) -> None:
    """Two generations in another group than the stream's (other steps: never a related base
    of it), so the first requests do not pay the engines' first calls."""
    import httpx

    for p in ("a red circle on a blue background, center", "a green square on a white background, top left"):
        r = httpx.post(url + "/v1/images/generations", json={"prompt": p, "size": size, "steps": steps, "seed": 1, "related": False}, timeout=300)
        r.raise_for_status()


def replay_setting(config: Path, thresholds: Optional[list[dict]], items: list[Any], clients: int, steps: int,
                   size: str, log: Callable[[str], None] = print) -> dict:  # fmt: skip
    """One setting's replay on a fresh server and store: its records, wall time and counters."""
    with tempfile.TemporaryDirectory(prefix="edit-rt-related-") as tmp:
        for attempt in range(3):  # a start that fails (a port taken meanwhile): its log said, then again
            try:
                server = Server(config, Path(tmp) / f"try{attempt}", thresholds)
                break
            except RuntimeError as err:
                log(f"  the server did not start ({err}); trying again")
                if attempt == 2:
                    raise
        try:
            warm_up(server.url, size, max(2, steps - 1))
            before = read_metrics(server.url)
            records, wall = asyncio.run(_replay(server.url, items, clients, size))
            after = read_metrics(server.url)
        finally:
            clean = server.stop()
        if not clean:
            log(f"  (the server did not report a clean shutdown; its log: {server.log.name})")
    return {"records": records, "wall_seconds": wall, "counters": {k: after[k] - before[k] for k in COUNTERS}, "clean_shutdown": clean}
