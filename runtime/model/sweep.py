"""Slider sweeps: one edit at n positions of one slider, as n rows of the same tail.

``sweep: {adapter: name, from: -2, to: 2, n: 9}`` sweeps an adapter's scale (a concept slider),
``sweep: {direction: i, ...}`` the strength of the edit's direction i (``directions``), and a
sweep naming neither the edit's own ``strength``. The edit expands into n edits that differ only
there (:func:`expand`), each labelled with its position, before anything else sees it: every
door (config, API, page) runs a sweep as n ordinary rows of one batched tail.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
from pydantic import AliasChoices, ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from .schema import AdapterName, AdapterScale, Int, between

MAX_POINTS = 64  # one sweep's rows: a batch, not a job queue


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid", populate_by_name=True))
class Sweep:
    """n evenly spaced positions of one slider, from ``from`` to ``to`` (both included)."""

    start: AdapterScale = Field(validation_alias=AliasChoices("from", "start"))
    stop: AdapterScale = Field(validation_alias=AliasChoices("to", "stop"))
    n: between(Int, 2, MAX_POINTS) = 9
    # the adapter whose scale moves (the config's adapters:), or the index of the direction
    # whose strength does; neither: the edit's own strength
    adapter: Optional[AdapterName] = None
    direction: Optional[between(Int, 0, 63)] = None

    @model_validator(mode="after")
    def _one_slider(self) -> "Sweep":
        if self.adapter is not None and self.direction is not None:
            raise ValueError("give adapter or direction, not both")
        return self

    def positions(self) -> list[float]:
        return [round(float(v), 6) for v in np.linspace(self.start, self.stop, self.n)]

    @property
    def slider(self) -> str:
        if self.adapter is not None:
            return self.adapter
        return "strength" if self.direction is None else f"directions[{self.direction}]"


def expand(edit: Any) -> list[Any]:
    """``edit`` without its sweep, at each of the sweep's positions (itself when it has none)."""
    sweep: Optional[Sweep] = getattr(edit, "sweep", None)
    if sweep is None:
        return [edit]
    out = []
    for value in sweep.positions():
        # the position first: a grid cell shows the start of its label
        changes: dict[str, Any] = {"sweep": None, "label": f"{sweep.slider}={value:g}: {edit.label or edit.prompt or 'edit'}"}
        if sweep.adapter is not None:
            changes["adapters"] = {**(edit.adapters or {}), sweep.adapter: value}
        elif sweep.direction is not None:
            directions = list(edit.directions or ())
            if sweep.direction >= len(directions):
                raise ValueError(f"sweep.direction: {sweep.direction} names no direction (the edit has {len(directions)})")
            directions[sweep.direction] = dataclasses.replace(directions[sweep.direction], strength=value)
            changes["directions"] = directions
        else:
            changes["strength"] = value
        out.append(dataclasses.replace(edit, **changes))
    return out


def rows_of(edits: list[Any]) -> int:
    """The rows :func:`expand_all` would make of ``edits``, without making them: what a
    request's limit is checked against before anything expands."""
    return sum(1 if getattr(edit, "sweep", None) is None else edit.sweep.n for edit in edits)


def expand_all(edits: list[Any], where: str = "edits") -> list[Any]:
    """Every edit's sweep expanded, in order; a sweep that names no direction is refused with
    its index (``edits[2].sweep.direction``)."""
    out = []
    for i, edit in enumerate(edits):
        try:
            out += expand(edit)
        except ValueError as err:
            raise ValueError(f"{where}[{i}].{err}") from None
    return out
