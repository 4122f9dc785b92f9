"""`edit-rt serve`: the HTTP service (FastAPI on uvicorn), loopback by default.

Route families, one app: edit-rt's own and the OpenAI Images API's (api_openai.py:
``/v1/images/generations``, ``/v1/images/edits``, ``/v1/models``), AUTOMATIC1111's
(api_a1111.py: ``/sdapi/v1/*``), and here ``GET``/``DELETE /v1/bases/{id}``, ``GET /health``,
``GET /metrics`` (Prometheus), ``GET /`` (the editing page), ``GET /openapi.json`` and its pages
``GET /docs``, ``GET /redoc`` (docs.py: offline). The routes
validate and wait; the service's one batcher worker owns the engines (service.py). What a
request's method and headers must say to be let in (Host, the method, origin, content type) is
request_checks.py's; who may call the API, credentials.py's (a bearer token, HTTP Basic users);
how deep its JSON may nest, json_depth.py's. Every answer, refusals included, is counted in
``/metrics`` under the template of the route its path lands on, or ``unmatched``
(route_table.py), never under the path a client chose.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from importlib import resources
from typing import AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from ..config.run_config import RunConfig
from ..metrics import CONTENT_TYPE
from ..serving.http_errors import ApiError, validation_error
from ..serving.service import Service
from .api import BaseInfo, BaseUpload, Deleted, EditsRequest, GenerationRequest, Health, errors
from .api_a1111 import a1111_routes
from .api_openai import openai_routes
from .credentials import Credentials, api_auth_of, token_of
from .docs import docs_routes
from .json_depth import JsonDepthLimit
from .openapi_bodies import body_schemas
from .request_checks import API_PREFIXES, SAFE_METHODS, refusal
from .route_table import RouteTable, Routed

log = logging.getLogger(__name__)
access = logging.getLogger("edit_rt.access")

KNOWN_METHODS = frozenset({"GET", "POST", "DELETE", "HEAD", "OPTIONS", "PUT", "PATCH"})


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def page_html(service: Service) -> str:
    """The editing page, with the served config's defaults filled in (as JSON, never as HTML)."""
    cfg = service.cfg
    defaults = {"negative_prompt": cfg.base.negative_prompt or "", "strength": cfg.cache.default_strength,
                "tail_fraction": cfg.cache.default_tail_fraction, "steps": cfg.base.steps,
                "preserve": cfg.preserve.mode, "structure": cfg.preserve.structure, "width": cfg.base.width, "height": cfg.base.height}  # fmt: skip
    # "</" cannot close the script element from inside a JSON string this way
    data = json.dumps(defaults).replace("</", "<\\/")
    return resources.files("edit_rt.runtime.web").joinpath("web.html").read_text().replace("/*DEFAULTS*/{}", data)


