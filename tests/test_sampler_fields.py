"""The doors' sampler fields against a real server: A1111's txt2img runs the (sampler_name,
scheduler) it names ("DPM++ 2M" + "Karras" is "DPM++ 2M Karras") and its PNG says so as A1111
writes it; /samplers lists what runs; a sampler or scheduler edit-rt does not run is refused
naming the field; img2img runs its base's sampler and reports the request's; the OpenAI door's
``sampler`` runs and ``ran.sampler`` says it, an edit asking another than its base's is refused;
a config's unknown ``base.sampler`` is refused naming it."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from edit_rt.runtime.pipeline.pnginfo import parse_fields

from .server_process import ServerProcess

STEPS = 6
PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = ServerProcess(tmp_path_factory.mktemp("samplers"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


@pytest.fixture(scope="module")
def api(server):
    import webuiapi

    return webuiapi.WebUIApi(host="127.0.0.1", port=server.port, steps=STEPS)


def _fields(image: Image.Image) -> dict[str, str]:
    """The last line of an image's A1111 ``parameters`` (edit-rt's reader, A1111's reading)."""
    return parse_fields(image.text["parameters"].splitlines()[-1])


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def _png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_txt2img_runs_the_sampler_and_scheduler_it_names_and_the_png_says_so(api):
    from sd_parsers import ParserManager

    args = dict(prompt=PROMPT, seed=21, width=32, height=32, steps=STEPS, cfg_scale=7.5)
    apart = api.txt2img(sampler_name="DPM++ 2M", scheduler="Karras", **args)
    combined = api.txt2img(sampler_name="DPM++ 2M Karras", scheduler="Automatic", **args)
    ddim = api.txt2img(sampler_name="DDIM", scheduler="Automatic", **args)
    assert np.array_equal(_pixels(apart.image), _pixels(combined.image))  # one sampler, one base
    assert apart.info["base_id"] == combined.info["base_id"] != ddim.info["base_id"]
    assert np.abs(_pixels(apart.image) - _pixels(ddim.image)).max() > 0  # another sampler, the same seed
    fields = _fields(apart.image)
    assert fields["Sampler"] == "DPM++ 2M" and fields["Schedule type"] == "Karras" and fields["Seed"] == "21"
    assert _fields(ddim.image)["Sampler"] == "DDIM" and "Schedule type" not in _fields(ddim.image)
    assert (apart.info["sampler_name"], apart.info["scheduler"]) == ("DPM++ 2M", "Karras")
    # what ran as named is not reported; webuiapi's sampler_index ("Euler a", beside sampler_name: A1111 reads
    # it only without one) and eta 1 (DPM++ 2M takes none) are
    assert set(apart.info["accepted"]) == {"sampler_index", "eta"}, apart.info["accepted"]
    assert apart.info["accepted"]["sampler_index"].startswith("DPM++ 2M Karras (sampler_name's")
    assert ParserManager().parse(apart.image).samplers[0].name == "DPM++ 2M"  # an independent reader
    euler_a = api.txt2img(**args)  # webuiapi's own defaults: Euler a, automatic, eta 1
    assert _fields(euler_a.image)["Sampler"] == "Euler a" and euler_a.info["eta"] == 1.0 and euler_a.info["accepted"] == {}


def test_img2img_runs_its_bases_sampler_and_reports_the_requests(api):
    base = api.txt2img(prompt=PROMPT, seed=22, width=32, height=32, steps=STEPS, sampler_name="UniPC", scheduler="Karras")
    edit = api.img2img(images=[base.image], prompt="a green circle", denoising_strength=0.5, width=32, height=32, seed=1)
    assert edit.info["base_ids"] == [base.info["base_id"]]
    fields = _fields(edit.image)
    assert fields["Sampler"] == "UniPC" and fields["Schedule type"] == "Karras"  # the base's, not webuiapi's "Euler a"
    assert edit.info["sampler_name"] == "UniPC" and edit.info["scheduler"] == "Karras"
    accepted = edit.info["accepted"]
    assert accepted["sampler_name"].startswith("UniPC Karras (this image's base's") and accepted["scheduler"].startswith("Karras")
    same = api.img2img(images=[base.image], prompt="a green circle", denoising_strength=0.5, width=32, height=32, seed=1,
                       sampler_name="UniPC Karras", sampler_index="UniPC Karras", scheduler="Automatic", eta=0.0)  # fmt: skip
    assert "sampler_name" not in same.info["accepted"] and "scheduler" not in same.info["accepted"]
    assert np.array_equal(_pixels(same.image), _pixels(edit.image))


