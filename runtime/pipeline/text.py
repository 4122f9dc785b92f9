"""Prompts -> K/V: the pipeline's text side (tokenizing with AUTOMATIC1111's emphasis, the
text encoder graph, the emphasis on its hidden states, the K/V projection of every
cross-attention layer) and the family's per-row conditioning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from tokenizers import Tokenizer

from ..engine.manifest import Manifest
from ..errors import ArtifactError, ConfigError
from ..metrics import Metrics, timed
from ..model.adapters import AdapterBank
from ..model.directions import word_end_ids
from ..model.edit import Base
from ..model.guidance_embedding import guidance_embedding
from ..model.state import KV
from ..model.weighting import SpanTokenizer, WeightedIds, emphasize, encoder_widths, prompt_spans


def tokenizers_from_export(onnx_dir: Path, names: Sequence[str]) -> list[Tokenizer]:
    """The export's tokenizer files ``names`` (SDXL has two); ArtifactError naming the file and the fix."""
    tokenizers = []
    for name in names:
        try:
            tokenizers.append(Tokenizer.from_file(str(Path(onnx_dir) / name)))
        except Exception as err:  # the tokenizers library raises its own types
            raise ArtifactError(f"{onnx_dir}/{name} cannot be loaded ({err}); re-run `make export`") from None
    return tokenizers