def create_app(cfg: RunConfig, service: Optional[Service] = None) -> FastAPI:
    """The one app: over a local :class:`Service` (engines in this process), or over one whose
    operations run on Ray Serve replicas (``ray_serve.RayService``), with the same routes."""
    service = service if service is not None else Service(cfg)
    limits = cfg.serve

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=service.load, name="edit-rt-loader", daemon=True).start()
        yield
        await asyncio.to_thread(service.shutdown)

    # docs_url/redoc_url None: FastAPI's pages load from a CDN; docs.py serves them offline
    app = FastAPI(title="edit-rt", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Batched edit tails for Stable Diffusion: generate a base once, edit it many times.")  # fmt: skip
    app.state.service = service
    # innermost first: the depth check reads the body through BodyTimeout's timed receive
    app.add_middleware(JsonDepthLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(BodyTimeout, seconds=cfg.serve.body_timeout_s)

    @app.exception_handler(ApiError)
    async def api_error(_, err: ApiError):
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, err: RequestValidationError):
        # a body's field named by its request model, for the range declared on it
        return _error_response(validation_error(err.errors(), candidates=(EditsRequest, GenerationRequest, BaseUpload)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(err.status_code, str(err.detail), kind, headers=dict(err.headers or {})))

    @app.exception_handler(ClientDisconnect)
    async def client_left(_, err: ClientDisconnect):
        # a client gone before its body was complete (a form upload): nobody to answer, nothing to log
        return _error_response(ApiError(499, "client disconnected", code="client_closed"))

    @app.exception_handler(Exception)
    async def unexpected(_, err: Exception):
        log.exception("unexpected error")
        return _error_response(ApiError(500, "internal error; see the server log", "server_error"))

    loopback = cfg.serve.host in ("127.0.0.1", "localhost", "::1")
    credentials = Credentials(token_of(cfg.serve), api_auth_of(cfg.serve))

    def refused_before_routing(request: HttpRequest, routed: Routed) -> Optional[Response]:
        """The answer to a request the router never sees; None: route it."""
        path = request.url.path
        refused = refusal(request, loopback, routed)  # Host, one Authorization, the method, same origin, JSON
        if refused is not None:
            return _error_response(refused)
        if service.draining.is_set():
            if path == "/health":
                return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
            return _error_response(ApiError(503, "the server is shutting down; retry on another replica or later",
                                            "server_error", code="shutting_down", headers={"Retry-After": "5"}))  # fmt: skip
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            return _error_response(ApiError(413, f"the body is larger than {limits.max_body_bytes} bytes", code="body_too_large"))
        if request.method == "POST" and length is None and routed.template is not None:
            return _error_response(ApiError(411, "a Content-Length header is required", code="length_required"))
        guarded = path.startswith(API_PREFIXES) or path == "/metrics"
        # the raw header's bytes (refusal() has made sure there is at most one)
        if credentials.required and guarded and not credentials.accept(dict(request.scope["headers"]).get(b"authorization", b"")):
            response = _error_response(ApiError(401, credentials.wanted(), "authentication_error"))
            for challenge in credentials.challenges():  # one header each
                response.headers.append("WWW-Authenticate", challenge)
            return response
        if path.startswith(API_PREFIXES) and not service.ready.is_set():
            why = service.load_error or "the engines are loading"
            return _error_response(ApiError(503, f"not ready: {why}", "server_error", headers={"Retry-After": "5"}))
        return None

    @app.middleware("http")
    async def guard(request: HttpRequest, call_next):
        start = time.perf_counter()
        routed = app.state.routes.at(request.scope)
        response = refused_before_routing(request, routed)
        if response is None:
            response = await call_next(request)
        # labels stay bounded: a route's template (never the path a client chose), a known method
        method = request.method if request.method in KNOWN_METHODS else "OTHER"
        route = routed.template or "unmatched"
        service.metrics.http.labels(route, method, str(response.status_code)).observe(time.perf_counter() - start)
        access.info("%s %s %d", method, request.url.path[:200], response.status_code)  # never the query string
        return response

    @app.get("/health", response_model=Health, responses={503: {"model": Health, "description": "loading, failed or draining"}})
    async def health():
        if service.ready.is_set():
            return {"status": "ready", "backend": service.backend}
        status = "failed" if service.load_error else "loading"
        return JSONResponse({"status": status, "error": service.load_error}, status_code=503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}},
                                                            **errors(401)})  # fmt: skip
    async def metrics():
        return Response(await service.metrics_text(), media_type=CONTENT_TYPE)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        return page_html(service)

    app.include_router(docs_routes(app.title))

    @app.get("/v1/bases/{bid}", response_model=BaseInfo, responses=errors(401, 404, 409, 503))
    async def get_base(bid: str):
        return await service.base_info(bid)

    @app.delete("/v1/bases/{bid}", response_model=Deleted, responses=errors(401, 404, 409, 503))
    async def delete_base(bid: str):
        await service.delete_base(bid)
        return {"id": bid, "deleted": True}

    app.include_router(openai_routes(service))
    app.include_router(a1111_routes(service))
    app.openapi = lambda: openapi_schema(app)
    app.state.routes = RouteTable(app.routes)  # every route is in by now, FastAPI's own /openapi.json too
    return app


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema, with the bearer and Basic schemes and the real error body for every status."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schema.setdefault("components", {}).setdefault("securitySchemes", {}).update({
        "bearer": {"type": "http", "scheme": "bearer", "description": "serve.token or EDIT_RT_TOKEN (when set)"},
        "basic": {"type": "http", "scheme": "basic", "description": "a user:password of serve.api_auth or "
                  "EDIT_RT_API_AUTH (when set; AUTOMATIC1111's --api-auth)"}})  # fmt: skip
    schema["security"] = [{"bearer": []}, {"basic": []}, {}]
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path in schema["paths"].values():
        for method, op in path.items():
            # FastAPI documents its own {"detail"} 422; this API answers 400 with {"error"}
            op.get("responses", {}).pop("422", None)
            if method.upper() not in SAFE_METHODS:  # the guard's (request_checks.py)
                op["responses"].setdefault("403", {"description": "a web page of another origin (Origin, Sec-Fetch-Site)",
                                                   "content": error})  # fmt: skip
            if method == "post":
                op["responses"].setdefault("415", {"description": "a body that is not application/json", "content": error})
    schemas = schema["components"].get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.update(body_schemas(app.state.service.cfg))  # the bodies read by hand (openapi_bodies.py)
    app.openapi_schema = schema
    return schema