def test_the_samplers_and_schedulers_listed_are_what_runs(api):
    names = api.util_get_sampler_names()
    assert {"DPM++ 2M", "Euler a", "DDIM", "UniPC", "Euler"} <= set(names)
    assert {"karras", "automatic"} <= set(api.util_get_scheduler_names())
    options = {s["name"]: s["options"] for s in api.get_samplers()}
    assert options["DPM++ 2M"] == {"scheduler": "karras"}  # Automatic is Karras for it, as in A1111


def test_every_listed_scheduler_runs_as_named_and_normal_is_refused(server):
    """A1111's Normal (sd_schedulers.normal_scheduler: the model's sigmas evenly in timestep,
    interpolated in log-sigma) is a schedule no sampler here runs: not listed, and refused naming
    the field, never run as another schedule under its name."""
    listed = httpx.get(server.url + "/sdapi/v1/schedulers", timeout=30).json()
    assert "normal" not in {s["name"] for s in listed}
    body = {"prompt": PROMPT, "seed": 4, "width": 32, "height": 32, "steps": STEPS, "sampler_name": "DPM++ 2M"}
    for s in listed:
        if s["label"] == "Automatic":  # the sampler's own default (Karras for DPM++ 2M), as A1111's
            continue
        r = httpx.post(server.url + "/sdapi/v1/txt2img", json={**body, "scheduler": s["label"]}, timeout=60)
        info = json.loads(r.json()["info"])
        assert r.status_code == 200 and info["scheduler"] == s["label"] and "scheduler" not in info["accepted"], r.text
        assert _fields(_png(r.json()["images"][0]))["Schedule type"] == s["label"]
    for field, sent in (("scheduler", {"scheduler": "Normal"}), ("sampler_name", {"sampler_name": "DPM++ 2M Normal"})):
        r = httpx.post(server.url + "/sdapi/v1/txt2img", json={**body, **sent}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and error["code"] == "unknown_sampler", r.text
        assert "Normal" in error["message"] and "Uniform" in error["message"] and "Karras" in error["message"]


@pytest.mark.parametrize("field, value", [("sampler_name", "LMS"), ("sampler_name", "Heun Karras"),
                                          ("scheduler", "Exponential"), ("sampler_index", "nonsense")])  # fmt: skip
def test_a_sampler_or_scheduler_that_does_not_run_is_refused_naming_the_field(server, field, value):
    body = {"prompt": PROMPT, "width": 32, "height": 32, "steps": STEPS, field: value}
    if field == "scheduler":
        body["sampler_name"] = "Euler"
    r = httpx.post(server.url + "/sdapi/v1/txt2img", json=body, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field and error["code"] == "unknown_sampler", r.text
    listed = ("Automatic", "Karras") if field == "scheduler" else ("DDIM", "Euler a", "DPM++ 2M", "UniPC")
    assert all(name in error["message"] for name in listed), error["message"]


def test_openai_generation_runs_its_sampler_and_an_edit_keeps_it(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    result = client.images.generate(prompt=PROMPT, size="32x32", extra_body={"seed": 5, "steps": STEPS, "sampler": "euler_a"})
    info = result.model_extra["info"]
    assert info["sampler"] == "euler_a (Euler a)" and _fields(_png(result.data[0].b64_json))["Sampler"] == "Euler a"
    bid = result.model_extra["id"]
    edit = {"base_id": bid, "edits": [{"prompt": "a green circle", "tail_steps": 3}]}
    r = httpx.post(server.url + "/v1/images/edits", json={**edit, "sampler": "ddim"}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "sampler", r.text
    assert "this base ran euler_a" in error["message"] and "leave sampler out or send euler_a" in error["message"]
    for sampler in (None, "Euler a", "euler_a"):  # left out, or the base's by any of its names: runs
        r = httpx.post(server.url + "/v1/images/edits", json={**edit, **({"sampler": sampler} if sampler else {})}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["info"]["sampler"] == "euler_a (Euler a)"
        assert _fields(_png(r.json()["data"][0]["b64_json"]))["Sampler"] == "Euler a"
    r = httpx.post(server.url + "/v1/images/generations", json={"prompt": PROMPT, "sampler": "lms"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampler" and "dpmpp_2m" in r.json()["error"]["message"]


def test_an_uploaded_images_edits_run_ddim_and_another_sampler_is_refused(server):
    small = np.random.default_rng(3).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(small).resize((32, 32), Image.BICUBIC).save(out, format="PNG")
    image = base64.b64encode(out.getvalue()).decode()
    body = {"image": image, "edits": [{"prompt": "a green circle", "tail_steps": 3}]}
    r = httpx.post(server.url + "/v1/images/edits", json={**body, "sampler": "DPM++ 2M"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampler", r.text
    assert "inverted with DDIM" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/images/edits", json={**body, "sampler": "DDIM"}, timeout=120)
    assert r.status_code == 200 and r.json()["data"][0]["info"]["sampler"] == "ddim (DDIM)", r.text
    a1111 = {"init_images": [image], "prompt": "a blue square", "width": 32, "height": 32, "steps": STEPS,
             "denoising_strength": 0.5, "sampler_name": "Euler a"}  # fmt: skip
    r = httpx.post(server.url + "/sdapi/v1/img2img", json=a1111, timeout=120)
    info = json.loads(r.json()["info"])
    assert r.status_code == 200 and info["sampler_name"] == "DDIM" and info["accepted"]["sampler_name"].startswith("DDIM (")
    assert "Sampler: DDIM," in info["infotexts"][0]


def test_a_config_base_with_a_sampler_edit_rt_does_not_run_is_refused_naming_it(tmp_path):
    from edit_rt.runtime.errors import ConfigError
    from edit_rt.runtime.config.load import load_config

    path = tmp_path / "lms.yaml"
    path.write_text(f"model: {tmp_path}\nbase:\n  prompt: a cat\n  sampler: LMS\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert "base.sampler" in str(refused.value) and "dpmpp_2m_karras" in str(refused.value)
    path.write_text(f"model: {tmp_path}\nbase:\n  prompt: a cat\n  sampler: DPM++ 2M Karras\n")
    assert load_config(path).base.sampler == "dpmpp_2m_karras"


def test_a_config_sampler_the_model_cannot_run_is_refused_when_its_pipeline_is_built(tmp_path, monkeypatch):
    """``base.sampler`` against the model's scheduler config (assemble.pipeline_of), as clip_skip."""
    from types import SimpleNamespace

    from edit_rt.runtime.pipeline import assemble
    from edit_rt.runtime.errors import ConfigError
    from edit_rt.runtime.config.load import config_from_dict

    cosine = {"_class_name": "DDIMScheduler", "beta_schedule": "squaredcos_cap_v2", "num_train_timesteps": 1000}

    class Pipe:  # what pipeline_of reads of a pipeline, over a cosine-schedule model
        adapter_bank, family, text = None, {"clip_skips": 2}, SimpleNamespace(conds=[])

        def __init__(self, *args, **kwargs):
            self.manifest = SimpleNamespace(data={"model": {"variant": None}}, scheduler_config=cosine)

    monkeypatch.setattr(assemble, "EditPipeline", Pipe)
    monkeypatch.setattr(assemble, "require_model", lambda cfg: None)  # no model or export on disk: the fake above reads none
    monkeypatch.setattr(assemble, "require_build", lambda cfg: tmp_path)
    cfg = config_from_dict({"model": str(tmp_path), "base": {"prompt": "a cat", "sampler": "DPM++ 2M Karras"}})
    with pytest.raises(ConfigError) as refused:
        assemble.pipeline_of(cfg)
    assert str(refused.value).startswith("base.sampler: dpmpp_2m_karras cannot run on this model")
    assemble.pipeline_of(config_from_dict({"model": str(tmp_path), "base": {"prompt": "a cat", "sampler": "dpmpp_2m"}}))
