"""Issue 56's text graphs on the TensorRT path, held to the simulated GPU (tests/fakegpu.py).

The plans are built by export/compile/text_engines.py through the builder that holds a build to
TensorRT's documented rules (fakegpu.FakeTrtBuilder: strongly typed, no precision flags, a profile
for every dynamic input with min <= opt <= max), and run by backend_trt.TrtGraph on the simulated
runtime, whose kernels are the ONNX graphs run by ONNX Runtime's CPU provider on the bytes found in
simulated device memory (a wrong shape, address, thread or order is a refusal or a wrong token).
The reference is ONNX Runtime's CPU provider on the same exported graphs, which
tests/test_text_model.py holds against the PyTorch model and LLaDA's decoding loop.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from edit_rt.export.compile.text_engines import text_trt_engines
from edit_rt.runtime.errors import ArtifactError, ConfigError
from edit_rt.runtime.model.text_manifest import TEXT_ENGINES_NAME
from edit_rt.runtime.pipeline.text_pipeline import Decoding, Row, Style, TextPipeline

from . import fakegpu
from .test_text_model import PROMPT, _text_config, text_models  # noqa: F401  (the session's random text models)

MAX_ROWS = 4


@pytest.fixture
def plans(gpu, text_models, tmp_path, monkeypatch):  # noqa: F811
    """Each kind's plans (max 4 rows a call) built through the rule-holding builder: {kind: engines dir}."""
    out = {}
    for kind in text_models:  # a builder each: a simulated plan holds its graph's copy, by file name
        builder = fakegpu.FakeTrtBuilder(tmp_path / kind / "plan-sources").install(monkeypatch)
        out[kind] = text_trt_engines(text_models[kind] / "onnx", tmp_path / kind / "trt", MAX_ROWS).parent
        assert sorted(builder.built) == ["text_cached", "text_full"]
    return out


def test_the_plans_give_onnx_runtimes_logits_and_kv(plans, text_models):
    rng = np.random.default_rng(0)
    onnx = text_models["mdm"] / "onnx"
    with TextPipeline(onnx, "trt", engines_dir=plans["mdm"]) as gpu_pipe, TextPipeline(onnx) as cpu_pipe:
        ids = rng.integers(3, 4096, (3, 40))
        for a, b in zip(gpu_pipe.full(ids, np.arange(40)), cpu_pipe.full(ids, np.arange(40))):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
        _, kv = cpu_pipe.full(ids[:1], np.arange(40))
        query = np.arange(10, 18)
        past = kv[:, :, :, :, np.setdiff1d(np.arange(40), query)]  # one row's cache broadcast over three
        for a, b in zip(gpu_pipe.cached(ids[:, query], query, past), cpu_pipe.cached(ids[:, query], query, past)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_decoding_on_the_plans_writes_onnx_runtimes_tokens(plans, text_models, cache):
    """Six continuations (past the plans' 4 rows a call: run in pieces), a span edit of five rows,
    a style pass of the six, and the autoregressive model's continuations, token for token as on
    ONNX Runtime's CPU provider."""
    decoding = Decoding(block_length=8, threshold=0.3, cache=cache, edit_threshold=0.9)
    rows = [Row(seed=k, temperature=0.7 if k % 2 else 0.0) for k in range(6)]
    results = {}
    for backend in ("trt", "ort-cpu"):
        with TextPipeline(text_models["mdm"] / "onnx", backend, engines_dir=plans["mdm"]) as pipe:
            done = pipe.complete(PROMPT, 16, decoding=decoding, rows=rows)
            edit = pipe.span_edit(done, 0, (2, 9), decoding, seeds=range(5), temperature=0.5)
            styled = pipe.style_pass(done, Style(edit_threshold=0.004, rounds=2, groups=2))  # 12 masked rows: 2 texts a call
        with TextPipeline(text_models["ar"] / "onnx", backend, engines_dir=plans["ar"]) as pipe:
            ar = pipe.complete(PROMPT, 12, rows=rows[:5])
        results[backend] = (done, edit, styled, ar)
    for gpu_result, cpu_result in zip(results["trt"], results["ort-cpu"]):
        for a, b in zip(gpu_result.ids, cpu_result.ids):
            np.testing.assert_array_equal(a, b)
    assert results["trt"][0].stats.forwards > results["ort-cpu"][0].stats.forwards  # six rows: two calls a step
    assert results["trt"][2].stats.edited > 0


def test_every_text_graph_call_runs_on_the_services_engine_thread(plans, text_models, tmp_path):
    """`edit-rt engines` of a text config builds its plans (the rule-holding builder), after which
    the config's ``backend: auto`` is trt; `edit-rt serve`'s TextService on it, asked from four
    threads at once: the contexts belong to the engine thread that made them (the simulator refuses
    any other thread's call), and each answer is ONNX Runtime's."""
    import asyncio

    from edit_rt.runtime.config.load import load_text_config
    from edit_rt.runtime.serving.text_service import TextService

    from .cli_in_process import edit_rt

    path = _text_config(tmp_path, text_models["mdm"] / "model", {"prompt": PROMPT, "max_tokens": 8})
    path.write_text(path.read_text().replace("backend: ort-cpu", "backend: auto"))
    config = load_text_config(path)
    shutil.copytree(text_models["mdm"] / "onnx", config.onnx_dir)  # the session's export, as `edit-rt export` writes it
    assert config.engine == "ort-cpu"  # no plans yet
    done = edit_rt("engines", str(path))
    assert done.returncode == 0 and "rows 1-16" in (done.stdout + done.stderr).replace("\n", ""), done.stdout + done.stderr
    assert config.engine == "trt"
    service = TextService(config)
    service.load()
    assert service.load_error is None, service.load_error
    prompts = [PROMPT, "def f(x):", "import os", "class A:"]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: asyncio.run(service.complete(p, 8, [Row(0), Row(1)], Decoding(block_length=8))), prompts))
    service.shutdown()
    with TextPipeline(text_models["mdm"] / "onnx") as cpu:
        for prompt, answer in zip(prompts, answers):
            assert answer.texts == cpu.complete(prompt, 8, n=2, decoding=Decoding(block_length=8)).texts


