"""A catalogue: hundreds of variants of one base, asked for in a few lines.

``catalogue: {edits: [...], sliders: [...]}`` is every edit at every position of every slider,
one slider at a time (the others at the edit's own values): 20 prompts x 3 sliders x 8 positions
is 480 rows. A slider is a :class:`~.sweep.Sweep` (an adapter's scale, a direction's strength, or
the edit's own strength); no slider: each edit once. Its size is counted from the spec
(:meth:`Catalogue.size`), against ``max_rows``, before a single row is made; the rows are then
made lazily, in order (:meth:`Catalogue.rows`), so a run holds one chunk of them at a time.
A stopped run resumes when its rows are the same rows (:meth:`Catalogue.key`), whatever its
limits say. Its images are decoded by its ``decoder`` (the run's by default: pipeline/decoders.py),
which is part of what its rows are: a folder of VAE images is not resumed with the tiny decoder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Annotated, Any, Callable, Iterator, Literal, Optional

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from ..model.edit import Edit
from ..model.schema import Int, between
from ..model.sweep import Sweep, expand

# The most rows a catalogue may ask for (its own ``max_rows`` may lower it): a catalogue is
# written image by image, but its rows' labels and the resume index live in memory.
MAX_ROWS = 65536


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class Catalogue:
    """Every edit, at every position of every slider (one slider at a time)."""

    edits: Annotated[list[Edit], Field(min_length=1)]
    sliders: list[Sweep] = dataclasses.field(default_factory=list)
    # The size a catalogue may reach: counted before anything is expanded, and refused over it.
    max_rows: between(Int, 1, MAX_ROWS) = 1024
    # Rows per batched tail (0: the step loop's max_batch): one chunk's rows and images are
    # held at a time, each image written as it is decoded.
    chunk: between(Int, 0, 4096) = 0
    # What decodes its images: vae or taesd (the tiny decoder, ~6% of the VAE's cost at 512x512:
    # hundreds of images for the price of a few dozen; the export must have one). None: the
    # run's `decoder` (itself vae unless set).
    decoder: Optional[Literal["vae", "taesd"]] = None

    def size(self) -> int:
        """The rows this catalogue makes, counted from the spec."""
        return len(self.edits) * max(1, sum(s.n for s in self.sliders))

    def rows(self) -> Iterator[tuple[int, Edit]]:
        """(index, edit) of every row, in order: edit by edit, slider by slider, position by position."""
        index = 0
        for i, edit in enumerate(self.edits):
            for slider in self.sliders or [None]:
                try:
                    variants = expand(dataclasses.replace(edit, sweep=slider)) if slider is not None else [edit]
                except ValueError as err:  # a slider naming a direction the edit lacks
                    raise ValueError(f"catalogue.edits[{i}].{err}") from None
                for variant in variants:
                    yield index, variant
                    index += 1

    def key(self, identity: dict[str, Any], row: Callable[[int, Edit], Any]) -> str:
        """What a resumed run must match: ``identity`` (the base and the model) and what every
        row is (``row(index, edit)``: the row as it runs), in order. Limits that leave the rows as
        they are (``max_rows``, ``chunk``) are not in it, so raising one resumes the same rows.
        One row at a time, as :meth:`rows` makes them: a pass over 65,536 rows holds one."""
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode())
        for i, edit in self.rows():
            made = row(i, edit)
            fields = dataclasses.asdict(made) if dataclasses.is_dataclass(made) else made
            digest.update(b"\n" + json.dumps(fields, sort_keys=True, default=_content).encode())
        return digest.hexdigest()[:24]


def _content(value: Any) -> Any:
    """A row's field that JSON cannot hold, as what it holds: an array (a pixel mask) by its
    shape, type and bytes' digest, not numpy's repr, which elides the middle of a large one."""
    if hasattr(value, "tobytes") and hasattr(value, "shape"):
        return {"shape": list(value.shape), "dtype": str(value.dtype), "sha256": hashlib.sha256(value.tobytes()).hexdigest()}
    return repr(value)
