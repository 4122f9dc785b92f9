"""`backend: auto` on the CPU: the engine picked per model and size, from a memory model of each
CPU engine held to measured peaks and a GFLOP count held to torch's.

The measured numbers are docs/engines-cpu.json's (each engine in a process of its own, its peak
RSS; torch's FlopCounterMode on diffusers' UNet): data the code under test never reads. SD 1.5's
export is described by the figures its manifest holds (`make check-sd15`'s export of the random
SD 1.5 at 512x512: each graph's weight bytes, which sit in an external data file, the
cross-attention layer list), so no 4 GB model is built here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edit_rt.runtime.engine.backend import select_backend
from edit_rt.runtime.engine.memory import cpu_model, engine_peak_bytes, memory_plan
from edit_rt.runtime.engine.manifest import load_manifest

MEASURED = json.loads((Path(__file__).resolve().parents[1] / "docs" / "engines-cpu.json").read_text())
ENGINES = {"ort-cpu": "ort-cpu", "openvino fp32": "openvino", "openvino bf16": "openvino bf16"}
GB = 10**9


class SdManifest:
    """The parts of SD 1.5's export manifest (512x512, sliced self-attention) the CPU engine
    choice reads, as `make check-sd15` wrote them."""

    def __init__(self):
        weights = {"text_encoder": 491774976, "kv_proj": 76677120, "unet_step": 3360684816,
                   "unet_step_shallow": 112048656, "latent_blend": 0, "vae_decoder": 197879900,
                   "vae_encoder": 136599360, "taesd_decoder": 4890124, "taesd_encoder": 4890128}  # fmt: skip
        graphs = {name: {"weight_bytes": w} for name, w in weights.items()}
        graphs["unet_step"].update(external_data="unet_step.onnx_data", slice_heads=1)
        graphs["unet_step_shallow"].update(inputs=[{"name": "deep_features", "shape": ["U", 640, "H", "W"]}],
                                           roles={"deep_features": "deep_in"})  # fmt: skip
        self.data = {"graphs": graphs, "model": {"block_out_channels": [320, 640, 1280, 1280], "vae_channels": 128}}
        widths = {0: 320, 1: 640, 2: 1280}
        self.layers = [{"name": f"down_blocks.{k}.attentions.{i}.transformer_blocks.0.attn2", "heads": 8, "inner_dim": widths[k]}
                       for k in range(3) for i in range(2)]  # fmt: skip
        self.layers += [{"name": f"up_blocks.{j}.attentions.{i}.transformer_blocks.0.attn2", "heads": 8,
                         "inner_dim": widths[3 - j]} for j in range(1, 4) for i in range(3)]  # fmt: skip
        self.layers.append({"name": "mid_block.attentions.0.transformer_blocks.0.attn2", "heads": 8, "inner_dim": 1280})
        self.vae_scale_factor = 8


LAZY = ("vae_encoder", "taesd_encoder")
SD = cpu_model(SdManifest(), (64, 64), LAZY)


def _openvino_reason():
    from edit_rt.runtime.engine.backend_ov import openvino_unavailable_reason

    return openvino_unavailable_reason()


def test_unet_gflop_matches_torch_flop_counter(shapes_onnx_dir):
    """The manifest's count of a UNet row's arithmetic is within 10% of what torch's
    FlopCounterMode counted on diffusers' own UNet (engines-cpu.json), at two sizes 4500x apart."""
    shapes = cpu_model(load_manifest(shapes_onnx_dir), (16, 16), LAZY)
    for model, key in ((SD, "sd15_cpu_engines"), (shapes, "shapes_model")):
        counted = MEASURED[key]["gflop_per_unet_row"]
        assert abs(model.gflop_per_unet_row / counted - 1) < 0.10, (key, model.gflop_per_unet_row, counted)


