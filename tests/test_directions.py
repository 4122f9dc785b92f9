"""Several directions in one edit, mixed by aligned tokens (issue 25): the permutation on token
ids, tails against diffusers' own UNet and DDIM fed the mixed prompt embeddings (K/V are linear
in them, so mixing the embeddings is mixing K/V), the sum formula against numpy, identity and
bad input, ``preserve: auto``'s positions, SDXL's pooled embedding, and where edits are described.

The test tokenizer is byte-level: a word is its letters, the last one ending in ``</w>``. So
``big`` is three tokens, and ``circle``/``square`` share letters at other offsets (an alignment
of single tokens would scramble them; one of words keeps them in place).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from edit_rt.runtime.apps.run import edit_label
from edit_rt.runtime.config.load import config_from_dict
from edit_rt.runtime.errors import ConfigError
from edit_rt.runtime.loop.jobs import Job, Request
from edit_rt.runtime.model.directions import token_permutation, units
from edit_rt.runtime.model.edit import Direction, Edit, EditDefaults, TailRow, resolve_edit
from edit_rt.runtime.pipeline.pnginfo import edit_fields, parameters_text, parse_fields
from edit_rt.runtime.web.http_errors import validation_error
from edit_rt.runtime.serving.results import Edited
from edit_rt.runtime.web.api import EditsRequest

from .conftest import TEST_BASE
from .step_feeds import ddim_feeds

G = TEST_BASE.guidance
BASE = TEST_BASE.prompt  # "a red circle on a blue background": 27 letters, EOS at 28
INSERTED = "a big red circle on a blue background"  # "big": 3 tokens after "a"
DELETED = "a circle on a blue background"  # "red" (3 tokens) gone
SAME_LENGTH = "a tan square on a gray background"  # each word replaced by one as long


def inserted_at(n: int, at: int, k: int = 77) -> np.ndarray:
    """The permutation of ``k`` inserted tokens at position ``at`` of the edit prompt (and none
    deleted): the base's later tokens shifted by ``k``, its last ``k`` (padding) slots, freed by
    the shift, take the inserted ones."""
    pi = np.arange(n)
    pi[at : n - k] += k
    pi[n - k :] = np.arange(at, at + k)
    return pi


def deleted_at(n: int, at: int, k: int) -> np.ndarray:
    """The permutation of ``k`` base tokens deleted at ``at``: later tokens shift back, the deleted
    ones pair with the padding slots the edit gained at its end."""
    pi = np.arange(n)
    pi[at : at + k] = np.arange(n - k, n)
    pi[at + k :] -= k
    return pi


# --- the permutation on token ids --------------------------------------------------------------

BOS, EOS = 100, 101
ENDS = set(range(1, 10))  # ids 1..9 end a word; 10, 11 are word starts


def _ids(*words: tuple[int, ...], n: int = 12) -> list[int]:
    ids = [BOS, *(t for w in words for t in w), EOS]
    return ids + [EOS] * (n - len(ids))  # SD's tokenizer pads with its EOS


def _perm(a, b, ends=ENDS):
    return token_permutation(a, b, {BOS, EOS}, ends).tolist()


def test_a_replacement_of_the_same_length_is_the_identity():
    assert _perm(_ids((1,), (2,), (3,)), _ids((1,), (4,), (3,))) == list(range(12))
    # a three-token word for a three-token word sharing its tokens at other offsets
    assert _perm(_ids((1,), (10, 11, 2), (3,)), _ids((1,), (11, 10, 4), (3,))) == list(range(12))


def test_an_insertion_takes_the_padding_slot_the_shift_freed():
    base, edit = _ids((1,), (2,), (3,)), _ids((1,), (10, 9), (2,), (3,))
    assert _perm(base, edit) == inserted_at(12, 2, 2).tolist()


def test_a_deletion_pairs_with_the_padding_the_edit_gained():
    base, edit = _ids((1,), (10, 9), (2,), (3,)), _ids((1,), (2,), (3,))
    assert _perm(base, edit) == deleted_at(12, 2, 2).tolist()


def test_several_changes_pair_replaced_words_word_by_word():
    # "1 (10 2) 3 (11 4)" -> "1 (10 5) 3 (11 11 4) 6": a same-length replacement in place, a
    # longer word (its extra token left over) and an appended word, which the base's last two
    # padding slots (freed by the shift of EOS and padding by two) take, in order
    base = _ids((1,), (10, 2), (3,), (11, 4), n=14)
    edit = _ids((1,), (10, 5), (3,), (11, 11, 4), (6,), n=14)
    assert _perm(base, edit) == [0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 7, 8]


def test_words_not_tokens_keep_a_replaced_word_in_place():
    # "circle" -> "square" letter by letter: single tokens match its r and e at other offsets
    c = [ord(x) for x in "circl"] + [1]  # ids: letters, then an id that ends the word
    s = [ord(x) for x in "squar"] + [1]
    base, edit = _ids(tuple(c), n=20), _ids(tuple(s), n=20)
    special = {BOS, EOS}
    assert token_permutation(base, edit, special, {1}).tolist() == list(range(20))
    assert token_permutation(base, edit, special, None).tolist() != list(range(20))
    assert units(base, special, {1}) == [(0, 1), (1, 7), *((i, i + 1) for i in range(7, 20))]


def test_every_alignment_is_a_permutation():
    rng = np.random.default_rng(0)
    for _ in range(300):
        words = [tuple(rng.integers(10, 12, rng.integers(0, 3))) + (int(rng.integers(1, 4)),) for _ in range(rng.integers(0, 6))]
        other = [w for w in words if rng.random() > 0.3] + [(int(rng.integers(1, 6)),)] * int(rng.integers(0, 3))
        rng.shuffle(other)
        pi = token_permutation(_ids(*words, n=30), _ids(*other, n=30), {BOS, EOS}, ENDS)
        assert sorted(pi.tolist()) == list(range(30))


def test_the_tokenizers_ids_give_the_hand_made_permutations(pipeline):
    ids = pipeline.input_ids([BASE, INSERTED, DELETED, SAME_LENGTH])
    perm = lambda i: token_permutation(ids[0], ids[i], pipeline.special_ids, pipeline.word_ends)  # noqa: E731
    np.testing.assert_array_equal(perm(1), inserted_at(77, 2, 3))
    np.testing.assert_array_equal(perm(2), deleted_at(77, 2, 3))
    np.testing.assert_array_equal(perm(3), np.arange(77))


# --- tails against diffusers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def sd(model_dir, diffusers_reference):
    return diffusers_reference.pipe(model_dir)[0]  # read only: its encoders and UNet


def _embeds(sd, prompts: list[str]) -> torch.Tensor:
    ids = sd.tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        return sd.text_encoder(ids)[0]


def _mixed(sd, terms: list[tuple[str, float, np.ndarray]]) -> torch.Tensor:
    """emb_b + sum_i s_i (emb_i[pi_i] - emb_b), in torch, on transformers' own encodings."""
    emb = _embeds(sd, [BASE, *(p for p, _, _ in terms)])
    out = emb[:1].clone()
    for k, (_, s, pi) in enumerate(terms):
        out += s * (emb[k + 1 : k + 2, torch.from_numpy(pi)] - emb[:1])
    return out


