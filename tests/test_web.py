"""The editing page in a real headless Chromium against a real server on loopback.

Generate a base, keep the page's two default edits, draw a rectangle on the base to mask the
last one, Apply: two edited images stream in.
"""

from __future__ import annotations

import shutil

import pytest

from .server_process import ServerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _launch(playwright):
    """Debian's headless Chromium, kept off the network but for loopback."""
    return playwright.chromium.launch(
        executable_path=CHROMIUM,
        args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    )  # fmt: skip


@pytest.fixture(scope="module")
def browser():
    """One Chromium for both tests (each its own server and page). Module-scoped, as
    test_page.py's: a Playwright left running would hold its event loop in the thread, and a later
    module's asyncio.run refuses to start inside it."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = _launch(p)
        yield b
        b.close()


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_generate_two_edits_in_the_browser(browser, tmp_path, model_dir, onnx_dir):
    import base64
    import io

    from PIL import Image

    proc = ServerProcess(tmp_path, model_dir, onnx_dir)
    try:
        page = browser.new_page()
        page.goto(proc.url + "/")
        page.click("#generate")
        page.wait_for_function("document.getElementById('base').naturalWidth === 32", timeout=60_000)
        assert page.locator(".edit").count() == 2
        box = page.locator("#base").bounding_box()
        page.mouse.move(box["x"] + 10, box["y"] + 10)
        page.mouse.down()
        page.mouse.move(box["x"] + 120, box["y"] + 120)
        page.mouse.up()
        assert page.locator(".edit").nth(1).locator(".m").inner_text() == "masked"
        page.locator(".edit .st").first.fill("0.5")  # the first edit keeps the base's layout for half its tail
        page.click("#apply")
        page.wait_for_function("document.querySelectorAll('figure.done').length === 2", timeout=120_000)
        widths = page.eval_on_selector_all("figure img", "imgs => imgs.map(i => i.naturalWidth)")
        assert widths == [32, 32]
        captions = page.locator("figure .i").all_inner_texts()
        assert all("s in the batch" in c for c in captions)
        # what the server was sent, read back from each PNG's parameters by PIL
        texts = [Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).text["parameters"]
                 for src in page.eval_on_selector_all("figure img", "imgs => imgs.map(i => i.src)")]  # fmt: skip
        assert ["Structure: 0.5" in t for t in texts] == [True, False]
        page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        page.close()
    finally:
        assert proc.stop()


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_a_colour_edit_with_the_pages_defaults_lands(browser, tmp_path, shapes_onnx_dir):
    """The committed shapes model, served with its config's defaults (negative prompt "",
    strength 1.5, tail 0.4): the page's first edit, untouched, turns the red circle green
    (the shapes reader on the PNG that came back); HTML in a prompt is shown as text."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from edit_rt.export.world.shapes import read

    from .conftest import SHAPES_MODEL

    proc = ServerProcess(tmp_path, SHAPES_MODEL, shapes_onnx_dir,
                         base={"prompt": "x", "negative_prompt": "", "steps": 30, "guidance": 4.0, "width": 32, "height": 32},
                         extra={"cache": {"default_tail_fraction": 0.4, "default_strength": 1.5}})  # fmt: skip
    try:
        page = browser.new_page()
        page.goto(proc.url + "/")
        assert page.input_value("#negative") == "" and page.locator(".edit .s").first.input_value() == "1.5"
        assert page.locator(".edit .t").first.input_value() == "12"
        page.fill("#seed", "2")
        page.click("#generate")
        page.wait_for_function("document.getElementById('base').naturalWidth === 32", timeout=60_000)
        page.locator(".edit .p").nth(1).fill("<img src=x onerror=window.pwned=1>a red square")
        page.click("#apply")
        page.wait_for_function("document.querySelectorAll('figure.done').length === 2", timeout=120_000)
        src = page.eval_on_selector("figure img", "i => i.src")
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB"))
        base = np.asarray(Image.open(io.BytesIO(base64.b64decode(page.eval_on_selector("#base", "i => i.src").split(",", 1)[1]))).convert("RGB"))
        assert read(base).colour == "red" and read(image).colour == "green"
        assert page.evaluate("window.pwned === undefined")  # the prompt was text, not HTML
        assert "<img" in page.locator("figure figcaption").nth(1).inner_text()
        page.close()
    finally:
        assert proc.stop()
