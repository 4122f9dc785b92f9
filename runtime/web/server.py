"""`edit-rt serve`: the HTTP service (FastAPI on uvicorn), loopback by default.

Route families, one app: edit-rt's own and the OpenAI Images API's (api_openai.py:
``/v1/images/generations``, ``/v1/images/edits``, ``/v1/models``), AUTOMATIC1111's
(api_a1111.py: ``/sdapi/v1/*``), a planner's ``POST /v1/plans`` (api_plans.py), and here ``GET``/``DELETE /v1/bases/{id}``, ``GET /health``,
``GET /metrics`` (Prometheus), ``GET /editor`` (the editing page, at ``GET /`` too unless
ComfyUI's frontend is served there: comfyui_frontend.py), ``GET /openapi.json`` and its pages
``GET /docs``, ``GET /redoc`` (docs.py: offline). Each family is a module-level ``router`` whose
handlers take the app's service by ``Depends`` (dependencies.py); :func:`create_app` builds the
app around them: its state, middleware and exception handlers. The routes validate and wait; the
service's one batcher worker owns the engines (service.py). What a request must say to be let in,
and how every answer is counted in ``/metrics``, is gate.py's; how deep its JSON may nest,
json_depth.py's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from contextlib import asynccontextmanager
from importlib import resources
from typing import AsyncIterator, Callable, Optional

from fastapi import APIRouter, FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from ..config.run_config import RunConfig
from ..config.serve import Serve
from ..config.text import TextRunConfig
from ..errors import EditRtError
from ..metrics import CONTENT_TYPE
from .http_errors import ApiError, api_error, validation_error
from ..serving.service import Service
from ..serving.text_service import TextService
from . import api_a1111, api_comfyui, api_completions, api_openai, api_plans, comfyui_frontend, docs
from .a1111_fields import Settings
from .api import BaseInfo, BaseUpload, Deleted, EditsRequest, GenerationRequest, Health, errors
from .exposure import refuse_an_open_port
from .credentials import Credentials, api_auth_of, token_of
from .dependencies import ServiceDep
from .gate import Gate, access, error_response
from .json_depth import JsonDepthLimit
from .openapi_bodies import body_schemas
from .request_checks import SAFE_METHODS
from .route_table import RouteTable

log = logging.getLogger(__name__)

# edit-rt's own routes besides the OpenAI door's: health, metrics, the page, a stored base
router = APIRouter()


def page_html(service: Service) -> str:
    """The editing page, with the served config's defaults filled in (as JSON, never as HTML)."""
    cfg = service.cfg
    defaults = {"negative_prompt": cfg.base.negative_prompt or "", "strength": cfg.cache.default_strength,
                "tail_fraction": cfg.cache.default_tail_fraction, "steps": cfg.base.steps,
                "preserve": cfg.preserve.mode, "structure": cfg.preserve.structure, "width": cfg.base.width, "height": cfg.base.height}  # fmt: skip
    # "</" cannot close the script element from inside a JSON string this way
    data = json.dumps(defaults).replace("</", "<\\/")
    return resources.files("edit_rt.runtime.web").joinpath("web.html").read_text().replace("/*DEFAULTS*/{}", data)


@router.get("/health", response_model=Health, responses={503: {"model": Health, "description": "loading, failed or draining"}})
async def health(service: ServiceDep):
    if service.ready.is_set():
        return {"status": "ready", "backend": service.backend}
    status = "failed" if service.load_error else "loading"
    return JSONResponse({"status": status, "error": service.load_error}, status_code=503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}},
                                                           **errors(401)})  # fmt: skip
async def metrics(service: ServiceDep):
    return Response(await service.metrics_text(), media_type=CONTENT_TYPE)


@router.get("/editor", response_class=HTMLResponse, include_in_schema=False)
async def page(service: ServiceDep):
    return page_html(service)


@router.get("/v1/bases/{bid}", response_model=BaseInfo, responses=errors(401, 404, 409, 503))
async def get_base(bid: str, service: ServiceDep):
    return await service.base_info(bid)


@router.delete("/v1/bases/{bid}", response_model=Deleted, responses=errors(401, 404, 409, 503))
async def delete_base(bid: str, service: ServiceDep):
    await service.delete_base(bid)
    return {"id": bid, "deleted": True}


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The engines load in a thread of their own (``/health`` answers meanwhile); shut down after.
    ``state.service``: the image app's :class:`Service` or the text app's :class:`TextService`."""
    service: Service | TextService = app.state.service
    threading.Thread(target=service.load, name="edit-rt-loader", daemon=True).start()
    yield
    await asyncio.to_thread(service.shutdown)


async def api_refusal(_, err: ApiError):
    return error_response(err)


async def domain_refusal(_, err: EditRtError):
    """The service's refusals (runtime/errors.py), answered here only."""
    return error_response(api_error(err))


async def invalid(_, err: RequestValidationError):
    # a body's field named by its request model, for the range declared on it
    return error_response(validation_error(err.errors(), candidates=(EditsRequest, GenerationRequest, BaseUpload)))


async def http_error(_, err: StarletteHTTPException):
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return error_response(ApiError(err.status_code, str(err.detail), kind, headers=dict(err.headers or {})))


async def client_left(_, err: ClientDisconnect):
    # a client gone before its body was complete (a form upload): nobody to answer, nothing to log
    return error_response(ApiError(499, "client disconnected", code="client_closed"))


async def unexpected(_, err: Exception):
    log.exception("unexpected error")
    return error_response(ApiError(500, "internal error; see the server log", "server_error"))


