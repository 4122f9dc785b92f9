"""The tiny decoder (issue 51, item 4): diffusers' ``AutoencoderTiny`` (TAESD) exported as
``taesd_decoder`` / ``taesd_encoder`` beside the VAE's graphs, chosen per run and request, and
decoding previews wherever the export has it.

No TAESD weights exist offline: the model here is the session's tiny model with a random
``AutoencoderTiny`` of TAESD's architecture (narrow: 16 channels) in its ``vae_tiny/``, and every
check compares with diffusers' own module on those weights (its ``decode``/``encode``, with the
pipelines' ``latents / scaling_factor`` and ``(x / 2 + 0.5).clamp(0, 1)``).
"""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from edit_rt.runtime.errors import ConfigError, ModelError
from edit_rt.runtime.loop.batcher import Batcher
from edit_rt.runtime.loop.jobs import Job, Request
from edit_rt.runtime.model.edit import TailRow
from edit_rt.runtime.pipeline.images import to_uint8

from .conftest import TEST_BASE


@pytest.fixture(scope="module")
def taesd_model(model_dir, tmp_path_factory):
    """The session's tiny model with a random tiny autoencoder in ``vae_tiny/`` (the VAE's 2x)."""
    from edit_rt.export.world.tiny_model import write_tiny_vae

    out = tmp_path_factory.mktemp("taesd") / "tiny-taesd"
    shutil.copytree(model_dir, out)
    write_tiny_vae(out / "vae_tiny", seed=1, factor=2, channels=16)
    return out


@pytest.fixture(scope="module")
def taesd_onnx(taesd_model):
    from edit_rt.export.compile.onnx_export import export_onnx

    out = taesd_model.parent / "build" / taesd_model.name / "onnx"
    export_onnx(taesd_model, out)
    return out


@pytest.fixture(scope="module")
def tiny(taesd_model):
    from diffusers import AutoencoderTiny

    return AutoencoderTiny.from_pretrained(str(taesd_model / "vae_tiny")).eval()


@pytest.fixture(scope="module")
def taesd_pipe(taesd_onnx, taesd_model):
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    with EditPipeline(taesd_onnx, taesd_model) as pipe:
        yield pipe