def test_missing_stale_or_foreign_plans_are_refused_naming_the_command(plans, text_models, tmp_path):
    onnx = text_models["mdm"] / "onnx"
    with pytest.raises(ArtifactError, match="edit-rt engines"):
        TextPipeline(onnx, "trt", engines_dir=tmp_path / "none")
    with pytest.raises(ArtifactError, match="is stale"):  # the ar model's plans are another graph's
        TextPipeline(onnx, "trt", engines_dir=plans["ar"])
    foreign = tmp_path / "foreign"
    shutil.copytree(plans["mdm"], foreign)
    record = json.loads((foreign / "trt" / TEXT_ENGINES_NAME).read_text())
    (foreign / "trt" / TEXT_ENGINES_NAME).write_text(json.dumps({**record, "device": "Another GPU"}))
    with pytest.raises(ArtifactError, match="Another GPU"):
        TextPipeline(onnx, "trt", engines_dir=foreign)


def test_trt_without_tensorrt_is_refused_naming_the_backends_that_run(text_models, tmp_path):
    with pytest.raises(ConfigError, match="backend: trt cannot start here .*ort-cpu or openvino"):
        TextPipeline(text_models["mdm"] / "onnx", "trt", engines_dir=tmp_path)


def test_the_prepared_gpu_checks_text_costs_run_here_on_the_cpu(text_models):
    """scripts/gpu_text_costs.py (gpu_check.sh's step 5, for a lent GPU) on this CPU: every call
    it times runs at the shapes it says, and the bounds are read from them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_text_costs.py"
    spec = importlib.util.spec_from_file_location("gpu_text_costs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.costs(text_models["mdm"] / "model", text_models["ar"] / "model", "cpu", __import__("torch").float32, 1,
                          rows=(1, 8), prompt=40, block=8, body=16)  # the random models' 96 positions
    ms = report["ms"]
    assert set(ms) == {"ar_step", "mdm_dual_step_1_rows", "mdm_dual_step_8_rows", "mdm_full_1_row"} and min(ms.values()) > 0
    assert report["batch_ceiling_8_rows"] == 8 * ms["mdm_dual_step_1_rows"] / ms["mdm_dual_step_8_rows"]
