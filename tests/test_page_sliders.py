"""The page's sliders (issue 25) in a real headless Chromium against a real server on loopback
with one LoRA adapter, and ``GET /v1/adapters``.

What the page shows is compared with what the server answers the test itself (httpx): a
precomputed image is the sweep reply's image for that position (the page's own request, read
back from the browser), the exact image is pixel for pixel what ``POST /v1/images/edits``
returns for the same combined edit, written out here by hand, sent by the test.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from .server_process import ServerProcess
from .test_page import no_sideways_scroll, offline, screenshot
from .test_web import CHROMIUM, _launch

STEPS = 6
BASE = {"prompt": "x", "steps": STEPS, "guidance": 7.5, "width": 32, "height": 32}
BASE_PROMPT = "a red circle on a blue background"
DIRECTION = "a vivid red circle"
POSITIONS = [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0]  # the page's sweep: -2..2, 9 positions


@pytest.fixture(scope="module")
def lora_build(model_dir, adapter_onnx_dir, tmp_path_factory):
    """An export with 3 adapter slots and one LoRA (text encoder and UNet) converted for it,
    laid out as `make export` and `edit-rt adapters` lay them out."""
    from edit_rt.export.compile.adapters import convert_adapters
    from edit_rt.runtime.engine.manifest import load_manifest

    from .test_adapters import make_lora

    root = tmp_path_factory.mktemp("sliders")
    onnx = adapter_onnx_dir  # the session's export with adapter slots (conftest.py)
    lora = make_lora(model_dir, root / "film", seed=5)
    convert_adapters(model_dir, load_manifest(onnx), {"film": lora}, onnx.parent / "adapters")
    return {"root": root, "onnx": onnx, "lora": lora}


@pytest.fixture(scope="module")
def server(lora_build, model_dir):
    proc = ServerProcess(lora_build["root"], model_dir, lora_build["onnx"], base=BASE,
                         extra={"adapters": {"film": str(lora_build["lora"])}})  # fmt: skip
    yield proc
    assert proc.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    with sync_playwright() as p:
        b = _launch(p)
        yield b
        b.close()


# --- GET /v1/adapters -------------------------------------------------------------------------------


def test_get_adapters_lists_the_configured_adapter(server, lora_build):
    from safetensors import safe_open

    with safe_open(str(lora_build["lora"]), framework="numpy") as f:  # the LoRA file's own rank and parts
        downs = [k for k in f.keys() if "lora_A" in k]
        rank = f.get_tensor(downs[0]).shape[0]
    r = httpx.get(server.url + "/v1/adapters", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["slots"] == 3 and [a["name"] for a in body["data"]] == ["film"]
    (film,) = body["data"]
    assert film["rank"] == rank and film["text"] is any(k.startswith("text_encoder") for k in downs)
    assert "unet_step" in film["graphs"] and ("text_encoder" in film["graphs"]) is film["text"]
    assert "/v1/adapters" in httpx.get(server.url + "/openapi.json").json()["paths"]


# --- the page ---------------------------------------------------------------------------------------


def _pixels(data: str) -> np.ndarray:
    """An image's pixels from a data URL or base64."""
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data.split(",", 1)[-1]))).convert("RGB"))


def _direct(server, base_id: str, edit: dict) -> np.ndarray:
    r = httpx.post(server.url + "/v1/images/edits", json={"base_id": base_id, "edits": [edit]}, timeout=120)
    assert r.status_code == 200, r.text
    return _pixels(r.json()["data"][0]["b64_json"])


class EditRequests:
    """The page's POSTs to /v1/images/edits, in order (playwright's requests: each body, and its reply once it came)."""

    def __init__(self, page):
        self.sent: list = []
        page.on("request", lambda r: r.method == "POST" and r.url.endswith("/v1/images/edits") and self.sent.append(r))

    def bodies(self) -> list[dict]:
        return [r.post_data_json for r in self.sent]

    def reply(self, k: int) -> dict:
        return self.sent[k].response().json()


def _drag(page, nth: int, value: float, release: bool = True) -> dict:
    """Slider ``nth`` set to ``value`` with an input event (and a change: the release); what
    the image shows right after the input event, in the same task (before any reply)."""
    return page.locator(".slider .r").nth(nth).evaluate(
        """(r, [v, release]) => {
             r.value = v; r.dispatchEvent(new Event('input'));
             const img = document.getElementById('slider-image');
             const now = {src: img.src, shows: img.dataset.shows, position: img.dataset.position};
             if (release) r.dispatchEvent(new Event('change'));
             return now;
           }""", [value, release])  # fmt: skip


