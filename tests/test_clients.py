"""Clients nobody here wrote, against a real server on loopback (issue 14): the OpenAI SDK,
webuiapi (AUTOMATIC1111's API), sd-parsers (PNG info), Prometheus' parser and promtool,
openapi-spec-validator and schemathesis (the OpenAPI document), the CLI's own flags."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess

import httpx
import numpy as np
import pytest
from PIL import Image

from .server_process import CLI, ServerProcess

STEPS = 6
PROMTOOL = shutil.which("promtool")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = ServerProcess(tmp_path_factory.mktemp("clients"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


def _image(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


# --- the OpenAI SDK ----------------------------------------------------------------------------


def test_openai_sdk_generate_with_its_fields_and_models(server, model_dir):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    result = client.images.generate(prompt="a red circle", n=2, model="dall-e-3", size="32x32", quality="auto",
                                    user="someone", response_format="b64_json",
                                    extra_body={"negative_prompt": "blurry", "seed": 11, "steps": STEPS})  # fmt: skip
    assert len(result.data) == 2
    images = [_image(d.b64_json) for d in result.data]
    assert images[0].size == (32, 32) and "Seed: 11" in images[0].text["parameters"] and "Seed: 12" in images[1].text["parameters"]
    assert [m.id for m in client.models.list()] == [model_dir.name]
    webp = client.images.generate(prompt="a red circle", size="32x32", extra_body={"output_format": "webp", "steps": STEPS})
    assert _image(webp.data[0].b64_json).format == "WEBP"


def test_openai_sdk_errors_are_its_own_types(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="x", size="64x64")
    assert err.value.body["param"] == "size" and "32x32" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="model: this server serves"):
        client.images.generate(prompt="x", model="another-model")
    with pytest.raises(openai.BadRequestError, match="steps"):
        client.images.generate(prompt="x", extra_body={"steps": "10"})


# --- AUTOMATIC1111 clients ---------------------------------------------------------------------


def test_webuiapi_txt2img_img2img_and_png_info(server):
    import webuiapi

    api = webuiapi.WebUIApi(host="127.0.0.1", port=server.port)
    base = api.txt2img(prompt="a red circle on a blue background", negative_prompt="blurry", seed=5, steps=STEPS,
                       width=32, height=32, cfg_scale=7.5)  # fmt: skip
    assert base.image.size == (32, 32) and len(base.info["base_id"]) == 24
    edited = api.img2img(images=[base.image], prompt="a green circle on a blue background", denoising_strength=0.5,
                         width=32, height=32)  # fmt: skip
    assert edited.image.size == (32, 32) and edited.info["base_ids"] == [base.info["base_id"]]
    assert edited.info["tail_steps"] == [3]  # denoising 0.5 of 6 steps
    assert np.abs(np.asarray(edited.image, dtype=int) - np.asarray(base.image, dtype=int)).max() > 0
    info = api.png_info(edited.image)
    assert f"Base id: {base.info['base_id']}" in info.info and "Tail steps: 3" in info.info
    models = api.get_sd_models()
    assert models[0]["model_name"] and api.get_options()["sd_model_checkpoint"] == models[0]["model_name"]
    assert 0 <= api.get_progress()["progress"] <= 1


# --- PNG info: an independent parser reads every field back whole -----------------------------


# AUTOMATIC1111's reading of a parameters line (its documented format: a value that holds a
# comma, colon or newline is a JSON string), written out here as the reference to read back with.
A1111_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def _a1111_fields(line: str) -> dict[str, str]:
    return {k: json.loads(v) if v.startswith('"') else v for k, v in A1111_PARAM.findall(line)}


def test_png_parameters_round_trip_through_sd_parsers_and_a1111s_format(server):
    from sd_parsers import ParserManager

    # a base prompt with commas, and a newline followed by a fake parameters line
    prompt = "a red circle on a blue background, top left\nSteps: 99, Seed: 1, Size: 1x1"
    gen = httpx.post(server.url + "/v1/images/generations", json={"prompt": prompt, "negative_prompt": "noise: high, blur",
                                                                  "seed": 9}, timeout=60).json()  # fmt: skip
    r = httpx.post(server.url + "/v1/images/edits", json={"base_id": gen["id"], "edits": [{"prompt": "a green circle", "tail_steps": 3}]},
                   timeout=60)  # fmt: skip
    for b64 in (gen["data"][0]["b64_json"], r.json()["data"][0]["b64_json"]):
        image = _image(b64)
        info = ParserManager().parse(image)  # sd-parsers: an independent reader
        (sampler,) = info.samplers
        assert sampler.name == "DDIM" and str(sampler.parameters["steps"]) == str(STEPS)  # the real line, not "Steps: 99"
        assert str(sampler.parameters["seed"]) == "9" and sampler.model.name and sampler.model.hash
        assert [p.value for p in sampler.negative_prompts] == ["noise: high, blur"]
        last = image.text["parameters"].splitlines()[-1]
        fields = _a1111_fields(last)
        assert fields["Steps"] == str(STEPS) and fields["Base id"] == gen["id"] and fields["Model"]
    assert [p.value for p in sampler.prompts] == ["a green circle"]
    assert fields["Base prompt"] == prompt  # read whole: commas, newline and all
    assert "Steps" not in [k for k in info.metadata if k != "Steps"] and json.loads(info.metadata["Base prompt"]) == prompt
    assert fields["Start step"] == "3" and fields["Tail steps"] == "3"


# --- Prometheus ---------------------------------------------------------------------------------


def test_metrics_parse_and_pass_promtool(server):
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(server.url + "/v1/images/generations", json={"prompt": "x", "seed": 2}, timeout=60)
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["edit_rt_ready"].samples[0].value == 1
    http = {(s.labels["route"], s.labels["method"], s.labels["status"]) for s in families["edit_rt_http_request_seconds"].samples
            if s.name.endswith("_count")}  # fmt: skip
    assert ("/v1/images/generations", "POST", "200") in http
    assert {s.labels["tier"] for s in families["edit_rt_store_bytes"].samples} == {"ram", "disk"}
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (.ci/run installs Debian's prometheus)")
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


# --- OpenAPI ------------------------------------------------------------------------------------


def test_openapi_document_is_valid_and_documents_errors(server):
    from openapi_spec_validator import validate

    schema = httpx.get(server.url + "/openapi.json").json()
    validate(schema)
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    edits = schema["paths"]["/v1/images/edits"]["post"]["responses"]
    assert "text/event-stream" in edits["200"]["content"]
    for status in ("400", "401", "404", "409", "413", "429", "503"):
        ref = edits[status]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorBody"), (status, ref)
    assert "422" not in json.dumps(schema["paths"])
    r = httpx.put(server.url + "/v1/images/generations")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["type"] == "invalid_request_error"


def test_schemathesis_finds_no_5xx_and_no_undocumented_status(server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures, calls = [], []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in ("/sdapi/v1/txt2img", "/sdapi/v1/img2img"):
            continue  # A1111's lax bodies: covered by webuiapi above

        @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(base_url=server.url, timeout=60)
            calls.append(response.status_code)
            # 501 only where documented: the A1111 routes edit-rt does not serve answer it by design
            server_error = response.status_code >= 500 and response.status_code != 501
            if server_error or str(response.status_code) not in operation.definition.raw["responses"]:
                failures.append((operation.label, response.status_code, response.text[:200]))

        check()
    assert not failures, failures[:5]
    assert len(calls) >= 30 and set(calls) - {200}, sorted(set(calls))  # it ran, and hit errors too


# --- the CLI ------------------------------------------------------------------------------------


def test_cli_version_and_serve_host_port(tmp_path, model_dir, onnx_dir):
    out = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("edit-rt ")
    out = subprocess.run([*CLI, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert "--host" in out.stdout and "--port" in out.stdout
