"""Previews while rows run: the decoded x_0 a step predicts (the step graph's, whatever the
sampler), one VAE decode of its row on the engine thread and one PNG encode in the image pool.
``k`` previews are spread over each row's own tail (``Job.preview_every`` = ceil(tail / (k + 1))
steps), so the rows of one request with tails of 12 and 6 steps each get theirs. The latest
preview of AUTOMATIC1111's door is kept (its ``current_image``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Optional

from ..loop.jobs import Job, Request
from ..pipeline.images import png_bytes
from .job_control import A1111, DOOR


class Previews:
    """Previews asked of rows, encoded in ``pool``; ``last``: the latest of A1111's door."""

    def __init__(self, pool: Executor):
        self.pool = pool
        self.last: Optional[bytes] = None

    def ask(self, request: Request, jobs: list[Job], events: asyncio.Queue, previews: int) -> None:
        """Ask each of ``jobs`` (``request``'s rows) for ``previews`` previews spread over its own
        tail, each put on ``events`` as ("preview", (index, step, of, image)) from the engine thread."""
        if previews <= 0:
            return
        loop = asyncio.get_running_loop()
        for job in jobs:
            tail = job.base.steps - job.row.start_step
            job.preview_every = max(1, -(-tail // (previews + 1)))
        request.on_preview = lambda *preview: loop.call_soon_threadsafe(events.put_nowait, ("preview", preview))

    async def event(self, preview: tuple) -> dict:
        """A preview as an event's data, its PNG encoded in the pool."""
        index, step, of, image = preview
        png = await asyncio.get_running_loop().run_in_executor(self.pool, png_bytes, image, f"preview: step {step} of {of}")
        if DOOR.get() == A1111:  # A1111's current_image: its own door's previews only
            self.last = png
        return {"index": index, "step": step, "of": of, "png": png}
