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
from dataclasses import replace
from typing import Any, Optional

from starlette.requests import Request as HttpRequest

from ..config.run_config import RunConfig
from ..errors import (ConfigError, DamagedBaseError, DiskFullError, EditRtError,
                      PromptSyntaxError, StoreBusyError, StoreFullError)  # fmt: skip
from ..loop.batcher import Batcher
from ..loop.jobs import Job, Request
from ..metrics import Metrics, timed
from ..model.adapters import check_uses
from ..model.edit import Base
from ..model.state import BaseState
from ..model.weighting import prompt_spans
from ..pipeline.assemble import pipeline_of, store_of
from ..pipeline.edit_pipeline import EditPipeline
from ..storage.related_index import RelatedIndex
from ..storage.store import BaseStore
from .edits import Edits
from .generation import Generation
from .http_errors import (ApiError, base_errors, check_base_id, disk_full, queue_errors, row_error,
                          store_busy, until_done)  # fmt: skip
from .inversion import Uploads
from .decoder_choice import DECODER
from .job_control import DOOR, JobControl
from .related import RelatedGenerations
from .sampler_fields import SamplerFields

log = logging.getLogger(__name__)



class Service(Generation, Edits, RelatedGenerations, SamplerFields, Uploads, JobControl):
    """The loaded engines, store and batcher, and the operations every route uses."""

    def __init__(self, cfg: RunConfig, engines: bool = True):
        """``engines``: this process loads them (a Ray Serve ingress does not: ray_serve.py)."""
        self.cfg = cfg
        self.token = os.environ.get("EDIT_RT_TOKEN") or cfg.serve.token
        self.metrics = Metrics(lambda: self.store.stats() if self.store is not None else None, engines)
        self.pipe: Optional[EditPipeline] = None
        self.store: Optional[BaseStore] = None
        self.related_index: Optional[RelatedIndex] = None
        self._default_sampler: Optional[str] = None  # the model's (SamplerFields), where no pipe is loaded
        self.batcher: Optional[Batcher] = None  # the first served size's
        self.batchers: dict[tuple[int, int], Batcher] = {}  # (width, height) -> its step loop
        self.ready = threading.Event()
        self.draining = threading.Event()
        self.load_error: Optional[str] = None
        self.model_name = cfg.model_name
        self.started = int(time.time())
        self.last_preview: Optional[bytes] = None  # the latest preview's PNG (A1111's current_image)
        self.interrupts = 0  # interrupt() calls so far: a cancelled request tells an interrupt by it
        self.interrupted_at = 0.0  # time.monotonic() of the last interrupt()
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
            pipe.metrics = self.metrics  # the pipeline's stages (text encode, decode, inversion) time themselves here
            pipe.check_decoder(cfg.decoder)  # the server's default decoder (taesd needs the export's tiny one)
            self.store = store_of(cfg, pipe.manifest.fingerprint)
            # the stored bases by prompt (serving/related.py), compared by the configured embedding
            self.related_index = RelatedIndex(cfg.store.disk_dir, cfg.serve.related.embedding)
            sizes = cfg.served_sizes()
            if len(sizes) > 1 and pipe.graph_set.backend == "ort-tensorrt":
                # its provider options take one profile per session; native `trt` plans hold one per size
                raise ConfigError("engines.sizes: the ort-tensorrt backend builds one size per session; serve one "
                                  "size there, or use backend trt (an optimization profile per size)")  # fmt: skip
            for k, (width, height) in enumerate(sizes):  # a step loop per size, all on the one engine thread
                try:
                    shape = pipe.latent_shape(replace(base, width=width, height=height))
                except ConfigError as err:
                    raise ConfigError(f"engines.sizes: {width}x{height}: {err}" if k else str(err)) from None
                batcher = pipe.batcher(shape)
                batcher.queue_limit = cfg.serve.queue_limit
                batcher.metrics = self.metrics
                self.batchers[(width, height)] = batcher.start()
            self.batcher = self.batchers[sizes[0]]
            self.pipe = pipe
            self.metrics.loaded(pipe.graph_set.backend, self.model_name, pipe.manifest.fingerprint,
                                [b.scheduler for b in self.batchers.values()])  # fmt: skip
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
        for batcher in self.batchers.values():
            batcher.close()

    def drained(self) -> bool:
        return all(batcher.idle for batcher in self.batchers.values())

    def finish(self) -> None:
        """Fail what is still running with a clear error (a 503, or an error event)."""
        for batcher in self.batchers.values():
            batcher.stop(timeout=0)

    def shutdown(self) -> None:
        self.ready.clear()
        self.metrics.ready.set(0)
        for batcher in self.batchers.values():
            batcher.stop(timeout=30)
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
        try:  # A1111's emphasis syntax is run; what edit-rt does not run is refused here, by field
            prompt_spans(prompt, negative=param.endswith("negative_prompt"))
        except PromptSyntaxError as err:
            raise ApiError(400, f"{param}: {err}", param=param, code="prompt_syntax") from None

    def base_of(self, prompt: str, negative_prompt: Optional[str] = None, size: Optional[str] = None, steps: Optional[int] = None,
                guidance: Optional[float] = None, seed: int = -1, clip_skip: Optional[int] = None,
                sizes: Optional[dict[str, Optional[int]]] = None, adapters: Optional[dict[str, float]] = None,
                sampler: Optional[str] = None, sampler_param: str = "sampler") -> Base:  # fmt: skip
        """A base from request fields (the server's defaults for what they leave out). ``sizes``:
        SDXL's size conditioning (original_width/height, crop_top/left), where the model takes it;
        ``adapters`` its LoRA adapters, {name: scale} (None: the config base's); ``sampler`` any
        name samplers.py accepts (None: the config base's, else the model's), set on the base as
        the canonical name that runs (its store key, replies and PNG name it), or a 400 naming
        ``sampler_param``. A speed LoRA among the adapters sets the sampler, steps and guidance
        the request and the config leave out (RunConfig.scheduled)."""
        set_here = {f for f, v in (("sampler", sampler), ("steps", steps or None), ("guidance", guidance)) if v is not None}
        default, held = self.cfg.request_base(adapters is not None)  # (the config's, what of its schedule it holds)
        serve = self.cfg.serve
        if sampler is not None:
            sampler = self.sampler_of(sampler, sampler_param)
        self.check_adapters(adapters, "adapters")
        self.check_prompt(prompt, "prompt")
        if negative_prompt is not None:  # None: the family's default (SDXL: zeros)
            self.check_prompt(negative_prompt, "negative_prompt")
        served = [f"{w}x{h}" for w, h in self.cfg.served_sizes()]
        if (size or served[0]) not in served:
            raise ApiError(400, f"size: {size[:16]} is not served; this server's engines serve {', '.join(served)}",
                           param="size", code="unsupported_size")  # fmt: skip
        width, height = map(int, (size or served[0]).split("x"))
        # a speed LoRA's schedule (run_config.scheduled) where neither the request nor the config set one
        adapters = default.adapters if adapters is None else dict(adapters)
        try:
            scheduled = self.cfg.scheduled(replace(default, adapters=adapters, sampler=sampler or default.sampler,
                                                   steps=steps or default.steps, image=None,
                                                   guidance=default.guidance if guidance is None else guidance),
                                           set_here | held, "")  # fmt: skip
        except ConfigError as err:
            raise ApiError(400, str(err), param="adapters", code="invalid_value") from None
        steps, guidance = scheduled.steps, scheduled.guidance
        if "sampler" in set_here or (scheduled.sampler is not None and scheduled.sampler == default.sampler):
            sampler = scheduled.sampler  # the request's (checked above) or the config base's
        elif scheduled.sampler is not None:  # its speed LoRA's, refused here if this model cannot run it
            sampler = self.sampler_of(scheduled.sampler, "adapters")
        else:
            sampler = self.default_sampler
        if steps > serve.max_steps:
            raise ApiError(400, f"steps: at most {serve.max_steps}", param="steps", code="too_many_steps")
        seed = seed if seed >= 0 else secrets.randbelow(2**31)
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
        return replace(default, width=width, height=height, prompt=prompt, negative_prompt=negative_prompt, seed=seed, steps=steps, guidance=guidance,
                       clip_skip=clip_skip, image=None, adapters=adapters, sampler=sampler, **given)  # fmt: skip

    def check_adapters(self, adapters: Optional[dict], where: str) -> None:
        """400 naming the field for an unknown adapter, a scale out of range, more adapters than
        the export's slots, or adapters on an export without slots."""
        if not adapters:
            return
        bank = self.pipe.adapter_bank if self.pipe is not None else None
        if bank is None:
            raise ApiError(400, f"{where}: this server's export has no adapter slots (export.adapter_slots); leave "
                           "adapters out", param=where, code="unsupported")  # fmt: skip
        try:
            check_uses(adapters, bank.adapters, bank.slots, where)
        except ConfigError as err:
            field = str(err).split(":", 1)[0]
            raise ApiError(400, str(err), param=field, code="unknown_adapter" if "no adapter" in str(err) else "out_of_range") from None

    # --- work ---------------------------------------------------------------------------------

    def _new_request(self) -> Request:
        return Request(uuid.uuid4().hex, deadline=time.monotonic() + self.cfg.serve.request_timeout_s, door=DOOR.get(),
                       decoder=DECODER.get() or self.cfg.decoder)  # fmt: skip

    def submit(self, request: Request, jobs: list[Job]) -> None:
        with queue_errors():
            self.batcher_of(jobs[0].base).submit(request, jobs)

    def batcher_of(self, base: Base) -> Batcher:
        """The step loop of ``base``'s size (a stored base of a size no longer served: 400)."""
        batcher = self.batchers.get((base.width, base.height))
        if batcher is None:
            served = ", ".join(f"{w}x{h}" for w, h in self.batchers)
            raise ApiError(400, f"base_id: this base is {base.width}x{base.height}; this server serves {served} "
                           "(engines.sizes)", param="base_id", code="unsupported_size")  # fmt: skip
        return batcher

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
        except EditRtError as err:  # every error of a row in the engine thread, as its answer
            raise row_error(err) from None
        finally:
            if any(not f.done() for f in futures):
                request.cancelled.set()

    @timed("store_load")
    def _pin(self, bid: str) -> BaseState:
        """``store.pin``: from RAM, or read and verified from the disk tier."""
        return self.store.pin(bid)

    async def pinned(self, bid: str, param: str = "base_id") -> BaseState:
        """Pin ``bid`` (in a thread: a disk load may read a file). A caller cancelled meanwhile
        (its client left) never sees the pin, so the pin is let go when it lands."""
        with base_errors(bid, param):
            pin = asyncio.get_running_loop().run_in_executor(self.store_pool, self._pin, check_base_id(bid))
            try:
                return await asyncio.shield(pin)
            except asyncio.CancelledError:
                pin.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or self.store.unpin(bid))
                raise

    async def has_base(self, bid: str) -> bool:
        return await self._store_read(self.store.__contains__, bid)

    async def base_info(self, bid: str) -> dict:
        with base_errors(bid):
            info = await self._store_read(self.store.info, check_base_id(bid))
        return {**info, "base": self.shown_base(info["base"])}

    async def delete_base(self, bid: str) -> None:
        with base_errors(bid):
            await self._store_read(self.store.delete, check_base_id(bid))

    async def _store_read(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.store_pool, fn, *args)

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

