"""The ComfyUI door (issue 53): API-format workflows queued at ComfyUI's paths run on the engines
and equal the same request through the OpenAI door (the same base id, the same pixels); a
workflow that cannot run is 400 in ComfyUI's ``node_errors`` shape with nothing run; ComfyUI's
own websocket client pattern (websocket-client + urllib, script_examples/websockets_api_example.py)
works against a real server. The references are the OpenAI door, ComfyUI's documented shapes,
Pillow reading the PNGs and the service's own row counters."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import urllib.parse
import urllib.request
import uuid

import httpx
import numpy as np
import pytest
from PIL import Image

from .server_process import ServerProcess

STEPS = 4
SERVE = {"model": None, "build_dir": None, "store": {"ram_mb": 32},
         "base": {"prompt": "x", "steps": STEPS, "guidance": 7.5, "width": 32, "height": 32}}  # fmt: skip


def txt2img(seed: int = 3, sampler: str = "euler", scheduler: str = "normal", text: str = "a red circle") -> dict:
    """ComfyUI's default workflow (its frontend's, in API format) at the served size."""
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "MODEL"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 32, "height": 32, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": text, "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler", "inputs": {"seed": seed, "steps": STEPS, "cfg": 7.5, "sampler_name": sampler,
                                                   "scheduler": scheduler, "denoise": 1.0, "model": ["4", 0],
                                                   "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "ComfyUI", "images": ["8", 0]}},
    }  # fmt: skip


def img2img(image: str, denoise: float, seed: int, text: str) -> dict:
    flow = txt2img(seed, "ddim", "ddim_uniform", text)
    flow["10"] = {"class_type": "LoadImage", "inputs": {"image": image}}
    flow["11"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["4", 2]}}
    flow["3"]["inputs"].update(latent_image=["11", 0], denoise=denoise)
    del flow["5"]
    return flow


@pytest.fixture(scope="module")
def served(model_dir, onnx_dir):
    from edit_rt.runtime.config.load import config_from_dict
    from edit_rt.runtime.serving.service import Service
    from edit_rt.runtime.web.server import create_app

    cfg = config_from_dict({**SERVE, "model": str(model_dir), "build_dir": str(onnx_dir.parent.parent),
                            "serve": {"comfyui": True}})  # fmt: skip
    service = Service(cfg)
    service.load()
    assert service.ready.is_set(), service.load_error
    yield service, create_app(cfg, service)
    service.shutdown()


def _flow(service, flow: dict) -> dict:
    flow = json.loads(json.dumps(flow))
    flow["4"]["inputs"]["ckpt_name"] = service.model_name
    return flow


async def _queued(c: httpx.AsyncClient, flow: dict, extra: dict | None = None) -> dict:
    """``flow`` queued and waited for, as ComfyUI's clients poll: its history entry."""
    r = await c.post("/prompt", json={"prompt": flow, "client_id": "t", **(extra or {})})
    assert r.status_code == 200, r.text
    pid = r.json()["prompt_id"]
    assert set(r.json()) == {"prompt_id", "number", "node_errors"}
    for _ in range(1200):
        entry = (await c.get(f"/history/{pid}")).json()
        if entry:
            return entry[pid]
        await asyncio.sleep(0.05)
    raise AssertionError("the prompt never finished")


def _run(app, work):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8188",
                                     timeout=120) as c:  # fmt: skip
            return await work(c)

    return asyncio.run(go())


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def _base_id(png: bytes) -> str:
    text = Image.open(io.BytesIO(png)).text["parameters"]
    return text.split("Base id: ", 1)[1].split(",", 1)[0].strip()


def _generated(service) -> float:
    return service.metrics.registry.get_sample_value("edit_rt_bases_generated_total") or 0.0


def test_txt2img_and_img2img_workflows_equal_the_openai_door(served):
    service, app = served

    async def work(c):
        entry = await _queued(c, _flow(service, txt2img(seed=3)), {"extra_data": {"extra_pnginfo": {"workflow": {"w": 1}}}})
        assert entry["status"]["status_str"] == "success"
        [image] = entry["outputs"]["9"]["images"]
        assert image["type"] == "output" and image["filename"].startswith("ComfyUI_")
        comfy = (await c.get("/view", params=image)).content
        openai = (await c.post("/v1/images/generations", json={"prompt": "a red circle", "negative_prompt": "blurry",
                                                               "seed": 3, "steps": STEPS, "cfg_scale": 7.5,
                                                               "sampler": "euler", "size": "32x32"})).json()  # fmt: skip
        reference = base64.b64decode(openai["data"][0]["b64_json"])
        # img2img: the txt2img PNG uploaded (it names its base) and edited at denoise 0.5 -- by DDIM,
        # so a base of its own: a ddim one generated through the OpenAI door first
        ddim = (await c.post("/v1/images/generations", json={"prompt": "a red circle", "negative_prompt": "blurry",
                                                             "seed": 4, "steps": STEPS, "cfg_scale": 7.5,
                                                             "sampler": "ddim", "size": "32x32"})).json()  # fmt: skip
        ddim_png = base64.b64decode(ddim["data"][0]["b64_json"])
        up = await c.post("/upload/image", files={"image": ("mine.png", ddim_png, "image/png")})
        assert up.status_code == 200 and up.json() == {"name": "mine.png", "subfolder": "", "type": "input"}
        edit_entry = await _queued(c, _flow(service, img2img("mine.png", 0.5, 9, "a blue square")))
        assert edit_entry["status"]["status_str"] == "success", edit_entry["status"]
        edited = (await c.get("/view", params=edit_entry["outputs"]["9"]["images"][0])).content
        edit_ref = (await c.post("/v1/images/edits", json={"base_id": ddim["id"], "edits": [
            {"prompt": "a blue square", "strength": 1.0, "tail_fraction": 0.5, "seed": 9, "cfg_scale": 7.5}]})).json()
        return comfy, reference, openai["id"], edited, base64.b64decode(edit_ref["data"][0]["b64_json"]), ddim["id"]

    comfy, reference, bid, edited, edit_ref, ddim_id = _run(app, work)
    assert _base_id(comfy) == bid
    assert np.array_equal(_pixels(comfy), _pixels(reference))  # 0 grey levels
    text = Image.open(io.BytesIO(comfy)).text  # ComfyUI's SaveImage chunks, as JSON
    assert json.loads(text["prompt"])["3"]["class_type"] == "KSampler" and json.loads(text["workflow"]) == {"w": 1}
    assert _base_id(edited) == ddim_id == _base_id(edit_ref)
    assert np.array_equal(_pixels(edited), _pixels(edit_ref))


