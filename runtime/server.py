"""`edit-rt serve`: the HTTP service (FastAPI on uvicorn), loopback by default.

Routes: ``POST /v1/images/generations`` (a base, kept in the store under its id),
``POST /v1/images/edits`` (a batch of edits of a base; ``stream: true`` for Server-Sent
Events), ``GET``/``DELETE /v1/bases/{id}``, ``GET /health`` (ready once the engines are loaded),
``GET /metrics`` (Prometheus text), ``GET /`` (the editing page), ``GET /openapi.json``.
The request loop only validates and waits; one :class:`Batcher` worker owns the engines.
"""

from __future__ import annotations

import asyncio
import base64
import re
import json
import logging
import os
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from importlib import resources
from typing import Any, AsyncIterator, Iterator, Optional

import numpy as np
from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import ApiError, EditItem, EditsRequest, GenerationRequest, validation_error
from .batcher import Batcher, CancelledError, Job, QueueFullError, Request, RowError, ShuttingDownError
from .config import Base, Mask, RunConfig
from .images import parameters_text, png_bytes
from .metrics import Metrics
from .pipeline import EditPipeline
from .state import TailRow
from .run import pipeline_of, store_of
from .store import BaseStore, DamagedBaseError, StoreFullError, UnknownBaseError, base_id

log = logging.getLogger(__name__)


