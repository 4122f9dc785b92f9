"""Issue 56's text models through the compiled pipeline, on small random models of the trained
ones' shape (export/compile/text_model.py) built in the session with the committed corpus tokenizer.

Every promise against an independent reference: the graphs against the PyTorch model through
Polygraphy; masked-diffusion decoding with the cache off against a PyTorch loop written here as
LLaDA's published ``generate.py`` decodes (its schedule, its low-confidence remasking, its
Gumbel-max); autoregressive decoding with the K/V cache against greedy decoding in PyTorch that
recomputes every token; a span edit against the text outside it; batched rows against each alone.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator, CompareFunc

from edit_rt.export.compile.parity import TorchCpuRunner, ort_runner
from edit_rt.export.compile.text_export import export_text
from edit_rt.export.compile.text_model import TextSpec, TextTransformer, load_text_model, save_text_model
from edit_rt.runtime.loop.text_decoding import decode_autoregressive, decode_masked
from edit_rt.runtime.pipeline.text_pipeline import Decoding, TextPipeline

from .conftest import built_once

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "export" / "checkpoints" / "text-tokenizer" / "tokenizer.json"
SPEC = TextSpec(d_model=32, layers=2, heads=2, max_len=96)
PROMPT = ('def mean(values):\n    """The arithmetic mean of a non-empty sequence of numbers."""\n    total = 0\n'
          "    for value in values:\n")


def _tiny(folder: Path, causal: bool, seed: int) -> None:
    from tokenizers import Tokenizer

    torch.manual_seed(seed)
    model = TextTransformer(dataclasses.replace(SPEC, causal=causal, rope=not causal))  # as the trained ones
    with torch.no_grad():  # larger than the initialisation's 0.02, so that tokens differ in confidence
        for p in model.parameters():
            p.mul_(8.0 if p.dim() >= 2 else 1.0)
    save_text_model(folder / "model", model.eval(), Tokenizer.from_file(str(TOKENIZER)))
    export_text(folder / "model", folder / "onnx")


@pytest.fixture(scope="session")
def text_models(tmp_path_factory) -> dict[str, Path]:
    """A random masked-diffusion model and an autoregressive one: {kind: folder with model/ and onnx/}."""
    return {kind: built_once(tmp_path_factory, f"text-{kind}", lambda folder, c=causal, s=seed: _tiny(folder, c, s))
            for kind, causal, seed in (("mdm", False, 0), ("ar", True, 1))}  # fmt: skip


def _metadata(names_shapes) -> TensorMetadata:
    meta = TensorMetadata()
    for name, dtype, shape in names_shapes:
        meta.add(name, np.dtype(dtype), shape)
    return meta


@pytest.mark.parametrize("kind", ["mdm", "ar"])
def test_both_graphs_equal_the_pytorch_model_through_polygraphy(text_models, kind):
    folder = text_models[kind]
    model = load_text_model(folder / "model")
    rng = np.random.default_rng(0)
    s = model.spec
    ids = lambda n, lq: rng.integers(3, s.vocab_size, (n, lq)).astype(np.int64)  # noqa: E731
    full_data = [OrderedDict(input_ids=ids(n, lq), positions=np.arange(lq)) for n, lq in ((1, 7), (3, 20))]
    cached_data = [OrderedDict(input_ids=ids(n, lq), positions=np.arange(p, p + lq),
                               past_kv=rng.standard_normal((s.layers, 2, np_, s.heads, p, s.head_dim)).astype(np.float32))
                   for n, lq, p, np_ in ((1, 4, 9, 1), (3, 6, 5, 3), (4, 1, 12, 1))]  # fmt: skip
    for graph, data, inputs in (
        ("text_full", full_data, [("input_ids", np.int64, [None, None]), ("positions", np.int64, [None])]),
        ("text_cached", cached_data, [("input_ids", np.int64, [None, None]), ("positions", np.int64, [None]),
                                      ("past_kv", np.float32, [s.layers, 2, None, s.heads, None, s.head_dim])]),
    ):  # fmt: skip
        reference = TorchCpuRunner(model, _metadata(inputs), ["logits", "kv"])
        results = Comparator.run([ort_runner(folder / "onnx" / f"{graph}.onnx", "onnxrt"), reference], data_loader=data)
        assert bool(Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=1e-4, rtol=1e-3))), graph


def test_the_cached_graph_equals_the_full_one_on_the_same_text(text_models):
    """A masked-diffusion model's tokens over the K/V of the others, computed with them, are the
    whole text's logits (the cache holds K/V exactly as the full pass makes them)."""
    with TextPipeline(text_models["mdm"] / "onnx") as pipe:
        x = np.array([pipe.encode(PROMPT)[:30]])
        assert x.shape == (1, 30)
        logits, kv = pipe.full(x, np.arange(30))
        span = np.arange(12, 19)
        outside = np.setdiff1d(np.arange(30), span)
        cached, _ = pipe.cached(x[:, span], span, kv[:, :, :, :, outside])
        np.testing.assert_allclose(cached, logits[:, span], atol=1e-4, rtol=1e-4)


