"""`edit-rt serve CONFIG --ray`: the same API on Ray Serve, past one machine.

Two deployments:

- ``edit-rt`` (the ingress, one replica, no engines): the one FastAPI app of ``server.py``
  (``@serve.ingress``, late-bound so it is built in the replica) over a :class:`RayService`,
  whose operations (generate, invert, edit, the store's) run on the workers. Everything about
  HTTP (validation, errors, the bearer token, body limits, SSE, the page) happens here, once.
- ``edit-rt-worker`` (``serve.ray.replicas`` replicas, ``cpus_per_replica``/``gpus_per_replica``
  each): :class:`EditWorker`, a whole local :class:`~edit_rt.runtime.serving.service.Service` (one
  engine set, one batcher, a RAM tier) over the shared disk tier (``store.disk_dir``).

Routing (:class:`BaseAffinityRouter`, Ray Serve's request-router API): a request that names a
base goes to a replica that holds it (where it was made or served, remembered by the ingress; a
base it does not remember goes to its rendezvous-hash owner among the live replicas), unless
that replica is past a load bound: then to the least loaded, which loads the base from the
shared tier (correct, just not warm) and holds it from then on. A new base goes to the less
loaded of two random replicas.
Each replica counts edits by where it found their base (``edit_rt_edit_requests_total
{base_tier}``): ``ram`` is an edit served by its base's owner.

A replica that dies loses nothing acknowledged: a base is in the shared tier before its
generation is answered. Its in-flight requests get 503 (``replica_lost``, Retry-After) and a
retry goes to a live replica; Ray Serve starts a replacement.

Job control is scoped by door as in one process: every operation that makes rows carries the
door its request came in by (``door``: the ingress's ``job_control.DOOR``) to its worker, so
A1111's ``/progress``, ``/interrupt`` and ``/skip`` see and stop the A1111 door's requests only.
The same operations carry the request's decoder (``decoder``: the ingress's
``decoder_choice.DECODER``, checked there against the export): a ContextVar stays in its process,
and the replica decodes the images (and encodes an upload) by the one the request chose.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import ray
from prometheus_client import Counter
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..config.run_config import RunConfig
from ..engine.manifest import load_manifest
from ..errors import ConfigError, EditRtError, ReplicaLostError
from ..metrics import merged
from ..model.edit import Base, Edit
from ..pipeline.uploads import Upload
from ..serving.decoder_choice import DECODER
from ..serving.fields import ServedModel
from ..serving.inversion import inversion_base
from ..serving.job_control import DOOR
from ..serving.results import Event, Generated
from ..serving.service import Service
from ..serving.step_loops import until_done
from ..storage.store import base_id, is_base_id
from ..web.exposure import refuse_an_open_port
from ..web.server import create_app, listening_line
from .router import BaseAffinityRouter

log = logging.getLogger(__name__)

APP_NAME = "edit-rt"
WORKER = "edit-rt-worker"


# --- the workers ----------------------------------------------------------------------------------


@dataclass
class Refused:
    """A worker's answer that is the service's refusal of the request (returned rather than
    raised: Ray would log a raised one as a replica failure, with its traceback)."""

    error: EditRtError


async def refusing(call):
    try:
        return await call
    except EditRtError as err:
        return Refused(err)


def as_sent(door: str, decoder: Optional[str]) -> None:
    """This worker call's own task takes its request's door and decoder, as the ingress's had
    them: the Requests it makes are that door's, decoded (an upload encoded) by that decoder."""
    DOOR.set(door)
    DECODER.set(decoder)


