"""The served step loops, one per served size (loop/batcher.py), as requests reach them: a
request's rows submitted to the loop of their base's size, and awaited from the event loop (a
client that leaves cancels them: their rows go at the next step). Refusals are the domain's
errors: a full queue, shutting down, a base of a size not served.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Callable, Optional, Protocol

from ..config.run_config import RunConfig
from ..errors import ClientGoneError, RequestError
from ..loop.batcher import Batcher
from ..loop.jobs import Job, Request
from ..model.edit import Base
from .decoder_choice import DECODER
from .job_control import DOOR


class Client(Protocol):
    """Who waits for an answer: an HTTP request (Starlette's), or nothing (the Python API)."""

    async def is_disconnected(self) -> bool: ...


class StepLoops:
    """The batchers by (width, height), the first served size's first."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.by_size: dict[tuple[int, int], Batcher] = {}

    def add(self, size: tuple[int, int], batcher: Batcher) -> None:
        self.by_size[size] = batcher.start()

    @property
    def first(self) -> Optional[Batcher]:
        return next(iter(self.by_size.values()), None)

    def new_request(self) -> Request:
        return Request(uuid.uuid4().hex, deadline=time.monotonic() + self.cfg.serve.request_timeout_s, door=DOOR.get(),
                       decoder=DECODER.get() or self.cfg.decoder)  # fmt: skip

    def batcher_of(self, base: Base) -> Batcher:
        """The step loop of ``base``'s size (a stored base of a size no longer served: refused)."""
        batcher = self.by_size.get((base.width, base.height))
        if batcher is None:
            served = ", ".join(f"{w}x{h}" for w, h in self.by_size)
            raise RequestError(f"base_id: this base is {base.width}x{base.height}; this server serves {served} "
                               "(engines.sizes)", "base_id", "unsupported_size")  # fmt: skip
        return batcher

    def submit(self, request: Request, jobs: list[Job]) -> None:
        self.batcher_of(jobs[0].base).submit(request, jobs)

    async def wait(self, client: Optional[Client], request: Request, jobs: list[Job]) -> list[Any]:
        """Each job's result, in order; the first row's error as raised in the engine thread."""
        futures = [asyncio.wrap_future(j.future) for j in jobs]
        try:
            await until_done(futures, client, request.cancelled.set)
            return [f.result() for f in futures]
        finally:
            if any(not f.done() for f in futures):
                request.cancelled.set()

    def close(self) -> None:
        """Admit no more rows; rows in flight go on."""
        for batcher in self.by_size.values():
            batcher.close()

    def idle(self) -> bool:
        return all(batcher.idle for batcher in self.by_size.values())

    def stop(self, timeout: float) -> None:
        """Stop every loop (what still runs after ``timeout`` fails with a shutdown error)."""
        for batcher in self.by_size.values():
            batcher.stop(timeout=timeout)


async def until_done(waitables: list, client: Optional[Client], leave: Callable[[], Any]) -> None:
    """Wait for ``waitables``; if ``client`` disconnects first, ``leave()`` (cancel the work) and
    raise :class:`ClientGoneError`."""
    while (await asyncio.wait(waitables, timeout=0.25))[1]:
        if client is not None and await client.is_disconnected():
            leave()
            raise ClientGoneError("client disconnected")

