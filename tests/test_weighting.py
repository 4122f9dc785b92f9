"""AUTOMATIC1111's prompt weighting (runtime/model/weighting.py), against A1111's own algorithm.

- the parser against the examples A1111 documents (its doctests and its wiki's
  "Attention/emphasis" example, to the float) and against A1111's regex algorithm transcribed
  below, on a few thousand random prompts of the syntax's characters;
- the refusals: prompt editing and alternation on the examples of A1111's schedule doctests
  (and what its grammar leaves alone), AND, a trailing weight, BREAK, extra networks, a weight
  that is not a number;
- K/V: the pipeline's against an independent PyTorch reference (transformers' CLIPTextModel on
  the spans tokenized one by one with transformers' tokenizer, A1111's multiply-and-restore-mean
  in torch, the UNet's own attn2 ``to_k``/``to_v``), within 1e-5; a prompt without the syntax
  gives bit-identical K/V to the text graphs run on transformers' ids; SDXL per encoder, its
  pooled embedding unweighted;
- ``preserve: auto``'s token diff sees words and weights, not brackets;
- the doors: a weighted prompt through the AUTOMATIC1111 route keeps its text in the PNG's
  parameters, and prompt editing is a 400 that names it.
"""

from __future__ import annotations

import base64
import io
import random
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from edit_rt.runtime.errors import PromptSyntaxError
from edit_rt.runtime.model.align import token_diff
from edit_rt.runtime.model.weighting import (emphasize, encoder_widths, parse_attention, prompt_spans, schedule_at)  # fmt: skip

from .in_process_server import InProcessServer

# --- A1111's parse_prompt_attention, transcribed (modules/prompt_parser.py), the reference -----------

_RE_ATTENTION = re.compile(r"""
\\\(|
\\\)|
\\\[|
\\]|
\\\\|
\\|
\(|
\[|
:\s*([+-]?[.\d]+)\s*\)|
\)|
]|
[^\\()\[\]:]+|
:
""", re.X)  # fmt: skip


def a1111_parse_prompt_attention(text: str) -> list[list]:
    res, round_brackets, square_brackets = [], [], []

    def multiply_range(start, multiplier):
        for p in range(start, len(res)):
            res[p][1] *= multiplier

    for m in _RE_ATTENTION.finditer(text):
        text, weight = m.group(0), m.group(1)
        if text.startswith("\\"):
            res.append([text[1:], 1.0])
        elif text == "(":
            round_brackets.append(len(res))
        elif text == "[":
            square_brackets.append(len(res))
        elif weight is not None and round_brackets:
            multiply_range(round_brackets.pop(), float(weight))
        elif text == ")" and round_brackets:
            multiply_range(round_brackets.pop(), 1.1)
        elif text == "]" and square_brackets:
            multiply_range(square_brackets.pop(), 1 / 1.1)
        else:
            for i, part in enumerate(re.split(r"\s*\bBREAK\b\s*", text)):
                if i > 0:
                    res.append(["BREAK", -1])
                res.append([part, 1.0])
    for pos in round_brackets:
        multiply_range(pos, 1.1)
    for pos in square_brackets:
        multiply_range(pos, 1 / 1.1)
    if not res:
        res = [["", 1.0]]
    i = 0
    while i + 1 < len(res):
        if res[i][1] == res[i + 1][1]:
            res[i][0] += res[i + 1][0]
            res.pop(i + 1)
        else:
            i += 1
    return res


# --- 1. the parser ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("normal text", [("normal text", 1.0)]),
    ("an (important) word", [("an ", 1.0), ("important", 1.1), (" word", 1.0)]),
    ("(unbalanced", [("unbalanced", 1.1)]),
    ("\\(literal\\]", [("(literal]", 1.0)]),
    ("(unnecessary)(parens)", [("unnecessaryparens", 1.1)]),
    # the wiki's "Attention/emphasis" example, A1111's floats exactly
    ("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
     [("a ", 1.0), ("house", 1.5730000000000004), (" ", 1.1), ("on", 1.0), (" a ", 1.1), ("hill", 0.55),
      (", sun, ", 1.1), ("sky", 1.4641000000000006), (".", 1.1)]),
    ("((word))", [("word", 1.2100000000000002)]),
    ("[word]", [("word", 1 / 1.1)]),
    ("(word: 1.3 )", [("word", 1.3)]),
    ("a stray ) and ] and : stay", [("a stray ) and ] and : stay", 1.0)]),
    ("ratio 16:9)", [("ratio 16:9)", 1.0)]),
])  # fmt: skip
def test_parser_gives_a1111s_documented_weights(text, expected):
    assert parse_attention(text) == expected
    assert [tuple(s) for s in a1111_parse_prompt_attention(text)] == expected  # the transcription too