def _diffusers_images(tiny, latents: np.ndarray) -> np.ndarray:
    """diffusers' decode of UNet latents with ``vae = AutoencoderTiny``, as [N, H, W, 3] in [0, 1]."""
    with torch.no_grad():
        image = tiny.decode(torch.from_numpy(latents) / tiny.config.scaling_factor).sample
    return (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def test_taesd_graphs_equal_diffusers_autoencoder_tiny(taesd_onnx, tiny):
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((3, 4, 16, 12), dtype=np.float32) * 2  # past TAESD's clamp at 3, another size
    decoder = ort.InferenceSession(str(taesd_onnx / "taesd_decoder.onnx"), providers=["CPUExecutionProvider"])
    (images,) = decoder.run(None, {"latents": latents})
    np.testing.assert_allclose(images.transpose(0, 2, 3, 1), _diffusers_images(tiny, latents), atol=1e-4)

    pixels = rng.random((2, 3, 32, 24), dtype=np.float32)
    encoder = ort.InferenceSession(str(taesd_onnx / "taesd_encoder.onnx"), providers=["CPUExecutionProvider"])
    (encoded,) = encoder.run(None, {"images": pixels})
    with torch.no_grad():  # diffusers' img2img: retrieve_latents (.latents), times scaling_factor
        reference = tiny.encode(torch.from_numpy(pixels) * 2 - 1).latents * tiny.config.scaling_factor
    np.testing.assert_allclose(encoded, reference.numpy(), atol=1e-4)


def test_an_edit_decoded_by_taesd_is_diffusers_tiny_decode_of_its_latents(taesd_pipe, tiny):
    state = taesd_pipe.generate_base(TEST_BASE)
    rows = [TailRow("a blue square", 1.0, 5, TEST_BASE.guidance), TailRow("a green circle", 0.5, 7, 3.0)]
    tiny_results = taesd_pipe.edit(state, rows, decoder="taesd")
    vae_results = taesd_pipe.edit(state, rows)  # the default: the VAE
    latents = np.stack([r.latent for r in tiny_results])
    expected = _diffusers_images(tiny, latents)
    for result, reference, vae in zip(tiny_results, expected, vae_results):
        np.testing.assert_allclose(result.image, reference, atol=1e-4)
        assert np.abs(to_uint8(result.image).astype(int) - to_uint8(reference).astype(int)).max() <= 1
        assert np.abs(vae.image - result.image).max() > 0.05  # the VAE decoded these: another decoder's pixels


def test_a_run_with_decoder_taesd_writes_diffusers_tiny_images(taesd_pipe, taesd_model, taesd_onnx, tiny, tmp_path):
    from edit_rt.runtime.apps.run import run_config
    from edit_rt.runtime.config.load import config_from_dict

    cfg = config_from_dict({
        "model": str(taesd_model), "build_dir": str(taesd_onnx.parent.parent), "output_dir": str(tmp_path / "out"),
        "decoder": "taesd", "base": {"prompt": TEST_BASE.prompt, "negative_prompt": TEST_BASE.negative_prompt,
                                     "seed": TEST_BASE.seed, "steps": TEST_BASE.steps, "guidance": TEST_BASE.guidance,
                                     "width": 32, "height": 32},
        "edits": [{"prompt": "a blue square", "start_step": 5}],
    })  # fmt: skip
    report = run_config(cfg)
    assert report["decoder"] == "taesd"
    state = taesd_pipe.generate_base(TEST_BASE)  # the same base: seeded, deterministic
    (edit,) = taesd_pipe.run_tail(state, [TailRow("a blue square", 1.0, 5, TEST_BASE.guidance)])
    for name, latent in (("base.png", state.final_latent[0]), ("edit_00.png", edit)):
        written = np.asarray(Image.open(tmp_path / "out" / name).convert("RGB")).astype(int)
        reference = to_uint8(_diffusers_images(tiny, latent[None])[0]).astype(int)
        assert np.abs(written - reference).max() <= 1, name


class Counting:
    """A graph's ``infer``, counting its calls."""

    def __init__(self, graph):
        self.infer, self.calls = graph.infer, 0

    def __call__(self, feeds):
        self.calls += 1
        return self.infer(feeds)


def _previews(pipe, monkeypatch) -> tuple[list[np.ndarray], dict[str, int]]:
    """A generation with a preview at every step: the previews, and each decoder graph's calls."""
    counters = {name: Counting(pipe.graphs[name]) for name in ("vae_decoder", "taesd_decoder") if name in pipe.graphs}
    for name, counter in counters.items():
        monkeypatch.setattr(pipe.graphs[name], "infer", counter)
    noise = pipe.initial_noise(TEST_BASE)
    scheduler = pipe.new_scheduler(noise.shape[1:], max_rows=2)
    batcher = Batcher(pipe.resolver, scheduler)
    seen, x0s = [], []
    request = Request("previews", on_preview=lambda i, step, of, image: seen.append(image), decode=False)
    job = Job(request, 0, TEST_BASE, TailRow(TEST_BASE.prompt, 1.0, 0, TEST_BASE.guidance), noise=noise, preview_every=3)
    batcher.submit(request, [job])
    while not job.future.done():
        batcher.work_once()
        x0s += [row.preview.copy() for row in scheduler.active if row.previewed == row.step - 1]
    scheduler.free()
    return list(zip(seen, x0s)), {name: c.calls for name, c in counters.items()}


def test_previews_go_through_the_tiny_decoder_when_there_is_one(taesd_pipe, pipeline, tiny, monkeypatch):
    previews, calls = _previews(taesd_pipe, monkeypatch)
    assert len(previews) == 3 and calls == {"vae_decoder": 0, "taesd_decoder": 3}
    for image, x0 in previews:
        np.testing.assert_allclose(image, _diffusers_images(tiny, x0[None])[0], atol=1e-4)
    # a model without one previews through its VAE, as before
    _, calls = _previews(pipeline, monkeypatch)
    assert calls == {"vae_decoder": 3}


def test_taesd_on_a_model_without_one_is_refused_in_one_line(pipeline, base_state):
    with pytest.raises(ConfigError) as err:
        pipeline.edit(base_state, [TailRow("a blue square", 1.0, 5, 7.5)], decoder="taesd")
    message = str(err.value)
    assert "\n" not in message and message.startswith("decoder: taesd") and "export.tiny_vae" in message


def test_the_doors_refuse_taesd_without_one_and_serve_it_with_one(model_dir, onnx_dir, taesd_model, taesd_onnx, tiny):
    """Both doors over ASGI, in this process: 400 naming the field on the plain model; on the
    model with a tiny decoder, the OpenAI door's image is diffusers' tiny decode of the base."""
    import asyncio
    import base64
    import io

    from edit_rt.runtime.config.load import config_from_dict
    from edit_rt.runtime.serving.service import Service
    from edit_rt.runtime.web.server import create_app

    def served(model, onnx):
        cfg = config_from_dict({"model": str(model), "build_dir": str(onnx.parent.parent), "store": {"ram_mb": 16},
                                "base": {"prompt": "x", "steps": 4, "guidance": 7.5, "width": 32, "height": 32}})  # fmt: skip
        service = Service(cfg)
        service.load()
        assert service.ready.is_set(), service.load_error
        return service, create_app(cfg, service)

    async def posts(app, requests):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8188", timeout=60) as c:
            return [await c.post(path, json=body) for path, body in requests]

    plain, plain_app = served(model_dir, onnx_dir)
    try:
        refused = asyncio.run(posts(plain_app, [
            ("/v1/images/generations", {"prompt": "x", "decoder": "taesd"}),
            ("/sdapi/v1/txt2img", {"prompt": "x", "override_settings": {"sd_vae": "taesd"}}),
        ]))  # fmt: skip
    finally:
        plain.shutdown()
    for answer, param in zip(refused, ("decoder", "override_settings.sd_vae")):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"] if "error" in answer.json() else answer.json()
        assert param in str(error) and "export.tiny_vae" in str(error)

    service, app = served(taesd_model, taesd_onnx)
    try:
        (made,) = asyncio.run(posts(app, [("/v1/images/generations", {"prompt": "x", "seed": 5, "decoder": "taesd"})]))
        assert made.status_code == 200, made.text
        base = service.base_of("x", None, None, None, None, 5, None)
        latent = service.pipe.generate_base(base).final_latent
    finally:
        service.shutdown()
    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(made.json()["data"][0]["b64_json"]))).convert("RGB"))
    assert np.abs(pixels.astype(int) - to_uint8(_diffusers_images(tiny, latent)[0]).astype(int)).max() <= 1


