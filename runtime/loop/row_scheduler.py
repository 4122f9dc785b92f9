"""The step loop's one scheduler: rows in resident slots, one ``unet_step`` call per step.

Every ``unet_step`` call of edit-rt goes through :meth:`RowScheduler.step`: base generations,
the edit tails of ``edit-rt run``, the server's batches and the bench. A :class:`Row` carries
its own schedule, step, guidance, K/V and negative prompt, so rows of any base, start step and
request share a call; they join and leave at step boundaries.

Where things live (docs/engines.md, "The step loop", says why):

- an admitted row's K/V, guidance, set index, entry latent and mask are written into backend
  memory once; a step writes the per-row step scalars (an ancestral row its noise). The latents and
  the solver history stay there: ``latent_blend`` puts each row's next latent (and history)
  back into the step's input on the device (solver_slots.py: the sampler's buffers), a masked
  row's base latent and an inverted base's correction copied in from the base's resident
  window (base_windows.py); a row's latent comes
  back when it finishes (a generation's every step; the maps while ``preserve: auto`` collects
  them), with at most one synchronization per step (a generation's per-step reads wait for the next one);
- the negative prompts' K/V are resident once per distinct set (keyed by value), side by side
  (uncond_sets.py);
- a call runs at a *bucket* of rows (``buckets``: pow2 on a GPU, one captured graph each; every
  count on the CPU), the padding bound but ignored; bindings per bucket live in an LRU
  (bindings.py);
- a row at its entry step takes its base's unconditional prediction as given (``entry_uncond``);
  a row whose tail takes it at every step (``tail.uncond``: uncond_reuse.py) is given it at every
  step, and an unguided row (``Row.unguided``: guidance <= 1, or a model without CFG) is given
  zeros at every step (at CFG scale 1 the update takes c exactly, so its UNet runs one half):
  such rows are kept as the active rows' suffix (a joining row that computes takes the
  first one's slot, which moves to the end; a leaving row's hole is filled from its own part),
  and while any is placed, a row at its entry step computes its prediction;
- ``preserve: auto`` rows collecting maps read the step's ``attn_maps`` output back (every step computes it);
- DeepCache (``tail.deepcache`` k > 1): every full call leaves each UNet row's deep features in
  one resident buffer (``deep_out``); the next call runs ``unet_step_shallow`` on them while
  the rows and their layout are those of that full call (no row joined, left or changed
  between given and computed u: each of those makes the next call full) and fewer than every
  row's k steps have passed since it; a row collecting maps makes its call full. So full and
  shallow rows never share a call: a call is shallow when all of its rows may be. A DeepCache
  row computes its unconditional half at its entry step (the next steps reuse its features),
  so rows that enter together run full at tail steps 0, k, 2k, ...

Rows leave by swap-with-last (one slot copy per leave; two when always-given rows follow the
leaving one's part), so the active rows are the prefix ``[:n]``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Optional, Sequence

import numpy as np

from ..engine.backend import Binding, Graph
from ..engine.device import DeviceTensor
from ..engine.step_signature import StepSignature
from ..model.adapters import AdapterBank
from .base_windows import BaseWindows
from .bindings import BindingCache, bind_blend, bind_step
from .rows import Row, SchedulerStats, _floor_pow2
from .solver_slots import SolverSlots
from .uncond_sets import UncondSets

log = logging.getLogger(__name__)

class RowScheduler:
    """Resident slots for up to ``max_rows`` rows and ``max_sets`` negative prompts."""

    def __init__(
        self,
        graph: Graph,
        signature: StepSignature,
        latent_shape: tuple[int, int, int],
        max_rows: int,
        max_sets: int,
        text_len: int,
        reuse_entry: bool = True,
        skip_unguided: bool = True,
        max_bindings: int = 64,
        map_hw: tuple[int, int] = (0, 0),
        blend_graph: Graph = None,
        buckets: Optional[Sequence[int]] = None,
        adapters: Optional[AdapterBank] = None,
        shallow: Optional[tuple[Graph, StepSignature]] = None,
        all_given: bool = False,
    ):
        """``signature`` is the step graph's inputs by role (step_signature.py: read from the
        manifest), with their shapes' symbolic dims (N rows, E entry rows, S negative-prompt tokens).
        ``map_hw`` the grid of the step graph's ``attn_maps`` output ([77, *map_hw] per row: bound
        on every step, read back on a step where a row collects its mask; (0, 0): none);
        ``blend_graph`` is ``latent_blend`` (next latents, masks and corrections -> latents);
        ``buckets`` the row counts calls run at (None: exactly the active rows); ``adapters``
        the resident LoRA slots (an export with adapter slots), whose matrices the step graph
        reads from backend memory, rewritten when a slot is loaded; ``shallow`` the DeepCache
        step graph and its signature (None: every call full). ``skip_unguided`` False: unguided
        rows compute their unconditional half as guided ones do (the bench's and the tests'
        two-halves reference; at scale 1 it changes c by float rounding only). ``all_given``: the
        step graphs take E = N (the profile's ``step_all_given``), so a call whose every row is
        given u runs no unconditional UNet row; False: one row of each call computes it."""
        self.graph = graph
        self.blend_graph = blend_graph
        self.map_hw = tuple(map_hw)
        self.sig = sig = signature
        # one graph computes the maps with every step (manifest v9): an output, not a variant
        self.has_maps = sig.attn_maps is not None and all(map_hw)
        self.specs = sig.shapes
        self.latent_shape = tuple(latent_shape)
        self.max_rows = max_rows
        self.max_sets = max_sets
        self.text_len = text_len
        self.reuse_entry = reuse_entry
        self.skip_unguided = skip_unguided
        self.all_given = all_given
        self.buckets = tuple(sorted(b for b in set(buckets) if b <= max_rows)) if buckets else None
        if self.buckets and self.buckets[-1] != max_rows:
            self.buckets += (max_rows,)
        self.stats = SchedulerStats()
        self.active: list[Row] = []
        self.pending: list[Row] = []
        self.entry_rows = 0  # trailing active rows whose u is given at this step
        self.persistent = 0  # trailing active rows given u at every step (_always_given)
        # The rows the current step placed (a failed step's suspects, batcher.py), and whether
        # its graph ran: before that a failed step has changed no row's latent or step.
        self.joined: list[Row] = []
        self._wants_maps: list[Row] = []  # this step's rows collecting maps, and due a preview
        self._due: list[Row] = []
        self.ran = False
        self.references = 0  # active reference rows (structure keeping)
        self.bindings = BindingCache(max_bindings, self.stats)  # the step graphs', per bucket
        self.blend_bindings: dict[int, Binding] = {}  # latent_blend's, per row count

        latent_elems = math.prod(self.latent_shape)
        hw = math.prod(self.latent_shape[1:])
        self.row_kv, self.row_cond = list(sig.row_kv), sig.row_cond  # row_cond: input -> the family's cond
        # Per-row element counts of everything a slot holds (moved together on a leave).
        self.row_elems: dict[str, int] = {sig.set_index: 1, sig.latents: latent_elems, "keep": hw, "add": latent_elems,
                                          **{name: 1 for name in sig.row_scalars}}  # fmt: skip
        for name in [*self.row_kv, *self.row_cond]:
            self.row_elems[name] = math.prod(self.specs[name][1:])
        self.adapters = adapters
        self.adapters_version = -1  # the bank's version the backend's copy holds
        if sig.row_adapters is not None:
            if adapters is None:
                raise ValueError("this step graph takes adapter slots: pass the AdapterBank")
            self.row_elems[sig.row_adapters] = adapters.slots
            self.zero_scales = np.zeros(adapters.slots, dtype=np.float32)
        # The host's side: the per-step scalars and indices (all slots: padding rows read them).
        self.scalars = {name: np.zeros(max_rows, dtype=self._dtype(name)) for name in sig.step_scalars}
        self.uncond_index = np.zeros(max_rows, dtype=self._dtype(sig.set_index))
        self.self_ref = np.arange(max_rows, dtype=self._dtype(sig.row_ref))
        self.one = {name: np.zeros(1, dtype=self._dtype(name)) for name in sig.row_scalars}
        self.zero_keep = np.zeros((1, *self.latent_shape[1:]), dtype=np.float32)
        self.zero_latent = np.zeros(self.latent_shape, dtype=np.float32)
        # The backend's side, each buffer in the dtype the compiled graph takes; the latent_blend
        # graph's own inputs (keep, base, add) beside the step's.
        alloc = lambda name, elems: graph.allocate(elems, self._dtype(name))  # noqa: E731
        latent_buffers = (sig.latents, sig.entry_uncond, sig.next_latents, sig.uncond_out, "base", "add")
        self.slopes = np.zeros(max_rows, dtype=self._dtype(sig.entry_slope))  # the given rows' (uncond_slope)
        self.dev: dict[str, DeviceTensor] = {
            **{name: alloc(name, max_rows * latent_elems) for name in latent_buffers},
            "keep": alloc("keep", max_rows * hw),
            sig.set_index: alloc(sig.set_index, max_rows),
            sig.entry_slope: alloc(sig.entry_slope, max_rows),
            **{name: alloc(name, max_rows) for name in [*sig.step_scalars, *sig.row_scalars]},
            **{name: alloc(name, max_rows * self.row_elems[name]) for name in self.row_kv},
            **{name: alloc(name, max_rows * self.row_elems[name]) for name in self.row_cond},
            **{name: alloc(name, math.prod(self.adapter_shape(name, True))) for name in sig.adapter_weights},
        }
        if sig.row_adapters is not None:
            self.dev[sig.row_adapters] = alloc(sig.row_adapters, max_rows * adapters.slots)
        self.latent_elems = latent_elems
        self.map_elems = text_len * math.prod(self.map_hw)
        if self.has_maps:
            self.dev[sig.attn_maps] = alloc(sig.attn_maps, max_rows * self.map_elems)
        self.dev[sig.row_ref] = alloc(sig.row_ref, max_rows)
        self.solver = SolverSlots(sig, graph, self.latent_shape, max_rows, self.dev)
        self.uncond = UncondSets(sig, text_len, max_sets, alloc, self.dev, self.stats)  # the negative prompts' K/V
        self.row_elems[sig.history] = self.solver.history_elems
        self.dev[sig.row_ref].write(self.self_ref)  # every row its own reference until one keeps structure
        # DeepCache: the deep features of the last full call's UNet rows, and what makes them valid
        self.shallow_graph, self.shallow_sig = shallow or (None, None)
        deep_channels = self.shallow_sig.shapes[self.shallow_sig.deep_in][1] if shallow else 1
        self.deep_shape = (deep_channels, *self.latent_shape[1:])
        self.dev["deep"] = graph.allocate(2 * max_rows * math.prod(self.deep_shape), graph.dtype(sig.deep_out))
        self.deep_key: Optional[tuple[int, int]] = None  # the last full call's (rows, given rows); None: invalid
        self.deep_age = 0  # calls since it
        self.dev[sig.entry_slope].write(self.slopes)
        self.refs_written = False
        # what the blend takes from a row's base each step, resident: a masked row's base
        # latents, an inverted base's corrections (base_windows.py; made with the first such row)
        self._windows: Optional[tuple[BaseWindows, BaseWindows]] = None

    # --- shapes ------------------------------------------------------------------------------

    def _dtype(self, name: str) -> np.dtype:
        """The dtype of buffer ``name`` as the graph that reads (or writes) it takes it."""
        if name in ("keep", "base", "add"):
            return self.blend_graph.dtype(name)
        return self.graph.dtype(name)

    def adapter_shape(self, name: str, used: bool) -> tuple[int, ...]:
        """An adapter matrix's shape as a call binds it: every slot's columns when a row of the
        call uses an adapter, none when no row does (``P``: slots, ``R``: slots x rank)."""
        slots = self.adapters.slots if used else 0
        dims = {"P": slots, "R": slots * self.adapters.rank}
        return tuple(dims.get(d, d) if isinstance(d, str) else int(d) for d in self.specs[name])  # (the scales' N stays)

    def bucket(self, n: int) -> int:
        """The rows a call of ``n`` active rows runs at."""
        if self.buckets is None:
            return n
        return next(b for b in self.buckets if b >= n)

    @property
    def max_bindings(self) -> int:
        return self.bindings.limit

    @max_bindings.setter
    def max_bindings(self, limit: int) -> None:
        self.bindings.limit = limit

    def _binding(self, n: int, e: int, m: int, shallow: bool = False) -> Binding:
        # adapter slots bound only where a row of the call uses one (none: the branch is free),
        # except on an engine that cannot bind a zero-wide input (OpenVINO's shape inference
        # reads ONNX Reshape's 0 as "copy this dimension"): its idle rows' scales are zeros
        used = self.sig.row_adapters is not None and (
            any(row.adapter_scale is not None for row in self.active) or not getattr(self.graph, "binds_zero_width", True))
        return self.bindings.get((n, e, m, shallow, used), lambda: bind_step(self, n, e, m, shallow, used))

    def _shallow(self, b: int, given: int, wants_maps: list) -> bool:
        """Whether this call runs ``unet_step_shallow``: the features are the same rows' in the
        same layout, and no row is due a full step (its ``deepcache`` calls have not passed)."""
        if self.shallow_graph is None or self.deep_key != (b, given) or wants_maps:
            return False
        return all(row.deepcache > self.deep_age for row in self.active)

    @property
    def windows(self) -> BaseWindows:
        return self._base_windows()[0]

    @property
    def corrections(self) -> BaseWindows:
        return self._base_windows()[1]

    def _base_windows(self) -> tuple[BaseWindows, BaseWindows]:
        if self._windows is None:
            graph, elems = self.graph, self.latent_elems
            base_dtype, add_dtype = self._dtype("base"), self._dtype("add")
            self._windows = (
                BaseWindows(lambda n: graph.allocate(n, base_dtype), elems, lambda row: row.base, lambda base, i: base.latent(i + 1)[0]),
                BaseWindows(lambda n: graph.allocate(n, add_dtype), elems, lambda row: row.corrections, lambda base, i: base.correction(i)),
            )  # fmt: skip
        return self._windows

    # --- admission ---------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return self.max_rows - len(self.active) - len(self.pending)

    def can_admit(self, row: Row) -> bool:
        """A free slot, and room for the row's negative prompt among the call's sets."""
        if self.free_slots <= 0:
            return False
        return self.uncond.fits([r.uncond.digest for r in self.pending] + [row.uncond.digest])

    def admit(self, row: Row) -> None:
        """Queue ``row`` for the next step (its slot is written when that step starts)."""
        if not self.can_admit(row):
            raise RuntimeError("no free slot or negative-prompt set for this row; check can_admit() first")
        self.pending.append(row)

    def _write_adapters(self) -> None:
        """The slots' LoRA matrices, when a slot was loaded since the last step."""
        if self.adapters is None or self.adapters_version == self.adapters.version:
            return
        weights = self.adapters.weights["unet_step"]
        for name in self.sig.adapter_weights:
            self.dev[name].write(weights[name])
        self.adapters_version = self.adapters.version

    def _place_pending(self) -> None:
        self._write_adapters()
        self.stats.last_joined = len(self.pending)
        # Rows whose u is given go last: the graph takes them as the call's last E rows. Rows
        # given it at every step stay last; while any is placed, entry rows compute theirs.
        always = self.persistent > 0 or any(self._always_given(row) for row in self.pending)
        # (a DeepCache row computes it: its next steps reuse that half's deep features)
        given = lambda row: self.reuse_entry and row.entry_uncond is not None and not always and row.deepcache <= 1  # noqa: E731
        self.pending.sort(key=lambda row: (self._always_given(row), given(row)))
        self.joined.clear()  # in place: a step allocates nothing
        self.joined.extend(self.pending)
        if self.pending:
            self.deep_key = None  # the rows' layout changes: the next call computes the features
        if self.uncond.place(self.pending):
            self._reindex()
        positions = self.uncond.positions()
        latent, sig = self.latent_elems, self.sig
        while self.pending:
            # The bookkeeping first, then the writes: a row is pending or placed, never half
            # of each, whatever raises (remove() undoes either).
            row = self.pending.pop(0)
            self.references += row.reference
            self.uncond.join(row)
            r = len(self.active)
            self.active.append(row)
            if self._always_given(row):
                self.persistent += 1
            elif self.persistent:  # the first always-given row moves to the end, this row takes its slot
                self._move(r - self.persistent, r)
                r -= self.persistent
                self.active[r] = row
            row.slot = r
            for name, kv in zip(self.row_kv, row.kv):
                self.dev[name].write(kv, offset=r * self.row_elems[name])
            for name, cond in self.row_cond.items():
                self.dev[name].write(row.conds[cond], offset=r * self.row_elems[name])
            if sig.row_adapters is not None:
                scales = self.zero_scales if row.adapter_scale is None else row.adapter_scale
                self.dev[sig.row_adapters].write(scales, offset=r * self.row_elems[sig.row_adapters])
            for name, attr in sig.row_scalars.items():
                self.one[name][0] = getattr(row, attr)
                self.dev[name].write(self.one[name], offset=r)
            self.uncond_index[r] = positions[row.set_key]
            self.dev[sig.set_index].write(self.uncond_index[r : r + 1], offset=r)
            self.dev[sig.latents].write(row.latent, offset=r * latent)
            self.solver.place(row)
            self._write_keep(row)
            self.dev["add"].write(self.zero_latent, offset=r * latent)
        self.entry_rows = sum(1 for row in self.joined if given(row))

    def _always_given(self, row: Row) -> bool:
        """Whether ``row`` is in the always-given suffix (fixed while it is placed: ``skip_unguided``
        is read when it joins, so set it only while the loop is idle)."""
        return row.given is not None or (row.unguided and self.skip_unguided)

    def _write_keep(self, row: Row) -> None:
        keep = self.zero_keep if row.keep is None else row.keep.astype(np.float32)
        self.dev["keep"].write(keep, offset=row.slot * self.row_elems["keep"])
        row.keep_written = row.keep

    def _reindex(self) -> None:
        """Every placed row's set index, after the sets' layout was rewritten."""
        positions = self.uncond.positions()
        for r, row in enumerate(self.active):
            self.uncond_index[r] = positions[row.set_key]
        if self.active:
            self.dev[self.sig.set_index].write(self.uncond_index[: len(self.active)])

    def remove(self, row: Row) -> None:
        """Take ``row`` out (finished or cancelled); the last row moves into its slot."""
        if row in self.pending:
            self.pending.remove(row)
            return
        r, last = row.slot, len(self.active) - 1
        if r < 0:
            return
        if self._always_given(row):  # from the always-given suffix
            if r != last:
                self._move(last, r)
            self.persistent -= 1
        else:  # the last computing row fills the hole, the last row fills its slot
            end = last - self.persistent
            if r != end:
                self._move(end, r)
            if self.persistent and end != last:
                self._move(last, end)
        self.active.pop()
        if self._windows is not None:
            for windows in self._windows:
                windows.release(row)
        self.deep_key = None
        self.references -= row.reference
        row.slot = -1
        self.uncond.leave(row)
        if not self.active and not self.pending:
            self.uncond.clear()

    def _move(self, src: int, dst: int) -> None:
        """The row in slot ``src`` moves to slot ``dst`` (everything its slot holds)."""
        moved = self.active[src]
        for name, elems in self.row_elems.items():
            self.dev[name].move(dst * elems, src * elems, elems)
        self.uncond_index[dst] = self.uncond_index[src]
        self.active[dst] = moved
        moved.slot = dst

    def suspend(self, rows: Sequence[Row]) -> None:
        """Take ``rows`` out so that they can be admitted again where they are: each placed
        row that has run steps gets its current latent back from the backend first (rows that
        joined at this step still hold theirs). For a failed step whose graph did not run."""
        joined = {id(row) for row in self.joined}
        back = [row for row in rows if row.slot >= 0 and id(row) not in joined]
        for row in back:
            self.dev[self.sig.latents].read_async(row.latent, offset=row.slot * self.latent_elems)
            self.solver.read_history(row)
        if back:
            self._synchronize()
        for row in rows:
            self.remove(row)

    def resync(self) -> None:
        """After a failed step: keep only the sets rows use, written afresh with every index
        (a set write the failure cut short leaves nothing behind)."""
        needed = {row.set_key for row in self.active} | {row.uncond.digest for row in self.pending}
        if self.uncond.keep_only(needed):
            self._reindex()
        self.joined.clear()

    # --- the step ----------------------------------------------------------------------------

    def _prepare_rows(self, n: int, b: int, m: int) -> None:
        """Scalars of every row of the bucket, and valid indices in its padding rows."""
        sig = self.sig
        for name, attr in sig.step_scalars.items():  # the schedule's value at each row's step
            values = self.scalars[name]
            for r, row in enumerate(self.active):
                values[r] = getattr(row.schedule, attr)[row.step]
            values[n:b] = values[0]  # padding: some valid step, ignored
            self.dev[name].write(values[:b])
        self.solver.prepare(self.active, b)
        if b > n and (self.uncond_index[n:b] >= m).any():
            self.uncond_index[n:b] = 0
            self.dev[sig.set_index].write(self.uncond_index[n:b], offset=n)
        # each row's self-attention pattern: its reference's while it keeps structure, or its own
        if self.references:
            self.self_ref[:b] = np.arange(b)
            for r, row in enumerate(self.active):
                if row.ref is not None and row.step < row.structure_end and row.ref.slot >= 0:
                    self.self_ref[r] = row.ref.slot
            self.dev[sig.row_ref].write(self.self_ref[:b])
            self.refs_written = True
        elif self.refs_written:  # back to every row its own, in every slot (padding included)
            self.self_ref[:] = np.arange(self.max_rows)
            self.dev[sig.row_ref].write(self.self_ref)
            self.refs_written = False

    def _blend(self, b: int) -> None:
        """latents <- the rows' next latents, with the base's where a mask keeps it, on the device."""
        latent = self.latent_elems
        for r, row in enumerate(self.active):
            if row.keep is not row.keep_written:
                self._write_keep(row)
            if row.keep is not None and row.base is not None:  # the base's next latent, from its resident window
                window, at = self.windows.source(row)
                self.dev["base"].copy_from(window, r * latent, at, latent)
            if row.corrections is not None:
                window, at = self.corrections.source(row)
                self.dev["add"].copy_from(window, r * latent, at, latent)
        if b not in self.blend_bindings:
            self.blend_bindings[b] = bind_blend(self, b)
        self.blend_bindings[b].run()

    def step(self) -> list[Row]:
        """Advance every admitted row by one step; return the rows that finished (removed).

        A step that raises before its graph has run changes no row's step or latent (it can
        be run again without some rows: batcher.py); after, the rows' latents are unknown."""
        self.ran = False
        self._place_pending()
        n = len(self.active)
        if n == 0:
            return []
        b, m = self.bucket(n), len(self.uncond)
        # The call's last E rows take their unconditional prediction as given: rows at their
        # entry step (placed last) and the bucket's padding; all of them where the step graph
        # takes E = N, else all but one (an older export's cross-attention cannot run an empty
        # unconditional batch). With buckets E is a power of two too, so a bucket has few variants.
        fewest = 0 if self.all_given else 1  # rows of a call that compute u, at the fewest
        e = min(self.persistent or self.entry_rows, n - fewest)
        if self.buckets is None:
            given = e
        else:
            given = _floor_pow2(min(e + b - n, b - fewest))
        first_given = b - given
        self._prepare_rows(n, b, m)
        sig = self.sig
        unguided_given = 0
        if given:
            self.slopes[:given] = 0  # padding rows: any finite prediction, no slope
            for r in range(max(first_given, n - e), n):
                row = self.active[r]
                if row.unguided and self.skip_unguided:  # no u: at scale 1 the update is c exactly
                    u, slope = self.zero_latent, 0.0
                    unguided_given += 1
                elif row.given is None:  # at its entry step
                    u, slope = row.entry_uncond, 0.0
                else:
                    u, slope = row.given.at(row.step, row.schedule.alpha_t[row.step])
                self.slopes[r - first_given] = slope
                self.dev[sig.entry_uncond].write(u, offset=(r - first_given) * self.latent_elems)
            self.dev[sig.entry_slope].write(self.slopes[:given])
        # reused lists: a step allocates no object it keeps (Python's list free list would
        # otherwise hand one step's list to whatever asks next)
        wants_maps, due = self._wants_maps, self._due
        wants_maps.clear()
        due.clear()
        for row in self.active:
            if row.auto is not None and row.auto.wants_maps:
                wants_maps.append(row)
            if row.preview_due():
                due.append(row)
        maps = self.has_maps and bool(wants_maps)
        shallow = self._shallow(b, given, wants_maps)
        binding = self._binding(b, given, m, shallow)
        for row in due:
            if row.preview is None:
                row.preview = np.empty(self.latent_shape, dtype=np.float32)
        start = time.perf_counter_ns()
        binding.run()
        self.ran = True
        if maps:  # the masks grow from this step's maps before the blend uses them
            step_maps = [np.empty((self.text_len, *self.map_hw), dtype=np.float32) for _ in wants_maps]
            for row, step_map in zip(wants_maps, step_maps):
                self.dev[sig.attn_maps].read_async(step_map, offset=row.slot * self.map_elems)
            self._synchronize()
            for row, step_map in zip(wants_maps, step_maps):
                row.auto.add(step_map)
                row.keep = row.auto.keep
        self._blend(b)
        # What comes back: each generation's latent and u of this step (queued: they land at the
        # next synchronization, at the latest its own last step's, so a generation's steady step
        # does not wait on the device), each finishing row's latent (the step waits for it).
        latent = self.latent_elems
        reads = 0
        for r, row in enumerate(self.active):
            if row.record is not None:
                if row.record.uncond is not None:
                    self.dev[sig.uncond_out].read_async(row.record.uncond[row.step], offset=r * latent)
                self.dev[sig.latents].read_async(row.record.latents[row.step + 1], offset=r * latent)
                if row.record.x0 is not None:
                    self.solver.read_x0(row, row.record.x0[row.step])
            if row.step + 1 == row.end:
                self.dev[sig.latents].read_async(row.latent, offset=r * latent)
                reads += 1
        for row in due:  # the x_0 this step predicted
            self.solver.read_x0(row, row.preview)
            reads += 1
        if reads:
            self._synchronize()
        for row in due:
            row.previewed = row.step
        self.stats.nanoseconds[0] = time.perf_counter_ns() - start
        self.stats.nanoseconds[1] += self.stats.nanoseconds[0]
        for row in self.active:
            row.step += 1
        for row in self.joined:
            row.entry_uncond = None  # its entry step is done: a row admitted again computes u
        self.joined.clear()
        self.entry_rows = 0
        if shallow:
            self.deep_age += 1
        else:  # every row's features are this call's
            self.deep_key, self.deep_age = (b, given), 1
        self.stats.calls += 1
        self.stats.shallow_calls += shallow
        self.stats.map_calls += maps
        self.stats.row_steps += n
        self.stats.rows_computed += b
        self.stats.uncond_rows_skipped += max(0, n - max(first_given, n - e)) - unguided_given
        self.stats.unguided_rows_skipped += unguided_given
        for row in self.active:
            self.stats.unguided_row_steps += row.unguided
        self.stats.last_rows = n
        references = self.references  # reference rows advanced by this call
        finished = [row for row in self.active if row.step == row.end]
        for row in finished:
            self.remove(row)
        if not references:
            return finished
        # a reference row leaves with the last row that takes its structure
        self.stats.reference_steps += references
        used = {id(row.ref) for row in self.active + self.pending if row.ref is not None and row.step < row.structure_end}
        for row in [row for row in self.active if row.reference and id(row) not in used]:
            self.remove(row)
        return [row for row in finished if not row.reference]

    def _synchronize(self) -> None:
        self.graph.synchronize()
        self.stats.syncs += 1

    def free(self) -> None:
        self.bindings.free()
        for binding in self.blend_bindings.values():
            binding.free()
        self.blend_bindings.clear()
        for windows in self._windows or ():
            windows.free()
        self._windows = None
        for tensor in self.dev.values():
            tensor.free()
