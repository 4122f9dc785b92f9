"""The tiny decoder (issue 51, item 4): diffusers' ``AutoencoderTiny`` (TAESD) exported as
``taesd_decoder`` / ``taesd_encoder`` beside the VAE's graphs, chosen per run and request, and
decoding previews wherever the export has it.

No TAESD weights exist offline: the model here is the session's tiny model with a random
``AutoencoderTiny`` of TAESD's architecture (narrow: 16 channels) in its ``vae_tiny/``, and every
check compares with diffusers' own module on those weights (its ``decode``/``encode``, with the
pipelines' ``latents / scaling_factor`` and ``(x / 2 + 0.5).clamp(0, 1)``).

Every place a decoder is chosen is checked: `make parity`, an upload's encoding (the server's
doors, a run's ``base.image``), the OpenAI multipart form, the Ray Serve hop (in this process:
the arguments pickled as Ray ships them, the worker's call in a context of its own) and a
catalogue's ``decoder``.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
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
def taesd_model(taesd_dir):
    """The session's tiny model with a random tiny autoencoder in ``vae_tiny/`` (the VAE's 2x)."""
    return taesd_dir


@pytest.fixture(scope="module")
def taesd_onnx(taesd_onnx_dir):
    return taesd_onnx_dir


@pytest.fixture(scope="module")
def tiny(taesd_model):
    from diffusers import AutoencoderTiny

    return AutoencoderTiny.from_pretrained(str(taesd_model / "vae_tiny")).eval()


@pytest.fixture(scope="module")
def taesd_pipe(taesd_onnx, taesd_model):
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    with EditPipeline(taesd_onnx, taesd_model) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def taesd_served(taesd_model, taesd_onnx):
    """A server's Service on the model with a tiny autoencoder, and its app (over ASGI)."""
    service, app = _served(taesd_model, taesd_onnx)
    yield service, app
    service.shutdown()


def _served(model, onnx):
    from edit_rt.runtime.config.load import config_from_dict
    from edit_rt.runtime.serving.service import Service
    from edit_rt.runtime.web.server import create_app

    cfg = config_from_dict({"model": str(model), "build_dir": str(onnx.parent.parent), "store": {"ram_mb": 16},
                            "base": {"prompt": "x", "steps": 4, "guidance": 7.5, "width": 32, "height": 32}})  # fmt: skip
    service = Service(cfg)
    service.load()
    assert service.ready.is_set(), service.load_error
    return service, create_app(cfg, service)


