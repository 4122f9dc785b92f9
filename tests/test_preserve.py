"""Edits that keep what they do not name (issue 12): token alignment, attention maps, auto masks,
masks exact in pixels, and the bad inputs around them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from edit_rt.export.compile.graphs import attention_map_layers, cross_attention_layers
from edit_rt.runtime.config.load import config_from_dict
from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.errors import ConfigError
from edit_rt.runtime.model.align import token_diff
from edit_rt.runtime.model.edit import Mask, Preserve, TailRow

from .conftest import TEST_BASE
from .step_feeds import ddim_feeds

G = TEST_BASE.guidance


# --- the token alignment ----------------------------------------------------------------------


def _diff(pipeline, base: str, edit: str):
    a, b = pipeline.input_ids([base, edit])
    return token_diff(list(a), list(b), pipeline.special_ids), list(a), list(b)


def _text(pipeline, ids, positions) -> str:
    return pipeline.text.tokenizer.decode([ids[p] for p in positions]).replace(" ", "").replace("</w>", "")


def test_a_word_swap_changes_that_word_in_both_prompts(pipeline):
    diff, a, b = _diff(pipeline, "a red circle", "a blue circle")
    # the byte-level test tokenizer spells words letter by letter: "red" vs "blue" differ in
    # their letters, the shared "e" in the middle may align
    assert "r" in _text(pipeline, a, diff.base_positions) and "b" in _text(pipeline, b, diff.edit_positions)
    assert _text(pipeline, a, [p for p in range(1, 13) if p not in diff.base_positions]).startswith("a")
    assert not diff.unchanged


def test_insertion_deletion_and_no_change(pipeline):
    ins, a, b = _diff(pipeline, "a circle", "a big circle")
    assert ins.base_positions == () and _text(pipeline, b, ins.edit_positions) == "big"
    dele, a, b = _diff(pipeline, "a big circle", "a circle")
    assert dele.edit_positions == () and _text(pipeline, a, dele.base_positions) == "big"
    same, _, _ = _diff(pipeline, "a red circle", "a red circle")
    assert same.unchanged


def test_repeated_words_align_to_the_changed_occurrence(pipeline):
    diff, a, b = _diff(pipeline, "red red red", "red red blue")
    # the first two "red"s match; only the third word changed
    # BOS, then r e d</w> three times: the first two match, only the third (7..9) changed
    assert diff.base_positions == (7, 8, 9) and min(diff.edit_positions) == 7


def test_a_change_past_77_tokens_is_invisible_and_reported(pipeline):
    long = "x" * 100  # 100 letters: past CLIP's 77-token window in the byte-level tokenizer
    diff, _, _ = _diff(pipeline, long + " red", long + " blue")
    assert diff.unchanged
    rows = [TailRow(TEST_BASE.prompt.replace("red", long + " red"), 1.0, 5, G, preserve="auto")]
    state = pipeline.generate_base(dataclasses.replace(TEST_BASE, prompt=long + " red"))
    (result,) = pipeline.edit(state, [TailRow(long + " blue", 1.0, 5, G, preserve="auto")])
    assert result.preserve.startswith("none: no token of the prompt changed")
    del rows


# --- the attention maps of the step graph -----------------------------------------------------


class _Recorder:
    """diffusers' own attention (get_attention_scores), keeping each call's probabilities."""

    def __init__(self, store: list):
        self.store = store

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kw):
        query = attn.head_to_batch_dim(attn.to_q(hidden_states))
        key = attn.head_to_batch_dim(attn.to_k(encoder_hidden_states))
        value = attn.head_to_batch_dim(attn.to_v(encoder_hidden_states))
        probs = attn.get_attention_scores(query, key, attention_mask)
        self.store.append(probs)
        out = attn.batch_to_head_dim(torch.bmm(probs, value))
        return attn.to_out[1](attn.to_out[0](out)) / attn.rescale_output_factor


def test_attention_maps_equal_diffusers_attention(pipeline, onnx_dir, torch_components):
    """unet_step's attn_maps against the same maps from diffusers' UNet and attention."""
    unet, text_encoder, _, tokenizer, _ = torch_components
    manifest = load_manifest(onnx_dir)
    prompts = ["a red circle", "a blue square"]
    negative = "blurry"
    n, c, hw = 2, 4, 16
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((n, c, hw, hw)).astype(np.float32)
    timestep = np.array([800.0, 300.0], dtype=np.float32)
    kv = pipeline.kv_from_prompts(prompts)
    uncond = pipeline.kv_from_prompts([negative])
    feeds = {"latents": latents, "timestep": timestep, "alpha_t": np.full(n, 0.3, np.float32),
             **ddim_feeds(0.4, n, (c, hw, hw)), "guidance": np.full(n, 7.5, np.float32),
             "uncond_index": np.zeros(n, np.int64), "uncond_given": np.zeros((0, c, hw, hw), np.float32), "uncond_slope": np.zeros(0, np.float32),
             "self_ref": np.arange(n)}  # fmt: skip
    for i in range(len(manifest.layers)):
        feeds[f"cond_k_{i}"], feeds[f"cond_v_{i}"] = kv.tensors[2 * i], kv.tensors[2 * i + 1]
        feeds[f"uncond_k_{i}"], feeds[f"uncond_v_{i}"] = uncond.tensors[2 * i][0], uncond.tensors[2 * i + 1][0]
    ours = pipeline.graphs["unet_step"].infer(feeds)[3]  # [N, 77, hm, wm]

    map_ids, factor = attention_map_layers(unet)
    layers = cross_attention_layers(unet)
    store: dict[int, list] = {i: [] for i in map_ids}
    for i in map_ids:
        layers[i][1].set_processor(_Recorder(store[i]))
    ids = tokenizer([negative] * n + prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        text = text_encoder(ids)[0]
        x = torch.from_numpy(latents)
        unet(torch.cat([x, x]), torch.from_numpy(np.concatenate([timestep, timestep])), encoder_hidden_states=text)
    maps = []
    for i in sorted(map_ids):
        probs = store[i][0]  # [2N * heads, tokens, 77]: the cond rows are the second half
        heads = layers[i][1].heads
        maps.append(probs.view(2 * n, heads, *probs.shape[1:])[n:].mean(1).transpose(1, 2))
    expected = torch.stack(maps).mean(0).reshape(n, 77, hw // factor, hw // factor).numpy()
    assert ours.shape == expected.shape
    # probabilities in [0, 1], fp32 graph against torch: ~1e-6
    np.testing.assert_allclose(ours, expected, atol=2e-5)


# --- auto masks in the loop -------------------------------------------------------------------


def _auto_rows():
    return [
        TailRow("a red circle on a green background", 1.0, 4, G, preserve="auto"),
        TailRow("a blue circle on a blue background", 1.5, 6, G, preserve="auto"),
        TailRow("a red square on a blue background", 1.0, 4, G),
        TailRow("a red triangle on a blue background", 1.0, 3, G, preserve="auto", seed=5),
    ]


def test_auto_mask_rows_batched_equal_one_at_a_time(pipeline, base_state, tight_preserve):
    batched = pipeline.run_tail(base_state, _auto_rows())
    for row, final in zip(_auto_rows(), batched):
        (alone,) = pipeline.run_tail(base_state, [row])
        # fp32 reordering across batch sizes: ~1e-6 relative on latents that reach ~30 here
        np.testing.assert_allclose(final, alone, rtol=1e-6, atol=1e-5)


@pytest.fixture
def tight_preserve(pipeline):
    """A tight mask on the random test model (its maps mark no object): threshold 0.6, no dilation."""
    pipeline.preservation.preserve = Preserve(threshold=0.6, dilate=0, region="words")
    yield pipeline.preservation.preserve
    pipeline.preservation.preserve = Preserve()


def test_auto_mask_keeps_the_base_outside_and_uses_the_maps_graph_only_first(pipeline, base_state, tight_preserve):
    scheduler = pipeline.batcher(base_state.latents.shape[1:]).scheduler
    before = scheduler.stats.map_calls
    (result,) = pipeline.edit(base_state, [TailRow("a red circle on a green background", 1.0, 2, G, preserve="auto")])
    assert scheduler.stats.map_calls - before == pipeline.preservation.preserve.steps  # then the plain graph
    assert result.preserve == "auto" and result.keep is not None and 0 < result.keep.mean() < 1
    keep = result.keep[0]
    np.testing.assert_array_equal(result.latent[:, keep], base_state.final_latent[0][:, keep])
    # and in pixels: outside the (bilinear) edge band the image is the base's
    weight = pipeline.preservation.pixel_weight(TailRow("x", 1, 2, G, preserve="auto"), result.keep, result.image.shape[:2])
    base_image = pipeline.base_image(base_state)
    outside = weight == 0
    assert outside.any()
    np.testing.assert_array_equal(result.image[outside], base_image[outside])


@pytest.mark.parametrize("start", [2, 7])
def test_identity_edits_stay_exact_with_preserve_auto(pipeline, base_state, start):
    rows = [TailRow(TEST_BASE.prompt, 1.0, start, G, preserve="auto"),  # no changed token: no mask
            TailRow("a blue square", 0.0, start, G, preserve="auto")]  # strength 0: the base's K/V  # fmt: skip
    results = pipeline.edit(base_state, rows)
    assert results[0].preserve.startswith("none: no token") and results[1].preserve == "auto"
    for r in results:
        np.testing.assert_array_equal(r.latent, base_state.final_latent[0])


def test_an_explicit_mask_never_lets_a_pixel_outside_change(pipeline, base_state):
    mask = Mask(x=8, y=4, width=13, height=11)  # not aligned to the 2-pixel latent grid
    (result,) = pipeline.edit(base_state, [TailRow("a yellow triangle", 1.5, 3, G, mask=mask)])
    base_image = pipeline.base_image(base_state)
    outside = np.ones(base_image.shape[:2], dtype=bool)
    outside[mask.y : mask.y + mask.height, mask.x : mask.x + mask.width] = False
    np.testing.assert_array_equal(result.image[outside], base_image[outside])
    inside = ~outside
    assert np.abs(result.image[inside] - base_image[inside]).max() > 0.01  # the edit did something (random model: small)
    # the PNG the server writes: the same bytes outside
    from edit_rt.runtime.pipeline.images import to_uint8

    np.testing.assert_array_equal(to_uint8(result.image)[outside], to_uint8(base_image)[outside])


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "patch,needle",
    [
        ({"edits": [{"prompt": "x", "preserve": "sometimes"}]}, "edits[0].preserve: must be one of 'auto' | 'none'"),
        ({"preserve": {"threshold": 1.5}}, "preserve.threshold: must lie in (0, 1)"),
        ({"preserve": {"dilate": -1}}, "preserve.dilate: must lie in [0, 8]"),
        ({"preserve": {"steps": 0}}, "preserve.steps: must lie in [1, 50]"),
        ({"preserve": {"mode": "always"}}, "preserve.mode: must be one of"),
        ({"preserve": {"region": "everywhere"}}, "preserve.region: must be one of"),
        ({"preserve": {"structure": 1.5}}, "preserve.structure: must lie in [0, 1]"),
        ({"edits": [{"prompt": "x", "structure": -0.1}]}, "edits[0].structure: must lie in [0, 1]"),
    ],
)
def test_bad_preserve_settings_name_the_field(model_dir, patch, needle):
    data = {"model": str(model_dir), "base": {"prompt": "x", "width": 32, "height": 32, "steps": 4}, **patch}
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert needle in str(err.value)


# --- structure keeping ------------------------------------------------------------------------


class _Injected:
    """diffusers' attention (its own score helper, upcast rules included) where row r takes the
    queries and keys of row ``source[r]``: the test's independent plug-and-play injection."""

    def __init__(self, source: torch.Tensor):
        self.source = source

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        residual = hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = q[self.source], k[self.source]
        q, k, v = (attn.head_to_batch_dim(t) for t in (q, k, v))
        out = attn.batch_to_head_dim(torch.bmm(attn.get_attention_scores(q, k), v))
        out = attn.to_out[1](attn.to_out[0](out))
        return (out + residual if attn.residual_connection else out) / attn.rescale_output_factor


