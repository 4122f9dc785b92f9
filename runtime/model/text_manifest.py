"""What an exported text model is (issue 56): its sizes, its kind, its graphs.

export/compile/text_export.py writes ``text_manifest.json`` beside ``text_full.onnx``,
``text_cached.onnx`` and ``tokenizer.json``; the decoding loops read only this (never torch). A
model is ``causal`` (autoregressive: a token sees the tokens before it) or not (masked diffusion:
every token sees every other, and ``mask_id`` marks what is still to decode).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ArtifactError

MANIFEST_NAME = "text_manifest.json"
TEXT_GRAPHS = ("text_full", "text_cached")
FORMAT = "edit-rt-text/1"


@dataclass(frozen=True)
class TextManifest:
    vocab_size: int
    d_model: int
    layers: int
    heads: int
    max_len: int
    causal: bool
    mask_id: int
    eos_id: int
    graphs: tuple[str, ...] = TEXT_GRAPHS
    source: str = ""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def kind(self) -> str:
        return "autoregressive" if self.causal else "masked diffusion"

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self), "graphs": list(self.graphs)}

    @classmethod
    def load(cls, folder: Path) -> "TextManifest":
        path = Path(folder) / MANIFEST_NAME
        if not path.exists():
            raise ArtifactError(f"{path}: no text model exported there; run `edit-rt export CONFIG` on its text config")
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ArtifactError(f"{path}: format {data.get('format')!r}, this edit-rt reads {FORMAT}; export it again")
        data.pop("format")
        data["graphs"] = tuple(data["graphs"])
        return cls(**data)
