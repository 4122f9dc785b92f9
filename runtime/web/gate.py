"""The gate every HTTP request passes: the answer to one the router never sees, and each answer
counted and logged.

Before routing, in this order: what the request's method and headers say (request_checks.py:
Host, one Authorization, the method, same origin, JSON), a draining server (503, ``/health``
answers ``draining``), a body too large or a POST without its length, credentials
(credentials.py) on the API's paths and ``/metrics``, and engines still loading. Every answer,
refusals included, is observed in ``/metrics`` under the template of the route its path lands
on, or ``unmatched`` (route_table.py), never under the path a client chose; the access log
writes the path, never the query string (tokens travel there).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from .credentials import Credentials
from .http_errors import ApiError
from .request_checks import API_PREFIXES, refusal
from .route_table import Routed

access = logging.getLogger("edit_rt.access")

KNOWN_METHODS = frozenset({"GET", "POST", "DELETE", "HEAD", "OPTIONS", "PUT", "PATCH"})


def error_response(err: ApiError) -> JSONResponse:
    """``err`` as the API's one error shape, with its status and headers."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class Gate:
    """ASGI middleware (the app's outermost): refusals before routing, then metrics and the access
    log. The service and the route table are the request's app's (``app.state``).

    A plain ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one runs the app behind a
    ``receive`` of its own through which ``Request.is_disconnected()`` never sees the client leave
    (its task group swallows the disconnect under the cancelled scope Starlette polls with), so a
    plain request's rows ran on after their client was gone (found at stop 64: the pin released
    only when they finished). Here the app reads the server's own ``receive``."""

    def __init__(self, app, loopback: bool, credentials: Credentials, max_body_bytes: int):
        self.app = app
        self.loopback = loopback
        self.credentials = credentials
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        request = HttpRequest(scope, receive)
        routed = request.app.state.routes.at(scope)
        answered: dict = {}  # the status and the seconds to it, when the answer starts

        async def observed(message) -> None:
            if message["type"] == "http.response.start" and not answered:
                answered.update(status=message["status"], seconds=time.perf_counter() - start)
            await send(message)

        refused = self.refused(request, routed)
        try:
            await (refused(scope, receive, observed) if refused is not None else self.app(scope, receive, observed))
        finally:
            # labels stay bounded: a route's template (never the path a client chose), a known method
            status = str(answered.get("status", 500))  # an app that raised before answering: the 500 Starlette sends
            method = request.method if request.method in KNOWN_METHODS else "OTHER"
            metrics = request.app.state.service.metrics
            metrics.http.labels(routed.template or "unmatched", method, status).observe(
                answered.get("seconds", time.perf_counter() - start))
            access.info("%s %s %s", method, request.url.path[:200], status)  # never the query string

    def refused(self, request: HttpRequest, routed: Routed) -> Optional[Response]:
        """The answer to a request the router never sees; None: route it."""
        service = request.app.state.service
        path = request.url.path
        refused = refusal(request, self.loopback, routed)  # Host, one Authorization, the method, same origin, JSON
        if refused is not None:
            return error_response(refused)
        if service.draining.is_set():
            if path == "/health":
                return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
            return error_response(ApiError(503, "the server is shutting down; retry on another replica or later",
                                           "server_error", code="shutting_down", headers={"Retry-After": "5"}))  # fmt: skip
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return error_response(ApiError(413, f"the body is larger than {self.max_body_bytes} bytes", code="body_too_large"))
        if request.method == "POST" and length is None and routed.template is not None:
            return error_response(ApiError(411, "a Content-Length header is required", code="length_required"))
        guarded = path.startswith(API_PREFIXES) or path == "/metrics"
        credentials = self.credentials
        # the raw header's bytes (refusal() has made sure there is at most one)
        if credentials.required and guarded and not credentials.accept(dict(request.scope["headers"]).get(b"authorization", b"")):
            response = error_response(ApiError(401, credentials.wanted(), "authentication_error"))
            for challenge in credentials.challenges():  # one header each
                response.headers.append("WWW-Authenticate", challenge)
            return response
        if path.startswith(API_PREFIXES) and not service.ready.is_set():
            why = service.load_error or "the engines are loading"
            return error_response(ApiError(503, f"not ready: {why}", "server_error", headers={"Retry-After": "5"}))
        return None
