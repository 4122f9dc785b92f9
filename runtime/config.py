"""Typed run configuration: YAML in, frozen dataclasses out, validated at the edge.

Every field is declared below with the reason for its default. An unknown key, a wrong type or
a value out of range raises :class:`ConfigError` naming the file, the field path
(``edits[2].strength``) and the fix. Paths in a config file are relative to that file's folder.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import AllowInfNan, ConfigDict, Strict, TypeAdapter, ValidationError, with_config

from .errors import ConfigError

# Strict types: a YAML or JSON value of the wrong type is refused, never coerced ("10" is no
# integer, true is no 1), and no float may be inf or nan.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
STRICT = ConfigDict(extra="forbid")

Backend = Literal["auto", "ort-cpu", "ort-cuda", "ort-tensorrt", "trt"]
Precision = Literal["fp16", "bf16", "fp32"]
StoragePrecision = Literal["fp32", "fp16", "int8"]
PreserveMode = Literal["auto", "none"]


@with_config(STRICT)
@dataclass(frozen=True)
class Mask:
    """A rectangle in image pixels; inside it the edit may change the image, outside it may not."""

    x: Int
    y: Int
    width: Int
    height: Int

    def validate(self, where: str) -> None:
        for name in ("x", "y"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("width", "height"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name}: must be > 0, got {getattr(self, name)}")


@with_config(STRICT)
@dataclass(frozen=True)
class Edit:
    """One row of the batched tail (see ARCHITECTURE.md, "Edits")."""

    prompt: Str
    # K/V = K_base + strength * (K_edit - K_base): 0 is the base, 1 the edit prompt, >1 pushes
    # further. A slider over strengths costs no extra text encoding. None: cache.default_strength.
    strength: Optional[Float] = None
    # Where the row re-enters the base chain: start_step = steps - tail_steps. Give one of them;
    # neither means the run's default tail.
    start_step: Optional[Int] = None
    tail_steps: Optional[Int] = None
    # Classifier-free guidance for this row; None means the base's.
    guidance: Optional[Float] = None
    mask: Optional[Mask] = None
    # None: a deterministic edit from the base's own latent. A seed re-noises the entry latent
    # (from the base's final latent, with this seed's noise) for a variation.
    seed: Optional[Int] = None
    # Shown in the grid and the report; defaults to a summary of the fields.
    label: Optional[Str] = None
    # "auto": only where the changed words attend may the image change (see `preserve:`);
    # "none": the plain tail. None: `preserve.mode`.
    preserve: Optional[PreserveMode] = None
    # The first fraction of the tail that takes its layout from the base (structure keeping).
    # None: `preserve.structure`.
    structure: Optional[Float] = None

    def validate(self, where: str) -> None:
        if not self.prompt.strip():
            raise ConfigError(f"{where}.prompt: must not be empty")
        if self.strength is not None and not -4.0 <= self.strength <= 4.0:
            raise ConfigError(f"{where}.strength: must lie in [-4, 4], got {self.strength}")
        if self.start_step is not None and self.tail_steps is not None:
            raise ConfigError(f"{where}: give start_step or tail_steps, not both")
        if self.guidance is not None and not 0.0 <= self.guidance <= 50.0:
            raise ConfigError(f"{where}.guidance: must lie in [0, 50], got {self.guidance}")
        if self.mask is not None:
            self.mask.validate(f"{where}.mask")
        if self.structure is not None and not 0.0 <= self.structure <= 1.0:
            raise ConfigError(f"{where}.structure: must lie in [0, 1] (a fraction of the tail), got {self.structure}")


@with_config(STRICT)
@dataclass(frozen=True)
class Base:
    """The generation every edit starts from."""

    prompt: Str
    # As diffusers means it: omitted (null) is the family's default (SDXL: zeros where its
    # model_index says force_zeros_for_empty_prompt), "" is the empty prompt, encoded.
    negative_prompt: Optional[Str] = None
    seed: Int = 0
    # Stable Diffusion's usual DDIM budget; the tiny test model uses fewer.
    steps: Int = 50
    # Classifier-free guidance; <= 1 turns it off (the conditional prediction alone), as in diffusers.
    guidance: Float = 7.5
    width: Int = 512
    height: Int = 512
    # CLIP layers to skip from the end (diffusers' clip_skip; 0: none). The negative prompt
    # keeps the default layer, as in diffusers.
    clip_skip: Int = 0
    # SDXL's size conditioning (its time_ids): the original size (default: width x height) and
    # the crop's top-left corner.
    original_width: Optional[Int] = None
    original_height: Optional[Int] = None
    crop_top: Int = 0
    crop_left: Int = 0
    # An image to edit instead of a generation: it is inverted (pipeline.invert) with `prompt`
    # as its description. In a config, a path (relative to the config); in a stored base's key,
    # "sha256:<hex>" of the pixels it was inverted from.
    image: Optional[Str] = None

    def validate(self, where: str) -> None:
        if not 1 <= self.steps <= 1000:
            raise ConfigError(f"{where}.steps: must lie in [1, 1000], got {self.steps}")
        if not 0.0 <= self.guidance <= 50.0:
            raise ConfigError(f"{where}.guidance: must lie in [0, 50], got {self.guidance}")
        for name in ("width", "height"):
            value = getattr(self, name)
            if value <= 0 or value > 4096:
                raise ConfigError(f"{where}.{name}: must lie in [1, 4096], got {value}")
        if self.seed < 0:
            raise ConfigError(f"{where}.seed: must be >= 0, got {self.seed}")
        if not 0 <= self.clip_skip <= 8:
            raise ConfigError(f"{where}.clip_skip: must lie in [0, 8], got {self.clip_skip}")
        for name in ("original_width", "original_height", "crop_top", "crop_left"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 16384:
                raise ConfigError(f"{where}.{name}: must lie in [0, 16384], got {value}")

    def time_ids(self) -> list[float]:
        """SDXL's size conditioning: original (h, w), crop (top, left), target (h, w)."""
        return [float(self.original_height or self.height), float(self.original_width or self.width),
                float(self.crop_top), float(self.crop_left), float(self.height), float(self.width)]  # fmt: skip