async def _sent(app, requests):
    """Each (path, httpx keyword arguments) POSTed to ``app`` in turn, over ASGI in this process."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8188", timeout=60) as c:
        return [await c.post(path, **kwargs) for path, kwargs in requests]


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


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_the_doors_refuse_taesd_without_one_and_serve_it_with_one(model_dir, onnx_dir, taesd_served, tiny):
    """Both doors over ASGI, in this process: 400 naming the field on the plain model (the
    OpenAI door's JSON and its multipart form, A1111's override); on the model with a tiny
    decoder, the OpenAI door's image is diffusers' tiny decode of the base."""
    import base64

    plain, plain_app = _served(model_dir, onnx_dir)
    image = _png(np.zeros((32, 32, 3), np.uint8))
    try:
        refused = asyncio.run(_sent(plain_app, [
            ("/v1/images/generations", {"json": {"prompt": "x", "decoder": "taesd"}}),
            ("/sdapi/v1/txt2img", {"json": {"prompt": "x", "override_settings": {"sd_vae": "taesd"}}}),
            ("/v1/images/edits", {"data": {"prompt": "x", "decoder": "taesd"}, "files": {"image": ("x.png", image, "image/png")}}),
            ("/v1/images/variations", {"data": {"decoder": "taesd"}, "files": {"image": ("x.png", image, "image/png")}}),
        ]))  # fmt: skip
    finally:
        plain.shutdown()
    for answer, param in zip(refused, ("decoder", "override_settings.sd_vae", "decoder", "decoder")):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"] if "error" in answer.json() else answer.json()
        assert param in str(error) and "export.tiny_vae" in str(error), error

    service, app = taesd_served
    (made,) = asyncio.run(_sent(app, [("/v1/images/generations", {"json": {"prompt": "x", "seed": 5, "decoder": "taesd"}})]))
    assert made.status_code == 200, made.text
    latent = service.pipe.generate_base(service.fields.base_of("x", None, None, None, None, 5, None)).final_latent
    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(made.json()["data"][0]["b64_json"]))).convert("RGB"))
    assert np.abs(pixels.astype(int) - to_uint8(_diffusers_images(tiny, latent)[0]).astype(int)).max() <= 1


def _diffusers_latent(tiny, pixels: np.ndarray) -> np.ndarray:
    """diffusers' img2img latent of ``pixels`` [H, W, 3] in [0, 1] with ``vae = AutoencoderTiny``:
    ``retrieve_latents`` (TAESD's encoder output itself: no posterior) times ``scaling_factor``."""
    assert tiny.config.scaling_factor == 1.0  # TAESD encodes to the UNet's latents as they are
    with torch.no_grad():
        x = torch.from_numpy(pixels.transpose(2, 0, 1)[None].copy()) * 2 - 1
        return (tiny.encode(x).latents * tiny.config.scaling_factor).numpy()


def _counted(monkeypatch, pipe, names=("vae_encoder", "taesd_encoder", "vae_decoder", "taesd_decoder")) -> dict:
    counters = {name: Counting(pipe.graphs[name]) for name in names}
    for name, counter in counters.items():
        monkeypatch.setattr(pipe.graphs[name], "infer", counter)
    return counters


def _calls(counters: dict) -> dict[str, int]:
    out = {name: c.calls for name, c in counters.items()}
    for c in counters.values():
        c.calls = 0
    return out


def _upload_edit(decoder=None, seed: int = 7) -> tuple[dict, np.ndarray]:
    """An OpenAI images.edit form of a random 32x32 image (not edit-rt's: it is inverted), and
    the image's pixels in [0, 1]."""
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    data = {"prompt": "a blue square", **({"decoder": decoder} if decoder else {})}
    return {"data": data, "files": {"image": ("photo.png", _png(pixels), "image/png")}}, pixels.astype(np.float32) / 255


def test_an_upload_asked_with_taesd_is_encoded_by_the_tiny_encoder(taesd_served, tiny, monkeypatch):
    """The multipart form's ``decoder: taesd``: the image inverted from diffusers' AutoencoderTiny
    latent of it (the inverted base ends at the image's latent), by taesd_encoder only, and
    decoded by the tiny decoder; the same image without it is the VAE's, another base."""
    service, app = taesd_served
    counters = _counted(monkeypatch, service.pipe)
    form, pixels = _upload_edit("taesd")
    (tiny_answer,) = asyncio.run(_sent(app, [("/v1/images/edits", form)]))
    assert tiny_answer.status_code == 200, tiny_answer.text
    # decoded twice: the inverted base's image, the edit's
    assert _calls(counters) == {"vae_encoder": 0, "taesd_encoder": 1, "vae_decoder": 0, "taesd_decoder": 2}
    tiny_base = service.store.get(tiny_answer.json()["base_id"])
    np.testing.assert_allclose(tiny_base.final_latent, _diffusers_latent(tiny, pixels), atol=1e-4)

    form, _ = _upload_edit()  # the server's decoder: the VAE, for the encoding too
    (vae_answer,) = asyncio.run(_sent(app, [("/v1/images/edits", form)]))
    assert vae_answer.status_code == 200, vae_answer.text
    assert _calls(counters) == {"vae_encoder": 1, "taesd_encoder": 0, "vae_decoder": 2, "taesd_decoder": 0}
    assert vae_answer.json()["base_id"] != tiny_answer.json()["base_id"]
    vae_base = service.store.get(vae_answer.json()["base_id"])
    assert np.abs(vae_base.final_latent - tiny_base.final_latent).max() > 0.05  # another autoencoder's latent


def test_a_run_with_decoder_taesd_inverts_its_image_from_the_tiny_encoders_latent(taesd_model, taesd_onnx, tiny, tmp_path):
    from edit_rt.runtime.apps.run import run_config
    from edit_rt.runtime.config.load import config_from_dict
    from edit_rt.runtime.engine.manifest import load_manifest
    from edit_rt.runtime.pipeline.assemble import store_of

    pixels = np.random.default_rng(8).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    (tmp_path / "photo.png").write_bytes(_png(pixels))
    cfg = config_from_dict({
        "model": str(taesd_model), "build_dir": str(taesd_onnx.parent.parent), "output_dir": str(tmp_path / "out"),
        "decoder": "taesd", "store": {"disk_dir": str(tmp_path / "bases")},
        "base": {"prompt": "a photo", "image": str(tmp_path / "photo.png"), "steps": 4, "width": 32, "height": 32},
        "edits": [{"prompt": "a blue square", "start_step": 2}],
    })  # fmt: skip
    report = run_config(cfg)
    assert report["base_source"] == "inverted"
    state = store_of(cfg, load_manifest(taesd_onnx).fingerprint).get(report["base_id"])
    np.testing.assert_allclose(state.final_latent, _diffusers_latent(tiny, pixels.astype(np.float32) / 255), atol=1e-4)


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


class _Hop:
    """A Ray Serve deployment handle over one worker, in this process, carrying a call as Ray
    does: its arguments pickled (Ray's cloudpickle) and the worker's coroutine run in a context
    of its own (a replica's task never sees the ingress's ContextVars)."""

    def __init__(self, worker, stream: bool = False):
        self.worker, self.stream = worker, stream

    def options(self, stream: bool = False) -> "_Hop":
        return _Hop(self.worker, stream)

    def __getattr__(self, name: str):
        hop = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                from ray import cloudpickle

                args, kwargs = cloudpickle.loads(cloudpickle.dumps((args, kwargs)))
                call = getattr(hop.worker, name)(*args, **kwargs)
                return _Stream(call) if hop.stream else _Response(call)

        return Method


class _Response:
    def __init__(self, call):
        self.task = asyncio.get_running_loop().create_task(call, context=contextvars.Context())

    def __await__(self):
        return self.task.__await__()

    def cancel(self):
        self.task.cancel()


class _Stream:
    def __init__(self, events):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._drain(events), context=contextvars.Context())

    async def _drain(self, events):
        try:
            async for event in events:
                await self.queue.put(("event", event))
            await self.queue.put(("end", None))
        except Exception as err:
            await self.queue.put(("error", err))

    def __aiter__(self):
        return self

    async def __anext__(self):
        kind, value = await self.queue.get()
        if kind == "end":
            raise StopAsyncIteration
        if kind == "error":
            raise value
        return value

    def cancel(self):
        self.task.cancel()


