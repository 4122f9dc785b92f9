"""What an operator graphs, read from `edit-rt serve`'s ``/metrics`` (issue 24, item 8), its app
run in this process over ASGI (in_process_server.py).

Every family is parsed by prometheus_client's own text parser and checked by promtool; the
values are checked against what the requests must have cost, counted by hand from the request
(T steps for a generation, ``tail_steps`` per edit, ``T - tail_steps`` rows saved per edit), from
the PNG's own parameters (the model hash) and from the kernel's ``/proc`` (the server's RSS),
never against the metrics code's own arithmetic.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from .in_process_server import InProcessServer

T = 6  # the test servers' default steps (server_process.server_config)
PROMTOOL = shutil.which("promtool")
STAGES = ("text_encode", "kv_mix", "step", "decode", "png_encode", "inversion", "store_load")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = InProcessServer(tmp_path_factory.mktemp("metrics"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


def scrape(client: httpx.Client) -> tuple[dict, str]:
    """``{(sample name, frozenset(labels)): value}`` and the text, through prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, text


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def moved(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def stage_count(before: dict, after: dict, stage: str) -> float:
    return moved(before, after, "edit_rt_stage_seconds_count", stage=stage)


def _generate(client: httpx.Client, seed: int) -> dict:
    r = client.post("/v1/images/generations", json={"prompt": "a red circle", "seed": seed}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _edit(client: httpx.Client, bid: str, prompts: list[str], tail: int) -> dict:
    edits = [{"prompt": p, "tail_steps": tail} for p in prompts]
    r = client.post("/v1/images/edits", json={"base_id": bid, "edits": edits}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_generation_and_an_edit_move_every_family_by_what_they_cost(server):
    """One generation (T steps, one row), then 3 edits of it with 2-step tails (3 rows, 2 calls):
    8 unet_step calls, 6 + 3 x 2 rows, 3 x (T - 2) rows saved, each stage observed as often as it
    ran, the base found in RAM, and a base nobody stored missing from both tiers."""
    before, _ = scrape(server.client)
    start = time.monotonic()
    gen = _generate(server.client, seed=5)
    gen_s = time.monotonic() - start
    _edit(server.client, gen["id"], ["a green circle", "a blue square", "a yellow circle"], tail=2)
    edit_s = time.monotonic() - start - gen_s
    unknown = server.client.post("/v1/images/edits", json={"base_id": "0" * 24, "edits": [{"prompt": "x"}]}, timeout=60)
    assert unknown.status_code == 404, unknown.text
    client_s = time.monotonic() - start  # the client's clock: every observed second lies within it
    after, text = scrape(server.client)

    # the step loop, counted by hand: 6 calls of 1 row, then 2 calls of 3 rows
    calls = moved(before, after, "edit_rt_unet_calls_total")
    assert calls == T + 2
    assert moved(before, after, "edit_rt_step_seconds_count") == calls  # one observation per call
    assert stage_count(before, after, "step") == calls
    assert moved(before, after, "edit_rt_unet_rows_total") == T + 3 * 2
    assert moved(before, after, "edit_rt_unet_rows_saved_total") == 3 * (T - 2)
    assert moved(before, after, "edit_rt_unet_padding_rows_total") == 0  # the CPU's exact buckets
    # the edits' first unconditional halves come from the base, all three (the step graph takes E = N)
    assert moved(before, after, "edit_rt_unet_uncond_halves_skipped_total") == 3
    # the queue: every row admitted once (1 + 3), each waiting within its own request's time
    assert moved(before, after, "edit_rt_queue_wait_seconds_count") == 4
    assert 0 <= moved(before, after, "edit_rt_queue_wait_seconds_sum") <= gen_s + 3 * edit_s

    # stages: two text encodes for the generation (its prompt; its negative prompt), one for
    # the three edit prompts (batched), a mix per edit, a decode per finished batch, a PNG per image
    assert stage_count(before, after, "text_encode") == 3
    assert stage_count(before, after, "kv_mix") == 3
    assert stage_count(before, after, "decode") == 2
    assert stage_count(before, after, "png_encode") == 4
    assert stage_count(before, after, "store_load") == 1  # the edit pinned its base (the unknown one never got a pin)
    assert stage_count(before, after, "inversion") == 0
    for stage in STAGES:
        assert f'edit_rt_stage_seconds_bucket{{le="0.0005",stage="{stage}"}}' in text  # every stage is a series
        spent = moved(before, after, "edit_rt_stage_seconds_sum", stage=stage)
        # a stage that ran took time, one that did not took none, and none outlasts the requests
        assert (spent > 0 if stage_count(before, after, stage) else spent == 0) and spent <= client_s, (stage, spent, client_s)
    # a whole step call holds a UNet evaluation; a K/V mix is a few multiply-adds
    per_call = lambda stage: moved(before, after, "edit_rt_stage_seconds_sum", stage=stage) / stage_count(before, after, stage)  # noqa: E731
    assert per_call("kv_mix") < per_call("step")

    # the store: the edit's base from RAM; the unknown base missed RAM, then the disk tier
    assert moved(before, after, "edit_rt_store_hits_total", tier="ram") == 1
    assert moved(before, after, "edit_rt_store_hits_total", tier="disk") == 0
    assert moved(before, after, "edit_rt_store_misses_total", tier="ram") == 1
    assert moved(before, after, "edit_rt_store_misses_total", tier="disk") == 1
    assert moved(before, after, "edit_rt_bases_generated_total") == 1
    assert moved(before, after, "edit_rt_edits_served_total") == 3


def test_build_info_names_what_runs(server, model_dir):
    from edit_rt.runtime import __version__

    gen = _generate(server.client, seed=6)
    params = Image.open(io.BytesIO(base64.b64decode(gen["data"][0]["b64_json"]))).text["parameters"]
    model_hash = params.split("Model hash: ")[1].split(",")[0]
    samples, _ = scrape(server.client)
    info = [dict(labels) for (name, labels), v in samples.items() if name == "edit_rt_build_info" and v == 1]
    assert len(info) == 1
    assert info[0]["version"] == __version__ and info[0]["backend"] == "ort-cpu" and info[0]["model"] == model_dir.name
    assert info[0]["fingerprint"].startswith(model_hash) and len(info[0]["fingerprint"]) > len(model_hash)


def test_process_cpu_and_rss_are_the_kernels(server):
    """process_resident_memory_bytes against the server's own /proc/<pid>/status; its CPU
    seconds grow while it generates."""
    before, _ = scrape(server.client)
    _generate(server.client, seed=7)
    after, _ = scrape(server.client)
    status = open(f"/proc/{os.getpid()}/status").read()  # the server runs in this process
    rss = int(status.split("VmRSS:")[1].split()[0]) * 1024
    reported = value(after, "process_resident_memory_bytes")
    assert 0.5 * rss < reported < 2 * rss
    assert moved(before, after, "process_cpu_seconds_total") > 0
    assert value(after, "process_start_time_seconds") <= time.time()


def test_an_inversion_is_a_stage_and_its_rows_are_counted(server):
    """POST /v1/bases: one inversion (T rows backwards, T forward corrections), its decode and PNG."""
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    before, _ = scrape(server.client)
    r = server.client.post("/v1/bases", json={"image": base64.b64encode(out.getvalue()).decode(), "source_prompt": "noise"},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    after, _ = scrape(server.client)
    assert stage_count(before, after, "inversion") == 1
    assert moved(before, after, "edit_rt_unet_rows_total") == 2 * T
    assert moved(before, after, "edit_rt_unet_rows_saved_total") == 0  # no edit ran
    assert stage_count(before, after, "png_encode") == 1
    # the inversion's steps are steps like any other
    assert stage_count(before, after, "step") == moved(before, after, "edit_rt_unet_calls_total") > 0


def test_a_base_another_server_stored_is_a_disk_hit_and_a_disk_load(server, tmp_path, model_dir, onnx_dir):
    """A second server (its own service) on the same store folder finds the first one's base on disk: a RAM miss,
    a disk hit, one disk load, and its store_load stage lasting at least the load."""
    gen = _generate(server.client, seed=8)
    folder = server.config.parent / "bases"
    other = InProcessServer(tmp_path, model_dir, onnx_dir, store={"ram_mb": 64, "disk_dir": str(folder), "disk_mb": 256})
    try:
        before, _ = scrape(other.client)
        _edit(other.client, gen["id"], ["a green circle"], tail=2)
        after, _ = scrape(other.client)
    finally:
        assert other.stop()
    assert moved(before, after, "edit_rt_store_hits_total", tier="disk") == 1
    assert moved(before, after, "edit_rt_store_misses_total", tier="ram") == 1
    assert moved(before, after, "edit_rt_store_misses_total", tier="disk") == 0
    assert moved(before, after, "edit_rt_store_disk_loads_total") == 1
    load = moved(before, after, "edit_rt_store_disk_load_seconds_total")
    assert 0 < load <= moved(before, after, "edit_rt_stage_seconds_sum", stage="store_load")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (.ci/run installs Debian's prometheus)")
def test_every_family_passes_promtool(server):
    _generate(server.client, seed=9)
    _, text = scrape(server.client)
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_stage_that_raises_is_not_observed_and_timed_methods_are_observed():
    """The stage timer on its own: a block that raises leaves the histogram as it was."""
    from edit_rt.runtime.metrics import Metrics, timed

    metrics = Metrics()

    class Thing:
        def __init__(self):
            self.metrics = metrics

        @timed("decode")
        def decode(self, fail: bool) -> str:
            if fail:
                raise ValueError("no")
            time.sleep(0.002)
            return "ok"

    thing = Thing()
    assert thing.decode(False) == "ok"
    with pytest.raises(ValueError):
        thing.decode(True)
    samples = {(s.name, s.labels.get("stage")): s.value for family in metrics.registry.collect() for s in family.samples}
    assert samples[("edit_rt_stage_seconds_count", "decode")] == 1
    assert samples[("edit_rt_stage_seconds_sum", "decode")] >= 0.002
    assert samples[("edit_rt_stage_seconds_count", "text_encode")] == 0