@with_config(STRICT)
@dataclass(frozen=True)
class Cache:
    """Which of the base's latents are kept: the window edits may re-enter at."""

    # The first step whose latent is kept; the window runs from here to the final latent.
    # 0 keeps them all (a 512x512 SD latent is 32 KiB in fp16, so 50 steps cost 1.6 MiB).
    window_start: Int = 0
    # The tail length of an edit that gives neither start_step nor tail_steps: 40% of the steps
    # redraws colour and texture but keeps the layout on SD-like models.
    default_tail_fraction: Float = 0.4
    # The strength of an edit that gives none. 1.0 is the edit prompt's own K/V; the shapes
    # model's measurements (README, "Edit quality") are how a model's default is chosen.
    default_strength: Float = 1.0

    def validate(self, where: str) -> None:
        if self.window_start < 0:
            raise ConfigError(f"{where}.window_start: must be >= 0, got {self.window_start}")
        if not 0.0 < self.default_tail_fraction <= 1.0:
            raise ConfigError(
                f"{where}.default_tail_fraction: must lie in (0, 1], got {self.default_tail_fraction}"
            )
        if not -4.0 <= self.default_strength <= 4.0:
            raise ConfigError(f"{where}.default_strength: must lie in [-4, 4], got {self.default_strength}")


