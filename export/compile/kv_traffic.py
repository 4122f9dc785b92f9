"""How many bytes of cached K/V one ``unet_step`` call touches, read off ONNX Runtime's profiler.

The step graph's K/V inputs (roles ``row_kv`` and ``set_kv`` in the manifest) are what the
runtime binds. A graph that gathers, concatenates or transposes them per call touches each
block several times before the attention reads it; one that reads them where they are bound
touches each once. This runs the graph once with ONNX Runtime's profiling on, follows every
tensor that is computed from K/V alone (a Gather, Concat, Transpose or Reshape of them), and adds
up, per executed node, the bytes of its K/V inputs and K/V outputs, from the shapes the
profiler recorded. ``touched / bound`` is the figure: 1.0 means each bound block is read once.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
import onnxruntime as ort

# Ops that read a tensor's shape, never its bytes.
_METADATA_OPS = {"Shape", "Size"}
_ITEMSIZE = {"float": 4, "float16": 2, "int64": 8, "int32": 4, "bool": 1, "double": 8}


def _bytes(entry: dict) -> tuple[str, int]:
    ((dtype, dims),) = entry.items()
    return dtype, _ITEMSIZE.get(dtype, 4) * math.prod(dims)


def kv_traffic(onnx_path: Path, feeds: Mapping[str, np.ndarray], kv_inputs: list[str], optimize: bool = True) -> dict:
    """Profile one run of ``onnx_path`` on ``feeds``: bound K/V bytes and K/V bytes touched.

    ``optimize``: let ONNX Runtime rewrite the graph (ORT_ENABLE_ALL, as a plain ONNX file
    runs); a saved CPU engine is already rewritten and runs with optimizations off.
    """
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "profile")
        options.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        )
        ran = Path(tmp) / "ran.onnx"  # the graph as ONNX Runtime runs it, to name each node's inputs
        options.optimized_model_filepath = str(ran)
        options.log_severity_level = 3
        session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        session.run(None, dict(feeds))
        events = json.loads(Path(session.end_profiling()).read_text())
        model = onnx.load(str(ran), load_external_data=False)
    kv = set(kv_inputs)
    initializers = {t.name for t in model.graph.initializer}
    nodes = {node.name: node for node in model.graph.node}
    # Tensors computed from K/V alone: a node whose every non-constant float input is K/V.
    derived = set(kv)
    touched = 0
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        node = nodes.get(event["name"][: -len("_kernel_time")])
        if node is None or node.op_type in _METADATA_OPS:
            continue
        args = event["args"]
        kinds = [_bytes(e) for e in args.get("input_type_shape", [])]
        data_inputs = [
            name for name, (dtype, _) in zip(node.input, kinds)
            if name and name not in initializers and dtype.startswith("float")
        ]  # fmt: skip
        from_kv = bool(data_inputs) and all(name in derived for name in data_inputs)
        for name, (_, size) in zip(node.input, kinds):
            if name in derived:
                touched += size
        if from_kv:
            for name, entry in zip(node.output, args.get("output_type_shape", [])):
                derived.add(name)
                touched += _bytes(entry)[1]
    bound = sum(feeds[name].nbytes for name in kv_inputs)
    return {"bound_bytes": bound, "touched_bytes": touched, "ratio": touched / bound}
