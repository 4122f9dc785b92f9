"""A base's generation, as one reply or as events with previews while it runs.

A preview is the decoded x_0 that a step predicts (the step graph's, whatever the sampler): one
VAE decode of its row on the engine thread and one PNG encode in the image pool; rows ask for one every
``Request.preview_every`` steps. The latest preview's PNG is kept (A1111's ``current_image``).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional

from starlette.requests import Request as HttpRequest

from ..images import png_bytes
from ..loop.jobs import CancelledError, Job, Request, RowError, ShuttingDownError, StepError
from ..model.edit import Base, TailRow
from ..pnginfo import base_fields, parameters_text
from ..storage.store import base_id
from .errors import ApiError, row_error
from .results import Generated

Event = tuple[str, dict]


class Generation:
    """Mixed into :class:`~edit_rt.runtime.serving.service.Service` (its pipe, store, metrics,
    image pool and submit / wait / keep)."""

    async def generate(self, base: Base, http: Optional[HttpRequest] = None, previews: int = 0) -> Generated:
        """Generate ``base``, keep it in the store, return its PNG (with its parameters).
        ``previews``: made while it runs (the latest kept as ``last_preview``), not returned."""
        if previews > 0:
            async for kind, data in watch(self.generate_events(base, previews), http):
                if kind == "generated":
                    return data
            raise RuntimeError("a generation's events ended without its result")  # generate_events raises first
        bid, request, job = self._generation(base)
        self.submit(request, [job])
        (result,) = await self.wait(http, request, [job])
        return await self._generated(base, bid, result)

    def _generation(self, base: Base) -> tuple[str, Request, Job]:
        """``base``'s id, and its generation as a request of one row from its initial noise."""
        request = self._new_request()
        job = Job(request, 0, base, TailRow(base.prompt, 1.0, 0, base.guidance), noise=self.pipe.initial_noise(base))
        return base_id(self.pipe.manifest.fingerprint, base), request, job

    async def _generated(self, base: Base, bid: str, result) -> Generated:
        """A finished generation kept in the store, as its reply."""
        await self.keep(result.state)
        self.metrics.inc("edit_rt_bases_generated_total")
        fields = base_fields(base, self.model_name, self.pipe.manifest.fingerprint, bid)
        with self.metrics.stage("png_encode"):
            png = png_bytes(result.image, parameters_text(base.prompt, base.negative_prompt, fields))
        return Generated(bid, base, png, result.seconds, self.store.tier(bid))

    async def generate_events(self, base: Base, previews: int = 0) -> AsyncIterator[Event]:
        """``generate`` as events: ``previews`` x "edit_rt.preview" (index, step, of, png: the
        decoded x_0 the step predicts) spread over the steps, then ("generated", Generated).
        Wrap it in :func:`watch` for a client that may leave."""
        bid, request, job = self._generation(base)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self._send_previews(request, events, previews, base.steps)
        job.future.add_done_callback(lambda f: loop.call_soon_threadsafe(events.put_nowait, ("done", job)))
        self.submit(request, [job])
        try:
            while (item := await events.get())[0] == "preview":
                yield "edit_rt.preview", await self._preview_event(item[1])
            try:
                result = job.future.result()
            except (CancelledError, ShuttingDownError, RowError, StepError) as err:
                raise row_error(err) from None
            yield "generated", await self._generated(base, bid, result)
        finally:
            if not job.future.done():
                request.cancelled.set()  # a client that left: its row goes at the next step

    def _send_previews(self, request: Request, events: asyncio.Queue, previews: int, steps: int) -> None:
        """Ask ``request``'s rows for ``previews`` previews spread over ``steps`` steps, each put
        on ``events`` as ("preview", (index, step, of, image)) from the engine thread."""
        if previews <= 0:
            return
        loop = asyncio.get_running_loop()
        request.preview_every = max(1, -(-steps // (previews + 1)))
        request.on_preview = lambda *preview: loop.call_soon_threadsafe(events.put_nowait, ("preview", preview))

    async def _preview_event(self, preview: tuple) -> dict:
        """A preview as an event's data, its PNG encoded in the image pool (and kept as the
        latest preview, AUTOMATIC1111's ``current_image``). A preview costs one VAE decode of
        its row on the engine thread and one PNG encode here."""
        index, step, of, image = preview
        png = await asyncio.get_running_loop().run_in_executor(self.image_pool, png_bytes, image, f"preview: step {step} of {of}")
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