@with_config(STRICT)
@dataclass(frozen=True)
class Preserve:
    """Automatic local edits (``preserve: auto``): the knobs of the mask from attention maps.

    Chosen by `make quality` on the shapes model (README, "Edit quality"): there ``auto`` kept
    no more than the plain tail (its maps do not mark the edited region well enough), so the
    default mode is ``none`` and the knobs are the best-measured ``auto`` setting.
    """

    # The mode of an edit that names none. "auto" keeps, exactly, what the edit's changed
    # words do not attend to; "none" lets the whole image follow the edit prompt.
    mode: PreserveMode = "none"
    # Of the summed map normalised to [0, 1]: at or above it the image may change.
    threshold: Float = 0.3
    # Map pixels the region grows by (prompt-to-prompt's max-pool): covers an outline's blur.
    dilate: Int = 1
    # "contrast": the changed words' region, or, when they attend away from the prompt's other
    # words (a background recoloured), everything but those words' region; "words": the
    # changed words' region alone (prompt-to-prompt's local blend).
    region: Literal["contrast", "words"] = "contrast"
    # Tail steps whose maps are summed; later steps keep the mask (and run the plain graph).
    steps: Int = 4
    # Decoded images are composited with the base image outside the mask; the edge blends
    # over this many pixels inside it, so nothing outside the mask changes at all.
    feather_px: Int = 2
    # Structure keeping: for this first fraction of an edit's tail, its self-attention takes
    # the pattern of the base's own tail (a reference row per base and entry step in the same
    # call: plug-and-play's injection), so the layout stays the base's; 0 turns it off.
    structure: Float = 0.0

    def validate(self, where: str) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"{where}.threshold: must lie in (0, 1), got {self.threshold}")
        if not 0 <= self.dilate <= 8:
            raise ConfigError(f"{where}.dilate: must lie in [0, 8] map pixels, got {self.dilate}")
        if not 1 <= self.steps <= 50:
            raise ConfigError(f"{where}.steps: must lie in [1, 50], got {self.steps}")
        if not 0 <= self.feather_px <= 16:
            raise ConfigError(f"{where}.feather_px: must lie in [0, 16], got {self.feather_px}")
        if not 0.0 <= self.structure <= 1.0:
            raise ConfigError(f"{where}.structure: must lie in [0, 1] (a fraction of the tail), got {self.structure}")


@with_config(STRICT)
@dataclass(frozen=True)
class Export:
    """Settings of `edit-rt export`."""

    # diffusers' weight variant ("fp16": *.fp16.safetensors); fp16 weights are cast to fp32 for
    # the CPU graphs.
    variant: Optional[Str] = None

    # 17 is the newest opset the TorchScript exporter covers for every op the UNet uses
    # (scaled_dot_product_attention included) and TensorRT 8.6+ parses.
    opset: Int = 17
    # Graphs whose weights exceed this are written with external data (*.onnx_data): protobuf
    # cannot serialize a message over 2 GiB, and a fp32 SD 1.5 UNet is ~3.4 GB.
    external_data_threshold_mb: Float = 1900.0

    def validate(self, where: str) -> None:
        if not 14 <= self.opset <= 21:
            raise ConfigError(f"{where}.opset: must lie in [14, 21], got {self.opset}")
        if self.external_data_threshold_mb < 0:
            raise ConfigError(f"{where}.external_data_threshold_mb: must be >= 0")


@with_config(STRICT)
@dataclass(frozen=True)
class Engines:
    """Settings of `edit-rt engines`: the edit-batch profile and the TensorRT precision."""

    # Rows per unet_step call. TensorRT tunes kernels for opt and accepts min..max; more rows
    # than max are split into max-sized calls. 32 rows of SD 1.5 at 512x512 need ~10 GB of
    # activations in fp16 (2x for CFG), which fits a 24 GB card next to the weights.
    min_batch: Int = 1
    opt_batch: Int = 8
    max_batch: Int = 32
    # fp16 halves memory and doubles tensor-core throughput; SD's UNet is trained for it.
    precision: Precision = "fp16"
    # Distinct negative prompts one unet_step call mixes: each adds 77 tokens that every
    # unconditional row's cross-attention scores (the sets are read once, not gathered per
    # row). Rows with a further negative prompt wait for a step that has room.
    max_uncond_sets: Int = 4
    # Capture each bound step shape as a CUDA graph on the GPU backends (one launch per step).
    cuda_graphs: Bool = True
    # Row counts a step call runs at. pow2: 1, 2, 4, ... max_batch, the rest padded (a GPU
    # replays one captured graph per bucket; a new row count would mean a new capture); exact:
    # every count (the CPU, where a padded row costs as much as a real one); auto: pow2 on the
    # GPU backends, exact on ort-cpu.
    buckets: Literal["auto", "pow2", "exact"] = "auto"
    # Rows per VAE call: its activations at full image size are far larger per row than the
    # UNet's (SDXL at 1024x1024), so it has its own profile and decodes in chunks of it.
    vae_max_batch: Int = 8

    def validate(self, where: str) -> None:
        if not 1 <= self.min_batch <= self.opt_batch <= self.max_batch <= 1024:
            raise ConfigError(
                f"{where}: need 1 <= min_batch <= opt_batch <= max_batch <= 1024, got "
                f"{self.min_batch}/{self.opt_batch}/{self.max_batch}"
            )
        if not 1 <= self.max_uncond_sets <= 64:
            raise ConfigError(f"{where}.max_uncond_sets: must lie in [1, 64], got {self.max_uncond_sets}")
        if not 1 <= self.vae_max_batch <= 1024:
            raise ConfigError(f"{where}.vae_max_batch: must lie in [1, 1024], got {self.vae_max_batch}")