def _diffusers_tail(sd, state, start: int, cond: torch.Tensor) -> np.ndarray:
    """diffusers' UNet and DDIMScheduler (eta 0) from the base's cached x_start with ``cond`` as
    the prompt embeddings and the base's negative prompt: the final latent [c, h, w]."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler.from_config(sd.scheduler.config)
    scheduler.set_timesteps(state.base.steps)
    negative = _embeds(sd, [state.base.negative_prompt])
    x = torch.from_numpy(state.latent(start).copy())
    with torch.no_grad():
        for t in scheduler.timesteps[start:]:
            u, c = sd.unet(torch.cat([x, x]), t, encoder_hidden_states=torch.cat([negative, cond])).sample.chunk(2)
            x = scheduler.step(u + state.base.guidance * (c - u), t, x, eta=0.0).prev_sample
    return x[0].numpy()


def _row(edit: Edit) -> TailRow:
    return resolve_edit(edit, TEST_BASE, 0, EditDefaults())


# The runtime's full generation matches diffusers' to 1e-4 on images (test_pipeline); latents of
# the tiny model reach ~3 here: fp32 reordering through a few chained UNet calls, ~1e-6 each.
TAIL_ATOL = 1e-4


def test_a_direction_at_strength_1_runs_its_prompts_own_tail_despite_an_insertion(pipeline, base_state, sd):
    (ours,) = pipeline.run_tail(base_state, [_row(Edit(directions=(Direction(INSERTED, 1.0),), start_step=4))])
    expected = _diffusers_tail(sd, base_state, 4, _embeds(sd, [INSERTED]))  # the prompt itself, unpermuted
    np.testing.assert_allclose(ours, expected, atol=TAIL_ATOL)
    assert np.abs(ours - base_state.final_latent[0]).max() > 1e-2  # it is an edit


def test_half_strength_mixes_aligned_tokens_where_position_mixing_differs(pipeline, base_state, sd):
    """At 0.5, an insertion's mix is the aligned one (diffusers fed the embeddings mixed through
    the hand-made permutation), not the position mix; a same-length replacement's are one."""
    ins, same = pipeline.run_tail(base_state, [_row(Edit(prompt=p, strength=0.5, start_step=3)) for p in (INSERTED, SAME_LENGTH)])
    aligned = _diffusers_tail(sd, base_state, 3, _mixed(sd, [(INSERTED, 0.5, inserted_at(77, 2, 3))]))
    by_position = _diffusers_tail(sd, base_state, 3, _mixed(sd, [(INSERTED, 0.5, np.arange(77))]))
    np.testing.assert_allclose(ins, aligned, atol=TAIL_ATOL)
    assert np.abs(ins - by_position).max() > 10 * TAIL_ATOL  # (the random model's text moves its latents little)
    np.testing.assert_allclose(same, _diffusers_tail(sd, base_state, 3, _mixed(sd, [(SAME_LENGTH, 0.5, np.arange(77))])),
                               atol=TAIL_ATOL)  # fmt: skip


