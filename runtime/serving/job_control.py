"""What the step loops are doing, and stopping it: AUTOMATIC1111's ``/progress`` and
``/interrupt`` over the service's batchers (one per served size). Read from the event loop
while the engine thread steps: snapshots, a step behind at most.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any, Optional

# The door a request came in by ("a1111" for the /sdapi/v1 routes, "" otherwise), set by the
# route and read where its Request is made: A1111's job control sees only its own door's jobs.
DOOR: ContextVar[str] = ContextVar("edit_rt_door", default="")
A1111 = "a1111"


def _ours(request, door: Optional[str]) -> bool:
    return door is None or getattr(request, "door", "") == door


class JobControl:
    """Reads and stops the step loops of ``batchers`` ((width, height) -> Batcher, the service's
    own dict: sizes added later are seen); counts its interrupts (a cancelled request tells an
    interrupt from a client that left by them)."""

    def __init__(self, batchers: dict):
        self.batchers = batchers
        self.interrupts = 0  # interrupt() calls so far
        self.interrupted_at = 0.0  # time.monotonic() of the last interrupt()

    async def progress(self, door: Optional[str] = None) -> dict[str, int]:
        """Rows in the step loops and rows queued (AUTOMATIC1111's /progress textinfo): of
        ``door``'s requests only (None: every door's, a structure reference row included)."""
        active = queued = 0
        for batcher in list(self.batchers.values()):
            if door is None:
                active, queued = active + len(batcher.scheduler.active), queued + batcher.queued_rows
                continue
            active += len(_rows_of(batcher, door))
            queued += sum(len(_snapshot(request.pending)) for request in _queued_of(batcher, door))
        return {"active": active, "queued": queued}

    def in_flight(self, door: Optional[str] = None) -> dict[str, Any]:
        """What the step loops hold now (AUTOMATIC1111's /progress): ``running`` requests (a row
        in a slot), ``queued`` ones (rows waiting only), the row-steps ``done`` of the ``total``
        their rows run, ``started`` (time.monotonic() of the oldest running row's admission, or
        None) and ``current`` (step, of) of that row; ``door``: only that door's requests (None:
        every door's). Read from the event loop while the engine
        thread steps: a snapshot, a step behind at most."""
        running, queued, done, total, oldest = {}, {}, 0, 0, None
        for batcher in list(self.batchers.values()):
            for row in _rows_of(batcher, door):
                job = row.owner
                entry = 0 if job.kind == "invert" else job.row.start_step
                running[id(job.request)] = job.request
                done, total = done + row.step - entry, total + row.end - entry
                if oldest is None or job.started < oldest[0]:
                    oldest = (job.started, row.step - entry, row.end - entry)
            for request in _queued_of(batcher, door):
                for job in _snapshot(request.pending):
                    total += 1 if job.kind == "correct" else job.base.steps - job.row.start_step
                if id(request) not in running:
                    queued[id(request)] = request
        started = None if oldest is None else time.monotonic() - (time.perf_counter() - oldest[0])
        return {"running": len(running), "queued": len(queued), "done": done, "total": total, "started": started,
                "current": None if oldest is None else oldest[1:]}  # fmt: skip

    async def job_status(self, door: Optional[str] = None) -> dict[str, Any]:
        """``in_flight()`` for a route (Ray Serve's ingress gathers its replicas')."""
        return self.in_flight(door)

    async def stop_jobs(self, door: Optional[str] = None) -> int:
        """``interrupt()`` for a route (Ray Serve's ingress sends it to every replica)."""
        return self.interrupt(door)

    def interrupt(self, door: Optional[str] = None) -> int:
        """Cancel every request of ``door`` (None: every door) that has a row in a step loop now
        (AUTOMATIC1111's interrupt: the current job stops, what waits wholly in the queue goes
        on): their rows leave at the next step, rows already finished stay finished. Another
        door's requests are never touched. Returns how many requests."""
        found = {}
        for batcher in list(self.batchers.values()):
            for row in _rows_of(batcher, door):
                found[id(row.owner.request)] = row.owner.request
        self.interrupts += 1
        self.interrupted_at = time.monotonic()
        for request in found.values():
            request.cancelled.set()
        return len(found)


def _rows_of(batcher, door: Optional[str]) -> list:
    """The rows of ``door``'s requests (None: every door's) in ``batcher``'s step loop, running
    or admitted, a structure reference row (no request's own) left out: a snapshot."""
    s = batcher.scheduler
    return [row for row in _snapshot(s.active) + _snapshot(s.pending)
            if not row.reference and row.owner is not None and _ours(row.owner.request, door)]  # fmt: skip


def _queued_of(batcher, door: Optional[str]) -> list:
    """``door``'s requests (None: every door's) in ``batcher``'s queue: a snapshot."""
    return [request for request in _snapshot(batcher.queue) if _ours(request, door)]


def _snapshot(items) -> list:
    """A list copy of a deque or list another thread changes (a copy that raced is retried)."""
    for _ in range(16):
        try:
            return list(items)
        except RuntimeError:  # "deque mutated during iteration"
            continue
    return []