def llada_generate(model: TextTransformer, prompt: torch.Tensor, steps: int, gen_length: int, block_length: int,
                   temperature: float = 0.0, noise=None) -> torch.Tensor:  # fmt: skip
    """LLaDA's ``generate.py`` (low-confidence remasking, no CFG), on this model's call signature.
    ``noise(shape, mask_index)`` gives the uniform draws of its Gumbel-max (LLaDA:
    ``torch.rand_like``; only the draws at masked positions matter, the others are not taken)."""
    mask_id = model.spec.mask_id
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
    x[:, : prompt.shape[1]] = prompt
    num_blocks = gen_length // block_length
    steps = steps // num_blocks
    for num_block in range(num_blocks):
        lo, hi = prompt.shape[1] + num_block * block_length, prompt.shape[1] + (num_block + 1) * block_length
        block_mask_index = x[:, lo:hi] == mask_id
        mask_num = block_mask_index.sum(dim=1, keepdim=True)
        base, remainder = mask_num // steps, mask_num % steps
        num_transfer_tokens = base.expand(-1, steps).clone()
        for i in range(mask_num.size(0)):
            num_transfer_tokens[i, : remainder[i]] += 1
        for i in range(steps):
            mask_index = x == mask_id
            with torch.no_grad():
                logits, _ = model(x, torch.arange(x.shape[1]))
            if temperature == 0:
                x0 = torch.argmax(logits, dim=-1)
            else:
                wide = logits.to(torch.float64)
                x0 = torch.argmax(wide.exp() / (-torch.log(noise(wide.shape, mask_index))) ** temperature, dim=-1)
            p = torch.softmax(logits.to(torch.float64), dim=-1)
            x0_p = torch.gather(p, dim=-1, index=x0.unsqueeze(-1)).squeeze(-1)
            x0_p[:, hi:] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(-np.inf, dtype=torch.float64))
            transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(confidence.shape[0]):
                _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j, i]))
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
    return x


def test_masked_decoding_with_the_cache_off_is_lladas_generate(text_models):
    model = load_text_model(text_models["mdm"] / "model")
    with TextPipeline(text_models["mdm"] / "onnx") as pipe:
        prompt = pipe.encode(PROMPT)
        ids = torch.tensor([prompt, prompt[::-1]])  # two texts, so that rows differ from the first step
        reference = llada_generate(model, ids, steps=16, gen_length=32, block_length=16)
        x = np.concatenate([ids.numpy(), np.full((2, 32), SPEC.mask_id)], axis=1)
        ours, stats = decode_masked(pipe, x, np.arange(x.shape[1]) >= len(prompt), SPEC.mask_id, block_length=16, steps=16)
    np.testing.assert_array_equal(ours, reference.numpy())
    assert stats.forwards == 16 and stats.decoded == 64  # 2 tokens a step, 2 rows


def test_masked_decoding_at_a_temperature_is_lladas_gumbel_max(text_models):
    """Each row draws its noise from its own generator; LLaDA's loop given the same draws."""
    model = load_text_model(text_models["mdm"] / "model")
    with TextPipeline(text_models["mdm"] / "onnx") as pipe:
        prompt = pipe.encode(PROMPT)
        x = np.concatenate([[prompt], np.full((1, 16), SPEC.mask_id)], axis=1)
        region = np.arange(x.shape[1]) >= len(prompt)
        ours, _ = decode_masked(pipe, x, region, SPEC.mask_id, block_length=16, steps=8, temperature=0.8, seeds=[7])
        draws = np.random.default_rng(7)
        # our loop draws at the masked positions only: LLaDA's draws elsewhere are never taken
        noise = lambda shape, masked: torch.from_numpy(_padded_draws(draws, shape, masked[0].numpy()))  # noqa: E731
        reference = llada_generate(model, torch.tensor([prompt]), steps=8, gen_length=16, block_length=16, temperature=0.8, noise=noise)
    np.testing.assert_array_equal(ours, reference.numpy())


