"""edit-rt's planner route (issue 55): ``POST /v1/plans`` takes a scene and the behaviours to plan,
and answers every plan as JSON (trajectories, the judge's scores, the best). Served by a planner's
config (``plan:``; configs/plan.yaml): the base plan of a scene is generated once and kept, every
variant is a row of one batched tail of it (pipeline/plans.py)."""

from __future__ import annotations

from typing import Annotated, Optional

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from ..config.plan import Aggressiveness, Behaviour, PlanScene
from ..model import driving
from ..pipeline.plans import Variant
from .api import errors
from .dependencies import ServiceDep

router = APIRouter()


class PlansRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scene: PlanScene = Field(description="The scene, in m and m/s (ego_speed, ego_y, lead_gap, lead_speed, obstacle, "
                                         "oncoming_distance, oncoming_speed).")  # fmt: skip
    behaviours: Annotated[list[Behaviour], Field(min_length=1)] = Field(default_factory=lambda: list(driving.BEHAVIOURS))
    aggressiveness: Annotated[list[Aggressiveness], Field(min_length=1)] = Field(default_factory=lambda: [0.0, 0.5, 1.0])
    base_behaviour: Behaviour = "keep lane"
    base_aggressiveness: Aggressiveness = 0.5
    tail_steps: Optional[int] = Field(None, description="The steps each variant re-runs (the server's plan.tail_steps).")
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1, description="The base plan's seed (the server's base.seed).")


class PlansResponse(BaseModel):
    scene: dict
    base: dict
    variants: list[dict]
    best: int
    best_label: str
    base_source: str
    seconds: dict[str, float]
    unet_rows: dict[str, int]


@router.post("/v1/plans", response_model=PlansResponse, responses=errors(400, 401, 413, 429, 503),
             summary="Plan a scene: its base plan once, every behaviour x aggressiveness as one batched tail, judged")  # fmt: skip
async def plans(body: PlansRequest, service: ServiceDep):
    scene = body.scene.to_scene("scene")
    variants = [Variant(b, a) for b in body.behaviours for a in body.aggressiveness]
    outcome = await service.plan(scene, variants, Variant(body.base_behaviour, body.base_aggressiveness), body.tail_steps,
                                 body.seed)  # fmt: skip
    return outcome.as_dict()
