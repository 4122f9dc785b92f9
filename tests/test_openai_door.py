"""The OpenAI door, drop-in (issue 24): every field of the ``openai`` SDK's images.generate,
images.edit and images.create_variation is honoured, refused (400 naming it) or accepted and
reported; OpenAI's mask keeps the uploaded pixels outside it; n edits are distinct seeded
variations; the SDK's streaming iterators get OpenAI's events; the OpenAPI document has every
body. Checked with the SDK itself (its own types say what a field is) and with Pillow reading
the images back; the edits are compared against the pipeline run directly."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from edit_rt.runtime.model.edit import Base, TailRow
from edit_rt.runtime.pipeline.images import to_uint8

from .server_process import ServerProcess

STEPS = 6
PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = ServerProcess(tmp_path_factory.mktemp("openai-door"), model_dir, onnx_dir,
                         base={"prompt": "x", "steps": STEPS, "guidance": 7.5, "width": 32, "height": 32})  # fmt: skip
    yield proc
    assert proc.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _picture(seed: int = 0) -> np.ndarray:
    """A smooth 32x32 picture (a disc on a gradient): something an inversion can hold."""
    y, x = np.mgrid[0:32, 0:32]
    rng = np.random.default_rng(seed)
    cx, cy = rng.integers(10, 22, 2)
    disc = ((x - cx) ** 2 + (y - cy) ** 2 < 64)[..., None]
    gradient = np.stack([x * 6, y * 6, np.full_like(x, 160)], -1)
    return np.where(disc, [220, 40, 30], gradient).astype(np.uint8)


def _png(pixels: np.ndarray, mode: str | None = None) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels, mode).save(out, format="PNG")
    return out.getvalue()


def _image(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(_image(b64).convert("RGB"))


# --- every field: honoured, refused or reported --------------------------------------------

# field -> [(a value other than the default, what must happen)]; "refused": 400 naming the
# field; "accepted": 200 with the field in info.accepted (what ran instead); a function: 200
# and the reply checked by it. Values are as a form carries them (text) for edit/variation.
REFUSED, ACCEPTED = "refused", "accepted"


def _n2(reply):
    assert len(reply["data"]) == 2 and len(set(reply["info"]["seeds"])) == 2


def _webp(reply):
    assert _image(reply["data"][0]["b64_json"]).format == "WEBP" and reply["output_format"] == "webp"


def _jpeg_at_10(reply):
    image = _image(reply["data"][0]["b64_json"])
    assert image.format == "JPEG" and reply["info"]["output_compression"] == 10
    assert PROMPT in image.getexif().get_ifd(0x8769)[0x9286][8:].decode("utf_16_be")  # the parameters ride along


def _echoed(reply):
    assert reply["safety_identifier"] == "someone"


def _size(reply):
    assert _image(reply["data"][0]["b64_json"]).size == (32, 32) and reply["size"] == "32x32"


def _streamed(reply):
    assert reply == "stream"


COMMON = {
    "background": [("transparent", REFUSED), ("opaque", ACCEPTED)],
    "complexity": [("high", REFUSED)],
    "frame_count": [(4, REFUSED)],
    "frame_duration_ms": [(100, REFUSED)],
    "model": [("gpt-image-1", ACCEPTED), ("another-model", REFUSED)],
    "moderation": [("low", ACCEPTED)],
    "n": [(2, _n2)],
    "output_compression": [(10, REFUSED)],  # with png; with jpeg below
    "output_format": [("webp", _webp), ("gif", REFUSED), ("svg", REFUSED)],
    "partial_images": [(2, REFUSED)],  # without stream; with it: the streaming tests
    "quality": [("high", REFUSED), ("auto", ACCEPTED)],
    "response_format": [("url", REFUSED)],
    "safety_identifier": [("someone", _echoed)],
    "size": [("64x64", REFUSED), ("32x32", _size)],
    "stream": [(True, _streamed)],
    "svg": [({"model": "x"}, REFUSED)],
    "user": [("someone", _echoed)],
}
GENERATE = {**COMMON, "prompt": [], "style": [("vivid", REFUSED)]}
EDIT = {**{k: v for k, v in COMMON.items() if k != "moderation"}, "image": [], "prompt": [], "mask": [], "markup": [(b"png", REFUSED)], "input_fidelity": [("high", REFUSED), ("low", ACCEPTED)]}
VARIATION = {"image": [], "model": COMMON["model"], "n": COMMON["n"], "response_format": COMMON["response_format"],
             "size": COMMON["size"], "user": COMMON["user"]}  # fmt: skip


def _sdk_fields(*typed_dicts) -> set[str]:
    return {k for t in typed_dicts for k in t.__required_keys__ | t.__optional_keys__}


def test_the_walk_covers_every_field_of_the_sdks_requests():
    from openai.types import image_create_variation_params as v, image_edit_params as e, image_generate_params as g

    assert set(GENERATE) == _sdk_fields(g.ImageGenerateParamsStreaming, g.ImageGenerateParamsNonStreaming)
    assert set(EDIT) == _sdk_fields(e.ImageEditParamsStreaming, e.ImageEditParamsNonStreaming)
    assert set(VARIATION) == _sdk_fields(v.ImageCreateVariationParams)


def _check(r: httpx.Response, field: str, expect):
    if expect == REFUSED:
        assert r.status_code == 400, (field, r.text)
        error = r.json()["error"]
        assert error["param"] == field and error["message"].startswith(f"{field}: "), (field, error)
        return
    assert r.status_code == 200, (field, r.text)
    if r.headers["content-type"].startswith("text/event-stream"):
        return expect("stream")
    reply = r.json()
    if expect == ACCEPTED:
        assert field in reply["info"]["accepted"], (field, reply["info"])
    else:
        expect(reply)


def test_every_generate_field_is_honoured_refused_or_reported(server):
    body = {"prompt": PROMPT, "seed": 5}
    for field, cases in GENERATE.items():
        for value, expect in cases:
            r = httpx.post(server.url + "/v1/images/generations", json={**body, field: value}, timeout=60)
            _check(r, field, expect)
    r = httpx.post(server.url + "/v1/images/generations", json={**body, "output_format": "jpeg", "output_compression": 10}, timeout=60)
    _check(r, "output_compression", _jpeg_at_10)


def _form(field, value):
    if field == "svg":
        return {"svg[model]": value["model"]}, {}
    if field == "markup":
        return {}, {"markup": ("m.png", value, "image/png")}
    return {field: str(value).lower() if isinstance(value, bool) else str(value)}, {}


def test_every_edit_and_variation_field_is_honoured_refused_or_reported(server):
    image = {"image": ("p.png", _png(_picture()), "image/png")}
    for route, table, body in (("edits", EDIT, {"prompt": "a green circle", "tail_steps": "2"}),
                               ("variations", VARIATION, {"tail_steps": "2"})):  # fmt: skip
        for field, cases in table.items():
            for value, expect in cases:
                data, files = _form(field, value)
                r = httpx.post(f"{server.url}/v1/images/{route}", data={**body, **data}, files={**image, **files}, timeout=60)
                _check(r, field, expect)
    for field, value in (("colour", "red"), ("prompt", "x")):  # not a field of the form: refused by name
        r = httpx.post(server.url + "/v1/images/variations", data={field: value}, files=image, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_sdk_generate_reports_what_ran(client, model_dir):
    result = client.images.generate(prompt=PROMPT, n=2, model="dall-e-3", size="32x32", quality="standard", moderation="low",
                                    user="someone", extra_body={"seed": 11, "steps": STEPS})  # fmt: skip
    info = result.model_extra["info"]
    assert info["model"] == model_dir.name and info["sampler"] == "ddim (DDIM)" and info["steps"] == STEPS  # the model's
    assert info["seeds"] == [11, 12] and set(info["accepted"]) == {"model", "quality", "moderation", "user"}
    assert f"{STEPS} sampling steps" in info["accepted"]["quality"] and result.safety_identifier == "someone"
    text = _image(result.data[1].b64_json).text["parameters"]
    assert "Seed: 12" in text and f"Model: {model_dir.name}" in text and "Sampler: DDIM" in text  # what ran, not dall-e-3
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt=PROMPT, quality="hd")
    assert err.value.body["param"] == "quality" and "steps" in err.value.body["message"]


# --- OpenAI's mask ---------------------------------------------------------------------------


def _mask(editable: np.ndarray, mode: str = "RGBA") -> bytes:
    """OpenAI's mask: transparent (alpha 0) where the image may change, opaque elsewhere."""
    rgba = np.zeros((*editable.shape, 4), np.uint8)
    rgba[..., 3] = np.where(editable, 0, 255)
    return _png(rgba if mode == "RGBA" else rgba[..., :3], mode)