class EditWorker:
    """One replica: a local Service, loaded before the replica reports healthy. Every method
    takes the ``route`` its request was routed by (the router reads it; the worker ignores it);
    those that make rows take the ``door`` their request came in by (its Requests are that
    door's: whose interrupt stops them) and its ``decoder`` (None: the server's)."""

    def __init__(self, cfg: RunConfig):
        self.service = Service(cfg)
        self.service.load()
        if self.service.load_error:
            raise RuntimeError(f"edit-rt worker: {self.service.load_error}")
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def generate(self, base: Base, route: Optional[dict] = None, related: Optional[bool] = None,
                       seed_given: bool = False, door: str = "", decoder: Optional[str] = None) -> Generated:  # fmt: skip
        as_sent(door, decoder)
        return await refusing(self.service.generate(base, related=related, seed_given=seed_given))

    async def invert(self, upload: Upload, prompt: str, negative_prompt: Optional[str], steps: Optional[int],
                     guidance: Optional[float], clip_skip: Optional[int], route: Optional[dict] = None,
                     door: str = "", decoder: Optional[str] = None) -> Generated:  # fmt: skip
        as_sent(door, decoder)
        return await refusing(self.service.invert(upload, prompt, negative_prompt, steps, guidance, clip_skip))

    async def edit_events(self, bid: str, specs: list[Edit], param: str = "base_id", previews: int = 0,
                          route: Optional[dict] = None, door: str = "", decoder: Optional[str] = None,
                          **masks) -> AsyncIterator[Event]:  # fmt: skip
        as_sent(door, decoder)  # before the first event: the edit's Request is made then
        try:
            async for event in self.service.edit_events(bid, specs, param, previews, **masks):
                yield event
        except EditRtError as err:
            yield "refused", {"error": err}

    async def generate_events(self, base: Base, previews: int = 0, route: Optional[dict] = None, related: Optional[bool] = None,
                              seed_given: bool = False, door: str = "", decoder: Optional[str] = None) -> AsyncIterator[Event]:  # fmt: skip
        as_sent(door, decoder)
        try:
            async for event in self.service.generate_events(base, previews, related, seed_given):
                yield event
        except EditRtError as err:
            yield "refused", {"error": err}

    async def has_base(self, bid: str, route: Optional[dict] = None) -> bool:
        return await refusing(self.service.has_base(bid))

    async def base_info(self, bid: str, route: Optional[dict] = None) -> dict:
        return await refusing(self.service.base_info(bid))

    async def delete_base(self, bid: str, route: Optional[dict] = None) -> Optional[Refused]:
        return await refusing(self.service.delete_base(bid))

    async def status(self, route: Optional[dict] = None, door: Optional[str] = None) -> dict:
        """This replica's id, process, backend, rows and metrics (the ingress's scrape); its
        rows and ``in_flight`` of ``door``'s requests only where one is named (A1111's /progress)."""
        return {"replica": self.replica, "pid": os.getpid(), "backend": self.service.backend,
                **(await self.service.progress(door)), "in_flight": self.service.in_flight(door),
                "metrics": await self.service.metrics_text()}  # fmt: skip

    async def interrupt(self, route: Optional[dict] = None, door: Optional[str] = None) -> dict:
        """AUTOMATIC1111's interrupt on this replica: ``door``'s running requests (None: every
        door's) stop at the next step."""
        return {"replica": self.replica, "interrupted": self.service.interrupt(door)}

    def check_health(self) -> None:
        """Ray Serve's health check: a worker whose step loop died is replaced."""
        batcher = self.service.loops.first
        if batcher is None or not batcher.alive:
            raise RuntimeError("the step loop is not running")

    def __del__(self):
        self.service.start_drain()
        self.service.shutdown()


# --- the ingress ----------------------------------------------------------------------------------


def replica_lost(err: BaseException) -> ReplicaLostError:
    return ReplicaLostError(f"the replica serving this request stopped ({type(err).__name__}); retry: another replica "
                            "serves the base from the shared store")  # fmt: skip


def unwrap(err: BaseException) -> BaseException:
    """A worker's refusal as itself; a replica that died as :class:`ReplicaLostError`; anything else as is."""
    if isinstance(err, ray.exceptions.RayTaskError) and isinstance(err.cause, EditRtError):
        return err.cause
    if isinstance(err, EditRtError):
        return err
    if isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return replica_lost(err)
    return err