def _cycle(flow):
    flow["8"]["inputs"]["samples"] = ["3", 0]
    flow["3"]["inputs"]["latent_image"] = ["12", 0]
    flow["12"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["8", 0], "vae": ["4", 2]}}
    return flow


BAD = {
    # what is broken -> (the node named, the input named or None, ComfyUI's error type)
    "cycle": (_cycle, "12", None, "dependency_cycle"),
    "missing input": (lambda f: f["3"]["inputs"].pop("steps") and f, "3", "steps", "required_input_missing"),
    "unknown node": (lambda f: {**f, "20": {"class_type": "NotANode", "inputs": {}}}, "20", None, "invalid_prompt"),
    "link to nothing": (lambda f: f["3"]["inputs"].update(positive=["99", 0]) or f, "3", "positive", "bad_linked_input"),
    "out of range": (lambda f: f["3"]["inputs"].update(steps=100000) or f, "3", "steps", "value_bigger_than_max"),
    "sampler pair": (lambda f: f["3"]["inputs"].update(scheduler="exponential") or f, "3", "sampler_name",
                     "unsupported_sampler"),
    # ComfyUI's ddim_uniform at 30 steps runs 31 (its ddim_scheduler's stride): not edit-rt's DDIM
    "ddim_uniform at 30 steps": (lambda f: f["3"]["inputs"].update(sampler_name="ddim", scheduler="ddim_uniform", steps=30)
                                 or f, "3", "steps", "invalid_input"),
    "other checkpoint": (lambda f: f["4"]["inputs"].update(ckpt_name="sd_xl_base.safetensors") or f, "4", "ckpt_name",
                         "value_not_in_list"),
    "LatentUpscale": (lambda f: {**f, "13": {"class_type": "LatentUpscale", "inputs": {"samples": ["5", 0]}},
                                 "8": {**f["8"], "inputs": {**f["8"]["inputs"], "samples": ["13", 0]}}},
                      "13", None, "unsupported_node"),
}  # fmt: skip


def test_a_workflow_that_cannot_run_is_400_with_node_errors_and_runs_nothing(served):
    service, app = served

    async def work(c):
        before, answers = _generated(service), {}
        for name, (broken, *_rest) in BAD.items():
            answers[name] = await c.post("/prompt", json={"prompt": broken(_flow(service, txt2img()))})
        huge = {str(i): {"class_type": "CLIPTextEncode", "inputs": {"text": "x", "clip": ["0", 1]}} for i in range(10_000)}
        answers["10,000 nodes"] = await c.post("/prompt", json={"prompt": huge})
        queue = (await c.get("/queue")).json()
        return before, answers, queue

    before, answers, queue = _run(app, work)
    for name, (_, node, field, kind) in BAD.items():
        r = answers[name]
        assert r.status_code == 400, (name, r.text)
        body = r.json()
        assert set(body) == {"error", "node_errors"}, name
        errors = body["node_errors"][node]["errors"]
        assert kind in [e["type"] for e in errors], (name, errors)
        if field is not None:
            assert field in [e["extra_info"].get("input_name") for e in errors], (name, errors)
    assert "pairs that run" in answers["sampler pair"].text and "euler+normal" in answers["sampler pair"].text
    assert "is 31 steps in ComfyUI" in answers["ddim_uniform at 30 steps"].text
    assert answers["10,000 nodes"].status_code == 400 and "10000 nodes" in answers["10,000 nodes"].json()["error"]["message"]
    assert _generated(service) == before and queue == {"queue_running": [], "queue_pending": []}


def test_history_view_and_object_info_answer_as_comfyui(served):
    service, app = served

    async def work(c):
        return [await c.get(p) for p in ("/history/no-such-id", "/view?filename=../../etc/passwd&type=output",
                                         "/view?filename=passwd&subfolder=../../etc", "/object_info",
                                         "/api/object_info/KSampler", "/api/prompt", "/models/checkpoints",
                                         "/system_stats", "/embeddings")]  # fmt: skip

    unknown, escape, escape2, info, ksampler, prompt, ckpts, stats, emb = _run(app, work)
    assert unknown.json() == {} and unknown.headers["x-edit-rt-prompt"] == "unknown"
    assert escape.status_code == escape2.status_code == 404
    nodes = info.json()
    assert {"KSampler", "KSamplerAdvanced", "CLIPTextEncode", "SaveImage", "LoraLoader"} <= set(nodes)
    assert nodes["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"] == [[service.model_name]]
    assert ksampler.json()["KSampler"]["output"] == ["LATENT"]
    assert prompt.json() == {"exec_info": {"queue_remaining": 0}}
    assert ckpts.json() == [service.model_name] and "devices" in stats.json() and emb.json() == []


