"""`edit-rt serve --ray`: the same API on real Ray Serve (a local Ray instance, loopback only),
2 worker replicas of 1 thread each, sharing the store's disk tier.

The server tests' and the client libraries' core cases run again here unchanged, against the
Ray deployment (they are imported below, and pytest gives them this module's ``server``). Then
what is Ray's own: 32 concurrent clients over 8 bases (every image equals the same edit run
alone through the pipeline; the share served by their base's owner, from the replicas'
metrics), a replica killed mid-load, and two replicas writing the same base at once.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install -e '.[ray]')")

from ray import serve  # noqa: E402

from edit_rt.runtime.config.load import load_config  # noqa: E402
from edit_rt.runtime.model.edit import Base  # noqa: E402
from edit_rt.runtime.scale import ray_serve  # noqa: E402

from .server_process import free_port  # noqa: E402
from .test_clients import (  # noqa: E402,F401  the client libraries' core cases, through Ray
    test_metrics_parse_and_pass_promtool,
    test_openai_sdk_errors_are_its_own_types,
    test_openai_sdk_generate_with_its_fields_and_models,
    test_webuiapi_txt2img_img2img_and_png_info,
)
from .test_server import (  # noqa: E402,F401  the API's core cases, through Ray
    STEPS,
    concurrent_single_edits,
    test_base_metadata_and_delete,
    test_bad_json_and_oversized_body,
    client_that_disconnects_leaves_the_server_serving,
    test_errors_have_one_shape_and_a_json_path,
    test_generate_then_edit_matches_the_pipeline,
    test_out_of_range_tail_and_mask_name_the_edit,
    test_stream_sends_queue_progress_images_then_done,
)

REPLICAS = 2


@dataclass
class RayServer:
    url: str
    port: int
    store: Path
    client: httpx.Client  # what the imported server tests call: here over the ingress's socket


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    import yaml

    # Ray's own start first, the session's model and export after it: under `make test` this is
    # the second worker's first module, and the first worker builds them meanwhile (built_once),
    # so the seconds Ray takes to start are not spent waiting for that build
    ray.init(num_cpus=REPLICAS, include_dashboard=False, log_to_driver=False)
    try:
        model_dir, onnx_dir = request.getfixturevalue("model_dir"), request.getfixturevalue("onnx_dir")
    except BaseException:
        ray.shutdown()
        raise
    tmp = tmp_path_factory.mktemp("ray")
    port = free_port()
    config = {
        "model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "threads": 1,
        "base": {"prompt": "x", "steps": STEPS, "guidance": 7.5, "width": 32, "height": 32},
        "engines": {"min_batch": 1, "opt_batch": 8, "max_batch": 16},
        "store": {"ram_mb": 64, "disk_dir": str(tmp / "bases"), "disk_mb": 256},
        "serve": {"port": port, "max_edits_per_request": 8, "queue_limit": 48, "max_body_bytes": 20_000,
                  "ray": {"replicas": REPLICAS, "cpus_per_replica": 1}},
    }  # fmt: skip
    (tmp / "serve.yaml").write_text(yaml.safe_dump(config))
    try:
        ray_serve.start(load_config(tmp / "serve.yaml"))
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the Ray deployment did not become ready after 240 polls")
        with httpx.Client(base_url=url) as client:
            yield RayServer(url, port, tmp / "bases", client)
    finally:
        serve.shutdown()
        ray.shutdown()


def _metric(server, name: str, every_replica: bool = False) -> dict[tuple, float]:
    """One metric family's samples from the ingress's /metrics, by (replica, label values);
    ``every_replica``: scraped again (up to 20 times) until each replica's samples are in it (a
    scrape leaves out a replica that did not answer in time, as on a loaded machine)."""
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(20):
        out, replicas = {}, set()
        for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text):
            for s in family.samples:
                replicas.add(s.labels.get("replica"))
                if s.name == name:
                    out[tuple(sorted(s.labels.items()))] = s.value
        if not every_replica or len(replicas - {None}) == REPLICAS:
            return out
        time.sleep(0.5)
    raise AssertionError(f"{name}: not every replica in 20 scrapes of /metrics")


def _owner_share(before: dict, after: dict) -> tuple[float, float]:
    """(edits whose base was in the serving replica's RAM, all edits) between two scrapes."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    total = sum(delta.values())
    ram = sum(v for k, v in delta.items() if ("base_tier", "ram") in k)
    return ram, total


def _statuses() -> list[dict]:
    handle = serve.get_deployment_handle(ray_serve.WORKER, app_name=ray_serve.APP_NAME)
    found = {}
    for k in range(REPLICAS):
        status = handle.status.remote(route={"replica": k}).result(timeout_s=60)
        found[status["replica"]] = status
    return list(found.values())


def test_every_replica_reports_with_its_label(server):
    replicas = {s["replica"] for s in _statuses()}
    assert len(replicas) == REPLICAS
    ready = _metric(server, "edit_rt_ready")  # the ingress's own, and each replica's
    assert ready == {(): 1.0, **{(("replica", r),): 1.0 for r in replicas}}
    stored = _metric(server, "edit_rt_store_budget_bytes")
    assert {dict(k)["replica"] for k in stored} == replicas  # every replica's, labelled


def test_a1111_progress_and_interrupt_reach_every_replica(server):
    """webuiapi's wait and interrupt through the ingress: idle is 0 jobs; a running job is
    seen, with its steps, and an interrupt stops it on the replica that runs it."""
    from concurrent.futures import ThreadPoolExecutor

    idle = httpx.get(server.url + "/sdapi/v1/progress", timeout=30).json()
    assert idle["progress"] == 0.0 and idle["state"]["job_count"] == 0, idle
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, server.url + "/sdapi/v1/txt2img", json={"prompt": "a long one", "steps": 150},
                              timeout=300)  # fmt: skip
        seen = None
        for _ in range(200):
            seen = httpx.get(server.url + "/sdapi/v1/progress", timeout=30).json()
            if seen["state"]["job_count"] and seen["state"]["sampling_steps"]:
                break
            time.sleep(0.05)
        assert seen["state"]["job_count"] >= 1 and seen["state"]["sampling_steps"] == 150, seen
        stopped = httpx.post(server.url + "/sdapi/v1/interrupt", timeout=30).json()
        assert stopped["interrupted"] >= 1, stopped
        answer = running.result()
    assert answer.status_code in (200, 409), answer.text  # its finished images, or none finished
    assert httpx.get(server.url + "/sdapi/v1/progress", timeout=30).json()["state"]["job_count"] == 0


