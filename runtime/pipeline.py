"""The edit pipeline: text -> K/V, base generation that records its state, the batched edit tail.

Step i of a T-step DDIM chain maps latent x_i to x_{i+1} (x_0 is the noise, x_T the final
latent). A base keeps x_i for every i of its cache window, its prompt's K/V for every
cross-attention layer and its negative prompt's (unconditional) K/V. An edit row re-enters at
x_s with its own K/V and runs steps s..T-1. Rows are sorted by start step, so at step i the
active rows are a prefix of the batch: one ``unet_step`` call advances them all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
from tokenizers import Tokenizer

from .backend import OrtGraph
from .config import Base, Mask
from .errors import ConfigError
from .manifest import Manifest, load_manifest, model_files
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


class EditPipeline:
    """Runs the four exported graphs. Use as a context manager, or call activate()/deactivate()."""

    def __init__(self, onnx_dir: Path, model_dir: Optional[Path] = None, threads: int = 0):
        if model_dir is not None:
            model_files(model_dir)  # a missing model is the first thing to say, before artifacts
        self.manifest: Manifest = load_manifest(onnx_dir)
        if model_dir is not None:
            self.manifest.check_model(model_dir)
        self.tokenizer = Tokenizer.from_file(str(Path(onnx_dir) / "tokenizer.json"))
        self.ddim_config = DDIMConfig.from_scheduler_config(self.manifest.scheduler_config)
        self.graphs = {
            name: OrtGraph(self.manifest.path(name), threads)
            for name in ("text_encoder", "kv_proj", "unet_step", "vae_decoder")
        }
        self.num_layers = len(self.manifest.layers)
        self.latent_channels = self.manifest.latent_channels
        self.scale = self.manifest.vae_scale_factor
        self._uncond_index = np.zeros(0, dtype=np.int64)

    def activate(self) -> "EditPipeline":
        for graph in self.graphs.values():
            graph.activate()
        return self

    def deactivate(self) -> None:
        for graph in self.graphs.values():
            graph.deactivate()

    def __enter__(self) -> "EditPipeline":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    # --- text -------------------------------------------------------------------------------

    def input_ids(self, prompts: Sequence[str]) -> np.ndarray:
        """CLIP ids [B, 77]: BOS, the prompt's tokens, EOS, padding (as diffusers tokenizes)."""
        return np.array([e.ids for e in self.tokenizer.encode_batch(list(prompts))], dtype=np.int64)

    def kv_from_prompts(self, prompts: Sequence[str]) -> KV:
        """Every cross-attention layer's K/V for each prompt, batched over the prompts."""
        (hidden,) = self.graphs["text_encoder"].infer({"input_ids": self.input_ids(prompts)})
        return KV(self.graphs["kv_proj"].infer({"hidden_states": hidden}))

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

    def generate_base(
        self,
        base: Base,
        window_start: int = 0,
        noise: Optional[np.ndarray] = None,
        progress: Optional[Progress] = None,
    ) -> BaseState:
        """Run the full T-step chain for ``base`` and keep its state from ``window_start`` on."""
        schedule = DDIMSchedule(self.ddim_config, base.steps)
        # x is denoised in place: never alias the caller's noise.
        x = self.initial_noise(base) if noise is None else np.array(noise, dtype=np.float32, copy=True)
        kv = self.kv_from_prompts([base.prompt, base.negative_prompt])
        cond, uncond = kv.row(0), kv.row(1)
        latents = np.empty((base.steps - window_start + 1, *x.shape[1:]), dtype=np.float32)
        if window_start == 0:
            latents[0] = x[0]

        def record(i: int, batch: np.ndarray) -> None:
            if i >= window_start:
                latents[i - window_start] = batch[0]

        self._denoise(
            x, schedule, np.array([0]), cond, uncond, np.array([base.guidance], np.float32), record, progress
        )
        state = BaseState(base, self.manifest.fingerprint, window_start, latents, cond, uncond)
        log.debug("base state: %d latents, %.1f KiB", len(latents), state.nbytes / 1024)
        return state

    def run_tail(self, state: BaseState, rows: Sequence[TailRow], progress: Optional[Progress] = None) -> np.ndarray:
        """Run every row as one batched tail; returns the final latents [N, c, h, w] in row order."""
        base, T = state.base, state.base.steps
        schedule = DDIMSchedule(self.ddim_config, T)
        for r, row in enumerate(rows):
            if not state.window_start <= row.start_step <= T - 1:
                raise ConfigError(
                    f"edits[{r}].start_step: {row.start_step} is outside the cache window "
                    f"[{state.window_start}, {T - 1}]"
                )
        # Sort by entry step: at step i the active rows are then a prefix of the batch.
        order = sorted(range(len(rows)), key=lambda r: rows[r].start_step)
        rows = [rows[r] for r in order]
        n = len(rows)
        c, h, w = state.latents.shape[1:]

        # 1. each row's K/V: K_base + strength * (K_edit - K_base), built once for the tail
        prompts = sorted({row.prompt for row in rows})
        edit_kv = self.kv_from_prompts(prompts)
        which = np.array([prompts.index(row.prompt) for row in rows])
        strength = np.array([row.strength for row in rows], dtype=np.float32)[:, None, None]
        cond = KV([b + strength * (e[which] - b) for b, e in zip(state.cond_kv.tensors, edit_kv.tensors)])

        # 2. entry latents: the base's own x_s, or x_s re-noised from the final latent (seed)
        x = np.empty((n, c, h, w), dtype=np.float32)
        for r, row in enumerate(rows):
            if row.seed is None:
                x[r] = state.latent(row.start_step)[0]
            else:
                a = schedule.alpha_t[row.start_step]
                noise = np.random.default_rng(row.seed).standard_normal((c, h, w), dtype=np.float32)
                x[r] = np.sqrt(a) * state.final_latent[0] + np.sqrt(1 - a) * noise

        # 3. masks in latent space: True where the row must keep the base's latent
        keep = np.zeros((n, 1, h, w), dtype=bool)
        masked = []
        for r, row in enumerate(rows):
            if row.mask is not None:
                keep[r] = True
                m, s = row.mask, self.scale
                keep[r, :, m.y // s : -(-(m.y + m.height) // s), m.x // s : -(-(m.x + m.width) // s)] = False
                masked.append(r)

        def blend(i: int, batch: np.ndarray) -> None:
            for r in masked:
                if r < len(batch):
                    np.copyto(batch[r], state.latent(i)[0], where=keep[r])

        starts = np.array([row.start_step for row in rows])
        guidance = np.array([row.guidance for row in rows], dtype=np.float32)
        self._denoise(x, schedule, starts, cond, state.uncond_kv, guidance, blend, progress)
        final = np.empty_like(x)
        final[order] = x
        return final

    def _denoise(
        self,
        x: np.ndarray,
        schedule: DDIMSchedule,
        starts: np.ndarray,
        cond: KV,
        uncond: KV,
        guidance: np.ndarray,
        after_step: Callable[[int, np.ndarray], None],
        progress: Optional[Progress],
    ) -> None:
        """Advance rows ``x`` (sorted by ``starts``) in place to x_T; rows join at their start.

        Per step only the prefix of active rows is fed, as views of the batch buffers: the
        cached K/V are never copied inside the loop.
        """
        n = len(x)
        # diffusers' convention: guidance <= 1 disables CFG (the conditional prediction alone),
        # which the fused formula uncond + g (cond - uncond) gives at g = 1.
        guidance = np.maximum(guidance, 1.0).astype(np.float32)
        feeds: dict[str, np.ndarray] = {}
        timestep = np.empty(n, dtype=np.float32)
        alpha_t = np.empty(n, dtype=np.float32)
        alpha_prev = np.empty(n, dtype=np.float32)
        uncond_index = np.zeros(n, dtype=np.int64)
        for i in range(self.num_layers):
            feeds[f"cond_k_{i}"] = cond.tensors[2 * i]
            feeds[f"cond_v_{i}"] = cond.tensors[2 * i + 1]
            feeds[f"uncond_k_{i}"] = uncond.tensors[2 * i]
            feeds[f"uncond_v_{i}"] = uncond.tensors[2 * i + 1]
        step_graph = self.graphs["unet_step"]
        for i in range(int(starts.min()), schedule.num_inference_steps):
            active = int(np.searchsorted(starts, i, side="right"))
            timestep[:active] = schedule.timesteps[i]
            alpha_t[:active] = schedule.alpha_t[i]
            alpha_prev[:active] = schedule.alpha_prev[i]
            step_feeds = {
                name: (value[:active] if name.startswith("cond_") else value) for name, value in feeds.items()
            }
            step_feeds.update(
                latents=x[:active],
                timestep=timestep[:active],
                alpha_t=alpha_t[:active],
                alpha_prev=alpha_prev[:active],
                guidance=guidance[:active],
                uncond_index=uncond_index[:active],
            )
            (x[:active],) = step_graph.infer(step_feeds)
            after_step(i + 1, x[:active])
            if progress is not None:
                progress(1)

    def decode(self, latents: np.ndarray) -> np.ndarray:
        """Final latents [N, c, h, w] -> images [N, H, W, 3] in [0, 1], float32."""
        (images,) = self.graphs["vae_decoder"].infer({"latents": np.ascontiguousarray(latents)})
        return images.transpose(0, 2, 3, 1)
