"""Each exported ONNX graph against its PyTorch source, through Polygraphy's Comparator.

Fresh random inputs at batch 1 and batch 3 (the graphs were traced at batch 2, so both
exercise the dynamic batch axis). Tolerances are fp32's: ONNX Runtime fuses and reorders the
same sums (attention, group norm, convolutions), which moves results by ~1e-6 relative per
layer; through the ~30 layers of the tiny UNet that stays below 1e-4 absolute on outputs of
order 1. A real export bug (a wrong K/V order, a frozen batch size) is off by O(1).
"""

from __future__ import annotations


import numpy as np
import onnx
import pytest
import torch
from polygraphy.comparator import Comparator, CompareFunc

from edit_rt.export.compile.parity import ort_runner, random_feeds, torch_runner
from edit_rt.runtime.engine.manifest import load_manifest

ATOL, RTOL = 1e-4, 1e-3


def assert_graph_matches_torch(graph: str, onnx_dir, model_dir) -> None:
    """``graph`` on ONNX Runtime against its PyTorch source on random feeds at 1 and 3 rows."""
    manifest = load_manifest(onnx_dir)
    rng = np.random.default_rng(0)
    data = [random_feeds(manifest, graph, n, m, rng, hw=16) for n, m in ((1, 1), (3, 2))]
    runners = [ort_runner(manifest.path(graph), "onnxrt"), torch_runner(graph, manifest, model_dir)]
    results = Comparator.run(runners, data_loader=data)
    assert bool(Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=ATOL, rtol=RTOL)))


@pytest.mark.parametrize("graph", ["text_encoder", "kv_proj", "unet_step", "unet_step_shallow", "vae_decoder", "vae_encoder"])
def test_onnx_graph_matches_torch(graph, onnx_dir, model_dir):
    assert_graph_matches_torch(graph, onnx_dir, model_dir)


def frozen_axes(model: onnx.ModelProto, spec) -> list[tuple[str, int, object]]:
    """The axes of ``model``'s inputs and outputs that are not what the manifest declares: a
    symbol ("N", "S", ...) where it says one (a traced size frozen into the file is a number
    there), that number where it says a number."""
    declared = {t.name: t.shape for t in [*spec.inputs, *spec.outputs]}
    wrong = []
    for v in [*model.graph.input, *model.graph.output]:
        dims = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        if len(dims) != len(declared[v.name]):
            wrong.append((v.name, -1, dims))
        wrong += [(v.name, axis, got) for axis, (got, want) in enumerate(zip(dims, declared[v.name])) if got != want]
    return wrong


def test_graphs_pass_onnx_checker_and_shape_inference(onnx_dir):
    manifest = load_manifest(onnx_dir)
    for name, spec in manifest.graphs.items():
        path = manifest.path(name)
        onnx.checker.check_model(str(path), full_check=True)
        inferred = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True)
        assert {v.name for v in [*inferred.graph.input, *inferred.graph.output]} == {t.name for t in [*spec.inputs, *spec.outputs]}
        assert frozen_axes(inferred, spec) == [], name
        # the edit batch is symbolic on the step's rows (what test_onnx_graph_matches_torch runs at 1 and 3)
        assert inferred.graph.input[0].type.tensor_type.shape.dim[0].dim_param in ("N", "B"), name
    # what a frozen batch looks like in a file: the check above sees it
    unet = onnx.load(str(manifest.path("unet_step")), load_external_data=False)
    unet.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    assert frozen_axes(unet, manifest.graphs["unet_step"]) == [("latents", 0, 2)]


def test_manifest_records_layer_order_and_io(onnx_dir, torch_components):
    from edit_rt.export.compile.graphs import cross_attention_layers

    manifest = load_manifest(onnx_dir)
    unet = torch_components[0]
    assert [l["name"] for l in manifest.layers] == [l.name for l, _ in cross_attention_layers(unet)]
    step_inputs = [t.name for t in manifest.graphs["unet_step"].inputs]
    assert step_inputs[:11] == ["latents", "timestep", "alpha_t", "coefs", "guidance", "uncond_index", "uncond_given",
                                "uncond_slope", "self_ref", "history", "noise"]  # fmt: skip
    assert len(step_inputs) == 11 + 4 * len(manifest.layers)
    # every input and output has its role, in graph order (what the runtime's slots read)
    roles = manifest.step_roles
    assert list(roles) == step_inputs + ["next_latents", "uncond_out", "history_out", "attn_maps", "deep_out"]
    assert [roles[n] for n in step_inputs[:12]] == [
        "latents", "step_scalar:timesteps", "step_scalar:alpha_t", "step_coefs", "row_scalar:guidance",
        "set_index", "entry_uncond", "entry_slope", "row_ref", "history", "step_noise", "row_kv"]
    assert manifest.data["opset"] == 17 and manifest.data["tools"]["torch"] == torch.__version__
