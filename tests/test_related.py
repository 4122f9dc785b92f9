"""Related generations (issue 28) against the served app (in this process, over ASGI) and the store:

- a request served related equals the same edit tail requested explicitly (POST /v1/images/edits
  on the related base, its prompt at strength 1 from the skipped step), and says so in its
  reply, its header and its PNG's parameters; its result is a base of its own;
- a request with its own seed is exact unless it asks; ``related: false`` is exact;
- the index follows the store: eviction from the disk tier, deletion, a restart (a fresh index
  on the folder), another replica's bases;
- bad thresholds are refused naming the field; ``n`` > 1 with ``related: true`` is refused.
"""

from __future__ import annotations

import base64
import dataclasses
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from edit_rt.runtime.config.load import config_from_dict
from edit_rt.runtime.errors import ConfigError
from edit_rt.runtime.pipeline.pnginfo import parse_fields
from edit_rt.runtime.storage.related_index import RelatedIndex
from edit_rt.runtime.storage.store import BaseStore, base_id

from .in_process_server import InProcessServer
from .test_store import BASE_BYTES, FP, UNCOND_BYTES, fake_state

A = "a red circle on a blue background"
B = "a green circle on a blue background"
STEPS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    # every prompt of the tiny random model is "related" at the first threshold: the policy
    # itself (which similarity buys which step) is measured on the shapes world, docs/related.md;
    # bases shared, so replies name the base they came from (not by default: test_door_answers.py)
    related = {"enabled": True, "thresholds": [{"similarity": 0.01, "skip": 0.5}], "share_bases": True}
    proc = InProcessServer(tmp_path_factory.mktemp("related"), model_dir, onnx_dir, serve={"related": related})
    yield proc
    assert proc.stop()


def _generate(server, prompt: str, **fields) -> httpx.Response:
    r = server.client.post("/v1/images/generations", json={"prompt": prompt, "size": "32x32", **fields}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _image(reply: dict, k: int = 0) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(reply["data"][k]["b64_json"])))