class BodyTimeout:
    """ASGI middleware: a request body that stalls for ``seconds`` is answered 408.

    Only the body is timed: once it is complete, ``receive`` waits for a disconnect as long as
    the response takes (a stream, a long tail). On a stall this middleware answers itself and
    tells the app the client is gone (frameworks turn a failing read into their own 400).
    """

    def __init__(self, app, seconds: float):
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_done, started, answered = False, False, False

        async def timed_receive():
            nonlocal body_done, answered
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.seconds)
            except asyncio.TimeoutError:
                body_done = True
                if not started:
                    answered = True
                    error = ApiError(408, f"the request body stalled for {self.seconds:g} s", code="body_timeout")
                    await _error_response(error)(scope, receive, send)
                return {"type": "http.disconnect"}
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def tracked_send(message):
            nonlocal started
            if answered:
                return  # the 408 went out; the app's late answer goes nowhere
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, timed_receive, tracked_send)


def listening_line(cfg: RunConfig, more: str = "") -> str:
    """What `edit-rt serve` prints once its port is bound: the address to open."""
    s = cfg.serve
    host = f"[{s.host}]" if ":" in s.host else s.host  # an IPv6 address, as a URL writes it
    return f"edit-rt serve: http://{host}:{s.port}/ (API docs at /docs{more})"


def serve(cfg: RunConfig, say: Callable[[str], None] = print) -> None:
    """Listen on ``serve.host``:``serve.port``, say so with ``say``, and serve until SIGTERM."""
    import uvicorn

    from .http_server import DrainingServer, header_timeout_protocol, listening_sockets

    s = cfg.serve
    # bound before anything starts: a busy port is one line (EditRtError), not uvicorn's exit
    # after the engines began loading (which aborted the process)
    sockets = listening_sockets(s.host, s.port)
    say(listening_line(cfg))  # after the bind: said before it, a busy port's address would be one never served
    app = create_app(cfg)
    service: Service = app.state.service
    # The access log (uvicorn's own is off: it prints query strings, tokens included).
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("INFO:     %(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False
    config = uvicorn.Config(app, host=s.host, port=s.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=5, http=header_timeout_protocol(s.header_timeout_s))  # fmt: skip
    DrainingServer(config, service.start_drain, service.drained, service.finish, s.drain_timeout_s).run(sockets=sockets)
