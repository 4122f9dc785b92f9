"""What the step loop schedules: a :class:`Row` (an edit's tail or a base's generation), what a
generation row records, the scheduler's counters, and the row buckets of the GPU backends.
The scheduler itself is in row_scheduler.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ..model.automask import AutoMask
from ..model.step_coefs import Schedule
from ..model.state import KV, BaseState
from .uncond_reuse import BaseUncond

@dataclass
class Recording:
    """What a generation row keeps: x_0..x_T, the unconditional prediction of each step and,
    for a multistep sampler, the x_0 each step predicted (its edits' solver history)."""

    latents: np.ndarray  # [T + 1, c, h, w]
    uncond: Optional[np.ndarray]  # [T, c, h, w]; None: an unguided row computes no u
    x0: Optional[np.ndarray] = None  # [T, c, h, w]


@dataclass(eq=False)
class Row:
    """One row of the step loop: an edit's tail or a base's generation."""

    schedule: Schedule  # its sampler's timesteps and coefficients (a row never switches sampler)
    step: int  # the step this row runs next (its entry step until it has run one)
    latent: np.ndarray  # [c, h, w]: x at ``step`` on admission; x_T when it finishes
    guidance: float  # the step's CFG scale: 1 for an unguided row (below)
    kv: Sequence[np.ndarray]  # the row's K/V, one per step-graph K/V input, batch axis dropped
    uncond: KV  # its negative prompt's K/V (B = 1)
    entry_uncond: Optional[np.ndarray] = None  # [c, h, w]: u at the entry step, when the base kept it
    # tail.uncond base / base-corrected: u from the base at every step (uncond_reuse.py)
    given: Optional[BaseUncond] = None
    keep: Optional[np.ndarray] = None  # [1, h, w] bool: True where the base's latent is kept
    base: Optional[BaseState] = None  # what ``keep`` blends in
    record: Optional[Recording] = None  # a generation: keep every latent and u
    auto: Optional[AutoMask] = None  # preserve: auto; its mask becomes ``keep`` as maps arrive
    corrections: Optional[BaseState] = None  # an inverted image's base: its d_i after each step i
    conds: dict = field(default_factory=dict)  # the family's per-row conditioning (SDXL: text_embeds, time_ids)
    stop: Optional[int] = None  # finish before the schedule's end (an inversion's one-step rows)
    # Structure keeping: until ``structure_end`` the row's self-attention takes its pattern from
    # ``ref``, a reference row of the same base at the same step (the base's own tail).
    ref: Optional["Row"] = None
    structure_end: int = 0
    reference: bool = False  # a reference row: nobody's result; it leaves once no row uses it
    owner: Any = None  # the caller's (the batcher's job)
    # LoRA: the UNet's scale per adapter slot [slots] (None: no adapter), and the slots it
    # holds (never reloaded while it runs)
    adapter_scale: Optional[np.ndarray] = None
    adapter_slots: frozenset = frozenset()
    base_adapter_scale: Optional[np.ndarray] = None  # its base's (a structure reference row takes them)
    # A multistep sampler's x_0 one and two steps before its step ([2, c, h, w]; None: zeros),
    # and the seed of an ancestral sampler's per-step noise (its base's: solver_slots.py)
    history: Optional[np.ndarray] = None
    noise_seed: int = 0
    # DeepCache: every ``deepcache``-th step full, the others shallow on its last full step's
    # deep features (0 or 1: every step full; row_scheduler.py)
    deepcache: int = 0
    slot: int = field(default=-1, init=False)
    set_key: str = field(default="", init=False)
    keep_written: Any = field(default=None, init=False, repr=False)  # the ``keep`` its slot holds
    # Previews: every ``preview_every`` steps the x_0 the step predicted comes back ([c, h, w],
    # read with the step's one synchronization), ``previewed`` the step it is of.
    preview_every: int = 0
    preview: Optional[np.ndarray] = field(default=None, init=False, repr=False)
    previewed: int = field(default=-1, init=False)
    entry: int = field(default=0, init=False)  # the step it entered at
    # Unguided: the conditional prediction alone, as diffusers does at guidance <= 1 (and a
    # model without CFG, e.g. an LCM whose guidance is an embedding in ``conds``: its row is made
    # with ``unguided=True``). Fixed at construction: the row is given u = 0 at every step (the
    # always-given suffix, row_scheduler.py) and runs at CFG scale 1, so ``u + 1 (c - u)`` is c exactly
    # and the UNet runs its conditional half only. Its recording keeps no u: it computed none.
    unguided: bool = False

    def __post_init__(self) -> None:
        self.unguided = self.unguided or self.guidance <= 1.0
        if self.unguided:
            self.guidance = 1.0
            if self.record is not None:
                self.record.uncond = None
        self.entry = self.step

    def preview_due(self) -> bool:
        """Whether the step this row runs next ends with a preview (never its last: that is its result)."""
        done = self.step + 1
        return self.preview_every > 0 and done < self.end and (done - self.entry) % self.preview_every == 0

    @property
    def end(self) -> int:
        return self.schedule.num_inference_steps if self.stop is None else self.stop


@dataclass
class SchedulerStats:
    calls: int = 0
    shallow_calls: int = 0  # calls of unet_step_shallow (DeepCache)
    map_calls: int = 0  # calls whose maps were read (some row still collecting its auto mask)
    reference_steps: int = 0  # reference rows advanced (structure keeping's extra rows)
    row_steps: int = 0  # rows advanced by one step, summed over calls
    uncond_rows_skipped: int = 0  # half-rows not computed: the base's u taken (entry step, tail.uncond)
    # Unguided rows (Row.unguided): their row-steps, and of those the ones whose unconditional
    # half the UNet did not run (the rest computed one they did not need: a GPU bucket's E
    # rounded down to a power of two, or an export without ``step_all_given``'s one computing row)
    unguided_row_steps: int = 0
    unguided_rows_skipped: int = 0
    rows_computed: int = 0  # rows the calls ran, padding of a bucket included
    syncs: int = 0  # host waits on the backend (one per step at most, plus maps steps)
    bindings_made: int = 0
    bindings_freed: int = 0
    set_writes: int = 0  # rewrites of the negative-prompt sets (new or dropped sets)
    last_rows: int = 0
    last_joined: int = 0  # rows placed into slots at the start of the last call
    # The last call's nanoseconds, in a preallocated int64: a float attribute would be a new
    # object every step, and the loop keeps no new object per step (tests/test_slots.py). Integer
    # nanoseconds, not float seconds: a float temporary lands on CPython's float free list, which
    # tracemalloc counts as kept memory (a flaky 24 B in that test).
    # [1]: every call's, summed (what a tail's UNet calls took: the bench's slider move)
    nanoseconds: np.ndarray = field(default_factory=lambda: np.zeros(2, dtype=np.int64), repr=False)

    @property
    def last_seconds(self) -> float:
        return int(self.nanoseconds[0]) * 1e-9

    @property
    def step_seconds(self) -> float:
        return int(self.nanoseconds[1]) * 1e-9


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Row buckets for a profile's [lo, hi]: the powers of two between, and both ends."""
    out = {lo, hi}
    b = 1
    while b < hi:
        if b >= lo:
            out.add(b)
        b *= 2
    return tuple(sorted(out))


def _floor_pow2(x: int) -> int:
    return 0 if x <= 0 else 1 << (x.bit_length() - 1)
