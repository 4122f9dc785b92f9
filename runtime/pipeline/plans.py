"""The plan-edit-evaluate loop (issue 55): a scene's base plan generated once around what a
planner knows, every behaviour x aggressiveness as rows of one batched tail of it, each plan
judged, the best chosen.

A planner is an export whose latent is a plan (model/plan_grid.py: the trajectory's 64 steps as
an 8 x 8 grid, the scene's numbers in two rows below; export/world/plan_model.py builds it).
Nothing here is a new kind of run: the base is :meth:`EditPipeline.generate_base` with ``known``
(the present and the scene kept, as diffusers' inpainting keeps them), the variants are edit rows
of it with the same mask (their prompts the scene's words with another behaviour: a behaviour
edit is a prompt edit of a word or two), so every plan keeps the present and the scene exactly,
and the variants cost ``tail_steps`` rows each, not ``steps``. A plan is read from its final latent
as a vehicle can drive it (model/plan_grid.py ``plan_of``: speed never negative, x its integral, no
sideways move while stopped) before it is judged.

The choice (:func:`choice_key`): a plan that does what it was asked without collision on the road
(the judge's ``success``, model/driving.py) ranks above any that does not; among those, the one
with the most progress less its discomfort (``ACCEL_COST`` metres per m/s^2 of peak acceleration,
``JERK_COST`` per m/s^3 of peak jerk); the caller gets every score and decides otherwise if it
wants.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np

from ..config.run_config import RunConfig
from ..errors import ConfigError, RequestError
from ..model import driving
from ..model.edit import Base, TailRow
from ..model.plan_grid import HEIGHT, WIDTH, known, plan_of, present
from ..model.samplers import IMAGE_SAMPLER
from ..model.state import BaseState
from .edit_pipeline import EditPipeline

ACCEL_COST = 2.0  # m of progress a plan gives up per m/s^2 of its peak acceleration
JERK_COST = 0.2  # and per m/s^3 of its peak jerk


@dataclass(frozen=True)
class Variant:
    """One behaviour at one aggressiveness in [0, 1] (the prompt bins it: driving.AGGRESSIVENESS_WORDS)."""

    behaviour: str
    aggressiveness: float = 0.5

    def check(self, field_name: str) -> "Variant":
        if self.behaviour not in driving.BEHAVIOURS:
            raise ConfigError(f"{field_name}.behaviour: {self.behaviour!r} is not a behaviour; one of "
                              f"{', '.join(driving.BEHAVIOURS)}")  # fmt: skip
        if not 0.0 <= self.aggressiveness <= 1.0:
            raise ConfigError(f"{field_name}.aggressiveness: {self.aggressiveness:g} is outside [0, 1]")
        return self

    @property
    def label(self) -> str:
        return f"{self.behaviour} {self.aggressiveness:g}"


@dataclass
class JudgedPlan:
    """A plan, its trajectory ([STEPS, 3]: x, y, speed) and the judge's scores."""

    variant: Variant
    trajectory: np.ndarray
    scores: dict

    @property
    def utility(self) -> float:
        s = self.scores
        return s["progress"] - ACCEL_COST * s["peak_accel"] - JERK_COST * s["peak_jerk"]

    def as_dict(self) -> dict:
        return {"behaviour": self.variant.behaviour, "aggressiveness": self.variant.aggressiveness,
                "label": self.variant.label, "utility": round(self.utility, 4), "scores": self.scores,
                "trajectory": self.trajectory.tolist()}  # fmt: skip


def choice_key(plan: JudgedPlan) -> tuple:
    """Sorts plans best last: success first, then utility (module docstring)."""
    return (plan.scores["success"], plan.utility)


@dataclass
class PlanOutcome:
    """One loop: the base plan, the variants in the order asked, the index of the best variant,
    and what it cost (seconds per stage, UNet rows run)."""

    scene: driving.Scene
    base: JudgedPlan
    variants: list[JudgedPlan]
    best: int
    base_source: str  # "generated" or "kept" (the loop's store of base plans)
    seconds: dict[str, float] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"scene": dataclasses.asdict(self.scene), "base": self.base.as_dict(),
                "variants": [v.as_dict() for v in self.variants], "best": self.best,
                "best_label": self.variants[self.best].variant.label, "base_source": self.base_source,
                "seconds": {k: round(v, 6) for k, v in self.seconds.items()}, "unet_rows": self.rows}  # fmt: skip

    def picture(self):
        """The road with the base and every variant, labelled (driving.draw), the best marked."""
        traces = {f"base: {self.base.variant.label}": self.base.trajectory}
        for k, v in enumerate(self.variants):
            mark = " (best)" if k == self.best else ("" if v.scores["success"] else " (fails)")
            traces[v.variant.label + mark] = v.trajectory
        return driving.draw(self.scene, traces)


def known_key(latent: np.ndarray) -> str:
    """``Base.known`` of a plan: what it keeps, hashed."""
    return "sha256:" + hashlib.sha256(np.ascontiguousarray(latent, dtype=np.float32).tobytes()).hexdigest()


