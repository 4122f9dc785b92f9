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
import json
import logging
import os
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from importlib import resources
from typing import Any, AsyncIterator, Optional

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
from .store import BaseStore, StoreFullError, UnknownBaseError, base_id

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

    @app.middleware("http")
    async def guard(request: HttpRequest, call_next):
        path = request.url.path
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            return _error_response(ApiError(413, f"the body is larger than {limits.max_body_bytes} bytes", code="body_too_large"))
        if request.method == "POST" and length is None:
            return _error_response(ApiError(411, "a Content-Length header is required", code="length_required"))
        if service.token and (path.startswith("/v1/") or path == "/metrics"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {service.token}".encode()):
                return _error_response(ApiError(401, "missing or wrong bearer token", "authentication_error"))
        if path.startswith("/v1/") and not service.ready.is_set():
            why = service.load_error or "the engines are loading"
            return _error_response(ApiError(503, f"not ready: {why}", "server_error", headers={"Retry-After": "5"}))
        start = time.perf_counter()
        response = await call_next(request)
        service.metrics.observe(f"edit_rt_http_{request.method.lower()}_seconds", time.perf_counter() - start)
        return response

    def ready_parts() -> tuple[EditPipeline, BaseStore, Batcher]:
        return service.pipe, service.store, service.batcher

    def check_prompt(prompt: str, param: str) -> None:
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
        try:
            state = await asyncio.to_thread(store.pin, body.base_id)
        except UnknownBaseError:
            raise ApiError(404, f"base_id: no base {body.base_id!r} (never generated, deleted or evicted)",
                           "not_found_error", param="base_id", code="unknown_base") from None  # fmt: skip
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
        try:
            return store.info(bid)
        except UnknownBaseError:
            raise ApiError(404, f"no base {bid!r}", "not_found_error", param="base_id", code="unknown_base") from None

    @app.delete("/v1/bases/{bid}")
    async def delete_base(bid: str):
        _, store, _ = ready_parts()
        try:
            await asyncio.to_thread(store.delete, bid)
        except UnknownBaseError:
            raise ApiError(404, f"no base {bid!r}", "not_found_error", param="base_id", code="unknown_base") from None
        except StoreFullError as err:
            raise ApiError(409, str(err), code="base_in_use") from None
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
                    yield _sse("error", {"index": job.index, **ApiError(500, str(job.future.exception()), "server_error").body()})
                    continue
                result = job.future.result()
                yield _sse("image_edit.completed", _edit_result(job.index, job.row, result.image, result.seconds, state, pipe, result.preserve))
            yield _sse("done", {"base_id": body.base_id})
        finally:
            request.cancelled.set()  # a client that left: its rows go at the next step
            store.unpin(body.base_id)

    return app


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def _submit(batcher: Batcher, request: Request, jobs: list[Job]) -> None:
    try:
        batcher.submit(request, jobs)
    except QueueFullError as err:
        raise ApiError(429, f"{err}; retry later", "rate_limit_error", code="queue_full", headers={"Retry-After": "2"}) from None
    except ShuttingDownError as err:
        raise ApiError(503, str(err), "server_error", code="shutting_down") from None


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
    except (CancelledError, ShuttingDownError) as err:
        raise ApiError(503, str(err), "server_error", code="cancelled") from None
    except RowError as err:
        raise ApiError(422, str(err), code="row_refused") from None
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

    uvicorn.run(create_app(cfg), host=cfg.serve.host, port=cfg.serve.port, log_level="info",
                timeout_graceful_shutdown=30)  # fmt: skip
