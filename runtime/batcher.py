"""Continuous batching at step granularity: one worker thread owns the engines.

Every ``unet_step`` call advances every active row by one step. Rows of different requests,
bases, step counts and start steps share a call (each row carries its own timestep, alphas,
guidance, K/V and unconditional set); new rows join at the next step boundary and finished rows
leave, up to ``max_rows``. Base generations are rows too (they record their latents).

The queue is bounded (``queue_limit`` rows) and fair: admission takes one row from the request
at its head, then moves that request to the back, so one request's 64 edits do not hold back a
later request's single edit. A request can be cancelled (client gone) or time out: its rows are
dropped at the next step boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from .buffers import StepBuffers
from .config import Base
from .errors import EditRtError
from .metrics import Metrics
from .pipeline import KV, BaseState, EditPipeline, TailRow, prepare_row
from .scheduler_ddim import DDIMSchedule

log = logging.getLogger(__name__)


class QueueFullError(EditRtError):
    """The queue holds ``queue_limit`` rows already; retry later."""


class ShuttingDownError(EditRtError):
    """The batcher is stopping and takes no new work."""


class CancelledError(EditRtError):
    """The request was cancelled (client disconnected) or passed its deadline."""


@dataclass
class Job:
    """One row: an edit of ``state``, or (``state`` None) the generation of base ``base``."""

    request: "Request"
    index: int
    base: Base
    row: TailRow
    state: Optional[BaseState] = None
    noise: Optional[np.ndarray] = None  # generation: x_0
    future: Future = field(default_factory=Future)
    # filled at admission
    schedule: Optional[DDIMSchedule] = None
    step: int = 0
    cond_kv: Optional[KV] = None
    uncond_key: str = ""
    uncond_kv: Optional[KV] = None
    record: Optional[np.ndarray] = None
    started: float = 0.0


@dataclass
class Request:
    """A group of rows submitted together; cancelling it drops all of them."""

    id: str
    deadline: float = float("inf")
    on_progress: Optional[Callable[[int, int, int], None]] = None  # (index, step, of)
    cancelled: threading.Event = field(default_factory=threading.Event)
    pending: deque = field(default_factory=deque)

    def expired(self) -> bool:
        return self.cancelled.is_set() or time.monotonic() > self.deadline


class Batcher:
    def __init__(self, pipe: EditPipeline, latent_shape: tuple[int, int, int], max_rows: int, queue_limit: int,
                 metrics: Optional[Metrics] = None):  # fmt: skip
        self.pipe = pipe
        self.max_rows = max_rows
        self.queue_limit = queue_limit
        self.metrics = metrics or Metrics()
        self.buf = StepBuffers(max_rows, latent_shape, pipe.kv_dims, pipe.text_len)
        # Unconditional K/V sets, [max_rows, 77, C] per layer: rows index theirs.
        self.uncond = [np.zeros((max_rows, pipe.text_len, c), dtype=np.float32) for c in pipe.kv_dims]
        self.uncond_slots: dict[str, list[int]] = {}  # key -> [index, rows using it]
        self.slots: list[Job] = []  # active rows, in buffer order
        self.queue: deque[Request] = deque()
        self.queued_rows = 0
        self.bindings: dict[int, object] = {}
        self._cv = threading.Condition()
        self._closing = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="edit-rt-batcher", daemon=True)

    # --- submitting -----------------------------------------------------------------------------

    def start(self) -> "Batcher":
        self._thread.start()
        return self

    def submit(self, request: Request, jobs: list[Job]) -> None:
        with self._cv:
            if self._closing:
                raise ShuttingDownError("the server is shutting down and takes no new work")
            if self.queued_rows + len(jobs) > self.queue_limit:
                raise QueueFullError(f"the queue is full ({self.queued_rows}/{self.queue_limit} rows)")
            request.pending.extend(jobs)
            self.queue.append(request)
            self.queued_rows += len(jobs)
            self.metrics.gauge("edit_rt_queue_rows", self.queued_rows)
            self._cv.notify()

    def queue_position(self, request: Request) -> int:
        with self._cv:
            return next((k for k, r in enumerate(self.queue) if r is request), -1)

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful: take no new work, finish what is queued and running, then stop.

        Rows still unfinished after ``timeout`` fail with a ShuttingDownError.
        """
        with self._cv:
            self._closing = True
            self._cv.notify()
        deadline = time.monotonic() + timeout
        with self._cv:
            while (self.queue or self.slots) and time.monotonic() < deadline:
                self._cv.wait(0.05)
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)
        leftover = [j for j in self.slots] + [j for r in self.queue for j in r.pending]
        for job in leftover:
            if not job.future.done():
                job.future.set_exception(ShuttingDownError("the server shut down before this row finished"))

    # --- the worker -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not self.slots and not self.queue:
                    self._cv.wait()
                if self._stopped:
                    return
                admitted = self._take_locked(self.max_rows - len(self.slots))
            try:
                self._admit(admitted)
                self._drop_expired()
                if self.slots:
                    self._step()
            except Exception as err:  # a bug or a broken engine: fail the rows, keep serving
                log.exception("batcher step failed")
                for job in self.slots:
                    if not job.future.done():
                        job.future.set_exception(err)
                self.slots = []
                self.uncond_slots = {}
            with self._cv:
                self._cv.notify_all()

    def _take_locked(self, free: int) -> list[Job]:
        taken = []
        while free > 0 and self.queue:
            request = self.queue.popleft()
            if request.expired():
                for job in request.pending:
                    job.future.set_exception(CancelledError("cancelled or past its deadline"))
                self.queued_rows -= len(request.pending)
                continue
            taken.append(request.pending.popleft())
            self.queued_rows -= 1
            free -= 1
            if request.pending:
                self.queue.append(request)  # round robin between requests
        self.metrics.gauge("edit_rt_queue_rows", self.queued_rows)
        return taken

    def _admit(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        prompts = sorted({j.row.prompt for j in jobs} | {j.base.negative_prompt for j in jobs if j.state is None})
        kv = self.pipe.kv_from_prompts(prompts)
        for job in jobs:
            job.schedule = DDIMSchedule(self.pipe.ddim_config, job.base.steps)
            row_kv = [t[prompts.index(job.row.prompt)] for t in kv.tensors]
            r = len(self.slots)
            if job.state is None:  # a base: its own prompt's K/V, from noise, recording
                job.cond_kv = KV([t[None] for t in row_kv])
                job.uncond_kv = KV([t[prompts.index(job.base.negative_prompt)][None] for t in kv.tensors])
                job.record = np.empty((job.base.steps + 1, *self.buf.latents.shape[1:]), dtype=np.float32)
                job.record[0] = job.noise[0]
                for dst, src in zip(self.buf.cond_kv, row_kv):
                    dst[r] = src
                self.buf.latents[r] = job.noise[0]
                self.buf.guidance[r] = job.row.guidance
                self.buf.keep[r] = False
            else:
                job.uncond_kv = job.state.uncond_kv
                prepare_row(job.state, job.row, row_kv, job.schedule, self.pipe.scale, self.buf, r)
            job.uncond_key = job.base.negative_prompt
            self.buf.uncond_index[r] = self._uncond_slot(job)
            self.buf.guidance[r] = max(float(self.buf.guidance[r]), 1.0)  # <= 1: no CFG (diffusers)
            job.step = job.row.start_step
            job.started = time.perf_counter()
            self.slots.append(job)

    def _uncond_slot(self, job: Job) -> int:
        slot = self.uncond_slots.get(job.uncond_key)
        if slot is None:
            used = {s[0] for s in self.uncond_slots.values()}
            index = next(k for k in range(self.max_rows) if k not in used)
            for dst, src in zip(self.uncond, job.uncond_kv.tensors):
                dst[index] = src[0]
            slot = self.uncond_slots[job.uncond_key] = [index, 0]
        slot[1] += 1
        return slot[0]

    def _remove(self, r: int) -> Job:
        """Take row r out of the batch: the last row moves into its slot (a copy per leave,
        never per step)."""
        job, last = self.slots[r], len(self.slots) - 1
        if r != last:
            b = self.buf
            for arr in (b.latents, b.guidance, b.uncond_index, b.keep, *b.cond_kv):
                arr[r] = arr[last]
            self.slots[r] = self.slots[last]
        self.slots.pop()
        slot = self.uncond_slots[job.uncond_key]
        slot[1] -= 1
        if slot[1] == 0:
            del self.uncond_slots[job.uncond_key]
        return job

    def _drop_expired(self) -> None:
        for r in reversed(range(len(self.slots))):
            if self.slots[r].request.expired():
                job = self._remove(r)
                job.future.set_exception(CancelledError("cancelled or past its deadline"))

    def _step(self) -> None:
        n, b = len(self.slots), self.buf
        for r, job in enumerate(self.slots):
            s = job.schedule
            b.timestep[r], b.alpha_t[r], b.alpha_prev[r] = s.timesteps[job.step], s.alpha_t[job.step], s.alpha_prev[job.step]
        binding = self.bindings.get(n)
        if binding is None:
            inputs = b.step_inputs(n, self.uncond)
            # Nothing is static here: rows join and leave, so K/V rows change between calls.
            binding = self.bindings[n] = self.pipe.graphs["unet_step"].bind(inputs, {"next_latents": b.next_latents[:n]}, frozenset())
        start = time.perf_counter()
        binding.run()
        self.metrics.observe("edit_rt_step_seconds", time.perf_counter() - start)
        self.metrics.observe("edit_rt_batch_rows", n)
        self.metrics.gauge("edit_rt_active_rows", n)
        b.latents[:n] = b.next_latents[:n]
        finished = []
        for r, job in enumerate(self.slots):
            job.step += 1
            if job.record is not None:
                job.record[job.step] = b.latents[r]
            elif job.row.mask is not None:
                np.copyto(b.latents[r], job.state.latent(job.step)[0], where=b.keep[r])
            if job.request.on_progress is not None:
                job.request.on_progress(job.index, job.step - job.row.start_step, job.base.steps - job.row.start_step)
            if job.step == job.base.steps:
                finished.append(r)
        if finished:
            latents = np.stack([b.latents[r] for r in finished])
            jobs = [self._remove(r) for r in sorted(finished, reverse=True)][::-1]
            images = self.pipe.decode(latents)
            for job, image, latent in zip(jobs, images, latents):
                seconds = time.perf_counter() - job.started
                self.metrics.observe("edit_rt_row_seconds", seconds)
                if job.record is not None:
                    state = BaseState(job.base, self.pipe.manifest.fingerprint, 0, job.record, job.cond_kv, job.uncond_kv)
                    job.future.set_result((image, state, seconds))
                else:
                    self.metrics.inc("edit_rt_edits_served_total")
                    job.future.set_result((image, latent, seconds))
