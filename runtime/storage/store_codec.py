"""How a base state is stored: tensor precision (fp32 / fp16 / int8) and the file format.

Precision is chosen per tensor kind (``latents``, ``kv``):

- ``fp32``: exact.
- ``fp16``: half the bytes; latents and K/V are O(1) values, well inside fp16's range.
- ``int8``: a quarter of the bytes, symmetric, with one fp32 scale per channel (per head
  dimension of K/V, reduced over the 77 tokens; per channel and step of a latent stack,
  reduced over the pixels): ``q = round(x / s)``, ``s = max|x| / 127``.

A stored state is a flat ``{name: array}`` dict; on disk it is one safetensors file whose
metadata holds the format version, the model fingerprint, the file's key (a base's, or a negative
prompt's for its unconditional K/V; store.py checks that the key hashes to the file's name), the
precisions and a sha256 over the metadata and every tensor's bytes, so a truncated, corrupt,
edited, foreign or swapped file is refused.
"""

from __future__ import annotations

import hashlib
import json
from typing import Mapping

import numpy as np

from ..errors import ArtifactError
from ..model.schema import StoragePrecision

# 2: K/V in the attention layout, u of the window steps; 3: header in the sha256; 4: every file
# records its key (an uncond file its negative prompt and precision, a base its K/V precision);
# 5: a base's sampler (in its key) and a multistep sampler's x_0 per step
FILE_FORMAT = "edit-rt-base/5"


def encode(name: str, x: np.ndarray, precision: StoragePrecision, reduce_axes: tuple[int, ...]) -> dict[str, np.ndarray]:
    """``x`` as stored tensors under ``name`` (and ``name.scale`` for int8, one scale per index
    of the axes not in ``reduce_axes``)."""
    if precision == "fp32":
        return {name: np.ascontiguousarray(x, dtype=np.float32)}
    if precision == "fp16":
        return {name: x.astype(np.float16)}
    scale = np.abs(x).max(axis=reduce_axes, keepdims=True) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.round(x / scale), -127, 127).astype(np.int8)
    return {name: q, f"{name}.scale": scale}


def decode(name: str, stored: Mapping[str, np.ndarray]) -> np.ndarray:
    """The float32 tensor ``name`` from its stored form (a view when stored as fp32)."""
    x = stored[name]
    if x.dtype == np.float32:
        return x
    if x.dtype == np.float16:
        return x.astype(np.float32)
    return x.astype(np.float32) * stored[f"{name}.scale"]


def content_sha256(tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> str:
    """One digest over the metadata (every key but the digest itself, canonical JSON) and every
    tensor's name, dtype, shape and bytes: a changed header is as damaged as a changed tensor."""
    h = hashlib.sha256()
    header = {k: v for k, v in meta.items() if k != "sha256"}
    h.update(json.dumps(header, sort_keys=True).encode() + b"\0")
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(name.encode() + b"\0" + str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def to_bytes(tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> bytes:
    from safetensors.numpy import save

    metadata = dict(meta, format=FILE_FORMAT)
    metadata["sha256"] = content_sha256(tensors, metadata)
    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=metadata)


def read_header(data: bytes) -> dict[str, str]:
    """A safetensors file's ``__metadata__`` ({} if it has none); raises on a malformed header."""
    n = int.from_bytes(data[:8], "little")
    if not 0 < n <= len(data) - 8:
        raise ValueError("the header length is out of range")
    meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("the metadata is not a mapping of strings")
    return meta


def from_bytes(data: bytes, fingerprint: str, source: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse and verify a stored file; refuses truncated, corrupt, edited or foreign ones."""
    from safetensors.numpy import load

    try:
        meta = read_header(data)
        tensors = load(data)
    except Exception as err:  # safetensors raises several types for a damaged file
        raise ArtifactError(f"{source}: not a readable base-state file ({type(err).__name__}: {err})") from None
    found = str(meta.get("format"))
    if found != FILE_FORMAT:
        if found.startswith("edit-rt-base/"):
            raise ArtifactError(f"{source}: written by another edit-rt version ({found}; this one reads {FILE_FORMAT})")
        raise ArtifactError(f"{source}: not an {FILE_FORMAT} file")
    if meta.get("fingerprint") != fingerprint:
        raise ArtifactError(f"{source}: belongs to another model (fingerprint {str(meta.get('fingerprint'))[:12]})")
    if content_sha256(tensors, meta) != meta.get("sha256"):
        raise ArtifactError(f"{source}: checksum mismatch, the file (header or tensors) is corrupt")
    return tensors, meta
