"""What an export's graphs depend on, and whether an existing export already holds them.

`edit-rt export` (and so `make demo`, `make engines`) skips the export when ``onnx_dir`` holds
an export of the same model weights, made with the same settings, by the same exporting code and
the same tools: re-running it would write the same graphs (seconds on the shapes model, minutes
at SD 1.5's size). What is compared:

- the model's files, as the runtime compares them (``Manifest.check_model``: size, mtime, ctime
  and inode of every file, and the content sha256 when any of them differs);
- the export settings (opset, external data threshold, variant, adapter slots and rank,
  attention slicing, and the content of ``export.tiny_vae``'s files: a model folder's own
  ``vae_tiny/`` is one of the model's files);
- the sha256 of the exporting code (every ``.py`` of this package) and the manifest version;
- the versions of torch, diffusers, transformers, onnx and onnxruntime, read from the installed
  distributions' metadata, so that this check imports none of them;
- every graph file the manifest lists, present at the size it was written.

torch-free on purpose: the check runs before the exporter (and torch) is imported.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Optional, Union

from edit_rt.runtime.engine.manifest import MANIFEST_VERSION, load_manifest
from edit_rt.runtime.errors import EditRtError

HERE = Path(__file__).resolve().parent
TOOLS = ("torch", "diffusers", "transformers", "onnx", "onnxruntime")


def _code_sha256() -> str:
    """sha256 over the exporting code: every module of export/compile/, by name and content."""
    h = hashlib.sha256(f"manifest {MANIFEST_VERSION}\0".encode())
    for path in sorted(HERE.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _tool_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def tiny_vae_sha256(path: Optional[Path]) -> Optional[str]:
    """sha256 over the names and bytes of the tiny autoencoder's files at ``path`` (a folder or
    a file; a few MB), None without one."""
    if path is None or not Path(path).exists():
        return None
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else sorted(path.parent.glob(path.name.replace("_decoder.", "_*coder.")))
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def export_inputs(opset: int, external_data_threshold_mb: float, variant: Optional[str], adapter_slots: int,
                  adapter_rank: int, attention_slicing: Union[str, int], tiny_vae: Optional[Path] = None) -> dict:  # fmt: skip
    """Everything besides the model's weights that the exported graphs depend on (recorded in the
    manifest as ``export_inputs``)."""
    return {
        "settings": {"opset": int(opset), "external_data_threshold_mb": float(external_data_threshold_mb),
                     "variant": variant, "adapter_slots": int(adapter_slots),
                     "adapter_rank": int(adapter_rank) if adapter_slots else 0,
                     "attention_slicing": attention_slicing, "tiny_vae": tiny_vae_sha256(tiny_vae)},  # fmt: skip
        "code_sha256": _code_sha256(),
        "tools": {name: _tool_version(name) for name in TOOLS},
    }


def why_export(model_dir: Path, onnx_dir: Path, inputs: dict) -> Optional[str]:
    """None when ``onnx_dir`` holds the export of ``model_dir`` with ``inputs``; else why it must
    be exported (again), in a few words."""
    try:
        manifest = load_manifest(onnx_dir)
    except EditRtError:
        return "no complete export there"
    recorded = manifest.data.get("export_inputs")
    if not isinstance(recorded, dict):
        return "the export predates its inputs' record"
    # through JSON, as the manifest holds them (tuples become lists, keys strings)
    wanted = json.loads(json.dumps(inputs))
    for part, what in (("settings", "the export settings"), ("code_sha256", "the exporting code"), ("tools", "the tools' versions")):
        if recorded.get(part) != wanted[part]:
            return f"{what} changed"
    for name, graph in manifest.data["graphs"].items():
        files = [graph["file"]] + ([graph["external_data"]] if graph.get("external_data") else [])
        sizes = [(Path(onnx_dir) / f).stat().st_size if (Path(onnx_dir) / f).is_file() else -1 for f in files]
        if -1 in sizes or ("file_bytes" in graph and sum(sizes) != graph["file_bytes"]):
            return f"graph {name} is missing or changed"
    try:
        manifest.check_model(model_dir)
    except EditRtError:
        return "the model's weights changed"
    return None