# Starlette picks a handler by the error's class (its MRO), whatever the order here
EXCEPTION_HANDLERS = {ApiError: api_refusal, EditRtError: domain_refusal, RequestValidationError: invalid,
                      StarletteHTTPException: http_error, ClientDisconnect: client_left, Exception: unexpected}  # fmt: skip


def create_app(cfg: RunConfig, service: Optional[Service] = None) -> FastAPI:
    """The one app: over a local :class:`Service` (engines in this process), or over one whose
    operations run on Ray Serve replicas (``ray_serve.RayService``), with the same routes."""
    # docs_url/redoc_url None: FastAPI's pages load from a CDN; docs.py serves them offline
    app = FastAPI(title="edit-rt", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  exception_handlers=EXCEPTION_HANDLERS,
                  description="Batched edit tails for Stable Diffusion: generate a base once, edit it many times.")  # fmt: skip
    app.state.service = service if service is not None else Service(cfg)
    app.state.a1111_settings = Settings()  # POST /sdapi/v1/options: this app's A1111 door's
    _guard(app, cfg.serve)
    docs.redoc_script()  # read now, off any request; fastapi-offline missing: one line here, not a 500 on /docs
    for door in (router, docs.router, api_openai.router, api_a1111.router, api_plans.router):
        app.include_router(door)
    if cfg.serve.comfyui:  # ComfyUI's bare paths (/prompt, /view) only when asked for
        app.state.comfyui = api_comfyui.Door(cfg, app.state.service)
        app.include_router(api_comfyui.router)
    if cfg.serve.comfyui_frontend:  # ComfyUI's page at /; the editing page keeps /editor
        comfyui_frontend.install(app, cfg)
    else:
        app.add_api_route("/", page, response_class=HTMLResponse, include_in_schema=False)
    app.openapi = lambda: openapi_schema(app)
    app.state.routes = RouteTable(app.routes)  # every route is in by now, FastAPI's own /openapi.json too
    return app


text_router = APIRouter()
text_router.add_api_route("/metrics", metrics, response_class=Response, responses=errors(401))  # the image app's handler


@text_router.get("/health", response_model=Health, responses={503: {"model": Health, "description": "loading, failed or draining"}})
async def text_health(request: HttpRequest):
    service: TextService = request.app.state.service
    if service.ready.is_set():
        return {"status": "ready", "backend": service.pipe.backend}
    status = "failed" if service.load_error else "loading"
    return JSONResponse({"status": status, "error": service.load_error}, status_code=503)


def _guard(app: FastAPI, serve: Serve) -> None:
    """The middleware every app of edit-rt runs behind, in the order they see a request."""
    # innermost first: the depth check reads the body through BodyTimeout's timed receive; the
    # gate is outermost, so its refusals and every answer are counted
    app.add_middleware(JsonDepthLimit, max_bytes=serve.max_body_bytes)
    app.add_middleware(BodyTimeout, seconds=serve.body_timeout_s)
    app.add_middleware(Gate, loopback=serve.host in ("127.0.0.1", "localhost", "::1"),
                       credentials=Credentials(token_of(serve), api_auth_of(serve)),
                       max_body_bytes=serve.max_body_bytes)  # fmt: skip


def create_text_app(cfg: TextRunConfig) -> FastAPI:
    """A text config's app (issue 56): OpenAI's /v1/completions and /v1/models over a
    :class:`TextService`, behind the same gate, body limits and error bodies as the image app."""
    app = FastAPI(title="edit-rt (text)", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  exception_handlers=EXCEPTION_HANDLERS,
                  description="A masked-diffusion text model: N continuations of one prompt as one batch.")  # fmt: skip
    # the gate reads ``state.service`` (its drain, readiness, request metrics): the text service
    app.state.service = TextService(cfg)
    _guard(app, cfg.serve)
    for door in (text_router, api_completions.router):
        app.include_router(door)
    app.openapi = lambda: openapi_schema(app)
    app.state.routes = RouteTable(app.routes)
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
                    await error_response(error)(scope, receive, send)
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
    if s.comfyui_frontend:  # / is ComfyUI's page then
        more = f"{more}, ComfyUI's frontend at /, the editing page at /editor"
    return f"edit-rt serve: http://{host}:{s.port}/ (API docs at /docs{more})"


def serve(cfg: RunConfig | TextRunConfig, say: Callable[[str], None] = print, allow_no_token: bool = False) -> None:
    """Listen on ``serve.host``:``serve.port``, say so with ``say``, and serve until SIGTERM. A
    port beyond loopback without credentials is refused unless ``allow_no_token`` (exposure.py)."""
    import uvicorn

    from .http_server import DrainingServer, header_timeout_protocol, listening_sockets

    refuse_an_open_port(cfg.serve, cfg.source or "the config", allow_no_token, say)
    s = cfg.serve
    # bound before anything starts: a busy port is one line (EditRtError), not uvicorn's exit
    # after the engines began loading (which aborted the process)
    sockets = listening_sockets(s.host, s.port)
    say(listening_line(cfg))  # after the bind: said before it, a busy port's address would be one never served
    app = create_text_app(cfg) if isinstance(cfg, TextRunConfig) else create_app(cfg)
    service: Service | TextService = app.state.service
    # The access log (uvicorn's own is off: it prints query strings, tokens included).
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("INFO:     %(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False
    config = uvicorn.Config(app, host=s.host, port=s.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=5, http=header_timeout_protocol(s.header_timeout_s))  # fmt: skip
    DrainingServer(config, service.start_drain, service.drained, service.finish, s.drain_timeout_s).run(sockets=sockets)