class Service:
    """What the routes share: the pipeline, the store, the batcher, the metrics."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.token = os.environ.get("EDIT_RT_TOKEN") or cfg.serve.token
        self.metrics = Metrics()
        self.pipe: Optional[EditPipeline] = None
        self.store: Optional[BaseStore] = None
        self.batcher: Optional[Batcher] = None
        self.ready = threading.Event()
        self.draining = threading.Event()
        self.load_error: Optional[str] = None

    def load(self) -> None:
        """Load the engines (in a thread: /health answers 503 meanwhile)."""
        try:
            cfg, base = self.cfg, self.cfg.base
            pipe = pipeline_of(cfg).activate()
            self.store = store_of(cfg, pipe.manifest.fingerprint)
            batcher = pipe.batcher(pipe.latent_shape(base))
            batcher.queue_limit = cfg.serve.queue_limit
            batcher.metrics = self.metrics
            self.batcher = batcher.start()
            self.pipe = pipe
            self.ready.set()
            log.info("ready: backend %s (%s)", pipe.graph_set.backend, pipe.graph_set.reason)
        except Exception as err:  # reported by /health; the process stays up to say why
            self.load_error = str(err)
            log.exception("loading the engines failed")

    def start_drain(self) -> None:
        """Stop admitting: new requests get 503 + Retry-After; rows in flight go on."""
        self.draining.set()
        if self.batcher is not None:
            self.batcher.close()

    def drained(self) -> bool:
        return self.batcher is None or self.batcher.idle

    def finish(self) -> None:
        """Fail what is still running with a clear error (a 503, or an error event)."""
        if self.batcher is not None:
            self.batcher.stop(timeout=0)

    def shutdown(self) -> None:
        self.ready.clear()
        if self.batcher is not None:
            self.batcher.stop(timeout=30)
        if self.pipe is not None:
            self.pipe.deactivate()


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def create_app(cfg: RunConfig) -> FastAPI:
    service = Service(cfg)
    limits = cfg.serve

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=service.load, name="edit-rt-loader", daemon=True).start()
        yield
        await asyncio.to_thread(service.shutdown)

    app = FastAPI(title="edit-rt", version="0.1.0", lifespan=lifespan,
                  description="Batched edit tails for Stable Diffusion: generate a base once, edit it many times.")  # fmt: skip
    app.state.service = service
    app.add_middleware(BodyTimeout, seconds=cfg.serve.body_timeout_s)

    @app.exception_handler(ApiError)
    async def api_error(_, err: ApiError):
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, err: RequestValidationError):
        return _error_response(validation_error(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(err.status_code, str(err.detail), kind))

    @app.exception_handler(Exception)
    async def unexpected(_, err: Exception):
        log.exception("unexpected error")
        return _error_response(ApiError(500, "internal error; see the server log", "server_error"))

    loopback = cfg.serve.host in ("127.0.0.1", "localhost", "::1")
    token = (service.token or "").encode("utf-8")

    @app.middleware("http")
    async def guard(request: HttpRequest, call_next):
        path = request.url.path
        if loopback and _host(request) not in LOOPBACK_HOSTS:
            # bound to loopback: a page elsewhere that resolves its own name here (DNS
            # rebinding) sends its own Host, and is refused
            return _error_response(ApiError(400, "this server answers to 127.0.0.1, localhost and [::1] only",
                                            code="untrusted_host"))  # fmt: skip
        if service.draining.is_set():
            if path == "/health":
                return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
            return _error_response(ApiError(503, "the server is shutting down; retry on another replica or later",
                                            "server_error", code="shutting_down", headers={"Retry-After": "5"}))  # fmt: skip
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            return _error_response(ApiError(413, f"the body is larger than {limits.max_body_bytes} bytes", code="body_too_large"))
        if request.method == "POST" and length is None:
            return _error_response(ApiError(411, "a Content-Length header is required", code="length_required"))
        if token and (path.startswith("/v1/") or path == "/metrics"):
            # the raw header bytes against the token's UTF-8 bytes: a non-ASCII token matches
            given = dict(request.scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, b"Bearer " + token):
                return _error_response(ApiError(401, "missing or wrong bearer token", "authentication_error"))
        if path.startswith("/v1/") and not service.ready.is_set():
            why = service.load_error or "the engines are loading"
            return _error_response(ApiError(503, f"not ready: {why}", "server_error", headers={"Retry-After": "5"}))
        start = time.perf_counter()
        response = await call_next(request)
        method = request.method if request.method in KNOWN_METHODS else "OTHER"  # labels stay bounded
        service.metrics.observe(f"edit_rt_http_{method.lower()}_seconds", time.perf_counter() - start)
        access.info("%s %s %d", method, path[:200], response.status_code)  # never the query string
        return response

    def ready_parts() -> tuple[EditPipeline, BaseStore, Batcher]:
        return service.pipe, service.store, service.batcher

    def check_prompt(prompt: str, param: str) -> None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ApiError(422, f"{param}: not valid Unicode (an unpaired surrogate at {err.start}); send UTF-8 text",
                           param=param, code="invalid_text") from None  # fmt: skip
        if len(prompt) > limits.max_prompt_chars:
            raise ApiError(422, f"{param}: longer than {limits.max_prompt_chars} characters", param=param, code="too_long")

    @app.get("/health")
    async def health():
        if service.ready.is_set():
            return {"status": "ready", "backend": service.pipe.graph_set.backend}
        status = "failed" if service.load_error else "loading"
        return JSONResponse({"status": status, "error": service.load_error}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        extra = []
        if service.store is not None:
            stats = service.store.stats()
            for tier in ("ram", "disk"):
                extra += [(f"edit_rt_store_{tier}_entries", "gauge", stats[tier]["entries"]),
                          (f"edit_rt_store_{tier}_bytes", "gauge", stats[tier]["bytes"])]  # fmt: skip
            for key in ("hits_ram", "hits_disk", "misses", "evictions_ram", "evictions_disk"):
                extra.append((f"edit_rt_store_{key}_total", "counter", stats[key]))
        return service.metrics.render(extra)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("edit_rt.runtime").joinpath("web.html").read_text()

    @app.post("/v1/images/generations")
    async def generations(body: GenerationRequest, http: HttpRequest):
        pipe, store, batcher = ready_parts()
        check_prompt(body.prompt, "prompt")
        check_prompt(body.negative_prompt, "negative_prompt")
        base = _base_of(body, cfg, pipe)
        bid = base_id(pipe.manifest.fingerprint, base)
        request = Request(uuid.uuid4().hex, deadline=time.monotonic() + limits.request_timeout_s)
        job = Job(request, 0, base, TailRow(base.prompt, 1.0, 0, base.guidance), noise=pipe.initial_noise(base))
        _submit(batcher, request, [job])
        result = await _wait(http, request, job)
        image, state, seconds = result.image, result.state, result.seconds
        try:
            await asyncio.to_thread(store.put, state)
        except StoreFullError as err:
            raise ApiError(503, str(err), "server_error", code="store_full") from None
        parameters = parameters_text(base.prompt, base.negative_prompt, _fields(base, pipe))
        service.metrics.inc("edit_rt_bases_generated_total")
        return {
            "id": bid,
            "created": int(time.time()),
            "seed": base.seed,
            "data": [{"b64_json": _b64(png_bytes(image, parameters))}],
            "parameters": {"prompt": base.prompt, "negative_prompt": base.negative_prompt, "steps": base.steps,
                           "cfg_scale": base.guidance, "seed": base.seed, "size": f"{base.width}x{base.height}"},  # fmt: skip
            "info": {"seconds": round(seconds, 4), "store_tier": store.tier(bid)},
        }

    @app.post("/v1/images/edits")
    async def edits(body: EditsRequest, http: HttpRequest):
        pipe, store, batcher = ready_parts()
        if len(body.edits) > limits.max_edits_per_request:
            raise ApiError(413, f"edits: {len(body.edits)} edits, at most {limits.max_edits_per_request} per request",
                           param="edits", code="too_many_edits")  # fmt: skip
        state = await _pinned(store, body.base_id)
        try:
            rows = [_row(e, i, state, cfg) for i, e in enumerate(body.edits)]
            for i, e in enumerate(body.edits):
                check_prompt(e.prompt, f"edits[{i}].prompt")
            request = Request(uuid.uuid4().hex, deadline=time.monotonic() + limits.request_timeout_s)
            jobs = [Job(request, i, state.base, row, state=state) for i, row in enumerate(rows)]
            if body.stream:
                events = _event_queue(request, jobs)
                _submit(batcher, request, jobs)  # before the 200 goes out: a full queue is still a 429
                return StreamingResponse(_stream(events, batcher, request, jobs, state, pipe, store, body),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})  # fmt: skip
            _submit(batcher, request, jobs)
            results = await _wait_all(http, request, jobs)
        except BaseException:
            store.unpin(body.base_id)
            raise
        store.unpin(body.base_id)
        return {
            "created": int(time.time()),
            "base_id": body.base_id,
            "data": [_edit_result(i, row, r.image, r.seconds, state, pipe, r.preserve) for i, (row, r) in enumerate(zip(rows, results))],
        }

    @app.get("/v1/bases/{bid}")
    async def get_base(bid: str):
        _, store, _ = ready_parts()
        with _base_errors(bid):
            return await asyncio.to_thread(store.info, _base_id(bid))

    @app.delete("/v1/bases/{bid}")
    async def delete_base(bid: str):
        _, store, _ = ready_parts()
        with _base_errors(bid):
            await asyncio.to_thread(store.delete, _base_id(bid))
        return {"id": bid, "deleted": True}

    def _event_queue(request: Request, jobs: list[Job]) -> asyncio.Queue:
        """Progress and completions, handed from the batcher's thread to this event loop."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request.on_progress = lambda i, step, of: loop.call_soon_threadsafe(
            events.put_nowait, ("progress", {"index": i, "step": step, "of": of}))  # fmt: skip
        for job in jobs:
            job.future.add_done_callback(lambda f, job=job: loop.call_soon_threadsafe(events.put_nowait, ("done", job)))
        return events

    async def _stream(events, batcher, request, jobs, state, pipe, store, body):
        try:
            yield _sse("queue", {"position": batcher.queue_position(request), "queue_size": batcher.queued_rows})
            remaining = len(jobs)
            while remaining:
                kind, payload = await events.get()
                if kind == "progress":
                    yield _sse("progress", payload)
                    continue
                remaining -= 1
                job = payload
                if job.future.exception() is not None:
                    yield _sse("error", {"index": job.index, **row_error(job.future.exception()).body()})
                    continue
                result = job.future.result()
                yield _sse("image_edit.completed", _edit_result(job.index, job.row, result.image, result.seconds, state, pipe, result.preserve))
            yield _sse("done", {"base_id": body.base_id})
        finally:
            request.cancelled.set()  # a client that left: its rows go at the next step
            store.unpin(body.base_id)

    return app


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


