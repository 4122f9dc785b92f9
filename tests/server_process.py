"""`edit-rt serve` as a real process: the one launcher of the tests, whether the server is to run
(:class:`ServerProcess`, on a free loopback port) or to refuse and end (:func:`serve_to_its_end`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from edit_rt.export.bench.related_replay import free_port, terminate, wait_healthy

CLI = [sys.executable, "-m", "edit_rt.runtime.apps.cli"]
# The console script pip installed (pyproject's [project.scripts]), for the tests whose point is
# what a shell runs: its exit status, its one line.
ENTRY_POINT = [str(Path(sys.executable).with_name("edit-rt"))]


def serve_to_its_end(config: Path, *args: str, env: dict | None = None, cli: list[str] = CLI,
                     timeout: float = 60) -> subprocess.CompletedProcess:  # fmt: skip
    """`edit-rt serve CONFIG ARGS` that is to end by itself (a refusal, a busy port), its output
    captured as text; ``env`` is laid over this process's environment, a value of None taken out."""
    environ = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    return subprocess.run([*cli, "serve", str(config), *args], capture_output=True, text=True, timeout=timeout,
                          env=environ)  # fmt: skip


def server_config(tmp: Path, port: int, model_dir: Path, onnx_dir: Path, serve: dict | None = None,
                  base: dict | None = None, store: dict | None = None, extra: dict | None = None) -> Path:  # fmt: skip
    """The tests' serve config (the tiny model, 6 steps at 32x32, a store under ``tmp``), written
    to ``tmp/serve-PORT.yaml``; ``serve``, ``base``, ``store`` and ``extra`` lay fields over it."""
    config = {
        "model": str(model_dir),
        "build_dir": str(onnx_dir.parent.parent),
        "base": base or {"prompt": "x", "steps": 6, "guidance": 7.5, "width": 32, "height": 32},
        "engines": {"min_batch": 1, "opt_batch": 8, "max_batch": 16},
        "store": store or {"ram_mb": 64, "disk_dir": str(tmp / "bases"), "disk_mb": 256},
        "serve": {"port": port, **(serve or {})},
        **(extra or {}),
    }
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / f"serve-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class ServerProcess:
    def __init__(self, tmp: Path, model_dir: Path, onnx_dir: Path, serve: dict | None = None, env: dict | None = None,
                 base: dict | None = None, wait: bool = True, store: dict | None = None, extra: dict | None = None):  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = server_config(tmp, self.port, model_dir, onnx_dir, serve, base, store, extra)
        # over the socket; the same attribute as InProcessServer's, so a check runs on either. A
        # connection per request, as httpx.post's: a drain or a kill meets no pooled connection
        self.client = httpx.Client(base_url=self.url, limits=httpx.Limits(max_keepalive_connections=0))
        self.log = open(tmp / f"serve-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [*CLI, "serve", str(self.config)],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )  # fmt: skip
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 90) -> None:
        wait_healthy(self.proc, self.url, Path(self.log.name), timeout)

    def stop(self, timeout: float = 60) -> bool:
        """SIGTERM, then wait: True when the server shut down gracefully.

        uvicorn re-raises the signal once its graceful shutdown is done, so the exit status is
        -SIGTERM either way; the log tells a clean shutdown apart.
        """
        terminate(self.proc, timeout)
        self.client.close()
        self.log.close()
        text = Path(self.log.name).read_text()
        return self.proc.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in text
