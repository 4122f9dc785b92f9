"""The AUTOMATIC1111 door against a real server, with webuiapi (issue 24): inpainting with a mask
keeps every pixel outside it (past the blur band) the init image's own; batch_size x n_iter
images with consecutive seeds; /progress idle and running, util_wait_for_ready, interrupt,
samplers, schedulers, options, sd-vae, memory; and every field webuiapi can send, walked with a
non-default value: each honoured (its effect seen in the reply) or refused naming it."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from .server_process import ServerProcess

STEPS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = ServerProcess(tmp_path_factory.mktemp("a1111"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


@pytest.fixture(scope="module")
def api(server):
    import webuiapi

    return webuiapi.WebUIApi(host="127.0.0.1", port=server.port, steps=STEPS)


def _photo(seed: int = 1) -> Image.Image:
    """A smooth foreign picture (no edit-rt parameters: it is inverted)."""
    small = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((32, 32), Image.BICUBIC)


def _disc(cy: float, cx: float, r: float) -> np.ndarray:
    y, x = np.mgrid[0:32, 0:32]
    return ((y - cy) ** 2 + (x - cx) ** 2) <= r * r


def _u8(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def _band(mask: np.ndarray, blur: int) -> np.ndarray:
    """Pixels within the blur kernel's reach of the mask (2 * int(2.5 blur + 0.5) + 1 taps)."""
    r = int(2.5 * blur + 0.5)
    ys, xs = np.nonzero(mask)
    y, x = np.mgrid[0:32, 0:32]
    near = np.zeros_like(mask)
    for cy, cx in zip(ys, xs):
        near |= (np.abs(y - cy) <= r) & (np.abs(x - cx) <= r)
    return near


# --- inpainting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("invert", [0, 1])
def test_img2img_with_a_mask_changes_only_inside_it(api, invert):
    init = _photo(1)
    white = _disc(12, 20, 6)
    mask = Image.fromarray((white * 255).astype(np.uint8), "L")
    out = api.img2img(images=[init], mask_image=mask, mask_blur=1, inpainting_mask_invert=invert, prompt="a red square",
                      denoising_strength=0.7, width=32, height=32, seed=3, cfg_scale=5.0)  # fmt: skip
    changes = ~white if invert else white
    outside = ~_band(changes, 1)
    got, own = _u8(out.image), _u8(init)
    assert np.array_equal(got[outside], own[outside]), np.abs(got.astype(int) - own)[outside].max()
    assert (got[changes & ~_band(~changes, 1)] != own[changes & ~_band(~changes, 1)]).any()
    text = out.image.text["parameters"]
    assert "Mask blur: 1" in text and "Masked content: original" in text and ("Mask mode" in text) == bool(invert)
    assert out.info["accepted"]["inpainting_fill"].startswith("1 (original") and out.info["sampler_name"] == "DDIM"
    assert out.info["base_reused"] == [False]  # a foreign picture: inverted into a new base


def test_inpainting_an_edit_rt_edit_keeps_that_edit_outside_the_mask(api):
    """The init image is an edit of a base (found by its Base id): outside the mask the reply
    is that edit's pixels, not the base's."""
    base = api.txt2img(prompt="a red circle on a blue background", seed=8, width=32, height=32, steps=STEPS)
    edit = api.img2img(images=[base.image], prompt="a green circle", denoising_strength=0.5, width=32, height=32, seed=1)
    assert edit.info["base_ids"] == [base.info["base_id"]] and edit.info["base_reused"] == [True]
    white = np.zeros((32, 32), bool)
    white[4:12, 4:14] = True
    again = api.img2img(images=[edit.image], mask_image=Image.fromarray((white * 255).astype(np.uint8)), mask_blur=0,
                        prompt="a yellow square", denoising_strength=0.8, width=32, height=32, seed=2)  # fmt: skip
    assert again.info["base_ids"] == [base.info["base_id"]]
    assert np.array_equal(_u8(again.image)[~white], _u8(edit.image)[~white])
    assert (_u8(again.image)[white] != _u8(edit.image)[white]).any()


