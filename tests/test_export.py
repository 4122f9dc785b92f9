"""`edit-rt export` details: external data for big graphs, and its own refusals."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import yaml

from edit_rt.export.compile.onnx_export import export_onnx
from edit_rt.export.compile.parity import random_feeds
from edit_rt.runtime.engine.manifest import load_manifest

from .cli_in_process import edit_rt


def test_large_graph_is_written_with_external_data(tmp_path, model_dir, onnx_dir):
    # A real fp32 SD 1.5 UNet (~3.4 GB) passes the 2 GiB protobuf limit; force the same path
    # here with a 0.5 MB threshold, which the tiny UNet (4.5 MB) and VAE (1.6 MB) pass.
    out = tmp_path / "onnx"
    export_onnx(model_dir, out, external_data_threshold_mb=0.5)
    manifest = load_manifest(out)
    graphs = manifest.data["graphs"]
    assert graphs["unet_step"]["external_data"] == "unet_step.onnx_data"
    assert graphs["vae_decoder"]["external_data"] == "vae_decoder.onnx_data"
    assert graphs["text_encoder"]["external_data"] is None
    # The weights moved out: tensors under 1 KiB (biases, norms) may stay inline.
    data_bytes = (out / "unet_step.onnx_data").stat().st_size
    assert data_bytes > 0.8 * graphs["unet_step"]["weight_bytes"] > (out / "unet_step.onnx").stat().st_size
    onnx.checker.check_model(str(out / "unet_step.onnx"), full_check=True)
    assert not (tmp_path / "onnx.partial").exists()

    feeds = random_feeds(manifest, "unet_step", 2, 1, np.random.default_rng(0), hw=16)
    options = dict(providers=["CPUExecutionProvider"])
    split = ort.InferenceSession(str(out / "unet_step.onnx"), **options).run(None, feeds)
    whole = ort.InferenceSession(str(onnx_dir / "unet_step.onnx"), **options).run(None, feeds)
    for a, b in zip(split, whole):
        np.testing.assert_array_equal(a, b)


def test_export_refuses_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text("{}")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": "model", "base": {"prompt": "x"}}))
    result = edit_rt("export", str(config))  # as the console script runs it, in this process
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "not a diffusers Stable Diffusion folder" in result.stderr and "unet" in result.stderr