def _padded_draws(rng: np.random.Generator, shape, masked: np.ndarray) -> np.ndarray:
    """Uniform draws at the masked positions from ``rng`` (as our loop takes them), 0.5 elsewhere."""
    out = np.full(shape, 0.5)
    out[0, masked] = rng.random((int(masked.sum()), shape[-1]))
    return out


def test_a_span_edit_decodes_only_the_span_and_keeps_every_token_outside(text_models):
    with TextPipeline(text_models["mdm"] / "onnx") as pipe:
        base = pipe.complete(PROMPT, 32, decoding=Decoding(block_length=16, threshold=0.5, cache="none"))
        x = np.array(base.ids)
        span = np.zeros(x.shape[1], dtype=bool)
        span[base.starts[0] + 8: base.starts[0] + 14] = True
        x[:, span] = SPEC.mask_id
        for cache in ("none", "prefix", "dual"):
            edited, stats = decode_masked(pipe, x, span, SPEC.mask_id, threshold=0.5, edit_threshold=0.6, cache=cache, temperature=1.0,
                                          seeds=[3])  # fmt: skip
            np.testing.assert_array_equal(edited[:, ~span], x[:, ~span])
            assert (edited[:, span] != SPEC.mask_id).all() and stats.decoded == 6


def style_reference(model: TextTransformer, x: torch.Tensor, region: torch.Tensor, threshold: float, rounds: int,
                    groups: int) -> torch.Tensor:  # fmt: skip
    """A style pass on the PyTorch model, one masked text at a time, every token recomputed: each
    round, for each group g the region's positions i with i % groups == g masked and predicted
    (argmax, the mask id never taken); every region token whose prediction is another token with
    probability >= ``threshold`` becomes it; a round that changes nothing ends the pass."""
    x = x.clone()
    where = torch.nonzero(region).flatten()
    for _ in range(rounds):
        predicted, confidence = x.clone(), torch.zeros(x.shape, dtype=torch.float64)
        for g in range(groups):
            masked = x.clone()
            masked[:, where[g::groups]] = model.spec.mask_id
            with torch.no_grad():
                logits, _ = model(masked, torch.arange(x.shape[1]))
            logits = logits.double()
            logits[..., model.spec.mask_id] = -float("inf")
            p, t = torch.softmax(logits, -1).max(-1)
            predicted[:, where[g::groups]] = t[:, where[g::groups]]
            confidence[:, where[g::groups]] = p[:, where[g::groups]]
        change = region[None] & (predicted != x) & (confidence >= threshold)
        if not change.any():
            break
        x = torch.where(change, predicted, x)
    return x


def test_a_style_pass_reads_every_token_again_masked_and_keeps_the_prompt(text_models):
    """Every continuation of a batch re-read whole: with the cache off, the PyTorch loop above
    (with or without an instruction line, which does not come back); the prompt and what follows a
    row's end kept under the prefix cache too; an autoregressive model refused."""
    from edit_rt.runtime.errors import RequestError
    from edit_rt.runtime.pipeline.text_pipeline import Style

    model = load_text_model(text_models["mdm"] / "model")
    with TextPipeline(text_models["mdm"] / "onnx") as pipe:
        base = pipe.complete(PROMPT, 24, n=3, decoding=Decoding(block_length=8, threshold=0.5, cache="none", temperature=1.0))
        # the random model's masked predictions peak near 0.005 over 4,096 ids: 0.004 makes it edit
        for instruction in (None, "# one line each"):
            styled = pipe.style_pass(base, Style(edit_threshold=0.004, rounds=3, groups=3, cache="none", instruction=instruction))
            head = pipe.encode(instruction + "\n") if instruction else []
            for k in range(3):
                x = torch.tensor([head + list(base.ids[k])])
                region = torch.zeros(x.shape[1], dtype=torch.bool)
                region[len(head) + base.starts[k]: len(head) + base.starts[k] + base.tokens[k]] = True
                expected = style_reference(model, x, region, 0.004, 3, 3)[0, len(head):].numpy()
                np.testing.assert_array_equal(styled.ids[k], expected)
            assert styled.stats.edited > 0  # the pass changed tokens: the comparison is not of unchanged texts
        styled = pipe.style_pass(base, Style(edit_threshold=0.004, rounds=3, cache="prefix"))
        assert styled.stats.edited > 0
        for k in range(3):
            kept = np.ones(len(base.ids[k]), dtype=bool)
            kept[base.starts[k]: base.starts[k] + base.tokens[k]] = False
            np.testing.assert_array_equal(styled.ids[k][kept], base.ids[k][kept])
    with TextPipeline(text_models["ar"] / "onnx") as pipe:
        with pytest.raises(RequestError, match="autoregressive"):
            pipe.style_pass(pipe.complete(PROMPT, 4))