def test_a_mask_of_another_size_is_resized_like_its_image_and_a_bad_one_refused(server):
    init = base64.b64encode(_png(_photo(2))).decode()
    small = base64.b64encode(_png(Image.fromarray((np.eye(16) * 255).astype(np.uint8)))).decode()
    body = {"init_images": [init], "prompt": "a blue square", "mask": small, "width": 32, "height": 32, "steps": STEPS}
    assert httpx.post(server.url + "/sdapi/v1/img2img", json=body, timeout=120).status_code == 200
    r = httpx.post(server.url + "/sdapi/v1/img2img", json={**body, "mask": "bm90IGFuIGltYWdl"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mask", r.text
    r = httpx.post(server.url + "/sdapi/v1/img2img", json={**body, "mask": None, "inpainting_mask_invert": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "inpainting_mask_invert", r.text


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


# --- batches ------------------------------------------------------------------------------------


def test_txt2img_and_img2img_return_batch_size_x_n_iter_seeded_images(api):
    gen = api.txt2img(prompt="a red circle", seed=40, batch_size=2, n_iter=2, width=32, height=32, steps=STEPS)
    assert len(gen.images) == 4 and gen.info["all_seeds"] == [40, 41, 42, 43] and len(gen.info["infotexts"]) == 4
    assert [f"Seed: {s}," in t for s, t in zip(range(40, 44), gen.info["infotexts"])] == [True] * 4
    assert gen.info["all_subseeds"] == [-1] * 4 and gen.info["batch_size"] == 2
    out = api.img2img(images=[gen.images[0]], prompt="a green circle", batch_size=2, n_iter=2, seed=-1,
                      denoising_strength=0.5, width=32, height=32)  # fmt: skip
    assert len(out.images) == 4
    first = out.info["seed"]
    assert out.info["all_seeds"] == [first, first + 1, first + 2, first + 3]
    assert [f"Variation seed: {s}" in t for s, t in zip(out.info["all_seeds"], out.info["infotexts"])] == [True] * 4
    pixels = [_u8(i).tobytes() for i in out.images]
    assert len(set(pixels)) == 4  # distinct variations
    again = api.img2img(images=[gen.images[0]], prompt="a green circle", seed=first + 2, denoising_strength=0.5,
                        width=32, height=32)  # fmt: skip
    assert _u8(again.image).tobytes() == pixels[2]  # seed + j reproduces image j


# --- job control --------------------------------------------------------------------------------


def _rows_run(server) -> float:
    """The server's count of UNet rows run so far (its /metrics, read by prometheus_client)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics").raise_for_status().text
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "edit_rt_unet_rows_total")  # fmt: skip


def test_progress_is_zero_when_idle_a_fraction_while_running_and_interrupt_stops_the_job(server, api):
    idle = api.get_progress()
    assert idle["progress"] == 0.0 and idle["state"]["job_count"] == 0
    api.util_wait_for_ready(check_interval=0.05)  # returns at once when idle
    seen, answer = [], {}

    def run():
        answer["r"] = httpx.post(server.url + "/sdapi/v1/txt2img", json={"prompt": "a red circle", "steps": 120,
                                 "batch_size": 2, "n_iter": 2, "seed": 1, "width": 32, "height": 32}, timeout=120)  # fmt: skip

    thread = threading.Thread(target=run)
    rows_at_start = _rows_run(server)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        p = api.get_progress()
        if 0.0 < p["progress"] < 1.0:
            seen.append(p)
            if p["progress"] > 0.1 and p["current_image"]:
                break
        time.sleep(0.02)
    assert seen and seen[-1]["state"]["job_count"] >= 1 and seen[-1]["state"]["sampling_steps"] == 120
    # A1111's live preview (every 10 steps): the image the step predicts, at the job's size
    preview = Image.open(io.BytesIO(base64.b64decode(seen[-1]["current_image"])))
    assert preview.size == (32, 32) and preview.format == "PNG"
    assert seen[-1]["eta_relative"] > 0  # a job under way has time left
    rows_before = _rows_run(server) - rows_at_start
    assert api.interrupt()["interrupted"] >= 1  # webuiapi posts it without a body
    thread.join(120)  # a hang guard
    # counted, not timed: the job ran `rows_before` UNet rows to reach `done` of its steps, so
    # the steps left hold rows_before * (1 - done) / done more; an interrupt ends it in a step or two
    done, rows_after = seen[-1]["progress"], _rows_run(server) - rows_at_start - rows_before
    assert rows_after < 0.5 * rows_before * (1 - done) / done, (rows_before, done, rows_after)
    r = answer["r"]
    assert r.status_code in (200, 409), r.text
    if r.status_code == 409:
        assert r.json()["error"]["code"] == "interrupted"
    else:
        info = json.loads(r.json()["info"])
        assert info["interrupted"] and 0 < len(r.json()["images"]) < 4
    api.util_wait_for_ready(check_interval=0.05)
    assert api.get_progress()["progress"] == 0.0
    after = api.txt2img(prompt="a red circle", seed=2, width=32, height=32, steps=STEPS)  # the server goes on
    assert after.image.size == (32, 32) and not after.info["interrupted"]


def test_samplers_schedulers_options_vae_memory_through_webuiapi(api, server):
    assert sorted(api.util_get_sampler_names()) == ["DDIM", "DPM++ 2M", "Euler", "Euler a", "LCM", "TCD", "UniPC"]
    assert api.get_samplers()[0]["aliases"] == ["ddim"]
    assert sorted(api.util_get_scheduler_names()) == ["automatic", "karras", "uniform"]
    models = api.util_get_model_names()
    api.util_set_model(models[0])  # sets sd_model_checkpoint to the served model's title: accepted
    assert api.util_get_current_model() == api.get_sd_models()[0]["model_name"]
    r = httpx.post(server.url + "/sdapi/v1/options", json={"sd_model_checkpoint": "another-model"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sd_model_checkpoint", r.text
    r = httpx.post(server.url + "/sdapi/v1/options", json={"show_progressbar": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "show_progressbar", r.text
    assert api.set_options({"CLIP_stop_at_last_layers": 1}) is None
    assert api.get_options()["CLIP_stop_at_last_layers"] == 1
    assert api.get_sd_vae()[0]["model_name"].endswith("/vae")
    memory = api.get_memory()
    assert 0 < memory["ram"]["used"] < memory["ram"]["total"] and "error" in memory["cuda"]
    assert api.get_scripts() == {"txt2img": [], "img2img": []} and api.skip() == {"skipped": 0}


# --- A1111's routes edit-rt has nothing behind --------------------------------------------------

# Every route of A1111's API (AUTOMATIC1111/stable-diffusion-webui 1.10, modules/api/api.py, the
# server-* ones behind --api-server-stop) with the JSON type its response_model gives a 200 (None:
# none declared); txt2img and img2img are walked below.
A1111_ROUTES = {
    ("POST", "/extra-single-image"): dict, ("POST", "/extra-batch-images"): dict, ("POST", "/png-info"): dict,
    ("GET", "/progress"): dict, ("POST", "/interrogate"): None, ("POST", "/interrupt"): None, ("POST", "/skip"): None,
    ("GET", "/options"): dict, ("POST", "/options"): None, ("GET", "/cmd-flags"): dict, ("GET", "/samplers"): list,
    ("GET", "/schedulers"): list, ("GET", "/upscalers"): list, ("GET", "/latent-upscale-modes"): list,
    ("GET", "/sd-models"): list, ("GET", "/sd-vae"): list, ("GET", "/hypernetworks"): list, ("GET", "/face-restorers"): list,
    ("GET", "/realesrgan-models"): list, ("GET", "/prompt-styles"): list, ("GET", "/embeddings"): dict,
    ("POST", "/refresh-embeddings"): None, ("POST", "/refresh-checkpoints"): None, ("POST", "/refresh-vae"): None,
    ("POST", "/create/embedding"): dict, ("POST", "/create/hypernetwork"): dict, ("POST", "/train/embedding"): dict,
    ("POST", "/train/hypernetwork"): dict, ("GET", "/memory"): dict, ("POST", "/unload-checkpoint"): None,
    ("POST", "/reload-checkpoint"): None, ("GET", "/scripts"): dict, ("GET", "/script-info"): list,
    ("GET", "/extensions"): list, ("POST", "/server-kill"): None, ("POST", "/server-restart"): None,
    ("POST", "/server-stop"): None, ("GET", "/loras"): list, ("POST", "/refresh-loras"): None,
}  # fmt: skip


def test_every_a1111_route_is_answered_in_a1111s_shape_never_a_bare_404(server):
    wrong, http = [], httpx.Client(base_url=server.url, timeout=60)  # one client: its setup costs more than these answers
    for (method, path), shape in A1111_ROUTES.items():
        r = http.request(method, f"/sdapi/v1{path}", **({"json": {}} if method == "POST" else {}))
        if r.status_code == 501:  # A1111's error shape (its api_middleware's), naming the route and why
            body = r.json()
            ok = set(body) == {"error", "detail", "body", "errors"} and f"{method} /sdapi/v1{path} is not served by edit-rt: " in body["detail"]
        elif r.status_code == 200:
            ok = shape is None or isinstance(r.json(), shape)
        else:  # refused for its empty body (png-info), as any route is
            ok = r.status_code == 400 and "error" in r.json()
        if not ok:
            wrong.append(f"{method} {path}: {r.status_code} {r.text[:200]}")
    http.close()
    assert wrong == []
    # the guards are the other routes': a cross-site page's post is refused before the route answers
    r = httpx.post(f"{server.url}/sdapi/v1/interrogate", json={}, headers={"origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin"
    r = httpx.get(f"{server.url}/sdapi/v1/upscalers", headers={"host": "evil.example"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "untrusted_host"
    assert httpx.get(f"{server.url}/sdapi/v1/artists", timeout=30).status_code == 404  # gone from A1111 itself


def test_webuiapi_sees_why_a_route_is_not_served(api):
    assert api.get_upscalers() == [] and api.get_hypernetworks() == [] and api.get_realesrgan_models() == []
    assert api.get_latent_upscale_modes() == [] and api.get_face_restorers() == [] and api.get_prompt_styles() == []
    assert api.get_embeddings() == {"loaded": {}, "skipped": {}} and api.get_scripts() == {"txt2img": [], "img2img": []}
    assert api.refresh_checkpoints() is None  # posted without a body: nothing to rescan, as A1111 answers a rescan
    for call, route in ((lambda: api.interrogate(_photo()), "/interrogate"), (lambda: api.extra_single_image(_photo()), "/extra-single-image"),
                        (lambda: api.extra_batch_images([_photo()]), "/extra-batch-images")):  # fmt: skip
        with pytest.raises(RuntimeError) as err:  # webuiapi raises (status, text) for a non-200
            call()
        status, text = err.value.args
        assert status == 501 and f"POST /sdapi/v1{route} is not served by edit-rt" in json.loads(text)["detail"], text
    flags = api.get_cmd_flags()  # webuiapi returns the body whatever the status
    assert "/sdapi/v1/cmd-flags is not served by edit-rt" in flags["detail"] and "/sdapi/v1/options" in flags["detail"]


# --- the field walk -----------------------------------------------------------------------------


def _webuiapi_payloads() -> dict[str, dict]:
    """What webuiapi sends by default for txt2img and img2img (with a mask), captured from its
    own code: the fields the walk must cover."""
    import webuiapi

    class Sent(Exception):
        pass

    api = webuiapi.WebUIApi.__new__(webuiapi.WebUIApi)  # no server contacted
    api.baseurl, api.default_sampler, api.default_scheduler, api.default_steps = "", "Euler a", "automatic", 20
    got = {}

    class Session:
        def post(self, url, json):
            got[url.rsplit("/", 1)[-1]] = json
            raise Sent

    api.session = Session()
    for call in (lambda: api.txt2img(prompt="x"), lambda: api.img2img(images=[_photo()], mask_image=Image.new("L", (32, 32)), prompt="x")):
        with pytest.raises(Sent):
            call()
    return got


def _text(r) -> str:
    return json.loads(r["info"])["infotexts"][0]


def _info(r) -> dict:
    return json.loads(r["info"])


WHITE = base64.b64encode(_png(Image.fromarray((_disc(16, 16, 6) * 255).astype(np.uint8)))).decode()
REFUSED = "refused"
# field -> (the request's changes, what must be seen): REFUSED (400 naming the field, or the
# param given), or a check of the 200 reply (its effect, or its report in info.accepted)
COMMON = {
    "prompt": ({"prompt": "a green square"}, lambda r: _text(r).startswith("a green square\n")),
    "styles": ({"styles": ["cinematic"]}, REFUSED),
    "seed": ({"seed": 77}, lambda r: _info(r)["seed"] == 77 and _info(r)["all_seeds"] == [77]),
    "subseed": ({"subseed": 3}, REFUSED),
    "subseed_strength": ({"subseed_strength": 0.5}, REFUSED),
    "seed_resize_from_h": ({"seed_resize_from_h": 64}, REFUSED),
    "seed_resize_from_w": ({"seed_resize_from_w": 64}, REFUSED),
    "batch_size": ({"batch_size": 2}, lambda r: len(r["images"]) == 2 and len(set(r["images"])) == 2),
    "n_iter": ({"n_iter": 2}, lambda r: len(r["images"]) == 2 and _info(r)["all_seeds"][1] == _info(r)["all_seeds"][0] + 1),
    "steps": ({"steps": 4}, lambda r: "Steps: 4," in _text(r)),
    "cfg_scale": ({"cfg_scale": 3.0}, lambda r: "CFG scale: 3," in _text(r)),
    "width": ({"width": 64}, REFUSED),
    "height": ({"height": 64}, REFUSED),
    "restore_faces": ({"restore_faces": True}, REFUSED),
    "tiling": ({"tiling": True}, REFUSED),
    # honoured: nothing is saved, which is what these ask for (or, false, what the API does in A1111 too)
    "do_not_save_samples": ({"do_not_save_samples": True}, lambda r: len(r["images"]) == 1),
    "do_not_save_grid": ({"do_not_save_grid": True}, lambda r: len(r["images"]) == 1),
    "negative_prompt": ({"negative_prompt": "noise"}, lambda r: "\nNegative prompt: noise\n" in _text(r)),
    "eta": ({"eta": 0.5}, REFUSED),
    "s_churn": ({"s_churn": 0.5}, REFUSED),
    "s_tmax": ({"s_tmax": 1.0}, REFUSED),
    "s_tmin": ({"s_tmin": 0.5}, REFUSED),
    "s_noise": ({"s_noise": 0.9}, REFUSED),
    "override_settings": ({"override_settings": {"CLIP_stop_at_last_layers": 2}}, lambda r: "Clip skip: 2," in _text(r)),
    "override_settings_restore_afterwards": ({"override_settings_restore_afterwards": False,
                                              "override_settings": {"CLIP_stop_at_last_layers": 1}}, REFUSED),
    # img2img of an uploaded image runs DDIM: another sampler is accepted and reported
    "sampler_name": ({"sampler_name": "DPM++ 2M"}, lambda r: _info(r)["accepted"]["sampler_name"].startswith("DDIM (")
                     and "Sampler: DDIM," in _text(r) and _info(r)["sampler_name"] == "DDIM"),
    "scheduler": ({"scheduler": "Karras"}, lambda r: _info(r)["accepted"]["scheduler"].startswith("Automatic (")),
    "sampler_index": ({"sampler_index": "Euler"}, lambda r: _info(r)["accepted"]["sampler_index"].startswith("DDIM (")),
    "script_name": ({"script_name": "x/y/z plot"}, REFUSED),
    "script_args": ({"script_args": [1]}, REFUSED),
    "send_images": ({"send_images": False}, lambda r: r["images"] == [] and len(_info(r)["infotexts"]) == 1),
    "save_images": ({"save_images": True}, REFUSED),
    "alwayson_scripts": ({"alwayson_scripts": {"ControlNet": {"args": []}}}, "alwayson_scripts.ControlNet"),
    # A1111's fields webuiapi does not send
    "s_min_uncond": ({"s_min_uncond": 0.5}, REFUSED),
    "refiner_checkpoint": ({"refiner_checkpoint": "sdxl-refiner"}, REFUSED),
    "refiner_switch_at": ({"refiner_switch_at": 0.5}, REFUSED),
    "disable_extra_networks": ({"disable_extra_networks": True, "prompt": "<lora:x:1> a cat"},
                               lambda r: _text(r).startswith(" a cat\n") and "prompt" in _info(r)["accepted"]),
    "firstpass_image": ({"firstpass_image": WHITE}, REFUSED),
    "comments": ({"comments": {"a": "b"}}, REFUSED),
    "force_task_id": ({"force_task_id": "task(1)"}, REFUSED),
    "infotext": ({"infotext": "a cat\nSteps: 3"}, REFUSED),
}
TXT2IMG = {
    **COMMON,
    "enable_hr": ({"enable_hr": True}, REFUSED),
    "hr_scale": ({"hr_scale": 3}, REFUSED),
    "hr_upscaler": ({"hr_upscaler": "ESRGAN_4x"}, REFUSED),
    "hr_second_pass_steps": ({"hr_second_pass_steps": 5}, REFUSED),
    "hr_resize_x": ({"hr_resize_x": 64}, REFUSED),
    "hr_resize_y": ({"hr_resize_y": 64}, REFUSED),
    "hr_checkpoint_name": ({"hr_checkpoint_name": "other"}, REFUSED),
    "hr_sampler_name": ({"hr_sampler_name": "Euler"}, REFUSED),
    "hr_scheduler": ({"hr_scheduler": "Karras"}, REFUSED),
    "hr_prompt": ({"hr_prompt": "sharper"}, REFUSED),
    "hr_negative_prompt": ({"hr_negative_prompt": "blur"}, REFUSED),
    "firstphase_width": ({"firstphase_width": 16}, REFUSED),
    "firstphase_height": ({"firstphase_height": 16}, REFUSED),
    # hires fix's strength: inert without it (as in A1111), reported in info
    "denoising_strength": ({"denoising_strength": 0.3}, lambda r: _info(r)["denoising_strength"] == 0.3),
    # txt2img runs the sampler it names ("DPM++ 2M": Karras, A1111's Automatic for it)
    "sampler_name": ({"sampler_name": "DPM++ 2M"}, lambda r: "sampler_name" not in _info(r)["accepted"]
                     and "Sampler: DPM++ 2M, Schedule type: Karras," in _text(r) and _info(r)["scheduler"] == "Karras"),
    "scheduler": ({"sampler_name": "Euler", "scheduler": "Karras"},
                  lambda r: "Sampler: Euler, Schedule type: Karras," in _text(r) and _info(r)["accepted"] == {}),
    "sampler_index": ({"sampler_index": "Euler"}, lambda r: "Sampler: Euler," in _text(r) and _info(r)["accepted"] == {}),
}
MASKED = {"mask": WHITE}
IMG2IMG = {
    **COMMON,
    "init_images": ({"init_images": [base64.b64encode(_png(_photo(5))).decode()]},
                    lambda r: _info(r)["base_ids"] != _info(_DEFAULT["img2img"])["base_ids"]),
    "resize_mode": ({"resize_mode": 1}, REFUSED),
    "denoising_strength": ({"denoising_strength": 0.3}, lambda r: _info(r)["tail_steps"] == [2]),  # 0.3 of 6 steps
    "mask": (MASKED, lambda r: "Mask blur: 4," in _text(r) and "Pixel mask:" in _text(r)),
    "mask_blur": ({**MASKED, "mask_blur": 2}, lambda r: "Mask blur: 2," in _text(r)),
    "mask_blur_x": ({**MASKED, "mask_blur_x": 2}, lambda r: "Mask blur: 2x4," in _text(r)),
    "mask_blur_y": ({**MASKED, "mask_blur_y": 2}, lambda r: "Mask blur: 4x2," in _text(r)),
    "mask_round": ({**MASKED, "mask_round": False}, REFUSED),
    "inpainting_fill": ({**MASKED, "inpainting_fill": 1},
                        lambda r: "Masked content: original" in _text(r) and "inpainting_fill" not in _info(r)["accepted"]),
    "inpaint_full_res": ({**MASKED, "inpaint_full_res": False}, lambda r: "inpaint_full_res" not in _info(r)["accepted"]
                         and "Inpaint area: Whole picture" in _text(r)),
    "inpaint_full_res_padding": ({**MASKED, "inpaint_full_res_padding": 32},
                                 lambda r: "padding 32 unused" in _info(r)["accepted"]["inpaint_full_res"]),
    "inpainting_mask_invert": ({**MASKED, "inpainting_mask_invert": 1}, lambda r: "Mask mode: Inpaint not masked" in _text(r)),
    "initial_noise_multiplier": ({"initial_noise_multiplier": 0.5}, REFUSED),
    "image_cfg_scale": ({"image_cfg_scale": 2.0}, REFUSED),
    "latent_mask": ({**MASKED, "latent_mask": WHITE}, REFUSED),
    "include_init_images": ({"include_init_images": True}, lambda r: isinstance(r["parameters"]["init_images"], list)),
    "seed": ({"seed": 77}, lambda r: _info(r)["all_seeds"] == [77] and "Variation seed: 77" in _text(r)),
}
DEFAULTS = {
    "txt2img": {"prompt": "a red circle", "width": 32, "height": 32, "steps": STEPS, "seed": 5},
    "img2img": {"init_images": [base64.b64encode(_png(_photo(3))).decode()], "prompt": "a blue square", "width": 32,
                "height": 32, "steps": STEPS, "seed": 5, "denoising_strength": 0.5},
}
_DEFAULT: dict[str, dict] = {}


def test_the_field_walk_covers_every_field_webuiapi_sends_and_every_field_a1111_has():
    from edit_rt.runtime.web.a1111_fields import Img2Img, Txt2Img

    sent = _webuiapi_payloads()
    assert set(sent["txt2img"]) <= set(TXT2IMG) and set(sent["img2img"]) <= set(IMG2IMG)
    assert set(TXT2IMG) == set(Txt2Img.model_fields) and set(IMG2IMG) == set(Img2Img.model_fields)


@pytest.mark.parametrize("route", ["txt2img", "img2img"])
def test_webuiapis_default_payload_is_taken_whole(server, route):
    """Every field at webuiapi's own default (with the served size): accepted, and what ran
    instead of what it names reported (img2img of an uploaded image: its sampler)."""
    body = {**_webuiapi_payloads()[route], **DEFAULTS[route]}
    body.pop("mask", None)
    r = httpx.post(f"{server.url}/sdapi/v1/{route}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    info = _info(r.json())
    if route == "txt2img":  # "Euler a" ran, at its eta 1
        assert info["accepted"] == {} and info["sampler_name"] == "Euler a" and "Sampler: Euler a," in _text(r.json())
    else:  # an uploaded image is inverted and edited with DDIM: "Euler a" ran as DDIM, webuiapi's eta 1 as DDIM's 0
        assert {k: v.split(" (")[0] for k, v in info["accepted"].items()} == {"sampler_name": "DDIM", "sampler_index": "DDIM",
                                                                             "eta": "0"}, info["accepted"]  # fmt: skip
        assert info["sampler_name"] == "DDIM" and "Sampler: DDIM," in _text(r.json())
    _DEFAULT[route] = r.json()


def _walk(server, route: str, table: dict) -> list[str]:
    if route not in _DEFAULT:
        _DEFAULT[route] = httpx.post(f"{server.url}/sdapi/v1/{route}", json=DEFAULTS[route], timeout=120).json()
    wrong = []
    for field, (changes, expect) in table.items():
        r = httpx.post(f"{server.url}/sdapi/v1/{route}", json={**DEFAULTS[route], **changes}, timeout=120)
        if isinstance(expect, str):
            param = field if expect == REFUSED else expect
            ok = r.status_code == 400 and r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
        else:
            ok = r.status_code == 200 and expect(r.json())
        if not ok:
            wrong.append(f"{field}: {r.status_code} {r.text[:300]}")
    return wrong


def test_every_txt2img_field_is_honoured_or_refused(server):
    assert _walk(server, "txt2img", TXT2IMG) == []


def test_every_img2img_field_is_honoured_or_refused(server):
    assert _walk(server, "img2img", IMG2IMG) == []


def test_unknown_fields_and_foreign_settings_are_refused_by_name(server):
    for route in ("txt2img", "img2img"):
        for changes, param in (({"mask_image": WHITE}, "mask_image"), ({"distilled_cfg_scale": 3.5}, "distilled_cfg_scale"),
                               ({"override_settings": {"sd_model_checkpoint": "sd_xl_base_1.0"}},
                                "override_settings.sd_model_checkpoint"),
                               ({"override_settings": {"show_progressbar": False}}, "override_settings.show_progressbar"),
                               ({"prompt": "a cat <lora:add_detail:0.5>"}, "prompt")):  # fmt: skip
            r = httpx.post(f"{server.url}/sdapi/v1/{route}", json={**DEFAULTS[route], **changes}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)