TWO = Edit(prompt=SAME_LENGTH, strength=0.7, directions=(Direction(INSERTED, 0.5), Direction(DELETED, -0.4)), start_step=3)
TWO_TERMS = [(SAME_LENGTH, 0.7, np.arange(77)), (INSERTED, 0.5, inserted_at(77, 2, 3)), (DELETED, -0.4, deleted_at(77, 2, 3))]


def _built(pipeline, state, row: TailRow):
    """The step loop's row for ``row`` (the resolver's mix), as the batcher would admit it."""
    built, failed = pipeline.resolver.rows([Job(Request("test"), 0, state.base, row, state=state)])
    assert not failed, failed
    return built[0][1]


def test_two_directions_are_the_sum_of_their_aligned_differences(pipeline, base_state):
    kv = pipeline.kv_from_prompts([p for p, _, _ in TWO_TERMS])
    got = _built(pipeline, base_state, _row(TWO)).kv
    for j, (b, mixed) in enumerate(zip(base_state.cond_kv.tensors, got)):
        axis = 3 if j % 2 == 0 else 2  # K [1, heads, head_dim, 77], V [1, heads, 77, head_dim]
        expected = b[0].astype(np.float64)
        for k, (_, s, pi) in enumerate(TWO_TERMS):
            expected = expected + s * (np.take(kv.tensors[j][k : k + 1], pi, axis=axis)[0] - b[0])
        np.testing.assert_allclose(mixed, expected, rtol=1e-5, atol=1e-6)


def test_two_directions_tail_equals_diffusers_fed_the_mixed_embeddings(pipeline, base_state, sd):
    (ours,) = pipeline.run_tail(base_state, [_row(TWO)])
    np.testing.assert_allclose(ours, _diffusers_tail(sd, base_state, 3, _mixed(sd, TWO_TERMS)), atol=TAIL_ATOL)


