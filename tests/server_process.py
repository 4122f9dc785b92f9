"""Start `edit-rt serve` as a real process on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from edit_rt.export.bench.related_replay import free_port, terminate, wait_healthy


class ServerProcess:
    def __init__(self, tmp: Path, model_dir: Path, onnx_dir: Path, serve: dict | None = None, env: dict | None = None,
                 base: dict | None = None, wait: bool = True, store: dict | None = None, extra: dict | None = None):  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "model": str(model_dir),
            "build_dir": str(onnx_dir.parent.parent),
            "base": base or {"prompt": "x", "steps": 6, "guidance": 7.5, "width": 32, "height": 32},
            "engines": {"min_batch": 1, "opt_batch": 8, "max_batch": 16},
            "store": store or {"ram_mb": 64, "disk_dir": str(tmp / "bases"), "disk_mb": 256},
            "serve": {"port": self.port, **(serve or {})},
            **(extra or {}),
        }
        self.config = tmp / f"serve-{self.port}.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.log = open(tmp / f"serve-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edit_rt.runtime.apps.cli", "serve", str(self.config)],
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
        self.log.close()
        text = Path(self.log.name).read_text()
        return self.proc.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in text
