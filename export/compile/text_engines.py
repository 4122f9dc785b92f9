"""`edit-rt engines` of a text config (issue 56): TensorRT plans of a text model's two graphs.

The graphs (text_export.py) have every axis but the model's own sizes dynamic: the rows, the
queried tokens, the cached tokens, the cache's rows. A plan is built from each with Polygraphy's
builder API as engines.py builds the UNet's (a strongly typed network, no precision flags, the
timing cache beside the folder), with one optimization profile that holds every shape the decoding
loops make (runtime/loop/text_decoding.py):

- rows 1..``max_rows`` (the pipeline runs more rows in pieces of ``max_rows``), the cache's rows
  1..``max_rows`` (1: one prefix's cache broadcast over the rows);
- queried tokens 1..the model's positions (a decoding step queries a block, a block and its
  tail, or one token; a first step the whole text), cached tokens 1..the model's positions.

fp32 only for now: the graphs are the export's. ONNX Runtime and OpenVINO run the exported graphs
themselves and need no engines. ``text_engines.json`` records what each plan was built from
(the graph's SHA-256, checked as the runtime loads it), the profile, TensorRT's version and the GPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from edit_rt.runtime.engine.graph_set import engine_device, engine_tools
from edit_rt.runtime.errors import ConfigError
from edit_rt.runtime.file_identity import sha256_file
from edit_rt.runtime.model.text_manifest import TEXT_ENGINES_NAME, TextManifest

from .engines import _fresh


def text_profile(manifest: TextManifest, max_rows: int) -> dict[str, dict[str, tuple]]:
    """Each graph's input shapes as TensorRT (min, opt, max): every shape the decoding loops make."""
    m, rows, positions = manifest, max_rows, manifest.max_len
    opt_rows, opt_tokens = max(1, rows // 2), max(1, positions // 2)
    ids = ((1, 1), (opt_rows, opt_tokens), (rows, positions))
    where = ((1,), (opt_tokens,), (positions,))
    past = tuple((m.layers, 2, r, m.heads, p, m.head_dim) for r, p in ((1, 1), (1, opt_tokens), (rows, positions)))
    return {"text_full": {"input_ids": ids, "positions": where},
            "text_cached": {"input_ids": ids, "positions": where, "past_kv": past}}  # fmt: skip


def text_trt_engines(onnx_dir: Path, out: Path, max_rows: int = 16, precision: str = "fp32",
                     done: Callable[[str], None] = lambda name: None) -> Path:  # fmt: skip
    """A TensorRT plan per text graph in ``out`` (needs TensorRT and a GPU), with text_engines.json."""
    from polygraphy.backend.trt import CreateConfig, Profile, engine_bytes_from_network, network_from_onnx_path

    if precision != "fp32":
        raise ConfigError(f"engines.precision: {precision!r}; a text model's plans are fp32 for now (2.6 M parameters: "
                          "its steps are bound by launches, not arithmetic); set fp32")  # fmt: skip
    onnx_dir, out = Path(onnx_dir), Path(out)
    manifest = TextManifest.load(onnx_dir)
    staging = _fresh(out)
    timing_cache = out.parent / "trt-timing.cache"
    graphs = {}
    for graph, shapes in text_profile(manifest, max_rows).items():
        profile = Profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.add(name, min=lo, opt=opt, max=hi)
        source = onnx_dir / f"{graph}.onnx"
        network = network_from_onnx_path(str(source), strongly_typed=True)
        config = CreateConfig(profiles=[profile], load_timing_cache=str(timing_cache) if timing_cache.exists() else None)
        (staging / f"{graph}.plan").write_bytes(engine_bytes_from_network(network, config=config, save_timing_cache=str(timing_cache)))
        graphs[graph] = {"file": f"{graph}.plan", "source_onnx": str(source), "source_sha256": sha256_file(source)}
        done(f"trt/{graph}")
    record = {"backend": "trt", "precision": precision, "max_rows": max_rows, "max_len": manifest.max_len,
              "tools": engine_tools("trt"), "device": engine_device("trt"), "graphs": graphs}  # fmt: skip
    (staging / TEXT_ENGINES_NAME).write_text(json.dumps(record, indent=1))
    if out.exists():
        shutil.rmtree(out)
    staging.replace(out)  # swapped in whole: a failed build keeps the old folder
    return out