KNOWN_METHODS = frozenset({"GET", "POST", "DELETE", "HEAD", "OPTIONS", "PUT", "PATCH"})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})
access = logging.getLogger("edit_rt.access")


def _host(request: HttpRequest) -> str:
    """The Host header without its port ("[::1]:8188" -> "[::1]")."""
    host = request.headers.get("host", "")
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _echo(value: str, limit: int = 64) -> str:
    """A client's string, bounded, for an error message."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def row_error(err: BaseException) -> ApiError:
    """The API error of a row that failed: its input (422), a shutdown or cancel (503)."""
    if isinstance(err, RowError):
        return ApiError(422, str(err), code="row_refused")
    if isinstance(err, (CancelledError, ShuttingDownError)):
        return ApiError(503, str(err), "server_error", code="shutting_down" if isinstance(err, ShuttingDownError) else "cancelled",
                        headers={"Retry-After": "5"})  # fmt: skip
    log.error("row failed: %s", err)
    return ApiError(500, "internal error; see the server log", "server_error")


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


BASE_ID = re.compile(r"^[0-9a-f]{24}$")


def _base_id(bid: str) -> str:
    if not BASE_ID.match(bid):
        raise UnknownBaseError(f"unknown base id {_echo(bid)}")
    return bid


@contextmanager
def _base_errors(bid: str, param: str = "base_id") -> Iterator[None]:
    """A store error about one base as the API's: unknown 404, damaged 409, in use 409."""
    try:
        yield
    except UnknownBaseError:
        raise ApiError(404, f"{param}: no base {_echo(bid)} (never generated, deleted or evicted; generate it again)",
                       "not_found_error", param=param, code="unknown_base") from None  # fmt: skip
    except DamagedBaseError as err:
        raise ApiError(409, f"{param}: {err}", param=param, code="base_damaged") from None
    except StoreFullError as err:
        raise ApiError(409, str(err), param=param, code="base_in_use") from None


