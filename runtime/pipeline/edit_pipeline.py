"""The edit pipeline: the compiled graphs, base generation, inversion and batched edit tails.

It is composed of one object per concept, each given what it needs: the prompts' K/V
(``text``: text.py), what an edit keeps of its base (``preservation``: preserve.py), the
autoencoders (``decoders``: decoders.py) and what fits in memory at each size
(``memory_fit``: memory_fit.py). The calls other layers make of them (the row resolver's
:class:`~edit_rt.runtime.loop.resolve.Model`, the server, the CLI) stay here, each one line.

Generation and tails are rows of one :class:`~edit_rt.runtime.loop.row_scheduler.RowScheduler` (one per
latent size), driven by its :class:`~edit_rt.runtime.loop.batcher.Batcher`: ``generate_base`` and
``run_tail`` submit one request and drive the loop until it is done; ``edit-rt serve`` runs the
same batcher on the engine thread (engine/engine_thread.py). There is no other step loop.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
from tokenizers import Tokenizer

from ..engine.engine_thread import EngineThread
from ..engine.graph_set import GraphSet, graphs_from_artifacts
from ..engine.manifest import Manifest, load_manifest, model_files
from ..engine.profiles import EditBatchProfile
from ..engine.step_signature import StepSignature
from ..errors import ArtifactError, ConfigError
from ..loop.batcher import Batcher
from ..loop.jobs import Job, Request
from ..loop.resolve import RowResolver
from ..loop.rows import pow2_buckets
from ..loop.row_scheduler import RowScheduler
from ..metrics import Metrics, timed
from ..model.adapters import Adapter, AdapterBank, load_adapter
from ..model.automask import AutoMask
from ..model.edit import Base, Mask, Preserve, TailRow
from ..model.samplers import IMAGE_SAMPLER, default_sampler, schedule_for
from ..model.scheduler_ddim import DDIMConfig
from ..model.step_coefs import Schedule
from ..model.state import KV, BaseState
from .decoders import Decoders
from .images import to_uint8
from .memory_fit import MemoryFit
from .preserve import Preservation
from .text import PromptEncoder, tokenizers_from_export

__all__ = ["EditPipeline", "KV", "BaseState", "TailRow"]

log = logging.getLogger(__name__)

Progress = Callable[[int], None]  # called with the number of row-steps just completed


def edit_batch_profile(manifest: Manifest, batch_profile: tuple[int, int, int], image_size: Optional[tuple[int, int]],
                       extra_image_sizes: Sequence[tuple[int, int]], max_uncond_sets: int, vae_max_batch: int) -> EditBatchProfile:
    """The shapes the engines are built for (`edit-rt engines`) and the pipeline runs at:
    ``batch_profile`` (min, opt, max) rows, the latent size of ``image_size`` and of each of
    ``extra_image_sizes`` ((height, width) in pixels; None: the model's sample size), and what the
    export fixes (its LoRA slots and rank, ``step_all_given``)."""
    scale = manifest.vae_scale_factor
    sample = manifest.data["model"]["sample_size"]
    h, w = (sample, sample) if image_size is None else (image_size[0] // scale, image_size[1] // scale)
    extra = tuple((eh // scale, ew // scale) for eh, ew in extra_image_sizes)  # (height, width) each
    spec = manifest.adapters
    return EditBatchProfile(*batch_profile, h, w, max_uncond_sets, scale, vae_max_batch, extra, spec["slots"], spec["rank"],
                            manifest.step_all_given)  # fmt: skip


class EditPipeline:
    """Runs the four compiled graphs. Use as a context manager, or call activate()/deactivate()."""

    def __init__(
        self,
        onnx_dir: Path,
        model_dir: Optional[Path] = None,
        threads: int = 0,
        backend: str = "ort-cpu",
        engines_dir: Optional[Path] = None,
        batch_profile: tuple[int, int, int] = (1, 8, 32),
        image_size: Optional[tuple[int, int]] = None,
        max_uncond_sets: int = 4,
        cuda_graphs: bool = True,
        reuse_entry: bool = True,
        preserve: Optional[Preserve] = None,
        precision: str = "fp16",
        buckets: str = "auto",
        vae_max_batch: int = 8,
        extra_image_sizes: Sequence[tuple[int, int]] = (),
        adapters: Optional[Mapping[str, Path]] = None,
        max_memory: Optional[int] = None,
    ):
        """``batch_profile`` is (min, opt, max) rows per call, ``image_size`` (height, width) in
        pixels for the engines of fixed latent size (TensorRT), ``max_uncond_sets`` the distinct
        negative prompts one call may mix; all come from the config. ``reuse_entry`` takes an
        edit's first unconditional prediction from its base (off only to measure the saving);
        ``preserve`` holds the knobs of ``preserve: auto`` edits (the config's ``preserve:``);
        ``precision`` what ``ort-tensorrt`` builds in; ``buckets`` the row counts step calls run
        at: ``pow2`` (1, 2, 4, ... max: one captured graph each), ``exact`` (every count: no
        padding), ``auto`` (pow2 on GPU backends, exact on the CPU, where a padded row costs as
        much as a real one); ``vae_max_batch`` the VAE's rows per call; ``adapters`` name ->
        converted LoRA file (export/compile/adapters.py), loaded into the export's adapter slots on use;
        ``max_memory`` the bytes the CPU path may use in all (None: what the machine has free):
        a step call runs at the rows that fit, a decode at the images that fit (memory.py)."""
        if model_dir is not None:
            model_files(model_dir)  # a missing model is the first thing to say, before artifacts
        self.manifest: Manifest = load_manifest(onnx_dir)
        if model_dir is not None:
            self.manifest.check_model(model_dir)
        self.family = self.manifest.family
        self.signature = StepSignature.from_manifest(self.manifest)  # the step graph's inputs by role
        self.shallow_signature = StepSignature.from_manifest(self.manifest, "unet_step_shallow")  # DeepCache's
        tokenizers = tokenizers_from_export(onnx_dir, self.family["tokenizers"])  # before the graphs load
        self.ddim_config = DDIMConfig.from_scheduler_config(self.manifest.scheduler_config)
        # the sampler a base names none runs: the model folder's scheduler (samplers.py)
        self.default_sampler = default_sampler(self.manifest.scheduler_config)
        self._schedules: dict[tuple[str, int], Schedule] = {}
        self.scale = self.manifest.vae_scale_factor
        profile = edit_batch_profile(self.manifest, batch_profile, image_size, extra_image_sizes, max_uncond_sets, vae_max_batch)
        self.graph_set: GraphSet = graphs_from_artifacts(self.manifest, engines_dir, backend, threads, profile,
                                                         cuda_graphs, precision, max_memory)  # fmt: skip
        self.graphs = self.graph_set.graphs
        self.profile = self.graph_set.profile
        self.max_batch = self.profile.max_batch
        self.max_uncond_sets = self.profile.max_sets
        if buckets not in ("auto", "pow2", "exact"):
            raise ConfigError(f"engines.buckets: {buckets!r} is not one of auto, pow2, exact")
        # pow2 buckets where a row count is a compiled shape: a GPU's captured graph, an
        # OpenVINO compile (static shapes; not a graph compiled once with dynamic axes, as SD
        # 1.5's UNet is); ONNX Runtime on the CPU runs any count as it comes
        static = self.graph_set.backend != "ort-cpu" and getattr(self.graphs["unet_step"], "static", True)
        self.buckets = (pow2_buckets(self.profile.min_batch, self.max_batch)
                        if buckets == "pow2" or (buckets == "auto" and static) else None)  # fmt: skip
        # The one thread that calls the graphs once `edit-rt serve` starts it (engine_thread.py).
        self.engine = EngineThread()
        self.resolver = RowResolver(self)  # jobs -> rows, finished rows -> results
        self._metrics = Metrics()  # the stages' seconds (@timed); the server's own once service.py hands it over
        self.reuse_entry = reuse_entry
        # LoRA slots (model/adapters.py): the adapters known by name, resident when rows use them
        spec = self.manifest.adapters
        self.adapter_bank: Optional[AdapterBank] = AdapterBank(spec) if spec["slots"] else None
        if adapters and self.adapter_bank is None:
            raise ConfigError(f"adapters: {', '.join(adapters)} configured, but {onnx_dir} was exported without "
                              "adapter slots; set export.adapter_slots (e.g. 4) and re-run `make export`")  # fmt: skip
        for name, path in (adapters or {}).items():
            self.load_adapter(name, path)
        self.num_layers = len(self.manifest.layers)
        self.text_len = self.manifest.data["model"]["text_len"]
        self.latent_channels = self.manifest.latent_channels
        self.map_factor = self.manifest.data["graphs"]["unet_step"]["map_factor"]
        # latent shape -> the batcher (and its row scheduler), made on first use and kept
        self.batchers: dict[tuple[int, int, int], Batcher] = {}
        self.memory_fit = MemoryFit(self.manifest, self.graph_set, max_memory)
        self.text = PromptEncoder(self.manifest, self.graphs, tokenizers, self.adapter_bank, self.max_batch, self._metrics)
        self.decoders = Decoders(self.manifest, self.graphs, self.profile, self.memory_fit, self._metrics)
        self.preservation = Preservation(self.text, self.decoders, self.scale, self.map_factor, preserve or Preserve())

    def activate(self) -> "EditPipeline":
        """Load every graph but those made on first use (graph_set.LAZY on the CPU)."""
        for graph in self.graphs.values():
            if not getattr(graph, "lazy", False):
                graph.activate()
        return self

    def deactivate(self) -> None:
        for batcher in self.batchers.values():
            batcher.stop(timeout=0)
            self.engine.call(batcher.scheduler.free).result(timeout=30)
        self.batchers.clear()
        self.engine.stop()
        for graph in self.graphs.values():
            graph.deactivate()
        self.graph_set.device.free()  # the shared stream (and TensorRT's context memory)

    def __enter__(self) -> "EditPipeline":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    @property
    def metrics(self) -> Metrics:
        """Where the stages time themselves (text encode, decode, inversion: ``@timed``)."""
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: Metrics) -> None:
        # the server hands over its own (service.py): every component's stages are timed there
        self._metrics = self.text.metrics = self.decoders.metrics = metrics

    # --- the components' calls other layers make (the row resolver's Model, the server, the CLI) --

    @property
    def pooled(self) -> list[str]:
        return self.text.pooled

    @property
    def special_ids(self) -> set[int]:
        return self.text.special_ids

    @property
    def word_ends(self) -> Optional[frozenset[int]]:
        return self.text.word_ends

    def input_ids(self, prompts: Sequence[str], tokenizer: Optional[Tokenizer] = None) -> np.ndarray:
        return self.text.input_ids(prompts, tokenizer)

    def kv_from_prompts(self, prompts: Sequence[Optional[str]], clip_skip: int = 0, negative: bool = False,
                        scales: Optional[tuple[np.ndarray, np.ndarray]] = None) -> KV:  # fmt: skip
        return self.text.kv_from_prompts(prompts, clip_skip, negative, scales)

    def prompt_embeddings(self, prompts: Sequence[str], clip_skip: int = 0, kind: str = "mean") -> np.ndarray:
        return self.text.prompt_embeddings(prompts, clip_skip, kind)

    def row_conds(self, base: Base, kv: KV) -> dict[str, np.ndarray]:
        return self.text.row_conds(base, kv)

    def guidance_conds(self, guidance: float) -> dict[str, np.ndarray]:
        return self.text.guidance_conds(guidance)

    def keep_mask(self, mask: Optional[Mask], latent_shape: Sequence[int]) -> Optional[np.ndarray]:
        return self.preservation.keep_mask(mask, latent_shape)

    def pixel_keep(self, pixel_mask: np.ndarray, latent_shape: Sequence[int]) -> np.ndarray:
        return self.preservation.pixel_keep(pixel_mask, latent_shape)

    def auto_mask(self, base_prompt: str, row: TailRow, latent_shape: Sequence[int]) -> tuple[Optional[AutoMask], str]:
        return self.preservation.auto_mask(base_prompt, row, latent_shape)

    def with_base(self, image: np.ndarray, state: BaseState, row: TailRow, keep: Optional[np.ndarray],
                  decoder: str = "vae") -> np.ndarray:  # fmt: skip
        return self.preservation.with_base(image, state, row, keep, decoder)

    def base_image(self, state: BaseState, decoder: str = "vae") -> np.ndarray:
        return self.preservation.base_image(state, decoder)

    def render_each(self, state: BaseState, rows: Sequence[TailRow], results: Sequence,
                    decoder: str = "vae") -> Iterator[np.ndarray]:  # fmt: skip
        return self.preservation.render_each(state, rows, results, decoder)

    def check_decoder(self, decoder: str, field: str = "decoder") -> str:
        return self.decoders.check_decoder(decoder, field)

    def encoder_for(self, decoder: str) -> str:
        return self.decoders.encoder_for(decoder)

    def decode_rows(self, latent_shape: Sequence[int], decoder: str = "vae") -> int:
        return self.decoders.decode_rows(latent_shape, decoder)

    def decode(self, latents: np.ndarray, decoder: str = "vae") -> np.ndarray:
        return self.decoders.decode(latents, decoder)

    def decode_preview(self, latents: np.ndarray) -> np.ndarray:
        return self.decoders.decode_preview(latents)

    # --- the chain --------------------------------------------------------------------------

    def latent_shape(self, base: Base) -> tuple[int, int, int]:
        multiple = self.scale * self.manifest.data["model"].get("latent_multiple", 1)
        for name in ("width", "height"):
            if getattr(base, name) % multiple:
                raise ConfigError(
                    f"base.{name}: {getattr(base, name)} is not a multiple of {multiple} "
                    f"(this model's VAE factor {self.scale} x UNet downsampling); pick a multiple"
                )
        shape = (self.latent_channels, base.height // self.scale, base.width // self.scale)
        self.memory_fit.check(base, shape)
        return shape

    def sampler_of(self, base: Base) -> str:
        """The sampler ``base`` runs: its own, or the model's (``default_sampler``)."""
        return base.sampler or self.default_sampler

    def schedule(self, sampler: Optional[str], steps: int) -> Schedule:
        """``sampler``'s (None: the model's) timesteps and coefficients for ``steps`` steps, made once."""
        key = (sampler or self.default_sampler, steps)
        if key not in self._schedules:
            self._schedules[key] = schedule_for(key[0], self.manifest.scheduler_config, steps)
        return self._schedules[key]

    def initial_noise(self, base: Base) -> np.ndarray:
        """x_0: standard normal noise from the base's seed (numpy PCG64), [1, c, h, w]."""
        rng = np.random.default_rng(base.seed)
        return rng.standard_normal((1, *self.latent_shape(base)), dtype=np.float32)

    def load_adapter(self, name: str, path: Path) -> Adapter:
        """Make the converted adapter at ``path`` known as ``name`` (resident once a row uses it):
        no graph is exported or built again."""
        adapter = load_adapter(path, name, self.manifest)
        if adapter.rank > self.adapter_bank.rank:
            raise ArtifactError(f"adapters.{name}: rank {adapter.rank} is above the export's adapter_rank "
                                f"{self.adapter_bank.rank}; run `edit-rt adapters CONFIG`")  # fmt: skip
        self.adapter_bank.adapters[name] = adapter  # a resident older file keeps its slot for its rows
        return adapter

    def held_adapter_slots(self) -> set[int]:
        """The adapter slots rows of any batcher still read (never reloaded under them)."""
        held: set[int] = set()
        for batcher in self.batchers.values():
            s = batcher.scheduler
            for row in [*s.active, *s.pending, *(r for unit, _ in batcher.probation for r in unit)]:
                held |= row.adapter_slots
        return held

    def new_scheduler(self, latent_shape: Sequence[int], max_rows: Optional[int] = None, graph=None,
                      shallow_graph=None) -> RowScheduler:  # fmt: skip
        """Resident slots for ``max_rows`` rows (the profile's max_batch) of ``latent_shape``
        latents on ``graph`` (this pipeline's step graph) and ``shallow_graph`` (its DeepCache
        variant)."""
        f = self.map_factor
        return RowScheduler(
            graph or self.graphs["unet_step"], self.signature,
            tuple(latent_shape), max_rows or self.max_batch, self.max_uncond_sets, self.text_len, self.reuse_entry,
            map_hw=(latent_shape[1] // f, latent_shape[2] // f),
            blend_graph=self.graphs["latent_blend"], buckets=pow2_buckets(self.profile.min_batch, max_rows or self.max_batch) if self.buckets else None,
            adapters=self.adapter_bank,
            shallow=(shallow_graph or self.graphs["unet_step_shallow"], self.shallow_signature),
            all_given=self.profile.step_all_given,  # a TensorRT plan's own: its E range
        )  # fmt: skip

    def batcher(self, latent_shape: Sequence[int]) -> Batcher:
        """The batcher (and resident slots) for latents of ``latent_shape``, made once."""
        latent_shape = tuple(latent_shape)
        if latent_shape not in self.batchers:
            rows = self.memory_fit.step_rows(latent_shape) or self.max_batch  # the rows that fit in memory
            self.batchers[latent_shape] = Batcher(self.resolver, self.new_scheduler(latent_shape, rows), engine=self.engine)
        return self.batchers[latent_shape]

    def _run(self, jobs: list[Job], request: Request, shape, progress: Optional[Progress], errors: bool = False) -> list:
        if progress is not None:
            done = {}

            def on_progress(index: int, step: int, of: int) -> None:
                progress(step - done.get(index, 0))
                done[index] = step

            request.on_progress = on_progress
        return self.batcher(shape).run(request, jobs, errors)

    def generate_base(
        self,
        base: Base,
        window_start: int = 0,
        noise: Optional[np.ndarray] = None,
        progress: Optional[Progress] = None,
        known: Optional[np.ndarray] = None,
        pixel_mask: Optional[np.ndarray] = None,
    ) -> BaseState:
        """Run the full T-step chain for ``base`` and keep its state from ``window_start`` on.

        ``known`` ([c, h, w] latent) with ``pixel_mask`` ([H, W], 1 where the chain may change,
        as an edit's): a generation around what is known, as diffusers' inpainting with a plain
        UNet runs it (``StableDiffusionInpaintPipeline``, 4 channels): after each step ``i`` the
        kept positions take ``known`` noised to step ``i + 1``'s level with the generation's own
        noise, the last step's ``known`` itself. Edits of this base with the same mask keep those
        positions exactly (a planner's present and scene: plans.py)."""
        if (known is None) != (pixel_mask is None):
            raise ConfigError("known: a generation around known positions takes both known and pixel_mask")
        shape = self.latent_shape(base)
        noise = self.initial_noise(base) if noise is None else noise
        request = Request(uuid.uuid4().hex, decode=False)
        if known is None:
            job = Job(request, 0, base, TailRow(base.prompt, 1.0, 0, base.guidance), noise=noise, kind="generate")
        else:  # a tail from step 0 of the noised knowns, recorded as a base (resolve.py: "related")
            anchors = self._noised(base, np.asarray(known, dtype=np.float32), noise)
            kv = self.text.kv_from_prompts([base.prompt], base.clip_skip)
            uncond = self.text.kv_from_prompts([base.negative_prompt], negative=True)
            known_state = BaseState(base, self.manifest.fingerprint, 0, anchors, kv, uncond)
            row = TailRow(base.prompt, 1.0, 0, base.guidance, pixel_mask=pixel_mask)
            job = Job(request, 0, base, row, state=known_state, kind="related")
        (result,) = self._run([job], request, shape, progress)
        state = result.state
        if window_start:
            state = state.windowed(window_start)
        log.debug("base state: %d latents, %.1f KiB", len(state.latents), state.nbytes / 1024)
        return state

    def _noised(self, base: Base, known: np.ndarray, noise: np.ndarray) -> np.ndarray:
        """x_i of ``known`` for i in 0..T: the noise itself at step 0, ``sqrt(a_i) known +
        sqrt(1 - a_i) noise`` between (``a_i``: the sampler's alpha-bar at step i, as diffusers'
        ``add_noise`` at its timestep), ``known`` at T."""
        sampler = self.sampler_of(base)
        if sampler != IMAGE_SAMPLER:  # alpha_t is alpha-bar in DDIM's schedule (the sigma samplers' differ)
            raise ConfigError(f"base.sampler: {sampler}; a generation around known positions runs {IMAGE_SAMPLER} "
                              f"(set base.sampler: {IMAGE_SAMPLER})")  # fmt: skip
        schedule = self.schedule(sampler, base.steps)
        if known.shape != noise.shape[1:]:
            raise ConfigError(f"known: a latent of shape {list(noise.shape[1:])} for this base, not {list(known.shape)}")
        a = np.asarray(schedule.alpha_t, dtype=np.float64)[1 : base.steps, None, None, None]
        between = (np.sqrt(a) * known + np.sqrt(1 - a) * noise).astype(np.float32)
        return np.concatenate([noise, between, known[None]])

    @timed("inversion")
    def invert(self, image: np.ndarray, base: Base, window_start: int = 0, progress: Optional[Progress] = None,
               encoder: str = "vae") -> BaseState:  # fmt: skip
        """A base state from an image: DDIM inversion over the window, with Direct Inversion's
        per-step corrections (Ju et al. 2023), so that the base's own row, and an identity
        edit from any step, end at the image's latent exactly (up to the VAE).

        1. encode the image (``encoder``: decoders.py) to z*_T and run DDIM backwards with ``base.prompt`` (the
           image's description; guidance 1) to z*_{window_start}: T - window_start rows, in turn;
        2. from every z*_i one forward step as the base's rows take it (its prompt, guidance and
           negative prompt): x^_{i+1}, and the unconditional prediction u_i; all in one tail;
        3. keep d_i = z*_{i+1} - x^_{i+1}: every edit row of this base adds it after step i;
           and the image's own pixels (uint8), which a masked edit shows outside its mask.
        """
        shape = self.latent_shape(base)
        T = base.steps
        z0 = self.decoders.encode_image(image, encoder)
        request = Request(uuid.uuid4().hex, decode=False)
        job = Job(request, 0, base, TailRow(base.prompt, 1.0, window_start, 1.0), noise=z0, kind="invert")
        (inversion,) = self._run([job], request, shape, progress)
        inverted = np.ascontiguousarray(inversion.record.latents[::-1])  # z*_ws .. z*_T
        cond = self.text.kv_from_prompts([base.prompt], base.clip_skip)
        uncond = self.text.kv_from_prompts([base.negative_prompt], negative=True)
        partial = BaseState(base, self.manifest.fingerprint, window_start, inverted, cond, uncond)
        request = Request(uuid.uuid4().hex, decode=False)
        steps = list(range(window_start, T))
        jobs = [Job(request, k, base, TailRow(base.prompt, 1.0, i, base.guidance), state=partial, kind="correct")
                for k, i in enumerate(steps)]  # fmt: skip
        results = self._run(jobs, request, shape, progress)
        stepped = np.stack([r.latent for r in results])
        # unguided rows compute no u (rows.py): the image's base keeps none, as a generated one
        uncond_out = None if results[0].record.uncond is None else np.stack([r.record.uncond[i] for r, i in zip(results, steps)])
        return dataclasses.replace(partial, uncond_out=uncond_out, corrections=inverted[1:] - stepped, source=to_uint8(image))

    def run_tail(self, state: BaseState, rows: Sequence[TailRow], progress: Optional[Progress] = None) -> np.ndarray:
        """Run every row as one batched tail; returns the final latents [N, c, h, w] in row order.

        Rows join the loop as slots free up: more rows than ``max_batch`` need no chunking.
        """
        results = self.edit(state, rows, progress, decode=False)
        if not results:
            return np.empty((0, *state.latents.shape[1:]), dtype=np.float32)
        return np.stack([r.latent for r in results])

    def edit(self, state: BaseState, rows: Sequence[TailRow], progress: Optional[Progress] = None,
             decode: bool = True, errors: bool = False, decoder: str = "vae") -> list:  # fmt: skip
        """Run ``rows`` as one batched tail: a RowResult each (images composited with the base
        outside their masks when ``decode``, by ``decoder``: decoders.py); ``errors``: a failed
        row's exception in its place (the others run on) instead of raising the first."""
        T = state.base.steps
        for r, row in enumerate(rows):
            if not state.window_start <= row.start_step <= T - 1:
                raise ConfigError(
                    f"edits[{r}].start_step: {row.start_step} is outside the cache window "
                    f"[{state.window_start}, {T - 1}]"
                )
        if not rows:
            return []
        shape = tuple(state.latents.shape[1:])
        request = Request(uuid.uuid4().hex, decode=decode, decoder=self.decoders.check_decoder(decoder))
        jobs = [Job(request, i, state.base, row, state=state, kind="edit") for i, row in enumerate(rows)]
        return self._run(jobs, request, shape, progress, errors)

