"""The editing page in a real headless Chromium against a real server on loopback.

Generate a base, keep the page's two default edits, draw a rectangle on the base to mask the
last one, Apply: two edited images stream in.
"""

from __future__ import annotations

import shutil

import pytest

from .server_process import ServerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_generate_two_edits_in_the_browser(tmp_path, model_dir, onnx_dir):
    from playwright.sync_api import sync_playwright

    proc = ServerProcess(tmp_path, model_dir, onnx_dir)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
            )  # fmt: skip
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
            page.click("#apply")
            page.wait_for_function("document.querySelectorAll('figure.done').length === 2", timeout=120_000)
            widths = page.eval_on_selector_all("figure img", "imgs => imgs.map(i => i.naturalWidth)")
            assert widths == [32, 32]
            captions = page.locator("figure .i").all_inner_texts()
            assert all("s in the batch" in c for c in captions)
            page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
            browser.close()
    finally:
        assert proc.stop()
