"""The request loop around the row scheduler: a queue, fair admission, deadlines, futures.

:class:`Batcher` turns submitted jobs (an edit of a base, or a base's generation) into rows of
its :class:`~edit_rt.runtime.slots.RowScheduler` and steps it. The same loop body,
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
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from .config import Base
from .engine_thread import EngineThread
from .errors import EditRtError
from .metrics import Metrics
from .scheduler_ddim import DDIMSchedule, InverseDDIMSchedule
from .rows import Recording, Row
from .slots import RowScheduler
from .state import KV, BaseState, TailRow

if TYPE_CHECKING:
    from .pipeline import EditPipeline

log = logging.getLogger(__name__)


class QueueFullError(EditRtError):
    """The queue holds ``queue_limit`` rows already; retry later."""


class ShuttingDownError(EditRtError):
    """The batcher is stopping and takes no new work."""


class CancelledError(EditRtError):
    """The request was cancelled (client disconnected) or passed its deadline."""


class RowError(EditRtError):
    """This row could not be run (its input, not the server); the message says why."""


@dataclass
class RowResult:
    latent: np.ndarray  # x_T, [c, h, w]
    image: Optional[np.ndarray]  # [H, W, 3] in [0, 1] when the request asked for images
    state: Optional[BaseState]  # a generation's recorded state
    seconds: float
    preserve: str = "none"  # what the row's preserve mode came to ("auto", or why none)
    keep: Optional[np.ndarray] = None  # [1, h, w] bool: where the row kept the base's latent
    record: Optional[Recording] = None  # what a recording row kept (inversion, its corrections)


@dataclass
class Job:
    """One row: an edit of ``state``, or (``state`` None) the generation of base ``base``."""

    request: "Request"
    index: int
    base: Base
    row: TailRow
    state: Optional[BaseState] = None
    noise: Optional[np.ndarray] = None  # generation: x_0, [1, c, h, w]
    future: Future = field(default_factory=Future)
    started: float = 0.0
    scheduled: Optional[Row] = None
    preserve: str = "none"
    # "": an edit (state) or a generation (noise); "invert": DDIM inversion of the image latent
    # ``noise`` over steps row.start_step..T-1; "correct": one forward step of ``state`` from
    # step row.start_step (pipeline.invert's two phases)
    kind: str = ""


@dataclass
class Request:
    """A group of rows submitted together; cancelling it drops all of them."""

    id: str
    deadline: float = float("inf")
    on_progress: Optional[Callable[[int, int, int], None]] = None  # (index, step, of)
    decode: bool = True  # images for the results (the server); latents only otherwise
    cancelled: threading.Event = field(default_factory=threading.Event)
    pending: deque = field(default_factory=deque)

    def expired(self) -> bool:
        return self.cancelled.is_set() or time.monotonic() > self.deadline


class Batcher:
    def __init__(self, pipe: "EditPipeline", scheduler: RowScheduler, queue_limit: Optional[int] = None,
                 metrics: Optional[Metrics] = None, engine: Optional[EngineThread] = None):  # fmt: skip
        self.pipe = pipe
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

    # --- submitting -----------------------------------------------------------------------------

    def start(self) -> "Batcher":
        """Run the loop on the engine thread (the server); without it, :meth:`run` drives it."""
        self.engine.attach(self)
        self.engine.start()
        return self

    def has_work(self) -> bool:
        return not self._stopped and bool(self.queue or self.scheduler.active or self.scheduler.pending)

    def submit(self, request: Request, jobs: list[Job]) -> None:
        with self._cv:
            if self._closing:
                raise ShuttingDownError("the server is shutting down and takes no new work")
            if self.queue_limit is not None and self.queued_rows + len(jobs) > self.queue_limit:
                raise QueueFullError(f"the queue is full ({self.queued_rows}/{self.queue_limit} rows)")
            request.pending.extend(jobs)
            self.queue.append(request)
            self.queued_rows += len(jobs)
            self.metrics.gauge("edit_rt_queue_rows", self.queued_rows)
            self._cv.notify_all()

    def run(self, request: Request, jobs: list[Job]) -> list[RowResult]:
        """Submit and wait: on the engine thread if one runs, else by driving the loop here (a
        task on the engine thread drives it too: it must not wait on itself)."""
        self.submit(request, jobs)
        if self.engine.owns():
            while not all(job.future.done() for job in jobs):
                self.work_once()
                if not (self.queue or self.scheduler.active or self.scheduler.pending):
                    for job in jobs:  # nothing left that could finish them: never wait forever
                        if not job.future.done():
                            job.future.set_exception(RuntimeError(f"row {job.index} of {request.id} was lost"))
        return [job.future.result() for job in jobs]

    def queue_position(self, request: Request) -> int:
        with self._cv:
            return next((k for k, r in enumerate(self.queue) if r is request), -1)

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful: take no new work, finish what is queued and running, then stop.

        Rows still unfinished after ``timeout`` fail with a ShuttingDownError.
        """
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        deadline = time.monotonic() + timeout
        with self._cv:
            while (self.queue or self.scheduler.active or self.scheduler.pending) and time.monotonic() < deadline:
                self._cv.wait(0.05)
            self._stopped = True
            self._cv.notify_all()
        try:
            self.engine.call(self._fail_leftovers).result(timeout=10)
        except Exception:  # an engine thread that cannot answer: fail the futures from here
            log.exception("the engine thread did not take the batcher's leftovers")
            for job in [row.owner for row in self.scheduler.active + self.scheduler.pending] + [
                    j for r in self.queue for j in r.pending]:  # fmt: skip
                if job is not None and not job.future.done():
                    job.future.set_exception(ShuttingDownError("the server shut down before this row finished"))
        if self._own_engine:
            self.engine.stop()

    def _fail_leftovers(self) -> None:
        with self._work:
            rows = self.scheduler.active + self.scheduler.pending
            leftover = [row.owner for row in rows if not row.reference] + [j for r in self.queue for j in r.pending]
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
            return not (self.queue or self.scheduler.active or self.scheduler.pending)

    def work_once(self) -> None:
        """Admit what fits, drop what expired, run one step, hand out what finished."""
        with self._work:
            finished: list[Job] = []
            try:
                with self._cv:
                    jobs = self._take_locked(self.scheduler.free_slots)
                self._admit(jobs)
                self._drop_expired()
                finished = [row.owner for row in self.scheduler.step()]
                self._observe()
                self._finish(finished)
            except Exception as err:  # a bug or a broken engine: fail the rows in flight, keep serving
                log.exception("batcher step failed")
                for row in self.scheduler.active + self.scheduler.pending:
                    self.scheduler.remove(row)
                    if not row.reference:
                        finished.append(row.owner)
                for job in finished:
                    if not job.future.done():
                        job.future.set_exception(err)
            with self._cv:
                self._cv.notify_all()

    def _take_locked(self, free: int) -> list[Job]:
        # Every queued request's deadline, not only the one at the head: a request stuck behind
        # full slots still times out on time.
        for request in [r for r in self.queue if r.expired()]:
            self.queue.remove(request)
            for job in request.pending:
                job.future.set_exception(CancelledError("cancelled or past its deadline"))
            self.queued_rows -= len(request.pending)
            request.pending.clear()
        taken = []
        while free > 0 and self.queue:
            request = self.queue.popleft()
            if request.expired():
                for job in request.pending:
                    job.future.set_exception(CancelledError("cancelled or past its deadline"))
                self.queued_rows -= len(request.pending)
                request.pending.clear()
                continue
            taken.append(request.pending.popleft())
            self.queued_rows -= 1
            free -= 1
            if request.pending:
                self.queue.append(request)  # round robin between requests
        self.metrics.gauge("edit_rt_queue_rows", self.queued_rows)
        return taken

    def _requeue(self, jobs: list[Job]) -> None:
        """Put jobs that found no room back at the head of the queue, in order."""
        with self._cv:
            for job in reversed(jobs):
                job.request.pending.appendleft(job)
                if job.request not in self.queue:
                    self.queue.appendleft(job.request)
                self.queued_rows += 1

    def _encode(self, keys: list[tuple[str, int, bool]]) -> dict[tuple, KV | Exception]:
        """K/V per (prompt, clip_skip, negative), one batched encoding per kind; a prompt that
        fails is retried alone, so only its own rows fail."""
        out: dict[tuple, KV | Exception] = {}
        for kind in sorted({(skip, negative) for _, skip, negative in keys}):
            prompts = [p for p, skip, negative in keys if (skip, negative) == kind]
            try:
                kv = self.pipe.kv_from_prompts(prompts, *kind)
                out.update({(p, *kind): kv.row(k) for k, p in enumerate(prompts)})
            except Exception:
                for p in prompts:
                    try:
                        out[(p, *kind)] = self.pipe.kv_from_prompts([p], *kind)
                    except Exception as err:  # the tokenizer or text encoder refused this text
                        out[(p, *kind)] = err
        return out

    @staticmethod
    def _needs(job: Job) -> list[tuple[str, int, bool]]:
        """The encodings a job's row needs: its prompt (at its base's clip_skip) and, for a row
        that starts a base, the negative prompt."""
        keys = [(job.row.prompt, job.base.clip_skip, False)]
        if job.state is None:
            keys.append((job.base.negative_prompt, 0, True))
        return keys

    def _admit(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        kv = self._encode(sorted({key for job in jobs for key in self._needs(job)}))
        waiting, built = [], []
        for job in jobs:
            try:
                built.append((job, self._row(job, kv)))
            except Exception as err:  # this row's input: fail it alone
                log.info("row %s/%d refused: %s", job.request.id, job.index, err)
                job.future.set_exception(err if isinstance(err, EditRtError) else RowError(f"{type(err).__name__}: {err}"))
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
                    ref = reference_row(chunk[0][1], self.pipe)
                    self.scheduler.admit(ref)
                for job, row in chunk:
                    row.ref = ref if structure else None
                    self.scheduler.admit(row)
                    job.scheduled = row
                    job.started = time.perf_counter()
        if waiting:
            self._requeue(waiting)

    def _row(self, job: Job, kv: dict) -> Row:
        """The scheduler row of ``job``: its K/V mix, entry latent, mask, what it records."""
        for key in self._needs(job):
            if isinstance(kv.get(key), Exception):
                err = kv[key]
                raise RowError(f"the prompt {key[0][:40]!r} cannot be encoded ({type(err).__name__}: {err})")
        base = job.base
        edit = kv[(job.row.prompt, base.clip_skip, False)]
        negative = kv.get((base.negative_prompt, 0, True))
        schedule = DDIMSchedule(self.pipe.ddim_config, base.steps)
        shape = job.noise.shape[1:] if job.state is None else job.state.latents.shape[1:]
        conds = self.pipe.row_conds(base, edit)
        if job.kind == "invert":  # the source prompt's prediction alone, backwards, recording
            inverse = InverseDDIMSchedule(schedule, job.row.start_step, base.steps)
            K = inverse.num_inference_steps
            record = Recording(np.empty((K + 1, *shape), dtype=np.float32), np.empty((K, *shape), dtype=np.float32))
            record.latents[0] = job.noise[0]
            return Row(inverse, 0, job.noise[0].copy(), 1.0, [t[0] for t in edit.tensors], negative,
                       record=record, conds=conds, owner=job)  # fmt: skip
        if job.kind == "correct":  # one forward step from the inverted latent, recording u
            T, i = base.steps, job.row.start_step
            record = Recording(np.empty((T + 1, *shape), dtype=np.float32), np.empty((T, *shape), dtype=np.float32))
            return Row(schedule, i, job.state.latent(i)[0].copy(), job.row.guidance, [t[0] for t in edit.tensors],
                       job.state.uncond_kv, record=record, stop=i + 1, conds=conds, owner=job)  # fmt: skip
        if job.state is None:  # a base: its own prompt's K/V, from noise, recording
            T = base.steps
            record = Recording(np.empty((T + 1, *shape), dtype=np.float32), np.empty((T, *shape), dtype=np.float32))
            record.latents[0] = job.noise[0]
            return Row(schedule, 0, job.noise[0].copy(), job.row.guidance, [t[0] for t in edit.tensors], negative,
                       record=record, conds=conds, owner=job)  # fmt: skip
        state, tail = job.state, job.row
        auto, job.preserve = self.pipe.auto_mask(state.base.prompt, tail, shape)
        mixed = mix_kv(state.cond_kv, edit, tail.strength)
        structure = math.ceil(tail.structure * (base.steps - tail.start_step))  # steps that keep it
        return Row(
            schedule, tail.start_step, entry_latent(state, tail, schedule), tail.guidance,
            [t[0] for t in mixed.tensors], state.uncond_kv,
            entry_uncond=state.entry_uncond(tail.start_step) if tail.seed is None else None,
            keep=self.pipe.keep_mask(tail.mask, shape), base=state, auto=auto,
            corrections=state if state.corrections is not None else None,
            conds=self.pipe.row_conds(base, mixed), structure_end=tail.start_step + structure, owner=job,
        )  # fmt: skip

    def _drop_expired(self) -> None:
        for row in list(self.scheduler.active + self.scheduler.pending):
            if not row.reference and row.owner.request.expired():
                self.scheduler.remove(row)
                row.owner.future.set_exception(CancelledError("cancelled or past its deadline"))

    def _observe(self) -> None:
        stats = self.scheduler.stats
        if stats.last_rows:
            self.metrics.observe("edit_rt_step_seconds", stats.last_seconds)
            self.metrics.observe("edit_rt_batch_rows", stats.last_rows)
        self.metrics.gauge("edit_rt_active_rows", len(self.scheduler.active))
        for row in self.scheduler.active:
            job = row.owner
            if not row.reference and job.request.on_progress is not None:
                job.request.on_progress(job.index, row.step - job.row.start_step, job.base.steps - job.row.start_step)

    def _finish(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        for job in jobs:  # the rows that finished this step made progress too
            if job.request.on_progress is not None:
                of = job.base.steps - job.row.start_step
                job.request.on_progress(job.index, of, of)
        decode = [job for job in jobs if job.request.decode]
        image_of = {}
        if decode:
            images = self.pipe.decode(np.stack([job.scheduled.latent for job in decode]))
            for job, image in zip(decode, images):
                if job.state is not None:  # outside its mask an edit shows the base's own pixels
                    image = self.pipe.with_base(image, job.state, job.row, job.scheduled.keep)
                image_of[id(job)] = image
        for job in jobs:
            seconds = time.perf_counter() - job.started
            self.metrics.observe("edit_rt_row_seconds", seconds)
            row = job.scheduled
            state = None
            if row.record is not None and not job.kind:
                cond = KV([t[None] for t in row.kv], {name: row.conds[name][None] for name in self.pipe.pooled})
                state = BaseState(job.base, self.pipe.manifest.fingerprint, 0, row.record.latents, cond, row.uncond,
                                  row.record.uncond)  # fmt: skip
            elif row.record is None:
                self.metrics.inc("edit_rt_edits_served_total")
            job.future.set_result(RowResult(row.latent, image_of.get(id(job)), state, seconds, job.preserve, row.keep,
                                            row.record))  # fmt: skip


def reference_row(row: Row, pipe) -> Row:
    """The reference row of ``row``'s group: its base's own tail from the same step, with the
    base's K/V and guidance, reset to the base's kept latent after every step (exact by
    construction), for as long as the group keeps structure."""
    state = row.base
    return Row(row.schedule, row.step, state.latent(row.step)[0].copy(), state.base.guidance,
               [t[0] for t in state.cond_kv.tensors], state.uncond_kv, entry_uncond=state.entry_uncond(row.step),
               keep=np.ones((1, *row.latent.shape[1:]), dtype=bool), base=state,
               conds=pipe.row_conds(state.base, state.cond_kv), stop=row.structure_end, reference=True)  # fmt: skip


def mix_kv(base: KV, edit: KV, strength: float) -> KV:
    """``K_base + strength * (K_edit - K_base)`` per tensor (same for V, and for the family's
    extras: SDXL's pooled embedding), one prompt (B = 1)."""

    def mix(b: np.ndarray, e: np.ndarray) -> np.ndarray:
        mixed = e[:1] - b[:1]
        mixed *= strength
        mixed += b[:1]
        return mixed

    return KV([mix(b, e) for b, e in zip(base.tensors, edit.tensors)], {k: mix(base.extras[k], v) for k, v in edit.extras.items()})


def entry_latent(state: BaseState, row: TailRow, schedule: DDIMSchedule) -> np.ndarray:
    """The base's own x_s, or (``row.seed``) x_s re-noised from the final latent for a variation."""
    if row.seed is None:
        return state.latent(row.start_step)[0].copy()
    a = schedule.alpha_t[row.start_step]
    noise = np.random.default_rng(row.seed).standard_normal(state.latents.shape[1:], dtype=np.float32)
    return (np.sqrt(a) * state.final_latent[0] + np.sqrt(1 - a) * noise).astype(np.float32)
