"""The run config's declarations: its sections and :class:`RunConfig`, frozen dataclasses
validated at the edge (load.py reads a YAML file into them).

Every field is declared below (the edit model's own in edit.py) with the reason for its default
and its range on its type (schema.py), so the config and the HTTP API accept and refuse the
same values. An unknown key, a wrong type or a value out of range raises :class:`ConfigError`
naming the file, the field path (``edits[2].strength``) and the fix. Paths in a config file are
relative to that file's folder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Collection, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, StringConstraints, Tag, with_config

from ..errors import ConfigError, EditError, ModelError, PromptSyntaxError
from ..model.adapters import SCHEDULE_FIELDS, schedule_changes
from ..model.edit import Base, Edit, EditDefaults, Preserve, SamplerName, TailRow, resolve_edit
from ..model.schema import Bool, DeepCache, Float, Guidance, Int, StoragePrecision, Str, Strength, UncondMode, between
from ..model.single_file import artifact_name, checkpoint_family, is_single_file, require_converted
from ..model.weighting import prompt_spans
from .catalogue import Catalogue
from .plan import PlanSection
from .serve import Serve

STRICT = ConfigDict(extra="forbid")

Backend = Literal["auto", "ort-cpu", "openvino", "ort-cuda", "ort-tensorrt", "trt"]
Precision = Literal["fp16", "bf16", "fp32"]
Decoder = Literal["vae", "taesd"]  # pipeline/decoders.py
Rows = between(Int, 1, 1024)  # rows of one call
Seconds = between(Float, 0.0, lo_open=True)
# The rows TensorRT tunes its kernels for when engines.opt_batch is left out (max_batch caps it).
OPT_BATCH = 8
AdapterKey = Annotated[Str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


@with_config(STRICT)
@dataclass(frozen=True)
class SpeedAdapter:
    """An ``adapters:`` entry written as a mapping: a LoRA file and the schedule it was distilled
    for (an LCM-LoRA: lcm, 4 steps, guidance 1; a Hyper-SD or Lightning LoRA: its card's). A
    generation using it at a nonzero UNet scale runs that schedule where the base or the request
    does not set its own (model/adapters.py's schedule_changes says the rule)."""

    path: Path
    # What its card says it runs with; left out: the base's own (the model's sampler, base.steps).
    sampler: Optional[SamplerName] = None
    # Few-step LoRAs run 1-8 steps; LCM's schedule takes at most its 50-step distillation grid
    # (LCMScheduler's original_inference_steps), so more is no speed LoRA's schedule.
    steps: Optional[between(Int, 1, 50)] = None
    # LCM-LoRA: 1 (off) to 2; Turbo- and Lightning-style LoRAs: 0 or 1.
    guidance: Optional[Guidance] = None


def _entry_kind(value: Any) -> str:
    return "(schedule)" if isinstance(value, (dict, SpeedAdapter)) else "(path)"


# A path, or a mapping with its path and schedule. The tags name the branch in a refusal's
# location; load.py leaves them out of the field path it prints (no adapter name has parentheses).
AdapterEntry = Annotated[Union[Annotated[Path, Tag("(path)")], Annotated[SpeedAdapter, Tag("(schedule)")]],
                         Discriminator(_entry_kind)]  # fmt: skip

@with_config(STRICT)
@dataclass(frozen=True)
class Cache:
    """Which of the base's latents are kept: the window edits may re-enter at."""

    # The first step whose latent is kept; the window runs from here to the final latent.
    # 0 keeps them all (a 512x512 SD latent is 32 KiB in fp16, so 50 steps cost 1.6 MiB).
    window_start: between(Int, 0) = 0
    # The tail length of an edit that gives neither start_step nor tail_steps: 40% of the steps
    # redraws colour and texture but keeps the layout on SD-like models.
    default_tail_fraction: between(Float, 0.0, 1.0, lo_open=True) = 0.4
    # The strength of an edit that gives none. 1.0 is the edit prompt's own K/V; the shapes
    # model's measurements (docs/quality.md) are how a model's default is chosen.
    default_strength: Strength = 1.0

@with_config(STRICT)
@dataclass(frozen=True)
class Tail:
    """How an edit's tail runs, for edits that do not say."""

    # The unconditional prediction at each tail step: computed by the row (compute: diffusers'
    # numbers), its base's (base: the row's unconditional half skipped), or its base's plus a
    # first-order correction in the row's own latent (base-corrected). runtime/loop/uncond_reuse.py
    # says how; docs/performance.md what each costs and keeps. A row that differs from its base
    # in negative prompt, guidance, adapters or seed computes whatever this says.
    uncond: UncondMode = "compute"
    # DeepCache over the tail (export/compile/graphs.py's UNetShallowStepGraph, loop/row_scheduler.py): every
    # k-th step of the tail, from its first, runs the whole UNet; the steps between run only its
    # outer blocks on the deep features of the last full step. 1: every step full.
    # docs/performance.md measures what each k costs and keeps.
    deepcache: DeepCache = 1


@with_config(STRICT)
@dataclass(frozen=True)
class Export:
    """Settings of `edit-rt export`."""

    # diffusers' weight variant ("fp16": *.fp16.safetensors); fp16 weights are cast to fp32 for
    # the CPU graphs.
    variant: Optional[Str] = None

    # 17 is the newest opset the TorchScript exporter covers for every op the UNet uses
    # (scaled_dot_product_attention included) and TensorRT 8.6+ parses.
    opset: between(Int, 14, 21) = 17
    # Graphs whose weights exceed this are written with external data (*.onnx_data): protobuf
    # cannot serialize a message over 2 GiB, and a fp32 SD 1.5 UNet is ~3.4 GB.
    external_data_threshold_mb: between(Float, 0.0) = 1900.0
    # LoRA slots: adapters resident in the graphs at once (rows of one call may use them all,
    # each row its own scales). None: 4 when `adapters:` names any, else 0 (graphs without
    # adapter inputs). Each slot costs every step call whose rows use an adapter two matmuls of
    # width adapter_rank per adapted layer; a call whose rows use none binds the slots zero wide
    # and runs no LoRA branch (docs/performance.md has the measured cost).
    adapter_slots: Optional[between(Int, 0, 16)] = None
    # The highest LoRA rank a slot holds (lower ranks are zero-padded); common SD LoRAs are
    # rank 4 to 32, sliders 4 to 8.
    adapter_rank: between(Int, 1, 128) = 16
    # The step graph's self-attention a few heads at a time (diffusers' attention slicing):
    # "auto" slices one head at a time where one UNet row's scores at the model's own size pass
    # 256 MiB (SD 1.5 and SDXL: 512 and 640 MiB a row; the shapes models: a few MiB, unsliced);
    # 0 never; n: n heads per slice. docs/performance.md measures memory against speed.
    attention_slicing: Union[Literal["auto"], between(Int, 0, 64)] = "auto"
    # The tiny autoencoder (TAESD for SD 1.x/2.x, TAESDXL for SDXL): a diffusers AutoencoderTiny
    # folder or its authors' taesd_decoder.safetensors (export/compile/tiny_vae.py). None: the
    # model folder's vae_tiny/ if it has one, else no tiny decoder. It decodes a preview at ~6%
    # of the VAE's cost (docs/engines.md measures it); finals stay the VAE's by default.
    tiny_vae: Optional[Path] = None

@with_config(STRICT)
@dataclass(frozen=True)
class Engines:
    """Settings of `edit-rt engines`: the edit-batch profile and the TensorRT precision."""

    # Rows per unet_step call. TensorRT tunes kernels for opt and accepts min..max; more rows
    # than max are split into max-sized calls. 32 rows of SD 1.5 at 512x512 need ~10 GB of
    # activations in fp16 (2x for CFG), which fits a 24 GB card next to the weights.
    min_batch: Rows = 1
    # Left out: OPT_BATCH within min_batch..max_batch (a config that lowers max_batch to 4 tunes for 4).
    opt_batch: Optional[Rows] = None
    max_batch: Rows = 32
    # fp16 halves memory and doubles tensor-core throughput; SD's UNet is trained for it.
    precision: Precision = "fp16"
    # Distinct negative prompts one unet_step call mixes: each adds 77 tokens that every
    # unconditional row's cross-attention scores (the sets are read once, not gathered per
    # row). Rows with a further negative prompt wait for a step that has room.
    max_uncond_sets: between(Int, 1, 64) = 4
    # Capture each bound step shape as a CUDA graph on the GPU backends (one launch per step).
    cuda_graphs: Bool = True
    # Row counts a step call runs at. pow2: 1, 2, 4, ... max_batch, the rest padded (a GPU
    # replays one captured graph per bucket; a new row count would mean a new capture); exact:
    # every count (the CPU, where a padded row costs as much as a real one); auto: pow2 on the
    # GPU backends, exact on ort-cpu.
    buckets: Literal["auto", "pow2", "exact"] = "auto"
    # Rows per VAE call: its activations at full image size are far larger per row than the
    # UNet's (SDXL at 1024x1024), so it has its own profile and decodes in chunks of it.
    vae_max_batch: Rows = 8
    # The host memory (GB) the CPU path may use in all: its calls run at the rows that fit in it
    # beside the weights (runtime/engine/memory.py), the rest in later calls. None: what the
    # machine has free when a size is first used. SD 1.5 at 512x512 needs ~4 GB of weights and
    # ~0.7 GB a step row (docs/performance.md).
    max_memory_gb: Optional[between(Float, 0.5, 65536.0)] = None
    # Image sizes `edit-rt serve` takes ("WxH"), besides base.width x base.height (always
    # served, and the default): one step loop each, on the same engines where their spatial
    # axes are dynamic (ONNX Runtime); uploads are resized to the base's size.
    sizes: list[Annotated[Str, StringConstraints(pattern=r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$")]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.opt_batch is None:  # object.__setattr__: the dataclass is frozen
            object.__setattr__(self, "opt_batch", self.default_opt_batch())

    def default_opt_batch(self) -> int:
        """The opt_batch a config that leaves it out gets: OPT_BATCH within min_batch..max_batch."""
        return min(max(OPT_BATCH, self.min_batch), self.max_batch)

    def batch_rows(self) -> tuple[int, int, int]:
        """(min_batch, opt_batch, max_batch): the rows per step call the engines are built for."""
        return (self.min_batch, self.opt_batch, self.max_batch)

@with_config(STRICT)
@dataclass(frozen=True)
class Store:
    """The base-state store: RAM and (optionally) disk budgets and the storage precision."""

    # SD 1.5 at 512x512, fp32: ~7.6 MiB of K/V + 32 KiB x 51 latents per base, so 1 GiB of
    # RAM holds ~100 bases; fp16 doubles that, int8 quadruples it.
    ram_mb: between(Float, 0.0, lo_open=True) = 1024.0
    # A folder for the disk tier (one safetensors file per base); none keeps bases in RAM only.
    disk_dir: Optional[Path] = None
    disk_mb: between(Float, 0.0, lo_open=True) = 10240.0
    latents_precision: StoragePrecision = "fp32"
    kv_precision: StoragePrecision = "fp32"
    # Which base the RAM tier lets go first when it is full: "lru", the least recently used;
    # "lcbfu", the one whose related generations saved the fewest steps so far (NIRVANA's least
    # computationally beneficial and frequently used), the least recent among equals. The disk
    # tier stays LRU (docs/related.md measures both on the related workload).
    eviction: Literal["lru", "lcbfu"] = "lru"

@with_config(STRICT)
@dataclass(frozen=True)
class RunConfig:
    """A whole `edit-rt run` job: which model, the base, the edits, where results go."""

    # A diffusers folder (model_index.json, unet/, ...) or a single-file .safetensors checkpoint
    # (SD 1.x, 2.x, SDXL in the original layout A1111 and ComfyUI use), which `edit-rt export`
    # converts once into <build_dir>/<file stem>/diffusers/ (model_dir).
    model: Path
    base: Base
    edits: list[Edit] = field(default_factory=list)
    # A single file's family: sd1, sd2 (512-base, epsilon), sd2-v (768, v-prediction), sdxl.
    # Detected from the file's keys when left out, except SD 2.x, whose two kinds have the same
    # keys: a wrong guess would sample noise-like images, so such a file must say which it is.
    family: Optional[Literal["sd1", "sd2", "sd2-v", "sdxl"]] = None
    # A single file's diffusers configs, used as they are: a folder with model_index.json, the
    # parts' config.json and the tokenizer(s), e.g. the diffusers release of the same model. Left
    # out, the family's shipped configs with what the file's tensor shapes tell (widths, depths)
    # written over them; this is for what shapes cannot tell (attention heads, activations).
    checkpoint_config: Optional[Path] = None
    # Artifacts live under <build_dir>/<model name>/{onnx,engines}/ (a folder's name, a file's stem).
    build_dir: Path = Path("build")
    output_dir: Path = Path("out")
    # ort-cpu runs everywhere; auto picks the fastest backend this machine has built engines for.
    backend: Backend = "ort-cpu"
    # ONNX Runtime intra-op threads; 0 lets ONNX Runtime use every core.
    threads: between(Int, 0, 1024) = 0
    # What decodes the final images of a run (and the server's default for a request that names
    # none): the VAE (exact: what diffusers' pipeline gives) or the tiny decoder (taesd: an
    # approximation at ~6% of the VAE's cost at 512x512 on a CPU; the export needs one, export.tiny_vae).
    # Previews go through the tiny decoder whenever the export has one.
    decoder: Decoder = "vae"
    cache: Cache = field(default_factory=Cache)
    tail: Tail = field(default_factory=Tail)
    preserve: Preserve = field(default_factory=Preserve)
    export: Export = field(default_factory=Export)
    engines: Engines = field(default_factory=Engines)
    store: Store = field(default_factory=Store)
    serve: Serve = field(default_factory=Serve)
    # LoRA files by name (diffusers/peft or kohya/AUTOMATIC1111 .safetensors; a path relative
    # to the config): `edit-rt adapters` (and make export) converts them for the model; rows
    # name them in `adapters: {name: scale}`. A speed LoRA's entry is a mapping, its path and
    # its schedule (SpeedAdapter); once validated every entry here is its path, and the
    # schedules are in speed_adapters.
    adapters: dict[AdapterKey, AdapterEntry] = field(default_factory=dict)
    # Hundreds of variants of the base (config/catalogue.py): every catalogue edit at every
    # position of every slider, written image by image to <output_dir>/catalogue/ after the edits.
    catalogue: Optional[Catalogue] = None
    # A plan config (config/plan.py, pipeline/plans.py): the model is a planner, and `edit-rt run`
    # plans the scene's base and its behaviours instead of editing an image.
    plan: Optional[PlanSection] = None
    # Set at load, never from the file: the file's path, and the rows each of the file's edits
    # became (a sweep's n, else 1; ``edits`` holds them expanded): the grid shows a sweep as a row.
    source: Optional[Path] = None
    edit_rows: tuple[int, ...] = ()
    # Set from the adapters: entries that are mappings, never written in the file: the speed
    # LoRAs by name. And set at load: the base fields (sampler, steps, guidance) its speed
    # LoRA's schedule filled in, which a request that names other adapters does not inherit.
    speed_adapters: dict[AdapterKey, SpeedAdapter] = field(default_factory=dict)
    base_schedule_filled: tuple[Literal["sampler", "steps", "guidance"], ...] = ()

    def __post_init__(self) -> None:
        # every consumer of adapters: reads name -> path; the schedules live beside them
        speed = {n: v for n, v in self.adapters.items() if isinstance(v, SpeedAdapter)}
        if speed:  # object.__setattr__: the dataclass is frozen
            object.__setattr__(self, "speed_adapters", {**self.speed_adapters, **speed})
            object.__setattr__(self, "adapters", {n: v.path if isinstance(v, SpeedAdapter) else v for n, v in self.adapters.items()})

    def scheduled(self, base: Base, given: Collection[str], where: str = "base.") -> Base:
        """``base`` with the schedule of the speed LoRA it uses, for each of sampler, steps and
        guidance not in ``given`` (model/adapters.py's schedule_changes: the one rule, for the
        config's base at load and for each request's generation). A base from an image is
        inverted with DDIM, so it keeps its own."""
        if base.image is not None or not self.speed_adapters:
            return base
        return dataclasses.replace(base, **schedule_changes(base.adapters, base.sampler, self.speed_adapters, given, where))

    def request_base(self, own_adapters: bool) -> tuple[Base, frozenset[str]]:
        """What a request's generation starts from, and the schedule fields to hold as set: the
        config's base with everything it set (the request keeps its adapters), or, for a request
        that names its own adapters, the base as its file declares it (the fields its speed LoRA
        filled in back at their defaults, for the request's adapters to fill in) with none."""
        if not own_adapters:
            return self.base, frozenset(SCHEDULE_FIELDS) - set(self.base_schedule_filled)
        defaults = {f.name: f.default for f in dataclasses.fields(Base) if f.name in self.base_schedule_filled}
        return dataclasses.replace(self.base, **defaults), frozenset()

    def served_sizes(self) -> list[tuple[int, int]]:
        """(width, height) of every size served: the base's first, then engines.sizes."""
        sizes = [(self.base.width, self.base.height)]
        for text in self.engines.sizes:
            size = tuple(int(v) for v in text.split("x"))
            if size not in sizes:
                sizes.append(size)
        return sizes

    @property
    def single_file(self) -> bool:
        """Whether ``model:`` names a single-file checkpoint rather than a diffusers folder."""
        return is_single_file(self.model)

    @property
    def model_name(self) -> str:
        """The name artifacts are kept under: the folder's name, or the file's stem; one plain
        folder name or a ConfigError, so no path made from it leaves build_dir."""
        try:
            return artifact_name(self.model)
        except ModelError as err:
            raise ConfigError(f"{f'{self.source}: ' if self.source else ''}model: {err}") from None

    @property
    def model_dir(self) -> Path:
        """The diffusers folder the export reads and the runtime fingerprints: ``model`` itself,
        or for a single file the folder it is converted into, next to the build."""
        return self.build_dir / self.model_name / "diffusers" if self.single_file else self.model

    def require_model_dir(self) -> Path:
        """``model_dir``, refusing in one line a single file not yet converted (or changed since)."""
        if self.single_file:
            return require_converted(self.model, self.model_dir, self.family, str(self.source or "CONFIG"), self.checkpoint_config)
        return self.model

    @property
    def onnx_dir(self) -> Path:
        return self.build_dir / self.model_name / "onnx"

    @property
    def engines_dir(self) -> Path:
        return self.build_dir / self.model_name / "engines"

    @property
    def adapters_dir(self) -> Path:
        return self.build_dir / self.model_name / "adapters"

    @property
    def adapter_slots(self) -> int:
        """The export's LoRA slots: export.adapter_slots, or 4 when adapters are configured."""
        given = self.export.adapter_slots
        return given if given is not None else (4 if self.adapters else 0)

    def validate(self, where: str) -> None:
        """What spans fields or needs the disk; each field's own range is declared on its type."""
        e = self.engines
        if e.min_batch > e.max_batch:
            raise ConfigError(f"{where}engines.min_batch: {e.min_batch} is above max_batch ({e.max_batch}); lower "
                              "min_batch or raise max_batch")  # fmt: skip
        if not e.min_batch <= e.opt_batch <= e.max_batch:
            raise ConfigError(f"{where}engines.opt_batch: {e.opt_batch} is outside min_batch..max_batch "
                              f"({e.min_batch}..{e.max_batch}); set opt_batch within them, or leave it out "
                              f"({e.default_opt_batch()} here)")  # fmt: skip
        thresholds = self.serve.related.thresholds
        for k in range(1, len(thresholds)):
            a, b = thresholds[k - 1], thresholds[k]
            if not (a.similarity < b.similarity and a.skip < b.skip):
                raise ConfigError(f"{where}serve.related.thresholds[{k}]: similarity {b.similarity:g} / skip {b.skip:g} after "
                                  f"{a.similarity:g} / {a.skip:g}; list them with both similarity and skip ascending "
                                  "(the closer the prompt, the more steps skipped)")  # fmt: skip
        self._check_model(where)
        if self.base.related is not None:
            raise ConfigError(f"{where}base.related: set by the server for related generations; remove it")
        if self.base.known is not None:
            raise ConfigError(f"{where}base.known: set by the planner for a plan's base; remove it")
        if self.plan is not None and (self.edits or self.catalogue is not None):
            raise ConfigError(f"{where}{'edits' if self.edits else 'catalogue'}: a plan config plans behaviours (plan:), "
                              "it edits no image; remove it")  # fmt: skip
        if self.plan is not None:
            tails = {"plan.tail_steps": self.plan.tail_steps,
                     **{f"plan.behaviour_tails.{b}": t for b, t in self.plan.behaviour_tails.items()}}  # fmt: skip
            for name, tail in tails.items():
                if tail is not None and tail > self.base.steps:
                    raise ConfigError(f"{where}{name}: {tail} is above base.steps ({self.base.steps}); lower it")
            self.plan.the_scene()  # a stopped obstacle with a speed: refused here
        if self.base.image is not None and not Path(self.base.image).is_file():
            raise ConfigError(f"{where}base.image: {self.base.image} is not a file; give the path of a PNG or JPEG")
        if self.store.disk_dir is not None and self.store.disk_dir.exists() and not self.store.disk_dir.is_dir():
            raise ConfigError(f"{where}store.disk_dir: {self.store.disk_dir} is a file, not a folder; point it at a folder")
        if self.cache.window_start >= self.base.steps:
            raise ConfigError(
                f"{where}cache.window_start: must be below base.steps ({self.base.steps}), "
                f"got {self.cache.window_start}"
            )
        for name, text in (("prompt", self.base.prompt), ("negative_prompt", self.base.negative_prompt)):
            try:
                if text is not None:
                    prompt_spans(text, negative=name == "negative_prompt")
            except PromptSyntaxError as err:
                raise ConfigError(f"{where}base.{name}: {err}") from None
        for i, edit in enumerate(self.edits):
            self.tail_row(edit, f"{where}edits[{i}]")

    def _check_checkpoint_config(self, where: str) -> None:
        """``checkpoint_config:`` belongs to a single file and names a diffusers config folder."""
        folder = self.checkpoint_config
        if folder is None:
            return
        if not self.single_file:
            raise ConfigError(f"{where}checkpoint_config: {folder}, but model: {self.model} is a folder, which holds "
                              "its own configs; remove checkpoint_config:")  # fmt: skip
        if not (folder / "model_index.json").is_file():
            raise ConfigError(f"{where}checkpoint_config: {folder} has no model_index.json; point it at a diffusers "
                              "folder of that model (model_index.json, unet/, vae/, text_encoder/ configs, tokenizer/)")  # fmt: skip

    def _check_model(self, where: str) -> None:
        """``family:`` belongs to a single file; a single file's refusals come from its header."""
        self._check_checkpoint_config(where)
        try:  # the name artifacts are kept under, refused at load rather than at first use
            artifact_name(self.model)
        except ModelError as err:
            raise ConfigError(f"{where}model: {err}") from None
        if not self.single_file:
            if self.family is not None:
                raise ConfigError(f"{where}family: {self.family}, but model: {self.model} is a folder, whose "
                                  "model_index.json says its family; remove family:")  # fmt: skip
            return
        try:
            checkpoint_family(self.model, self.family)
        except ModelError as err:  # "family: ..." when the two disagree, else what the file is
            raise ConfigError(f"{where}{'' if str(err).startswith('family:') else 'model: '}{err}") from None

    def edit_defaults(self) -> EditDefaults:
        """What an edit that leaves a field out gets: ``cache:`` and ``preserve:``'s defaults."""
        c, p = self.cache, self.preserve
        return EditDefaults(c.default_strength, c.default_tail_fraction, p.mode, p.structure, self.tail.uncond, self.tail.deepcache)

    def tail_row(self, edit: Edit, where: str = "edit") -> TailRow:
        """``edit`` of this config's base as the row it runs (edit.resolve_edit), or a
        ConfigError naming the field and the fix."""
        try:
            return resolve_edit(edit, self.base, self.cache.window_start, self.edit_defaults(), where)
        except EditError as err:
            raise ConfigError(str(err)) from None