class PromptEncoder:
    """Prompts -> ids (with their emphasis weights), K/V and the family's extras, on the export's
    ``text_encoder`` and ``kv_proj`` graphs; and a row's per-row conditioning."""

    def __init__(self, manifest: Manifest, graphs: Mapping[str, Any], tokenizers: Sequence[Tokenizer],
                 adapter_bank: Optional[AdapterBank], max_batch: int, metrics: Metrics):  # fmt: skip
        """``graphs`` the pipeline's (name -> graph), ``tokenizers`` the export's
        (:func:`tokenizers_from_export`), ``adapter_bank`` the LoRA slots the text graphs read
        (None: an export without slots), ``max_batch`` the prompts per graph call, ``metrics``
        where the text_encode stage is timed (the pipeline hands over the server's own)."""
        self.manifest = manifest
        self.graphs = graphs
        self.family = manifest.family
        self.tokenizers = list(tokenizers)
        self.tokenizer = self.tokenizers[0]
        # A1111's weighted spans -> ids and a weight per id (model/weighting.py), one per tokenizer
        self.span_tokenizers = [SpanTokenizer(t) for t in self.tokenizers]
        self._text_widths: Optional[list[int]] = None  # each text encoder's hidden columns, found on first use
        self.conds = self.family.get("conds", [])
        # the conds that come from the prompt (SDXL's pooled embedding): kept with its K/V (KV.extras)
        self.pooled = [c["name"] for c in self.conds if c["source"] == "pooled"]
        self.adapter_bank = adapter_bank
        self.max_batch = max_batch
        self.metrics = metrics
        self.special_ids = {self.tokenizer.token_to_id(t) for t in ("<|startoftext|>", "<|endoftext|>")} - {None}
        # the ids that end a word: an edit's tokens align to its base's by words (model/directions.py)
        self.word_ends = word_end_ids(self.tokenizer.get_vocab()) or None

    def input_ids(self, prompts: Sequence[str], tokenizer: Optional[Tokenizer] = None) -> np.ndarray:
        """CLIP ids [B, 77]: BOS, the prompt's tokens, EOS, padding (as diffusers tokenizes), of
        the prompts' text without their weighting syntax (``a (red:1.3) car``: ``a red car``)."""
        k = self.tokenizers.index(tokenizer) if tokenizer is not None else 0
        return np.stack([self.span_tokenizers[k].encode(prompt_spans(p)).ids for p in prompts])

    def weighted_ids(self, prompts: Sequence[str], negative: bool = False) -> list[list[WeightedIds]]:
        """Per tokenizer, each prompt's ids and their weights (AUTOMATIC1111's emphasis syntax,
        model/weighting.py); a syntax edit-rt does not run raises PromptSyntaxError."""
        spans = [prompt_spans(p, negative) for p in prompts]
        return [[tokenizer.encode(s) for s in spans] for tokenizer in self.span_tokenizers]

    def text_widths(self, width: int) -> list[int]:
        """Each text encoder's columns of the ``width`` hidden-state columns, in order: the
        emphasis restores each encoder's own mean (A1111 weights SDXL's two encoders apart).
        The manifest records only the sum; weighting.encoder_widths finds them from the text
        graph, once."""
        if self._text_widths is None:
            if len(self.tokenizers) == 1:
                self._text_widths = [width]
            else:
                names = [spec.name for spec in self.manifest.graphs["text_encoder"].inputs]
                plain = {name: self.input_ids([""], t) for name, t in zip(names, self.tokenizers)}
                encode = lambda feeds: self.graphs["text_encoder"].infer({**feeds, **self._adapter_feeds("text_encoder", None, 1)})[0][0, 0]  # noqa: E731
                changed = [encode({**plain, name: self.input_ids(["a photo"], t)})
                           for name, t in zip(names, self.tokenizers)]  # fmt: skip
                self._text_widths = encoder_widths(encode(plain), changed)
        return self._text_widths

    def _adapter_feeds(self, graph: str, scales: Optional[np.ndarray], rows: int) -> dict[str, np.ndarray]:
        """``graph``'s adapter inputs (none without slots): the rows' scales per slot and the
        resident slots' matrices (model/adapters.py)."""
        bank = self.adapter_bank
        if bank is None or graph not in bank.weights:
            return {}
        scale = np.zeros((rows, bank.slots), dtype=np.float32) if scales is None else scales
        return {"adapter_scale": scale, **bank.weights[graph]}

    @timed("text_encode")
    def kv_from_prompts(self, prompts: Sequence[Optional[str]], clip_skip: int = 0, negative: bool = False,
                        scales: Optional[tuple[np.ndarray, np.ndarray]] = None) -> KV:  # fmt: skip
        """Every cross-attention layer's K/V for each prompt, and the family's extras (SDXL's
        pooled embedding), batched (max_batch prompts a call).

        ``clip_skip`` picks the text encoder's layer (0: the family's default). ``negative``
        prompts keep the default layer; a negative prompt of None (none given) is zeros where
        the family says so (SDXL's ``force_zeros_for_empty_prompt``) and the empty prompt
        elsewhere, while ``""`` is always the empty prompt encoded, as diffusers forms them.
        ``scales``: each prompt's adapter scales per slot, (text ``[B, slots]``, UNet ``[B,
        slots]``): the text encoders take the first, kv_proj (the UNet's attn2.to_k/to_v) the
        second; None: no adapter.
        """
        skips = self.family.get("clip_skips", 1)
        if not 0 <= clip_skip < skips:
            raise ConfigError(f"base.clip_skip: {clip_skip} is outside [0, {skips - 1}] for this model's text encoder")
        layer = 0 if negative and not self.family.get("negative_clip_skip") else clip_skip
        parts = []
        for lo in range(0, len(prompts), self.max_batch):
            given = list(prompts[lo : lo + self.max_batch])
            chunk = ["" if p is None else p for p in given]
            names = [spec.name for spec in self.manifest.graphs["text_encoder"].inputs]  # one per tokenizer
            tokens = self.weighted_ids(chunk, negative)  # every prompt parsed before anything runs
            feeds = {name: np.stack([w.ids for w in ws]) for name, ws in zip(names, tokens)}
            text_scale, unet_scale = (None, None) if scales is None else (s[lo : lo + self.max_batch] for s in scales)
            feeds.update(self._adapter_feeds("text_encoder", text_scale, len(chunk)))
            outputs = self.graphs["text_encoder"].infer(feeds)
            hidden = np.ascontiguousarray(outputs[0][:, layer])
            for b in range(len(chunk)):  # A1111's emphasis on the weighted prompts' hidden states
                if any(ws[b].weighted for ws in tokens):
                    weights = [ws[b].weights for ws in tokens]
                    hidden[b] = emphasize(hidden[b], weights, self.text_widths(hidden.shape[-1]))
            pooled = outputs[1] if len(outputs) > 1 else None
            if negative and self.family.get("zero_empty_negative"):
                empty = np.array([p is None for p in given])
                hidden[empty] = 0.0
                if pooled is not None:
                    pooled[empty] = 0.0
            kv = list(self.graphs["kv_proj"].infer({"hidden_states": hidden,
                                                    **self._adapter_feeds("kv_proj", unet_scale, len(chunk))}))  # fmt: skip
            parts.append((kv, {name: pooled for name in self.pooled}))
        tensors = [np.concatenate(ts) for ts in zip(*(kv for kv, _ in parts))]
        extras = {k: np.concatenate([e[k] for _, e in parts]) for k in parts[0][1]}
        return KV(tensors, extras)

    @timed("text_encode")
    def prompt_embeddings(self, prompts: Sequence[str], clip_skip: int = 0, kind: str = "mean") -> np.ndarray:
        """Each prompt's text embedding for finding related bases, [B, D] float32, unit length,
        from the text encoder's hidden states at ``clip_skip``'s layer (the states the K/V come
        from): ``mean`` over its tokens, BOS to EOS (padding left out: it would pull every short
        prompt together), or ``eos``, the state at its EOS token (CLIP's pooled position).
        docs/related.md measures what each separates."""
        names = [spec.name for spec in self.manifest.graphs["text_encoder"].inputs]
        eos = self.input_ids([""])[0][1]  # the empty prompt is BOS, EOS, padding
        out = []
        for lo in range(0, len(prompts), self.max_batch):
            chunk = list(prompts[lo : lo + self.max_batch])
            feeds = {name: np.stack([w.ids for w in ws]) for name, ws in zip(names, self.weighted_ids(chunk))}
            feeds.update(self._adapter_feeds("text_encoder", None, len(chunk)))
            hidden = self.graphs["text_encoder"].infer(feeds)[0][:, clip_skip]  # [b, 77, D]
            ids = feeds[names[0]]
            for b in range(len(chunk)):
                n = int(np.argmax(ids[b] == eos)) + 1 if (ids[b] == eos).any() else ids.shape[1]
                v = (hidden[b, :n].mean(axis=0) if kind == "mean" else hidden[b, n - 1]).astype(np.float64)
                out.append((v / max(np.linalg.norm(v), 1e-12)).astype(np.float32))
        return np.stack(out)

    def row_conds(self, base: Base, kv: KV) -> dict[str, np.ndarray]:
        """A row's values of the family's per-row conditioning (none for SD 1.x/2.x): the
        pooled embedding from ``kv`` (already mixed by strength), the size ids from ``base``."""
        out = {}
        for cond in self.conds:
            if cond["source"] == "pooled":
                out[cond["name"]] = np.ascontiguousarray(kv.extras[cond["name"]][0], dtype=np.float32)
            elif cond["source"] == "time_ids":
                out[cond["name"]] = np.array(base.time_ids(), dtype=np.float32)
        return out

    def guidance_conds(self, guidance: float) -> dict[str, np.ndarray]:
        """A full LCM's guidance embedding of a row at ``guidance`` (its UNet's ``timestep_cond``:
        model/guidance_embedding.py); {} for a model whose guidance is CFG's."""
        return {cond["name"]: guidance_embedding(guidance, int(cond["dim"]))
                for cond in self.conds if cond["source"] == "guidance"}  # fmt: skip
