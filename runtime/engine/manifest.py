"""``manifest.json``: what `edit-rt export` wrote, and whether it still matches the model.

The manifest records every graph's inputs and outputs, the cross-attention layer order, the
opset, the tool versions and a fingerprint of the source model (sha256 over its weights and
configs). The runtime refuses artifacts whose fingerprint does not match the model directory,
naming the command that rebuilds them.

Hashing a 4 GB SD checkpoint takes seconds, so the manifest also keeps each file's size,
mtime, ctime and inode: when all are unchanged the stored fingerprint is trusted (a file's
ctime changes with its bytes and cannot be set back); otherwise the files are hashed again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

from ..errors import ArtifactError, ModelError
from ..file_identity import file_stat, sha256_file  # noqa: F401  (sha256_file: callers import it from here)

MANIFEST_VERSION = 11  # 2: K/V layout, step roles, entry reuse, maps; 3: families, vae_encoder; 4: self_ref; 5: latent_blend; 6: roles name their attribute; 7: adapter slots; 8: samplers (coefs, history, noise); 9: one step graph (maps an output of unet_step); 10: uncond_slope (the base's u over a tail); 11: deep_out and unet_step_shallow (DeepCache)
# The files of a diffusers SD directory that decide what the exported graphs compute.
_MODEL_PARTS = ("unet", "text_encoder", "vae", "tokenizer", "scheduler")
_EXTRA_PARTS = ("text_encoder_2", "tokenizer_2", "vae_tiny")  # SDXL's second text encoder; a tiny autoencoder
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".txt")


def model_files(model_dir: Path) -> list[Path]:
    """The files the fingerprint covers, in a stable order; refuses a non-diffusers folder."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(
            f"model directory {model_dir} does not exist; run `make model` for the embedded "
            f"default or set `model:` to a diffusers Stable Diffusion folder"
        )
    missing = [p for p in ("model_index.json", *_MODEL_PARTS) if not (model_dir / p).exists()]
    if missing:
        files = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".safetensors", ".ckpt"))
        fix = (f"it holds {', '.join(files[:3])}: set model: to that single-file checkpoint" if files else
               "point model: at a diffusers folder (model_index.json, unet/, vae/, text_encoder/, tokenizer/, "
               "scheduler/) or at a single-file .safetensors checkpoint")  # fmt: skip
        raise ModelError(f"{model_dir} is not a diffusers Stable Diffusion folder: it lacks {', '.join(missing)}; {fix}")
    files = []
    for part in _MODEL_PARTS + tuple(p for p in _EXTRA_PARTS if (model_dir / p).is_dir()):
        for p in sorted((model_dir / part).iterdir()):
            if p.is_file() and p.suffix in _WEIGHT_SUFFIXES:
                files.append(p)
    return files


def _file_stats(model_dir: Path, files: list[Path]) -> dict[str, list[int]]:
    """Size, mtime, ctime and inode per file. A changed file keeps its size and can be given its
    old mtime back (``touch -d``), but its ctime moves whenever its bytes or its mtime change, and
    no user can set it: equal stats mean the bytes the fingerprint hashed."""
    return {str(p.relative_to(model_dir)): file_stat(p) for p in files}


def model_fingerprint(model_dir: Path) -> tuple[str, dict[str, list[int]]]:
    """sha256 over the relative path and content of every model file, and the files' stats."""
    model_dir = Path(model_dir)
    files = model_files(model_dir)
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(model_dir)).encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest(), _file_stats(model_dir, files)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: list[Any]  # ints and symbolic names ("N", "E", "S")


@dataclass(frozen=True)
class GraphSpec:
    file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of an export directory."""

    root: Path
    data: dict[str, Any]

    @property
    def graphs(self) -> dict[str, GraphSpec]:
        return {
            name: GraphSpec(
                file=g["file"],
                inputs=[TensorSpec(**t) for t in g["inputs"]],
                outputs=[TensorSpec(**t) for t in g["outputs"]],
                sha256=g["sha256"],
            )
            for name, g in self.data["graphs"].items()
        }

    @property
    def layers(self) -> list[dict[str, Any]]:
        return self.data["layers"]

    @property
    def fingerprint(self) -> str:
        return self.data["model"]["fingerprint"]

    @property
    def latent_channels(self) -> int:
        return self.data["model"]["latent_channels"]

    @property
    def vae_scale_factor(self) -> int:
        return self.data["model"]["vae_scale_factor"]

    @property
    def family(self) -> dict[str, Any]:
        """The model family's description (export/family_*.py): tokenizers, clip_skips, conds."""
        return self.data["family"]

    @property
    def step_roles(self) -> dict[str, str]:
        """Each ``unet_step`` input's and output's role, in the graph's order (export's ``step_io``)."""
        return self.data["graphs"]["unet_step"]["roles"]

    @property
    def adapters(self) -> dict[str, Any]:
        """The LoRA slots (export/compile/adapter_slots.py): ``slots``, ``rank``, and each adapted layer's
        name, graph, input names and shape; ``slots`` 0: the graphs take no adapters."""
        return self.data["adapters"]

    @property
    def step_all_given(self) -> bool:
        """Whether the step graphs take E = N: a call whose every row is given its unconditional
        prediction runs no unconditional UNet row. False for an export made before it (whose
        cross-attention needs one such row: a call keeps E < N there)."""
        return self.data.get("step_all_given") is True

    def roles(self, graph: str = "unet_step") -> dict[str, str]:
        """Each input's and output's role in a step graph, in the graph's order."""
        return self.data["graphs"][graph]["roles"]

    @property
    def scheduler_config(self) -> dict[str, Any]:
        return self.data["model"]["scheduler"]

    def has(self, graph: str) -> bool:
        """Whether the export holds ``graph`` (an OPTIONAL_GRAPHS one may be absent)."""
        return graph in self.data["graphs"]

    def path(self, graph: str) -> Path:
        return self.root / self.data["graphs"][graph]["file"]

    def check_model(self, model_dir: Path) -> None:
        """Refuse these artifacts if ``model_dir``'s weights are not the ones they came from."""
        model_dir = Path(model_dir)
        files = model_files(model_dir)
        if _file_stats(model_dir, files) == self.data["model"]["file_stats"]:
            return
        fingerprint, _ = model_fingerprint(model_dir)
        if fingerprint != self.fingerprint:
            raise ArtifactError(
                f"{self.root} was exported from other weights than {model_dir} "
                f"(fingerprint {self.fingerprint[:12]} != {fingerprint[:12]}); "
                f"re-run `make export` (edit-rt export CONFIG) to rebuild it"
            )