def test_structure_keeping_is_plug_and_play_self_attention_injection(pipeline, onnx_dir, model_dir):
    """One step of the maps graph with row 1 taking row 0's self-attention pattern, against
    diffusers' UNet with the test's own injecting processor and diffusers' DDIM step."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from diffusers.models.attention_processor import AttnProcessor

    sd = StableDiffusionPipeline.from_pretrained(model_dir)
    scheduler = DDIMScheduler.from_config(sd.scheduler.config)
    scheduler.set_timesteps(10)
    t = int(scheduler.timesteps[4])
    prev = t - scheduler.config.num_train_timesteps // 10
    a_t, a_prev = scheduler.alphas_cumprod[t], scheduler.alphas_cumprod[prev]
    manifest = load_manifest(onnx_dir)
    prompts, negative, n, g = ["a red circle", "a blue square"], "blurry", 2, 7.5
    latents = np.random.default_rng(1).standard_normal((n, 4, 16, 16)).astype(np.float32)
    kv, uncond = pipeline.kv_from_prompts(prompts), pipeline.kv_from_prompts([negative])
    feeds = {"latents": latents, "timestep": np.full(n, t, np.float32), "alpha_t": np.full(n, float(a_t), np.float32),
             **ddim_feeds(float(a_prev), n, (4, 16, 16)), "guidance": np.full(n, g, np.float32),
             "uncond_index": np.zeros(n, np.int64), "uncond_given": np.zeros((0, 4, 16, 16), np.float32),
             "uncond_slope": np.zeros(0, np.float32)}  # fmt: skip
    for i in range(len(manifest.layers)):
        feeds[f"cond_k_{i}"], feeds[f"cond_v_{i}"] = kv.tensors[2 * i], kv.tensors[2 * i + 1]
        feeds[f"uncond_k_{i}"], feeds[f"uncond_v_{i}"] = uncond.tensors[2 * i][0], uncond.tensors[2 * i + 1][0]
    ours = pipeline.graphs["unet_step"].infer({**feeds, "self_ref": np.array([0, 0])})[0]
    plain = pipeline.graphs["unet_step"].infer({**feeds, "self_ref": np.array([0, 1])})[0]

    # rows [uncond 0, uncond 1, cond 0, cond 1]: each half of row 1 takes row 0's pattern
    source = torch.tensor([0, 0, 2, 2])
    sd.unet.set_attn_processor({name: _Injected(source) if ".attn1." in name else AttnProcessor()
                                for name in sd.unet.attn_processors})  # fmt: skip
    ids = sd.tokenizer([negative] * n + prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        x = torch.from_numpy(latents)
        out = sd.unet(torch.cat([x, x]), t, encoder_hidden_states=sd.text_encoder(ids)[0]).sample
        eps = out[:n] + g * (out[n:] - out[:n])
        expected = torch.cat([scheduler.step(eps[r : r + 1], t, x[r : r + 1], eta=0.0).prev_sample for r in range(n)]).numpy()
    np.testing.assert_allclose(ours, expected, atol=1e-4)
    np.testing.assert_allclose(ours[0], plain[0], atol=1e-5)  # its own reference: the plain step
    assert np.abs(ours[1] - plain[1]).max() > 1e-3  # row 1 took row 0's layout


def _structure_rows():
    return [
        TailRow("a blue square", 1.0, 4, G, structure=0.5),
        TailRow("a green circle", 1.5, 4, G, structure=0.5),
        TailRow("a yellow circle", 1.0, 6, G, structure=1.0),
        TailRow("a blue square", 1.0, 4, G),
        TailRow("a green square", 1.0, 3, G, structure=0.5, seed=4),
    ]


def test_structure_rows_batched_equal_one_at_a_time(pipeline, base_state):
    rows = _structure_rows()
    batched = pipeline.run_tail(base_state, rows)
    for row, final in zip(rows, batched):
        (alone,) = pipeline.run_tail(base_state, [row])
        np.testing.assert_allclose(final, alone, rtol=1e-6, atol=1e-5)
    plain = pipeline.run_tail(base_state, [dataclasses.replace(row, structure=0.0) for row in rows])
    for row, kept, free in zip(rows, batched, plain):  # structure keeping changes what it is asked to
        assert (np.abs(kept - free).max() > 1e-3) == (row.structure > 0)


def test_one_reference_row_per_group_rides_along_and_leaves(pipeline, base_state):
    """Two rows entering at step 4 with 0.5 of their 6-step tail kept share one reference row
    for 3 steps, on the plain graph; nothing is left in the slots."""
    scheduler = pipeline.batcher(base_state.latents.shape[1:]).scheduler
    before = dataclasses.replace(scheduler.stats)
    rows = [TailRow("a blue square", 1.0, 4, G, structure=0.5), TailRow("a green circle", 1.0, 4, G, structure=0.5)]
    pipeline.run_tail(base_state, rows)
    after = scheduler.stats
    assert after.reference_steps - before.reference_steps == 3
    assert after.map_calls - before.map_calls == 0 and after.calls - before.calls == 6
    assert after.row_steps - before.row_steps == 2 * 6 + 3  # (N + 1) / N of the rows, for 3 of 6 steps
    assert not scheduler.active and not scheduler.pending


@pytest.mark.parametrize("start", [0, 5])
def test_identity_edits_stay_exact_with_structure_keeping(pipeline, base_state, start):
    rows = [TailRow(TEST_BASE.prompt, 1.0, start, G, structure=1.0), TailRow("anything", 0.0, start, G, structure=0.5)]
    for final in pipeline.run_tail(base_state, rows):
        np.testing.assert_allclose(final, base_state.final_latent[0], atol=1e-5)


def test_rows_after_structure_rows_take_their_own_pattern_again(pipeline, base_state):
    """After a structure-keeping tail leaves, every slot is its own reference again: a wide
    batch of plain rows equals the same rows one at a time."""
    pipeline.run_tail(base_state, _structure_rows() * 3)
    rows = [TailRow(f"a {c} square", 1.0, 2 + k % 5, G) for k, c in enumerate(["red", "blue", "green", "white"] * 3)]
    batched = pipeline.run_tail(base_state, rows)
    for row, final in zip(rows, batched):
        (alone,) = pipeline.run_tail(base_state, [row])
        np.testing.assert_allclose(final, alone, rtol=1e-6, atol=1e-5)


def test_a_runs_preserve_knobs_reach_its_edits(tmp_path, model_dir, onnx_dir, pipeline, base_state):
    """`edit-rt run` with `preserve: {threshold, dilate, region}` gives the image the pipeline
    gives with those knobs (not the defaults'): the config's knobs reach the run's pipeline."""
    from PIL import Image

    from edit_rt.runtime.apps.run import run_config
    from edit_rt.runtime.config.load import load_config

    edit = "a yellow triangle on a green background"
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {model_dir}\nbuild_dir: {onnx_dir.parents[1]}\noutput_dir: {tmp_path / 'out'}\n"
                    f"base: {{prompt: {TEST_BASE.prompt}, negative_prompt: {TEST_BASE.negative_prompt}, "
                    f"seed: {TEST_BASE.seed}, steps: {TEST_BASE.steps}, guidance: {TEST_BASE.guidance}, width: 32, height: 32}}\n"
                    "cache: {window_start: 0}\npreserve: {threshold: 0.9, dilate: 0, region: words}\n"
                    f"edits: [{{prompt: {edit}, strength: 2.0, start_step: 1, preserve: auto}}]\n")  # fmt: skip
    run_config(load_config(path))
    written = np.asarray(Image.open(tmp_path / "out" / "edit_00.png"), dtype=np.int16)
    images = {}
    for name, knobs in (("tight", Preserve(threshold=0.9, dilate=0, region="words")), ("default", Preserve())):
        pipeline.preservation.preserve = knobs
        (result,) = pipeline.edit(base_state, [TailRow(edit, 2.0, 1, TEST_BASE.guidance, preserve="auto")])
        images[name] = np.round(np.clip(result.image, 0, 1) * 255).astype(np.int16)
    pipeline.preservation.preserve = Preserve()
    assert np.abs(images["tight"] - images["default"]).max() > 2  # the knobs matter on this model
    assert np.abs(written - images["tight"]).max() <= 1