@with_config(STRICT)
@dataclass(frozen=True)
class Store:
    """The base-state store: RAM and (optionally) disk budgets and the storage precision."""

    # SD 1.5 at 512x512, fp32: ~7.6 MiB of K/V + 32 KiB x 51 latents per base, so 1 GiB of
    # RAM holds ~100 bases; fp16 doubles that, int8 quadruples it.
    ram_mb: Float = 1024.0
    # A folder for the disk tier (one safetensors file per base); none keeps bases in RAM only.
    disk_dir: Optional[Path] = None
    disk_mb: Float = 10240.0
    latents_precision: StoragePrecision = "fp32"
    kv_precision: StoragePrecision = "fp32"

    def validate(self, where: str) -> None:
        for name in ("ram_mb", "disk_mb"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name}: must be > 0, got {getattr(self, name)}")


@with_config(STRICT)
@dataclass(frozen=True)
class RayServe:
    """`edit-rt serve CONFIG --ray`: the same API on Ray Serve, in front of N replicas."""

    # Workers, each with its own engine set, batcher and RAM tier; they share store.disk_dir.
    replicas: Int = 2
    cpus_per_replica: Float = 1.0
    gpus_per_replica: Float = 0.0
    # A running cluster ("ray://head:10001" or "auto"); RAY_ADDRESS overrides; none starts a
    # local Ray instance.
    address: Optional[Str] = None
    # Requests one replica takes at once: they queue in its batcher, which batches them, so this
    # is well above Ray Serve's default of 5.
    max_ongoing_requests: Int = 64
    # Where each base was placed, kept by the ingress for routing (the least recent go first;
    # a base it forgot is routed by rendezvous hashing, then remembered again).
    placements: Int = 100_000
    # affinity: a request that names a base goes to the replica holding it (ray_serve.py);
    # power_of_two: Ray Serve's default router, which ignores the base (for comparison).
    routing: Literal["affinity", "power_of_two"] = "affinity"
    # affinity: a request goes past the replicas holding its base only when each of them has
    # more requests in flight than load_bound x the mean, plus one (a large value: never).
    load_bound: Float = 2.0

    def validate(self, where: str) -> None:
        for name in ("replicas", "max_ongoing_requests", "placements"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}: must be >= 1, got {getattr(self, name)}")
        if self.load_bound < 1.0:
            raise ConfigError(f"{where}.load_bound: must be >= 1, got {self.load_bound}")
        for name in ("cpus_per_replica", "gpus_per_replica"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name}: must be >= 0, got {getattr(self, name)}")


@with_config(STRICT)
@dataclass(frozen=True)
class Serve:
    """`edit-rt serve`: where it listens and what it accepts."""

    # Loopback by default: exposing the service is a deliberate choice (and wants `token`).
    host: Str = "127.0.0.1"
    port: Int = 8188
    # Bearer token for /v1/* and /metrics; EDIT_RT_TOKEN in the environment overrides it.
    token: Optional[Str] = None
    max_edits_per_request: Int = 64
    # Rows waiting for a batch slot; past this a request gets 429 with Retry-After.
    queue_limit: Int = 256
    max_prompt_chars: Int = 500
    # Room for an uploaded image (multipart or base64 JSON) besides the rest of a body.
    max_body_bytes: Int = 16_000_000
    # An uploaded image's own bytes; one of another size is resized to the served size (or,
    # with resize_uploads false, refused with the size it must have).
    max_image_bytes: Int = 10_000_000
    resize_uploads: Bool = True
    max_steps: Int = 150
    # A request whose rows are not done by then is dropped at the next step boundary.
    request_timeout_s: Float = 600.0
    # On SIGTERM: new requests get 503 at once; rows in flight get this long to finish.
    drain_timeout_s: Float = 30.0
    # Slow or stalled clients: a request head must arrive within header_timeout_s of the
    # connection, and a body must not stall for body_timeout_s.
    header_timeout_s: Float = 10.0
    body_timeout_s: Float = 30.0
    ray: RayServe = field(default_factory=RayServe)

    def validate(self, where: str) -> None:
        self.ray.validate(f"{where}.ray")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"{where}.port: must lie in [0, 65535], got {self.port}")
        for name in ("max_edits_per_request", "queue_limit", "max_prompt_chars", "max_body_bytes", "max_steps", "max_image_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "drain_timeout_s", "header_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name}: must be > 0, got {getattr(self, name)}")
        if self.token is not None and not self.token.strip():
            raise ConfigError(f"{where}.token: empty; set a token, or remove the key to serve without one")