def test_edit_rt_nodes_edit_a_stored_base_by_id_at_any_strength_as_one_tail(served):
    """edit-rt's own nodes: EditRtStoredBase (a base by id) and EditRtEdit (strength, negative
    too; tail_steps; preserve): two edits of one base run as one request of 2 rows, each equal to
    the same edit through the OpenAI door; an unknown id is a node error naming base_id."""
    service, app = served
    edits = [("a blue square", 0.5, "none"), ("a green circle", -1.0, "auto")]

    def requests() -> float:
        return sum(s.value for m in service.metrics.registry.collect() for s in m.samples
                   if s.name == "edit_rt_edit_requests_total")  # fmt: skip

    async def work(c):
        made = (await c.post("/v1/images/generations", json={"prompt": "a red circle", "seed": 6, "steps": STEPS,
                                                             "cfg_scale": 7.5, "size": "32x32"})).json()  # fmt: skip
        flow = {"4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": service.model_name}},
                "1": {"class_type": "EditRtStoredBase", "inputs": {"base_id": made["id"]}}}  # fmt: skip
        for k, (text, strength, preserve) in enumerate(edits):
            n = 10 * (k + 1)
            flow[str(n)] = {"class_type": "CLIPTextEncode", "inputs": {"text": text, "clip": ["4", 1]}}
            flow[str(n + 1)] = {"class_type": "EditRtEdit", "inputs": {
                "samples": ["1", 0], "positive": [str(n), 0], "strength": strength, "tail_steps": 2, "cfg": 7.5,
                "preserve": preserve}}  # fmt: skip
            flow[str(n + 2)] = {"class_type": "VAEDecode", "inputs": {"samples": [str(n + 1), 0], "vae": ["4", 2]}}
            flow[str(n + 3)] = {"class_type": "SaveImage", "inputs": {"filename_prefix": f"e{k}", "images": [str(n + 2), 0]}}
        before = requests()
        entry = await _queued(c, flow)
        ran = requests() - before
        pngs = [(await c.get("/view", params=entry["outputs"][str(10 * (k + 1) + 3)]["images"][0])).content
                for k in range(len(edits))]  # fmt: skip
        alone = []
        for text, strength, preserve in edits:
            r = await c.post("/v1/images/edits", json={"base_id": made["id"], "edits": [
                {"prompt": text, "strength": strength, "tail_steps": 2, "cfg_scale": 7.5, "preserve": preserve}]})  # fmt: skip
            assert r.status_code == 200, r.text
            alone.append(base64.b64decode(r.json()["data"][0]["b64_json"]))
        flow["1"]["inputs"]["base_id"] = "b" * 64
        unknown = await c.post("/prompt", json={"prompt": flow})
        info = (await c.get("/object_info/EditRtEdit")).json()
        return entry, ran, pngs, alone, unknown, info

    entry, ran, pngs, alone, unknown, info = _run(app, work)
    assert entry["status"]["status_str"] == "success" and ran == 1
    for png, reference in zip(pngs, alone):
        assert np.array_equal(_pixels(png), _pixels(reference))  # 0 grey levels
    assert unknown.status_code == 400 and unknown.json()["node_errors"]["1"]["errors"][0]["extra_info"]["input_name"] == "base_id"
    assert info["EditRtEdit"]["input"]["required"]["strength"][1]["min"] < 0 and info["EditRtEdit"]["description"]


def _png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def test_upload_mask_puts_the_masks_alpha_into_its_original_as_comfyui_does(served):
    """ComfyUI's mask editor: POST /upload/mask (the mask, original_ref) writes the original with
    the mask's alpha, its text kept (an edit-rt PNG still names its base); LoadImage then reads
    the MASK from it and a masked img2img runs. Checked with Pillow against the two uploads."""
    service, app = served
    alpha = np.full((32, 32), 255, np.uint8)
    alpha[:, :16] = 0  # transparent: may change
    mask = np.zeros((32, 32, 4), np.uint8)
    mask[..., 3] = alpha

    async def work(c):
        made = (await c.post("/v1/images/generations", json={"prompt": "a red circle", "negative_prompt": "blurry",
                                                             "seed": 4, "steps": STEPS, "cfg_scale": 7.5,
                                                             "sampler": "ddim", "size": "32x32"})).json()  # fmt: skip
        original = base64.b64decode(made["data"][0]["b64_json"])
        await c.post("/upload/image", files={"image": ("orig.png", original, "image/png")})
        ref = json.dumps({"filename": "orig.png", "subfolder": "", "type": "input"})
        up = await c.post("/upload/mask", files={"image": ("masked.png", _png(mask), "image/png")},
                          data={"original_ref": ref})  # fmt: skip
        stored = (await c.get("/view", params={"filename": "masked.png", "type": "input"})).content
        wrong_size = await c.post("/upload/mask", files={"image": ("m.png", _png(mask[:16]), "image/png")},
                                  data={"original_ref": ref})  # fmt: skip
        unknown = await c.post("/upload/mask", files={"image": ("m.png", _png(mask), "image/png")},
                               data={"original_ref": json.dumps({"filename": "nope.png"})})  # fmt: skip
        flow = _flow(service, img2img("masked.png", 0.5, 9, "a blue square"))
        flow["12"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["11", 0], "mask": ["10", 1]}}
        flow["3"]["inputs"]["latent_image"] = ["12", 0]
        entry = await _queued(c, flow)
        return original, up, stored, wrong_size, unknown, entry

    original, up, stored, wrong_size, unknown, entry = _run(app, work)
    assert up.status_code == 200 and up.json() == {"name": "masked.png", "subfolder": "", "type": "input"}
    written, source = Image.open(io.BytesIO(stored)), Image.open(io.BytesIO(original))
    assert written.mode == "RGBA" and np.array_equal(np.asarray(written)[..., 3], alpha)
    assert np.array_equal(np.asarray(written)[..., :3], np.asarray(source.convert("RGB")))
    assert written.text["parameters"] == source.text["parameters"]
    assert wrong_size.status_code == 400 and "16" in wrong_size.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "original_ref"
    assert entry["status"]["status_str"] == "success", entry["status"]