def test_the_request_decoder_crosses_the_ray_hop(taesd_served, tiny, monkeypatch):
    """On Ray Serve the ingress (no engines) checks the request's decoder against the manifest
    and sends it with the call; the replica decodes (and encodes an upload) by it: a generation's
    image is diffusers' tiny decode of its base, an upload's base diffusers' tiny latent of it."""
    import base64

    pytest.importorskip("ray", reason="Ray Serve is not installed (pip install -e '.[ray]')")
    from edit_rt.runtime.engine.manifest import load_manifest
    from edit_rt.runtime.scale.ray_serve import EditWorker, RayService
    from edit_rt.runtime.serving.fields import ServedModel
    from edit_rt.runtime.web.server import create_app

    service, _ = taesd_served

    class InProcessWorker(EditWorker):
        def __init__(self):  # the test's loaded service, which it leaves running when collected
            self.service, self.replica = service, "in-process"

        def __del__(self):
            pass

    ingress = RayService(service.cfg, _Hop(InProcessWorker()))
    # what load() reads and asks a worker
    ingress.fields.model, ingress._backend = ServedModel.of_manifest(load_manifest(service.cfg.onnx_dir)), service.backend
    ingress.ready.set()
    app = create_app(service.cfg, ingress)
    counters = _counted(monkeypatch, service.pipe)
    form, pixels = _upload_edit("taesd", seed=9)
    made, edited = asyncio.run(_sent(app, [
        ("/v1/images/generations", {"json": {"prompt": "x", "seed": 6, "decoder": "taesd"}}),
        ("/v1/images/edits", form),
    ]))  # fmt: skip
    assert made.status_code == 200 and edited.status_code == 200, (made.text, edited.text)
    # the generation's image, the inverted base's, the edit's: all by the tiny decoder
    assert _calls(counters) == {"vae_encoder": 0, "taesd_encoder": 1, "vae_decoder": 0, "taesd_decoder": 3}
    latent = service.pipe.generate_base(service.fields.base_of("x", None, None, None, None, 6, None)).final_latent
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(made.json()["data"][0]["b64_json"]))).convert("RGB"))
    assert np.abs(image.astype(int) - to_uint8(_diffusers_images(tiny, latent)[0]).astype(int)).max() <= 1
    inverted = service.store.get(edited.json()["base_id"])
    np.testing.assert_allclose(inverted.final_latent, _diffusers_latent(tiny, pixels), atol=1e-4)


