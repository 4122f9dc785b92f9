"""The service every door calls: the loaded engines, store and step loops, and the operations
the native API, the OpenAI-compatible routes, the AUTOMATIC1111-compatible routes and the Python
API share (generate, edit, invert, the store's, job control).

:class:`Service` owns its parts and delegates to them; each part holds its own state and is
given what it uses:

- ``fields`` (fields.py): a request's fields checked against the served model, and its base;
- ``loops`` (step_loops.py): the step loop of each served size, rows submitted and awaited;
- ``jobs`` (job_control.py): what the loops run, and stopping it (A1111's progress, interrupt);
- ``images`` (image_work.py): uploads decoded in the image pool, within their deadline;
- ``bases`` (bases.py): the store as requests use it (keep, pin, read, delete);
- ``related`` (related.py): related generations, the index and when a request is served from it;
- ``previews`` (previews.py): previews while rows run;
- once the engines load, ``generations`` (generation.py), ``edits`` (edits.py) and
  ``inversions`` (inversion.py) on the pipeline; for a planner's config (``plan:``), ``plans``
  (pipeline/plans.py: its base plans kept, its variants one batched tail on the served loop).

Every refusal is a domain error of runtime/errors.py with the field it names; only web/ turns
them into HTTP answers (web/http_errors.py), and the Python API raises them as they are.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Optional

from ..config.run_config import RunConfig
from ..errors import ConfigError, RequestError, TooLargeError
from ..engine.manifest import Manifest
from ..metrics import Metrics
from ..model import driving
from ..model.adapters import Adapter
from ..model.edit import Base, Edit
from ..pipeline.assemble import pipeline_of, store_of
from ..pipeline.edit_pipeline import EditPipeline
from ..pipeline.plans import PlanLoop, PlanOutcome, Variant
from ..pipeline.uploads import Upload
from ..storage.related_index import RelatedIndex
from .adapter_reload import reloaded
from .bases import Bases
from .decoder_choice import choose_decoder, upload_encoder
from .edits import Edits, collected
from .fields import RequestFields, ServedModel
from .generation import Generations, first_result
from .image_work import ImageWork
from .inversion import Inversions, named_base
from .job_control import JobControl
from .previews import Previews
from .related import RelatedGenerations
from .results import Edited, Event, Generated
from .step_loops import Client, StepLoops

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedAdapters:
    """The LoRAs a request may name here. ``loaded``: name -> the converted adapter, or None on a
    Ray Serve ingress (no engine runs there: the config's names, which every replica loads);
    ``sources``: name -> the LoRA file it was converted from; ``slots``: the export's adapter
    slots (0: it runs no LoRA)."""

    slots: int
    loaded: dict[str, Optional[Adapter]]
    sources: dict[str, str]


class Service:
    """The loaded engines, store and step loops, and the operations every door uses."""

    def __init__(self, cfg: RunConfig, engines: bool = True):
        """``engines``: this process loads them (a Ray Serve ingress does not: ray_serve.py)."""
        self.cfg = cfg
        self.token = os.environ.get("EDIT_RT_TOKEN") or cfg.serve.token
        self.model_name = cfg.model_name
        self.started = int(time.time())
        self.metrics = Metrics(lambda: self.bases.store.stats() if self.bases.store is not None else None, engines)
        self.bases = Bases(self.metrics)
        self.fields = RequestFields(cfg)
        self.loops = StepLoops(cfg)
        self.jobs = JobControl(self.loops.by_size)
        self.images = ImageWork(cfg)
        self.related = RelatedGenerations(cfg, self.metrics, self.bases)
        self.previews = Previews(self.images.pool)
        self.pipe: Optional[EditPipeline] = None
        self.generations: Optional[Generations] = None
        self.edits: Optional[Edits] = None
        self.inversions: Optional[Inversions] = None
        self.plans: Optional[PlanLoop] = None  # a planner's loop (cfg.plan)
        self.ready = threading.Event()
        self.draining = threading.Event()
        self.load_error: Optional[str] = None

    # --- life -----------------------------------------------------------------------------------

    def load(self) -> None:
        """Load the engines (in a thread: /health answers 503 meanwhile)."""
        try:
            cfg, base = self.cfg, self.cfg.base
            pipe = pipeline_of(cfg).activate()
            pipe.metrics = self.metrics  # the pipeline's stages (text encode, decode, inversion) time themselves here
            pipe.check_decoder(cfg.decoder)  # the server's default decoder (taesd needs the export's tiny one)
            self.bases.store = store_of(cfg, pipe.manifest.fingerprint)
            # the stored bases by prompt (related.py), compared by the configured embedding
            embedding = cfg.serve.related.embedding
            self.related.attach(RelatedIndex(cfg.store.disk_dir, embedding),
                                lambda b: pipe.engine.call(pipe.prompt_embeddings, [b.prompt], b.clip_skip, embedding))
            self.fields.model = ServedModel(pipe.manifest, pipe.default_sampler, pipe.adapter_bank)
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
                self.loops.add((width, height), batcher)
            self.pipe = pipe
            self.generations = Generations(pipe, self.loops, self.bases, self.related, self.previews, self.metrics,
                                           self.model_name)  # fmt: skip
            self.edits = Edits(cfg, self.fields, self.loops, self.bases, self.previews, self.related, self.metrics,
                               self.model_name)  # fmt: skip
            self.inversions = Inversions(cfg, pipe, self.fields, self.bases, self.metrics, self.model_name)
            if cfg.plan is not None:  # a planner: plans served (POST /v1/plans) from its base plans
                self.plans = PlanLoop.of_config(pipe, cfg)
            self.metrics.loaded(pipe.graph_set.backend, self.model_name, pipe.manifest.fingerprint,
                                [b.scheduler for b in self.loops.by_size.values()])  # fmt: skip
            self.ready.set()
            self.metrics.ready.set(1)
            log.info("ready: backend %s (%s)", pipe.graph_set.backend, pipe.graph_set.reason)
        except Exception as err:  # reported by /health; the process stays up to say why
            self.load_error = str(err)
            log.exception("loading the engines failed")

    def start_drain(self) -> None:
        """Stop admitting: new requests are refused (shutting down); rows in flight go on."""
        self.draining.set()
        self.metrics.ready.set(0)
        self.loops.close()

    def drained(self) -> bool:
        return self.loops.idle()

    def finish(self) -> None:
        """Fail what is still running with a clear error (shutting down)."""
        self.loops.stop(timeout=0)

    def shutdown(self) -> None:
        self.ready.clear()
        self.metrics.ready.set(0)
        self.loops.stop(timeout=30)
        if self.pipe is not None:
            self.pipe.deactivate()
        self.images.close()
        self.bases.close()

    # --- what is served -------------------------------------------------------------------------

    @property
    def manifest(self) -> Optional[Manifest]:
        """The export served (None until it loads)."""
        return self.fields.model.manifest if self.fields.model is not None else None

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint if self.manifest is not None else ""

    @property
    def backend(self) -> str:
        return self.pipe.graph_set.backend if self.pipe is not None else ""

    @property
    def store(self):
        return self.bases.store

    def adapters(self) -> ServedAdapters:
        """The LoRAs served, as every door lists and checks them; a reload goes through
        ``reload_adapters``."""
        if self.pipe is None:  # a Ray Serve ingress
            return ServedAdapters(self.cfg.adapter_slots, dict.fromkeys(self.cfg.adapters),
                                  {name: str(source) for name, source in self.cfg.adapters.items()})  # fmt: skip
        bank = self.pipe.adapter_bank
        if bank is None:
            return ServedAdapters(0, {}, {})
        return ServedAdapters(bank.slots, dict(bank.adapters),
                              {name: a.source or str(a.path) for name, a in bank.adapters.items()})  # fmt: skip

    async def reload_adapters(self) -> None:
        """The config file's ``adapters:`` read again and loaded on the engine thread (adapter_reload.py)."""
        self.cfg = await reloaded(self.cfg, self.pipe)

    async def plan(self, scene: driving.Scene, variants: list[Variant], base: Variant, tail_steps: Optional[int] = None,
                   seed: Optional[int] = None) -> PlanOutcome:  # fmt: skip
        """A planner's loop (pipeline/plans.py): the scene's base plan (kept from an earlier
        request, or generated) and every variant as one batched tail of it, judged. Its rows run
        on the served step loop beside every other request's."""
        if self.plans is None:
            raise RequestError("this server's model is not a planner (its config has no plan: section); serve a plan "
                               "config (configs/plan.yaml)", "model", "not_a_planner")  # fmt: skip
        limit = self.cfg.serve.max_edits_per_request
        if len(variants) > limit:
            raise TooLargeError(f"behaviours x aggressiveness: {len(variants)} variants; this server plans at most {limit} "
                                "a request (serve.max_edits_per_request)", "behaviours", "too_many_edits")  # fmt: skip
        return await asyncio.to_thread(self.plans.run, scene, variants, base, tail_steps, seed)

    def choose_decoder(self, asked: Optional[str], param: str = "decoder") -> None:
        """This request's decoder (decoder_choice.py), checked against the export."""
        choose_decoder(self.manifest, asked, param)

    def upload_encoder(self) -> str:
        return upload_encoder(self.cfg, self.manifest)

    # --- operations (a Ray Serve ingress runs each on a worker: ray_serve.RayService) ------------

    async def generate(self, base: Base, client: Optional[Client] = None, previews: int = 0,
                       related: Optional[bool] = None, seed_given: bool = False) -> Generated:  # fmt: skip
        """Generate ``base``, keep it in the store, return its PNG (with its parameters).
        ``previews``: made while it runs (the latest of A1111's door kept), not returned.
        ``related``: serve it from a related stored base (True), never (False), or as the
        server's ``serve.related.enabled`` says unless the request gave its own seed (None)."""
        if previews > 0:
            return await first_result(self.generate_events(base, previews, related, seed_given), client)
        return await self.generations.generate(base, client, related, seed_given)

    def generate_events(self, base: Base, previews: int = 0, related: Optional[bool] = None,
                        seed_given: bool = False) -> AsyncIterator[Event]:  # fmt: skip
        """``generate`` as events (generation.Generations.events)."""
        return self.generations.events(base, previews, related, seed_given)

    def edit_events(self, bid: str, specs: list[Edit], param: str = "base_id", previews: int = 0,
                    **masks) -> AsyncIterator[Event]:  # fmt: skip
        """Edits of the stored base ``bid`` as one batched tail, as events (edits.Edits.events)."""
        return self.edits.events(bid, specs, param, previews, **masks)

    async def edit_base(self, bid: str, specs: list[Edit], client: Optional[Client] = None,
                        param: str = "base_id", previews: int = 0, **masks) -> list[Edited]:  # fmt: skip
        """``edit_events`` collected: the edits in order, or the first row's error."""
        return await collected(self.edit_events(bid, specs, param, previews, **masks), client)

    async def invert(self, upload: Upload, prompt: str = "", negative_prompt: Optional[str] = None, steps: Optional[int] = None,
                     guidance: Optional[float] = None, clip_skip: Optional[int] = None) -> Generated:  # fmt: skip
        return await self.inversions.invert(upload, prompt, negative_prompt, steps, guidance, clip_skip)

    async def named_base(self, data: bytes, param: str) -> Optional[dict]:
        """The stored base an uploaded image's PNG text names (inversion.named_base), or None."""
        return await named_base(self.images, self.base_info, data, param)

    async def has_base(self, bid: str) -> bool:
        return await self.bases.has(bid)

    async def base_info(self, bid: str) -> dict:
        """A stored base's file and fields, its ``related`` shown as bases are shared (related.py)."""
        info = await self.bases.info(bid)
        return {**info, "base": self.related.shown_base(info["base"])}

    async def delete_base(self, bid: str) -> None:
        await self.bases.delete(bid)

    async def metrics_text(self) -> bytes:
        return self.metrics.render()

    async def progress(self, door: Optional[str] = None) -> dict[str, int]:
        return await self.jobs.progress(door)

    def in_flight(self, door: Optional[str] = None) -> dict:
        return self.jobs.in_flight(door)

    async def job_status(self, door: Optional[str] = None) -> dict:
        """``in_flight()`` for a route (Ray Serve's ingress gathers its replicas')."""
        return self.jobs.in_flight(door)

    async def stop_jobs(self, door: Optional[str] = None) -> int:
        """``interrupt()`` for a route (Ray Serve's ingress sends it to every replica)."""
        return self.jobs.interrupt(door)

    def interrupt(self, door: Optional[str] = None) -> int:
        return self.jobs.interrupt(door)
