"""`edit-rt serve`'s API: its app in this process over ASGI (in_process_server.py), and a real
server process on loopback where the process matters (a graceful shutdown).

Images are compared with the same edit run alone through the pipeline (`edit-rt run`'s code),
to one grey level: batching with other requests' rows reorders fp32 sums (~1e-5), which can
flip an 8-bit rounding, never more.
"""

from __future__ import annotations

import base64
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from edit_rt.runtime.model.edit import Base, Mask
from edit_rt.runtime.pipeline.edit_pipeline import TailRow
from edit_rt.runtime.pipeline.images import to_uint8

from .in_process_server import InProcessServer
from .server_process import ServerProcess

STEPS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    app = InProcessServer(tmp_path_factory.mktemp("serve"), model_dir, onnx_dir,
                          serve={"max_edits_per_request": 8, "queue_limit": 48, "max_body_bytes": 20_000})  # fmt: skip
    yield app
    app.stop()


def _png(b64: str) -> tuple[np.ndarray, dict]:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    return np.asarray(image, dtype=np.int16), dict(image.text)


def _generate(client: httpx.Client, prompt: str = "a red circle", seed: int = 1, **extra) -> dict:
    r = client.post("/v1/images/generations", json={"prompt": prompt, "negative_prompt": "blurry", "seed": seed, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _expected_edit(pipeline, base: Base, row: TailRow) -> np.ndarray:
    """The same edit through the pipeline (a masked one composited with the base's pixels). A
    row on its base's u runs beside one that computes (a call's only row always computes it)."""
    state = pipeline.generate_base(base)
    rows = [row] if row.uncond == "compute" else [TailRow("a cat", 1.0, row.start_step, row.guidance), row]
    return to_uint8(pipeline.edit(state, rows)[-1].image).astype(np.int16)


def _base(prompt="a red circle", seed=1) -> Base:
    return Base(prompt=prompt, negative_prompt="blurry", seed=seed, steps=STEPS, guidance=7.5, width=32, height=32)


def test_generate_then_edit_matches_the_pipeline(server, pipeline):
    gen = _generate(server.client)
    assert gen["seed"] == 1 and gen["parameters"]["steps"] == STEPS and len(gen["id"]) == 24
    image, text = _png(gen["data"][0]["b64_json"])
    base = _base()
    expected = to_uint8(pipeline.decode(pipeline.generate_base(base).final_latent)[0]).astype(np.int16)
    assert np.abs(image - expected).max() <= 1
    assert text["parameters"].startswith("a red circle\nNegative prompt: blurry\nSteps: 6, Sampler: DDIM")

    edits = [
        {"prompt": "a blue square", "strength": 1.0, "tail_steps": 3},
        {"prompt": "a green circle", "strength": 0.5, "tail_steps": 5, "cfg_scale": 4.0},
        {"prompt": "a yellow circle", "tail_steps": 4, "mask": {"x": 0, "y": 0, "width": 16, "height": 16}},
        {"prompt": "a red circle", "tail_steps": 2, "seed": 3},
        {"prompt": "a blue circle", "tail_steps": 4, "structure": 0.5},
        {"prompt": "a red square", "tail_steps": 4, "uncond": "base-corrected"},  # the base's u (tail.uncond)
    ]
    r = server.client.post("/v1/images/edits", json={"base_id": gen["id"], "edits": edits}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["base_id"] == gen["id"] and [d["index"] for d in body["data"]] == [0, 1, 2, 3, 4, 5]
    rows = [
        TailRow("a blue square", 1.0, STEPS - 3, 7.5),
        TailRow("a green circle", 0.5, STEPS - 5, 4.0),
        TailRow("a yellow circle", 1.0, STEPS - 4, 7.5, mask=Mask(0, 0, 16, 16)),
        TailRow("a red circle", 1.0, STEPS - 2, 7.5, seed=3),
        TailRow("a blue circle", 1.0, STEPS - 4, 7.5, structure=0.5),
        TailRow("a red square", 1.0, STEPS - 4, 7.5, uncond="base-corrected"),
    ]
    assert [d["info"]["uncond"] for d in body["data"]] == ["compute"] * 5 + ["base-corrected"]
    for d, row in zip(body["data"], rows):
        got, text = _png(d["b64_json"])
        assert np.abs(got - _expected_edit(pipeline, base, row)).max() <= 1
        assert f"Tail steps: {STEPS - row.start_step}" in text["parameters"]
        assert ("Structure: 0.5" in text["parameters"]) == (row.structure == 0.5)
        assert ("Tail uncond: base-corrected" in text["parameters"]) == (row.uncond == "base-corrected")


def test_deepcache_edits_match_the_pipeline(server, pipeline):
    """Two edits with ``deepcache: 2`` (every other tail step shallow) share the server's calls
    as they share the pipeline's; their PNGs say so."""
    gen = _generate(server.client, seed=5)
    edits = [{"prompt": "a blue square", "tail_steps": 4, "deepcache": 2}, {"prompt": "a green circle", "tail_steps": 4, "deepcache": 2}]
    r = server.client.post("/v1/images/edits", json={"base_id": gen["id"], "edits": edits}, timeout=120)
    assert r.status_code == 200, r.text
    rows = [TailRow(e["prompt"], 1.0, STEPS - 4, 7.5, deepcache=2) for e in edits]
    expected = pipeline.edit(pipeline.generate_base(_base(seed=5)), rows)
    for d, want in zip(r.json()["data"], expected):
        got, text = _png(d["b64_json"])
        assert np.abs(got - to_uint8(want.image).astype(np.int16)).max() <= 1
        assert "Tail deepcache: 2" in text["parameters"]


def test_stream_sends_queue_progress_images_then_done(server):
    gen = _generate(server.client, seed=2)
    edits = [{"prompt": "a blue square", "tail_steps": 3}, {"prompt": "a green square", "tail_steps": 2}]
    events = []
    with server.client.stream("POST", "/v1/images/edits", json={"base_id": gen["id"], "edits": edits, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for block in r.read().decode().split("\n\n"):
            if block.strip():
                kind, data = block.split("\n", 1)
                events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    kinds = [k for k, _ in events]
    assert kinds[0] == "edit_rt.queue" and kinds[-1] == "edit_rt.done"
    assert kinds.count("image_edit.completed") == 2
    assert all(d["type"] == k for k, d in events)  # the data name the event too (the OpenAI SDK reads "type")
    assert {"type": "edit_rt.progress", "index": 0, "step": 3, "of": 3} in [d for k, d in events if k == "edit_rt.progress"]
    assert sorted(d["index"] for k, d in events if k == "image_edit.completed") == [0, 1]


def test_base_metadata_and_delete(server):
    gen = _generate(server.client, seed=4)
    info = server.client.get(f"/v1/bases/{gen['id']}").json()
    assert info["tier"] == "ram" and info["base"]["seed"] == 4 and info["base"]["steps"] == STEPS
    assert server.client.delete(f"/v1/bases/{gen['id']}").json() == {"id": gen["id"], "deleted": True}
    r = server.client.get(f"/v1/bases/{gen['id']}")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = server.client.post("/v1/images/edits", json={"base_id": gen["id"], "edits": [{"prompt": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "base_id"


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/images/edits", {"base_id": "b", "edits": [{"prompt": "x"}, {"prompt": "y", "strength": 5}]}, 400, "edits[1].strength"),
        ("/v1/images/edits", {"base_id": "b", "edits": [{"prompt": "x", "colour": 1}]}, 400, "edits[0].colour"),
        ("/v1/images/edits", {"base_id": "b", "edits": []}, 400, "edits"),
        ("/v1/images/edits", {"base_id": "b", "edits": [{"prompt": "x", "structure": 1.5}]}, 400, "edits[0].structure"),
        ("/v1/images/edits", {"base_id": "b", "edits": [{"prompt": "x", "uncond": "reuse"}]}, 400, "edits[0].uncond"),
        ("/v1/images/edits", {"base_id": "b", "edits": [{"prompt": "x", "deepcache": 0}]}, 400, "edits[0].deepcache"),
        ("/v1/images/edits", {"edits": [{"prompt": "x"}]}, 400, "base_id"),
        ("/v1/images/edits", {"base_id": "b", "edits": [{"prompt": "x"}] * 9}, 413, "edits"),
        ("/v1/images/generations", {"prompt": ""}, 400, "prompt"),
        ("/v1/images/generations", {"prompt": "x", "size": "64x64"}, 400, "size"),
        ("/v1/images/generations", {"prompt": "x", "steps": 1000}, 400, "steps"),
        ("/v1/images/generations", {"prompt": "x" * 600}, 400, "prompt"),
        ("/v1/images/generations", {"prompt": "x", "seed": "one"}, 400, "seed"),
        ("/v1/images/generations", {"prompt": "x", "clip_skip": 5}, 400, "clip_skip"),  # the tiny model has 2 layers
        ("/v1/images/generations", {"prompt": "x", "original_width": 64}, 400, "original_width"),  # SDXL only
    ],
)
def test_errors_have_one_shape_and_a_json_path(server, path, body, status, param):
    r = server.client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["message"]


def test_out_of_range_tail_and_mask_name_the_edit(server):
    gen = _generate(server.client, seed=5)
    r = server.client.post("/v1/images/edits", json={"base_id": gen["id"], "edits": [{"prompt": "x", "tail_steps": 2}, {"prompt": "y", "tail_steps": 7}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "edits[1].tail_steps"
    r = server.client.post("/v1/images/edits", json={"base_id": gen["id"], "edits": [{"prompt": "x", "mask": {"x": 30, "y": 0, "width": 8, "height": 8}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "edits[0].mask"


# One edit schema at both doors: (edit, the field a refusal names or None, words both doors use)
BOTH_DOORS = [
    ({"prompt": "x", "strength": -1.5}, None, ""),  # "less of it": a negative strength is an edit everywhere
    ({"prompt": "x", "cfg_scale": 3.0}, None, ""),
    ({"prompt": "x", "guidance": 3.0, "tail_steps": 6}, None, ""),
    ({"prompt": "x", "strength": 5}, "edits[0].strength", "must lie in [-4, 4]"),
    ({"prompt": "x", "tail_steps": 0}, "edits[0].tail_steps", "must lie in [1, 1000]"),
    ({"prompt": "x", "start_step": -1}, "edits[0].start_step", "must lie in [0, 999]"),
    ({"prompt": "x", "tail_steps": 7}, "edits[0].tail_steps", "tail_steps in [1, 6]"),
    ({"prompt": "x", "start_step": 2, "tail_steps": 2}, "edits[0]", "not both"),
    ({"prompt": "x", "mask": {"x": 30, "y": 0, "width": 8, "height": 8}}, "edits[0].mask", "leaves the 32x32 image"),
    ({"prompt": "x", "mask": {"x": 0, "y": 0, "width": 0, "height": 8}}, "edits[0].mask.width", "must be > 0"),
    ({"prompt": "x", "structure": 1.5}, "edits[0].structure", "must lie in [0, 1]"),
    ({"prompt": "x", "preserve": "maybe"}, "edits[0].preserve", "must be one of 'auto' | 'none'"),
    ({"prompt": "   "}, "edits[0].prompt", "must not be empty"),
    ({"prompt": "x", "strenght": 1.0}, "edits[0].strenght", "unknown"),
]


@pytest.mark.parametrize("edit,field,words", BOTH_DOORS)
def test_config_and_api_accept_and_refuse_the_same_edits(server, model_dir, onnx_dir, tmp_path, edit, field, words):
    from edit_rt.runtime.config.load import config_from_dict
    from edit_rt.runtime.errors import ConfigError

    config = {"model": str(model_dir), "build_dir": str(onnx_dir.parent.parent),
              "base": {"prompt": "a red circle", "negative_prompt": "blurry", "seed": 1, "steps": STEPS, "width": 32,
                       "height": 32}, "edits": [edit]}  # fmt: skip
    try:
        config_from_dict(config, tmp_path / "config.yaml")
        config_refusal = None
    except ConfigError as err:
        config_refusal = str(err)
    gen = _generate(server.client, seed=1)
    r = server.client.post("/v1/images/edits", json={"base_id": gen["id"], "edits": [edit]}, timeout=120)
    if field is None:
        assert config_refusal is None and r.status_code == 200, (config_refusal, r.text)
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and words in error["message"], error
    assert config_refusal is not None and f"{field}: " in config_refusal and words in config_refusal, config_refusal


def test_bad_json_and_oversized_body(server):
    r = server.client.post("/v1/images/generations", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"
    r = server.client.post("/v1/images/generations", json={"prompt": "x", "negative_prompt": "y" * 30_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_full_queue_answers_429_with_retry_after(tmp_path, model_dir, onnx_dir):
    proc = InProcessServer(tmp_path, model_dir, onnx_dir, serve={"queue_limit": 3, "max_edits_per_request": 8})
    try:
        gen = _generate(proc.client, seed=6)
        r = proc.client.post("/v1/images/edits", json={"base_id": gen["id"], "edits": [{"prompt": "x"}] * 4})
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        assert proc.stop()


def test_bearer_token(tmp_path, model_dir, onnx_dir):
    proc = InProcessServer(tmp_path, model_dir, onnx_dir, env={"EDIT_RT_TOKEN": "s3cret"})
    try:
        assert proc.client.get("/health").status_code == 200  # health stays open for probes
        r = proc.client.post("/v1/images/generations", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert proc.client.get("/metrics").status_code == 401
        wrong = proc.client.post("/v1/images/generations", json={"prompt": "x"}, headers={"Authorization": "Bearer s3cre"})
        assert wrong.status_code == 401  # a bearer token is compared, not only present
        ok = proc.client.post("/v1/images/generations", json={"prompt": "x"}, headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert ok.status_code == 200
    finally:
        proc.stop()


def test_not_ready_answers_503_and_health_says_why(tmp_path, model_dir, onnx_dir):
    proc = InProcessServer(tmp_path, tmp_path / "no-model", onnx_dir, wait=False)
    try:
        for _ in range(100):
            health = proc.client.get("/health")
            if health.json()["status"] == "failed":
                break
            threading.Event().wait(0.2)
        assert health.status_code == 503 and "does not exist" in health.json()["error"]
        r = proc.client.post("/v1/images/generations", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
    finally:
        proc.stop()


def test_openapi_schema_and_page(server):
    schema = server.client.get("/openapi.json").json()
    assert {"/v1/images/generations", "/v1/images/edits", "/v1/bases/{bid}", "/v1/adapters"} <= set(schema["paths"])
    page = server.client.get("/")
    assert page.status_code == 200 and "edit-rt" in page.text and "/v1/images/edits" in page.text
    # an export without adapter slots lists none, at each door
    assert server.client.get("/v1/adapters").json() == {"data": [], "slots": 0}
    assert server.client.get("/sdapi/v1/loras").json() == []
    # a picture model is no planner: POST /v1/plans says so, naming the fix
    r = server.client.post("/v1/plans", json={"scene": {"ego_speed": 10.0, "lead_gap": 20.0}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_a_planner" and "plan:" in r.text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
edit_like = st.fixed_dictionaries({"prompt": st.text(max_size=30)}, optional={
    "strength": json_values | st.floats(-1, 3), "tail_steps": json_values | st.integers(-1, 8),
    "mask": json_values | st.fixed_dictionaries({k: st.integers(-4, 40) for k in ("x", "y", "width", "height")}),
    "seed": json_values, "cfg_scale": json_values, "extra": json_values})  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/images/generations", "/v1/images/edits"]),
    body=json_values | st.fixed_dictionaries({"base_id": st.text(max_size=30) | json_values, "edits": st.lists(edit_like, max_size=3) | json_values})
    | st.fixed_dictionaries({"prompt": st.text(max_size=30) | json_values}, optional={"steps": json_values, "seed": json_values, "size": json_values, "cfg_scale": json_values}),
)  # fmt: skip
def test_fuzzed_bodies_never_get_a_5xx(server, path, body):
    r = server.client.post(path, json=body, timeout=120)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_server_still_serves_after_the_fuzz(server):
    assert server.client.get("/health").json()["status"] == "ready"


def concurrent_single_edits(http: httpx.Client, pipeline, bases: list[Base], ids: list[str], clients: int = 32) -> None:
    """``clients`` single-edit requests at once over the stored ``bases`` (``ids``), each
    answered 200 with the image of the same edit run alone through the pipeline."""
    jobs = [(k % len(bases), {"prompt": f"edit {k}", "strength": 0.5 + (k % 3) * 0.5, "tail_steps": 2 + k % 4}) for k in range(clients)]

    def client(job):
        b, edit = job
        r = http.post("/v1/images/edits", json={"base_id": ids[b], "edits": [edit]}, timeout=300)
        return b, edit, r

    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client, jobs))
    assert all(r.status_code == 200 for _, _, r in results), [r.text for _, _, r in results if r.status_code != 200][:2]
    states = [pipeline.generate_base(base) for base in bases]
    for b, edit, r in results:
        row = TailRow(edit["prompt"], edit["strength"], STEPS - edit["tail_steps"], 7.5)
        alone = to_uint8(pipeline.decode(pipeline.run_tail(states[b], [row]))[0]).astype(np.int16)
        got, _ = _png(r.json()["data"][0]["b64_json"])
        assert np.abs(got - alone).max() <= 1


def test_32_concurrent_clients_share_batches_and_get_their_own_images(server, pipeline):
    bases = [_base(prompt=p, seed=10 + k) for k, p in enumerate(["a red circle", "a blue square", "a green triangle", "a cat"])]
    ids = [_generate(server.client, prompt=b.prompt, seed=b.seed)["id"] for b in bases]
    before = _batch_rows(server)
    concurrent_single_edits(server.client, pipeline, bases, ids)
    after = _batch_rows(server)
    shared = sum(after.get(k, 0) - before.get(k, 0) for k in after if k > 1)
    assert shared > 0, after  # single-edit requests met in multi-row calls


def _batch_rows(server) -> dict[float, int]:
    """Calls per batch-size bucket, from the Prometheus histogram (cumulative -> per bucket)."""
    from prometheus_client.parser import text_string_to_metric_families

    cumulative = {}
    for family in text_string_to_metric_families(server.client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "edit_rt_batch_rows_bucket":
                cumulative[float(sample.labels["le"])] = int(sample.value)
    counts, previous = {}, 0
    for le in sorted(cumulative):
        counts[le] = cumulative[le] - previous
        previous = cumulative[le]
    return counts


def test_metrics_are_prometheus_text(server):
    text = server.client.get("/metrics").text
    for name in ("edit_rt_queue_rows", "edit_rt_active_rows", "edit_rt_batch_rows_bucket", "edit_rt_step_seconds_bucket",
                 'edit_rt_store_hits_total{tier="ram"}', "edit_rt_edits_served_total", 'edit_rt_store_evictions_total{tier="ram"}'):  # fmt: skip
        assert name in text


def client_that_disconnects_leaves_the_server_serving(url: str) -> None:
    """A stream's client hangs up after its first event: the next request is served and the base
    is unpinned. Needs a socket to hang up on (in-process, the answer is read whole)."""
    gen = _generate(httpx.Client(base_url=url), seed=7)
    with httpx.stream("POST", url + "/v1/images/edits",
                      json={"base_id": gen["id"], "edits": [{"prompt": "x", "tail_steps": 6}] * 8, "stream": True}, timeout=60) as r:  # fmt: skip
        next(r.iter_lines())  # the queue event, then hang up
    r = httpx.post(url + "/v1/images/edits", json={"base_id": gen["id"], "edits": [{"prompt": "y", "tail_steps": 1}]}, timeout=60)
    assert r.status_code == 200
    assert httpx.get(f"{url}/v1/bases/{gen['id']}").json()["pinned"] is False


@pytest.mark.slow  # a real process; the default run keeps test_pins.py's hang-ups on a real server (and test_ray's)
def test_client_that_disconnects_leaves_the_server_serving(tmp_path, model_dir, onnx_dir):
    proc = ServerProcess(tmp_path, model_dir, onnx_dir)
    try:
        client_that_disconnects_leaves_the_server_serving(proc.url)
    finally:
        assert proc.stop()


def test_graceful_shutdown_finishes_in_flight_requests(tmp_path, model_dir, onnx_dir):
    proc = ServerProcess(tmp_path, model_dir, onnx_dir, base={"prompt": "x", "steps": 30, "width": 32, "height": 32})
    gen = _generate(proc.client, seed=8)
    result = {}

    def slow_edit():
        result["r"] = httpx.post(proc.url + "/v1/images/edits",
                                 json={"base_id": gen["id"], "edits": [{"prompt": "y", "tail_steps": 30}] * 4}, timeout=120)  # fmt: skip

    t = threading.Thread(target=slow_edit)
    t.start()
    threading.Event().wait(1.0)
    assert proc.stop()
    t.join(60)
    assert result["r"].status_code == 200 and len(result["r"].json()["data"]) == 4
