"""What every route family shares: the loaded service and the operations the routes call.

:class:`Service` owns the pipeline, the store, the batcher and the metrics; its ``generate`` and
``edit`` turn validated requests into rows of the one step loop and wait for them, so the native
API, the OpenAI-compatible routes and the AUTOMATIC1111-compatible routes are thin adapters over
the same code (and the same errors).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request as HttpRequest

from ..assemble import pipeline_of, store_of
from ..images import png_bytes
from ..loop.batcher import Batcher
from ..loop.jobs import CancelledError, Job, Request, RowError, ShuttingDownError
from ..metrics import Metrics
from ..model.config import RunConfig
from ..model.edit import Base, Edit, EditError, TailRow, resolve_edit
from ..model.state import BaseState
from ..pipeline import EditPipeline
from ..pnginfo import base_fields, edit_fields, parameters_text
from ..storage.store import BaseStore, DamagedBaseError, DiskFullError, StoreBusyError, StoreFullError, base_id
from ..uploads import ImageInputError, Upload, image_from_bytes, text_of_image
from .errors import (ApiError, base_errors, check_base_id, disk_full, is_base_id, queue_errors, row_error, store_busy,
                     until_done)  # fmt: skip

log = logging.getLogger(__name__)


@dataclass
class Generated:
    id: str
    base: Base
    png: bytes
    seconds: float
    tier: Optional[str] = None  # the store tier that holds it ("ram", "disk")


@dataclass
class Edited:
    index: int
    png: bytes
    seconds: float
    preserve: str
    tail_steps: int
    strength: float

    def info(self) -> dict:
        return {"seconds": round(self.seconds, 4), "tail_steps": self.tail_steps, "strength": self.strength,
                "preserve": self.preserve}  # fmt: skip


# An edit request's events, in order: "edit_rt.queue" once, then per row "edit_rt.progress" and
# one "image_edit.completed" (data: index, png, info) or "error" (data: index, error: ApiError),
# then "edit_rt.done". The SSE stream sends them as they come; the JSON answer collects them.
Event = tuple[str, dict]


class Service:
    """The loaded engines, store and batcher, and the operations every route uses."""

    def __init__(self, cfg: RunConfig, engines: bool = True):
        """``engines``: this process loads them (a Ray Serve ingress does not: ray_serve.py)."""
        self.cfg = cfg
        self.token = os.environ.get("EDIT_RT_TOKEN") or cfg.serve.token
        self.metrics = Metrics(lambda: self.store.stats() if self.store is not None else None, engines)
        self.pipe: Optional[EditPipeline] = None
        self.store: Optional[BaseStore] = None
        self.batcher: Optional[Batcher] = None
        self.ready = threading.Event()
        self.draining = threading.Event()
        self.load_error: Optional[str] = None
        self.model_name = cfg.model_name
        self.started = int(time.time())
        # Uploads decode in a pool of their own: a burst of big images waits its turn there and
        # never takes the threads that store reads and the event loop's other work use.
        self.image_pool = ThreadPoolExecutor(max_workers=cfg.serve.image_workers, thread_name_prefix="edit-rt-images")
        # Store reads (pin, info, exists, delete) in theirs: never queued behind writes of new
        # bases (those take the default pool) or decodes.
        self.store_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="edit-rt-store")

    # --- life -----------------------------------------------------------------------------------

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
            self.metrics.ready.set(1)
            log.info("ready: backend %s (%s)", pipe.graph_set.backend, pipe.graph_set.reason)
        except Exception as err:  # reported by /health; the process stays up to say why
            self.load_error = str(err)
            log.exception("loading the engines failed")

    def start_drain(self) -> None:
        """Stop admitting: new requests get 503 + Retry-After; rows in flight go on."""
        self.draining.set()
        self.metrics.ready.set(0)
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
        self.metrics.ready.set(0)
        if self.batcher is not None:
            self.batcher.stop(timeout=30)
        if self.pipe is not None:
            self.pipe.deactivate()
        for pool in (self.image_pool, self.store_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    # --- input --------------------------------------------------------------------------------

    def check_prompt(self, prompt: str, param: str) -> None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ApiError(400, f"{param}: not valid Unicode (an unpaired surrogate at {err.start}); send UTF-8 text",
                           param=param, code="invalid_text") from None  # fmt: skip
        limit = self.cfg.serve.max_prompt_chars
        if len(prompt) > limit:
            raise ApiError(400, f"{param}: longer than {limit} characters", param=param, code="too_long")

    def base_of(self, prompt: str, negative_prompt: Optional[str] = None, size: Optional[str] = None, steps: Optional[int] = None,
                guidance: Optional[float] = None, seed: int = -1, clip_skip: Optional[int] = None,
                sizes: Optional[dict[str, Optional[int]]] = None) -> Base:  # fmt: skip
        """A base from request fields (the server's defaults for what they leave out). ``sizes``:
        SDXL's size conditioning (original_width/height, crop_top/left), where the model takes it."""
        default, serve = self.cfg.base, self.cfg.serve
        self.check_prompt(prompt, "prompt")
        if negative_prompt is not None:  # None: the family's default (SDXL: zeros)
            self.check_prompt(negative_prompt, "negative_prompt")
        served = f"{default.width}x{default.height}"
        if (size or served) != served:
            raise ApiError(400, f"size: this server's engines serve {served} only", param="size", code="unsupported_size")
        steps = steps or default.steps
        if steps > serve.max_steps:
            raise ApiError(400, f"steps: at most {serve.max_steps}", param="steps", code="too_many_steps")
        seed = seed if seed >= 0 else secrets.randbelow(2**31)
        guidance = default.guidance if guidance is None else guidance
        family = self.family
        clip_skip = default.clip_skip if clip_skip is None else clip_skip
        if not 0 <= clip_skip < family["clip_skips"]:
            raise ApiError(400, f"clip_skip: must lie in [0, {family['clip_skips'] - 1}] for this model's text encoder",
                           param="clip_skip", code="out_of_range")  # fmt: skip
        given = {k: v for k, v in (sizes or {}).items() if v is not None}
        takes = any(c["source"] == "time_ids" for c in family["conds"])
        if given and not takes:
            name = next(iter(given))
            raise ApiError(400, f"{name}: only SDXL models take size conditioning; this server serves an "
                           f"{family['family']} model: leave it out", param=name, code="unsupported")  # fmt: skip
        for name, value in given.items():
            if not 0 <= value <= 16384:
                raise ApiError(400, f"{name}: must lie in [0, 16384]", param=name, code="out_of_range")
        return replace(default, prompt=prompt, negative_prompt=negative_prompt, seed=seed, steps=steps, guidance=guidance,
                       clip_skip=clip_skip, image=None, **given)  # fmt: skip

    def row_of(self, i: int, state: BaseState, edit: Edit) -> TailRow:
        """Edit ``i`` of a request as a row of ``state``'s tail (edit.resolve_edit: the config's
        defaults filled in, its tail and mask checked against the base)."""
        self.check_prompt(edit.prompt, f"edits[{i}].prompt")
        try:
            return resolve_edit(edit, state.base, state.window_start, self.cfg.edit_defaults(), f"edits[{i}]")
        except EditError as err:
            raise ApiError(400, str(err), param=err.field, code="out_of_range") from None

    # --- work ---------------------------------------------------------------------------------

    def _new_request(self) -> Request:
        return Request(uuid.uuid4().hex, deadline=time.monotonic() + self.cfg.serve.request_timeout_s)

    def submit(self, request: Request, jobs: list[Job]) -> None:
        with queue_errors():
            self.batcher.submit(request, jobs)

    async def keep(self, state: BaseState) -> None:
        """Put a new base in the store: 503 ``store_full`` when every base there is pinned, 507
        ``disk_full`` when the disk refuses it and RAM cannot hold it instead, 503 ``store_busy``
        when another process holds the folder's lock, 409 ``base_damaged`` when its name is
        taken by something that cannot be moved."""
        try:
            await asyncio.to_thread(self.store.put, state)
        except DiskFullError as err:
            raise disk_full(err) from None
        except StoreFullError as err:
            raise ApiError(503, str(err), "server_error", code="store_full", headers={"Retry-After": "5"}) from None
        except StoreBusyError as err:
            raise store_busy(err) from None
        except DamagedBaseError as err:
            raise ApiError(409, str(err), code="base_damaged") from None

    async def wait(self, http: Optional[HttpRequest], request: Request, jobs: list[Job]) -> list[Any]:
        futures = [asyncio.wrap_future(j.future) for j in jobs]
        try:
            await until_done(futures, http, request.cancelled.set)
            return [f.result() for f in futures]
        except (CancelledError, ShuttingDownError, RowError) as err:
            raise row_error(err) from None
        finally:
            if any(not f.done() for f in futures):
                request.cancelled.set()

    async def generate(self, base: Base, http: Optional[HttpRequest] = None) -> Generated:
        """Generate ``base``, keep it in the store, return its PNG (with its parameters)."""
        pipe = self.pipe
        bid = base_id(pipe.manifest.fingerprint, base)
        request = self._new_request()
        job = Job(request, 0, base, TailRow(base.prompt, 1.0, 0, base.guidance), noise=pipe.initial_noise(base))
        self.submit(request, [job])
        (result,) = await self.wait(http, request, [job])
        await self.keep(result.state)
        self.metrics.inc("edit_rt_bases_generated_total")
        fields = base_fields(base, self.model_name, pipe.manifest.fingerprint, bid)
        png = png_bytes(result.image, parameters_text(base.prompt, base.negative_prompt, fields))
        return Generated(bid, base, png, result.seconds, self.store.tier(bid))

    async def pinned(self, bid: str, param: str = "base_id") -> BaseState:
        """Pin ``bid`` (in a thread: a disk load may read a file). A caller cancelled meanwhile
        (its client left) never sees the pin, so the pin is let go when it lands."""
        with base_errors(bid, param):
            pin = asyncio.get_running_loop().run_in_executor(self.store_pool, self.store.pin, check_base_id(bid))
            try:
                return await asyncio.shield(pin)
            except asyncio.CancelledError:
                pin.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or self.store.unpin(bid))
                raise

    def edit_png(self, state: BaseState, row: TailRow, image, preserve: str) -> bytes:
        bid = base_id(state.fingerprint, state.base)
        fields = edit_fields(state.base, row, self.model_name, state.fingerprint, bid, preserve)
        return png_bytes(image, parameters_text(row.prompt, state.base.negative_prompt, fields))

    def check_edit_count(self, n: int) -> None:
        limit = self.cfg.serve.max_edits_per_request
        if n > limit:
            raise ApiError(413, f"edits: {n} edits, at most {limit} per request", param="edits", code="too_many_edits")

    def edit_jobs(self, state: BaseState, rows: list[TailRow]) -> tuple[Request, list[Job]]:
        self.check_edit_count(len(rows))
        request = self._new_request()
        return request, [Job(request, i, state.base, row, state=state) for i, row in enumerate(rows)]

    async def edit_events(self, bid: str, specs: list[Edit], param: str = "base_id") -> AsyncIterator[Event]:
        """Edits of the stored base ``bid`` as one batched tail (with whatever else runs), as
        events. Everything a request can be refused for (an unknown base, a bad edit, a full
        queue) is raised before the first event; the base stays pinned until the last."""
        tier = self.store.tier(bid) if is_base_id(bid) else None
        state = await self.pinned(bid, param)
        self.metrics.edit_requests.labels(tier or "disk").inc()
        request = None
        try:
            rows = [self.row_of(i, state, spec) for i, spec in enumerate(specs)]
            request, jobs = self.edit_jobs(state, rows)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()  # from the batcher's thread to this loop
            request.on_progress = lambda i, step, of: loop.call_soon_threadsafe(
                events.put_nowait, ("edit_rt.progress", {"index": i, "step": step, "of": of}))  # fmt: skip
            for job in jobs:
                job.future.add_done_callback(lambda f, job=job: loop.call_soon_threadsafe(events.put_nowait, ("done", job)))
            self.submit(request, jobs)
            yield "edit_rt.queue", {"position": self.batcher.queue_position(request), "queue_size": self.batcher.queued_rows}
            remaining = len(jobs)
            while remaining:
                kind, payload = await events.get()
                if kind != "done":
                    yield kind, payload
                    continue
                remaining -= 1
                job = payload
                if job.future.exception() is not None:
                    yield "error", {"index": job.index, "error": row_error(job.future.exception())}
                    continue
                r, row = job.future.result(), job.row
                edited = Edited(job.index, self.edit_png(state, row, r.image, r.preserve), r.seconds, r.preserve,
                                state.base.steps - row.start_step, row.strength)  # fmt: skip
                yield "image_edit.completed", {"index": job.index, "png": edited.png, "info": edited.info()}
            yield "edit_rt.done", {"base_id": bid}
        finally:
            if request is not None:
                request.cancelled.set()  # a client that left: its rows go at the next step
            self.store.unpin(bid)

    async def edit_base(self, bid: str, specs: list[Edit], http: Optional[HttpRequest] = None,
                        param: str = "base_id") -> list[Edited]:  # fmt: skip
        """``edit_events`` collected: the edits in order, or the first row's error."""
        out = []
        async for kind, data in watch(self.edit_events(bid, specs, param), http):
            if kind == "error":
                raise data["error"]
            if kind == "image_edit.completed":
                info = data["info"]
                out.append(Edited(data["index"], data["png"], info["seconds"], info["preserve"], info["tail_steps"],
                                  info["strength"]))  # fmt: skip
        return sorted(out, key=lambda e: e.index)

    async def has_base(self, bid: str) -> bool:
        return await self._store_read(self.store.__contains__, bid)

    async def base_info(self, bid: str) -> dict:
        with base_errors(bid):
            return await self._store_read(self.store.info, check_base_id(bid))

    async def delete_base(self, bid: str) -> None:
        with base_errors(bid):
            await self._store_read(self.store.delete, check_base_id(bid))

    async def _store_read(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.store_pool, fn, *args)

    async def progress(self) -> dict[str, int]:
        """Rows running and rows queued (AUTOMATIC1111's /progress)."""
        batcher = self.batcher
        return {"active": len(batcher.scheduler.active) if batcher else 0, "queued": batcher.queued_rows if batcher else 0}

    async def metrics_text(self) -> bytes:
        return self.metrics.render()

    @property
    def fingerprint(self) -> str:
        return self.pipe.manifest.fingerprint if self.pipe is not None else ""

    @property
    def backend(self) -> str:
        return self.pipe.graph_set.backend if self.pipe is not None else ""

    @property
    def family(self) -> dict:
        return self.pipe.family

    async def upload(self, data: bytes, param: str) -> Upload:
        """An uploaded image as the served size's pixels, or the API's error for it (decoded in
        the image pool, off the event loop, within ``serve.max_image_pixels``)."""
        base, s = self.cfg.base, self.cfg.serve
        decode = lambda: image_from_bytes(data, (base.width, base.height), param, s.max_image_bytes,  # noqa: E731
                                          s.resize_uploads, s.max_image_pixels)  # fmt: skip
        try:
            return await asyncio.get_running_loop().run_in_executor(self.image_pool, decode)
        except ImageInputError as err:
            raise ApiError(err.status, str(err), param=param, code="invalid_image") from None

    async def image_text(self, data: bytes, param: str) -> dict[str, str]:
        """An uploaded image's text (its PNG ``parameters``, say), read in the image pool without
        decoding its pixels, within the same limits as an upload."""
        s = self.cfg.serve
        read = lambda: text_of_image(data, param, s.max_image_bytes, s.max_image_pixels)  # noqa: E731
        try:
            return await asyncio.get_running_loop().run_in_executor(self.image_pool, read)
        except ImageInputError as err:
            raise ApiError(err.status, str(err), param=param, code="invalid_image") from None

    async def invert(self, upload: Upload, prompt: str = "", negative_prompt: Optional[str] = None, steps: Optional[int] = None,
                     guidance: Optional[float] = None, clip_skip: Optional[int] = None) -> Generated:  # fmt: skip
        """A base from an uploaded image (its inversion; kept in the store like a generation).

        ``prompt`` describes the image (the source prompt; empty if not given). The same image
        with the same settings finds the stored base instead of inverting again."""
        if prompt:
            self.check_prompt(prompt, "source_prompt")
        base = replace(self.base_of(prompt, negative_prompt, None, steps, guidance, 0, clip_skip), image=upload.key)
        pipe = self.pipe
        bid = base_id(pipe.manifest.fingerprint, base)
        start = time.perf_counter()
        if bid not in self.store:
            with queue_errors():  # the inversion's rows go through the batcher's queue
                state = await asyncio.wrap_future(pipe.engine.call(pipe.invert, upload.pixels, base, self.cfg.cache.window_start))
            await self.keep(state)
        state = await self.pinned(bid)
        try:
            image = (await asyncio.wrap_future(pipe.engine.call(pipe.decode, state.final_latent)))[0]  # on the engine thread
        finally:
            self.store.unpin(bid)
        fields = base_fields(base, self.model_name, pipe.manifest.fingerprint, bid)
        fields["Inverted from"] = upload.key
        png = png_bytes(image, parameters_text(base.prompt, base.negative_prompt, fields))
        return Generated(bid, base, png, time.perf_counter() - start, self.store.tier(bid))


async def watch(events: AsyncIterator[Event], http: Optional[HttpRequest]) -> AsyncIterator[Event]:
    """``events`` while the client is there: a client that disconnects closes them (its rows
    leave the batch at the next step) and gets 499."""
    try:
        while True:
            task = asyncio.ensure_future(events.__anext__())
            while not (await asyncio.wait([task], timeout=0.25))[0]:
                if http is not None and await http.is_disconnected():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)  # the events' own cleanup runs
                    raise ApiError(499, "client disconnected", code="client_closed")
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        await events.aclose()
