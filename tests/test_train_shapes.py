"""The shapes training script at toy length: it writes a model the whole pipeline accepts."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from diffusers import StableDiffusionPipeline

from edit_rt.export.compile.onnx_export import export_onnx
from edit_rt.export.world.train import TrainSpec, train_shapes, world_words


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


@pytest.mark.slow  # ~9-20 s; the default run keeps the resume to the same weights (the looks run, below)
def test_a_cut_world2_run_resumes_to_the_same_model(tmp_path):
    """World 2 at toy length: a run cut after a checkpoint and resumed from it writes the same
    weights as one uncut run (the checkpoint holds the optimizer, schedule, EMA and generator)."""
    from safetensors.torch import load_file

    spec = TrainSpec.world64(vae_steps=2, unet_steps=6, batch=2, dataset_size=16, checkpoint_every=2,
                             block_out_channels=(8, 16, 16), vae_block_out_channels=(8, 8, 8), text_hidden_size=16)  # fmt: skip
    quiet = lambda s: None  # noqa: E731
    uncut = train_shapes(tmp_path / "uncut", spec, say=quiet)
    train_shapes(tmp_path / "cut", spec, say=quiet, checkpoint=tmp_path / "ckpt", stop_at=3)  # last checkpoint: step 2
    resumed = train_shapes(tmp_path / "resumed", spec, say=quiet, checkpoint=tmp_path / "ckpt")
    assert resumed["unet_steps_run"] == uncut["unet_steps_run"] == 6
    assert resumed["loss"]["unet"] == uncut["loss"]["unet"]
    a = load_file(tmp_path / "uncut" / "unet" / "diffusion_pytorch_model.safetensors")
    b = load_file(tmp_path / "resumed" / "unet" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "resumed" / "world.json").read_text()) == {"world": 2, "image_size": 64}
    assert 0 <= resumed["vae_round_trip"]["reader"] <= 1
    # a checkpoint of another spec is refused, not silently mixed in
    with pytest.raises(ValueError, match="another spec"):
        train_shapes(tmp_path / "other", dataclasses.replace(spec, seed=1), say=quiet, checkpoint=tmp_path / "ckpt")


def test_a_looks_run_cut_into_pieces_resumes_without_its_dataset_to_the_same_model(tmp_path):
    """Issue 36's training in pieces: a piece ends on its clock with its state saved, in either
    stage; the last, its 98 MB dataset not committed (deleted here), draws the same dataset again
    from its own seed and ends with the weights of one uncut run. The look round trip is on the card before
    any UNet step (written with the autoencoder's checkpoint)."""
    from safetensors.torch import load_file

    spec = TrainSpec.looks32(vae_steps=2, unet_steps=5, batch=2, dataset_size=16, checkpoint_every=100, max_minutes=0.0, look_scenes=3,
                             block_out_channels=(8, 16), vae_block_out_channels=(8, 8), text_hidden_size=16)  # fmt: skip
    quiet = lambda s: None  # noqa: E731
    uncut = train_shapes(tmp_path / "uncut", spec, say=quiet)
    # piece 1 ends in the autoencoder stage (after its first step), piece 2 finishes the
    # autoencoder and ends at the UNet's first step, piece 3 runs the rest
    first = train_shapes(tmp_path / "piece1", spec, say=quiet, checkpoint=tmp_path / "ckpt", piece_minutes=1e-9)
    assert not first["finished"] and first["stage"] == "autoencoder" and first["vae_steps_run"] == 1
    assert not (tmp_path / "piece1" / "unet").exists() and (tmp_path / "ckpt" / "vae_partial.pt").is_file()
    second = train_shapes(tmp_path / "piece2", spec, say=quiet, checkpoint=tmp_path / "ckpt", piece_minutes=1e-9)
    assert not second["finished"] and second["unet_steps_run"] < 5 and not (tmp_path / "ckpt" / "vae_partial.pt").exists()
    assert second["loss"]["vae"] == uncut["loss"]["vae"]  # the autoencoder as one uncut run trained it
    assert json.loads((tmp_path / "ckpt" / "look_round_trip.json").read_text())["looks"].keys() == {"saturation", "stroke", "blur"}
    (tmp_path / "ckpt" / "data.pt").unlink()
    resumed = train_shapes(tmp_path / "piece3", spec, say=quiet, checkpoint=tmp_path / "ckpt")
    assert resumed["finished"] and resumed["unet_steps_run"] == uncut["unet_steps_run"] == 5
    assert resumed["loss"]["unet"] == uncut["loss"]["unet"]
    for part in ("vae", "unet"):
        a = load_file(tmp_path / "uncut" / part / "diffusion_pytorch_model.safetensors")
        b = load_file(tmp_path / "piece3" / part / "diffusion_pytorch_model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    assert (tmp_path / "piece2" / "look_round_trip.png").is_file()  # written with the autoencoder, before any UNet step
    # a checkpoint of another spec is refused, not silently mixed in
    with pytest.raises(ValueError, match="another spec"):
        train_shapes(tmp_path / "other", dataclasses.replace(spec, seed=1), say=quiet, checkpoint=tmp_path / "ckpt")
