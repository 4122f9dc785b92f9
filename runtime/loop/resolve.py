"""Where an edit becomes rows: the resolver between the jobs callers submit and the step loop.

:class:`RowResolver` is what the :class:`~edit_rt.runtime.loop.batcher.Batcher` calls, and the only
thing of the model it sees:

- :meth:`RowResolver.rows`: each job's :class:`~edit_rt.runtime.loop.rows.Row`: its prompt's K/V
  (one batched encoding per kind; a prompt the text encoder refuses fails its own rows only),
  mixed with the base's by its terms' strengths and aligned tokens (``K_base + sum_i s_i
  (K_i[pi_i] - K_base)``, model/directions.py), its entry latent (the
  base's x_s, or re-noised for a seeded variation), mask, ``preserve: auto`` maps, structure
  window, and what a generation or an inversion records;
- :meth:`RowResolver.reference`: the reference row of a group that keeps its base's structure;
- :meth:`RowResolver.results`: what finished rows give back (decoded and composited images,
  a generation's base state).

It works on a model object with the pipeline's text and image calls (:class:`Model`); it
imports neither the pipeline nor the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict
from typing import Any, Optional, Protocol, Sequence

import numpy as np

from ..errors import EditRtError, RowError
from ..model.directions import mixed_kv, token_permutation
from ..model.edit import TailRow
from ..model.step_coefs import Schedule
from ..model.scheduler_ddim import DDIMSchedule, InverseDDIMSchedule
from ..model.state import KV, BaseState
from .adapter_rows import NONE, RowAdapters, row_adapters, text_scales
from .jobs import Job, RowResult
from .rows import Recording, Row
from .uncond_reuse import BaseUncond

log = logging.getLogger(__name__)


class Model(Protocol):
    """The pipeline's calls the resolver makes (pipeline/edit_pipeline.py's EditPipeline has them)."""

    ddim_config: Any
    pooled: list[str]
    manifest: Any
    metrics: Any  # metrics.Metrics: the kv_mix stage is timed here
    special_ids: set[int]  # BOS, EOS (and padding): tokens that are no word
    word_ends: Optional[frozenset[int]]  # ids that end a word (directions.word_end_ids)

    def schedule(self, sampler: Optional[str], steps: int) -> Schedule: ...  # None: the model's own
    def input_ids(self, prompts: Sequence[str]) -> np.ndarray: ...

    def kv_from_prompts(self, prompts: Sequence[str], clip_skip: int = 0, negative: bool = False,
                        scales: Optional[tuple[np.ndarray, np.ndarray]] = None) -> KV: ...  # fmt: skip
    def row_conds(self, base: Any, kv: KV) -> dict[str, np.ndarray]: ...
    def guidance_conds(self, guidance: float) -> dict[str, np.ndarray]: ...  # {}: guidance is CFG's
    def auto_mask(self, base_prompt: str, row: TailRow, latent_shape: Sequence[int]) -> tuple[Any, str]: ...
    def keep_mask(self, mask: Any, latent_shape: Sequence[int]) -> Optional[np.ndarray]: ...
    def pixel_keep(self, pixel_mask: np.ndarray, latent_shape: Sequence[int]) -> np.ndarray: ...
    def decode(self, latents: np.ndarray, decoder: str = "vae") -> np.ndarray: ...
    def decode_preview(self, latents: np.ndarray) -> np.ndarray: ...  # the tiny decoder where there is one
    def with_base(self, image: np.ndarray, state: BaseState, row: TailRow, keep: Optional[np.ndarray],
                  decoder: str = "vae") -> np.ndarray: ...  # fmt: skip


# The K/V of recently encoded prompts (no text adapters), least recently used first out past this
# many bytes: a slider move (a new strength, an adapter's UNet scale) re-mixes them with no text
# encoding. SD 1.5: 7.5 MB a prompt, ~17 kept; the shapes model: thousands.
ENCODED_BYTES = 128 * 2**20


class RowResolver:
    def __init__(self, model: Model, encoded_bytes: int = ENCODED_BYTES):
        self.model = model
        self.encoded: OrderedDict[tuple, KV] = OrderedDict()
        self.encoded_bytes, self.encoded_limit = 0, encoded_bytes

    # --- jobs -> rows ---------------------------------------------------------------------------

    def rows(self, jobs: list[Job]) -> tuple[list[tuple[Job, Row]], list[tuple[Job, Exception]]]:
        """Each job's row, or the error that refuses it (the job's input, not the server's)."""
        built, failed = [], []
        # LoRA first: each job's adapters resident in slots no running row holds
        bank, held = getattr(self.model, "adapter_bank", None), set()
        if bank is not None:
            held = self.model.held_adapter_slots()
        ads = {}
        for job in list(jobs):
            try:
                ads[id(job)] = row_adapters(job, bank, held)
            except EditRtError as err:
                failed.append((job, err))
        jobs = [job for job in jobs if id(job) in ads]
        # a negative prompt of None (the family's default) sorts apart from every text
        keys = {key for job in jobs for key in self._needs(job, ads[id(job)])}
        kv = self._encode(sorted(keys, key=lambda k: (k[0] is not None, k[0] or "", *k[1:])), bank)
        for job in jobs:
            try:
                built.append((job, self._row(job, kv, ads[id(job)])))
            except Exception as err:  # this row's input: fail it alone
                log.info("row %s/%d refused: %s", job.request.id, job.index, err)
                failed.append((job, err if isinstance(err, EditRtError) else RowError(f"{type(err).__name__}: {err}")))
        return built, failed

    def _encode(self, keys: list[tuple[Optional[str], int, bool, tuple]], bank=None) -> dict[tuple, KV | Exception]:
        """K/V per (prompt, clip_skip, negative, adapters' text key), one batched encoding per
        kind (each prompt with its own adapter scales); a prompt that fails is retried alone,
        so only its own rows fail."""
        out: dict[tuple, KV | Exception] = {}
        for key in keys:
            if key in self.encoded:
                self.encoded.move_to_end(key)
                out[key] = self.encoded[key]
        keys = [key for key in keys if key not in out]
        for kind in sorted({(skip, negative) for _, skip, negative, _ in keys}):
            group = [(p, text) for p, skip, negative, text in keys if (skip, negative) == kind]
            prompts = [p for p, _ in group]
            try:
                kv = self.model.kv_from_prompts(prompts, *kind, scales=text_scales(bank, [t for _, t in group]))
                out.update({(p, *kind, t): kv.row(k) for k, (p, t) in enumerate(group)})
            except Exception:
                for p, t in group:
                    try:
                        out[(p, *kind, t)] = self.model.kv_from_prompts([p], *kind, scales=text_scales(bank, [t]))
                    except Exception as err:  # the tokenizer or text encoder refused this text
                        out[(p, *kind, t)] = err
        for key in keys:
            self._keep_encoded(key, out[key])
        return out

    def _keep_encoded(self, key: tuple, kv: KV | Exception) -> None:
        """Keep a fresh encoding (none under text adapters: their scales make every key new)."""
        if isinstance(kv, Exception) or key[3] or kv.nbytes > self.encoded_limit:
            return
        # its own arrays: a row of a batched encoding is a view that would keep the whole batch
        self.encoded[key] = kv = KV([t.copy() for t in kv.tensors], {k: v.copy() for k, v in kv.extras.items()})
        self.encoded_bytes += kv.nbytes
        while self.encoded_bytes > self.encoded_limit:
            _, dropped = self.encoded.popitem(last=False)
            self.encoded_bytes -= dropped.nbytes

    @staticmethod
    def _needs(job: Job, ad: RowAdapters = NONE) -> list[tuple[Optional[str], int, bool, tuple]]:
        """The encodings a job's row needs: its prompts (TailRow.terms: its prompt and its
        directions; at its base's clip_skip, under its adapters' text scales) and, for a row
        that starts a base, the negative prompt; an edit whose text adapters are not its base's
        also the base prompt and the negative prompt under them (its cached K/V hold the base's)."""
        keys = [(p, job.base.clip_skip, False, ad.text) for p, _ in job.row.terms]
        if job.state is None:
            keys.append((job.base.negative_prompt, 0, True, ad.text))
        elif ad.text != ad.base_text:
            keys += [(job.state.base.prompt, job.base.clip_skip, False, ad.text), (job.base.negative_prompt, 0, True, ad.text)]
        return keys

    def _row(self, job: Job, kv: dict, ad: RowAdapters = NONE) -> Row:
        """The scheduler row of ``job``: its K/V mix, entry latent, mask, what it records."""
        for key in self._needs(job, ad):
            if isinstance(kv.get(key), Exception):
                err = kv[key]
                raise RowError(f"the prompt {key[0][:40]!r} cannot be encoded ({type(err).__name__}: {err})")
        row = self._embedded_guidance(self._row_kv(job, kv, ad))
        row.adapter_scale, row.adapter_slots, row.base_adapter_scale = ad.unet_scale, ad.slots, ad.base_unet_scale
        return row

    def _row_kv(self, job: Job, kv: dict, ad: RowAdapters) -> Row:
        model, base = self.model, job.base
        edit = kv.get((job.row.prompt, base.clip_skip, False, ad.text))  # None: an edit's, adding nothing (TailRow.terms)
        negative = kv.get((base.negative_prompt, 0, True, ad.text))
        shape = job.noise.shape[1:] if job.state is None else job.state.latents.shape[1:]
        conds = model.row_conds(base, edit) if edit is not None else {}
        if job.kind in ("invert", "correct"):  # an image's inversion and its corrections run DDIM (pipeline.invert)
            schedule = DDIMSchedule(model.ddim_config, base.steps)
        else:  # a base's own sampler, and every edit's of it: a row never switches sampler
            schedule = model.schedule((base if job.state is None else job.state.base).sampler, base.steps)
        if job.kind == "invert":  # the source prompt's prediction alone, backwards, recording
            inverse = InverseDDIMSchedule(schedule, job.row.start_step, base.steps)
            K = inverse.num_inference_steps
            record = Recording(np.empty((K + 1, *shape), dtype=np.float32), np.empty((K, *shape), dtype=np.float32))
            record.latents[0] = job.noise[0]
            return Row(inverse, 0, job.noise[0].copy(), 1.0, [t[0] for t in edit.tensors], negative,
                       record=record, conds=conds, owner=job)  # fmt: skip
        if job.kind == "correct":  # one forward step from the inverted latent, recording u
            T, i = base.steps, job.row.start_step
            record = Recording(np.empty((T + 1, *shape), dtype=np.float32), np.empty((T, *shape), dtype=np.float32))
            return Row(schedule, i, job.state.latent(i)[0].copy(), job.row.guidance, [t[0] for t in edit.tensors],
                       job.state.uncond_kv, record=record, stop=i + 1, conds=conds, owner=job)  # fmt: skip
        if job.kind == "generate":  # a base: its own prompt's K/V, from noise, recording
            T = base.steps
            record = Recording(np.empty((T + 1, *shape), dtype=np.float32), np.empty((T, *shape), dtype=np.float32),
                               np.empty((T, *shape), dtype=np.float32) if schedule.history else None)  # fmt: skip
            # x_0: the noise at the sampler's initial sigma (VP latents: 1 but for Euler's)
            record.latents[0] = job.noise[0] * np.float32(schedule.init_sigma) if schedule.init_sigma != 1 else job.noise[0]
            return Row(schedule, 0, record.latents[0].copy(), job.row.guidance, [t[0] for t in edit.tensors], negative,
                       record=record, conds=conds, owner=job, noise_seed=base.seed, deepcache=base.deepcache)  # fmt: skip
        if job.kind == "related":  # a related generation (serving/related.py): its related base's
            # tail at strength 1, i.e. with its own prompt's K/V, recording from the entry step; with a
            # mask, kept to the state's latents where it keeps them (a generation around known positions:
            # EditPipeline.generate_base)
            state, T, k = job.state, base.steps, job.row.start_step
            keep = self._keep(job.row, shape)
            record = Recording(np.empty((T + 1, *shape), dtype=np.float32), np.empty((T, *shape), dtype=np.float32),
                               np.empty((T, *shape), dtype=np.float32) if schedule.history else None)  # fmt: skip
            record.latents[k] = state.latent(k)[0]
            return Row(schedule, k, record.latents[k].copy(), job.row.guidance, [t[0] for t in edit.tensors], state.uncond_kv,
                       entry_uncond=state.entry_uncond(k), record=record, conds=conds, owner=job, keep=keep,
                       base=state if keep is not None else None,
                       history=state.history(k) if schedule.history else None, noise_seed=state.base.seed,
                       deepcache=base.deepcache)  # fmt: skip
        state, tail = job.state, job.row  # an edit: a tail of its base
        auto, job.preserve = model.auto_mask(state.base.prompt, tail, shape)
        # the base prompt's and the negative prompt's K/V under the row's text adapters
        own = ad.text == ad.base_text
        cond_base = state.cond_kv if own else kv[(state.base.prompt, base.clip_skip, False, ad.text)]
        uncond = state.uncond_kv if own else kv[(base.negative_prompt, 0, True, ad.text)]
        with model.metrics.stage("kv_mix"):
            mixed = self._mixed(job, kv, cond_base, ad.text)
        structure = math.ceil(tail.structure * (base.steps - tail.start_step))  # steps that keep it
        # the base's u holds for its own chain only: the same weights (so the same negative
        # prompt's K/V), no re-noising; over the whole tail (tail.uncond) also the same guidance
        same_chain = tail.seed is None and ad.same_as_base
        reuse = tail.uncond != "compute" and same_chain and tail.guidance == state.base.guidance \
            and state.uncond_out is not None  # fmt: skip
        job.uncond = tail.uncond if reuse else "compute"
        return Row(
            schedule, tail.start_step, entry_latent(state, tail, schedule), tail.guidance,
            [t[0] for t in mixed.tensors], uncond,
            entry_uncond=state.entry_uncond(tail.start_step) if same_chain else None,
            keep=self._keep(tail, shape), base=state, auto=auto,
            corrections=state if state.corrections is not None else None,
            conds=model.row_conds(base, mixed), structure_end=tail.start_step + structure, owner=job,
            history=state.history(tail.start_step) if schedule.history else None, noise_seed=state.base.seed,
            given=BaseUncond(state, tail.uncond, model.ddim_config.prediction_type) if reuse else None,
            deepcache=tail.deepcache,
        )  # fmt: skip

    def _embedded_guidance(self, row: Row) -> Row:
        """``row`` on a model that takes its guidance as an embedding (a full LCM): the embedding
        of its guidance among its conds, and unguided (its UNet runs the conditional half only)."""
        extra = self.model.guidance_conds(row.guidance)
        return dataclasses.replace(row, conds={**row.conds, **extra}, unguided=True) if extra else row

    def _mixed(self, job: Job, kv: dict, cond_base: KV, text: tuple) -> KV:
        """An edit row's K/V: ``cond_base`` plus each of its terms' difference, token by aligned
        token (the first tokenizer's ids: SDXL's second tokenizes the same words alike)."""
        terms, skip = job.row.terms, job.base.clip_skip
        ids = self.model.input_ids([job.state.base.prompt, *(p for p, _ in terms)])
        perms = [token_permutation(ids[0], row_ids, self.model.special_ids, self.model.word_ends) for row_ids in ids[1:]]
        return mixed_kv(cond_base, [(kv[(p, skip, False, text)], s, pi) for (p, s), pi in zip(terms, perms)])

    def _keep(self, tail: TailRow, shape: Sequence[int]) -> Optional[np.ndarray]:
        """Where an edit row keeps the base's latent: outside its rectangle and outside its
        pixel mask (both, when it has both: only where each lets it may it change)."""
        keep = self.model.keep_mask(tail.mask, shape)
        if tail.pixel_mask is not None:
            pixels = self.model.pixel_keep(tail.pixel_mask, shape)
            keep = pixels if keep is None else keep | pixels
        return keep

    def reference(self, rows: Sequence[Row]) -> Row:
        """The reference row of a group of rows keeping structure (one base, entry step and
        structure window, so ``rows[0]`` speaks for them): its base's own tail from the same step, with the base's K/V and guidance, reset to the
        base's kept latent after every step (exact by construction), for as long as the group
        keeps structure. It takes its base's unconditional prediction as given at its entry step
        only when every row of the group does: a row that computes its own (a seed of its own, a
        rejoin after a failure) takes that half's self-attention pattern from the reference,
        which must then compute it too, whatever else shares the call (a call with an unguided
        row computes every entry row's; one without did not, and the row fell back on its own)."""
        row = rows[0]
        state = row.base
        given = all(r.entry_uncond is not None for r in rows)
        ref = Row(row.schedule, row.step, state.latent(row.step)[0].copy(), state.base.guidance,
                  [t[0] for t in state.cond_kv.tensors], state.uncond_kv,
                  entry_uncond=state.entry_uncond(row.step) if given else None,
                  keep=np.ones((1, *row.latent.shape[1:]), dtype=bool), base=state,
                  conds=self.model.row_conds(state.base, state.cond_kv), stop=row.structure_end, reference=True,
                  history=None if row.history is None else state.history(row.step), noise_seed=row.noise_seed,
                  deepcache=row.deepcache)  # fmt: skip
        ref = self._embedded_guidance(ref)
        # the base's own adapters (resident: its edit's row placed them with its own)
        ref.adapter_scale, ref.adapter_slots = row.base_adapter_scale, row.adapter_slots
        return ref

    # --- rows -> results ----------------------------------------------------------------------

    def previews(self, rows: list[Row]) -> list[np.ndarray]:
        """The decoded x_0 estimates of rows that just ran a preview step, [H, W, 3] each."""
        return list(self.model.decode_preview(np.stack([row.preview for row in rows])))

    def results(self, jobs: list[Job]) -> list[RowResult]:
        """What each finished job gives back: its latent, its image (decoded, with the base's
        pixels outside an edit's mask) when its request asked for images, a generation's state."""
        decode = [job for job in jobs if job.request.decode]
        image_of = {}
        if decode:
            for decoder in dict.fromkeys(job.request.decoder for job in decode):  # one call per decoder
                chosen = [job for job in decode if job.request.decoder == decoder]
                images = self.model.decode(np.stack([job.scheduled.latent for job in chosen]), decoder)
                for job, image in zip(chosen, images):
                    if job.state is not None:  # outside its mask an edit shows the base's own pixels
                        image = self.model.with_base(image, job.state, job.row, job.scheduled.keep, decoder)
                    image_of[id(job)] = image
        out = []
        for job in jobs:
            row = job.scheduled
            state = None
            if row.record is not None and job.kind in ("generate", "related"):
                state = self._recorded_state(job, row)
            out.append(RowResult(row.latent, image_of.get(id(job)), state, time.perf_counter() - job.started,
                                 job.preserve, row.keep, row.record, job.uncond))  # fmt: skip
        return out

    def _recorded_state(self, job: Job, row: Row) -> BaseState:
        """What a generation row recorded, as a base state: from step 0, or a related
        generation's from its entry step k (window k: steps before it were its related base's,
        under another prompt; its history at k is that base's)."""
        cond = KV([t[None] for t in row.kv], {name: row.conds[name][None] for name in self.model.pooled})
        k, record = row.entry, row.record
        x0 = None  # a multistep sampler's: from step k - 2 on (BaseState.x0)
        if record.x0 is not None:
            before = np.zeros((2, *record.x0.shape[1:]), np.float32) if job.state is None else job.state.history(k)[::-1]
            x0 = np.concatenate([before, record.x0[k:]])
        # an unguided generation computed no u: its edits compute their own (guided ones need it)
        uncond_out = None if record.uncond is None else record.uncond[k:]
        return BaseState(job.base, self.model.manifest.fingerprint, k, record.latents[k:], cond, row.uncond,
                         uncond_out, x0=x0)


def entry_latent(state: BaseState, row: TailRow, schedule: Schedule) -> np.ndarray:
    """The base's own x_s, or (``row.seed``) x_s re-noised from the final latent for a variation."""
    if row.seed is None:
        return state.latent(row.start_step)[0].copy()
    a = schedule.alpha_t[row.start_step]
    noise = np.random.default_rng(row.seed).standard_normal(state.latents.shape[1:], dtype=np.float32)
    return (np.sqrt(a) * state.final_latent[0] + np.sqrt(1 - a) * noise).astype(np.float32)