def test_a_catalogue_decodes_by_its_own_decoder(taesd_pipe, taesd_model, taesd_onnx, tiny, model_dir, onnx_dir, tmp_path):
    """``catalogue.decoder: taesd`` in a run whose own images are the VAE's: the catalogue's
    images are diffusers' tiny decode of its rows' latents, the edits' stay the VAE's; on a model
    without a tiny decoder it is refused in one line before anything runs."""
    from edit_rt.runtime.apps.run import run_config
    from edit_rt.runtime.config.load import config_from_dict

    def config(model, onnx, out):
        return config_from_dict({
            "model": str(model), "build_dir": str(onnx.parent.parent), "output_dir": str(out),
            "base": {"prompt": TEST_BASE.prompt, "negative_prompt": TEST_BASE.negative_prompt, "seed": TEST_BASE.seed,
                     "steps": TEST_BASE.steps, "guidance": TEST_BASE.guidance, "width": 32, "height": 32},
            "edits": [{"prompt": "a blue square", "start_step": 5}],
            "catalogue": {"edits": [{"prompt": "a blue square", "start_step": 5}], "decoder": "taesd"},
        })  # fmt: skip

    plain = config(model_dir, onnx_dir, tmp_path / "plain")
    with pytest.raises(ConfigError) as err:
        run_config(plain)
    assert str(err.value).startswith("catalogue.decoder: taesd") and "\n" not in str(err.value)
    assert not (tmp_path / "plain" / "base.png").exists()  # refused before the base

    cfg = config(taesd_model, taesd_onnx, tmp_path / "out")
    report = run_config(cfg)
    assert report["decoder"] == "vae" and report["catalogue"]["decoder"] == "taesd"
    state = taesd_pipe.generate_base(TEST_BASE)
    (latent,) = taesd_pipe.run_tail(state, [cfg.tail_row(cfg.catalogue.edits[0], "catalogue row 0")])
    written = np.asarray(Image.open(tmp_path / "out" / "catalogue" / "00000.png").convert("RGB")).astype(int)
    assert np.abs(written - to_uint8(_diffusers_images(tiny, latent[None])[0]).astype(int)).max() <= 1
    edit = np.asarray(Image.open(tmp_path / "out" / "edit_00.png").convert("RGB")).astype(int)
    assert np.abs(edit - written).max() > 12  # the same latent through the VAE: another decoder's pixels


def test_parity_checks_the_tiny_autoencoder_against_diffusers(taesd_model, taesd_onnx, tiny, tmp_path):
    """`make parity` lists taesd_decoder and taesd_encoder where the export has them, compared
    with diffusers' AutoencoderTiny (Polygraphy's Comparator); a graph that is not that module's
    fails there."""
    from edit_rt.export.compile.parity import parity_report, random_feeds, torch_runner
    from edit_rt.runtime.config.load import config_from_dict
    from edit_rt.runtime.engine.manifest import load_manifest

    def config(build):
        return config_from_dict({"model": str(taesd_model), "build_dir": str(build),
                                 "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32}})  # fmt: skip

    report = parity_report(config(taesd_onnx.parent.parent), (1, 2), graphs=("taesd_decoder", "taesd_encoder"))
    assert {(r["graph"], r["backend"], r["batch"]) for r in report.rows} == {
        (g, "onnx", n) for g in ("taesd_decoder", "taesd_encoder") for n in (1, 2)}  # fmt: skip
    assert all(r["pass"] for r in report.rows) and "| taesd_decoder | onnx |" in report.path.read_text()

    # parity's reference is diffusers' module itself: its decode / encode as the pipelines call them
    manifest = load_manifest(taesd_onnx)
    feeds = random_feeds(manifest, "taesd_decoder", 2, 1, np.random.default_rng(1), 16)
    with torch_runner("taesd_decoder", manifest, taesd_model) as runner:
        (images,) = runner.infer(feeds).values()
    np.testing.assert_allclose(images.transpose(0, 2, 3, 1), _diffusers_images(tiny, feeds["latents"]), atol=1e-5)
    feeds = random_feeds(manifest, "taesd_encoder", 1, 1, np.random.default_rng(2), 16)
    with torch_runner("taesd_encoder", manifest, taesd_model) as runner:
        (latents,) = runner.infer(feeds).values()
    np.testing.assert_allclose(latents, _diffusers_latent(tiny, feeds["images"][0].transpose(1, 2, 0)), atol=1e-5)

    # an export whose tiny decoder is another module's: parity says so
    from edit_rt.export.compile.graphs import VaeDecoderGraph
    from edit_rt.export.world.tiny_model import tiny_vae_module

    build = tmp_path / "build"
    shutil.copytree(taesd_onnx, build / taesd_model.name / "onnx")
    other = VaeDecoderGraph(tiny_vae_module(factor=2, channels=16, seed=5).eval())
    torch.onnx.export(other, (torch.randn(2, 4, 16, 16),), str(build / taesd_model.name / "onnx" / "taesd_decoder.onnx"),
                      input_names=["latents"], output_names=["images"], opset_version=17, dynamo=False,
                      dynamic_axes={"latents": {0: "N", 2: "H", 3: "W"}, "images": {0: "N", 2: "IH", 3: "IW"}})  # fmt: skip
    wrong = parity_report(config(build), (1,), graphs=("taesd_decoder",))
    assert [(r["graph"], r["pass"]) for r in wrong.rows] == [("taesd_decoder", False)]
