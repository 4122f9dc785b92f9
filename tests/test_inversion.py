"""Edit any image (issue 15): a base from an uploaded image by DDIM inversion with Direct
Inversion's corrections, then the same batched tails, through every door (config, JSON, the
OpenAI SDK's images.edit, webuiapi's img2img, the page's upload)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import httpx
import numpy as np
import pytest
import yaml
from PIL import Image

from edit_rt.export.world.shapes import Scene, prompt, read, render
from edit_rt.runtime.errors import ImageInputError
from edit_rt.runtime.model.edit import TailRow
from edit_rt.runtime.pipeline.images import to_uint8
from edit_rt.runtime.pipeline.uploads import image_from_bytes

from .cli_in_process import edit_rt
from .conftest import SHAPES_MODEL, TEST_BASE
from .server_process import ServerProcess

SCENE = Scene("red", "circle", "blue", "top left")


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def _png(pixels: np.ndarray, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format="PNG")
    return out.getvalue()


def _rendered(size: int = 32) -> np.ndarray:
    return render(SCENE, size, np.random.default_rng(0))  # a shapes-world picture no model drew


@pytest.fixture(scope="module")
def shapes_pipe(shapes_onnx_dir):
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    with EditPipeline(shapes_onnx_dir, SHAPES_MODEL) as pipe:
        yield pipe


SHAPES_BASE = dataclasses.replace(TEST_BASE, prompt=prompt(SCENE), negative_prompt="", steps=30, guidance=4.0)


@pytest.mark.parametrize("which", ["shapes", "random"])
def test_identity_edits_of_an_inverted_base_reconstruct_the_input(which, shapes_pipe, pipeline):
    pipe, base = (shapes_pipe, SHAPES_BASE) if which == "shapes" else (pipeline, TEST_BASE)
    image = _rendered().astype(np.float32) / 255
    state = pipe.invert(image, dataclasses.replace(base, image="sha256:test"))
    round_trip = pipe.decode(pipe.decoders.encode_image(image))[0]  # the VAE's own reconstruction
    T = base.steps
    # The random model's steps multiply fp32 noise by ~5 each (batch-size rounding: the
    # corrections were computed in one batch, this row runs alone): from step 0 its 10-step
    # chain ends 0.03 off (31.7 dB); from a third of the way on, as edits enter, it is exact to
    # 1e-3. The trained shapes model is not chaotic: exact (>100 dB) from step 0.
    starts = [0 if which == "shapes" else T // 3, T // 2, T - 1]
    finals = pipe.run_tail(state, [TailRow(base.prompt, 1.0, s, base.guidance) for s in starts])
    for s, final in zip(starts, finals):
        assert _psnr(pipe.decode(final[None])[0], round_trip) >= 40, s  # the bar; measured >100 dB
    # and the corrections are what makes it: without them the inverted chain drifts
    drifted = pipe.run_tail(dataclasses.replace(state, corrections=None), [TailRow(base.prompt, 1.0, starts[0], base.guidance)])
    assert _psnr(pipe.decode(drifted)[0], round_trip) < _psnr(pipe.decode(finals[:1])[0], round_trip)


def test_edits_of_an_inverted_base_batch_like_any_other(shapes_pipe):
    image = _rendered().astype(np.float32) / 255
    state = shapes_pipe.invert(image, dataclasses.replace(SHAPES_BASE, image="sha256:test"))
    T = SHAPES_BASE.steps
    rows = [TailRow(prompt(dataclasses.replace(SCENE, colour="green")), 1.5, 18, 4.0),
            TailRow(prompt(dataclasses.replace(SCENE, background="yellow")), 1.5, 18, 4.0),
            TailRow(SHAPES_BASE.prompt, 1.0, 20, 4.0, seed=3)]  # fmt: skip
    batched = shapes_pipe.run_tail(state, rows)
    for row, final in zip(rows, batched):
        (alone,) = shapes_pipe.run_tail(state, [row])
        np.testing.assert_allclose(final, alone, atol=1e-4)
    green, yellow = (read(to_uint8(im)) for im in shapes_pipe.decode(batched[:2]))
    assert green.colour == "green" and yellow.background == "yellow"
    assert T == 30


@pytest.mark.parametrize(
    "data,size,resize,status,needle",
    [
        (b"not an image", (32, 32), True, 400, "not an image"),
        (_png(np.zeros((40, 30, 3), np.uint8)), (32, 32), False, 400, "30x40; this server edits 32x32"),
        (_png(np.zeros((32, 32, 4), np.uint8), "RGBA"), (32, 32), True, 400, "transparent pixels"),
        (b"\x89PNG" + b"\0" * 2000, (32, 32), True, 413, "2004 bytes, at most 1000"),
    ],
)
def test_bad_images_are_refused_clearly(data, size, resize, status, needle):
    with pytest.raises(ImageInputError) as err:
        image_from_bytes(data, size, "image", 1000 if status == 413 else 10**7, resize, 25_000_000)
    assert err.value.status == status and needle in str(err.value) and str(err.value).startswith("image: ")


def test_grey_opaque_and_other_sized_images_are_taken():
    grey = image_from_bytes(_png(np.full((32, 32, 3), 128, np.uint8), "L"), (32, 32), "image", 10**7, True, 25_000_000)
    assert grey.pixels.shape == (32, 32, 3) and "converted from L to RGB" in grey.notes
    opaque = np.full((32, 32, 4), 255, np.uint8)
    assert "alpha" in image_from_bytes(_png(opaque, "RGBA"), (32, 32), "image", 10**7, True, 25_000_000).notes[0]
    big = image_from_bytes(_png(_rendered(64)), (32, 32), "image", 10**7, True, 25_000_000)
    assert big.pixels.shape == (32, 32, 3) and "resized from 64x64 to 32x32" in big.notes


@pytest.fixture(scope="module")
def server(tmp_path_factory, shapes_onnx_dir):
    proc = ServerProcess(tmp_path_factory.mktemp("inversion"), SHAPES_MODEL, shapes_onnx_dir,
                         base={"prompt": "x", "negative_prompt": "", "steps": 30, "guidance": 4.0, "width": 32, "height": 32},
                         extra={"cache": {"default_tail_fraction": 0.4, "default_strength": 1.5}})  # fmt: skip
    yield proc
    assert proc.stop()


def test_openai_sdk_images_edit_on_an_uploaded_image(server, tmp_path):
    import openai

    path = tmp_path / "picture.png"
    path.write_bytes(_png(_rendered()))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    edit = prompt(dataclasses.replace(SCENE, colour="green"))
    result = client.images.edit(image=open(path, "rb"), prompt=edit, extra_body={"source_prompt": prompt(SCENE)})
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"))
    assert read(image).colour == "green"
    bid = result.model_extra["base_id"]
    info = httpx.get(server.url + f"/v1/bases/{bid}").json()
    assert info["base"]["image"].startswith("sha256:") and info["base"]["prompt"] == prompt(SCENE)
    # the same picture again finds the stored base; JSON with base64 works as well
    again = httpx.post(server.url + "/v1/images/edits", json={"image": base64.b64encode(path.read_bytes()).decode(),
                       "source_prompt": prompt(SCENE), "edits": [{"prompt": edit}]}, timeout=120).json()  # fmt: skip
    assert again["base_id"] == bid
    with pytest.raises(openai.BadRequestError, match="not an image"):
        client.images.edit(image=("x.png", b"nope", "image/png"), prompt=edit)


def test_webuiapi_img2img_of_any_image(server):
    import webuiapi

    api = webuiapi.WebUIApi(host="127.0.0.1", port=server.port)
    picture = Image.fromarray(_rendered())
    result = api.img2img(images=[picture], prompt=prompt(dataclasses.replace(SCENE, background="yellow")),
                         denoising_strength=0.4, width=32, height=32, steps=30)  # fmt: skip (steps: the inversion's)
    assert read(np.asarray(result.image.convert("RGB"))).background == "yellow"
    assert result.info["tail_steps"] == [12] and len(result.info["base_ids"][0]) == 24


def test_a_config_base_image_runs_end_to_end(tmp_path, shapes_onnx_dir):
    (tmp_path / "in.png").write_bytes(_png(_rendered()))
    cfg = {"model": str(SHAPES_MODEL), "build_dir": str(shapes_onnx_dir.parent.parent), "output_dir": str(tmp_path / "out"),
           "base": {"prompt": prompt(SCENE), "negative_prompt": "", "steps": 30, "guidance": 4.0, "width": 32, "height": 32,
                    "image": "in.png"},
           "store": {"disk_dir": str(tmp_path / "bases")},
           "edits": [{"prompt": prompt(dataclasses.replace(SCENE, colour="white")), "strength": 1.5}]}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    # `edit-rt run` as the console script runs it, in this process (tests/cli_in_process.py): no
    # signal or fresh interpreter is this test's, the run and the store's second look are
    run = lambda: edit_rt("run", str(tmp_path / "config.yaml"))  # noqa: E731
    result = run()
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["base_source"] == "inverted" and report["unet_rows"]["base"] == 60
    assert read(np.asarray(Image.open(tmp_path / "out" / "edit_00.png").convert("RGB"))).colour == "white"
    assert "Base id: " in Image.open(tmp_path / "out" / "base.png").text["parameters"]
    again = run()
    assert again.returncode == 0, again.stderr
    again_report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert again_report["base_source"] == "store (disk)" and again_report["base_id"] == report["base_id"]