def _exact(page, requests: EditRequests, before: int) -> str:
    """The exact image's src once the reply to the page's one new edit request is shown."""
    page.wait_for_function("document.getElementById('slider-image').dataset.shows === 'exact'", timeout=60_000)
    assert len(requests.sent) == before + 1  # one request for the combined setting
    return page.get_attribute("#slider-image", "src")


def _sweeps_ready(page, n: int) -> None:
    page.wait_for_function(f"[...document.querySelectorAll('.slider .w')].filter(w => w.textContent === '9 positions ready')"
                           f".length === {n}", timeout=90_000)  # fmt: skip


def _open_base(page, server, requests: "EditRequests") -> str:
    """A base opened (its adapter slider swept), then a direction slider added (swept too)."""
    page.goto(server.url + "/")
    page.wait_for_selector(".slider", state="attached")  # the adapter's slider (GET /v1/adapters); shown once a base opens
    page.fill("#prompt", BASE_PROMPT)
    page.fill("#seed", "4")
    page.press("#prompt", "Enter")
    _sweeps_ready(page, 1)
    assert len(requests.sent) == 1  # one request for the one slider
    page.select_option("#slider-kind", "direction")
    page.fill("#slider-prompt", DIRECTION)
    page.click("#add-slider")
    assert page.locator(".slider").count() == 2
    _sweeps_ready(page, 2)
    assert len(requests.sent) == 2
    return page.evaluate("baseId")


def test_sliders_sweep_once_then_show_the_nearest_at_once_and_then_the_exact_mix(server, browser):
    """Opening a base: one sweep request for its slider (adapter film); adding a direction
    slider: one for it; each answered with 9 images. Dragging: the sweep's image nearest the value at once, then the exact image
    of every slider's value as one row, which is what the API answers for that edit."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    refused = offline(context)
    page = context.new_page()
    requests = EditRequests(page)
    base_id = _open_base(page, server, requests)

    sweeps = requests.bodies()
    assert sweeps == [
        {"base_id": base_id, "edits": [{"prompt": BASE_PROMPT, "sweep": {"from": -2, "to": 2, "n": 9, "adapter": "film"}}]},
        {"base_id": base_id, "edits": [{"prompt": BASE_PROMPT, "directions": [{"prompt": DIRECTION, "strength": 0}],
                                        "sweep": {"from": -2, "to": 2, "n": 9, "direction": 0}}]},
    ]  # fmt: skip
    film, direction = (requests.reply(k)["data"] for k in (0, 1))
    assert [d["index"] for d in film] == list(range(9)) and [d["index"] for d in direction] == list(range(9))
    assert not np.array_equal(_pixels(film[0]["b64_json"]), _pixels(film[8]["b64_json"]))  # the LoRA moves the image
    assert page.get_attribute("#slider-image", "data-shows") == "base"

    # the adapter to 0.7: at once the sweep's 0.5 (index 5), then film 0.7 with the direction at 0
    now = _drag(page, 0, 0.7)
    assert now["shows"] == "precomputed" and now["position"] == "5"
    assert now["src"] == "data:image/png;base64," + film[5]["b64_json"]
    assert page.inner_text(".slider .v >> nth=0") == "+0.7"
    assert "precomputed: film +0.5" in page.inner_text("#slider-shows")
    src = _exact(page, requests, 2)
    edit = {"prompt": BASE_PROMPT, "adapters": {"film": 0.7}, "directions": [{"prompt": DIRECTION, "strength": 0}]}
    assert requests.bodies()[2] == {"base_id": base_id, "edits": [edit]}
    assert np.array_equal(_pixels(src), _direct(server, base_id, edit))
    assert page.inner_text("#slider-shows") == "exact: film +0.7, a vivid red circle 0.0"

    # the direction to -1 (a sweep position, index 2): its precomputed image, then both sliders' mix
    now = _drag(page, 1, -1.0)
    assert now["shows"] == "precomputed" and now["src"] == "data:image/png;base64," + direction[2]["b64_json"]
    src = _exact(page, requests, 3)
    edit = {"prompt": BASE_PROMPT, "adapters": {"film": 0.7}, "directions": [{"prompt": DIRECTION, "strength": -1.0}]}
    assert requests.bodies()[3]["edits"] == [edit]
    mixed = _direct(server, base_id, edit)
    assert np.array_equal(_pixels(src), mixed)
    assert not np.array_equal(mixed, _direct(server, base_id, {**edit, "directions": [{"prompt": DIRECTION, "strength": 0}]}))
    screenshot(page, "page-sliders.png")
    assert refused == []
    context.close()


def test_a_drag_without_release_waits_then_sends_one_request_and_a_stale_reply_is_dropped(server, browser):
    """Input events alone: one request after the pause (debounced), for the last value; a reply
    to an older request arriving after a newer one was sent is not shown. At a phone's width."""
    context = browser.new_context(viewport={"width": 420, "height": 900})
    page = context.new_page()
    requests = EditRequests(page)
    base_id = _open_base(page, server, requests)
    no_sideways_scroll(page)
    for v in (0.3, 0.6, 1.2):
        _drag(page, 0, v, release=False)
    page.wait_for_timeout(600)
    assert [b["edits"][0].get("adapters") for b in requests.bodies()[2:]] == [{"film": 1.2}]
    page.wait_for_function("document.getElementById('slider-image').dataset.shows === 'exact'", timeout=60_000)
    # a request superseded before its reply came: its reply is dropped, the newer one's shown
    page.evaluate("""() => { const send = window.fetch;  // the reply to film -1.3 held back a second
                       window.fetch = async (url, opts) => { const r = await send(url, opts);
                         if (String(opts && opts.body).includes('"film":-1.3')) await new Promise(ok => setTimeout(ok, 1000));
                         return r; }; }""")  # fmt: skip
    _drag(page, 0, -1.3)
    _drag(page, 0, 1.8)
    page.wait_for_function("document.getElementById('slider-shows').textContent.startsWith('exact: film +1.8')", timeout=60_000)
    page.wait_for_timeout(1500)  # the -1.3 reply has come by now
    assert page.inner_text("#slider-shows").startswith("exact: film +1.8")
    expected = _direct(server, base_id, {"prompt": BASE_PROMPT, "adapters": {"film": 1.8},
                                         "directions": [{"prompt": DIRECTION, "strength": 0}]})  # fmt: skip
    assert np.array_equal(_pixels(page.get_attribute("#slider-image", "src")), expected)
    context.close()