def test_streamed_texts_are_prefixes_of_the_final_ones_block_by_block(text_models):
    """``on_text`` (the stream of /v1/completions): a masked-diffusion call reports each row as its
    blocks finish, an autoregressive one token by token; every text reported is a prefix of the
    row's final text, with stop strings that may begin at a block's end; what it raises ends the call."""
    for kind, expect_calls in (("mdm", 4), ("ar", 16)):
        with TextPipeline(text_models[kind] / "onnx") as pipe:
            free = pipe.complete(PROMPT, 16, n=2, decoding=Decoding(block_length=4, threshold=0.3, temperature=1.0))
            stops = [free.texts[0][5:9], free.texts[1][-3:]]  # inside the texts: the stream must not pass them
            seen: dict = {0: [], 1: []}
            done = pipe.complete(PROMPT, 16, n=2, decoding=Decoding(block_length=4, threshold=0.3, temperature=1.0), stop=stops,
                                 on_text=lambda k, text: seen[k].append(text))  # fmt: skip
            for k in (0, 1):
                assert seen[k] and all(done.texts[k].startswith(t) for t in seen[k]), (kind, seen[k], done.texts[k])
                assert all(len(a) < len(b) for a, b in zip(seen[k], seen[k][1:]))
                assert len(seen[k]) <= expect_calls
            calls = []

            def leave(k, text):
                calls.append(pipe)
                raise KeyboardInterrupt

            with pytest.raises(KeyboardInterrupt):
                pipe.complete(PROMPT, 16, decoding=Decoding(block_length=4, threshold=0.3, temperature=1.0), on_text=leave)
            assert len(calls) == 1


def test_batched_rows_equal_each_row_alone(text_models):
    with TextPipeline(text_models["mdm"] / "onnx") as pipe:
        decoding = Decoding(block_length=8, threshold=0.3, edit_threshold=0.7, cache="prefix", temperature=0.9)
        together = pipe.complete(PROMPT, 24, n=3, decoding=decoding, seeds=[11, 12, 13])
        alone = [pipe.complete(PROMPT, 24, n=1, decoding=decoding, seeds=[s]) for s in (11, 12, 13)]
    assert len({tuple(r) for r in together.ids}) > 1  # the seeds made different texts
    for k, one in enumerate(alone):
        np.testing.assert_array_equal(together.ids[k], one.ids[0])


def test_autoregressive_decoding_with_its_cache_is_greedy_decoding_in_pytorch(text_models):
    model = load_text_model(text_models["ar"] / "model")
    with TextPipeline(text_models["ar"] / "onnx") as pipe:
        prompt = pipe.encode(PROMPT)
        out, stats = decode_autoregressive(pipe, np.array(prompt), 20, SPEC.eos_id, rows=2)
        ids = torch.tensor([prompt])
        for _ in range(20):  # no cache: every token computed again each step
            with torch.no_grad():
                logits, _ = model(ids, torch.arange(ids.shape[1]))
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    reference = ids[0, len(prompt):].numpy()
    end = int(np.argmax(reference == SPEC.eos_id)) + 1 if (reference == SPEC.eos_id).any() else 20
    np.testing.assert_array_equal(out[:, :end], np.tile(reference[:end], (2, 1)))
    assert stats.forwards == end