def test_memory_model_within_15_percent_of_measured_peaks(shapes_onnx_dir):
    """Every measured peak RSS of the SD 1.5 side-by-side run (ort-cpu, openvino fp32 and bf16,
    1 and 4 rows) and of the shapes model on ort-cpu (1, 4, 16 rows) is predicted within 15%."""
    shapes = cpu_model(load_manifest(shapes_onnx_dir), (16, 16), LAZY)
    checked = 0
    for model, key, engines in ((SD, "sd15_cpu_engines", ENGINES), (shapes, "shapes_model", {"ort-cpu": "ort-cpu"})):
        for point in MEASURED[key]["points"]:
            if point["engine"] not in engines:
                continue
            predicted = engine_peak_bytes(engines[point["engine"]], model, point["n"])
            measured = point["peak_rss_bytes"]
            assert abs(predicted / measured - 1) < 0.15, (key, point["engine"], point["n"], predicted, measured)
            checked += 1
    assert checked == 9


def test_auto_keeps_a_small_model_on_ort_cpu(onnx_dir):
    """The session's tiny model: a fraction of a GFLOP a UNet row, where fixed costs dominate
    and ort-cpu is as fast as openvino or faster; the reason names the count."""
    model = cpu_model(load_manifest(onnx_dir), (16, 16), LAZY)
    chosen, why = select_backend("auto", set(), model, 1, 64 * GB)
    assert chosen == "ort-cpu"
    assert f"{model.gflop_per_unet_row:.3g} GFLOP a UNet row" in why and "under the 100" in why


def test_auto_picks_openvino_for_sd_size_when_it_fits():
    """SD 1.5 at 512x512 (~780 GFLOP a UNet row) with 64 GB: openvino fp32, whose expected
    peak at one step row (9.7 GB; measured 9.72) the reason names beside the budget."""
    reason = _openvino_reason()
    if reason is not None:
        pytest.skip(f"openvino cannot start here: {reason}")
    chosen, why = select_backend("auto", set(), SD, 1, 64 * GB)
    assert chosen == "openvino", why
    assert "GFLOP a UNet row" in why and "9.7 GB at 1 row(s)" in why and "64.0 GB engines.max_memory_gb" in why


def test_auto_stays_on_ort_cpu_when_openvino_does_not_fit():
    """The same model with engines.max_memory_gb: 8 (where ort-cpu's 4 rows measured 7.45 GB and
    openvino fp32's one row 9.72): ort-cpu, and the reason says what openvino would need."""
    chosen, why = select_backend("auto", set(), SD, 1, 8 * GB)
    assert chosen == "ort-cpu", why
    if _openvino_reason() is None:
        assert "needs about 9.7 GB at 1 row(s)" in why and "over the 8.0 GB engines.max_memory_gb" in why


def test_openvino_rows_fit_its_own_memory():
    """The rows a call runs in a budget are the engine's own: from openvino fp32's measured
    loaded RSS, the 12.59 GB it peaked at with 4 rows holds 3 or 4 of its rows (the plan keeps a
    margin), where from ort-cpu's loaded RSS the same budget holds more of ort-cpu's."""
    points = {(p["engine"], p["n"]): p for p in MEASURED["sd15_cpu_engines"]["points"]}
    budget = points["openvino fp32", 4]["peak_rss_bytes"]
    ov = memory_plan(SdManifest(), (64, 64), budget, held=points["openvino fp32", 4]["peak_rss_loaded_bytes"],
                     engine="openvino").step_rows(32)  # fmt: skip
    ort = memory_plan(SdManifest(), (64, 64), budget, held=points["ort-cpu", 4]["peak_rss_loaded_bytes"]).step_rows(32)
    assert 3 <= ov <= 4 and ort > ov, (ov, ort)


@pytest.mark.parametrize("precision,flags,computes", [
    ("fp16", {"avx512_bf16"}, "bf16"),  # the config's default on a CPU with native bf16
    ("fp16", {"amx_bf16"}, "bf16"),
    ("fp16", {"avx512f"}, "fp32"),  # no native bf16: OpenVINO would emulate it, slower
    ("fp32", {"amx_bf16"}, "fp32"),  # stated: kept
])
def test_auto_on_openvino_computes_bf16_only_where_the_cpu_has_it(precision, flags, computes):
    from edit_rt.runtime.engine.backend_ov import auto_precision

    chosen, why = auto_precision(precision, flags)
    assert chosen == computes, why
    assert why  # the reason goes to the log and report.json