async def _pinned(store: BaseStore, bid: str):
    with _base_errors(bid):
        return await asyncio.to_thread(store.pin, _base_id(bid))


def _submit(batcher: Batcher, request: Request, jobs: list[Job]) -> None:
    try:
        batcher.submit(request, jobs)
    except QueueFullError as err:
        raise ApiError(429, f"{err}; retry later", "rate_limit_error", code="queue_full", headers={"Retry-After": "2"}) from None
    except ShuttingDownError as err:
        raise ApiError(503, str(err), "server_error", code="shutting_down", headers={"Retry-After": "5"}) from None


async def _wait(http: HttpRequest, request: Request, job: Job):
    (result,) = await _wait_all(http, request, [job])
    return result


async def _wait_all(http: HttpRequest, request: Request, jobs: list[Job]) -> list[Any]:
    futures = [asyncio.wrap_future(j.future) for j in jobs]
    try:
        while True:
            done, pending = await asyncio.wait(futures, timeout=0.25)
            if not pending:
                break
            if await http.is_disconnected():
                request.cancelled.set()
                raise ApiError(499, "client disconnected", code="client_closed")
        return [f.result() for f in futures]
    except (CancelledError, ShuttingDownError, RowError) as err:
        raise row_error(err) from None
    finally:
        if any(not f.done() for f in futures):
            request.cancelled.set()


