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


TEXT_ENGINES_NAME = "text_engines.json"
REBUILD = "run `edit-rt engines CONFIG` on the text config again"


@dataclass(frozen=True)
class TextEngines:
    """A folder of TensorRT plans of a text model's graphs (export/compile/text_engines.py)."""

    root: Path
    precision: str
    max_rows: int  # rows of one call the plans' profile holds (the pipeline runs more in pieces)
    device: str
    graphs: dict

    def path(self, graph: str) -> Path:
        return self.root / self.graphs[graph]["file"]

    @classmethod
    def load(cls, root: Path, onnx_dir: Path, device: str, tools: dict) -> "TextEngines":
        """``root/text_engines.json``, checked against the exported graphs and this machine."""
        from ..file_identity import sha256_file

        path = Path(root) / TEXT_ENGINES_NAME
        if not path.is_file():
            raise ArtifactError(f"{path} not found; run `edit-rt engines CONFIG` on the text config (TensorRT plans of its graphs)")
        try:
            data = json.loads(path.read_text())
            engines = cls(Path(root), data["precision"], int(data["max_rows"]), data["device"], dict(data["graphs"]))
            built_tools = dict(data["tools"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ArtifactError(f"{path} is unreadable ({err}); {REBUILD}") from None
        if engines.device != device:
            raise ArtifactError(f"{path} was built on {engines.device!r}, this is {device!r}; {REBUILD}")
        for tool, version in tools.items():
            if built_tools.get(tool) != version:
                raise ArtifactError(f"{path} was built with {tool} {built_tools.get(tool)}, this is {version}; {REBUILD}")
        for graph in TEXT_GRAPHS:
            entry = engines.graphs.get(graph)
            if not isinstance(entry, dict) or "file" not in entry or not engines.path(graph).is_file():
                raise ArtifactError(f"{path}: the {graph} engine is missing; {REBUILD}")
            if entry.get("source_sha256") != sha256_file(Path(onnx_dir) / f"{graph}.onnx"):
                raise ArtifactError(f"{engines.path(graph)} is stale: it was built from another {graph}.onnx than {onnx_dir}; {REBUILD}")
        return engines