def _frames_until_done(ws, pid: str) -> tuple[list[str], list[bytes], dict]:
    """A websocket's messages until ``executing`` with node null for ``pid``: the JSON ones'
    types, the binary frames (each arrived while the prompt ran) and each node's last
    ``progress`` (value, max)."""
    seen, frames, progress = [], [], {}
    while True:
        out = ws.recv()
        if isinstance(out, bytes):
            frames.append(out)
            continue
        message = json.loads(out)
        seen.append(message["type"])
        if message["type"] == "progress" and message["data"]["prompt_id"] == pid:
            progress[message["data"]["node"]] = (message["data"]["value"], message["data"]["max"])
        if message["type"] == "executing" and message["data"]["node"] is None and message["data"]["prompt_id"] == pid:
            return seen, frames, progress


def _silent_frames(ws) -> list[bytes]:
    """The binary frames a websocket holds now (read until it is quiet for 0.2 s)."""
    import websocket

    ws.settimeout(0.2)
    frames = []
    try:
        while True:
            out = ws.recv()
            if isinstance(out, bytes):
                frames.append(out)
    except websocket.WebSocketTimeoutException:
        return frames


def _preview(frame: bytes) -> tuple[int, dict, Image.Image]:
    """A binary frame read as ComfyUI's server.py writes it (the reference: its send_image and
    send_image_with_metadata): a big-endian event type; PREVIEW_IMAGE (1) then a format (1
    JPEG, 2 PNG) and the image; PREVIEW_IMAGE_WITH_METADATA (4) then a length, that much JSON
    and the image."""
    kind = struct.unpack(">I", frame[:4])[0]
    if kind == 1:
        image_type = struct.unpack(">I", frame[4:8])[0]
        image = Image.open(io.BytesIO(frame[8:]))
        assert image.format == {1: "JPEG", 2: "PNG"}[image_type]
        return kind, {}, image
    assert kind == 4, kind
    length = struct.unpack(">I", frame[4:8])[0]
    return kind, json.loads(frame[8:8 + length]), Image.open(io.BytesIO(frame[8 + length:]))