class RayService(Service):
    """The ingress's Service: validation and HTTP here, every operation on a worker replica."""

    def __init__(self, cfg: RunConfig, workers):
        super().__init__(cfg, engines=False)
        self.workers = workers
        self.resent = Counter("edit_rt_replica_lost_resent", "Requests sent again because their replica died",
                              registry=self.metrics.registry)  # fmt: skip
        self._backend = ""

    def load(self) -> None:
        try:
            # base ids and validation need no engines
            self.fields.model = ServedModel.of_manifest(load_manifest(self.cfg.onnx_dir))
            status = self.workers.status.remote(route={"replica": 0}).result(timeout_s=600)
            self._backend = status["backend"]
            self.ready.set()
            self.metrics.ready.set(1)
            log.info("ready: %d replicas, backend %s", self.cfg.serve.ray.replicas, self._backend)
        except Exception as err:
            self.load_error = str(err)
            log.exception("connecting to the workers failed")

    def shutdown(self) -> None:
        self.ready.clear()
        self.metrics.ready.set(0)

    @property
    def backend(self) -> str:
        return f"ray:{self._backend}"

    async def call(self, send, client=None):
        """A worker's answer to ``send()``; a client that leaves cancels it (its rows go at the
        next step). Once, a request whose replica died is sent again (every operation here is
        idempotent: a base is a function of its key, an edit of its base and row)."""
        for attempt in range(2):
            response = send()
            task = asyncio.ensure_future(self._result(response))
            await until_done([task], client, lambda: (response.cancel(), task.cancel()))
            try:
                return task.result()
            except ReplicaLostError:
                if attempt:
                    raise
                log.warning("a replica died under a request; sending it again")
                self.resent.inc()

    @staticmethod
    async def _result(response):
        try:
            value = await response
        except Exception as err:
            raise unwrap(err) from None
        if isinstance(value, Refused):
            raise value.error
        return value

    async def generate(self, base: Base, client=None, previews: int = 0, related: Optional[bool] = None,
                       seed_given: bool = False) -> Generated:  # fmt: skip
        """On a replica. ``previews`` (A1111's live previews) are not made here: the ingress could
        not show a replica's (its /progress current_image stays None on Ray Serve). ``related``:
        the replica looks its related base up (docs/related.md: routed as any generation)."""
        bid, door, decoder = base_id(self.fingerprint, base), DOOR.get(), DECODER.get()
        return await self.call(lambda: self.workers.generate.remote(base, route={"base": bid, "new": True}, related=related,
                                                                    seed_given=seed_given, door=door, decoder=decoder), client)  # fmt: skip

    async def invert(self, upload: Upload, prompt: str = "", negative_prompt: Optional[str] = None, steps: Optional[int] = None,
                     guidance: Optional[float] = None, clip_skip: Optional[int] = None) -> Generated:  # fmt: skip
        base = inversion_base(self.fields, upload, self.upload_encoder(), prompt, negative_prompt, steps, guidance, clip_skip)
        route, door, decoder = {"base": base_id(self.fingerprint, base), "new": True}, DOOR.get(), DECODER.get()
        return await self.call(lambda: self.workers.invert.remote(upload, prompt, negative_prompt, steps, guidance,
                                                                  clip_skip, route=route, door=door, decoder=decoder))  # fmt: skip

    async def edit_events(self, bid: str, specs: list[Edit], param: str = "base_id", previews: int = 0,
                          **masks) -> AsyncIterator[Event]:  # fmt: skip
        """On the replica holding ``bid``; ``masks``: Service.edit_events' pixel masks, backdrops,
        PNG fields and mask parameter (numpy arrays travel as Ray objects)."""
        door, decoder = DOOR.get(), DECODER.get()
        for attempt in range(2):
            stream = self.workers.options(stream=True).edit_events.remote(bid, specs, param, previews, route={"base": bid},
                                                                          door=door, decoder=decoder, **masks)  # fmt: skip
            started = finished = False
            try:
                async for kind, data in stream:
                    if kind == "refused":
                        finished = True
                        raise data["error"]
                    started = True
                    yield kind, data
                finished = True
                return
            except Exception as err:
                err = unwrap(err)
                if not isinstance(err, ReplicaLostError) or started or attempt:
                    raise err from None
                log.warning("a replica died before answering an edit; sending it again")
                self.resent.inc()
            finally:
                if not finished:
                    stream.cancel()  # the client left, or a row failed: the worker drops its rows

    async def edit_base(self, bid: str, specs: list[Edit], client=None, param: str = "base_id", **masks):
        """As the local one; a replica lost midway is tried once more (nothing was sent yet)."""
        try:
            return await super().edit_base(bid, specs, client, param, **masks)
        except ReplicaLostError:
            log.warning("a replica died under an edit; sending it again")
            self.resent.inc()
            return await super().edit_base(bid, specs, client, param, **masks)

    async def generate_events(self, base: Base, previews: int = 0, related: Optional[bool] = None,
                              seed_given: bool = False) -> AsyncIterator[Event]:  # fmt: skip
        """A streamed generation on the replica it is routed to (previews, then "generated")."""
        bid = base_id(self.fingerprint, base)
        stream = self.workers.options(stream=True).generate_events.remote(base, previews, route={"base": bid, "new": True},
                                                                          related=related, seed_given=seed_given,
                                                                          door=DOOR.get(), decoder=DECODER.get())  # fmt: skip
        finished = False
        try:
            async for kind, data in stream:
                if kind == "refused":
                    finished = True
                    raise data["error"]
                yield kind, data
            finished = True
        except EditRtError:
            raise
        except Exception as err:
            raise unwrap(err) from None
        finally:
            if not finished:
                stream.cancel()

    async def _on_owner(self, method: str, bid: str):
        if not is_base_id(bid):  # no replica can hold it: the worker answers 404 all the same
            return await self._result(getattr(self.workers, method).remote(bid, route={}))
        return await self._result(getattr(self.workers, method).remote(bid, route={"base": bid}))

    async def has_base(self, bid: str) -> bool:
        return await self._on_owner("has_base", bid)

    async def base_info(self, bid: str) -> dict:
        return await self._on_owner("base_info", bid)

    async def delete_base(self, bid: str) -> None:
        await self._on_owner("delete_base", bid)

    async def replicas(self, method: str = "status", **kwargs) -> list[dict]:
        """Every worker's answer to ``method`` (its status by default, with ``kwargs``; one call
        per replica, in id order; a replica lost meanwhile is left out)."""
        n, out = self.cfg.serve.ray.replicas, {}
        for k in range(0, 4 * n, n):  # the affinity router answers in one round; Ray's own picks at random
            calls = [getattr(self.workers, method).remote(route={"replica": k + i}, **kwargs) for i in range(n)]
            for status in await asyncio.gather(*(self._result(c) for c in calls), return_exceptions=True):
                if isinstance(status, dict):
                    out[status["replica"]] = status
            if len(out) >= n:
                break
        return list(out.values())

    async def progress(self, door: Optional[str] = None) -> dict[str, int]:
        statuses = await self.replicas(door=door)
        return {"active": sum(s["active"] for s in statuses), "queued": sum(s["queued"] for s in statuses)}

    async def metrics_text(self) -> bytes:
        return merged(self.metrics.registry, {s["replica"]: s["metrics"] for s in await self.replicas()})

    async def job_status(self, door: Optional[str] = None) -> dict:
        """The replicas' step loops as one (A1111's /progress): ``door``'s requests and row-steps
        summed (each worker's requests carry the door they came in by), the oldest running row's
        step (time.monotonic() is one clock per machine)."""
        parts = [s["in_flight"] for s in await self.replicas(door=door)]
        started = [p for p in parts if p["started"] is not None]
        oldest = min(started, key=lambda p: p["started"]) if started else None
        return {**{key: sum(p[key] for p in parts) for key in ("running", "queued", "done", "total")},
                "started": oldest["started"] if oldest else None, "current": oldest["current"] if oldest else None}

    async def stop_jobs(self, door: Optional[str] = None) -> int:
        """A1111's interrupt on every replica, of ``door``'s running requests only (None: every
        door's), as the local service's."""
        self.jobs.interrupts += 1
        self.jobs.interrupted_at = time.monotonic()
        return sum(answer["interrupted"] for answer in await self.replicas("interrupt", door=door))