def test_threshold_zero_decodes_a_block_in_one_step_as_the_models_argmax(text_models):
    """Parallel decoding at threshold 0 takes every masked token of a block at once: the
    PyTorch model's argmax over the masked text."""
    model = load_text_model(text_models["mdm"] / "model")
    with TextPipeline(text_models["mdm"] / "onnx") as pipe:
        prompt = pipe.encode(PROMPT)
        x = np.concatenate([[prompt], np.full((1, 12), SPEC.mask_id)], axis=1)
        ours, stats = decode_masked(pipe, x, np.arange(x.shape[1]) >= len(prompt), SPEC.mask_id, threshold=0.0)
    with torch.no_grad():
        logits, _ = model(torch.from_numpy(x), torch.arange(x.shape[1]))
    np.testing.assert_array_equal(ours[0, len(prompt):], logits[0, len(prompt):].argmax(-1).numpy())
    assert stats.forwards == 1


def test_openvino_runs_the_same_graphs_to_the_same_tokens(text_models):
    """OpenVINO's CPU plugin on the exported graphs (compiled once, dynamic: a decoding step's
    shapes change every step): ONNX Runtime's logits to fp32 noise, the same decoded tokens."""
    pytest.importorskip("openvino", reason="OpenVINO is an optional engine (pip install 'edit-rt[openvino]')")
    decoding = Decoding(block_length=8, threshold=0.4, cache="dual")
    results = {}
    for backend in ("ort-cpu", "openvino"):
        with TextPipeline(text_models["mdm"] / "onnx", backend=backend) as pipe:
            x = np.array([pipe.encode(PROMPT)])
            results[backend] = (pipe.full(x, np.arange(x.shape[1]))[0], np.array(pipe.complete(PROMPT, 16, n=2, decoding=decoding).ids))
    np.testing.assert_allclose(results["openvino"][0], results["ort-cpu"][0], atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(results["openvino"][1], results["ort-cpu"][1])


def _text_config(tmp_path: Path, model: Path, text: dict) -> Path:
    import yaml

    path = tmp_path / "text.yaml"
    path.write_text(yaml.safe_dump({"model": str(model), "build_dir": str(tmp_path / "build"), "output_dir": str(tmp_path / "out"),
                                    "backend": "ort-cpu", "threads": 1, "text": text}))  # fmt: skip
    return path


def test_edit_rt_export_and_run_a_text_config_write_lladas_tokens_and_a_span_edit(tmp_path, text_models):
    """`edit-rt export` and `edit-rt run` on a text config: the first row (one token a step, the
    cache off) is LLaDA's generate.py on the PyTorch model; a second row with an instruction line
    runs beside it; a span edit of lines keeps the text outside the lines it re-decodes."""
    from .cli_in_process import edit_rt

    config = _text_config(tmp_path, text_models["mdm"] / "model", {
        "prompt": PROMPT, "max_tokens": 16, "block_length": 8, "threshold": None, "steps": 16, "cache": "none",
        "rows": [{"seed": 0}, {"seed": 1, "instruction": "# Python 3"}], "edits": [{"lines": [0, 1], "seed": 4, "temperature": 1.0}],
        "style": {"edit_threshold": 0.004, "rounds": 2, "groups": 2, "cache": "none"},
    })  # fmt: skip
    for command in ("export", "run"):
        done = edit_rt(command, str(config))
        assert done.returncode == 0, done.stdout + done.stderr
    import json

    report = json.loads((tmp_path / "out" / "text.json").read_text())
    model = load_text_model(text_models["mdm"] / "model")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    prompt = tokenizer.encode(PROMPT).ids
    reference = llada_generate(model, torch.tensor([prompt]), steps=16, gen_length=16, block_length=8)[0, len(prompt):].tolist()
    if SPEC.eos_id in reference:
        reference = reference[: reference.index(SPEC.eos_id)]
    assert report["rows"][0]["text"] == tokenizer.decode(reference)
    assert (tmp_path / "out" / "row-1.txt").read_text().startswith("# Python 3\n" + PROMPT)
    edit = report["edits"][0]
    first_line_end = report["rows"][0]["text"].find("\n")
    a, b = edit["span_tokens"]
    kept_before = tokenizer.decode(reference[:a])
    assert edit["text"].startswith(kept_before) and edit["text"].endswith(tokenizer.decode(reference[b:]))
    assert a == 0 and (first_line_end < 0 or len(tokenizer.decode(reference[:b])) > first_line_end)
    # the style pass over the first row: the PyTorch loop over LLaDA's continuation
    x = torch.tensor([prompt + reference])
    region = torch.arange(x.shape[1]) >= len(prompt)
    styled = style_reference(model, x, region, 0.004, 2, 2)[0, len(prompt):].tolist()
    assert report["style"][0]["text"] == tokenizer.decode(styled) and (tmp_path / "out" / "style-0.txt").is_file()
    assert report["style"][0]["changed"] == sum(a != b for a, b in zip(styled, reference)) > 0


def test_a_text_config_is_refused_with_the_field_and_the_fix(tmp_path, text_models):
    from .cli_in_process import edit_rt

    cases = [({"prompt": PROMPT, "threshold": 0.9, "steps": 8}, "text.threshold / text.steps"),
             ({"prompt": PROMPT, "cache": "all"}, "text.cache"),
             ({"prompt": PROMPT, "edits": [{"tokens": [4, 2]}]}, "text.edits[0].tokens"),
             ({"prompt": PROMPT, "temprature": 1.0}, "text.temprature: unknown key")]  # fmt: skip
    for text, named in cases:
        done = edit_rt("run", str(_text_config(tmp_path, text_models["mdm"] / "model", text)))
        assert done.returncode != 0 and named in done.stdout + done.stderr, (named, done.stdout + done.stderr)
    done = edit_rt("run", str(_text_config(tmp_path, text_models["mdm"] / "model", {"prompt": PROMPT})))
    assert done.returncode != 0 and "edit-rt export" in done.stdout + done.stderr  # not exported yet


def test_openais_sdk_completes_through_a_real_text_server(tmp_path, text_models):
    """`edit-rt serve` of a text config on loopback, called by the ``openai`` SDK: n continuations
    (at temperature 0 and threshold 0 each is the PyTorch model's argmax over the masked text),
    streamed or not, stop strings, and the server's limits as OpenAI-shaped errors."""
    import os
    import subprocess
    import sys

    import openai
    import yaml

    from edit_rt.export.bench.related_replay import free_port, terminate, wait_healthy

    from .cli_in_process import edit_rt

    port = free_port()
    config = _text_config(tmp_path, text_models["mdm"] / "model", {"prompt": "unused", "block_length": 12})
    data = yaml.safe_load(config.read_text())
    data["serve"] = {"port": port, "max_edits_per_request": 4}
    config.write_text(yaml.safe_dump(data))
    assert edit_rt("export", str(config)).returncode == 0
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edit_rt.runtime.apps.cli", "serve", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log, 90)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["model"]
        answer = client.completions.create(model="model", prompt=PROMPT, n=3, max_tokens=12, temperature=0,
                                           extra_body={"threshold": 0.0, "cache": "none"})  # fmt: skip
        model = load_text_model(text_models["mdm"] / "model")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(TOKENIZER))
        prompt = tokenizer.encode(PROMPT).ids
        x = torch.tensor([prompt + [SPEC.mask_id] * 12])
        with torch.no_grad():
            argmax = model(x, torch.arange(x.shape[1]))[0][0, len(prompt):].argmax(-1).tolist()
        expected = tokenizer.decode(argmax[: argmax.index(SPEC.eos_id)] if SPEC.eos_id in argmax else argmax)
        assert [c.text for c in answer.choices] == [expected] * 3 and [c.index for c in answer.choices] == [0, 1, 2]
        assert answer.usage.prompt_tokens == len(prompt) and answer.object == "text_completion"
        styled = client.completions.create(model="model", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={
            "threshold": 0.0, "cache": "none", "style": {"edit_threshold": 0.004, "rounds": 2, "groups": 2, "cache": "none"}})
        kept = len(argmax[: argmax.index(SPEC.eos_id)] if SPEC.eos_id in argmax else argmax)
        region = (torch.arange(x.shape[1]) >= len(prompt)) & (torch.arange(x.shape[1]) < len(prompt) + kept)
        restyled = style_reference(model, torch.tensor([prompt + argmax]), region, 0.004, 2, 2)[0, len(prompt):].tolist()
        assert styled.choices[0].text == tokenizer.decode(restyled[:kept]) != expected
        stop = expected[3:6]
        cut = client.completions.create(model="model", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                        extra_body={"threshold": 0.0, "cache": "none"})  # fmt: skip
        assert cut.choices[0].text == expected[: expected.index(stop)] and cut.choices[0].finish_reason == "stop"
        streamed, events, reasons = {}, 0, {}
        for chunk in client.completions.create(model="model", prompt=PROMPT, n=2, max_tokens=12, temperature=0.9, seed=5,
                                               stream=True, extra_body={"block_length": 4}):  # fmt: skip
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
                events += bool(c.text)
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
        sampled = client.completions.create(model="model", prompt=PROMPT, n=2, max_tokens=12, temperature=0.9, seed=5,
                                            extra_body={"block_length": 4})  # fmt: skip
        assert streamed == {c.index: c.text for c in sampled.choices}  # the same seeds: the same texts, streamed or not
        assert reasons == {c.index: c.finish_reason for c in sampled.choices}
        assert events > 2  # block by block (three blocks of 4), not one event a choice
        with pytest.raises(openai.APIStatusError) as too_many:
            client.completions.create(model="model", prompt=PROMPT, n=5, max_tokens=4)
        assert too_many.value.status_code == 413 and "max_edits_per_request" in str(too_many.value)
        with pytest.raises(openai.BadRequestError) as other:
            client.completions.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT, max_tokens=4)
        assert "model" in str(other.value)
        with pytest.raises(openai.BadRequestError) as long:
            client.completions.create(model="model", prompt=PROMPT, max_tokens=SPEC.max_len)
        assert "max_tokens" in str(long.value)
        # edit-rt's span edit door: the client's completion, its first line decoded again 3 ways
        import httpx

        url = f"http://127.0.0.1:{port}/v1/text/edits"
        sent = {"prompt": PROMPT, "completion": expected, "lines": [0, 1], "n": 3, "seed": 2, "threshold": 0.5, "cache": "dual"}
        edits = httpx.post(url, json=sent, timeout=60).json()
        a, b = edits["span_tokens"]
        ids = tokenizer.encode(expected).ids
        before, after = tokenizer.decode(ids[:a]), tokenizer.decode(ids[b:])
        texts = [c["text"] for c in edits["choices"]]
        assert all(t.startswith(before) and t.endswith(after) for t in texts) and len(set(texts)) > 1, (texts, before, after)
        for wrong, field in (({"chars": [0, 2]}, "lines / chars"), ({"lines": None, "chars": [9000, 9001]}, "chars"),
                             ({"n": 5}, "max_edits_per_request"), ({"lines": None}, "no span and no style"),
                             ({"lines": [2, 1]}, "lines: lines [2, 1] hold none")):  # fmt: skip
            answer = httpx.post(url, json={**sent, **wrong}, timeout=60)
            assert answer.status_code in (400, 413) and field in answer.text, (wrong, answer.text)
    finally:
        terminate(proc, 30)