def test_sdk_mask_keeps_the_uploaded_pixels_exactly_outside_it(client):
    import openai

    picture = _picture(1)
    editable = np.zeros((32, 32), bool)
    editable[:, :16] = True  # the left half may change
    kwargs = dict(image=("p.png", _png(picture), "image/png"), prompt="a green square on a yellow background",
                  extra_body={"source_prompt": PROMPT, "tail_steps": 5, "strength": 2.0})  # fmt: skip
    plain = _pixels(client.images.edit(**kwargs).data[0].b64_json)
    masked = _pixels(client.images.edit(mask=("m.png", _mask(editable), "image/png"), **kwargs).data[0].b64_json)
    assert np.array_equal(masked[:, 16:], picture[:, 16:])  # outside the mask: the upload's own pixels, exactly
    assert not np.array_equal(plain[:, 16:], picture[:, 16:])  # (which an unmasked edit does not keep)
    assert np.abs(masked[:, :14].astype(int) - picture[:, :14]).max() > 0  # inside it, the edit
    # an upload of another size is resized to the served one (Pillow's LANCZOS), its mask with it
    big = np.asarray(Image.fromarray(picture).resize((64, 64), Image.NEAREST))
    served = np.asarray(Image.fromarray(big).resize((32, 32), Image.LANCZOS))
    wide = np.zeros((64, 64), bool)
    wide[:, :32] = True
    resized = client.images.edit(**{**kwargs, "image": ("p.png", _png(big), "image/png")}, mask=("m.png", _mask(wide), "image/png"))
    assert np.array_equal(_pixels(resized.data[0].b64_json)[:, 17:], served[:, 17:])  # past the resized edge's blend
    with pytest.raises(openai.BadRequestError) as err:
        client.images.edit(mask=("m.png", _mask(np.ones((16, 16), bool)), "image/png"), **kwargs)
    assert err.value.body["param"] == "mask" and "16x16" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.images.edit(mask=("m.png", _mask(editable, "RGB"), "image/png"), **kwargs)
    assert err.value.body["param"] == "mask" and "alpha" in err.value.body["message"]


