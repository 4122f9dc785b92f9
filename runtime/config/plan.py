"""A plan config's ``plan:`` section (issue 55): the scene, the base plan's behaviour, and the
behaviours x aggressiveness levels planned from it as one batched tail (pipeline/plans.py).

``base:`` then holds the base plan's chain (steps, guidance, seed); its prompt and size are the
plan's (load.py fills them: the scene and the base behaviour in words, the plan grid's sides).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal, Optional, get_args

import numpy as np
from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from ..errors import RequestError
from ..model import driving
from ..model.schema import Bool, Float, Int, between

Behaviour = Literal["follow", "overtake left", "brake to stop", "keep lane", "change lane"]
assert get_args(Behaviour) == driving.BEHAVIOURS
Aggressiveness = between(Float, 0.0, 1.0)
STRICT = ConfigDict(extra="forbid")


@pydantic_dataclass(frozen=True, config=STRICT)
class PlanScene:
    """driving.Scene's numbers, in its units (m, m/s), within the ranges the planner was trained on
    (driving.random_scene) or near them."""

    ego_speed: between(Float, 0.0, 30.0)
    lead_gap: between(Float, 0.0, 200.0)
    lead_speed: between(Float, 0.0, 30.0) = 0.0
    ego_y: between(Float, -1.0, 1.0) = 0.0  # the ego's offset from its lane's centre, left positive
    obstacle: Bool = False  # the lead is stopped (lead_speed 0)
    oncoming_distance: Optional[between(Float, 0.0, 1000.0)] = None  # m front to front; null: none
    oncoming_speed: between(Float, 0.0, 30.0) = 0.0

    def to_scene(self, where: str = "plan.scene") -> driving.Scene:
        if self.obstacle and self.lead_speed:
            raise RequestError(f"{where}.lead_speed: {self.lead_speed:g} for a stopped obstacle; set 0, or obstacle false",
                               f"{where}.lead_speed")  # fmt: skip
        return driving.Scene(self.ego_speed, self.ego_y, self.lead_gap, self.lead_speed, self.obstacle,
                             self.oncoming_distance, self.oncoming_speed)  # fmt: skip


@pydantic_dataclass(frozen=True, config=STRICT)
class PlanSection:
    """What `edit-rt run` plans: ``scene`` (or ``scene_seed``: driving.random_scene of that seed),
    the base plan's behaviour, and every one of ``behaviours`` at every ``aggressiveness``."""

    scene: Optional[PlanScene] = None
    scene_seed: Optional[between(Int, 0)] = None
    base_behaviour: Behaviour = "keep lane"
    base_aggressiveness: Aggressiveness = 0.5
    behaviours: Annotated[list[Behaviour], Field(min_length=1)] = dataclasses.field(default_factory=lambda: list(driving.BEHAVIOURS))
    aggressiveness: Annotated[list[Aggressiveness], Field(min_length=1)] = dataclasses.field(default_factory=lambda: [0.0, 0.5, 1.0])
    # The steps each variant re-runs; left out, half of base.steps.
    tail_steps: Optional[between(Int, 1, 1000)] = None
    # A behaviour's own tail where it needs another (one that departs from the base plan early
    # re-enters earlier); its rows still run in the same batch.
    behaviour_tails: dict[Behaviour, between(Int, 1, 1000)] = dataclasses.field(default_factory=dict)

    def the_scene(self) -> driving.Scene:
        if self.scene is not None:
            return self.scene.to_scene()
        return driving.random_scene(np.random.default_rng(self.scene_seed or 0))
