"""How `edit-rt serve` runs its app: uvicorn, with a drain on SIGTERM and timeouts for slow clients.

- **Drain.** On SIGTERM (or SIGINT) the service first stops admitting: every new request gets
  503 with ``Retry-After`` (the socket stays open, so clients are told, not refused); the rows
  in flight get ``serve.drain_timeout_s`` to finish; whatever is left then fails with a proper
  error (a JSON 503, or an ``error`` event on a stream); then uvicorn shuts down as usual. A
  second signal ends the wait (a second SIGINT, as in uvicorn, exits at once).
- **Slow clients.** A connection that has not sent a whole request head within
  ``serve.header_timeout_s`` is closed (uvicorn has no such timer of its own); a request body
  that stalls for ``serve.body_timeout_s`` is answered 408 (the app's middleware).
- **Access log** without query strings: a token given as ``?token=`` never reaches a log.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request head is not in after ``seconds``."""

    class HeaderTimeoutH11(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(seconds, self._head_timeout)

        def _head_timeout(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                log.info("closed a connection that sent no request head in %.0f s", seconds)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self._head_timer is not None:
                self._head_timer.cancel()  # a request is in: keep-alive timing is uvicorn's
                self._head_timer = None

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutH11


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains the service before shutting down."""

    def __init__(self, config: uvicorn.Config, start_drain: Callable[[], None], drained: Callable[[], bool],
                 finish: Callable[[], None], drain_timeout_s: float):  # fmt: skip
        super().__init__(config)
        self.start_drain = start_drain
        self.drained = drained
        self.finish = finish
        self.drain_timeout_s = drain_timeout_s
        self.draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.draining:
            super().handle_exit(sig, frame)  # a second signal: stop waiting (twice SIGINT: at once)
            return
        self.draining = True
        self.start_drain()
        threading.Thread(target=self._drain, args=(sig, frame), name="edit-rt-drain", daemon=True).start()

    def _drain(self, sig: int, frame: Any) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while not self.drained() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.finish()  # rows still running fail with a clear error, not a cut connection
        log.info("drained; shutting down")
        super().handle_exit(sig, frame)
