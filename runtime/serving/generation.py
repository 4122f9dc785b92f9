"""A base's generation, as one reply or as events with previews while it runs; served related
(serving/related.py: a stored near twin's tail) where the request and the server say so.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional

import numpy as np

from ..errors import ClientGoneError
from ..loop.jobs import Job, Request
from ..metrics import Metrics
from ..model.edit import Base, TailRow
from ..pipeline.edit_pipeline import EditPipeline
from ..pipeline.images import png_bytes
from ..pipeline.pnginfo import base_fields, parameters_text
from ..storage.store import base_id
from .bases import Bases
from .previews import Previews
from .related import RelatedGenerations, RelatedPlan, related_base
from .results import Event, Generated
from .step_loops import Client, StepLoops


class Generations:
    """Generations on the loaded ``pipe``: rows of the step ``loops``, kept in ``bases``, looked
    up and indexed by ``related``, previewed by ``previews``, counted in ``metrics``."""

    def __init__(self, pipe: EditPipeline, loops: StepLoops, bases: Bases, related: RelatedGenerations,
                 previews: Previews, metrics: Metrics, model_name: str):  # fmt: skip
        self.pipe = pipe
        self.loops = loops
        self.bases = bases
        self.related = related
        self.previews = previews
        self.metrics = metrics
        self.model_name = model_name

    async def generate(self, base: Base, client: Optional[Client] = None, related: Optional[bool] = None,
                       seed_given: bool = False) -> Generated:  # fmt: skip
        """Generate ``base``, keep it in the store, return its PNG (with its parameters).
        ``related``: serve it from a related stored base (True), never (False), or as the
        server's ``serve.related.enabled`` says unless the request gave its own seed (None)."""
        vector, plan = await self.related.lookup(base, related, seed_given)
        bid, request, job = self._generation(base, plan)
        ok = False
        try:  # a refused submit (a full queue) lets the related base's pin go too
            self.loops.submit(request, [job])
            (result,) = await self.loops.wait(client, request, [job])
            ok = True
        finally:
            self.related.done(plan, ok)
        return await self._generated(job.base, bid, result, plan, vector)

    def _generation(self, base: Base, plan: Optional[RelatedPlan] = None) -> tuple[str, Request, Job]:
        """``base``'s id, and its generation as a request of one row from its initial noise (or,
        related, from ``plan``'s base at its entry step, with ``base``'s prompt)."""
        request = self.loops.new_request()
        if plan is not None:
            base = related_base(base, plan)
            job = Job(request, 0, base, TailRow(base.prompt, 1.0, plan.step, base.guidance), state=plan.state, kind="related")
        else:
            job = Job(request, 0, base, TailRow(base.prompt, 1.0, 0, base.guidance), noise=self.pipe.initial_noise(base))
        return base_id(self.pipe.manifest.fingerprint, base), request, job

    async def _generated(self, base: Base, bid: str, result, plan: Optional[RelatedPlan] = None,
                         vector: Optional[np.ndarray] = None) -> Generated:  # fmt: skip
        """A finished generation kept in the store (and in the related index), as its reply."""
        await self.bases.keep(result.state)
        self.related.add(bid, result.state, vector)
        self.metrics.inc("edit_rt_bases_generated_total")
        fields = self.related.shown_fields(base_fields(base, self.model_name, self.pipe.manifest.fingerprint, bid))
        with self.metrics.stage("png_encode"):
            png = png_bytes(result.image, parameters_text(base.prompt, base.negative_prompt, fields))
        related = None if plan is None else plan.info(self.related.shares_bases())
        return Generated(bid, base, png, result.seconds, self.bases.store.tier(bid), related)

    async def events(self, base: Base, previews: int = 0, related: Optional[bool] = None,
                     seed_given: bool = False) -> AsyncIterator[Event]:  # fmt: skip
        """``generate`` as events: "edit_rt.progress" (index, step, of) as its steps advance,
        ``previews`` x "edit_rt.preview" (index, step, of, png: the decoded x_0 the step
        predicts) spread over the steps, then ("generated", Generated). Wrap it in
        :func:`watch` for a client that may leave."""
        vector, plan = await self.related.lookup(base, related, seed_given)
        bid, request, job = self._generation(base, plan)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request.on_progress = lambda i, step, of: loop.call_soon_threadsafe(
            events.put_nowait, ("edit_rt.progress", {"index": i, "step": step, "of": of}))  # fmt: skip
        self.previews.ask(request, [job], events, previews)
        job.future.add_done_callback(lambda f: loop.call_soon_threadsafe(events.put_nowait, ("done", job)))
        try:
            self.loops.submit(request, [job])
            while (item := await events.get())[0] != "done":
                yield item if item[0] == "edit_rt.progress" else ("edit_rt.preview", await self.previews.event(item[1]))
            result = job.future.result()  # a row's error as raised in the engine thread
            self.related.done(plan, True)
            done, plan = plan, None
            yield "generated", await self._generated(job.base, bid, result, done, vector)
        finally:
            self.related.done(plan, False)  # a failed or abandoned row's pin (None once let go above)
            if not job.future.done():
                request.cancelled.set()  # a client that left: its row goes at the next step


async def watch(events: AsyncIterator[Event], client: Optional[Client], every: float = 0.25) -> AsyncIterator[Event]:
    """``events`` while the client is there, asked every ``every`` seconds whether it is, however
    often the events come (a step's progress comes faster than that: a check made only while
    none came never ran, and a plain request's rows went on after its client left): a client
    that disconnects closes them (its rows leave the batch at the next step) and gets
    :class:`ClientGoneError`."""
    loop = asyncio.get_running_loop()
    task, check_at = None, loop.time() + every
    try:
        while True:
            task = asyncio.ensure_future(events.__anext__())
            while True:
                await asyncio.wait([task], timeout=max(0.0, check_at - loop.time()))
                if loop.time() >= check_at:
                    check_at = loop.time() + every
                    if client is not None and await client.is_disconnected():
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)  # the events' own cleanup runs
                        raise ClientGoneError("client disconnected")
                if task.done():
                    break
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if task is not None and not task.done():
            # this watch was cancelled (its caller's task) while the events ran their step: stop
            # that first, or closing them would find them still running
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await events.aclose()


async def first_result(events: AsyncIterator[Event], client: Optional[Client]) -> Generated:
    """A generation's events (previews made, not returned) until its result."""
    async for kind, data in watch(events, client):
        if kind == "generated":
            return data
    raise RuntimeError("a generation's events ended without its result")  # the events raise first