# --- n: distinct seeded variations -----------------------------------------------------------


def test_sdk_edit_n_gives_distinct_seeded_variations(client):
    kwargs = dict(image=("p.png", _png(_picture(2)), "image/png"), prompt="a green circle",
                  extra_body={"source_prompt": PROMPT, "tail_steps": 4})  # fmt: skip
    result = client.images.edit(n=3, **kwargs)
    seeds = [d.model_extra["info"]["seed"] for d in result.data]
    assert seeds == result.model_extra["info"]["seeds"] and seeds == list(range(seeds[0], seeds[0] + 3))
    images = [_pixels(d.b64_json) for d in result.data]
    assert all(not np.array_equal(images[a], images[b]) for a, b in ((0, 1), (0, 2), (1, 2)))
    for d, seed in zip(result.data, seeds):
        assert f"Variation seed: {seed}" in _image(d.b64_json).text["parameters"]
    seeded = client.images.edit(n=2, **{**kwargs, "extra_body": {**kwargs["extra_body"], "seed": 40}})
    assert [d.model_extra["info"]["seed"] for d in seeded.data] == [40, 41]


def test_json_edits_n_are_the_pipelines_seeded_edits(server, pipeline):
    gen = httpx.post(server.url + "/v1/images/generations", json={"prompt": PROMPT, "negative_prompt": "blurry", "seed": 3}, timeout=60).json()
    r = httpx.post(server.url + "/v1/images/edits", json={"base_id": gen["id"], "n": 2,
                   "edits": [{"prompt": "a blue square", "tail_steps": 3, "seed": 20}]}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    base = Base(prompt=PROMPT, negative_prompt="blurry", seed=3, steps=STEPS, guidance=7.5, width=32, height=32)
    state = pipeline.generate_base(base)
    for d, seed in zip(r.json()["data"], (20, 21)):
        assert d["info"]["seed"] == seed
        expected = to_uint8(pipeline.edit(state, [TailRow("a blue square", 1.0, STEPS - 3, 7.5, seed=seed)])[0].image)
        assert np.abs(_pixels(d["b64_json"]).astype(int) - expected).max() <= 1


def test_sdk_create_variation_is_seeded_renoising_of_the_image(client, server):
    picture = ("p.png", _png(_picture(3)), "image/png")
    result = client.images.create_variation(image=picture, n=2, extra_body={"seed": 7, "source_prompt": PROMPT})
    assert [d.model_extra["info"]["seed"] for d in result.data] == [7, 8] == result.model_extra["info"]["seeds"]
    a, b = (_pixels(d.b64_json) for d in result.data)
    assert not np.array_equal(a, b)
    text = _image(result.data[0].b64_json).text["parameters"]
    assert text.startswith(PROMPT) and "Variation seed: 7" in text and "Tail steps: 2" in text  # 0.4 of 6 steps
    plain = client.images.create_variation(image=picture)  # no prompt, no seed: the base's own K/V, a random seed
    assert plain.data[0].model_extra["info"]["seed"] is not None and plain.data[0].model_extra["info"]["strength"] == 0.0


# --- an edit-rt PNG re-enters its own base ---------------------------------------------------


def _metric(server, name: str, **labels: str) -> float:
    """A /metrics sample summed over the series whose labels include ``labels`` (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))  # fmt: skip


def test_sdk_edit_of_an_edit_rt_png_re_enters_its_base_as_img2img_does(client, server):
    """images.edit of a PNG this server generated: no inversion, no new base; the edit is the one
    requested by base id, pixel for pixel; an edit's PNG names the same base (with a mask, the
    upload's own pixels stay outside it); with the base gone, the image is inverted instead."""
    gen = client.images.generate(prompt=PROMPT, size="32x32", extra_body={"seed": 21, "steps": STEPS})
    bid, png = gen.model_extra["id"], base64.b64decode(gen.data[0].b64_json)
    inversions = lambda: _metric(server, "edit_rt_stage_seconds_count", stage="inversion")  # noqa: E731
    stored = lambda: _metric(server, "edit_rt_store_entries")  # noqa: E731
    before = (inversions(), stored())
    prompt, edit_body = "a green circle on a blue background", {"tail_steps": 3}
    edit = client.images.edit(image=("base.png", png, "image/png"), prompt=prompt, extra_body={**edit_body, "steps": 50})
    assert edit.model_extra["base_id"] == bid and edit.model_extra["base_reused"] == [True]
    assert (inversions(), stored()) == before  # no inversion ran, no base was stored
    assert edit.model_extra["info"]["accepted"]["steps"].startswith(f"{STEPS} (")  # the base's steps ran, said so
    by_id = httpx.post(server.url + "/v1/images/edits", json={"base_id": bid, "edits": [{"prompt": prompt, **edit_body}]},
                       timeout=120).json()  # fmt: skip
    assert np.array_equal(_pixels(edit.data[0].b64_json), _pixels(by_id["data"][0]["b64_json"]))  # 0 grey levels apart
    as_json = httpx.post(server.url + "/v1/images/edits", json={"image": gen.data[0].b64_json, "edits": [{"prompt": prompt, **edit_body}]},
                         timeout=120).json()  # fmt: skip
    assert as_json["base_id"] == bid and as_json["base_reused"] == [True]
    assert np.array_equal(_pixels(as_json["data"][0]["b64_json"]), _pixels(by_id["data"][0]["b64_json"]))
    editable = np.zeros((32, 32), bool)
    editable[:, :16] = True
    masked = client.images.edit(image=("edit.png", base64.b64decode(edit.data[0].b64_json), "image/png"), prompt="a yellow square",
                                mask=("m.png", _mask(editable), "image/png"), extra_body={"tail_steps": 5, "strength": 2.0})  # fmt: skip
    assert masked.model_extra["base_ids"] == [bid] and masked.model_extra["base_reused"] == [True]
    got, own = _pixels(masked.data[0].b64_json), _pixels(edit.data[0].b64_json)
    assert np.array_equal(got[:, 16:], own[:, 16:]) and not np.array_equal(got[:, :14], own[:, :14])
    assert (inversions(), stored()) == before
    # the base deleted: the same upload is inverted into a new base (as the A1111 door falls back)
    assert httpx.delete(f"{server.url}/v1/bases/{bid}", timeout=30).status_code == 200
    again = client.images.edit(image=("base.png", png, "image/png"), prompt=prompt, extra_body=edit_body)
    assert again.model_extra["base_reused"] == [False] and again.model_extra["base_id"] != bid
    assert inversions() == before[0] + 1


# --- streaming with the SDK's iterators ------------------------------------------------------


def test_sdk_generate_streams_partial_images_then_the_image(client):
    events = list(client.images.generate(prompt=PROMPT, stream=True, partial_images=2, size="32x32",
                                         extra_body={"seed": 9, "steps": STEPS}))  # fmt: skip
    kinds = [e.type for e in events]
    partial = [e for e in events if e.type == "image_generation.partial_image"]
    assert 1 <= len(partial) <= 2 and kinds[-1] == "image_generation.completed", kinds
    assert [e.partial_image_index for e in partial] == list(range(len(partial)))
    assert all(_image(e.b64_json).size == (32, 32) for e in partial)
    plain = client.images.generate(prompt=PROMPT, size="32x32", extra_body={"seed": 9, "steps": STEPS})
    assert np.array_equal(_pixels(events[-1].b64_json), _pixels(plain.data[0].b64_json))
    assert events[-1].model_extra["seed"] == 9 and events[-1].size == "32x32" and events[-1].output_format == "png"
    only = [e.type for e in client.images.generate(prompt=PROMPT, stream=True, partial_images=0, extra_body={"seed": 9})]
    assert only == ["image_generation.completed"]


def test_sdk_edit_streams_partial_images_then_each_image(client):
    kwargs = dict(image=("p.png", _png(_picture(4)), "image/png"), prompt="a green circle",
                  extra_body={"source_prompt": PROMPT, "tail_steps": 5})  # fmt: skip
    events = list(client.images.edit(stream=True, partial_images=1, n=2, **kwargs))
    kinds = [e.type for e in events]
    assert set(kinds) == {"image_edit.partial_image", "image_edit.completed"}, kinds  # OpenAI's events only
    done = sorted((e for e in events if e.type == "image_edit.completed"), key=lambda e: e.model_extra["index"])
    assert [e.model_extra["index"] for e in done] == [0, 1]
    for index in (0, 1):
        partial = [e for e in events if e.type == "image_edit.partial_image" and e.model_extra["index"] == index]
        assert len(partial) <= 1 and kinds.index("image_edit.completed") > kinds.index("image_edit.partial_image")
    plain = client.images.edit(**kwargs)  # n=1: the deterministic edit, the same as streamed alone
    streamed = list(client.images.edit(stream=True, **kwargs))
    assert [e.type for e in streamed] == ["image_edit.completed"]
    assert np.array_equal(_pixels(streamed[0].b64_json), _pixels(plain.data[0].b64_json))


def test_a_stream_refused_before_it_starts_is_a_plain_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.images.edit(image=("p.png", _png(_picture()), "image/png"), prompt="x", stream=True, extra_body={"strength": 9})
    assert err.value.body["param"] == "strength"


# --- the OpenAPI document --------------------------------------------------------------------


def test_openapi_documents_both_edit_bodies_and_the_served_sizes(server):
    from openapi_spec_validator import validate

    schema = httpx.get(server.url + "/openapi.json").json()
    validate(schema)
    components = schema["components"]["schemas"]
    body = schema["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"]["$ref"].endswith("/EditsRequest")
    assert body["multipart/form-data"]["schema"]["$ref"].endswith("/EditForm")
    form = components["EditForm"]["properties"]
    assert form["image"]["format"] == "binary" and form["mask"]["format"] == "binary"
    assert {"prompt", "n", "stream", "partial_images", "input_fidelity", "quality"} <= set(form)
    assert components["EditsRequest"]["properties"]["image"]["contentEncoding"] == "base64"
    assert components["Edit"]["properties"]["prompt"]
    sizes = json.dumps(components["GenerationRequest"]["properties"]["size"])
    assert '"32x32"' in sizes and '"auto"' in sizes
    variations = schema["paths"]["/v1/images/variations"]["post"]["requestBody"]["content"]
    assert components[variations["multipart/form-data"]["schema"]["$ref"].split("/")[-1]]["properties"]["image"]["format"] == "binary"


def test_schemathesis_sends_both_edit_bodies_and_finds_no_5xx(server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    seen, failures = [], []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path not in ("/v1/images/edits", "/v1/images/variations"):
            continue

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(base_url=server.url, timeout=60)
            seen.append((operation.path, case.media_type, response.status_code))
            if response.status_code >= 500 or str(response.status_code) not in operation.definition.raw["responses"]:
                failures.append((operation.path, case.media_type, response.status_code, response.text[:200]))

        check()
    assert not failures, failures[:5]
    kinds = {(path, kind) for path, kind, status in seen}
    assert {("/v1/images/edits", "multipart/form-data"), ("/v1/images/edits", "application/json"),
            ("/v1/images/variations", "multipart/form-data")} <= kinds, kinds  # fmt: skip
    assert {path for path, kind, status in seen if status == 200 and kind == "multipart/form-data"} == {
        "/v1/images/edits", "/v1/images/variations"}  # its generated images were edited, not only refused
