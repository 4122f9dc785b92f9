"""The edit pipeline: text -> K/V, base generation that records its state, the batched edit tail.

Step i of a T-step DDIM chain maps latent x_i to x_{i+1} (x_0 is the noise, x_T the final
latent). A base keeps x_i for every i of its cache window, its prompt's K/V for every
cross-attention layer and its negative prompt's (unconditional) K/V. An edit row re-enters at
x_s with its own K/V and runs steps s..T-1. Rows are sorted by start step, so at step i the
active rows are a prefix of the batch: one ``unet_step`` call advances them all.

The step loop runs on :class:`StepBuffers` bound to the graph once per active-row count: per
step it writes three scalars per row, runs the binding and moves the output latents back
(blending masked rows with the base). The cached K/V are bound where they live and never
copied inside the loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
from tokenizers import Tokenizer

from .backend import Binding
from .buffers import StepBuffers
from .config import Base, Mask
from .errors import ConfigError
from .graph_set import GraphSet, graphs_from_artifacts
from .manifest import Manifest, load_manifest, model_files
from .profiles import EditBatchProfile
from .scheduler_ddim import DDIMConfig, DDIMSchedule

log = logging.getLogger(__name__)

Progress = Callable[[int], None]  # called with the number of steps just completed


@dataclass
class KV:
    """Cross-attention K/V of B prompts: ``tensors[2*i]`` is K of layer i, ``[2*i+1]`` its V."""

    tensors: list[np.ndarray]  # each [B, 77, C_i], float32

    def row(self, b: int) -> "KV":
        return KV([t[b : b + 1] for t in self.tensors])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class BaseState:
    """What a base keeps so that edits can re-enter its chain (see ARCHITECTURE.md, cache)."""

    base: Base
    fingerprint: str
    window_start: int
    latents: np.ndarray  # [T - window_start + 1, c, h, w]: x_i for i in window_start..T
    cond_kv: KV  # the base prompt's K/V, B = 1
    uncond_kv: KV  # the negative prompt's K/V, B = 1

    def latent(self, i: int) -> np.ndarray:
        """x_i as a [1, c, h, w] view into the cache (no copy)."""
        return self.latents[i - self.window_start][None]

    @property
    def final_latent(self) -> np.ndarray:
        return self.latents[-1][None]

    @property
    def nbytes(self) -> int:
        return self.latents.nbytes + self.cond_kv.nbytes + self.uncond_kv.nbytes


@dataclass
class TailRow:
    """One edit, resolved: the K/V mix, where it enters and how it is guided."""

    prompt: str
    strength: float
    start_step: int
    guidance: float
    mask: Optional[Mask] = None
    seed: Optional[int] = None


def prepare_row(
    state: BaseState,
    row: TailRow,
    edit_kv: Sequence[np.ndarray],
    schedule: DDIMSchedule,
    scale: int,
    buf: StepBuffers,
    r: int,
) -> None:
    """Write edit ``row``'s inputs into slot ``r`` of ``buf``, once, before its first step.

    ``edit_kv`` holds the edit prompt's K/V per layer, each [77, C_i].
    """
    # 1. K/V = K_base + strength * (K_edit - K_base), per layer (same for V)
    for dst, base_kv, e in zip(buf.cond_kv, state.cond_kv.tensors, edit_kv):
        np.subtract(e, base_kv[0], out=dst[r])
        dst[r] *= row.strength
        dst[r] += base_kv[0]
    # 2. the entry latent: the base's own x_s, or x_s re-noised from the final latent (seed)
    if row.seed is None:
        buf.latents[r] = state.latent(row.start_step)[0]
    else:
        a = schedule.alpha_t[row.start_step]
        noise = np.random.default_rng(row.seed).standard_normal(buf.latents.shape[1:], dtype=np.float32)
        buf.latents[r] = np.sqrt(a) * state.final_latent[0] + np.sqrt(1 - a) * noise
    buf.guidance[r] = row.guidance
    # 3. the mask in latent space: True where the row keeps the base's latent (the rectangle
    #    grows to whole latent pixels, so every pixel inside it may change)
    buf.keep[r] = row.mask is not None
    if row.mask is not None:
        m = row.mask
        buf.keep[r, :, m.y // scale : -(-(m.y + m.height) // scale), m.x // scale : -(-(m.x + m.width) // scale)] = False


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
    ):
        """``batch_profile`` is (min, opt, max) rows per call, ``image_size`` (height, width) in
        pixels for the engines of fixed latent size (TensorRT); both come from the config."""
        if model_dir is not None:
            model_files(model_dir)  # a missing model is the first thing to say, before artifacts
        self.manifest: Manifest = load_manifest(onnx_dir)
        if model_dir is not None:
            self.manifest.check_model(model_dir)
        self.tokenizer = Tokenizer.from_file(str(Path(onnx_dir) / "tokenizer.json"))
        self.ddim_config = DDIMConfig.from_scheduler_config(self.manifest.scheduler_config)
        self.scale = self.manifest.vae_scale_factor
        sample = self.manifest.data["model"]["sample_size"]
        h, w = (sample, sample) if image_size is None else (image_size[0] // self.scale, image_size[1] // self.scale)
        profile = EditBatchProfile(*batch_profile, h, w)
        self.graph_set: GraphSet = graphs_from_artifacts(self.manifest, engines_dir, backend, threads, profile)
        self.graphs = self.graph_set.graphs
        self.profile = self.graph_set.profile
        self.max_batch = self.profile.max_batch
        self.num_layers = len(self.manifest.layers)
        self.kv_dims = [layer["inner_dim"] for layer in self.manifest.layers for _ in ("k", "v")]
        self.text_len = self.manifest.data["model"]["text_len"]
        self.latent_channels = self.manifest.latent_channels
        # (bucket rows, latent shape) -> buffers, made on first use and kept for later tails
        self.buffers: dict[tuple[int, tuple[int, int, int]], StepBuffers] = {}

    def activate(self) -> "EditPipeline":
        for graph in self.graphs.values():
            graph.activate()
        return self

    def deactivate(self) -> None:
        for graph in self.graphs.values():
            graph.deactivate()
        self.buffers.clear()

    def __enter__(self) -> "EditPipeline":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    # --- text -------------------------------------------------------------------------------

    def input_ids(self, prompts: Sequence[str]) -> np.ndarray:
        """CLIP ids [B, 77]: BOS, the prompt's tokens, EOS, padding (as diffusers tokenizes)."""
        return np.array([e.ids for e in self.tokenizer.encode_batch(list(prompts))], dtype=np.int64)

    def kv_from_prompts(self, prompts: Sequence[str]) -> KV:
        """Every cross-attention layer's K/V for each prompt, batched (max_batch prompts a call)."""
        parts = []
        for lo in range(0, len(prompts), self.max_batch):
            ids = self.input_ids(prompts[lo : lo + self.max_batch])
            (hidden,) = self.graphs["text_encoder"].infer({"input_ids": ids})
            parts.append(self.graphs["kv_proj"].infer({"hidden_states": hidden}))
        if len(parts) == 1:
            return KV(list(parts[0]))
        return KV([np.concatenate(ts) for ts in zip(*parts)])

    # --- the chain --------------------------------------------------------------------------

    def latent_shape(self, base: Base) -> tuple[int, int, int]:
        multiple = self.scale * self.manifest.data["model"].get("latent_multiple", 1)
        for name in ("width", "height"):
            if getattr(base, name) % multiple:
                raise ConfigError(
                    f"base.{name}: {getattr(base, name)} is not a multiple of {multiple} "
                    f"(this model's VAE factor {self.scale} x UNet downsampling); pick a multiple"
                )
        return (self.latent_channels, base.height // self.scale, base.width // self.scale)

    def initial_noise(self, base: Base) -> np.ndarray:
        """x_0: standard normal noise from the base's seed (numpy PCG64), [1, c, h, w]."""
        rng = np.random.default_rng(base.seed)
        return rng.standard_normal((1, *self.latent_shape(base)), dtype=np.float32)

    def step_buffers(self, rows: int, latent_shape: tuple[int, int, int]) -> StepBuffers:
        """The buffers of the bucket that holds ``rows`` rows (made once, then reused)."""
        bucket = self.profile.bucket_for(rows)
        key = (bucket, latent_shape)
        if key not in self.buffers:
            self.buffers[key] = StepBuffers(bucket, latent_shape, self.kv_dims, self.text_len)
        return self.buffers[key]

    def generate_base(
        self,
        base: Base,
        window_start: int = 0,
        noise: Optional[np.ndarray] = None,
        progress: Optional[Progress] = None,
    ) -> BaseState:
        """Run the full T-step chain for ``base`` and keep its state from ``window_start`` on."""
        schedule = DDIMSchedule(self.ddim_config, base.steps)
        shape = self.latent_shape(base)
        kv = self.kv_from_prompts([base.prompt, base.negative_prompt])
        cond, uncond = kv.row(0), kv.row(1)
        latents = np.empty((base.steps - window_start + 1, *shape), dtype=np.float32)

        buf = self.step_buffers(1, shape)
        buf.latents[0] = self.initial_noise(base)[0] if noise is None else noise[0]
        for dst, src in zip(buf.cond_kv, cond.tensors):
            dst[0] = src[0]
        buf.guidance[0] = base.guidance
        buf.keep[0] = False
        if window_start == 0:
            latents[0] = buf.latents[0]

        def record(i: int, n: int) -> None:
            if i >= window_start:
                latents[i - window_start] = buf.latents[0]

        self._denoise(buf, 1, schedule, np.array([0]), uncond, [], record, progress)
        state = BaseState(base, self.manifest.fingerprint, window_start, latents, cond, uncond)
        log.debug("base state: %d latents, %.1f KiB", len(latents), state.nbytes / 1024)
        return state

    def run_tail(self, state: BaseState, rows: Sequence[TailRow], progress: Optional[Progress] = None) -> np.ndarray:
        """Run every row as one batched tail; returns the final latents [N, c, h, w] in row order.

        More rows than the profile's max_batch run as consecutive calls of max_batch rows.
        """
        T = state.base.steps
        for r, row in enumerate(rows):
            if not state.window_start <= row.start_step <= T - 1:
                raise ConfigError(
                    f"edits[{r}].start_step: {row.start_step} is outside the cache window "
                    f"[{state.window_start}, {T - 1}]"
                )
        final = np.empty((len(rows), *state.latents.shape[1:]), dtype=np.float32)
        if not rows:
            return final
        # 1. every row's K/V: K_base + strength * (K_edit - K_base); one text encoding per prompt
        prompts = sorted({row.prompt for row in rows})
        edit_kv = self.kv_from_prompts(prompts)
        for chunk in self.profile.chunks(len(rows)):
            final[chunk.start : chunk.stop] = self._tail_chunk(state, [rows[r] for r in chunk], prompts, edit_kv, progress)
        return final

    def _tail_chunk(self, state, rows, prompts, edit_kv: KV, progress) -> np.ndarray:
        schedule = DDIMSchedule(self.ddim_config, state.base.steps)
        # Sort by entry step: at step i the active rows are then a prefix of the batch.
        order = sorted(range(len(rows)), key=lambda r: rows[r].start_step)
        rows = [rows[r] for r in order]
        n = len(rows)
        c, h, w = shape = state.latents.shape[1:]
        buf = self.step_buffers(n, shape)

        masked = []
        for r, row in enumerate(rows):
            e = prompts.index(row.prompt)
            prepare_row(state, row, [t[e] for t in edit_kv.tensors], schedule, self.scale, buf, r)
            if row.mask is not None:
                masked.append(r)

        starts = np.array([row.start_step for row in rows])
        self._denoise(buf, n, schedule, starts, state.uncond_kv, masked, lambda i, k: None, progress, state)
        final = np.empty((n, c, h, w), dtype=np.float32)
        final[order] = buf.latents[:n]
        return final

    def _denoise(
        self,
        buf: StepBuffers,
        n: int,
        schedule: DDIMSchedule,
        starts: np.ndarray,
        uncond: KV,
        masked: Sequence[int],
        after_step: Callable[[int, int], None],
        progress: Optional[Progress],
        state: Optional[BaseState] = None,
    ) -> None:
        """Advance rows ``buf.latents[:n]`` (sorted by ``starts``) in place to x_T.

        A row joins at its start step. Masked rows are blended with ``state``'s latent of the
        same step after every step.
        """
        # diffusers' convention: guidance <= 1 disables CFG (the conditional prediction alone),
        # which the fused formula uncond + g (cond - uncond) gives at g = 1.
        np.maximum(buf.guidance[:n], 1.0, out=buf.guidance[:n])
        buf.uncond_index[:n] = 0
        static = frozenset(name for name in buf.step_inputs(0, uncond.tensors) if "cond_" in name)
        bindings: dict[int, Binding] = {}
        step_graph = self.graphs["unet_step"]
        for i in range(int(starts.min()), schedule.num_inference_steps):
            active = int(np.searchsorted(starts, i, side="right"))
            if active not in bindings:
                # Once per active-row count, not per step: rows join at only a few steps.
                inputs = buf.step_inputs(active, uncond.tensors)
                bindings[active] = step_graph.bind(inputs, {"next_latents": buf.next_latents[:active]}, static)
            buf.timestep[:active] = schedule.timesteps[i]
            buf.alpha_t[:active] = schedule.alpha_t[i]
            buf.alpha_prev[:active] = schedule.alpha_prev[i]
            bindings[active].run()
            buf.latents[:active] = buf.next_latents[:active]
            for r in masked:
                if r < active:
                    np.copyto(buf.latents[r], state.latent(i + 1)[0], where=buf.keep[r])
            after_step(i + 1, active)
            if progress is not None:
                progress(1)

    def decode(self, latents: np.ndarray) -> np.ndarray:
        """Final latents [N, c, h, w] -> images [N, H, W, 3] in [0, 1], float32."""
        images = []
        for lo in range(0, len(latents), self.max_batch):
            (part,) = self.graphs["vae_decoder"].infer({"latents": np.ascontiguousarray(latents[lo : lo + self.max_batch])})
            images.append(part)
        return np.concatenate(images).transpose(0, 2, 3, 1)
