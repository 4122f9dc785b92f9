"""Edit-batch profiles: the shapes an engine accepts.

A TensorRT engine (and the TensorRT execution provider) is built for a range of shapes per
input: ``min``/``opt``/``max``. Here every dynamic axis is a count: ``N`` (rows of a step),
``B`` (prompts being encoded), ``U`` (a step's UNet rows, 2N - E), ``E`` (rows whose unconditional prediction is given: at
their entry step, taking the base's, or unguided), ``S`` (tokens of the negative prompts' K/V sets, 77 per set), ``M`` (those sets, where a family
has per-set values besides K/V: SDXL's pooled embedding); the latent size is
fixed per engine. The runtime binds each shape it runs once and reuses the binding (and its
CUDA graph) for every later step of that shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

Shape = tuple[int, ...]
TEXT_LEN = 77  # CLIP's context: every negative prompt's set is 77 tokens


@dataclass(frozen=True)
class EditBatchProfile:
    min_batch: int
    opt_batch: int
    max_batch: int
    latent_height: int
    latent_width: int
    # Distinct negative prompts one step may mix (each adds 77 tokens to every unconditional
    # row's cross-attention): the server waits to admit a row whose set would pass it.
    max_sets: int = 4
    # Image pixels per latent pixel (the VAE's factor): vae_encoder takes images, not latents.
    vae_scale: int = 1
    # Rows per VAE call: its activations at full image size dwarf the UNet's per row (SDXL at
    # 1024x1024: ~3 GB a row in fp16), so it has its own, smaller profile; decode chunks by it.
    vae_max_batch: int = 8
    # More latent sizes (height, width) the engines serve (engines.sizes): a TensorRT plan has
    # one optimization profile per size, each fixed in its spatial dims; ONNX Runtime's graphs
    # take any size.
    extra_sizes: tuple = ()
    # The step graph's LoRA slots and rank (manifest "adapters"): its slot axes P (slots) and R
    # (slots x rank) run at 0 (a call no row of which uses an adapter) or at all of them.
    adapter_slots: int = 0
    adapter_rank: int = 0
    # The step graphs take E = N (manifest ``step_all_given``): a call may give every row its
    # unconditional prediction, so E reaches max_batch and U (2N - E) comes down to N. False:
    # an export whose calls keep one row computing it (E < N, U >= N + 1).
    step_all_given: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_sizes", tuple(tuple(int(d) for d in size) for size in self.extra_sizes))  # from JSON: lists

    def latent_sizes(self) -> list[tuple[int, int]]:
        """Every served latent size, (height, width): the profile's own first."""
        return [(self.latent_height, self.latent_width), *[s for s in self.extra_sizes if s != (self.latent_height, self.latent_width)]]

    def at(self, size: tuple[int, int]) -> "EditBatchProfile":
        """This profile at one latent size (one TensorRT optimization profile)."""
        return replace(self, latent_height=size[0], latent_width=size[1], extra_sizes=())

    def rows(self, which: str, graph: str = "") -> int:
        rows = getattr(self, f"{which}_batch")
        if graph.startswith(("vae_", "taesd_")):
            rows = min(rows, self.vae_max_batch)
        return rows

    def dims(self, which: str, graph: str = "") -> dict[str, int]:
        """Values of the symbolic dims at ``which`` in (min, opt, max) for ``graph``."""
        rows = self.rows(which, graph)
        return {
            "N": rows,
            "B": rows,
            # Rows given their unconditional prediction: all of them where the step graph takes
            # E = N, else all but one.
            "E": 0 if which != "max" else (self.max_batch if self.step_all_given else self.max_batch - 1),
            # A step's UNet rows, 2N - E (deep_out, a shallow step's deep features): N at the
            # fewest (every row given; N + 1 where one row still computes), 2N at opt and max
            "U": {"min": rows if self.step_all_given else rows + 1, "opt": 2 * rows, "max": 2 * rows}[which],
            "S": TEXT_LEN * (1 if which != "max" else self.max_sets),
            "M": 1 if which != "max" else self.max_sets,  # the sets' other per-prompt values (SDXL)
            "P": 0 if which == "min" else self.adapter_slots,
            "R": 0 if which == "min" else self.adapter_slots * self.adapter_rank,
            "H": self.latent_height,
            "W": self.latent_width,
            "IH": self.latent_height * self.vae_scale,
            "IW": self.latent_width * self.vae_scale,
            # vae_decoder's image size is fixed by the latent size; it is an output only.
        }

    def shapes(self, inputs: Sequence[Any], graph: str = "") -> dict[str, tuple[Shape, Shape, Shape]]:
        """(min, opt, max) shape of each input spec (``.name``, ``.shape`` with symbolic dims)."""
        out = {}
        for spec in inputs:
            out[spec.name] = tuple(
                tuple(self.dims(which, graph)[d] if isinstance(d, str) else int(d) for d in spec.shape)
                for which in ("min", "opt", "max")
            )
        return out


SPATIAL = frozenset({"H", "W", "IH", "IW"})


def spatial(inputs: Sequence[Any]) -> bool:
    """Whether a graph's inputs have spatial axes (one TensorRT profile per latent size then)."""
    return any(isinstance(d, str) and d in SPATIAL for spec in inputs for d in spec.shape)


def ort_trt_profile_options(profile: EditBatchProfile, inputs: Sequence[Any], graph: str = "") -> dict[str, str]:
    """ONNX Runtime TensorRT EP provider options for ``profile`` (``trt_profile_*_shapes``)."""
    shapes = profile.shapes(inputs, graph)
    options = {}
    for k, which in enumerate(("min", "opt", "max")):
        options[f"trt_profile_{which}_shapes"] = ",".join(
            f"{name}:{'x'.join(str(d) for d in s[k])}" for name, s in shapes.items() if len(s[k]) > 0
        )
    return options