class PlanLoop:
    """The loop on a planner's pipeline. ``steps``, ``guidance`` and ``seed``: the base plan's
    chain (DDIM, as its training's scheduler); ``tail_steps``: the steps each variant re-runs,
    ``behaviour_tails`` a behaviour's own where it needs another (one that departs from the base
    plan early, as an overtake from a kept lane, re-enters earlier; its rows still run in the same
    batch); ``keep_bases``: base plans kept in memory (least recently used out), so a scene planned
    again starts from its stored base."""

    def __init__(self, pipe: EditPipeline, steps: int = 20, guidance: float = 3.0, tail_steps: int = 10, seed: int = 0,
                 keep_bases: int = 64, behaviour_tails: Optional[Mapping[str, int]] = None):  # fmt: skip
        shape = tuple(pipe.latent_shape(Base("", width=WIDTH, height=HEIGHT)))
        if shape[1:] != (HEIGHT, WIDTH):
            raise ConfigError(f"model: its latent is {list(shape)}, not a plan's [4, {HEIGHT}, {WIDTH}]; a planner is "
                              "made by `make train-planner` (export/world/plan_model.py)")  # fmt: skip
        self.pipe, self.steps, self.guidance, self.seed = pipe, steps, guidance, seed
        self.tail_steps = self._checked(tail_steps, "plan.tail_steps")
        self.behaviour_tails = {b: self._checked(t, f"plan.behaviour_tails.{b}") for b, t in (behaviour_tails or {}).items()}
        self.mask = known()
        self.keep_bases = keep_bases
        self._bases: OrderedDict[str, BaseState] = OrderedDict()
        self._lock = threading.Lock()  # the server runs loops from several request threads

    def _checked(self, tail: int, field_name: str) -> int:
        if not 1 <= tail <= self.steps:
            raise RequestError(f"{field_name}: {tail} is outside [1, steps = {self.steps}]", field_name, "out_of_range")
        return tail

    def tail_of(self, variant: Variant, tail_steps: Optional[int] = None) -> int:
        """The steps ``variant`` re-runs: ``tail_steps`` for every variant where given, else its
        behaviour's own, else the loop's."""
        if tail_steps is not None:
            return tail_steps
        return self.behaviour_tails.get(variant.behaviour, self.tail_steps)

    def base_of(self, scene: driving.Scene, variant: Variant, seed: Optional[int] = None) -> Base:
        """The base plan's generation: the scene and behaviour in words, what it keeps hashed."""
        return Base(driving.prompt(scene, variant.behaviour, variant.aggressiveness), negative_prompt="",
                    seed=self.seed if seed is None else seed, steps=self.steps, guidance=self.guidance, width=WIDTH,
                    height=HEIGHT, sampler=IMAGE_SAMPLER, known=known_key(present(scene)))  # fmt: skip

    def base_plan(self, scene: driving.Scene, variant: Variant, seed: Optional[int] = None) -> tuple[BaseState, str]:
        """The base plan's state and where it came from ("kept": planned before, "generated")."""
        base = self.base_of(scene, variant.check("base"), seed)
        key = repr(base)
        with self._lock:
            state = self._bases.get(key)
            if state is not None:
                self._bases.move_to_end(key)
                return state, "kept"
        state = self.pipe.generate_base(base, known=present(scene), pixel_mask=self.mask)
        with self._lock:
            self._bases[key] = state
            while len(self._bases) > self.keep_bases:
                self._bases.popitem(last=False)
        return state, "generated"

    def rows(self, scene: driving.Scene, variants: Sequence[Variant], tail_steps: Optional[int] = None) -> list[TailRow]:
        """Each variant as an edit row of the base plan: its words, the mask keeping the present
        and the scene, re-entering its tail's steps before the end (:meth:`tail_of`)."""
        return [TailRow(driving.prompt(scene, v.behaviour, v.aggressiveness), 1.0, self.steps - self.tail_of(v, tail_steps),
                        self.guidance, pixel_mask=self.mask) for v in variants]  # fmt: skip

    def run(self, scene: driving.Scene, variants: Sequence[Variant], base: Variant = Variant("keep lane"),
            tail_steps: Optional[int] = None, seed: Optional[int] = None) -> PlanOutcome:  # fmt: skip
        """The loop: the base plan (kept or generated), every variant as one batched tail, each
        judged. ``tail_steps``: every variant's tail (the loop's own per behaviour if None)."""
        if not variants:
            raise ConfigError("plan.behaviours: no variant to plan; name at least one behaviour")
        variants = [v.check(f"variants[{k}]") for k, v in enumerate(variants)]
        if tail_steps is not None:
            self._checked(tail_steps, "tail_steps")
        t0 = time.perf_counter()
        state, source = self.base_plan(scene, base, seed)
        t1 = time.perf_counter()
        latents = self.pipe.run_tail(state, self.rows(scene, variants, tail_steps))
        t2 = time.perf_counter()
        judged = [self.judged(scene, v, latent) for v, latent in zip(variants, latents)]
        base_plan = self.judged(scene, base, state.final_latent[0])
        best = max(range(len(judged)), key=lambda k: choice_key(judged[k]))
        t3 = time.perf_counter()
        seconds = {"base": t1 - t0, "variants": t2 - t1, "judge": t3 - t2, "total": t3 - t0}
        rows = {"base": self.steps if source == "generated" else 0,
                "variants": sum(self.tail_of(v, tail_steps) for v in variants)}  # fmt: skip
        return PlanOutcome(scene, base_plan, judged, best, source, seconds, rows)

    @classmethod
    def of_config(cls, pipe: EditPipeline, cfg: RunConfig) -> "PlanLoop":
        """The loop a plan config (``plan:``) asks for: its base's chain, its tails (half of
        ``base.steps`` where it sets none)."""
        b, p = cfg.base, cfg.plan
        return cls(pipe, b.steps, b.guidance, p.tail_steps or max(1, b.steps // 2), b.seed, behaviour_tails=p.behaviour_tails)

    @staticmethod
    def judged(scene: driving.Scene, variant: Variant, latent: np.ndarray) -> JudgedPlan:
        trajectory = plan_of(latent)
        return JudgedPlan(variant, trajectory, driving.judge(scene, trajectory, variant.behaviour))
