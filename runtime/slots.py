"""The step loop's one scheduler: rows in resident slots, one ``unet_step`` call per step.

Every ``unet_step`` call of edit-rt goes through :meth:`RowScheduler.step`: base generations,
the edit tails of ``edit-rt run``, the server's batches and the bench. A :class:`Row` carries
its own schedule, step, guidance, K/V and negative prompt, so rows of any base, start step and
request share a call; they join and leave at step boundaries.

Where things live (see backend.py for the memory):

- a row is *admitted* into a slot: its K/V, guidance and negative-prompt index are written into
  the backend's memory once; a step writes only the per-row step scalars and the latents
  (the host keeps the latents: masks blend there, generations record there);
- the negative prompts' K/V are resident once per distinct set (keyed by their values, so an
  int8-stored copy and a fresh encoding of one prompt are two sets), laid side by side;
- a binding (graph inputs and outputs bound by address) is made per bucket (rows, rows at
  their entry step, negative-prompt sets) and kept in a bounded LRU; evicting frees it;
- a row at its entry step re-enters its base's chain at x_s, whose unconditional prediction the
  base kept: it is passed in (``uncond_given``) and the UNet skips that half-row;
- a row with ``preserve: auto`` collects cross-attention maps over its first steps: those calls
  run the ``unet_step_maps`` variant (same slots, plus the ``attn_maps`` output), every other
  call the plain graph, which pays nothing for maps.

Rows leave by swap-with-last: the last slot's row moves into the freed slot (one slot copy in
backend memory per leave, never per step), so the active rows are always the prefix ``[:n]``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .automask import AutoMask
from .backend import Binding, Graph
from .device import DeviceTensor, TensorView
from .scheduler_ddim import DDIMSchedule
from .state import KV, BaseState

log = logging.getLogger(__name__)

STEP_SCALARS = ("timestep", "alpha_t", "alpha_prev")


@dataclass
class Recording:
    """What a generation row keeps: x_0..x_T and the unconditional prediction of each step."""

    latents: np.ndarray  # [T + 1, c, h, w]
    uncond: np.ndarray  # [T, c, h, w]


@dataclass(eq=False)
class Row:
    """One row of the step loop: an edit's tail or a base's generation."""

    schedule: DDIMSchedule
    step: int  # the step this row runs next (its entry step until it has run one)
    latent: np.ndarray  # [c, h, w]: x at ``step`` on admission; x_T when it finishes
    guidance: float
    kv: Sequence[np.ndarray]  # the row's K/V, one per step-graph K/V input, batch axis dropped
    uncond: KV  # its negative prompt's K/V (B = 1)
    entry_uncond: Optional[np.ndarray] = None  # [c, h, w]: u at the entry step, when the base kept it
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
    slot: int = field(default=-1, init=False)
    set_key: str = field(default="", init=False)

    @property
    def end(self) -> int:
        return self.schedule.num_inference_steps if self.stop is None else self.stop


@dataclass
class _Set:
    kv: KV
    users: int = 0


@dataclass
class SchedulerStats:
    calls: int = 0
    map_calls: int = 0  # calls on the maps variant (some row still collecting its auto mask)
    reference_steps: int = 0  # reference rows advanced (structure keeping's extra rows)
    row_steps: int = 0  # rows advanced by one step, summed over calls
    uncond_rows_skipped: int = 0  # half-rows not computed thanks to entry-step reuse
    bindings_made: int = 0
    bindings_freed: int = 0
    set_writes: int = 0  # rewrites of the negative-prompt sets (new or dropped sets)
    last_rows: int = 0
    last_joined: int = 0  # rows placed into slots at the start of the last call
    last_seconds: float = 0.0


class RowScheduler:
    """Resident slots for up to ``max_rows`` rows and ``max_sets`` negative prompts."""

    def __init__(
        self,
        graph: Graph,
        roles: Mapping[str, str],
        specs: Mapping[str, Sequence[Any]],
        latent_shape: tuple[int, int, int],
        max_rows: int,
        max_sets: int,
        text_len: int,
        reuse_entry: bool = True,
        max_bindings: int = 64,
        maps_graph: Optional[Graph] = None,
        map_hw: tuple[int, int] = (0, 0),
    ):
        """``roles``/``specs`` come from the manifest's ``unet_step`` entry: each input's role and
        its shape with symbolic dims (N rows, E entry rows, S negative-prompt tokens).
        ``maps_graph`` is the ``unet_step_maps`` variant (the same inputs, plus the ``attn_maps``
        output: [77, *map_hw] per row), run on a step where a row collects its mask."""
        self.graph = graph
        self.maps_graph = maps_graph
        self.map_hw = tuple(map_hw)
        self.roles = dict(roles)
        self.specs = {name: list(shape) for name, shape in specs.items()}
        self.latent_shape = tuple(latent_shape)
        self.max_rows = max_rows
        self.max_sets = max_sets
        self.text_len = text_len
        self.reuse_entry = reuse_entry
        self.max_bindings = max_bindings
        self.stats = SchedulerStats()
        self.active: list[Row] = []
        self.pending: list[Row] = []
        self.sets: OrderedDict[str, _Set] = OrderedDict()
        self.entry_rows = 0  # trailing active rows whose u is given at this step
        self.references = 0  # active reference rows (structure keeping)
        self.bindings: OrderedDict[tuple[bool, int, int, int], Binding] = OrderedDict()

        latent_elems = math.prod(self.latent_shape)
        self.row_kv = [n for n, r in self.roles.items() if r == "row_kv"]
        self.set_kv = [n for n, r in self.roles.items() if r == "set_kv"]
        # the family's conditioning: input name -> its cond's name (roles "row_cond:<cond>", "set_cond:<cond>")
        self.row_cond = {n: r.split(":", 1)[1] for n, r in self.roles.items() if r.startswith("row_cond:")}
        self.set_cond = {n: r.split(":", 1)[1] for n, r in self.roles.items() if r.startswith("set_cond:")}
        # Per-row element counts of everything a slot holds (moved together on a leave).
        self.row_elems: dict[str, int] = {"guidance": 1, "uncond_index": 1}
        for name in [*self.row_kv, *self.row_cond]:
            self.row_elems[name] = math.prod(self.specs[name][1:])
        # The host's side: latents (authoritative between steps) and the per-step scalars.
        self.latents = np.zeros((max_rows, *self.latent_shape), dtype=np.float32)
        self.scalars = {name: np.zeros(max_rows, dtype=np.float32) for name in STEP_SCALARS}
        self.uncond_index = np.zeros(max_rows, dtype=np.int64)
        self.self_ref = np.arange(max_rows, dtype=np.int64)
        self.one = {"guidance": np.zeros(1, dtype=np.float32), "uncond_index": np.zeros(1, dtype=np.int64)}
        # The backend's side.
        alloc = graph.allocate
        self.dev: dict[str, DeviceTensor] = {
            "latents": alloc(max_rows * latent_elems, np.float32),
            "uncond_given": alloc(max_rows * latent_elems, np.float32),
            "next_latents": alloc(max_rows * latent_elems, np.float32),
            "uncond_out": alloc(max_rows * latent_elems, np.float32),
            "guidance": alloc(max_rows, np.float32),
            "uncond_index": alloc(max_rows, np.int64),
            **{name: alloc(max_rows, np.float32) for name in STEP_SCALARS},
            **{name: alloc(max_rows * self.row_elems[name], np.float32) for name in self.row_kv},
            **{name: alloc(max_sets * self._set_elems(name), np.float32) for name in self.set_kv},
            **{name: alloc(max_rows * self.row_elems[name], np.float32) for name in self.row_cond},
            **{name: alloc(max_sets * math.prod(self.specs[name][1:]), np.float32) for name in self.set_cond},
        }
        self.latent_elems = latent_elems
        self.map_elems = text_len * math.prod(self.map_hw)
        if maps_graph is not None:
            self.dev["attn_maps"] = alloc(max_rows * self.map_elems, np.float32)
        self.dev["self_ref"] = alloc(max_rows, np.int64)
        self.dev["self_ref"].write(self.self_ref)  # every row its own reference until one keeps structure
        self.refs_written = False

    # --- shapes ------------------------------------------------------------------------------

    def _set_elems(self, name: str) -> int:
        return math.prod(self.text_len if d == "S" else d for d in self.specs[name])

    def _set_shape(self, name: str, sets: int) -> tuple[int, ...]:
        return tuple(sets * self.text_len if d == "S" else d for d in self.specs[name])

    def _binding(self, maps: bool, n: int, e: int, m: int) -> Binding:
        key = (maps, n, e, m)
        binding = self.bindings.get(key)
        if binding is not None:
            self.bindings.move_to_end(key)
            return binding
        latent = lambda rows: (rows, *self.latent_shape)  # noqa: E731
        views: dict[str, TensorView] = {
            "latents": self.dev["latents"].view(latent(n)),
            "uncond_given": self.dev["uncond_given"].view(latent(e)),
            "guidance": self.dev["guidance"].view((n,)),
            "uncond_index": self.dev["uncond_index"].view((n,)),
            **{name: self.dev[name].view((n,)) for name in STEP_SCALARS},
            **{name: self.dev[name].view((n, *self.specs[name][1:])) for name in self.row_kv},
            **{name: self.dev[name].view(self._set_shape(name, m)) for name in self.set_kv},
            **{name: self.dev[name].view((n, *self.specs[name][1:])) for name in self.row_cond},
            **{name: self.dev[name].view((m, *self.specs[name][1:])) for name in self.set_cond},
            "self_ref": self.dev["self_ref"].view((n,)),
        }
        outputs = {name: self.dev[name].view(latent(n)) for name in ("next_latents", "uncond_out")}
        graph = self.graph
        if maps:
            graph = self.maps_graph
            outputs["attn_maps"] = self.dev["attn_maps"].view((n, self.text_len, *self.map_hw))
        binding = graph.bind({name: views[name] for name in self.roles if name in views}, outputs)
        self.stats.bindings_made += 1
        self.bindings[key] = binding
        while len(self.bindings) > self.max_bindings:
            _, old = self.bindings.popitem(last=False)
            old.free()
            self.stats.bindings_freed += 1
        return binding

    # --- admission ---------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return self.max_rows - len(self.active) - len(self.pending)

    def can_admit(self, row: Row) -> bool:
        """A free slot, and room for the row's negative prompt among the call's sets."""
        if self.free_slots <= 0:
            return False
        needed = {k for k, s in self.sets.items() if s.users} | {r.uncond.digest for r in self.pending}
        return len(needed | {row.uncond.digest}) <= self.max_sets

    def admit(self, row: Row) -> None:
        """Queue ``row`` for the next step (its slot is written when that step starts)."""
        if not self.can_admit(row):
            raise RuntimeError("no free slot or negative-prompt set for this row; check can_admit() first")
        self.pending.append(row)

    def _place_pending(self) -> None:
        self.stats.last_joined = len(self.pending)
        # Rows whose u is given go last: the graph takes them as the call's last E rows.
        given = lambda row: self.reuse_entry and row.entry_uncond is not None  # noqa: E731
        self.pending.sort(key=given)
        new = [row for row in self.pending if row.uncond.digest not in self.sets]
        if new:
            for key in [k for k, s in self.sets.items() if not s.users]:
                del self.sets[key]
            for row in new:
                self.sets.setdefault(row.uncond.digest, _Set(row.uncond))
            self._write_sets()
        positions = {key: k for k, key in enumerate(self.sets)}
        for row in self.pending:
            self.references += row.reference
            row.set_key = row.uncond.digest
            self.sets[row.set_key].users += 1
            r = row.slot = len(self.active)
            self.active.append(row)
            for name, kv in zip(self.row_kv, row.kv):
                self.dev[name].write(kv, offset=r * self.row_elems[name])
            for name, cond in self.row_cond.items():
                self.dev[name].write(row.conds[cond], offset=r * self.row_elems[name])
            self.one["guidance"][0] = max(row.guidance, 1.0)  # <= 1: no CFG (diffusers), = cond alone
            self.dev["guidance"].write(self.one["guidance"], offset=r)
            self.uncond_index[r] = positions[row.set_key]
            self.dev["uncond_index"].write(self.uncond_index[r : r + 1], offset=r)
            self.latents[r] = row.latent
        self.entry_rows = sum(1 for row in self.pending if given(row))
        self.pending.clear()

    def _write_sets(self) -> None:
        """Lay the resident sets side by side on the token axis and re-index every row."""
        for j, name in enumerate(self.set_kv):
            axis = self.specs[name].index("S")
            self.dev[name].write(np.concatenate([s.kv.tensors[j][0] for s in self.sets.values()], axis=axis))
        for name, cond in self.set_cond.items():  # [sets, dim]: one row per set
            self.dev[name].write(np.concatenate([s.kv.extras[cond] for s in self.sets.values()]))
        positions = {key: k for k, key in enumerate(self.sets)}
        for r, row in enumerate(self.active):
            self.uncond_index[r] = positions[row.set_key]
        if self.active:
            self.dev["uncond_index"].write(self.uncond_index[: len(self.active)])
        self.stats.set_writes += 1

    def remove(self, row: Row) -> None:
        """Take ``row`` out (finished or cancelled); the last row moves into its slot."""
        if row in self.pending:
            self.pending.remove(row)
            return
        r, last = row.slot, len(self.active) - 1
        if r < 0:
            return
        if r != last:
            moved = self.active[last]
            for name, elems in self.row_elems.items():
                self.dev[name].move(r * elems, last * elems, elems)
            self.latents[r] = self.latents[last]
            self.uncond_index[r] = self.uncond_index[last]
            self.active[r] = moved
            moved.slot = r
        self.active.pop()
        self.references -= row.reference
        row.slot = -1
        self.sets[row.set_key].users -= 1
        if not self.active and not self.pending:
            self.sets.clear()  # idle: the next rows start with only their own sets

    # --- the step ----------------------------------------------------------------------------

    def step(self) -> list[Row]:
        """Advance every admitted row by one step; return the rows that finished (removed)."""
        self._place_pending()
        n = len(self.active)
        if n == 0:
            return []
        # At least one unconditional row is computed: ONNX Runtime's MatMul cannot broadcast
        # the negative prompts' K/V over an empty batch.
        e = min(self.entry_rows, n - 1)
        for r, row in enumerate(self.active):
            for name in STEP_SCALARS:
                self.scalars[name][r] = getattr(row.schedule, "timesteps" if name == "timestep" else name)[row.step]
        self.dev["latents"].write(self.latents[:n])
        for name in STEP_SCALARS:
            self.dev[name].write(self.scalars[name][:n])
        for j, row in enumerate(self.active[n - e :]):
            self.dev["uncond_given"].write(row.entry_uncond, offset=j * self.latent_elems)
        maps = self.maps_graph is not None and any(row.auto is not None and row.auto.wants_maps for row in self.active)
        if self.references:  # each row's self-attention pattern: its reference's, or its own
            self.self_ref[:n] = np.arange(n)
            for r, row in enumerate(self.active):
                if row.ref is not None and row.step < row.structure_end and row.ref.slot >= 0:
                    self.self_ref[r] = row.ref.slot
            self.dev["self_ref"].write(self.self_ref[:n])
            self.refs_written = True
        elif self.refs_written:  # back to every row its own, in every slot
            self.self_ref[:] = np.arange(self.max_rows)
            self.dev["self_ref"].write(self.self_ref)
            self.refs_written = False
        binding = self._binding(maps, n, e, len(self.sets))
        start = time.perf_counter()
        binding.run()
        self.stats.last_seconds = time.perf_counter() - start
        self.dev["next_latents"].read(self.latents[:n])
        for r, row in enumerate(self.active):
            if maps and row.auto is not None and row.auto.wants_maps:
                step_map = np.empty((self.text_len, *self.map_hw), dtype=np.float32)
                self.dev["attn_maps"].read(step_map, offset=r * self.map_elems)
                row.auto.add(step_map)
                row.keep = row.auto.keep
            if row.corrections is not None:
                np.add(self.latents[r], row.corrections.correction(row.step), out=self.latents[r])
            if row.record is not None:
                self.dev["uncond_out"].read(row.record.uncond[row.step], offset=r * self.latent_elems)
                row.record.latents[row.step + 1] = self.latents[r]
            elif row.keep is not None:
                np.copyto(self.latents[r], row.base.latent(row.step + 1)[0], where=row.keep)
            row.step += 1
        self.entry_rows = 0
        self.stats.calls += 1
        self.stats.map_calls += maps
        self.stats.row_steps += n
        self.stats.uncond_rows_skipped += e
        self.stats.last_rows = n
        references = self.references  # reference rows advanced by this call
        finished = [row for row in self.active if row.step == row.end]
        for row in finished:
            row.latent[...] = self.latents[row.slot]
            self.remove(row)
        if not references:
            return finished
        # a reference row leaves with the last row that takes its structure
        self.stats.reference_steps += references
        used = {id(row.ref) for row in self.active + self.pending if row.ref is not None and row.step < row.structure_end}
        for row in [row for row in self.active if row.reference and id(row) not in used]:
            self.remove(row)
        return [row for row in finished if not row.reference]

    def free(self) -> None:
        for binding in self.bindings.values():
            binding.free()
        self.bindings.clear()
        for tensor in self.dev.values():
            tensor.free()
