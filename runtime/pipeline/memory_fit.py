"""What fits in memory at each latent size: the rows of a step call and the images of a decode
the pipeline runs there (engine/memory.py's plan), found once per size before anything is
allocated, and the refusal of a size where not even one row fits.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from ..engine.backend import CPU_BACKENDS
from ..engine.graph_set import GraphSet
from ..engine.manifest import Manifest
from ..engine.memory import gib, memory_plan, no_row_fits
from ..errors import ConfigError
from ..model.edit import Base

log = logging.getLogger(__name__)


class MemoryFit:
    """Per latent shape, (step rows, decoded images) per call that fit in memory."""

    def __init__(self, manifest: Manifest, graph_set: GraphSet, max_memory: Optional[int]):
        """``max_memory`` the bytes the CPU path may use in all (None: what the machine has free)."""
        self.manifest = manifest
        self.graph_set = graph_set
        self.max_memory = max_memory
        self._fitting: dict[tuple[int, int, int], tuple[int, int]] = {}

    def check(self, base: Base, shape: tuple[int, int, int]) -> None:
        """The rows of a step call and the images of a decode that fit in memory at this size
        (the CPU backend's memory is the host's: memory.py counts weights and each row's
        activations), before anything is allocated; refuse the size only where not even one
        row fits (attention grows with the square of the pixels: a 512x512 base on a model
        made for 32x32 needs terabytes, and would be killed mid-run). A GPU backend's engines
        fix their size and rows (engines.py checks them). Found once per shape."""
        if shape in self._fitting:
            return
        profile, graphs, backend = self.graph_set.profile, self.graph_set.graphs, self.graph_set.backend
        rows, images = profile.max_batch, profile.vae_max_batch
        if backend in CPU_BACKENDS:
            loading = sum(int(self.manifest.data["graphs"][name].get("weight_bytes", 0)) for name, graph in graphs.items()
                          if not getattr(graph, "lazy", False) and not getattr(graph, "loaded", True))  # fmt: skip
            plan = memory_plan(self.manifest, shape[1:], self.max_memory, loading=loading, engine=backend)
            rows, images = plan.step_rows(profile.max_batch), plan.decode_rows(images)
            if rows == 0:
                scale = self.manifest.vae_scale_factor
                native = self.manifest.data["model"]["sample_size"] * scale
                raise ConfigError(no_row_fits(plan, base.width, base.height, shape[1:], native, self.max_memory is not None))
            if rows < profile.max_batch or images < profile.vae_max_batch:
                log.info("%dx%d: %d step row(s) and %d image(s) per call fit in %s (%s a row, %s an image)",
                         base.width, base.height, rows, images, gib(plan.free or 0), gib(plan.step_row),
                         gib(plan.decode_row))  # fmt: skip
        self._fitting[shape] = (rows, images)

    def step_rows(self, shape: Sequence[int]) -> Optional[int]:
        """The step rows per call that fit at ``shape`` (None: not checked)."""
        fit = self._fitting.get(tuple(shape))
        return None if fit is None else fit[0]

    def decode_images(self, shape: Sequence[int]) -> Optional[int]:
        """The decoded images per call that fit at ``shape`` (None: not checked)."""
        fit = self._fitting.get(tuple(shape))
        return None if fit is None else fit[1]
