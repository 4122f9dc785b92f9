"""A base's generation, as one reply or as events with previews while it runs; served related
(serving/related.py: a stored near twin's tail) where the request and the server say so.

A preview is the decoded x_0 that a step predicts (the step graph's, whatever the sampler): one
VAE decode of its row on the engine thread and one PNG encode in the image pool. ``k`` previews
are spread over each row's own tail (``Job.preview_every`` = ceil(tail / (k + 1)) steps), so the
rows of one request with tails of 12 and 6 steps each get theirs. The latest preview's PNG is kept
(A1111's ``current_image``).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional

import numpy as np

from starlette.requests import Request as HttpRequest

from ..errors import EditRtError
from ..loop.jobs import Job, Request
from ..model.edit import Base, TailRow
from ..pipeline.images import png_bytes
from ..pipeline.pnginfo import base_fields, parameters_text
from ..storage.store import base_id
from .http_errors import ApiError, row_error
from .job_control import A1111, DOOR
from .related import RelatedPlan
from .results import Event, Generated


class Generation:
    """Mixed into :class:`~edit_rt.runtime.serving.service.Service` (its pipe, store, metrics,
    image pool and submit / wait / keep)."""

    async def generate(self, base: Base, http: Optional[HttpRequest] = None, previews: int = 0,
                       related: Optional[bool] = None, seed_given: bool = False) -> Generated:  # fmt: skip
        """Generate ``base``, keep it in the store, return its PNG (with its parameters).
        ``previews``: made while it runs (the latest kept as ``last_preview``), not returned.
        ``related``: serve it from a related stored base (True), never (False), or as the
        server's ``serve.related.enabled`` says unless the request gave its own seed (None)."""
        if previews > 0:
            async for kind, data in watch(self.generate_events(base, previews, related, seed_given), http):
                if kind == "generated":
                    return data
            raise RuntimeError("a generation's events ended without its result")  # generate_events raises first
        vector, plan = await self._related_of(base, related, seed_given)
        bid, request, job = self._generation(base, plan)
        ok = False
        try:  # a refused submit (a full queue) lets the related base's pin go too
            self.submit(request, [job])
            (result,) = await self.wait(http, request, [job])
            ok = True
        finally:
            self.related_done(plan, ok)
        return await self._generated(job.base, bid, result, plan, vector)

    async def _related_of(self, base: Base, related: Optional[bool], seed_given: bool
                          ) -> tuple[Optional[np.ndarray], Optional[RelatedPlan]]:  # fmt: skip
        """The prompt's embedding where related generations are in play (to look up, and to
        index the result), and the related base the request is served from (None: a miss, or
        not asked)."""
        wanted = self.related_wanted(related, seed_given)
        if not (wanted or self.indexing()):
            return None, None
        vector = await self.prompt_vector(base)
        return vector, (await self.related_plan(base, vector) if wanted else None)

    def _generation(self, base: Base, plan: Optional[RelatedPlan] = None) -> tuple[str, Request, Job]:
        """``base``'s id, and its generation as a request of one row from its initial noise (or,
        related, from ``plan``'s base at its entry step, with ``base``'s prompt)."""
        request = self._new_request()
        if plan is not None:
            base = self.related_base(base, plan)
            job = Job(request, 0, base, TailRow(base.prompt, 1.0, plan.step, base.guidance), state=plan.state, kind="related")
        else:
            job = Job(request, 0, base, TailRow(base.prompt, 1.0, 0, base.guidance), noise=self.pipe.initial_noise(base))
        return base_id(self.pipe.manifest.fingerprint, base), request, job

    async def _generated(self, base: Base, bid: str, result, plan: Optional[RelatedPlan] = None,
                         vector: Optional[np.ndarray] = None) -> Generated:  # fmt: skip
        """A finished generation kept in the store (and in the related index), as its reply."""
        await self.keep(result.state)
        self.index_base(bid, result.state, vector)
        self.metrics.inc("edit_rt_bases_generated_total")
        fields = self.shown_fields(base_fields(base, self.model_name, self.pipe.manifest.fingerprint, bid))
        with self.metrics.stage("png_encode"):
            png = png_bytes(result.image, parameters_text(base.prompt, base.negative_prompt, fields))
        related = None if plan is None else plan.info(self.shares_bases())
        return Generated(bid, base, png, result.seconds, self.store.tier(bid), related)

    async def generate_events(self, base: Base, previews: int = 0, related: Optional[bool] = None,
                              seed_given: bool = False) -> AsyncIterator[Event]:  # fmt: skip
        """``generate`` as events: ``previews`` x "edit_rt.preview" (index, step, of, png: the
        decoded x_0 the step predicts) spread over the steps, then ("generated", Generated).
        Wrap it in :func:`watch` for a client that may leave."""
        vector, plan = await self._related_of(base, related, seed_given)
        bid, request, job = self._generation(base, plan)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self._send_previews(request, [job], events, previews)
        job.future.add_done_callback(lambda f: loop.call_soon_threadsafe(events.put_nowait, ("done", job)))
        try:
            self.submit(request, [job])
            while (item := await events.get())[0] == "preview":
                yield "edit_rt.preview", await self._preview_event(item[1])
            try:
                result = job.future.result()
            except EditRtError as err:
                raise row_error(err) from None
            self.related_done(plan, True)
            done, plan = plan, None
            yield "generated", await self._generated(job.base, bid, result, done, vector)
        finally:
            self.related_done(plan, False)  # a failed or abandoned row's pin (None once let go above)
            if not job.future.done():
                request.cancelled.set()  # a client that left: its row goes at the next step

    def _send_previews(self, request: Request, jobs: list[Job], events: asyncio.Queue, previews: int) -> None:
        """Ask each of ``jobs`` (``request``'s rows) for ``previews`` previews spread over its own
        tail, each put on ``events`` as ("preview", (index, step, of, image)) from the engine thread."""
        if previews <= 0:
            return
        loop = asyncio.get_running_loop()
        for job in jobs:
            tail = job.base.steps - job.row.start_step
            job.preview_every = max(1, -(-tail // (previews + 1)))
        request.on_preview = lambda *preview: loop.call_soon_threadsafe(events.put_nowait, ("preview", preview))

    async def _preview_event(self, preview: tuple) -> dict:
        """A preview as an event's data, its PNG encoded in the image pool (and kept as the
        latest preview, AUTOMATIC1111's ``current_image``). A preview costs one VAE decode of
        its row on the engine thread and one PNG encode here."""
        index, step, of, image = preview
        png = await asyncio.get_running_loop().run_in_executor(self.image_pool, png_bytes, image, f"preview: step {step} of {of}")
        if DOOR.get() == A1111:  # A1111's current_image: its own door's previews only
            self.last_preview = png
        return {"index": index, "step": step, "of": of, "png": png}


async def watch(events: AsyncIterator[Event], http: Optional[HttpRequest]) -> AsyncIterator[Event]:
    """``events`` while the client is there: a client that disconnects closes them (its rows
    leave the batch at the next step) and gets 499."""
    task = None
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
        if task is not None and not task.done():
            # this watch was cancelled (its caller's task) while the events ran their step: stop
            # that first, or closing them would find them still running
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await events.aclose()
