"""The shapes training script at toy length: it writes a model the whole pipeline accepts."""

from __future__ import annotations

import json

from diffusers import StableDiffusionPipeline

from edit_rt.export.onnx_export import export_onnx
from edit_rt.export.train_shapes import TrainSpec, train_shapes, world_words


def test_training_writes_a_loadable_exportable_model(tmp_path):
    out = tmp_path / "shapes-sd"
    report = train_shapes(out, TrainSpec(vae_steps=3, unet_steps=3, batch=4, dataset_size=64), say=lambda s: None)
    assert len(report["loss"]["vae"]) == 3 and len(report["loss"]["unet"]) == 3
    assert (out / "loss.png").is_file() and json.loads((out / "training.json").read_text())["seconds"] > 0
    pipe = StableDiffusionPipeline.from_pretrained(out)
    # every word of the world is one token
    for word in world_words():
        assert len(pipe.tokenizer.tokenize(word)) == 1, word
    assert abs(pipe.vae.config.scaling_factor - report["vae_scaling_factor"]) < 1e-6
    export_onnx(out, tmp_path / "onnx")