@pytest.mark.parametrize("prompt", [None, "a blue square"])
def test_all_strengths_0_reproduce_the_base_exactly(pipeline, base_state, prompt):
    given = {} if prompt is None else {"prompt": prompt, "strength": 0.0}
    edit = Edit(**given, directions=(Direction(INSERTED, 0.0), Direction("a green square", 0.0)), start_step=2)
    (final,) = pipeline.run_tail(base_state, [_row(edit)])
    np.testing.assert_array_equal(final, base_state.final_latent[0])


def test_an_edit_of_directions_alone_is_the_base_prompt_plus_them():
    row = _row(Edit(directions=(Direction(INSERTED, 0.5), Direction(DELETED)), tail_steps=3))
    assert (row.prompt, row.strength) == (BASE, 0.0)
    assert row.directions == (Direction(INSERTED, 0.5), Direction(DELETED, 1.0))  # cache.default_strength
    assert row.terms == [(INSERTED, 0.5), (DELETED, 1.0)]  # the base prompt at 0 is not encoded
    assert TailRow("x", 0.0, 3, G).terms == [("x", 0.0)]  # without directions: as before


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit,field,words",
    [({"directions": []}, "edits[0].directions", "must hold at least 1 item, got 0"),
     ({"directions": [{"prompt": "a"}, {"prompt": "  "}]}, "edits[0].directions[1].prompt", "must not be empty"),
     ({"directions": [{"prompt": "a"}, {"prompt": "b", "strength": 9.0}]}, "edits[0].directions[1].strength", "must lie in [-4, 4], got 9.0"),
     ({"prompt": "a", "directions": [{"prompt": "a"}] * 9}, "edits[0].directions", "must hold at most 8 items, got 9"),
     ({"directions": [{"prompt": "a [b:c:0.5]"}]}, "edits[0].directions[0].prompt", "prompt editing"),
     ({"directions": [{"prompt": "a", "weight": 1.0}]}, "edits[0].directions[0].weight", "unknown"),
     ({"directions": [{"prompt": "a"}], "strength": 1.0}, "edits[0]", "strength is the prompt's"),
     ({"strength": 1.0}, "edits[0].prompt", "required"),  # neither: a missing prompt, as before
     ({"prompt": None, "directions": [{"prompt": "a"}]}, "edits[0].prompt", "must be a string, got None")],
)  # fmt: skip
def test_bad_directions_are_refused_naming_the_field(edit, field, words):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": "m", "base": {"prompt": BASE}, "edits": [edit]})
    assert str(err.value).startswith(f"{field}: ") and words in str(err.value), str(err.value)
    with pytest.raises(ValidationError) as invalid:  # the API's body: the same field, the same words
        EditsRequest.model_validate({"base_id": "x", "edits": [edit]})
    api = validation_error(invalid.value.errors(), EditsRequest)
    assert api.status == 400 and (api.param or "") == field and words in api.message, api.message


def test_a_missing_prompt_is_refused_as_before():
    with pytest.raises(ConfigError, match=r"^edits\[0\]\.prompt: missing; this field is required$"):
        config_from_dict({"model": "m", "base": {"prompt": BASE}, "edits": [{"tail_steps": 2}]})
    with pytest.raises(ValidationError):
        Edit()
    with pytest.raises(ValidationError):
        dataclasses.replace(Edit(prompt="a"), prompt=None)
    assert dataclasses.replace(Edit(directions=(Direction("a"),)), seed=3).seed == 3  # what variations do


# --- preserve: auto ----------------------------------------------------------------------------


