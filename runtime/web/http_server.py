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
- **The port is bound first** (:func:`listening_sockets`), before the app starts loading
  engines: a busy port is one line and exit status 2, where uvicorn's own bind failure came
  after the loader thread had started and the process aborted (exit 134).
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Any, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import EditRtError

log = logging.getLogger(__name__)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of ``host`` at ``port``, as asyncio's create_server binds
    them (SO_REUSEADDR, IPv6 sockets IPv6-only), for uvicorn to listen on; a failure is an
    :class:`EditRtError` naming the setting to change."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as err:
        for sock in sockets:
            sock.close()
        why = err.strerror or str(err)
        if err.errno == errno.EADDRINUSE:
            raise EditRtError(f"serve.port {port} on {host} is in use ({why}): stop the other server or choose "
                              "another serve.port (or --port)") from None  # fmt: skip
        raise EditRtError(f"cannot listen on {host}:{port} ({why}): choose another serve.host or serve.port "
                          "(or --host, --port)") from None  # fmt: skip
    return sockets


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

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sockets is not None and self.started:
            self._log_started_message(sockets)  # uvicorn logs its "running on" line only when it binds

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