@with_config(STRICT)
@dataclass(frozen=True)
class RunConfig:
    """A whole `edit-rt run` job: which model, the base, the edits, where results go."""

    model: Path
    base: Base
    edits: list[Edit] = field(default_factory=list)
    # Artifacts live under <build_dir>/<model folder name>/{onnx,engines}/.
    build_dir: Path = Path("build")
    output_dir: Path = Path("out")
    # ort-cpu runs everywhere; auto picks the fastest backend this machine has built engines for.
    backend: Backend = "ort-cpu"
    # ONNX Runtime intra-op threads; 0 lets ONNX Runtime use every core.
    threads: Int = 0
    cache: Cache = field(default_factory=Cache)
    preserve: Preserve = field(default_factory=Preserve)
    export: Export = field(default_factory=Export)
    engines: Engines = field(default_factory=Engines)
    store: Store = field(default_factory=Store)
    serve: Serve = field(default_factory=Serve)
    source: Optional[Path] = None

    @property
    def model_name(self) -> str:
        return self.model.resolve().name

    @property
    def onnx_dir(self) -> Path:
        return self.build_dir / self.model_name / "onnx"

    @property
    def engines_dir(self) -> Path:
        return self.build_dir / self.model_name / "engines"

    def validate(self, where: str) -> None:
        self.base.validate(f"{where}base")
        if self.base.image is not None and not Path(self.base.image).is_file():
            raise ConfigError(f"{where}base.image: {self.base.image} is not a file; give the path of a PNG or JPEG")
        self.cache.validate(f"{where}cache")
        self.preserve.validate(f"{where}preserve")
        self.export.validate(f"{where}export")
        self.engines.validate(f"{where}engines")
        self.store.validate(f"{where}store")
        self.serve.validate(f"{where}serve")
        if not 0 <= self.threads <= 1024:
            raise ConfigError(f"{where}threads: must lie in [0, 1024] (0: every core), got {self.threads}")
        if self.store.disk_dir is not None and self.store.disk_dir.exists() and not self.store.disk_dir.is_dir():
            raise ConfigError(f"{where}store.disk_dir: {self.store.disk_dir} is a file, not a folder; point it at a folder")
        if self.cache.window_start >= self.base.steps:
            raise ConfigError(
                f"{where}cache.window_start: must be below base.steps ({self.base.steps}), "
                f"got {self.cache.window_start}"
            )
        for i, edit in enumerate(self.edits):
            edit.validate(f"{where}edits[{i}]")
            self.start_step_of(edit, f"{where}edits[{i}]")
            if edit.mask is not None:
                m = edit.mask
                if m.x + m.width > self.base.width or m.y + m.height > self.base.height:
                    raise ConfigError(
                        f"{where}edits[{i}].mask: the rectangle ({m.x},{m.y},{m.width}x{m.height}) "
                        f"leaves the {self.base.width}x{self.base.height} image; shrink it"
                    )

    def preserve_of(self, preserve: Optional[str]) -> str:
        """An edit's preserve mode (config or API), or ``preserve.mode`` when it gives none."""
        return self.preserve.mode if preserve is None else preserve

    def structure_of(self, structure: Optional[float]) -> float:
        """An edit's structure-keeping fraction (config or API), or ``preserve.structure``."""
        return self.preserve.structure if structure is None else structure

    def strength_of(self, strength: Optional[float]) -> float:
        """An edit's strength (config or API), or ``cache.default_strength`` when it gives none."""
        return self.cache.default_strength if strength is None else strength

    def start_step_of(self, edit: Edit, where: str = "edit") -> int:
        """The step at which ``edit`` re-enters the base chain, checked against the window."""
        steps, lo = self.base.steps, self.cache.window_start
        if edit.start_step is not None:
            start, name = edit.start_step, "start_step"
        elif edit.tail_steps is not None:
            start, name = steps - edit.tail_steps, "tail_steps"
        else:
            start, name = steps - max(1, round(self.cache.default_tail_fraction * steps)), ""
        if not lo <= start <= steps - 1:
            given = f"{name}={getattr(edit, name)}" if name else "the default tail"
            raise ConfigError(
                f"{where}.{name or 'start_step'}: {given} enters at step {start}, outside the cache "
                f"window [{lo}, {steps - 1}] (base.steps={steps}, cache.window_start={lo}); "
                f"use a start_step in that range or a tail_steps in [1, {steps - lo}]"
            )
        return start