def load_manifest(onnx_dir: Path) -> Manifest:
    """Read ``onnx_dir/manifest.json``, refusing a missing, unreadable or foreign one."""
    onnx_dir = Path(onnx_dir)
    path = onnx_dir / "manifest.json"
    if not path.is_file():
        raise ArtifactError(f"{path} not found; run `make export` (edit-rt export CONFIG) first")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:  # unreadable, not UTF-8, not JSON
        raise ArtifactError(f"{path} is unreadable ({err}); re-run `make export`") from None
    if not isinstance(data, dict) or data.get("format") != "edit-rt-onnx" or data.get("version") != MANIFEST_VERSION:
        raise ArtifactError(
            f"{path} is not an edit-rt manifest of version {MANIFEST_VERSION}; re-run `make export`"
        )
    _check_keys(path, data)
    manifest = Manifest(onnx_dir, data)
    for name in (*_GRAPHS, *(g for g in OPTIONAL_GRAPHS if g in data["graphs"])):
        if not manifest.path(name).is_file():
            raise ArtifactError(f"{onnx_dir}: graph {name!r} is missing; re-run `make export`")
    for name in data["family"].get("tokenizers", ["tokenizer.json"]):
        if not (onnx_dir / name).is_file():
            raise ArtifactError(f"{onnx_dir}/{name} is missing; re-run `make export`")
    return manifest


# What the runtime reads from a manifest, with its types: anything missing or of another type
# is refused up front (pydantic), not as a KeyError or TypeError deep in a request.
_GRAPHS = ("text_encoder", "kv_proj", "unet_step", "unet_step_shallow", "latent_blend", "vae_decoder", "vae_encoder")
# Graphs an export has only where the model has what they need: the tiny autoencoder's (TAESD,
# export.tiny_vae). A manifest without them is a model without a tiny decoder, not a stale one.
OPTIONAL_GRAPHS = ("taesd_decoder", "taesd_encoder")
_OPEN = ConfigDict(extra="allow", strict=True)  # the runtime reads these keys; others are the export's


class _Tensor(BaseModel):
    model_config = _OPEN
    name: str
    dtype: str
    shape: list[Union[int, str]]

    @field_validator("dtype")
    @classmethod
    def _a_dtype(cls, dtype: str) -> str:
        try:
            np.dtype(dtype)
        except TypeError:  # pydantic reports ValueErrors only
            raise ValueError(f"{dtype!r} is not a dtype") from None
        return dtype


class _Graph(BaseModel):
    model_config = _OPEN
    file: str
    inputs: list[_Tensor]
    outputs: list[_Tensor]
    sha256: str
    roles: Optional[dict[str, str]] = None


class _Layer(BaseModel):
    model_config = _OPEN
    name: str
    heads: PositiveInt
    inner_dim: PositiveInt


class _AdapterLayer(BaseModel):
    model_config = _OPEN
    name: str
    graph: str
    down: str
    up: str
    in_: PositiveInt = Field(alias="in")
    out: PositiveInt


class _Adapters(BaseModel):
    model_config = _OPEN
    slots: int = Field(ge=0)
    rank: int = Field(ge=0)
    layers: list[_AdapterLayer]


class _Model(BaseModel):
    model_config = _OPEN
    fingerprint: str
    file_stats: dict
    latent_channels: PositiveInt
    sample_size: PositiveInt
    vae_scale_factor: PositiveInt
    text_len: PositiveInt
    scheduler: dict


class _Manifest(BaseModel):
    model_config = _OPEN
    model: _Model
    layers: list[_Layer] = Field(min_length=1)
    graphs: dict[str, _Graph]
    family: dict
    adapters: _Adapters


def _check_keys(path: Path, data: dict) -> None:
    try:
        manifest = _Manifest.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the manifest"
        what = "is missing" if first["type"] == "missing" else f"is not valid ({first['msg']})"
        raise ArtifactError(f"{path}: {where} {what}; re-run `make export`") from None
    for name in _GRAPHS:
        if name not in manifest.graphs:
            raise ArtifactError(f"{path.parent}: graph {name!r} is missing; re-run `make export`")
    if manifest.graphs["unet_step"].roles is None:
        raise ArtifactError(f"{path}: graphs.unet_step.roles is missing; re-run `make export`")
    if not isinstance(data["graphs"]["unet_step"].get("map_factor"), int):
        raise ArtifactError(f"{path}: graphs.unet_step.map_factor is missing; re-run `make export`")