def test_comfyuis_websocket_client_example_and_a_maintained_client_against_a_real_server(tmp_path, model_dir, onnx_dir):
    """script_examples/websockets_api_example.py's pattern: queue, watch the websocket until
    ``executing`` with node null for this prompt, read /history, fetch each image from /view.
    Binary preview frames arrive on the prompt's client's websocket while it runs, as ComfyUI
    sends them (PREVIEW_IMAGE with a JPEG; with metadata naming the node to a client that
    announced ``supports_preview_metadata``), and never on another client's or on one that gave
    no clientId. Then comfy-api-simplified (a maintained client from the package index), with
    HTTP Basic credentials as it sends them (on its requests and in its websocket URL)."""
    import websocket  # websocket-client
    from comfy_api_simplified import ComfyApiWrapper, ComfyWorkflowWrapper

    server = ServerProcess(tmp_path, model_dir, onnx_dir, serve={"comfyui": True, "token": "sesame",
                                                                 "api_auth": "ada:lovelace"}, base=SERVE["base"])  # fmt: skip
    try:
        address, auth = f"127.0.0.1:{server.port}", {"Authorization": "Bearer sesame"}
        with pytest.raises(websocket.WebSocketBadStatusException):  # the token rule holds on the websocket too
            websocket.create_connection(f"ws://{address}/ws?clientId=x", timeout=10)
        client_id = str(uuid.uuid4())
        ws = websocket.create_connection(f"ws://{address}/ws?clientId={client_id}", header=auth, timeout=60)
        other = websocket.create_connection(f"ws://{address}/ws?clientId=someone-else", header=auth, timeout=60)
        anonymous = websocket.create_connection(f"ws://{address}/ws", header=auth, timeout=60)
        name = json.loads(urllib.request.urlopen(urllib.request.Request(f"http://{address}/models/checkpoints",
                                                                        headers=auth)).read())[0]  # fmt: skip

        def queue(flow: dict, client: str) -> str:
            flow["4"]["inputs"]["ckpt_name"] = name
            data = json.dumps({"prompt": flow, "client_id": client}).encode()  # urllib's default Content-Type, as the example
            return json.loads(urllib.request.urlopen(urllib.request.Request(f"http://{address}/prompt", data=data,
                                                                            headers=auth)).read())["prompt_id"]  # fmt: skip

        pid = queue(txt2img(seed=5), client_id)
        seen, frames, progress = _frames_until_done(ws, pid)
        ws.close()
        # a client announcing preview metadata (ComfyUI's frontend does, on connect): a branching
        # workflow's previews, each naming its node (the chain's, each branch's)
        meta = websocket.create_connection(f"ws://{address}/ws?clientId=meta", header=auth, timeout=60)
        meta.recv()  # status
        meta.send(json.dumps({"type": "feature_flags", "data": {"supports_preview_metadata": True}}))
        answered = json.loads(meta.recv())
        meta_pid = queue(branching(["a blue square", "a green circle"], seed=7), "meta")
        _, meta_frames, meta_progress = _frames_until_done(meta, meta_pid)
        meta.close()
        others = _silent_frames(other) + _silent_frames(anonymous)  # everything they were sent is there by now
        other.close()
        anonymous.close()
        history = json.loads(urllib.request.urlopen(urllib.request.Request(f"http://{address}/history/{pid}",
                                                                           headers=auth)).read())[pid]  # fmt: skip
        images = []
        for node_output in history["outputs"].values():
            for image in node_output["images"]:
                query = urllib.parse.urlencode({"filename": image["filename"], "subfolder": image["subfolder"],
                                                "type": image["type"]})  # fmt: skip
                images.append(urllib.request.urlopen(urllib.request.Request(f"http://{address}/view?{query}",
                                                                            headers=auth)).read())  # fmt: skip
        api = ComfyApiWrapper(f"http://{address}", user="ada", password="lovelace")
        assert api.get_system_stats()["system"] and "KSampler" in api.get_object_info()
        flow = txt2img(seed=5)
        flow["4"]["inputs"]["ckpt_name"] = name
        for node in flow.values():  # ComfyUI's "Export (API)" titles every node
            node["_meta"] = {"title": node["class_type"]}
        flow["9"]["_meta"] = {"title": "Save Image"}
        wrapper = ComfyWorkflowWrapper(flow)
        wrapper.set_node_param("Save Image", "filename_prefix", "maintained")
        maintained = api.queue_and_wait_images(wrapper, "Save Image")
    finally:
        assert server.stop()
    assert seen[0] == "status" and {"execution_start", "executing", "executed", "execution_success"} <= set(seen)
    # each sampler's steps as they advance, its last step always told (as ComfyUI's callback)
    assert progress == {"3": (STEPS, STEPS)}
    assert set(meta_progress) == {"20", "31", "41"} and all(v == m > 0 for v, m in meta_progress.values())
    assert meta_progress["31"][1] == meta_progress["41"][1] < STEPS  # the branches' tails
    assert len(images) == 1 and Image.open(io.BytesIO(images[0])).size == (32, 32)
    [(filename, png)] = maintained.items()  # the same workflow and seed: the same pixels
    assert filename.startswith("maintained") and np.array_equal(_pixels(png), _pixels(images[0]))
    # previews: ComfyUI's default frames (no feature flags sent), JPEGs of the image's size
    assert frames and all(_preview(f)[0] == 1 and _preview(f)[2].size == (32, 32) for f in frames)
    assert others == []  # another client's, and a client that gave no clientId, get none of them
    assert answered["type"] == "feature_flags" and answered["data"]["supports_preview_metadata"] is True
    read = [_preview(f) for f in meta_frames]
    assert read and all(kind == 4 and image.size == (32, 32) and m["prompt_id"] == meta_pid for kind, m, image in read)
    assert {m["node_id"] for _, m, _ in read} == {"20", "31", "41"}  # the chain's node and each branch's