def test_the_python_api_completes_edits_and_refuses_as_the_server_does(tmp_path, text_models):
    from edit_rt.runtime.apps.text_editor import TextEditor
    from edit_rt.runtime.errors import RequestError, TooLargeError

    from .cli_in_process import edit_rt

    config = _text_config(tmp_path, text_models["mdm"] / "model", {"prompt": "unused", "max_tokens": 10, "block_length": 10,
                                                                     "threshold": 0.0, "cache": "none"})  # fmt: skip
    assert edit_rt("export", str(config)).returncode == 0
    model = load_text_model(text_models["mdm"] / "model")
    with TextEditor.from_config(config) as ed:
        done = ed.complete(PROMPT, n=2)
        prompt = ed.service.encode(PROMPT)
        x = torch.tensor([prompt + [SPEC.mask_id] * 10])
        with torch.no_grad():
            argmax = model(x, torch.arange(x.shape[1]))[0][0, len(prompt):].argmax(-1).numpy()
        for row in done.ids:  # threshold 0: one step, every masked token the model's argmax
            np.testing.assert_array_equal(row[len(prompt):], argmax)
        edited = ed.edit(done, 1, tokens=(3, 6), seeds=[1, 2], temperature=1.0, threshold=0.5)
        for row in edited.ids:
            kept = np.ones(len(row), dtype=bool)
            kept[len(prompt) + 3: len(prompt) + 6] = False
            np.testing.assert_array_equal(row[kept], done.ids[1][kept])
        with pytest.raises(TooLargeError) as refused:
            ed.complete(PROMPT, n=65)
        assert refused.value.field == "n"
        styled = ed.style(done, edit_threshold=0.004, rounds=1, groups=2, cache="none")  # the PyTorch loop's, as above
        for k in range(2):
            region = torch.arange(len(done.ids[k])) >= len(prompt)
            region &= torch.arange(len(done.ids[k])) < len(prompt) + done.tokens[k]
            expected = style_reference(model, torch.tensor(done.ids[k][None]), region, 0.004, 1, 2)[0].numpy()
            np.testing.assert_array_equal(styled.ids[k], expected)
        with pytest.raises(RequestError) as refused:
            ed.style(done, edit_threshold=0.0)
        assert refused.value.field == "style.edit_threshold"