def test_parser_equals_a1111s_algorithm_on_random_prompts():
    rng = random.Random(0)
    alphabet = ["a", "b", "c ", " ", "(", ")", "[", "]", ":", "1.5", "0.", ".", "-2", "\\", "\\(", "\\]", ",", "1.2.3"]
    for _ in range(4000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        try:
            expected = [tuple(s) for s in a1111_parse_prompt_attention(text)]
        except ValueError:  # float("1.2.3"): A1111 fails; edit-rt refuses
            with pytest.raises(PromptSyntaxError, match="is not a number"):
                parse_attention(text)
            continue
        assert parse_attention(text) == expected, text


# --- refusals: what A1111 runs and edit-rt does not ----------------------------------------------------


@pytest.mark.parametrize("text,kind", [  # the prompts of A1111's schedule doctests
    ("a [b:3]", "prompt editing"),
    ("a [b: 3]", "prompt editing"),
    ("a [[[b]]:2]", "prompt editing"),
    ("[(a:2):3]", "prompt editing"),
    ("a [b : c : 1] d", "prompt editing"),
    ("a[b:[c:d:2]:1]e", "prompt editing"),
    ("a [b:.5] c", "prompt editing"),
    ("((a][:b:c [d:3]", "prompt editing"),
    ("[a|(b:1.1)]", "alternation"),
    ("[fe|]male", "alternation"),
    ("[fe|||]male", "alternation"),
    ("a [red:blue:0.5] car, (sky:1.2)", "prompt editing"),
    ("a [b::3] c", "prompt editing"),
])  # fmt: skip
def test_prompt_editing_and_alternation_are_refused(text, kind):
    found = schedule_at(text)
    assert found is not None and found[2] == kind
    with pytest.raises(PromptSyntaxError, match=kind):
        prompt_spans(text)


@pytest.mark.parametrize("text", [
    "test", "a [unbalanced", "a (red:1.3) car", "[a:b]", "[word]", "\\[a:3\\]", "(a:3)",
    "a | b [c:3]",  # a "|" outside brackets: A1111's grammar fails and it runs the prompt as written
    "a [{b|d{:.5] c",  # its doctest says "not handling this right now": its grammar of today fails on it
])  # fmt: skip
def test_what_a1111s_schedule_grammar_leaves_alone_is_emphasis(text):
    assert schedule_at(text) is None
    assert prompt_spans(text) == [tuple(s) for s in a1111_parse_prompt_attention(text)]


# What A1111's schedule grammar (modules/prompt_parser.py, run on lark 1.3.1 while writing this
# test: it is no dependency of edit-rt) says of random prompts of its characters: True where its
# parse has a scheduled or alternate node. schedule_at agreed with it on 8000 such prompts.
LARK_SAYS = [
    ("-1[\\[x|x].5", True), ("[-1]\\[-1-1)]][|]", True), ("[3|](\\[.5\\-1\\[][", True), (" b [:[|]\\   ", True),
    ("\\\\[3|]", True), ("))b [|]\\:", True), ("x\\x[|x]:[", True), (" [[.5\\[b \\[| ]", True),
    ("[\\( :-1])1e2", True), ("3\\\\[\\::1e2]-1", True), ("x]))[a:.5](", True), ("b 3[x1e231e2.5:-1]", True),
    ("x:a[\\\\[:-1.5]\\[", True), ("[:-1]-1-1]-13x 1e2", True), ("\\-1[:1e2]]x(.5-1", True),
    (" ].5ab \\[|b [", False), ("a(a|\\[ )] |", False), (":x[-1:)3b b |] ", False), ("x\\[\\\\[.5\\|]]]]", False),
    ("x [\\(||\\|", False), (".5x[ || aa\\-1", False), ("1e2b xx]\\[ax:.5a", False), ("[3]\\[):1e2a(\\[x", False),
    ("].5)[3):-1)31e2)", False), (" -1]:.5)-1.5-1][", False), ("\\[):1e2:x1e2x\\]", False), (")\\.5[(\\:3]", False),
]


@pytest.mark.parametrize("text,scheduled", LARK_SAYS)
def test_schedule_detection_agrees_with_a1111s_grammar(text, scheduled):
    assert (schedule_at(text) is not None) == scheduled


@pytest.mark.parametrize("text,needle", [
    ("a cat AND a dog", "`AND` combines prompts"),
    ("a cat :1.5", "trailing `:1.5`"),
    ("a cat BREAK a dog", "`BREAK` starts a second 75-token chunk"),
    ("(a BREAK b)", "`BREAK`"),
    ("a cat <lora:film:0.8>", "`<lora:film:0.8>` is an AUTOMATIC1111 extra network"),
    ("(a:1.2.3)", "the weight '1.2.3' is not a number"),
])  # fmt: skip
def test_syntax_edit_rt_does_not_run_is_refused_by_name(text, needle):
    with pytest.raises(PromptSyntaxError, match=re.escape(needle)):
        prompt_spans(text)


def test_negative_prompts_read_and_and_trailing_weights_as_text_as_a1111_does():
    assert prompt_spans("blurry AND dark", negative=True) == [("blurry AND dark", 1.0)]
    assert prompt_spans("blurry:2", negative=True) == [("blurry:2", 1.0)]
    assert prompt_spans("(blurry:1.2)", negative=True) == [("blurry", 1.2)]
    # a positive prompt's ":1" is A1111's identity weight: the text before it is encoded
    assert prompt_spans("a cat:1") == prompt_spans("a cat :1.0") == [("a cat", 1.0)]
    assert prompt_spans("a cat and a dog, break") == [("a cat and a dog, break", 1.0)]


# --- 2./3. K/V against PyTorch ------------------------------------------------------------------------


def a1111_chunk(tokenizer, text: str, negative: bool = False) -> tuple[list[int], list[float]]:
    """A1111's tokenize_line for one 77-token chunk: each span tokenized alone (transformers'
    tokenizer, no special tokens), weights per token; past 75 tokens truncated (diffusers' rule,
    which edit-rt follows where A1111 would start a second chunk)."""
    tokens, weights = [], []
    for span, weight in a1111_parse_prompt_attention(text):
        ids = tokenizer(span, truncation=False, add_special_tokens=False).input_ids
        tokens += ids
        weights += [weight] * len(ids)
    tokens, weights = tokens[:75], weights[:75]
    pad = 77 - 2 - len(tokens)
    return ([tokenizer.bos_token_id, *tokens, tokenizer.eos_token_id] + [tokenizer.pad_token_id] * pad,
            [1.0, *weights, 1.0] + [1.0] * pad)  # fmt: skip


def a1111_emphasis(z: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """sd_emphasis.EmphasisOriginal.after_transformers on one chunk's z [77, D]."""
    original_mean = z.mean()
    z = z * torch.asarray(weights).reshape(-1, 1).expand(z.shape)
    return z * (original_mean / z.mean())


def reference_kv(unet, z: torch.Tensor) -> list[np.ndarray]:
    """Every attn2 layer's to_k/to_v of z [77, D], in the step graph's layout (K [heads,
    head_dim, 77], V [heads, 77, head_dim]), in module order."""
    out = []
    for name, module in unet.named_modules():
        if name.endswith("attn2"):
            k, v = module.to_k(z), module.to_v(z)
            heads = module.heads
            out.append(k.reshape(77, heads, -1).permute(1, 2, 0).numpy())
            out.append(v.reshape(77, heads, -1).transpose(0, 1).numpy())
    return out


@pytest.fixture(scope="module")
def biased_dir(model_dir, tmp_path_factory):
    """The tiny model with a final layer norm that has a bias, as real CLIPs' have: the random
    one's is 0, which makes every token's hidden state mean 0 and A1111's mean restoration a
    ratio of two rounding errors (~1e-9)."""
    from transformers import CLIPTextModel

    out = tmp_path_factory.mktemp("models") / "tiny-sd-biased"
    shutil.copytree(model_dir, out)
    encoder = CLIPTextModel.from_pretrained(model_dir / "text_encoder")
    norm = getattr(encoder, "text_model", encoder).final_layer_norm
    with torch.no_grad():
        norm.bias.copy_(0.3 + 0.5 * torch.randn(norm.bias.shape, generator=torch.Generator().manual_seed(0)))
    encoder.save_pretrained(out / "text_encoder")
    return out


@pytest.fixture(scope="module")
def biased(biased_dir, tmp_path_factory):
    from edit_rt.export.compile.onnx_export import export_onnx
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    out = tmp_path_factory.mktemp("build") / "tiny-sd-biased" / "onnx"
    export_onnx(biased_dir, out)
    with EditPipeline(out, biased_dir) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def torch_sd(biased_dir):
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    return (CLIPTokenizer.from_pretrained(biased_dir / "tokenizer"), CLIPTextModel.from_pretrained(biased_dir / "text_encoder"),
            UNet2DConditionModel.from_pretrained(biased_dir / "unet"))  # fmt: skip


WEIGHTED = [
    "a (red:1.3) circle on a [blue] background",
    "((a green)) square, (top left:0.7)",
    "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
    "(a yellow triangle:-0.4), (unbalanced",
    "(" + "a long prompt of many words " * 6 + ":1.4) and a [tail] past the limit",  # > 75 tokens
]


@pytest.mark.parametrize("clip_skip", [0, 1])
def test_weighted_kv_equals_a1111s_rule_in_pytorch(biased, torch_sd, clip_skip):
    tokenizer, encoder, unet = torch_sd
    ours = biased.kv_from_prompts(WEIGHTED, clip_skip)
    norm = getattr(encoder, "text_model", encoder).final_layer_norm
    for b, text in enumerate(WEIGHTED):
        ids, weights = a1111_chunk(tokenizer, text)
        np.testing.assert_array_equal(biased.input_ids([text])[0], ids)  # the plain tokens
        with torch.no_grad():
            out = encoder(torch.tensor([ids]), output_hidden_states=True)
            z = out.last_hidden_state[0] if clip_skip == 0 else norm(out.hidden_states[-(clip_skip + 1)])[0]
            expected = reference_kv(unet, a1111_emphasis(z, weights))
        for got, want in zip(ours.tensors, expected, strict=True):
            np.testing.assert_allclose(got[b], want, atol=1e-5, rtol=0)
    # and the weighting did something: the plain text's K/V differ
    plain = biased.kv_from_prompts(["a red circle on a blue background"])
    assert np.abs(plain.tensors[0][0] - ours.tensors[0][0]).max() > 1e-2


def test_negative_prompts_are_weighted_too(biased, torch_sd):
    tokenizer, encoder, unet = torch_sd
    text = "(blurry:1.5), [dark]"
    (k0, *_) = biased.kv_from_prompts([text], negative=True).tensors
    ids, weights = a1111_chunk(tokenizer, text, negative=True)
    with torch.no_grad():
        expected = reference_kv(unet, a1111_emphasis(encoder(torch.tensor([ids])).last_hidden_state[0], weights))
    np.testing.assert_allclose(k0[0], expected[0], atol=1e-5, rtol=0)


def test_past_75_tokens_a_prompt_is_truncated_and_counted(pipeline, torch_sd):
    tokenizer = torch_sd[0]
    text = "(" + "word " * 100 + ":1.2) tail"
    tokens = sum(len(tokenizer(span, add_special_tokens=False).input_ids) for span, _ in a1111_parse_prompt_attention(text))
    ((got,),) = pipeline.text.weighted_ids([text])
    assert got.truncated == tokens - 75 > 0
    assert (got.weights[1:76] == np.float32(1.2)).all() and got.weights[0] == got.weights[76] == 1.0


def test_emphasis_restores_each_text_encoders_own_mean():
    """SDXL's hidden states are two encoders' side by side: A1111 weights each apart."""
    rng = np.random.default_rng(0)
    hidden = rng.normal(0.2, 1.0, (77, 12)).astype(np.float32)
    weights = np.ones(77, dtype=np.float32)
    weights[3:6], weights[9] = 1.3, 0.6
    expected = torch.cat([a1111_emphasis(torch.from_numpy(hidden[:, :5]), weights.tolist()),
                          a1111_emphasis(torch.from_numpy(hidden[:, 5:]), weights.tolist())], -1)  # fmt: skip
    np.testing.assert_allclose(emphasize(hidden, [weights, weights], [5, 7]), expected.numpy(), atol=1e-6, rtol=0)
    # an encoder's columns: those that move when only its ids change
    changed = [hidden.copy(), hidden.copy()]
    changed[0][4, :5] += 1
    changed[1][2:, 5:] -= 1
    assert encoder_widths(hidden, changed) == [5, 7]


def test_a_prompt_without_the_syntax_gives_bit_identical_kv(pipeline, torch_sd):
    """Today's path, rebuilt from its parts: transformers' ids, the text graph, kv_proj."""
    tokenizer = torch_sd[0]
    prompts = ["a red circle on a blue background", "", "A Blue SQUARE, top-left!  ", "x" * 200, "a cat and a dog, 16:9 wide"]
    ids = np.array(tokenizer(prompts, padding="max_length", max_length=77, truncation=True).input_ids, dtype=np.int64)
    hidden = np.ascontiguousarray(pipeline.graphs["text_encoder"].infer({"input_ids": ids})[0][:, 0])
    expected = pipeline.graphs["kv_proj"].infer({"hidden_states": hidden})
    for got, want in zip(pipeline.kv_from_prompts(prompts).tensors, expected, strict=True):
        np.testing.assert_array_equal(got, want)


# --- preserve: auto's diff ---------------------------------------------------------------------------


def _diff(pipeline, base: str, edit: str):
    (b, e) = pipeline.text.weighted_ids([base, edit])[0]
    return token_diff(b.ids, e.ids, pipeline.special_ids, b.weights, e.weights)


def test_token_diff_compares_words_not_brackets(pipeline):
    plain = _diff(pipeline, "a red car", "a blue car")
    assert not plain.unchanged
    assert _diff(pipeline, "a (red:1.3) car", "a (blue:1.3) car") == plain  # the one word, same positions
    # a changed weight changes that word's tokens (its K/V moved), and only them
    reweighted = _diff(pipeline, "a red car", "a (red:1.5) car")
    words = lambda text: sum(t not in pipeline.special_ids for t in pipeline.input_ids([text])[0])  # noqa: E731
    red = tuple(range(1 + words("a"), 1 + words("a red")))  # after BOS and "a"
    assert reweighted.edit_positions == reweighted.base_positions == red
    # brackets that leave the words and their weights alone change nothing
    assert _diff(pipeline, "a red car", "(a red car:1)").unchanged
    assert _diff(pipeline, "a (red) car", "a (red:1.1) car").unchanged


# --- SDXL: per encoder, pooled unweighted ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sdxl(sdxl_dir, sdxl_onnx_dir):
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    with EditPipeline(sdxl_onnx_dir, sdxl_dir) as pipe:
        yield pipe, sdxl_dir


@pytest.mark.slow
def test_sdxl_weights_each_encoder_apart_and_not_the_pooled_embedding(sdxl):
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    pipe, model = sdxl
    tok_1, tok_2 = (CLIPTokenizer.from_pretrained(model / name) for name in ("tokenizer", "tokenizer_2"))
    enc_1 = CLIPTextModel.from_pretrained(model / "text_encoder")
    enc_2 = CLIPTextModelWithProjection.from_pretrained(model / "text_encoder_2")
    unet = UNet2DConditionModel.from_pretrained(model / "unet")
    text = "a (red:1.3) circle on a [blue] background, ((sky))"
    ours = pipe.kv_from_prompts([text])
    assert pipe.text.text_widths(pipe.manifest.data["model"]["text_hidden_size"]) == [enc_1.config.hidden_size, enc_2.config.hidden_size]
    (ids_1, w_1), (ids_2, w_2) = a1111_chunk(tok_1, text), a1111_chunk(tok_2, text)
    with torch.no_grad():
        out_1 = enc_1(torch.tensor([ids_1]), output_hidden_states=True)
        out_2 = enc_2(torch.tensor([ids_2]), output_hidden_states=True)
        z = torch.cat([a1111_emphasis(out_1.hidden_states[-2][0], w_1), a1111_emphasis(out_2.hidden_states[-2][0], w_2)], -1)
        expected = reference_kv(unet, z)
    for got, want in zip(ours.tensors, expected, strict=True):
        np.testing.assert_allclose(got[0], want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours.extras["text_embeds"][0], out_2.text_embeds[0].numpy(), atol=1e-5, rtol=0)


# --- the doors --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    proc = InProcessServer(tmp_path_factory.mktemp("weighting"), model_dir, onnx_dir)
    yield proc
    assert proc.stop()


def test_a1111_route_runs_weighted_prompts_and_refuses_prompt_editing(server):
    body = {"prompt": "a (red:1.3) circle", "negative_prompt": "[blurry]", "steps": 4, "width": 32, "height": 32,
            "seed": 5}  # fmt: skip
    weighted = server.client.post("/sdapi/v1/txt2img", json=body, timeout=60)
    assert weighted.status_code == 200, weighted.text
    png = base64.b64decode(weighted.json()["images"][0])
    parameters = Image.open(io.BytesIO(png)).text["parameters"]
    assert parameters.startswith("a (red:1.3) circle\nNegative prompt: [blurry]\n")  # as written, as A1111 writes it
    plain = server.client.post("/sdapi/v1/txt2img", json={**body, "prompt": "a red circle"}, timeout=60)
    assert plain.json()["images"][0] != weighted.json()["images"][0]
    edited = server.client.post("/sdapi/v1/txt2img", json={**body, "prompt": "a [red:blue:2] circle"}, timeout=60)
    assert edited.status_code == 400
    assert "`[red:blue:2]` is AUTOMATIC1111's prompt editing" in edited.text