class Ingress:
    """The HTTP deployment: the app of ``server.create_app`` over a :class:`RayService`."""

    def __init__(self, cfg: RunConfig, workers):
        self.cfg = cfg
        self.service = RayService(cfg, workers)

    def __serve_build_asgi_app__(self):
        return create_app(self.cfg, self.service)


def application(cfg: RunConfig):
    """The Ray Serve application: the ingress bound to the workers."""
    r = cfg.serve.ray
    if r.replicas > 1 and cfg.store.disk_dir is None:
        raise ConfigError("store.disk_dir: Ray replicas share bases through the disk tier; set it to a folder every "
                          "replica can reach (a shared filesystem on a cluster)")  # fmt: skip
    router = RequestRouterConfig()  # Ray Serve's power of two choices
    if r.routing == "affinity":
        router = RequestRouterConfig(request_router_class=BaseAffinityRouter,
                                     request_router_kwargs={"placements": r.placements, "load_bound": r.load_bound})
    worker = serve.deployment(
        EditWorker, name=WORKER, num_replicas=r.replicas, max_ongoing_requests=r.max_ongoing_requests,
        ray_actor_options={"num_cpus": r.cpus_per_replica, "num_gpus": r.gpus_per_replica},
        request_router_config=router, health_check_period_s=5, graceful_shutdown_timeout_s=cfg.serve.drain_timeout_s,
    )  # fmt: skip
    ingress = serve.deployment(serve.ingress()(Ingress), name=APP_NAME, num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)  # fmt: skip
    return ingress.bind(cfg, worker.bind(cfg))


def start(cfg: RunConfig) -> None:
    """Join (``serve.ray.address``, ``RAY_ADDRESS``) or start Ray, and deploy the application."""
    address = os.environ.get("RAY_ADDRESS") or cfg.serve.ray.address
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    serve.run(application(cfg), name=APP_NAME, route_prefix="/")


def serve_forever(cfg: RunConfig, say=print, allow_no_token: bool = False) -> None:
    """`edit-rt serve --ray`: deploy, then wait for SIGTERM or SIGINT and take it down. A port
    beyond loopback without credentials is refused unless ``allow_no_token`` (web/exposure.py)."""
    refuse_an_open_port(cfg.serve, cfg.source or "the config", allow_no_token, say)
    start(cfg)
    # said once Ray Serve's proxy holds the port (the CLI prints no address before that)
    say(listening_line(cfg, f"; Ray Serve, {cfg.serve.ray.replicas} replicas"))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
