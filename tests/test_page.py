"""The editing page's layout and keys, and ``/docs``, in a real headless Chromium against a real
server on loopback (issue 24, items 9 and 10).

Facts read from the DOM (``getBoundingClientRect``, ``scrollWidth``), at a desktop size
(1280x900) and a phone's width (420x900); PNGs read back by Pillow, not by the page. Screenshots
go to ``out/test-artifacts/`` (ignored by git), their paths printed.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from PIL import Image

from .server_process import ServerProcess
from .test_web import CHROMIUM, _launch

ARTIFACTS = Path(__file__).resolve().parents[1] / "out" / "test-artifacts"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = ServerProcess(tmp_path_factory.mktemp("page"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = _launch(p)
        yield b
        b.close()


def offline(context) -> list[str]:
    """Abort every request that leaves loopback; the list of those it aborted."""
    refused: list[str] = []

    def route(r):
        if urlsplit(r.request.url).hostname in ("127.0.0.1", "localhost"):
            r.continue_()
        else:
            refused.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    return refused


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def png_text(data_url: str) -> str:
    return Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1]))).text["parameters"]


def rect(page, selector: str, nth: int = 0) -> dict:
    return page.eval_on_selector_all(selector, f"els => {{ const r = els[{nth}].getBoundingClientRect(); "
                                               "return {x: r.x, y: r.y, w: r.width, h: r.height, bottom: r.bottom, right: r.right}; }")  # fmt: skip


def remove_buttons_on_the_prompts_line(page) -> None:
    """Every edit row's remove button sits on its prompt's line (its vertical middle within the prompt's box)."""
    for k in range(page.locator(".edit").count()):
        p, x = rect(page, ".edit .p", k), rect(page, ".edit .x", k)
        middle = x["y"] + x["h"] / 2
        assert p["y"] <= middle <= p["bottom"], (k, p, x)
        assert x["x"] >= p["right"]  # beside it, not below


def no_sideways_scroll(page) -> None:
    width, inner = page.evaluate("[document.scrollingElement.scrollWidth, window.innerWidth]")
    assert width <= inner, f"the page is {width} px wide in a {inner} px window"


def generate_with_enter(page) -> str:
    """Type a prompt, press Enter (no click): the base comes back; the seed the page shows."""
    page.fill("#prompt", "a red circle on a blue background")
    page.press("#prompt", "Enter")
    page.wait_for_function("document.getElementById('base').naturalWidth === 32", timeout=60_000)
    return page.inner_text("#used-seed")


def apply_edits(page, n: int = 2) -> None:
    page.click("#apply")
    page.wait_for_function(f"document.querySelectorAll('figure.done').length === {n}", timeout=120_000)


def test_docs_render_offline(server, browser):
    """Swagger UI and ReDoc from this server's own files: with every other host unreachable,
    /docs shows the API's operations and /redoc its sections, and neither asked elsewhere."""
    context = browser.new_context()
    refused = offline(context)
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.goto(server.url + "/docs")
    page.wait_for_selector(".opblock", timeout=30_000)
    assert errors == []  # nothing the page's policy refused, nothing that failed to load
    operations = page.locator(".opblock-summary-path").all_inner_texts()
    assert "/v1/images/generations" in [o.replace("\u200b", "") for o in operations]
    assert page.locator(".opblock").count() >= 10
    screenshot(page, "docs.png")
    page.goto(server.url + "/redoc")
    page.wait_for_selector("[data-section-id^='operation/']", state="attached", timeout=30_000)
    assert page.locator("[data-section-id^='operation/']").count() >= 10
    screenshot(page, "redoc.png")
    assert refused == []
    context.close()


def test_the_docs_assets_are_a_fixed_list(server):
    import httpx

    assert httpx.get(server.url + "/docs/assets/swagger-ui.css").headers["content-type"].startswith("text/css")
    r = httpx.get(server.url + "/docs/assets/core.py")
    assert r.status_code == 404 and "swagger-ui-bundle.js" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/docs/assets/..%2F__init__.py").status_code == 404


def test_the_page_at_1280x900(server, browser):
    """Rows keep their remove button on the prompt's line; the strength value has one width and
    the slider does not move while dragged; Enter generates; the random seed is shown, as the
    PNG says; each image downloads as the server's PNG; after a generate and an edit, the base
    and every result are in view without scrolling."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    refused = offline(context)
    page = context.new_page()
    page.goto(server.url + "/")
    remove_buttons_on_the_prompts_line(page)

    widths, lefts = set(), set()
    for v in ("0", "0.5", "1", "1.5", "2", "0.1"):
        page.locator(".edit .s").first.evaluate("(s, v) => { s.value = v; s.dispatchEvent(new Event('input')); }", v)
        widths.add(rect(page, ".edit .sv")["w"])
        lefts.add(rect(page, ".edit .s")["x"])
        assert page.locator(".edit .sv").first.inner_text() == f"{float(v):.1f}"
    assert len(widths) == 1 and len(lefts) == 1, (widths, lefts)
    page.locator(".edit .s").first.evaluate("s => { s.value = 1; s.dispatchEvent(new Event('input')); }")

    shown = generate_with_enter(page)
    params = png_text(page.get_attribute("#base-download", "href"))
    seed = int(params.split("Seed: ")[1].split(",")[0])
    assert shown == f"seed {seed}"
    assert f"seed {seed}" in page.inner_text("#status")
    with page.expect_download() as got:
        page.click("#base-download")
    download = got.value
    base_id = page.evaluate("baseId")
    assert download.suggested_filename.endswith(".png") and base_id in download.suggested_filename
    assert f"seed-{seed}" in download.suggested_filename
    assert f"Seed: {seed}" in Image.open(download.path()).text["parameters"]

    apply_edits(page)
    assert page.evaluate("document.scrollingElement.scrollTop") == 0
    for selector in ("#base", "figure"):
        for k in range(page.locator(selector).count()):
            r = rect(page, selector, k)
            assert r["y"] >= 0 and r["bottom"] <= 900 and r["right"] <= 1280, (selector, k, r)
    names = page.eval_on_selector_all("figure a.dl", "as => as.map(a => a.download)")
    assert len(names) == 2 and len(set(names)) == 2 and all(n.endswith(".png") and base_id in n for n in names)
    with page.expect_download() as got:
        page.locator("figure a.dl").nth(1).click()
    edited = Image.open(got.value.path()).text["parameters"]
    assert edited.startswith("a red square") and f"Seed: {seed}" in edited and "Edit strength" in edited
    remove_buttons_on_the_prompts_line(page)
    no_sideways_scroll(page)
    screenshot(page, "page-1280x900.png")
    assert refused == []
    context.close()


def test_the_page_at_420x900_has_no_sideways_scroll(server, browser):
    """A phone's width: one column, no horizontal scroll before or after a generate and an edit,
    remove buttons still on their prompt's line, Enter in an edit's prompt applies."""
    context = browser.new_context(viewport={"width": 420, "height": 900})
    page = context.new_page()
    page.goto(server.url + "/")
    no_sideways_scroll(page)
    remove_buttons_on_the_prompts_line(page)
    page.fill("#seed", "4")
    assert generate_with_enter(page) == "seed 4"
    page.press(".edit .p >> nth=0", "Enter")  # Enter in an edit applies all of them
    page.wait_for_function("document.querySelectorAll('figure.done').length === 2", timeout=120_000)
    assert page.locator(".edit").count() == 2  # Enter did not press a row's remove button
    no_sideways_scroll(page)
    remove_buttons_on_the_prompts_line(page)
    screenshot(page, "page-420x900.png")
    context.close()
