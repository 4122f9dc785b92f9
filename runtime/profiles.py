"""Edit-batch profiles: the shapes an engine accepts, and the batch buckets the runtime uses.

A TensorRT engine (and the TensorRT execution provider) is built for a range of shapes per
input: ``min``/``opt``/``max``. Here every dynamic axis is a row count: ``N`` (tail rows),
``B`` (prompts being encoded), ``M`` (unconditional K/V sets); the latent size is fixed per
engine. The runtime groups calls into power-of-two buckets so that buffers (and CUDA graphs)
are made once per bucket and reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

Shape = tuple[int, ...]


@dataclass(frozen=True)
class EditBatchProfile:
    min_batch: int
    opt_batch: int
    max_batch: int
    latent_height: int
    latent_width: int

    def dims(self, which: str) -> dict[str, int]:
        """Values of the symbolic dims at ``which`` in (min, opt, max)."""
        rows = getattr(self, f"{which}_batch")
        return {
            "N": rows,
            "B": rows,
            # Unconditional K/V sets: one per negative prompt in a call, at most one per row.
            "M": 1 if which != "max" else self.max_batch,
            "H": self.latent_height,
            "W": self.latent_width,
            # vae_decoder's image size is fixed by the latent size; it is an output only.
        }

    def shapes(self, inputs: Sequence[Any]) -> dict[str, tuple[Shape, Shape, Shape]]:
        """(min, opt, max) shape of each input spec (``.name``, ``.shape`` with symbolic dims)."""
        out = {}
        for spec in inputs:
            out[spec.name] = tuple(
                tuple(self.dims(which)[d] if isinstance(d, str) else int(d) for d in spec.shape)
                for which in ("min", "opt", "max")
            )
        return out

    def buckets(self) -> list[int]:
        """Power-of-two row counts from 1 up to max_batch (max_batch itself included)."""
        sizes, b = [], 1
        while b < self.max_batch:
            sizes.append(b)
            b *= 2
        return sizes + [self.max_batch]

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket that holds ``rows`` (1 <= rows <= max_batch)."""
        if not 1 <= rows <= self.max_batch:
            raise ValueError(f"{rows} rows do not fit the profile (max_batch {self.max_batch})")
        return next(b for b in self.buckets() if b >= rows)

    def chunks(self, rows: int) -> list[range]:
        """Split ``rows`` into calls of at most max_batch rows, in order."""
        return [range(s, min(s + self.max_batch, rows)) for s in range(0, rows, self.max_batch)]


def ort_trt_profile_options(profile: EditBatchProfile, inputs: Sequence[Any]) -> dict[str, str]:
    """ONNX Runtime TensorRT EP provider options for ``profile`` (``trt_profile_*_shapes``)."""
    shapes = profile.shapes(inputs)
    options = {}
    for k, which in enumerate(("min", "opt", "max")):
        options[f"trt_profile_{which}_shapes"] = ",".join(
            f"{name}:{'x'.join(str(d) for d in s[k])}" for name, s in shapes.items() if len(s[k]) > 0
        )
    return options