def _authors_layout(module) -> tuple[dict, dict]:
    """``module``'s state dict under the keys its authors' taesd_decoder/encoder files use: their
    ``nn.Sequential`` indices, the decoder's one up (its layer 0 is the clamp)."""
    state = {k: v.contiguous() for k, v in module.state_dict().items()}
    encoder = {k[len("encoder.layers."):]: v for k, v in state.items() if k.startswith("encoder.layers.")}
    decoder = {}
    for k, v in state.items():
        if k.startswith("decoder.layers."):
            index, rest = k[len("decoder.layers."):].split(".", 1)
            decoder[f"{int(index) + 1}.{rest}"] = v
    return decoder, encoder


def test_the_authors_files_load_as_diffusers_autoencoder_tiny(tmp_path):
    from edit_rt.export.compile.tiny_vae import load_tiny_vae
    from edit_rt.export.world.tiny_model import tiny_vae_module

    reference = tiny_vae_module(factor=4, channels=8, seed=2)
    decoder, encoder = _authors_layout(reference)
    save_file(decoder, str(tmp_path / "taesd_decoder.safetensors"))
    save_file(encoder, str(tmp_path / "taesd_encoder.safetensors"))
    for path in (tmp_path, tmp_path / "taesd_decoder.safetensors"):  # the folder, or the decoder file
        loaded = load_tiny_vae(path)
        assert loaded.encoder
        got = loaded.module.state_dict()
        assert got.keys() == reference.state_dict().keys()
        for key, value in reference.state_dict().items():
            assert torch.equal(got[key], value), key
        latents = torch.randn(1, 4, 6, 6)
        with torch.no_grad():
            assert torch.equal(loaded.module.decode(latents).sample, reference.decode(latents).sample)

    (tmp_path / "taesd_encoder.safetensors").unlink()  # a decoder alone: previews need no encoder
    assert not load_tiny_vae(tmp_path / "taesd_decoder.safetensors").encoder

    pickle = tmp_path / "taesd_decoder.pth"
    pickle.write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(ModelError, match="pickle") as err:
        load_tiny_vae(pickle)
    assert "\n" not in str(err.value)


def test_a_tiny_autoencoder_of_another_factor_is_refused(model_dir, tmp_path):
    from edit_rt.export.compile.onnx_export import export_onnx
    from edit_rt.export.world.tiny_model import write_tiny_vae

    wrong = write_tiny_vae(tmp_path / "taesd", factor=8, channels=8)  # SD's 8x; this model's VAE is 2x
    with pytest.raises(ModelError, match="export.tiny_vae") as err:
        export_onnx(model_dir, tmp_path / "onnx", tiny_vae=wrong)
    assert "\n" not in str(err.value)


def test_bench_measures_taesd_against_the_vae_side_by_side(taesd_pipe, pipeline, base_state, monkeypatch):
    from edit_rt.export.bench.interactive import interactive, taesd_vs_vae

    counters = {name: Counting(taesd_pipe.graphs[name]) for name in ("vae_decoder", "taesd_decoder")}
    for name, counter in counters.items():
        monkeypatch.setattr(taesd_pipe.graphs[name], "infer", counter)
    state = taesd_pipe.generate_base(TEST_BASE)
    measured = taesd_vs_vae(taesd_pipe, state, repeats=1)
    assert {name: c.calls for name, c in counters.items()} == {"vae_decoder": 4, "taesd_decoder": 4}  # 3 repeats + warm-up
    low, high = measured["ratio_spread"]
    assert low <= measured["ratio"] <= high and measured["seconds_taesd"] > 0 and measured["latent_shape"] == [4, 16, 16]
    monkeypatch.setattr("edit_rt.export.bench.interactive.unguided_vs_guided", lambda *args: {})
    assert "taesd_vs_vae" not in interactive(pipeline, base_state, [], 1, 1)  # a model without one: no key