def test_auto_mask_reads_the_changed_words_where_the_mix_put_them(pipeline, base_state):
    """The maps are indexed by the base's positions once K/V are mixed: an inserted word's are
    where its permutation put it (the base's last three padding slots), a replaced word's in
    place, the union over directions of non-zero strength."""
    shape = base_state.latents.shape[1:]
    mask, how = pipeline.auto_mask(BASE, _row(Edit(prompt=INSERTED, preserve="auto")), shape)
    assert how == "auto" and mask.changed == (74, 75, 76)
    assert set(mask.content) == set(range(1, 28)) | {74, 75, 76}
    two = Edit(directions=(Direction(INSERTED, 0.5), Direction("a tan circle on a blue background", -1.0),
                           Direction("a red circle on a blue box", 0.0)), preserve="auto")  # fmt: skip
    mask, _ = pipeline.auto_mask(BASE, _row(two), shape)
    assert mask.changed == (2, 3, 4, 74, 75, 76)  # "red" -> "tan", and "big"; not the strength-0 "box"
    none, how = pipeline.auto_mask(BASE, _row(Edit(directions=(Direction(INSERTED, 0.0),), preserve="auto")), shape)
    assert none is None and how.startswith("none: no token")


def test_a_rows_maps_are_its_prompts_own_maps_in_the_base_positions(pipeline, base_state):
    """Attention is permutation-equivariant: the maps of a row mixed at strength 1 are the edit
    prompt's own maps with position b read at pi[b], so the inserted word's map is at 74..76."""
    pi = inserted_at(77, 2, 3)
    row = _built(pipeline, base_state, _row(Edit(directions=(Direction(INSERTED, 1.0),), start_step=4)))
    own = pipeline.kv_from_prompts([INSERTED])
    maps = [_maps(pipeline, base_state, kv) for kv in ([t[None] for t in row.kv], own.tensors)]
    np.testing.assert_allclose(maps[0], maps[1][:, pi], atol=1e-6)
    assert np.abs(maps[0] - maps[1]).max() > 1e-3  # by position they differ


