"""A text model (export/compile/text_model.py) as ONNX graphs whose cached K/V are inputs (issue 56).

Two graphs of one model, the same weights:

- ``text_full``: ``input_ids [N, L]`` and ``positions [L]`` -> ``logits [N, L, vocab]`` and ``kv
  [layers, 2, N, heads, L, head_dim]``: every token of a text at once (the cache off, or the
  cache's refresh);
- ``text_cached``: the same and ``past_kv [layers, 2, Np, heads, P, head_dim]`` (``Np`` 1 or N):
  the queried tokens attend to themselves and to the P cached ones.

Every axis but the model's own sizes is dynamic: the batch, the queried length, the cached
length, the cache's batch. ``text_manifest.json`` beside them holds the model's spec and the
graphs' names; ``tokenizer.json`` is copied in. The legacy exporter (``dynamo=False``, opset 17),
as the UNet's graphs (ARCHITECTURE.md's checked facts).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from edit_rt.runtime.model.text_manifest import MANIFEST_NAME, TEXT_GRAPHS, TextManifest

from .text_model import load_text_model

OPSET = 17


class _Full(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)


class _Cached(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, past_kv):
        return self.model(input_ids, positions, past_kv)


def export_text(model_dir: Path, out: Path) -> Path:
    """``model_dir``'s model as ``out/text_full.onnx`` and ``out/text_cached.onnx`` with the manifest."""
    model_dir, out = Path(model_dir), Path(out)
    model = load_text_model(model_dir)
    spec = model.spec
    out.mkdir(parents=True, exist_ok=True)
    n, lq, p = 2, 5, 3
    ids = torch.randint(3, spec.vocab_size, (n, lq))
    positions = torch.arange(p, p + lq)
    past = torch.randn(spec.layers, 2, n, spec.heads, p, spec.head_dim)
    outputs_axes = {"logits": {0: "batch", 1: "queried"}, "kv": {2: "batch", 4: "queried"}}
    with torch.no_grad():
        torch.onnx.export(_Full(model), (ids, positions), str(out / "text_full.onnx"), dynamo=False, opset_version=OPSET,
                          input_names=["input_ids", "positions"], output_names=["logits", "kv"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "queried"}, "positions": {0: "queried"}, **outputs_axes})  # fmt: skip
        torch.onnx.export(_Cached(model), (ids, positions, past), str(out / "text_cached.onnx"), dynamo=False,
                          opset_version=OPSET, input_names=["input_ids", "positions", "past_kv"], output_names=["logits", "kv"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "queried"}, "positions": {0: "queried"},
                                        "past_kv": {2: "cache_batch", 4: "cached"}, **outputs_axes})  # fmt: skip
    shutil.copyfile(model_dir / "tokenizer.json", out / "tokenizer.json")
    manifest = TextManifest(spec.vocab_size, spec.d_model, spec.layers, spec.heads, spec.max_len, spec.causal, spec.mask_id,
                            spec.eos_id, graphs=TEXT_GRAPHS, source=str(model_dir))  # fmt: skip
    (out / MANIFEST_NAME).write_text(json.dumps(manifest.to_json(), indent=1))
    return out