def test_text_training_cut_into_pieces_ends_with_the_weights_of_one_uncut_run(tmp_path):
    """`make train-text`'s pieces: a run stopped after each step and resumed from its checkpoint
    (weights, optimiser, schedule, the batches' generator) ends where an uncut run ends."""
    from safetensors.torch import load_file

    from edit_rt.export.world.text_corpus import corpus_files, split
    from edit_rt.export.world.train_text import TextTrainSpec, train_text

    train, held = split(corpus_files())
    files = (train[:6], held[:2])
    spec = TextTrainSpec(kind="mdm", steps=3, batch=2, d_model=32, layers=1, heads=2, max_len=32, eval_every=2, eval_windows=2,
                         checkpoint_every=1, warmup=2, rope=True)  # fmt: skip
    uncut = train_text(tmp_path / "uncut", spec, say=lambda _: None, tokenizer_dir=TOKENIZER.parent, files=files)
    for _ in range(3):  # each piece ends at its first step past 0 minutes
        cut = train_text(tmp_path / "cut", spec, say=lambda _: None, checkpoint=tmp_path / "state", piece_minutes=1e-9,
                         tokenizer_dir=TOKENIZER.parent, files=files)  # fmt: skip
        assert (cut["finished"], cut["ended"]) == (cut["steps_run"] == 3, "steps" if cut["steps_run"] == 3 else "piece")
    cut = train_text(tmp_path / "cut", spec, say=lambda _: None, checkpoint=tmp_path / "state", tokenizer_dir=TOKENIZER.parent,
                     files=files)  # fmt: skip
    assert uncut["finished"] and cut["finished"] and cut["steps_run"] == uncut["steps_run"] == 3
    a, b = load_file(str(tmp_path / "uncut" / "model.safetensors")), load_file(str(tmp_path / "cut" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
    assert cut["loss"] == uncut["loss"]
    # a run whose minutes are spent is over (finished, "budget"), not a piece to resume
    spent = train_text(tmp_path / "spent", dataclasses.replace(spec, max_minutes=1e-9), say=lambda _: None,
                       tokenizer_dir=TOKENIZER.parent, files=files)  # fmt: skip
    assert (spent["finished"], spent["ended"]) == (True, "budget") and spent["steps_run"] < 3


def test_docs_text_md_names_every_text_field_with_its_default():
    """docs/text.md's `text:` table against config/text.py's declarations: every key, no other,
    each default as declared."""
    import dataclasses as dc

    from edit_rt.runtime.config.text import TextSection

    rows = {}
    for line in (ROOT / "docs" / "text.md").read_text().split("## Config reference", 1)[1].splitlines():
        if line.startswith("| `"):
            key, default = [cell.strip() for cell in line.strip("|").split("|")[:2]]
            rows[key.strip("`")] = default
    fields = {f.name: f for f in dc.fields(TextSection)}
    assert set(rows) == set(fields)
    for name, f in fields.items():
        if f.default is dc.MISSING and f.default_factory is dc.MISSING:
            assert rows[name] == "required", name
            continue
        default = f.default if f.default is not dc.MISSING else f.default_factory()
        assert rows[name].strip("`") == _written(default), name


def _written(value) -> str:
    """A default as the docs' table writes it (YAML's words, whole numbers without a point)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, float) and value == int(value):
        return str(int(value))
    if isinstance(value, list):
        return "[" + ", ".join("{seed: %d}" % r.seed if hasattr(r, "seed") else str(r) for r in value) + "]"
    return str(value)