def branching(prompts: list[str], split: int = 2, seed: int = 5) -> dict:
    """ComfyUI's "generate once, branch into variants": a KSamplerAdvanced that stops at step
    ``split`` with its leftover noise, feeding one KSamplerAdvanced per prompt that starts there
    (add_noise disable), each decoded and saved."""
    flow = txt2img(seed, "euler", "normal")
    del flow["3"], flow["8"], flow["9"]
    flow["20"] = {"class_type": "KSamplerAdvanced", "inputs": {
        "add_noise": "enable", "noise_seed": seed, "steps": STEPS, "cfg": 7.5, "sampler_name": "euler",
        "scheduler": "normal", "start_at_step": 0, "end_at_step": split, "return_with_leftover_noise": "enable",
        "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}}  # fmt: skip
    for k, text in enumerate(prompts):
        n = 30 + 10 * k
        flow[str(n)] = {"class_type": "CLIPTextEncode", "inputs": {"text": text, "clip": ["4", 1]}}
        flow[str(n + 1)] = {"class_type": "KSamplerAdvanced", "inputs": {
            "add_noise": "disable", "noise_seed": seed, "steps": STEPS, "cfg": 7.5, "sampler_name": "euler",
            "scheduler": "normal", "start_at_step": split, "end_at_step": 10000, "return_with_leftover_noise": "disable",
            "model": ["4", 0], "positive": [str(n), 0], "negative": ["7", 0], "latent_image": ["20", 0]}}  # fmt: skip
        flow[str(n + 2)] = {"class_type": "VAEDecode", "inputs": {"samples": [str(n + 1), 0], "vae": ["4", 2]}}
        flow[str(n + 3)] = {"class_type": "SaveImage", "inputs": {"filename_prefix": f"branch{k}", "images": [str(n + 2), 0]}}
    return flow


def test_branches_of_one_partial_chain_run_as_one_base_and_one_batched_tail(served):
    """Issue 53: 1 shared chain + 4 branches: one base generated, one edit request of 4 rows; each branch
    equals the same edit alone through the OpenAI door (strength 1 from the split step: for
    Euler, ComfyUI's branch sampler starting at s from the leftover latent is that re-entry)."""
    service, app = served
    prompts = ["a blue square", "a green circle", "a red triangle", "a yellow square"]

    def counter(name: str) -> float:  # summed over its labels
        return sum(s.value for m in service.metrics.registry.collect() for s in m.samples if s.name == name)

    async def work(c):
        names = ("edit_rt_bases_generated_total", "edit_rt_edits_served_total", "edit_rt_edit_requests_total")
        before = {n: counter(n) for n in names}
        entry = await _queued(c, _flow(service, branching(prompts)))
        assert entry["status"]["status_str"] == "success", entry["status"]
        after = {n: counter(n) - before[n] for n in before}
        pngs = [(await c.get("/view", params=entry["outputs"][str(33 + 10 * k)]["images"][0])).content
                for k in range(len(prompts))]  # fmt: skip
        alone = []
        for text in prompts:
            r = await c.post("/v1/images/edits", json={"base_id": _base_id(pngs[0]), "edits": [
                {"prompt": text, "strength": 1.0, "start_step": 2, "cfg_scale": 7.5}]})  # fmt: skip
            assert r.status_code == 200, r.text
            alone.append(base64.b64decode(r.json()["data"][0]["b64_json"]))
        # re-queued with one branch's prompt changed: the chain's base and 3 branches are reused
        # (ComfyUI's execution_cached), one row runs, and the unchanged branches are the same images
        changed = prompts[:3] + ["a purple circle"]
        before = {n: counter(n) for n in names}
        again = await _queued(c, _flow(service, branching(changed)))
        rerun = {n: counter(n) - before[n] for n in names}
        cached = next(m[1]["nodes"] for m in again["status"]["messages"] if m[0] == "execution_cached")
        again_pngs = [(await c.get("/view", params=again["outputs"][str(33 + 10 * k)]["images"][0])).content
                      for k in range(len(prompts))]  # fmt: skip
        return after, pngs, alone, rerun, cached, again_pngs

    after, pngs, alone, rerun, cached, again_pngs = _run(app, work)
    # one base, and its 4 branches as one edit request of 4 rows (one batched tail)
    assert after == {"edit_rt_bases_generated_total": 1, "edit_rt_edits_served_total": 4, "edit_rt_edit_requests_total": 1}
    assert len({_base_id(p) for p in pngs}) == 1
    for branch, reference in zip(pngs, alone):
        assert np.array_equal(_pixels(branch), _pixels(reference))  # 0 grey levels
    assert len({_pixels(p).tobytes() for p in pngs}) == 4  # four prompts, four images
    assert rerun == {"edit_rt_bases_generated_total": 0, "edit_rt_edits_served_total": 1, "edit_rt_edit_requests_total": 1}
    assert sorted(cached) == ["20", "31", "41", "51"]
    assert all(np.array_equal(_pixels(a), _pixels(b)) for a, b in zip(again_pngs[:3], pngs[:3]))
    assert not np.array_equal(_pixels(again_pngs[3]), _pixels(pngs[3]))


def _counter(service, name: str) -> float:
    """A metric summed over its labels (a histogram's ``_count``: its observations)."""
    return sum(s.value for m in service.metrics.registry.collect() for s in m.samples if s.name == name)


def _sweep_flow(service, samples: dict, n, tail_steps: int = 2) -> dict:
    """``samples`` (nodes making the latent "1") swept by edit-rt's sweep node "12", saved as one batch."""
    flow = {"4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": service.model_name}}, **samples,
            "10": {"class_type": "CLIPTextEncode", "inputs": {"text": "a blue square", "clip": ["4", 1]}},
            "12": {"class_type": "EditRtSweep", "inputs": {
                "samples": ["1", 0], "positive": ["10", 0], "slider": "strength", "from": -1.0, "to": 1.5, "n": n,
                "tail_steps": tail_steps, "cfg": 7.5, "preserve": "none"}},
            "13": {"class_type": "VAEDecode", "inputs": {"samples": ["12", 0], "vae": ["4", 2]}},
            "14": {"class_type": "SaveImage", "inputs": {"filename_prefix": "sweep", "images": ["13", 0]}}}  # fmt: skip
    return flow