# --- YAML -> dataclasses ------------------------------------------------------------------

_MESSAGES = {
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "finite_number": "must be a finite number",
    "path_type": "must be a path string",
    "list_type": "must be a list",
    "dataclass_type": "must be a mapping",
    "int_from_float": "must be an integer",
}


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _type_at(loc: tuple) -> Any:
    """The dataclass a location's last key belongs to (for the list of allowed keys)."""
    tp: Any = RunConfig
    for part in loc:
        if isinstance(part, int):
            continue
        hints = typing.get_type_hints(tp, include_extras=False)
        tp = hints.get(part)
        while typing.get_origin(tp) in (list, Optional, types.UnionType, typing.Union):
            tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
        if not dataclasses.is_dataclass(tp):
            return None
    return tp


def _config_error(err: ValidationError) -> ConfigError:
    first = err.errors()[0]
    loc, kind = tuple(first["loc"]), first["type"]
    where = _path(loc) or "top level"
    if kind == "unexpected_keyword_argument":
        owner = _type_at(loc[:-1])
        known = sorted(f.name for f in dataclasses.fields(owner) if f.name != "source") if owner else []
        return ConfigError(f"{where}: unknown key; the keys allowed here are {', '.join(known)}")
    if kind in ("missing", "missing_argument", "missing_keyword_argument"):
        return ConfigError(f"{where}: missing; this field is required")
    if kind == "literal_error":
        choices = first.get("ctx", {}).get("expected", "")
        return ConfigError(f"{where}: must be one of {choices.replace(' or ', ' | ')}, got {first.get('input')!r}")
    message = _MESSAGES.get(kind, first["msg"])
    return ConfigError(f"{where}: {message}, got {first.get('input')!r}")


_ADAPTER: Optional[TypeAdapter] = None


def config_from_dict(data: Any, source: Optional[Path] = None) -> RunConfig:
    """Build and validate a RunConfig; relative paths are taken from ``source``'s folder."""
    global _ADAPTER
    label = f"{source}: " if source is not None else ""
    try:
        if not isinstance(data, dict):
            raise ConfigError(f"top level: must be a mapping, got {type(data).__name__}")
        if "source" in data:
            raise ConfigError("source: unknown key; it is set from the file's path")
        if _ADAPTER is None:
            _ADAPTER = TypeAdapter(RunConfig)
        try:
            cfg = _ADAPTER.validate_python(data)
        except ValidationError as err:
            raise _config_error(err) from None
        root = source.parent if source is not None else Path.cwd()
        cfg = dataclasses.replace(
            cfg,
            model=_resolve(cfg.model, root),
            build_dir=_resolve(cfg.build_dir, root),
            output_dir=_resolve(cfg.output_dir, root),
            source=source,
        )
        if cfg.store.disk_dir is not None:
            cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, disk_dir=_resolve(cfg.store.disk_dir, root)))
        if cfg.base.image is not None:
            cfg = dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, image=str(_resolve(Path(cfg.base.image), root))))
        cfg.validate("")
    except ConfigError as err:
        raise ConfigError(f"{label}{err}") from None
    return cfg


def load_config(path: Path | str) -> RunConfig:
    """Read a YAML config file into a validated :class:`RunConfig`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); save the file as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    return config_from_dict(data, source=path)


def _resolve(p: Path, root: Path) -> Path:
    p = p.expanduser()
    return p if p.is_absolute() else Path(os.path.normpath(root / p))
