"""Edits of a stored base, as the doors ask for them: each edit checked and resolved into a row of
the base's tail, the rows submitted as one request of the step loop, and their results as events
(queue position, progress, previews, each image with its PNG parameters, errors per row) or as one
collected answer.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Sequence

import numpy as np
from starlette.requests import Request as HttpRequest

from ..errors import EditError
from ..loop.jobs import Job, Request
from ..model.edit import Edit, TailRow, resolve_edit
from ..model.state import BaseState
from ..pipeline.images import checked_pixel_mask, png_bytes
from ..pipeline.pnginfo import edit_fields, parameters_text
from ..storage.store import base_id
from .generation import watch
from .http_errors import ApiError, is_base_id, row_error
from .results import Edited, Event
from .sampler_fields import sampler_label


class Edits:
    """Mixed into :class:`~edit_rt.runtime.serving.service.Service` (its config, store, metrics, checks and
    submit / pin): an edit request from its specs to its images."""

    def row_of(self, i: int, state: BaseState, edit: Edit, pixel_mask: Optional[np.ndarray] = None,
               backdrop: Optional[np.ndarray] = None, mask_param: Optional[str] = None) -> TailRow:  # fmt: skip
        """Edit ``i`` of a request as a row of ``state``'s tail (edit.resolve_edit: the config's
        defaults filled in, its tail and mask checked against the base), with its pixel mask
        ([H, W] in [0, 1], 1 = may change) and the backdrop it is composited onto outside it
        ([H, W, 3] in [0, 1]; None: the base's image) checked against the base's size (400
        naming ``mask_param``, by default ``edits[i].pixel_mask``)."""
        if edit.prompt is not None:
            self.check_prompt(edit.prompt, f"edits[{i}].prompt")
        self.check_adapters(edit.adapters, f"edits[{i}].adapters")
        for j, direction in enumerate(edit.directions or ()):
            self.check_prompt(direction.prompt, f"edits[{i}].directions[{j}].prompt")
        try:
            row = resolve_edit(edit, state.base, state.window_start, self.cfg.edit_defaults(), f"edits[{i}]")
        except EditError as err:
            raise ApiError(400, str(err), param=err.field, code="out_of_range") from None
        hw = (state.base.height, state.base.width)
        param = mask_param or f"edits[{i}].pixel_mask"
        if pixel_mask is not None:
            try:
                row.pixel_mask = checked_pixel_mask(pixel_mask, hw)
            except ValueError as err:
                raise ApiError(400, f"{param}: {err}", param=param, code="invalid_mask") from None
        if backdrop is not None:
            if np.shape(backdrop) != (*hw, 3):
                raise ApiError(400, f"{param}: its image is {list(np.shape(backdrop))}, the base {hw[1]}x{hw[0]} RGB; "
                               "send the image at the base's size", param=param, code="invalid_mask")  # fmt: skip
            row.backdrop = np.ascontiguousarray(backdrop, dtype=np.float32)
        return row

    def edit_png(self, state: BaseState, row: TailRow, image, preserve: str, extra: Optional[dict] = None,
                 uncond: str = "compute") -> bytes:  # fmt: skip
        """An edit's PNG with its parameters; ``extra``: a door's own fields, added after them
        (AUTOMATIC1111's ``Mask blur``, say)."""
        bid = base_id(state.fingerprint, state.base)
        fields = self.shown_fields(edit_fields(state.base, row, self.model_name, state.fingerprint, bid, preserve, uncond))
        if row.pixel_mask is not None:
            fields["Pixel mask"] = f"{int(np.count_nonzero(row.pixel_mask))} of {row.pixel_mask.size} px may change"
        fields.update(extra or {})
        with self.metrics.stage("png_encode"):
            return png_bytes(image, parameters_text(row.prompt, state.base.negative_prompt, fields))

    def check_edit_count(self, n: int) -> None:
        limit = self.cfg.serve.max_edits_per_request
        if n > limit:
            raise ApiError(413, f"edits: {n} edits, at most {limit} per request", param="edits", code="too_many_edits")

    def edit_jobs(self, state: BaseState, rows: list[TailRow]) -> tuple[Request, list[Job]]:
        self.check_edit_count(len(rows))
        request = self._new_request()
        return request, [Job(request, i, state.base, row, state=state) for i, row in enumerate(rows)]

    async def edit_events(self, bid: str, specs: list[Edit], param: str = "base_id", previews: int = 0, *,
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
        tier = self.store.tier(bid) if is_base_id(bid) else None
        state = await self.pinned(bid, param)
        self.metrics.edit_requests.labels(tier or "disk").inc()
        request = None
        try:
            per = lambda given, i: None if given is None else given[i]  # noqa: E731
            rows = [self.row_of(i, state, spec, per(pixel_masks, i), per(backdrops, i), mask_param)
                    for i, spec in enumerate(specs)]  # fmt: skip
            request, jobs = self.edit_jobs(state, rows)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()  # from the batcher's thread to this loop
            request.on_progress = lambda i, step, of: loop.call_soon_threadsafe(
                events.put_nowait, ("edit_rt.progress", {"index": i, "step": step, "of": of}))  # fmt: skip
            self._send_previews(request, jobs, events, previews)
            for job in jobs:
                job.future.add_done_callback(lambda f, job=job: loop.call_soon_threadsafe(events.put_nowait, ("done", job)))
            self.submit(request, jobs)
            batcher = self.batcher_of(state.base)
            yield "edit_rt.queue", {"position": batcher.queue_position(request), "queue_size": batcher.queued_rows}
            remaining = len(jobs)
            while remaining:
                kind, payload = await events.get()
                if kind == "preview":
                    yield "edit_rt.preview", await self._preview_event(payload)
                    continue
                if kind != "done":
                    yield kind, payload
                    continue
                remaining -= 1
                job = payload
                if job.future.exception() is not None:
                    yield "error", {"index": job.index, "error": row_error(job.future.exception())}
                    continue
                r, row = job.future.result(), job.row
                png = self.edit_png(state, row, r.image, r.preserve, per(png_fields, job.index), r.uncond)
                edited = Edited(job.index, png, r.seconds, r.preserve, state.base.steps - row.start_step, row.strength,
                                tuple({"prompt": d.prompt, "strength": d.strength} for d in row.directions),
                                sampler_label(state.base.sampler or self.default_sampler), r.uncond)  # fmt: skip
                yield "image_edit.completed", {"index": job.index, "png": edited.png, "info": edited.info()}
            yield "edit_rt.done", {"base_id": bid}
        finally:
            if request is not None:
                request.cancelled.set()  # a client that left: its rows go at the next step
            self.store.unpin(bid)

    async def edit_base(self, bid: str, specs: list[Edit], http: Optional[HttpRequest] = None,
                        param: str = "base_id", previews: int = 0, **masks) -> list[Edited]:  # fmt: skip
        """``edit_events`` collected: the edits in order, or the first row's error. ``masks``:
        edit_events' pixel_masks, backdrops, png_fields, mask_param; ``previews`` are made (the
        latest kept as ``last_preview``) but not returned."""
        out = []
        async for kind, data in watch(self.edit_events(bid, specs, param, previews, **masks), http):
            if kind == "error":
                raise data["error"]
            if kind == "image_edit.completed":
                info = data["info"]
                out.append(Edited.from_info(data["index"], data["png"], info))
        return sorted(out, key=lambda e: e.index)