def test_a_related_generation_equals_the_explicit_edit_tail_and_says_so(server):
    first = _generate(server, A, seed=5, related=False).json()
    assert first["info"]["related"] == [None]
    r = _generate(server, B, related=True)
    reply = r.json()
    (related,) = reply["info"]["related"]
    assert related["base_id"] == first["id"] and related["skipped_steps"] == STEPS // 2
    assert 0 < related["similarity"] <= 1
    assert r.headers["X-Edit-RT-Related"].startswith(f"base={first['id']}; skipped={STEPS // 2};")
    image = _image(reply)
    fields = parse_fields(image.text["parameters"].splitlines()[-1])
    assert fields["Related base"] == first["id"] and fields["Skipped steps"] == str(STEPS // 2)
    assert reply["seed"] == 5  # its noise is its related base's
    # the same tail, asked for as an edit of the related base
    edit = server.client.post("/v1/images/edits", json={"base_id": first["id"], "edits": [
        {"prompt": B, "strength": 1.0, "start_step": STEPS // 2}]}, timeout=120)  # fmt: skip
    assert edit.status_code == 200, edit.text
    ours = np.asarray(image.convert("RGB"), np.int16)
    explicit = np.asarray(_image(edit.json()).convert("RGB"), np.int16)
    # the related row takes B's K/V as encoded, the edit B's mixed onto A's by aligned tokens
    # (the same values permuted): fp32 rounding, at most one level of a PNG
    assert np.abs(ours - explicit).max() <= 1
    assert (ours != np.asarray(_image(first).convert("RGB"), np.int16)).any()  # B, not A (the latents: below)
    # it is a base of its own: editable, and not the exact generation's key
    assert reply["id"] != first["id"]
    again = server.client.post("/v1/images/edits", json={"base_id": reply["id"], "edits": [{"prompt": A}]}, timeout=120)
    assert again.status_code == 200, again.text


def test_a_request_with_its_own_seed_is_exact_unless_it_asks(server):
    _generate(server, A, seed=11, related=False)
    seeded = _generate(server, B, seed=12).json()
    assert seeded["info"]["related"] == [None] and seeded["seed"] == 12
    exact = _generate(server, B, seed=12, related=False).json()
    assert seeded["id"] == exact["id"]
    assert _image(seeded).tobytes() == _image(exact).tobytes()
    asked = _generate(server, B, seed=12, related=True).json()
    assert asked["info"]["related"][0] is not None and asked["id"] != exact["id"]


def test_metrics_count_hits_misses_and_steps_saved(server):
    _generate(server, A, related=True)  # a hit: bases are stored by now
    text = server.client.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("edit_rt_related")}
    assert values["edit_rt_related_hits_total"] >= 2
    assert values["edit_rt_related_steps_saved_total"] == STEPS // 2 * values["edit_rt_related_hits_total"]
    assert "edit_rt_related_misses_total" in values


def test_the_a1111_door_serves_one_unseeded_image_related_and_its_png_says_so(server):
    import json

    _generate(server, A, seed=31, related=False)
    body = {"prompt": B, "seed": -1, "width": 32, "height": 32, "steps": STEPS}
    reply = server.client.post("/sdapi/v1/txt2img", json=body, timeout=120).json()
    info = json.loads(reply["info"])
    assert info["related"][0] is not None and info["related"][0]["skipped_steps"] == STEPS // 2
    image = Image.open(io.BytesIO(base64.b64decode(reply["images"][0])))
    assert parse_fields(image.text["parameters"].splitlines()[-1])["Related base"] == info["related"][0]["base_id"]
    seeded = json.loads(server.client.post("/sdapi/v1/txt2img", json={**body, "seed": 33}, timeout=120).json()["info"])
    assert seeded["related"] == [None]


def test_n_images_with_related_true_is_refused_naming_the_field(server):
    r = server.client.post("/v1/images/generations", json={"prompt": A, "n": 2, "related": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "related"


def test_a_related_row_is_the_explicit_tail_and_its_record_a_base_of_its_own(pipeline, base_state):
    """In the loop: the related job's latent equals run_tail's of the same prompt from the same
    step, and the state it records (window k) reproduces itself under an identity edit."""
    from edit_rt.runtime.loop.jobs import Job, Request
    from edit_rt.runtime.model.edit import TailRow

    k, g = 4, base_state.base.guidance
    base = dataclasses.replace(base_state.base, prompt=B, related="x@4")
    request = Request("related", decode=False)
    (result,) = pipeline.batcher(base_state.latents.shape[1:]).run(
        request, [Job(request, 0, base, TailRow(B, 1.0, k, g), state=base_state, kind="related")])
    (explicit,) = pipeline.run_tail(base_state, [TailRow(B, 1.0, k, g)])
    # rtol too: the tiny model's latents reach ~40, where float32's rounding of two batchings is 4e-6 an ulp
    np.testing.assert_allclose(result.latent, explicit, rtol=1e-6, atol=1e-5)
    assert np.abs(result.latent - base_state.final_latent[0]).max() > 1e-2  # B's, not A's
    state = result.state
    assert state.window_start == k and state.base == base and len(state.latents) == base.steps - k + 1
    np.testing.assert_array_equal(state.latents[0], base_state.latent(k)[0])
    for final in pipeline.run_tail(state, [TailRow(B, 1.0, k, g), TailRow(A, 0.0, base.steps - 2, g)]):
        np.testing.assert_allclose(final, result.latent, atol=1e-5)


def _vector(k: int, d: int = 8) -> np.ndarray:
    v = np.random.default_rng(k).standard_normal(d).astype(np.float32)
    return v / np.linalg.norm(v)


def test_the_index_follows_the_store_across_eviction_deletion_and_restart(tmp_path):
    folder = tmp_path / "bases"
    store = BaseStore(FP, ram_bytes=BASE_BYTES, disk_dir=folder, disk_bytes=3 * BASE_BYTES + BASE_BYTES // 2)
    index = RelatedIndex(folder)
    states = [fake_state(i) for i in range(5)]
    bids = []
    for k, state in enumerate(states):
        bids.append(store.put(state))
        index.add(bids[-1], state.base, _vector(k), 0)
    held = [bid for bid in bids if bid in store]
    assert 0 < len(held) < len(bids)  # the disk budget evicted the oldest
    base = states[0].base
    # the nearest to an evicted base's own vector is a held one (the evicted entry is gone)
    for k, bid in enumerate(bids):
        found = index.nearest(base, _vector(k), store.__contains__)
        assert found is not None and found[0] in held
        if bid in held:
            assert found[0] == bid and found[1] == pytest.approx(1.0, abs=1e-6)
    # a restart, or another replica on the folder: the same entries, read back
    again = RelatedIndex(folder)
    assert sorted(b for b in bids if b in again) == sorted(held)
    store.delete(held[-1])
    assert index.nearest(base, _vector(bids.index(held[-1])), store.__contains__)[0] != held[-1]
    assert held[-1] not in RelatedIndex(folder)
    # another group (another negative prompt) is never related
    other = dataclasses.replace(base, negative_prompt="blurry")
    assert index.nearest(other, _vector(0), store.__contains__) is None
    assert base_id(FP, base) in bids


@pytest.mark.parametrize("thresholds,field", [
    ([{"similarity": 0.9, "skip": 0.4}, {"similarity": 0.8, "skip": 0.6}], "serve.related.thresholds[1]"),
    ([{"similarity": 0.8, "skip": 0.6}, {"similarity": 0.9, "skip": 0.4}], "serve.related.thresholds[1]"),
    ([{"similarity": 1.5, "skip": 0.4}], "serve.related.thresholds[0].similarity"),
    ([{"similarity": 0.9, "skip": 1.0}], "serve.related.thresholds[0].skip"),
])  # fmt: skip
def test_bad_thresholds_are_refused_naming_the_field(tmp_path, model_dir, thresholds, field):
    raw = {"model": str(model_dir), "base": {"prompt": A}, "serve": {"related": {"thresholds": thresholds}}}
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        config_from_dict(raw, tmp_path / "c.yaml")


@pytest.mark.parametrize("kind", ["mean", "eos"])
def test_prompt_embeddings_are_the_text_encoders_states_averaged_or_at_eos(pipeline, torch_components, kind):
    """Against transformers' CLIP text model: the mean of its last hidden states over BOS..EOS,
    or the state at EOS, unit length."""
    _, text_encoder, _, tokenizer, _ = torch_components
    prompts = [A, "a cat", ""]
    ids = tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    import torch

    with torch.no_grad():
        hidden = text_encoder(ids).last_hidden_state.numpy()
    ours = pipeline.prompt_embeddings(prompts, 0, kind)
    for b in range(len(prompts)):
        n = int((ids[b] == tokenizer.eos_token_id).nonzero()[0]) + 1
        v = hidden[b, :n].mean(axis=0) if kind == "mean" else hidden[b, n - 1]
        np.testing.assert_allclose(ours[b], v / np.linalg.norm(v), atol=1e-5)
    assert abs(float(ours[0] @ ours[1])) < 0.9999  # different prompts are not the same vector


def test_an_index_of_one_embedding_leaves_the_other_kinds_entries_alone(tmp_path):
    folder = tmp_path / "bases"
    state = fake_state(0)
    RelatedIndex(folder, "mean").add("b" * 32, state.base, _vector(0), 0)
    assert "b" * 32 in RelatedIndex(folder, "mean") and "b" * 32 not in RelatedIndex(folder, "eos")


@pytest.mark.parametrize("eviction,kept", [("lru", [False, True, True, True]), ("lcbfu", [True, False, True, True])])
def test_lcbfu_eviction_keeps_the_base_related_generations_reuse(eviction, kept):
    """A RAM tier of three bases gets a fourth: LRU lets the oldest go; "lcbfu" keeps it when
    its related generations saved steps, and lets the next uncredited one go."""
    store = BaseStore(FP, ram_bytes=3 * BASE_BYTES + UNCOND_BYTES + 1024, eviction=eviction)
    bids = [store.put(fake_state(i)) for i in range(3)]
    store.credit(bids[0], 12)
    bids.append(store.put(fake_state(3)))
    assert [bid in store for bid in bids] == kept


def test_an_unknown_eviction_policy_is_refused_naming_the_field(tmp_path, model_dir):
    raw = {"model": str(model_dir), "base": {"prompt": A}, "store": {"eviction": "lfu"}}
    with pytest.raises(ConfigError, match=r"store\.eviction"):
        config_from_dict(raw, tmp_path / "c.yaml")