def test_an_a1111_interrupt_through_the_ingress_leaves_another_doors_work(server):
    """The workers know each request's door: the ingress's A1111 /progress does not count an
    OpenAI-door generation and its interrupt does not stop it, as in one process."""
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(httpx.post, server.url + "/v1/images/generations", timeout=300,
                            json={"prompt": "another door", "size": "32x32", "steps": 150, "seed": 3})  # fmt: skip
        deadline = time.monotonic() + 60
        while not any(s["active"] for s in _statuses()) and time.monotonic() < deadline:
            time.sleep(0.02)
        seen = httpx.get(server.url + "/sdapi/v1/progress", timeout=30).json()
        stopped = httpx.post(server.url + "/sdapi/v1/interrupt", timeout=30).json()
        answer = other.result()
    assert answer.status_code == 200, answer.text
    assert seen["state"]["job_count"] == 0 and stopped["interrupted"] == 0, (seen, stopped)


def test_32_clients_over_8_bases_get_their_own_images_from_their_bases_owner(server, pipeline):
    bases = [Base(prompt=f"a red circle {k}", negative_prompt="blurry", seed=20 + k, steps=STEPS, guidance=7.5,
                  width=32, height=32) for k in range(8)]  # fmt: skip
    ids = []
    for b in bases:
        r = httpx.post(server.url + "/v1/images/generations", json={"prompt": b.prompt, "negative_prompt": "blurry",
                                                                     "seed": b.seed}, timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    before = _metric(server, "edit_rt_edit_requests_total", every_replica=True)
    concurrent_single_edits(server.client, pipeline, bases, ids)
    ram, total = _owner_share(before, _metric(server, "edit_rt_edit_requests_total", every_replica=True))
    assert total == 32 and ram / total >= 0.95, (ram, total)


def test_client_that_disconnects_leaves_the_ingress_serving(server):
    client_that_disconnects_leaves_the_server_serving(server.url)


def test_two_replicas_writing_the_same_base_leave_one_valid_file(server):
    from edit_rt.runtime.storage.store import BaseStore

    handle = serve.get_deployment_handle(ray_serve.WORKER, app_name=ray_serve.APP_NAME)
    base = Base(prompt="the same base twice", negative_prompt="blurry", seed=99, steps=STEPS, guidance=7.5, width=32, height=32)
    calls = [handle.generate.remote(base, route={"replica": k}) for k in range(REPLICAS)]
    made = [c.result(timeout_s=120) for c in calls]
    assert len({m.id for m in made}) == 1 and {m.png for m in made} == {made[0].png}
    files = sorted(p.name for p in (server.store / "bases").iterdir())
    assert files.count(f"{made[0].id}.safetensors") == 1
    assert not [f for f in files if not f.endswith(".safetensors")], files  # no temporary left behind
    fingerprint = httpx.get(server.url + "/sdapi/v1/sd-models", timeout=30).json()[0]["sha256"]
    state = BaseStore(fingerprint, 1 << 26, server.store, 1 << 28).get(made[0].id)  # verified as it loads
    assert state.base == base


@pytest.mark.slow  # ~10-20 s; the default run keeps the Ray 32-client and A1111 tests
def test_a_killed_replica_loses_no_acknowledged_base_and_is_replaced(server):
    ids = []
    for k in range(6):
        r = httpx.post(server.url + "/v1/images/generations", json={"prompt": f"kill {k}", "seed": k}, timeout=120)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])  # acknowledged: in the shared tier
    def client(k):
        edit = {"prompt": f"edit {k}", "tail_steps": 4}
        return httpx.post(server.url + "/v1/images/edits", json={"base_id": ids[k % 6], "edits": [edit]}, timeout=300)

    resent = _metric(server, "edit_rt_replica_lost_resent_total").get((), 0.0)
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(client, k) for k in range(24)]
        deadline = time.monotonic() + 30
        while True:  # the one with rows in flight (a fixed wait raced the tails on a busy machine)
            victim = max(_statuses(), key=lambda s: s["active"] + s["queued"])
            if victim["active"] + victim["queued"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        os.kill(victim["pid"], signal.SIGKILL)
        results = [f.result() for f in futures]
    # the ingress sent the victim's requests again, once, to the live replica (they are idempotent)
    assert _metric(server, "edit_rt_replica_lost_resent_total")[()] > resent
    refused = [r for r in results if r.status_code != 200]
    for r in refused:  # if that one died too: a clear 503 that says to retry
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "replica_lost" and r.headers["retry-after"] == "1"
    for k in range(len(refused)):  # and the retry succeeds
        assert client(k).status_code == 200
    for bid in ids:  # every acknowledged base is still served
        r = httpx.post(server.url + "/v1/images/edits", json={"base_id": bid, "edits": [{"prompt": "after", "tail_steps": 2}]},
                       timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
    for _ in range(120):  # Ray Serve starts a replacement
        try:
            replicas = {s["replica"] for s in _statuses()}
        except Exception:
            replicas = set()
        if len(replicas) == REPLICAS and victim["replica"] not in replicas:
            break
        time.sleep(1)
    else:
        pytest.fail(f"no replacement replica after 120 polls: {replicas}")
