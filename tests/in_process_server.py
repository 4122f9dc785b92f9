"""The app `edit-rt serve` runs, built from the same config file and loaded in this process, with
a client that reaches it over ASGI (Starlette's TestClient: httpx over the app, no socket).

For the checks of HTTP behaviour (routes, answers, refusals, auth, metrics), which need neither a
socket nor a process: a real process costs a Python start and an engine load each. What needs
the socket or the process (drain on SIGTERM, kill -9, slow clients, a third-party client that
wants a URL) stays with :class:`server_process.ServerProcess`.

Entering the client runs the app's lifespan, as uvicorn does: the service loads in its own
thread and shuts down when the client closes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from unittest import mock

from starlette.testclient import TestClient

from edit_rt.runtime.config.load import load_config
from edit_rt.runtime.web.server import create_app

from .server_process import server_config

# A loopback server answers only Host 127.0.0.1, localhost or [::1] (request_checks.py); the port
# is never bound, only named in Host and Origin.
PORT = 8188


class _Client(TestClient):
    def request(self, method, url, **kwargs):
        # no socket to time out on: the app answers in this process (TestClient warns on one)
        kwargs.pop("timeout", None)
        return super().request(method, url, **kwargs)


class InProcessServer:
    """Same arguments as ServerProcess; ``client`` takes paths (``server.client.post("/v1/...")``)."""

    def __init__(self, tmp: Path, model_dir: Path, onnx_dir: Path, serve: dict | None = None, env: dict | None = None,
                 base: dict | None = None, wait: bool = True, store: dict | None = None, extra: dict | None = None):  # fmt: skip
        self.port = PORT
        self.url = f"http://127.0.0.1:{PORT}"
        self.config = server_config(tmp, PORT, model_dir, onnx_dir, serve, base, store, extra)
        # the token and Basic users are read when the app is built, as `edit-rt serve` reads them
        environ = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
        with mock.patch.dict(os.environ, environ, clear=True):
            self.app = create_app(load_config(self.config))
        self.service = self.app.state.service
        # raise_server_exceptions=False: an unexpected error is answered 500, as a client of the
        # real server would see it, instead of raised into the test
        self.client = _Client(self.app, base_url=self.url, raise_server_exceptions=False)
        self.client.__enter__()
        deadline = time.monotonic() + 90
        while wait and not self.service.ready.wait(0.05):
            if self.service.load_error or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the service did not load: {self.service.load_error or 'not in 90 s'}")

    def stop(self) -> bool:
        """Close the client: the lifespan's shutdown stops the service. True, as ServerProcess's."""
        self.client.__exit__(None, None, None)
        return True