def test_a_sweep_node_is_one_request_of_n_rows_equal_to_the_openai_doors_sweep(served):
    """edit-rt's EditRtSweep: n positions of the edit's strength as one batch of n images, run as
    one request of n rows; each equals the same sweep through the OpenAI door (0 grey levels),
    of a stored base and of a KSamplerAdvanced chain stopped at step 2. A bad n (0, past the
    bound, not a number) is a node error naming n, with nothing run."""
    service, app = served
    sweep = {"from": -1.0, "to": 1.5, "n": 3}
    chain = {k: v for k, v in branching([], seed=21).items() if k in ("5", "6", "7", "20")}
    chain["1"] = chain.pop("20")

    async def work(c):
        made = (await c.post("/v1/images/generations", json={"prompt": "a red circle", "seed": 8, "steps": STEPS,
                                                             "cfg_scale": 7.5, "size": "32x32"})).json()  # fmt: skip
        stored = {"1": {"class_type": "EditRtStoredBase", "inputs": {"base_id": made["id"]}}}
        names = ("edit_rt_edit_requests_total", "edit_rt_edits_served_total")
        before = {n: _counter(service, n) for n in names}
        entry = await _queued(c, _sweep_flow(service, stored, 3))
        ran = {n: _counter(service, n) - before[n] for n in names}
        pngs = [(await c.get("/view", params=i)).content for i in entry["outputs"]["14"]["images"]]
        openai = (await c.post("/v1/images/edits", json={"base_id": made["id"], "edits": [
            {"prompt": "a blue square", "tail_steps": 2, "cfg_scale": 7.5, "preserve": "none", "sweep": sweep}]})).json()
        on_chain = await _queued(c, _sweep_flow(service, chain, 3))
        chain_pngs = [(await c.get("/view", params=i)).content for i in on_chain["outputs"]["14"]["images"]]
        chain_ref = (await c.post("/v1/images/edits", json={"base_id": _base_id(chain_pngs[0]), "edits": [
            {"prompt": "a blue square", "tail_steps": 2, "cfg_scale": 7.5, "preserve": "none", "sweep": sweep}]})).json()
        before_bad = _counter(service, "edit_rt_edit_requests_total")
        bad = {n: await c.post("/prompt", json={"prompt": _sweep_flow(service, stored, n)}) for n in (0, 65, "five")}
        too_long = await c.post("/prompt", json={"prompt": _sweep_flow(service, chain, 3, tail_steps=3)})
        two = _sweep_flow(service, stored, 40)  # 40 + 40 rows: each n in range, the workflow's sum not
        two["22"] = {**two["12"], "inputs": {**two["12"]["inputs"]}}
        two["23"] = {"class_type": "VAEDecode", "inputs": {"samples": ["22", 0], "vae": ["4", 2]}}
        two["24"] = {"class_type": "SaveImage", "inputs": {"filename_prefix": "sweep", "images": ["23", 0]}}
        bad["80 in all"] = await c.post("/prompt", json={"prompt": two})
        info = (await c.get("/object_info/EditRtSweep")).json()["EditRtSweep"]
        return (ran, pngs, openai, chain_pngs, chain_ref, bad, too_long, info,
                _counter(service, "edit_rt_edit_requests_total") - before_bad)

    ran, pngs, openai, chain_pngs, chain_ref, bad, too_long, info, ran_bad = _run(app, work)
    assert ran == {"edit_rt_edit_requests_total": 1, "edit_rt_edits_served_total": 3}  # one request of n rows
    for got, ref in ((pngs, openai), (chain_pngs, chain_ref)):
        reference = [base64.b64decode(d["b64_json"]) for d in ref["data"]]
        assert len(got) == len(reference) == 3
        for png, expected in zip(got, reference):
            assert np.array_equal(_pixels(png), _pixels(expected))  # 0 grey levels
        assert len({_pixels(p).tobytes() for p in got}) == 3  # three positions, three images
    for n, r in bad.items():
        assert r.status_code == 400, (n, r.text)
        assert [e["extra_info"]["input_name"] for e in r.json()["node_errors"]["12"]["errors"]] == ["n"], (n, r.text)
    assert set(bad["80 in all"].json()["node_errors"]) == {"12", "22"} and "80 rows" in bad["80 in all"].text
    assert too_long.status_code == 400 and "tail_steps" in too_long.text and ran_bad == 0
    assert info["description"] and info["input"]["required"]["n"][1]["max"] == 64
    assert all(spec[1]["tooltip"] for spec in info["input"]["required"].values())


def test_queued_workflows_share_step_calls_and_each_equals_running_it_alone(served):
    """Several queued prompts run at once (comfyui_queue.MAX_RUNNING): the rows of two branching
    workflows share UNet calls (counted by the step loop's own rows-per-call histogram: fewer
    calls than the same two run one after another), each prompt's images equal its run alone (0
    grey levels), /history lists them in queue order; an interrupt naming one running prompt
    stops it alone."""
    service, app = served
    queue = app.state.comfyui.queue
    flows = [branching(["a blue square", "a green circle"], seed=31), branching(["a red triangle", "a yellow circle"], seed=32)]
    numbers = {}

    async def post(c, flow: dict) -> str:
        r = await c.post("/prompt", json={"prompt": _flow(service, flow)})
        assert r.status_code == 200, r.text
        numbers[r.json()["prompt_id"]] = r.json()["number"]
        return r.json()["prompt_id"]

    async def done(c, pid: str) -> dict:
        for _ in range(1200):
            if (entry := (await c.get(f"/history/{pid}")).json()):
                return entry[pid]
            await asyncio.sleep(0.02)
        raise AssertionError("the prompt never finished")

    async def images(c, entry: dict) -> list[bytes]:
        return [(await c.get("/view", params=entry["outputs"][n]["images"][0])).content for n in ("33", "43")]

    async def forget(c, entries: list[dict]) -> None:  # so that the next round runs everything again
        for entry in entries:
            for png in await images(c, entry):
                bid = _base_id(png)
                if await service.has_base(bid):
                    await service.delete_base(bid)
        queue.rows.pngs.clear()

    async def work(c):
        calls = _counter(service, "edit_rt_batch_rows_count")
        pids = await asyncio.gather(*(post(c, f) for f in flows))
        together = [await done(c, pid) for pid in pids]
        shared = _counter(service, "edit_rt_batch_rows_count") - calls
        order = [pid for pid in (await c.get("/history")).json() if pid in pids]
        await forget(c, together)
        calls = _counter(service, "edit_rt_batch_rows_count")
        alone = [await done(c, await post(c, f)) for f in flows]
        serial = _counter(service, "edit_rt_batch_rows_count") - calls
        together_pngs = [await images(c, e) for e in together]
        alone_pngs = [await images(c, e) for e in alone]
        # an interrupt naming one running prompt: it stops, the other one runs to its end
        long_one = txt2img(seed=41)
        long_one["3"]["inputs"]["steps"] = 100
        slow, other = await post(c, long_one), await post(c, branching(["a blue circle"], seed=42))
        while queue.where(slow) == "pending":
            await asyncio.sleep(0.005)
        await c.post("/interrupt", json={"prompt_id": slow})
        return (pids, together, shared, order, alone, serial, together_pngs, alone_pngs, await done(c, slow),
                await done(c, other))

    pids, together, shared, order, alone, serial, together_pngs, alone_pngs, slow, other = _run(app, work)
    assert all(e["status"]["status_str"] == "success" for e in together + alone)
    assert order == sorted(pids, key=numbers.get)  # /history in queue order, whichever finished first
    for a, b in zip(together_pngs, alone_pngs):
        for x, y in zip(a, b):
            assert np.array_equal(_pixels(x), _pixels(y))  # 0 grey levels
    # alone: each 4 chain steps + 2 tail steps; together the rows of both share calls
    assert serial == 2 * (STEPS + 2) and shared < serial, (shared, serial)
    assert slow["status"]["status_str"] == "error" and "execution_interrupted" in [m[0] for m in slow["status"]["messages"]]
    assert other["status"]["status_str"] == "success"


