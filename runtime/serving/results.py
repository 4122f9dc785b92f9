"""What the service's operations answer: a generated (or inverted) base, an edit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..model.edit import Base

# What an operation streams: (kind, data). An edit request's kinds in order: "edit_rt.queue" once,
# then per row "edit_rt.progress" (and, when asked for, "edit_rt.preview": index, step, of, png)
# and one "image_edit.completed" (data: index, png, info) or "error" (data: index, error: the
# row's exception), then "edit_rt.done"; a generation's: its previews, then its result. The SSE stream
# sends them as they come; the JSON answer collects them.
Event = tuple[str, dict]


@dataclass
class Generated:
    id: str
    base: Base
    png: bytes
    seconds: float
    tier: Optional[str] = None  # the store tier that holds it ("ram", "disk")
    # Served related (serving/related.py): {"skipped_steps", "similarity"}, and "base_id" where
    # serve.related.share_bases; None: exact
    related: Optional[dict] = None


@dataclass
class Edited:
    index: int
    png: bytes
    seconds: float
    preserve: str
    tail_steps: int
    strength: float
    # The edit's directions as they ran, {prompt, strength} each (none: a plain edit)
    directions: tuple[dict, ...] = ()
    # The sampler it ran, its base's (fields.sampler_label: "euler_a (Euler a)")
    sampler: Optional[str] = None
    uncond: str = "compute"  # tail.uncond as the row ran it

    @classmethod
    def from_info(cls, index: int, png: bytes, info: dict) -> "Edited":
        """An edit from its event's ``info`` (what ``info()`` wrote)."""
        return cls(index, png, info["seconds"], info["preserve"], info["tail_steps"], info["strength"],
                   tuple(info.get("directions", ())), info.get("sampler"), info.get("uncond", "compute"))  # fmt: skip

    def info(self) -> dict:
        out = {"seconds": round(self.seconds, 4), "tail_steps": self.tail_steps, "strength": self.strength,
               "preserve": self.preserve, "uncond": self.uncond}  # fmt: skip
        if self.directions:
            out["directions"] = list(self.directions)
        if self.sampler is not None:
            out["sampler"] = self.sampler
        return out
