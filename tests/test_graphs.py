"""Each exported ONNX graph against its PyTorch source, through Polygraphy's Comparator.

Fresh random inputs at batch 1 and batch 3 (the graphs were traced at batch 2, so both
exercise the dynamic batch axis). Tolerances are fp32's: ONNX Runtime fuses and reorders the
same sums (attention, group norm, convolutions), which moves results by ~1e-6 relative per
layer; through the ~30 layers of the tiny UNet that stays below 1e-4 absolute on outputs of
order 1. A real export bug (a wrong K/V order, a frozen batch size) is off by O(1).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import onnx
import pytest
import torch
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator, CompareFunc

from edit_rt.export.graphs import KVProjGraph, TextEncoderGraph, UNetStepGraph, VaeDecoderGraph
from edit_rt.runtime.manifest import load_manifest
from edit_rt.runtime.scheduler_ddim import DDIMConfig, DDIMSchedule

from .reference_runner import TorchCpuRunner

ATOL, RTOL = 1e-4, 1e-3


def _feeds(manifest, graph: str, n: int, m: int, rng: np.random.Generator, hw: int = 16) -> OrderedDict:
    """Random inputs for ``graph`` with N = n rows and M = m unconditional K/V sets."""
    feeds = OrderedDict()
    steps = DDIMSchedule(DDIMConfig.from_scheduler_config(manifest.scheduler_config), 20)
    picks = rng.integers(0, 20, size=n)
    for spec in manifest.graphs[graph].inputs:
        dims = {"N": n, "B": n, "M": m, "H": hw, "W": hw}
        shape = [dims[d] if isinstance(d, str) else d for d in spec.shape]
        if spec.name == "input_ids":
            feeds[spec.name] = rng.integers(0, 514, size=shape).astype(np.int64)
        elif spec.name == "uncond_index":
            feeds[spec.name] = rng.integers(0, m, size=shape).astype(np.int64)
        elif spec.name == "timestep":
            feeds[spec.name] = steps.timesteps[picks].astype(np.float32)
        elif spec.name in ("alpha_t", "alpha_prev"):
            feeds[spec.name] = getattr(steps, spec.name)[picks]
        elif spec.name == "guidance":
            feeds[spec.name] = rng.uniform(1.0, 9.0, size=shape).astype(np.float32)
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _torch_module(graph: str, components):
    unet, text_encoder, vae, _, scheduler = components
    if graph == "text_encoder":
        return TextEncoderGraph(text_encoder)
    if graph == "kv_proj":
        return KVProjGraph(unet)
    if graph == "unet_step":
        return UNetStepGraph(unet, scheduler.get("prediction_type", "epsilon"), None)
    return VaeDecoderGraph(vae)


@pytest.mark.parametrize("graph", ["text_encoder", "kv_proj", "unet_step", "vae_decoder"])
def test_onnx_graph_matches_torch(graph, onnx_dir, torch_components):
    manifest = load_manifest(onnx_dir)
    rng = np.random.default_rng(0)
    data = [_feeds(manifest, graph, n, m, rng) for n, m in ((1, 1), (3, 2))]
    spec = manifest.graphs[graph]
    meta = TensorMetadata()
    for t in spec.inputs:
        meta.add(t.name, np.dtype(t.dtype), [None if isinstance(d, str) else d for d in t.shape])
    runners = [
        OnnxrtRunner(SessionFromOnnx(str(manifest.path(graph)), providers=["CPUExecutionProvider"])),
        TorchCpuRunner(_torch_module(graph, torch_components), meta, [o.name for o in spec.outputs]),
    ]
    results = Comparator.run(runners, data_loader=data)
    assert bool(Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=ATOL, rtol=RTOL)))


def test_graphs_pass_onnx_checker_and_shape_inference(onnx_dir):
    manifest = load_manifest(onnx_dir)
    for name, spec in manifest.graphs.items():
        path = manifest.path(name)
        onnx.checker.check_model(str(path), full_check=True)
        inferred = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True)
        # The edit batch is symbolic on every input and output that has one.
        batch_dims = [v.type.tensor_type.shape.dim[0].dim_param for v in [*inferred.graph.input, *inferred.graph.output]]
        assert all(d in ("N", "B", "M") for d in batch_dims), (name, batch_dims)


def test_manifest_records_layer_order_and_io(onnx_dir, torch_components):
    from edit_rt.export.graphs import cross_attention_layers

    manifest = load_manifest(onnx_dir)
    unet = torch_components[0]
    assert [l["name"] for l in manifest.layers] == [l.name for l, _ in cross_attention_layers(unet)]
    step_inputs = [t.name for t in manifest.graphs["unet_step"].inputs]
    assert step_inputs[:6] == ["latents", "timestep", "alpha_t", "alpha_prev", "guidance", "uncond_index"]
    assert len(step_inputs) == 6 + 4 * len(manifest.layers)
    assert manifest.data["opset"] == 17 and manifest.data["tools"]["torch"] == torch.__version__