def _base_of(body: GenerationRequest, cfg: RunConfig, pipe: EditPipeline) -> Base:
    default = cfg.base
    size = body.size or f"{default.width}x{default.height}"
    if size != f"{default.width}x{default.height}":
        raise ApiError(422, f"size: this server's engines serve {default.width}x{default.height} only",
                       param="size", code="unsupported_size")  # fmt: skip
    steps = body.steps or default.steps
    if steps > cfg.serve.max_steps:
        raise ApiError(422, f"steps: at most {cfg.serve.max_steps}", param="steps", code="too_many_steps")
    seed = body.seed if body.seed >= 0 else secrets.randbelow(2**31)
    guidance = default.guidance if body.cfg_scale is None else body.cfg_scale
    return replace(default, prompt=body.prompt, negative_prompt=body.negative_prompt, seed=seed, steps=steps,
                   guidance=guidance)  # fmt: skip


def _row(e: EditItem, i: int, state, cfg: RunConfig) -> TailRow:
    T, lo = state.base.steps, state.window_start
    tail = e.tail_steps or max(1, round(cfg.cache.default_tail_fraction * T))
    if not 1 <= tail <= T - lo:
        raise ApiError(422, f"edits[{i}].tail_steps: {tail} is outside [1, {T - lo}] for this base ({T} steps)",
                       param=f"edits[{i}].tail_steps", code="out_of_range")  # fmt: skip
    mask = None
    if e.mask is not None:
        m, b = e.mask, state.base
        if m.x + m.width > b.width or m.y + m.height > b.height:
            raise ApiError(422, f"edits[{i}].mask: the rectangle leaves the {b.width}x{b.height} image",
                           param=f"edits[{i}].mask", code="out_of_range")  # fmt: skip
        mask = Mask(m.x, m.y, m.width, m.height)
    guidance = state.base.guidance if e.cfg_scale is None else e.cfg_scale
    return TailRow(e.prompt, cfg.strength_of(e.strength), T - tail, guidance, mask, e.seed, cfg.preserve_of(e.preserve))


def _fields(base: Base, pipe: EditPipeline) -> dict:
    return {"Steps": base.steps, "Sampler": "DDIM", "CFG scale": f"{base.guidance:g}", "Seed": base.seed,
            "Size": f"{base.width}x{base.height}", "Model hash": pipe.manifest.fingerprint[:10]}  # fmt: skip


def _edit_result(i: int, row: TailRow, image: np.ndarray, seconds: float, state, pipe, preserve: str = "none") -> dict:
    base = state.base
    fields = dict(_fields(base, pipe), **{"CFG scale": f"{row.guidance:g}", "Edit strength": f"{row.strength:g}",
                  "Tail steps": base.steps - row.start_step, "Base prompt": base.prompt})  # fmt: skip
    if row.mask is not None:
        fields["Edit mask"] = f"{row.mask.x} {row.mask.y} {row.mask.width}x{row.mask.height}"
    if row.seed is not None:
        fields["Variation seed"] = row.seed
    png = png_bytes(image, parameters_text(row.prompt, base.negative_prompt, fields))
    return {"index": i, "b64_json": _b64(png),
            "info": {"seconds": round(seconds, 4), "tail_steps": base.steps - row.start_step, "strength": row.strength,
                     "preserve": preserve}}  # fmt: skip


def serve(cfg: RunConfig) -> None:
    import uvicorn

    from .http_server import DrainingServer, header_timeout_protocol

    app = create_app(cfg)
    service: Service = app.state.service
    # The access log (uvicorn's own is off: it prints query strings, tokens included).
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("INFO:     %(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False
    s = cfg.serve
    config = uvicorn.Config(app, host=s.host, port=s.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=5, http=header_timeout_protocol(s.header_timeout_s))  # fmt: skip
    DrainingServer(config, service.start_drain, service.drained, service.finish, s.drain_timeout_s).run()