# Stable Diffusion 1.5's scheduler_config.json (runwayml/stable-diffusion-v1-5, as published)
SD15_SCHEDULER = {"_class_name": "PNDMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
                  "beta_start": 0.00085, "num_train_timesteps": 1000, "set_alpha_to_one": False,
                  "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None, "clip_sample": False}  # fmt: skip


class ComfyModelSampling:
    """ComfyUI's ModelSamplingDiscrete (comfy/model_sampling.py) for a scaled_linear chain, re-derived
    from its source in numpy: the training sigmas in float32, ``sigma(t)`` interpolating log-sigma
    between integer timesteps, ``timestep(sigma)`` the nearest training timestep in log-sigma (what
    ComfyUI feeds the UNet)."""

    def __init__(self, beta_start: float = 0.00085, beta_end: float = 0.012, n: int = 1000):
        betas = np.linspace(beta_start**0.5, beta_end**0.5, n, dtype=np.float64) ** 2
        alphas_cumprod = np.cumprod(1.0 - betas)
        sigmas = ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5
        self.sigmas, self.log_sigmas = sigmas.astype(np.float32), np.log(sigmas).astype(np.float32)

    def sigma(self, t: float) -> float:
        t = min(max(float(t), 0.0), len(self.sigmas) - 1)
        low, high, w = int(np.floor(t)), int(np.ceil(t)), t - np.floor(t)
        return float(np.exp((1 - w) * self.log_sigmas[low] + w * self.log_sigmas[high]))

    def timestep(self, sigma: float) -> int:
        return int(np.abs(np.float32(np.log(sigma)) - self.log_sigmas).argmin())

    # comfy/samplers.py's schedulers, each ending at sigma 0
    def normal(self, steps: int) -> np.ndarray:
        start, end = self.timestep(self.sigmas[-1]), self.timestep(self.sigmas[0])
        return np.array([self.sigma(t) for t in np.linspace(start, end, steps, dtype=np.float32)] + [0.0])

    def karras(self, steps: int, rho: float = 7.0) -> np.ndarray:  # k-diffusion's get_sigmas_karras
        lo, hi = float(self.sigmas[0]) ** (1 / rho), float(self.sigmas[-1]) ** (1 / rho)
        return np.append((hi + np.linspace(0, 1, steps) * (lo - hi)) ** rho, 0.0)

    def ddim_uniform(self, steps: int) -> np.ndarray:
        every = max(len(self.sigmas) // steps, 1)
        return np.array([0.0] + [float(self.sigmas[x]) for x in range(1, len(self.sigmas), every)])[::-1]


def test_the_sampler_pairs_the_door_runs_have_comfyuis_sigmas():
    """Each (sampler_name, scheduler) pair the door runs, on Stable Diffusion 1.5's scheduler
    config: the sigmas of edit-rt's sampler equal those of ComfyUI's scheduler (re-derived from
    ComfyUI's source: the reference) within 1e-4, step by step; the DPM++ and UniPC Karras pairs feed the
    UNet ComfyUI's own integer timesteps, Euler's (diffusers' linspace points) are within half a
    timestep of them. DDIM's timesteps are ddim_uniform's where steps divides 1000 (elsewhere
    ComfyUI runs one step more), its last step ending at the chain's first alpha (set_alpha_to_one
    false) where ComfyUI ends at sigma 0."""
    from edit_rt.runtime.model.samplers import schedule_for
    from edit_rt.runtime.web.comfyui_nodes import PAIRS

    comfy = ComfyModelSampling()
    assert set(PAIRS) == {("euler", "normal"), ("euler", "karras"), ("euler_ancestral", "normal"),
                          ("dpmpp_2m", "karras"), ("uni_pc_bh2", "karras"), ("ddim", "ddim_uniform")}  # fmt: skip
    for (sampler_name, scheduler), name in PAIRS.items():
        for steps in (4, 20, 25, 50):
            ours = schedule_for(name, SD15_SCHEDULER, steps)
            reference = getattr(comfy, scheduler)(steps)
            if name == "ddim":
                sigmas = np.sqrt((1 - ours.alpha_t) / ours.alpha_t)
                np.testing.assert_allclose(sigmas, reference[:-1], rtol=2e-5, err_msg=f"{name} {steps}")
                assert np.isclose(ours.alpha_prev[-1], 1 / (1 + comfy.sigmas[0] ** 2), rtol=1e-6)  # not sigma 0
                continue
            # 1e-4: float32, and diffusers' Euler interpolates sigma between training timesteps
            # linearly where ComfyUI interpolates log-sigma (7.5e-5 at one of 50 steps)
            np.testing.assert_allclose(ours.sigmas, reference, rtol=1e-4, atol=1e-7, err_msg=f"{name} {steps}")
            fed = [comfy.timestep(s) for s in reference[:-1]]
            gap = np.abs(np.asarray(ours.timesteps, dtype=np.float64) - fed).max()
            assert gap == 0 if scheduler == "karras" and name != "euler_karras" else gap <= 0.5, (name, steps, gap)
