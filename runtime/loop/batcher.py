"""The request loop around the row scheduler: a queue, fair admission, deadlines, futures.

:class:`Batcher` turns submitted jobs (an edit of a base, or a base's generation) into rows of
its :class:`~edit_rt.runtime.loop.row_scheduler.RowScheduler`, through a resolver (resolve.py: what a job's
row is; this file knows only queues and rows), and steps it. The same loop body,
:meth:`Batcher.work_once`, runs in two ways: on the pipeline's engine thread, the one thread
that touches the backend (``edit-rt serve``; see engine_thread.py), or driven by the caller
until its own request is done (``edit-rt run``, the bench, the pipeline's
``generate_base``/``run_tail``, and a task already on the engine thread). Either way rows of
different requests, bases, step counts and start steps share each ``unet_step`` call.

The queue is bounded (``queue_limit`` rows) and fair: admission takes one row from the request
at its head, then moves that request to the back, so one request's 64 edits do not hold back a
later request's single edit. A request can be cancelled (client gone) or time out: its rows are
dropped at the next step boundary. A row whose admission fails (a prompt the tokenizer cannot
take, say) fails alone: its request gets the error, every other row goes on.

A step that raises fails only the rows that caused it (:meth:`Batcher._isolate`). A failed
step has moved no row, so rows can be taken out and run again. The rows that joined at that
step are taken out (the others run the step again without them) and rejoin one *unit* per
step (a row, or a structure group with its reference row); a step that fails with nobody new
takes every row out. A unit whose rejoining step fails beside other rows waits to run alone
(no new rows join meanwhile, so the call drains); a unit that fails alone in a call is the
cause, and only its rows fail. A broken engine so ends every request with an error, one unit
at a time, and never in a loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Optional, Protocol, Sequence

from ..engine.engine_thread import EngineThread
from ..errors import CancelledError, QueueFullError, ShuttingDownError, SlotsBusyError, StepError
from ..metrics import Metrics
from .jobs import Job, Request, RowResult
from .rows import Row
from .row_scheduler import RowScheduler

log = logging.getLogger(__name__)

EXPIRED = "cancelled or past its deadline"  # every expired request's rows fail with this


def _expired(row: Row) -> bool:
    """``row``'s request was cancelled or ran past its deadline (a reference row serves others:
    it goes when they do, never on its own)."""
    return not row.reference and row.owner.request.expired()


class Resolver(Protocol):
    """What turns jobs into rows and finished rows into results (resolve.py's RowResolver)."""

    def rows(self, jobs: list[Job]) -> tuple[list[tuple[Job, Row]], list[tuple[Job, Exception]]]: ...
    def reference(self, rows: Sequence[Row]) -> Row: ...
    def results(self, jobs: list[Job]) -> list[RowResult]: ...
    def previews(self, rows: list[Row]) -> list: ...


class Batcher:
    def __init__(self, resolver: Resolver, scheduler: RowScheduler, queue_limit: Optional[int] = None,
                 metrics: Optional[Metrics] = None, engine: Optional[EngineThread] = None):  # fmt: skip
        self.resolver = resolver
        self.scheduler = scheduler
        self.queue_limit = queue_limit
        self.metrics = metrics or Metrics()
        self.queue: deque[Request] = deque()
        self.queued_rows = 0
        self._own_engine = engine is None  # a batcher on its own (tests): its stop() ends the thread
        self.engine = engine or EngineThread()
        self._cv = self.engine.cv  # one condition: a submit wakes the engine thread
        self._work = threading.Lock()  # one work_once at a time: the engines are not reentrant
        self._closing = False
        self._stopped = False
        # Units (rows that must run together) out of a failed step, rejoining one per step;
        # (unit, alone): alone once it failed beside others, so it rejoins an empty call.
        self.probation: deque[tuple[list[Row], bool]] = deque()
        self._trial: Optional[list[Row]] = None  # the unit rejoining at this step
        self._calls = 0  # scheduler calls observed (a loop turn without a step observes none)

    # --- submitting -----------------------------------------------------------------------------

    def start(self) -> "Batcher":
        """Run the loop on the engine thread (the server); without it, :meth:`run` drives it."""
        self.engine.attach(self)
        self.engine.start()
        return self

    def _busy(self) -> bool:
        return bool(self.queue or self.probation or self.scheduler.active or self.scheduler.pending)

    def has_work(self) -> bool:
        return not self._stopped and self._busy()

    def submit(self, request: Request, jobs: list[Job]) -> None:
        with self._cv:
            if self._closing:
                raise ShuttingDownError("the server is shutting down and takes no new work")
            if self.queue_limit is not None and self.queued_rows + len(jobs) > self.queue_limit:
                raise QueueFullError(f"the queue is full ({self.queued_rows}/{self.queue_limit} rows)")
            for job in jobs:  # job.started: its submission until admitted (the queue wait), then its admission
                job.started = time.perf_counter()
            request.pending.extend(jobs)
            self.queue.append(request)
            self.queued_rows += len(jobs)
            self.metrics.gauge("edit_rt_queue_rows", self.queued_rows)
            self._cv.notify_all()

    def run(self, request: Request, jobs: list[Job], errors: bool = False) -> list[RowResult]:
        """Submit and wait: on the engine thread if one runs, else by driving the loop here (a
        task on the engine thread drives it too: it must not wait on itself). ``errors``: a
        failed row's exception in its place instead of raising the first."""
        self.submit(request, jobs)
        if self.engine.owns():
            while not all(job.future.done() for job in jobs):
                self.work_once()
                if not self._busy():
                    for job in jobs:  # nothing left that could finish them: never wait forever
                        if not job.future.done():
                            job.future.set_exception(RuntimeError(f"row {job.index} of {request.id} was lost"))
        if errors:
            return [job.future.exception() or job.future.result() for job in jobs]
        return [job.future.result() for job in jobs]

    def queue_position(self, request: Request) -> int:
        with self._cv:
            return next((k for k, r in enumerate(self.queue) if r is request), -1)

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful: take no new work, finish what is queued and running, then stop.

        Rows still unfinished after ``timeout`` fail with a ShuttingDownError. A second stop
        (the drain's, then the app's) returns at once: the first left nothing to wait for.
        """
        with self._cv:
            if self._stopped:
                return
            self._closing = True
            self._cv.notify_all()
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._busy() and time.monotonic() < deadline:
                self._cv.wait(0.05)
            self._stopped = True
            self._cv.notify_all()
        try:
            self.engine.call(self._fail_leftovers, True).result(timeout=10)
        except Exception:  # an engine thread that cannot answer: fail the futures from here
            log.exception("the engine thread did not take the batcher's leftovers")
            self._fail_leftovers(remove=False)
        if self._own_engine:
            self.engine.stop()

    def _fail_leftovers(self, remove: bool) -> None:
        """Fail every row still queued or scheduled; ``remove`` also frees their slots (on the
        engine thread, under the loop's lock: a leave copies in backend memory). Without it,
        from a thread whose engine cannot answer, the futures alone (no lock: it may be held)."""
        rows = self.scheduler.active + self.scheduler.pending
        waiting = [row for unit, _ in self.probation for row in unit]
        self.probation.clear()
        with self._cv:
            queued = [j for r in self.queue for j in r.pending]
            self.queue.clear()
            self.queued_rows = 0
        leftover = [row.owner for row in rows + waiting if not row.reference] + queued
        if remove:
            with self._work:
                for row in rows:
                    self.scheduler.remove(row)
        for job in leftover:
            if not job.future.done():
                job.future.set_exception(ShuttingDownError("the server shut down before this row finished"))

    # --- the loop -------------------------------------------------------------------------------

    def close(self) -> None:
        """Take no new work (submit raises ShuttingDownError); what is queued still runs."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (a health check's question)."""
        return self.engine.running

    @property
    def idle(self) -> bool:
        with self._cv:
            return not self._busy()

    def work_once(self) -> None:
        """Admit what fits, drop what expired, run one step, hand out what finished."""
        with self._work:
            finished: list[Job] = []
            try:
                self._trial = self._rejoin() if self.probation else None
                if self._trial is None and not self.probation:
                    with self._cv:
                        jobs = self._take_locked(self.scheduler.free_slots)
                    self._admit(jobs)
                self._drop_expired()
                finished = [row.owner for row in self.scheduler.step()]
            except Exception as err:  # this step's rows: the ones that caused it fail, the rest go on
                log.exception("a step failed; isolating the rows that caused it")
                self._isolate(err)
            else:
                self._observe()
                self._previews()
                self._finish(finished)
            with self._cv:
                self._cv.notify_all()

    # --- a failed step ----------------------------------------------------------------------------

    def _rejoin(self) -> Optional[list[Row]]:
        """Admit the next unit out of a failed step, alone among this step's joiners (None
        while it has no room: the running rows go on meanwhile)."""
        unit, alone = self.probation[0]
        for row in unit:
            if _expired(row):
                row.owner.future.set_exception(CancelledError(EXPIRED))
        if all(row.reference or row.owner.future.done() for row in unit):
            self.probation.popleft()  # nobody left to run it for
            return None
        if alone and (self.scheduler.active or self.scheduler.pending):
            return None  # the call drains first (nothing new joins while units wait)
        if self.scheduler.free_slots < len(unit) or not self.scheduler.can_admit(unit[0]):
            return None
        self.probation.popleft()
        for row in unit:
            self.scheduler.admit(row)
        return unit

    def _isolate(self, err: Exception) -> None:
        """A failed step: fail the rows that caused it, take the suspects out to rejoin one unit
        at a time, leave the rest to run the step again."""
        s = self.scheduler
        in_call = s.active + s.pending
        if s.ran:  # the graph ran, reading back or blending failed: the backend, not a row
            self._fail(in_call, StepError(f"the engine failed after a step ({type(err).__name__}: {err})"))
            s.resync()
            return
        ids = lambda rows: {id(row) for row in rows}  # noqa: E731
        trial = self._trial
        if trial is not None and ids(in_call) == ids(trial):  # alone in its call: the cause
            self._fail(trial, StepError(f"this row failed the step ({type(err).__name__}: {err})"))
            s.resync()
            return
        joined = [row for row in s.joined if id(row) in ids(in_call)]
        suspects = joined or in_call  # nobody new: nothing tells the rows apart, all rejoin
        try:
            s.suspend(suspects)
        except Exception:  # the backend cannot give the latents back: these rows are lost
            log.exception("the rows of a failed step could not be taken out")
            self._fail(s.active + s.pending, StepError(f"the engine failed ({type(err).__name__}: {err})"))
            return
        if trial is not None and ids(suspects) == ids(trial):
            self.probation.appendleft((trial, True))  # failed beside others: next, alone
        else:
            self.probation.extend((unit, False) for unit in self._units(suspects))
        s.resync()

    def _units(self, rows: list[Row]) -> list[list[Row]]:
        """``rows`` as units that rejoin together: one request's rows of one structure group,
        with a reference of their own (a reference is the base's own tail, reset to the base's
        latent every step, so a new one at their step is the same), or a row alone."""
        units: dict[tuple, list[Row]] = {}
        for row in rows:
            if row.reference:
                continue  # each unit that still needs one gets its own
            keeps = row.ref is not None and row.step < row.structure_end
            units.setdefault((id(row.ref), id(row.owner.request)) if keeps else (id(row),), []).append(row)
        out = []
        for members in units.values():
            if members[0].ref is not None and members[0].step < members[0].structure_end:
                ref = self.resolver.reference(members)
                for row in members:
                    row.ref = ref
                members = [ref, *members]  # a reference joins before its rows
            else:
                for row in members:
                    row.ref = None
            out.append(members)
        return out

    def _fail(self, rows: list[Row], err: Exception) -> None:
        for row in rows:
            if row.slot >= 0 or row in self.scheduler.pending:
                self.scheduler.remove(row)
            if not row.reference and not row.owner.future.done():
                row.owner.future.set_exception(err)

    def _take_locked(self, free: int) -> list[Job]:
        # Every queued request's deadline, not only the one at the head: a request stuck behind
        # full slots still times out on time.
        for request in [r for r in self.queue if r.expired()]:
            self.queue.remove(request)
            self._cancel_queued(request)
        taken = []
        while free > 0 and self.queue:
            request = self.queue.popleft()
            if request.expired():
                self._cancel_queued(request)
                continue
            taken.append(request.pending.popleft())
            self.queued_rows -= 1
            free -= 1
            if request.pending:
                self.queue.append(request)  # round robin between requests
        self.metrics.gauge("edit_rt_queue_rows", self.queued_rows)
        return taken

    def _cancel_queued(self, request: Request) -> None:
        """Fail the queued rows of an expired ``request`` (taken out of the queue by the caller)."""
        for job in request.pending:
            job.future.set_exception(CancelledError(EXPIRED))
        self.queued_rows -= len(request.pending)
        request.pending.clear()

    def _requeue(self, jobs: list[Job]) -> None:
        """Put jobs that found no room back at the head of the queue, in order."""
        with self._cv:
            for job in reversed(jobs):
                job.request.pending.appendleft(job)
                if job.request not in self.queue:
                    self.queue.appendleft(job.request)
                self.queued_rows += 1

    def _admit(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        try:
            built, failed = self.resolver.rows(jobs)
        except Exception as err:  # the resolver itself: its rows fail (one at a time they may not)
            log.exception("building rows failed")
            built, failed = [], [(job, err) for job in jobs]
        waiting = []
        for job, err in failed:  # this row's input: it fails alone
            if isinstance(err, SlotsBusyError) and (self.scheduler.active or self.scheduler.pending or built):
                waiting.append(job)  # its adapters' slots are held by running rows: it waits for them
            else:
                job.future.set_exception(err)
        # Rows keeping structure come in groups (same base, entry step and structure window)
        # with one reference row: all of a group's rows and its reference join together or wait.
        groups: dict[tuple, list[tuple[Job, Row]]] = {}
        for job, row in built:
            key = (id(row.base), row.step, row.structure_end) if row.structure_end > row.step else (id(row),)
            groups.setdefault(key, []).append((job, row))
        for members in groups.values():
            structure = members[0][1].structure_end > members[0][1].step
            while members:
                room = self.scheduler.free_slots - structure  # a reference takes a slot too
                if room < 1 or not self.scheduler.can_admit(members[0][1]):
                    waiting += [job for job, _ in members]
                    break
                chunk, members = members[:room], members[room:]
                if structure:
                    ref = self.resolver.reference([row for _, row in chunk])
                    self.scheduler.admit(ref)
                for job, row in chunk:
                    row.preview_every = job.preview_every
                    row.ref = ref if structure else None
                    self.scheduler.admit(row)
                    job.scheduled = row
                    self.metrics.observe("edit_rt_queue_wait_seconds", time.perf_counter() - job.started)
                    job.started = time.perf_counter()
        if waiting:
            self._requeue(waiting)

    def _drop_expired(self) -> None:
        for row in list(self.scheduler.active + self.scheduler.pending):
            if _expired(row):
                self.scheduler.remove(row)
                row.owner.future.set_exception(CancelledError(EXPIRED))

    def _observe(self) -> None:
        stats = self.scheduler.stats
        if stats.calls != self._calls:
            self._calls = stats.calls
            self.metrics.observe_stage("step", stats.last_seconds)
            self.metrics.observe("edit_rt_step_seconds", stats.last_seconds)
            self.metrics.observe("edit_rt_batch_rows", stats.last_rows)
        self.metrics.gauge("edit_rt_active_rows", len(self.scheduler.active))
        for row in self.scheduler.active:
            job = row.owner
            if not row.reference and job.request.on_progress is not None:
                job.request.on_progress(job.index, row.step - job.row.start_step, job.base.steps - job.row.start_step)

    def _previews(self) -> None:
        """Decoded previews of the rows that asked for one at this step (a failed decode costs
        the preview, never the row)."""
        rows = [row for row in self.scheduler.active if row.previewed == row.step - 1 and not row.reference]
        if not rows:
            return
        try:
            images = self.resolver.previews(rows)
        except Exception:
            log.exception("decoding %d previews failed", len(rows))
            return
        for row, image in zip(rows, images):
            job = row.owner
            if job.request.on_preview is not None:
                of = job.base.steps - job.row.start_step
                job.request.on_preview(job.index, row.step - job.row.start_step, of, image)

    def _finish(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        for job in jobs:  # the rows that finished this step made progress too
            if job.request.on_progress is not None:
                of = job.base.steps - job.row.start_step
                job.request.on_progress(job.index, of, of)
        try:
            results = list(zip(jobs, self.resolver.results(jobs)))
        except Exception:  # one row's result (its decode, say): each alone, so only it fails
            log.exception("finishing %d rows together failed; finishing each alone", len(jobs))
            results = []
            for job in jobs:
                try:
                    results += zip([job], self.resolver.results([job]))
                except Exception as err:
                    job.future.set_exception(StepError(f"this row's result could not be made ({type(err).__name__}: {err})"))
        for job, result in results:
            self.metrics.observe("edit_rt_row_seconds", result.seconds)
            if job.scheduled.record is None:
                self.metrics.inc("edit_rt_edits_served_total")
                self.metrics.inc("edit_rt_unet_rows_saved_total", job.row.start_step)  # T - (T - s)
            job.future.set_result(result)
