"""Edits of a stored base, as the doors ask for them: each edit checked and resolved into a row of
the base's tail, the rows submitted as one request of the step loop, and their results as events
(queue position, progress, previews, each image with its PNG parameters, errors per row) or as one
collected answer.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Sequence

import numpy as np

from ..config.run_config import RunConfig
from ..errors import EditError, RequestError
from ..loop.jobs import Job, Request
from ..metrics import Metrics
from ..model.edit import Edit, TailRow, resolve_edit
from ..model.state import BaseState
from ..pipeline.images import checked_pixel_mask, png_bytes
from ..pipeline.pnginfo import edit_fields, parameters_text
from ..storage.store import base_id
from .bases import Bases
from .fields import RequestFields, sampler_label
from .generation import watch
from .previews import Previews
from .related import RelatedGenerations
from .results import Edited, Event
from .step_loops import Client, StepLoops


class Edits:
    """Edit requests from their specs to their images: checked by ``fields``, run as rows of
    the step ``loops`` on bases pinned in ``bases``, previewed by ``previews``, their PNG
    parameters shown as ``related`` says, counted in ``metrics``."""

    def __init__(self, cfg: RunConfig, fields: RequestFields, loops: StepLoops, bases: Bases, previews: Previews,
                 related: RelatedGenerations, metrics: Metrics, model_name: str):  # fmt: skip
        self.cfg = cfg
        self.fields = fields
        self.loops = loops
        self.bases = bases
        self.previews = previews
        self.related = related
        self.metrics = metrics
        self.model_name = model_name

    def row_of(self, i: int, state: BaseState, edit: Edit, pixel_mask: Optional[np.ndarray] = None,
               backdrop: Optional[np.ndarray] = None, mask_param: Optional[str] = None) -> TailRow:  # fmt: skip
        """Edit ``i`` of a request as a row of ``state``'s tail (edit.resolve_edit: the config's
        defaults filled in, its tail and mask checked against the base), with its pixel mask
        ([H, W] in [0, 1], 1 = may change) and the backdrop it is composited onto outside it
        ([H, W, 3] in [0, 1]; None: the base's image) checked against the base's size (a
        refusal naming ``mask_param``, by default ``edits[i].pixel_mask``)."""
        if edit.prompt is not None:
            self.fields.check_prompt(edit.prompt, f"edits[{i}].prompt")
        self.fields.check_adapters(edit.adapters, f"edits[{i}].adapters")
        for j, direction in enumerate(edit.directions or ()):
            self.fields.check_prompt(direction.prompt, f"edits[{i}].directions[{j}].prompt")
        try:
            row = resolve_edit(edit, state.base, state.window_start, self.cfg.edit_defaults(), f"edits[{i}]")
        except EditError as err:
            raise RequestError(str(err), err.field, "out_of_range") from None
        hw = (state.base.height, state.base.width)
        param = mask_param or f"edits[{i}].pixel_mask"
        if pixel_mask is not None:
            try:
                row.pixel_mask = checked_pixel_mask(pixel_mask, hw)
            except ValueError as err:
                raise RequestError(f"{param}: {err}", param, "invalid_mask") from None
        if backdrop is not None:
            if np.shape(backdrop) != (*hw, 3):
                raise RequestError(f"{param}: its image is {list(np.shape(backdrop))}, the base {hw[1]}x{hw[0]} RGB; "
                                   "send the image at the base's size", param, "invalid_mask")  # fmt: skip
            row.backdrop = np.ascontiguousarray(backdrop, dtype=np.float32)
        return row

    def edit_png(self, state: BaseState, row: TailRow, image, preserve: str, extra: Optional[dict] = None,
                 uncond: str = "compute") -> bytes:  # fmt: skip
        """An edit's PNG with its parameters; ``extra``: a door's own fields, added after them
        (AUTOMATIC1111's ``Mask blur``, say)."""
        bid = base_id(state.fingerprint, state.base)
        fields = self.related.shown_fields(edit_fields(state.base, row, self.model_name, state.fingerprint, bid, preserve, uncond))
        if row.pixel_mask is not None:
            fields["Pixel mask"] = f"{int(np.count_nonzero(row.pixel_mask))} of {row.pixel_mask.size} px may change"
        fields.update(extra or {})
        with self.metrics.stage("png_encode"):
            return png_bytes(image, parameters_text(row.prompt, state.base.negative_prompt, fields))

    def jobs(self, state: BaseState, rows: list[TailRow]) -> tuple[Request, list[Job]]:
        self.fields.check_edit_count(len(rows))
        request = self.loops.new_request()
        return request, [Job(request, i, state.base, row, state=state) for i, row in enumerate(rows)]

    async def events(self, bid: str, specs: list[Edit], param: str = "base_id", previews: int = 0, *,
                          pixel_masks: Optional[Sequence[Optional[np.ndarray]]] = None,
                          backdrops: Optional[Sequence[Optional[np.ndarray]]] = None,
                          png_fields: Optional[Sequence[Optional[dict]]] = None,
                          mask_param: Optional[str] = None) -> AsyncIterator[Event]:  # fmt: skip
        """Edits of the stored base ``bid`` as one batched tail (with whatever else runs), as
        events. Everything a request can be refused for (an unknown base, a bad edit, a full
        queue) is raised before the first event; the base stays pinned until the last.
        ``previews``: that many "edit_rt.preview" events per row, spread over its tail.
        ``pixel_masks``, ``backdrops``, ``png_fields``: per edit (None entries for none), its
        pixel mask, what it is composited onto outside it, and extra PNG parameters (see
        ``row_of``, ``edit_png``); ``mask_param`` names the mask in a refusal."""
        tier = self.bases.tier(bid)
        state = await self.bases.pinned(bid, param)
        self.metrics.edit_requests.labels(tier or "disk").inc()
        request = None
        try:
            per = lambda given, i: None if given is None else given[i]  # noqa: E731
            rows = [self.row_of(i, state, spec, per(pixel_masks, i), per(backdrops, i), mask_param)
                    for i, spec in enumerate(specs)]  # fmt: skip
            request, jobs = self.jobs(state, rows)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()  # from the batcher's thread to this loop
            request.on_progress = lambda i, step, of: loop.call_soon_threadsafe(
                events.put_nowait, ("edit_rt.progress", {"index": i, "step": step, "of": of}))  # fmt: skip
            self.previews.ask(request, jobs, events, previews)
            for job in jobs:
                job.future.add_done_callback(lambda f, job=job: loop.call_soon_threadsafe(events.put_nowait, ("done", job)))
            self.loops.submit(request, jobs)
            batcher = self.loops.batcher_of(state.base)
            yield "edit_rt.queue", {"position": batcher.queue_position(request), "queue_size": batcher.queued_rows}
            remaining = len(jobs)
            while remaining:
                kind, payload = await events.get()
                if kind == "preview":
                    yield "edit_rt.preview", await self.previews.event(payload)
                    continue
                if kind != "done":
                    yield kind, payload
                    continue
                remaining -= 1
                job = payload
                if job.future.exception() is not None:
                    yield "error", {"index": job.index, "error": job.future.exception()}
                    continue
                r, row = job.future.result(), job.row
                png = self.edit_png(state, row, r.image, r.preserve, per(png_fields, job.index), r.uncond)
                edited = Edited(job.index, png, r.seconds, r.preserve, state.base.steps - row.start_step, row.strength,
                                tuple({"prompt": d.prompt, "strength": d.strength} for d in row.directions),
                                sampler_label(state.base.sampler or self.fields.default_sampler), r.uncond)  # fmt: skip
                yield "image_edit.completed", {"index": job.index, "png": edited.png, "info": edited.info()}
            yield "edit_rt.done", {"base_id": bid}
        finally:
            if request is not None:
                request.cancelled.set()  # a client that left: its rows go at the next step
            self.bases.unpin(bid)


async def collected(events: AsyncIterator[Event], client: Optional[Client]) -> list:
    """An edit's events collected: the edits in order (previews made, not returned), or the
    first row's error."""
    out = []
    async for kind, data in watch(events, client):
        if kind == "error":
            raise data["error"]
        if kind == "image_edit.completed":
            out.append(Edited.from_info(data["index"], data["png"], data["info"]))
    return sorted(out, key=lambda e: e.index)
