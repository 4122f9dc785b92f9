"""What the step loop's callers hand it and get back: a :class:`Request` of :class:`Job` rows,
each resolving to a :class:`RowResult`, and the loop's own refusals. Data only: the loop
(batcher.py), the resolver (resolve.py) and the pipeline all speak it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, get_args

import numpy as np

from ..model.edit import Base, TailRow
from ..model.state import BaseState
from .rows import Recording, Row


@dataclass
class RowResult:
    latent: np.ndarray  # x_T, [c, h, w]
    image: Optional[np.ndarray]  # [H, W, 3] in [0, 1] when the request asked for images
    state: Optional[BaseState]  # a generation's recorded state
    seconds: float
    preserve: str = "none"  # what the row's preserve mode came to ("auto", or why none)
    keep: Optional[np.ndarray] = None  # [1, h, w] bool: where the row kept the base's latent
    record: Optional[Recording] = None  # what a recording row kept (inversion, its corrections)
    uncond: str = "compute"  # where its unconditional prediction came from (tail.uncond, as it ran)


# What a job's row does (``Job.kind``):
# "generate": the generation of ``base`` from the noise ``noise``, recorded as a base;
# "edit": a tail of the base ``state`` from step row.start_step;
# "invert": DDIM inversion of the image latent ``noise`` over steps row.start_step..T-1, and
# "correct": one forward step of ``state`` from step row.start_step (pipeline.invert's two phases);
# "related": a related generation of ``base`` as ``state``'s tail from row.start_step, recorded
# as a base of its own.
JobKind = Literal["generate", "edit", "invert", "correct", "related"]
JOB_KINDS: tuple[str, ...] = get_args(JobKind)


@dataclass
class Job:
    """One row of a request: what it does is ``kind`` (``JobKind``); left None, a job with a
    ``state`` is an edit of it and one without the generation of ``base``."""

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
    uncond: str = "compute"  # tail.uncond as the row runs it (compute where the base's u is not its own)
    kind: Optional[JobKind] = None
    # every this many steps of its row, a preview (its request's ``on_preview``); 0: none. Per
    # row, so that rows of one request spread their previews over their own tails
    preview_every: int = 0

    def __post_init__(self):
        if self.kind is None:
            self.kind = "generate" if self.state is None else "edit"
        elif self.kind not in JOB_KINDS:
            raise ValueError(f"Job kind {self.kind!r} is not one of {', '.join(JOB_KINDS)}")


@dataclass
class Request:
    """A group of rows submitted together; cancelling it drops all of them."""

    id: str
    deadline: float = float("inf")
    on_progress: Optional[Callable[[int, int, int], None]] = None  # (index, step, of)
    # at each row's previews (Job.preview_every), (index, step, of, image [H, W, 3] in [0, 1]):
    # the decoded prediction of the final image (DDIM's x_0 estimate), from the engine thread
    on_preview: Optional[Callable[[int, int, int, np.ndarray], None]] = None
    decode: bool = True  # images for the results (the server); latents only otherwise
    decoder: str = "vae"  # what decodes them: vae or taesd (pipeline/decoders.py); previews pick their own
    cancelled: threading.Event = field(default_factory=threading.Event)
    pending: deque = field(default_factory=deque)
    door: str = ""  # the door it came in by (serving/job_control.py DOOR): whose interrupt stops it

    def expired(self) -> bool:
        return self.cancelled.is_set() or time.monotonic() > self.deadline