def test_an_unknown_adapter_is_the_servers_400_beside_its_slider_and_the_page_goes_on(server, browser):
    """A slider naming an adapter the server lacks: its sweep's 400 message, as the server
    words it, beside it; the mix that names it refused beside the slider dragged; removed,
    the other sliders work again."""
    context = browser.new_context()
    page = context.new_page()
    base_id = _open_base(page, server, EditRequests(page))
    page.evaluate("addSlider({adapter: 'nope'})")  # a slider no select offers: its request made by hand
    page.wait_for_function("document.querySelectorAll('.slider .m')[2].textContent !== ''", timeout=60_000)
    sweep = {"prompt": BASE_PROMPT, "sweep": {"from": -2, "to": 2, "n": 9, "adapter": "nope"}}
    r = httpx.post(server.url + "/v1/images/edits", json={"base_id": base_id, "edits": [sweep]}, timeout=60)
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"], r.text
    assert page.locator(".slider .m").nth(2).inner_text() == r.json()["error"]["message"]
    _drag(page, 0, 1.0)  # the mix names nope too: the 400 shows beside the slider dragged
    page.wait_for_function("document.querySelectorAll('.slider .m')[0].textContent.includes('nope')", timeout=60_000)
    assert page.get_attribute("#slider-image", "data-shows") == "refused" and "nope" in page.inner_text("#slider-shows")
    assert page.locator("#add-slider").is_disabled()  # three sliders: the most
    page.locator(".slider .x").nth(2).click()
    assert page.locator("#add-slider").is_enabled()
    _drag(page, 0, 0.5)
    page.wait_for_function("document.getElementById('slider-image').dataset.shows === 'exact'", timeout=60_000)
    assert page.locator(".slider .m").nth(0).inner_text() == ""
    context.close()