def _maps(pipeline, state, kv: list[np.ndarray]) -> np.ndarray:
    """One unet_step call on the base's x_4: the cross-attention maps [1, 77, hm, wm]."""
    x = state.latent(4)
    feeds = {"latents": x, "timestep": np.array([600.0], np.float32), "alpha_t": np.array([0.3], np.float32),
             **ddim_feeds(0.4, 1, x.shape[1:]), "guidance": np.array([G], np.float32),
             "uncond_index": np.zeros(1, np.int64), "uncond_given": np.zeros((0, *x.shape[1:]), np.float32), "uncond_slope": np.zeros(0, np.float32),
             "self_ref": np.zeros(1, np.int64)}  # fmt: skip
    for i in range(len(kv) // 2):
        feeds[f"cond_k_{i}"], feeds[f"cond_v_{i}"] = kv[2 * i], kv[2 * i + 1]
        feeds[f"uncond_k_{i}"], feeds[f"uncond_v_{i}"] = state.uncond_kv.tensors[2 * i][0], state.uncond_kv.tensors[2 * i + 1][0]
    return pipeline.graphs["unet_step"].infer(feeds)[3]


# --- SDXL: two tokenizers, the pooled embedding ------------------------------------------------


@pytest.fixture(scope="module")
def sdxl(sdxl_dir, sdxl_onnx_dir):
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    with EditPipeline(sdxl_onnx_dir, sdxl_dir) as pipe:
        yield pipe


def test_sdxl_tokenizers_align_the_words_alike(sdxl):
    """K/V project the two encoders' states concatenated per position, so one permutation must
    serve both: the first tokenizer's (padding with its EOS) is the second's (padding with "!")."""
    pad = sdxl.text.tokenizers[1].token_to_id("!")
    for edit in (INSERTED, DELETED, SAME_LENGTH, "a big red circle on a bluish background, top left"):
        first, second = (sdxl.input_ids([BASE, edit], t) for t in sdxl.text.tokenizers)
        np.testing.assert_array_equal(
            token_permutation(first[0], first[1], sdxl.special_ids, sdxl.word_ends),
            token_permutation(second[0], second[1], sdxl.special_ids | {pad}, sdxl.word_ends))  # fmt: skip


def test_sdxl_directions_mix_prompt_and_pooled_embeddings_alike(sdxl, sdxl_dir, diffusers_reference):
    """An edit from step 0 is a generation (test_families' reference): diffusers fed the prompt
    embeddings mixed through the permutations and the pooled embedding by the same sum."""
    from .test_families import _sdxl_reference

    pipe, _ = diffusers_reference.pipe(sdxl_dir, sdxl=True)  # its own Euler: edit-rt's default for it
    noise = sdxl.initial_noise(TEST_BASE)
    state = sdxl.generate_base(TEST_BASE, noise=noise)
    terms = [(INSERTED, 0.6, inserted_at(77, 2, 3)), (SAME_LENGTH, -0.3, np.arange(77))]
    edit = Edit(prompt=INSERTED, strength=0.6, directions=(Direction(SAME_LENGTH, -0.3),), start_step=0)
    row = _built(sdxl, state, _row(edit))
    kv = sdxl.kv_from_prompts([p for p, _, _ in terms])
    base_pooled = state.cond_kv.extras["text_embeds"][0]
    pooled = base_pooled + sum(s * (kv.extras["text_embeds"][k] - base_pooled) for k, (_, s, _) in enumerate(terms))
    np.testing.assert_allclose(row.conds["text_embeds"], pooled, rtol=1e-6, atol=1e-6)
    (ours,) = sdxl.run_tail(state, [_row(edit)])
    with torch.no_grad():
        emb_b, neg, pool_b, neg_pool = pipe.encode_prompt(BASE, negative_prompt=TEST_BASE.negative_prompt)
        emb, pool = emb_b.clone(), pool_b.clone()
        for prompt, s, pi in terms:
            emb_i, _, pool_i, _ = pipe.encode_prompt(prompt, negative_prompt=TEST_BASE.negative_prompt)
            emb += s * (emb_i[:, torch.from_numpy(pi)] - emb_b)
            pool += s * (pool_i - pool_b)
    embeds = {"prompt_embeds": emb, "pooled_prompt_embeds": pool, "negative_prompt_embeds": neg,
              "negative_pooled_prompt_embeds": neg_pool}  # fmt: skip
    # 1e-4 on images in [0, 1], as test_families' edit against diffusers
    np.testing.assert_allclose(sdxl.decode(ours[None]), _sdxl_reference(pipe, TEST_BASE, noise, **embeds), atol=1e-4)


# --- where an edit is described ----------------------------------------------------------------


def test_labels_png_info_and_replies_name_the_directions():
    edit = Edit(prompt="a blue square", directions=(Direction("a big red circle, top left", -0.5),))
    row = dataclasses.replace(_row(edit), start_step=6)
    label = edit_label(edit, row.strength, row.start_step, 10, "none", row.directions)
    assert label == "x1 tail 4: a blue square + a big red circle, top left x-0.5"
    alone = Edit(directions=(Direction("a cat", 0.5), Direction("a dog", 1.5)))
    assert edit_label(alone, 0.0, 6, 10, "none", _row(alone).directions) == "tail 4: a cat x0.5; a dog x1.5"
    fields = edit_fields(TEST_BASE, row, "tiny", "f" * 64, "b" * 24)
    text = parameters_text(row.prompt, TEST_BASE.negative_prompt, fields)
    assert parse_fields(text.split("\n")[-1])["Edit directions"] == "a big red circle, top left x-0.5"
    assert "Edit directions" not in edit_fields(TEST_BASE, _row(Edit(prompt="x")), "tiny", "f" * 64, "b" * 24)
    info = Edited(0, b"", 0.1, "none", 4, 1.0, ({"prompt": "a cat", "strength": 0.5},)).info()
    assert info["directions"] == [{"prompt": "a cat", "strength": 0.5}]
    assert "directions" not in Edited(0, b"", 0.1, "none", 4, 1.0).info()


def test_the_openapi_schema_documents_directions():
    from edit_rt.runtime.web.openapi_bodies import body_schemas

    schemas = body_schemas(config_from_dict({"model": "m", "base": {"prompt": BASE}}))
    edit = schemas["Edit"]
    assert edit["properties"]["directions"]["anyOf"][0]["maxItems"] == 8
    assert edit["properties"]["prompt"]["type"] == "string" and "prompt" not in edit.get("required", [])
    assert edit["anyOf"] == [{"required": ["prompt"]}, {"required": ["directions"]}]
    assert set(schemas["Direction"]["properties"]) == {"prompt", "strength"}
    assert TypeAdapter(EditsRequest).validate_python({"base_id": "x", "edits": [{"directions": [{"prompt": "a"}]}]})


def test_the_python_api_and_the_server_run_directions_and_say_so(model_dir, onnx_dir, pipeline, tmp_path):
    """The service's door (the Editor is the server's Service in process): a directions-only
    edit's image is the pipeline's tail of the same row, its label, PNG parameters and info say
    what ran, and a direction's prompt is checked as a prompt is, naming it."""
    from edit_rt.runtime.apps.editor import Editor
    from edit_rt.runtime.errors import EditorError
    from edit_rt.runtime.pipeline.images import to_uint8

    with Editor.from_model(model_dir, onnx_dir.parent.parent, width=32, height=32, steps=10, guidance=G,
                           backend="ort-cpu", store={"disk_dir": str(tmp_path / "bases")}) as ed:  # fmt: skip
        base = ed.generate(BASE, negative_prompt=TEST_BASE.negative_prompt, seed=TEST_BASE.seed)
        spec = {"directions": [{"prompt": INSERTED, "strength": 0.5}, {"prompt": DELETED}], "tail_steps": 4}
        (result,) = ed.edit(base, [spec])
        assert result.label == f"tail 4: {INSERTED} x0.5; {DELETED} x1"
        assert result.fields["Edit directions"] == f"{INSERTED} x0.5; {DELETED} x1" and result.fields["Edit strength"] == "0"
        with pytest.raises(EditorError) as err:
            ed.edit(base, [{"prompt": "x", "directions": [{"prompt": "a"}, {"prompt": "y" * 5000}]}])
        assert err.value.field == "edits[0].directions[1].prompt" and "longer than" in str(err.value)
    state = pipeline.generate_base(TEST_BASE)
    row = _row(Edit(directions=(Direction(INSERTED, 0.5), Direction(DELETED, 1.0)), tail_steps=4))
    (final,) = pipeline.run_tail(state, [row])
    alone = to_uint8(pipeline.decode(final[None])[0]).astype(np.int16)
    assert np.abs(result.array.astype(np.int16) - alone).max() <= 1


def test_edit_rt_run_labels_and_reports_directions(tmp_path, model_dir, onnx_dir):
    from PIL import Image

    from edit_rt.runtime.apps.run import run_config

    edits = [{"prompt": SAME_LENGTH, "strength": 0.5, "directions": [{"prompt": INSERTED, "strength": -0.5}], "tail_steps": 3},
             {"directions": [{"prompt": DELETED}], "tail_steps": 3}]  # fmt: skip
    cfg = {"model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path / "out"),
           "base": {"prompt": BASE, "negative_prompt": "blurry", "seed": 3, "steps": 10, "guidance": G, "width": 32,
                    "height": 32}, "edits": edits, "cache": {"default_strength": 1.5}}  # fmt: skip
    report = run_config(config_from_dict(cfg, tmp_path / "config.yaml"))
    first, second = report["edits"]
    assert first["label"] == f"x0.5 tail 3: {SAME_LENGTH} + {INSERTED} x-0.5"
    assert first["directions"] == [{"prompt": INSERTED, "strength": -0.5}]
    assert second["label"] == f"tail 3: {DELETED} x1.5" and (second["prompt"], second["strength"]) == (BASE, 0.0)
    text = Image.open(tmp_path / "out" / second["file"]).text["parameters"]
    assert parse_fields(text.split("\n")[-1])["Edit directions"] == f"{DELETED} x1.5"
