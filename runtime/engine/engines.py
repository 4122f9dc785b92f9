"""``engines.json``: what `edit-rt engines` built, and whether it still fits.

One ``engines.json`` per backend folder (``build/<model>/engines/<backend>/``). Per graph it
records the engine file, the backend, the edit-batch profile, the precision, the tool
versions, the device, and the sha256 of the ONNX graph it was built from (as ``manifest.json``
records it). The runtime refuses an engine that is stale (built from another ONNX graph),
foreign (another backend, device or tool version) or built for another latent size, in one
line that names ``make engines``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import ArtifactError
from .manifest import OPTIONAL_GRAPHS, Manifest
from .profiles import EditBatchProfile

ENGINES_VERSION = 1
GRAPHS = ("text_encoder", "kv_proj", "unet_step", "unet_step_shallow", "latent_blend", "vae_decoder", "vae_encoder")
REBUILD = "re-run `make engines` (edit-rt engines CONFIG)"


def graphs_of(manifest: Manifest) -> tuple[str, ...]:
    """The graphs an export has, each needing an engine: GRAPHS and the optional ones it holds."""
    return GRAPHS + tuple(g for g in OPTIONAL_GRAPHS if manifest.has(g))


@dataclass(frozen=True)
class EngineSet:
    """The parsed engines.json of one backend folder."""

    root: Path
    backend: str
    profile: EditBatchProfile
    precision: str
    tools: dict[str, str]
    device: str
    graphs: dict[str, dict[str, Any]]

    def path(self, graph: str) -> Path:
        return self.root / self.graphs[graph]["file"]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "edit-rt-engines",
            "version": ENGINES_VERSION,
            "backend": self.backend,
            "profile": vars(self.profile),
            "precision": self.precision,
            "tools": self.tools,
            "device": self.device,
            "graphs": self.graphs,
        }


def graph_precision(manifest: Manifest, graph: str, precision: str) -> str:
    """The precision ``graph``'s engine runs in: the VAE of a model whose config says
    ``force_upcast`` (SDXL 1.0's overflows in fp16) stays fp32, and so does ``latent_blend`` (it
    only selects latents, which the step keeps in fp32); everything else ``precision``."""
    if graph == "latent_blend" or (graph.startswith("vae_") and manifest.family.get("vae_force_upcast")):
        return "fp32"
    return precision


def upcasts(manifest: Manifest, graph: str) -> bool:
    """Whether ``graph`` has attention whose scores the model needs in fp32 (``upcast_attention``)."""
    return graph.startswith("unet_step") and bool(manifest.family.get("upcast_attention"))


def write_engines_json(engines: EngineSet) -> Path:
    path = engines.root / "engines.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(engines.to_json(), indent=2))
    tmp.replace(path)
    return path


def load_engines(
    root: Path,
    manifest: Manifest,
    backend: str,
    tools: Mapping[str, str],
    device: str,
    latent_sizes: Sequence[tuple[int, int]] = (),
) -> EngineSet:
    """Read ``root/engines.json`` and check it against the ONNX manifest and this machine."""
    path = Path(root) / "engines.json"
    if not path.is_file():
        raise ArtifactError(f"{path} not found; run `make engines` (edit-rt engines CONFIG) first")
    try:
        data = json.loads(path.read_text())
        engines = EngineSet(
            root=Path(root),
            backend=data["backend"],
            profile=EditBatchProfile(**data["profile"]),
            precision=data["precision"],
            tools=data["tools"],
            device=data["device"],
            graphs=data["graphs"],
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ArtifactError(f"{path} is unreadable ({err}); {REBUILD}") from None
    if data.get("format") != "edit-rt-engines" or data.get("version") != ENGINES_VERSION:
        raise ArtifactError(f"{path} is not an edit-rt engines.json of version {ENGINES_VERSION}; {REBUILD}")
    if engines.backend != backend:
        raise ArtifactError(f"{path} holds {engines.backend} engines, not {backend}; {REBUILD}")
    if engines.device != device:
        raise ArtifactError(f"{path} was built on {engines.device!r}, this is {device!r}; {REBUILD}")
    for tool, version in tools.items():
        if engines.tools.get(tool) != version:
            raise ArtifactError(
                f"{path} was built with {tool} {engines.tools.get(tool)}, this is {version}; {REBUILD}"
            )
    missing = [size for size in latent_sizes if size not in engines.profile.latent_sizes()]
    if missing:  # engines of fixed size (TensorRT): one optimization profile per latent size
        built = ", ".join(f"{h}x{w}" for h, w in engines.profile.latent_sizes())
        raise ArtifactError(
            f"{path} was built for {built} latents, this run needs {missing[0][0]}x{missing[0][1]} too; "
            f"{REBUILD} with this config's sizes (base and engines.sizes)"
        )
    sources = manifest.data["graphs"]
    for graph in graphs_of(manifest):
        entry = engines.graphs.get(graph)
        if entry is None or "file" not in entry or not engines.path(graph).is_file():
            raise ArtifactError(f"{path}: the {graph} engine is missing; {REBUILD}")
        if not isinstance(entry, dict) or "source_sha256" not in entry or "file" not in entry:
            raise ArtifactError(f"{path}: the {graph} entry has no file or source_sha256; {REBUILD}")
        if entry["source_sha256"] != sources[graph]["sha256"]:
            raise ArtifactError(
                f"{engines.path(graph)} is stale: it was built from another {graph}.onnx than "
                f"{manifest.root}; {REBUILD}"
            )
    return engines
