"""The ``openvino`` backend (issue 40): OpenVINO's CPU plugin on the exported ONNX graphs.

tests/test_pipeline.py, test_families.py (SD 2.x, SDXL) and test_samplers_pipeline.py (every
sampler, v-prediction) run their exactness promises against diffusers on it (fp32) beside
``ort-cpu`` in make test-all; the default run holds it here by every graph of each family against
its PyTorch source and one generation per family against diffusers. Here too: its precision is
what the config says and what OpenVINO itself reports after compiling (fp32 pinned on a CPU whose
default is bf16; in bf16 the guidance and sampler update still fp32), shapes are compiled static
per row bucket, bf16 is refused with the reason on a CPU without it (the CPU's flags simulated),
and bf16 stays near fp32 on the same base.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from edit_rt.runtime.engine import backend_ov
from edit_rt.runtime.errors import ConfigError
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline, TailRow

from .conftest import TEST_BASE

ov = pytest.importorskip("openvino", reason="the openvino extra is not installed")
HAS_BF16 = backend_ov.bf16_unavailable_reason() is None
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="this CPU has neither avx512_bf16 nor amx_bf16")

# /proc/cpuinfo of a CPU with AVX-512 but no bf16 (Skylake-SP), and of one with AMX (Sapphire Rapids)
SKYLAKE = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n"


def _runtime_precisions(compiled, names: set[str]) -> dict[str, set[str]]:
    """OpenVINO's own report of what each executed node computes in: layer type -> precisions,
    over the executed nodes made from the original nodes ``names``."""
    out: dict[str, set[str]] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if set(info["originalLayersNames"].astype(str).split(",")) & names:
            out.setdefault(info["layerType"].astype(str), set()).add(info["runtimePrecision"].astype(str))
    return out


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    (tmp_path / "skylake").write_text(SKYLAKE)
    (tmp_path / "spr").write_text(SAPPHIRE)
    assert "avx512f" in backend_ov.cpu_flags(tmp_path / "skylake")
    assert backend_ov.bf16_unavailable_reason(backend_ov.cpu_flags(tmp_path / "skylake")) is not None
    assert backend_ov.bf16_unavailable_reason(backend_ov.cpu_flags(tmp_path / "spr")) is None
    assert backend_ov.cpu_flags(tmp_path / "missing") == set()


def test_bf16_is_refused_with_the_reason_on_a_cpu_without_it(onnx_dir, model_dir, monkeypatch, tmp_path):
    (tmp_path / "cpuinfo").write_text(SKYLAKE)
    read = backend_ov.cpu_flags
    monkeypatch.setattr(backend_ov, "cpu_flags", lambda: read(tmp_path / "cpuinfo"))
    with pytest.raises(ConfigError) as err:
        EditPipeline(onnx_dir, model_dir, backend="openvino", precision="bf16")
    message = str(err.value)
    assert message.startswith("engines.precision: bf16 cannot run here")
    assert "avx512_bf16" in message and "amx_bf16" in message and "engines.precision: fp32" in message
    # fp32 still runs on that CPU
    with EditPipeline(onnx_dir, model_dir, backend="openvino", precision="fp32") as pipe:
        assert pipe.graphs["unet_step"].precision == "fp32"


def test_bf16_is_for_openvino_only(onnx_dir, model_dir):
    with pytest.raises(ConfigError, match="bf16 runs on backend: openvino only"):
        EditPipeline(onnx_dir, model_dir, backend="ort-cpu", precision="bf16")


def test_openvino_starts_here_but_auto_keeps_ort_cpu():
    """openvino is listed (its CPU plugin loads) and taken by name; auto's CPU engine stays
    ort-cpu (as fast at fp32, in less memory: docs/engines.md)."""
    from edit_rt.runtime.engine.backend import backend_report, select_backend

    report = backend_report()
    assert report["openvino"] == (True, "OpenVINO's CPU plugin loads")
    assert select_backend("auto", set())[0] == "ort-cpu"
    assert select_backend("openvino", set()) == ("openvino", "chosen in the config")


@pytest.fixture(scope="module")
def fp32(onnx_dir, model_dir):
    with EditPipeline(onnx_dir, model_dir, backend="openvino", precision="fp32") as pipe:
        yield pipe


def test_fp32_is_pinned_and_shapes_are_static_per_bucket(fp32):
    state = fp32.generate_base(TEST_BASE)
    fp32.run_tail(state, [TailRow("a blue square", 1.0, 5, TEST_BASE.guidance) for _ in range(3)])
    step = fp32.graphs["unet_step"]
    shapes = list(step._compiled.values())
    assert shapes, "the step graph was never compiled"
    for compiled in shapes:
        # OpenVINO's default on a bf16 CPU is bf16: the compiled model must say f32
        assert str(compiled.get_property("INFERENCE_PRECISION_HINT")) == "<Type: 'float32'>"
        assert all(i.get_partial_shape().is_static for i in compiled.inputs)
    rows = sorted({c.input("latents").get_shape()[0] for c in shapes})
    assert 4 in rows and 3 not in rows, f"3 rows run at the pow2 bucket of 4, not their own shape: {rows}"


def test_a_graph_past_the_weights_limit_is_compiled_once_dynamic(onnx_dir, model_dir, pipeline, base_state, monkeypatch):
    """SD 1.5's UNet would hold a copy of its 3.4 GB of weights per compiled bucket: a graph past
    the limit is compiled once with its dynamic axes (the step loop then runs exact row counts,
    as on ort-cpu), and still equals ONNX Runtime (the session's ort-cpu pipeline and base)."""
    monkeypatch.setattr(backend_ov.OvGraph, "STATIC_WEIGHTS_LIMIT", 0)
    rows = [TailRow("a blue square", 1.0, 4, TEST_BASE.guidance), TailRow("a green circle", 0.5, 7, 3.0),
            TailRow("a blue square", 1.0, 6, TEST_BASE.guidance, seed=11)]  # fmt: skip
    assert pipeline.graph_set.backend == "ort-cpu"
    state, expected = base_state, pipeline.run_tail(base_state, rows)
    with EditPipeline(onnx_dir, model_dir, backend="openvino") as pipe:
        ours = pipe.run_tail(state, rows)
        step = pipe.graphs["unet_step"]
        assert not step.static and list(step._compiled) == [("dynamic",)]
        assert pipe.buckets is None  # any row count runs as it comes: no padding, no pow2 E
        (compiled,) = step._compiled.values()
        assert not compiled.input("latents").get_partial_shape().is_static
    np.testing.assert_allclose(ours, expected, atol=1e-4)


@pytest.fixture(scope="module")
def bf16(onnx_dir, model_dir):
    """The bf16 pipeline both bf16 tests read (each its own base and rows)."""
    with EditPipeline(onnx_dir, model_dir, backend="openvino", precision="bf16") as pipe:
        yield pipe


@needs_bf16
def test_bf16_keeps_the_guidance_and_sampler_update_fp32(bf16):
    state = bf16.generate_base(TEST_BASE)
    step = bf16.graphs["unet_step"]
    (compiled,) = [c for c in step._compiled.values() if c.input("latents").get_shape()[0] == 1]
    assert str(compiled.get_property("INFERENCE_PRECISION_HINT")) == "<Type: 'bfloat16'>"
    model = ov.Core().read_model(str(step.path))
    outside = {n.get_friendly_name() for n in backend_ov.outside_unet(model)}
    inside = {n.get_friendly_name() for n in model.get_ordered_ops()} - outside
    unet, update = _runtime_precisions(compiled, inside), _runtime_precisions(compiled, outside)
    assert "bf16" in unet["Convolution"] and "bf16" in unet.get("MatMul", set()) | unet.get("FullyConnected", set())
    arithmetic = {kind: precisions for kind, precisions in update.items() if kind in ("Eltwise", "Subgraph", "Reduce")}
    assert arithmetic and all("bf16" not in p for p in arithmetic.values()), update
    assert state.final_latent.dtype == np.float32


@needs_bf16
def test_bf16_stays_near_fp32_on_the_same_base(bf16, fp32):
    exact = fp32.generate_base(TEST_BASE)
    low = bf16.generate_base(TEST_BASE, noise=fp32.initial_noise(TEST_BASE))
    rows = [TailRow("a blue square", 1.0, 4, TEST_BASE.guidance)]
    tail_low = bf16.run_tail(exact, rows)[0]
    tail = fp32.run_tail(exact, rows)[0]
    scale = np.abs(exact.final_latent).max()
    base_diff = np.abs(low.final_latent - exact.final_latent).max() / scale
    tail_diff = np.abs(tail_low - tail).max() / scale
    # bf16 keeps 8 bits of mantissa: really lower precision (not silently fp32) ...
    assert base_diff > 1e-4 and tail_diff > 1e-5, (base_diff, tail_diff)
    # ... and near fp32 through 10 chained steps on the tiny model
    assert base_diff < 0.05 and tail_diff < 0.05, (base_diff, tail_diff)


def test_a_pipeline_on_ort_cpu_does_not_load_openvino(onnx_dir, model_dir):
    """Probing openvino loads its CPU plugin and thread pool into the process: auto (which
    stops at ort-cpu) and ort-cpu never pay it."""
    import subprocess
    import sys

    code = ("import sys; from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline; "
            f"EditPipeline({str(onnx_dir)!r}, {str(model_dir)!r}, backend='auto').activate(); "
            "print('openvino' in sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False"], done.stdout


def test_an_export_with_idle_adapter_slots_runs_and_equals_diffusers(adapter_onnx_dir, model_dir, diffusers_reference):
    """A generation whose rows use no adapter binds the slots zero wide on ONNX Runtime; OpenVINO
    cannot compile a zero-wide input, so its rows bind them full width at zero scales."""
    with EditPipeline(adapter_onnx_dir, model_dir, backend="openvino") as pipe:
        noise = pipe.initial_noise(TEST_BASE)
        image = pipe.decode(pipe.generate_base(TEST_BASE, noise=noise).final_latent)
    np.testing.assert_allclose(image, diffusers_reference(model_dir, TEST_BASE, noise), atol=1e-4)


# --- the exactness promises on OpenVINO: each graph, and one generation per family -----------------
#
# tests/test_pipeline.py, test_samplers_pipeline.py and test_families.py run every promise on
# OpenVINO in make test-all. The default run holds the engine by its parts: every graph of every
# family against its PyTorch source (what a step computes), and one whole
# generation per family against diffusers (what the step loop binds, pads and chains on it).

FAMILIES = {"sd": ("onnx_dir", "model_dir"), "sd2": ("sd2_onnx_dir", "sd2_dir"), "sdxl": ("sdxl_onnx_dir", "sdxl_dir")}
GRAPH_ATOL, GRAPH_RTOL = 1e-4, 1e-3  # fp32 fusions and reorderings, as tests/test_graphs.py allows ONNX Runtime


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_graph_on_openvino_equals_its_torch_source(request, family):
    from edit_rt.export.compile.parity import load_sources, random_feeds, torch_runner
    from edit_rt.runtime.engine.engines import graphs_of
    from edit_rt.runtime.engine.manifest import load_manifest

    onnx_dir, model_dir = (request.getfixturevalue(name) for name in FAMILIES[family])
    manifest = load_manifest(onnx_dir)
    rng = np.random.default_rng(0)
    graphs = graphs_of(manifest)
    assert {"text_encoder", "kv_proj", "unet_step", "vae_decoder", "vae_encoder"} <= set(graphs)
    sources = load_sources(model_dir, manifest)  # each graph's source on its own copy, as `edit-rt parity` runs them
    for graph in graphs:
        # 3 rows, 2 uncond sets: neither the traced batch (2) nor 1, so a frozen axis shows
        feeds = [random_feeds(manifest, graph, 3, 2, rng, hw=16)]
        with backend_ov.OvGraph(manifest.path(graph), precision="fp32") as ours, torch_runner(graph, manifest, model_dir, sources) as torch_graph:
            for feed in feeds:
                expected = torch_graph.infer(feed)
                for name, got in zip(ours.output_names, ours.infer(feed)):
                    np.testing.assert_allclose(got, expected[name], atol=GRAPH_ATOL, rtol=GRAPH_RTOL, err_msg=f"{family} {graph} {name}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_generation_on_openvino_equals_diffusers(request, family, diffusers_reference):
    onnx_dir, model_dir = (request.getfixturevalue(name) for name in FAMILIES[family])
    # each family's own sampler (DDIM on SD, SDXL's Euler), a second sampler's history slots on SD 2.x
    sampler = {"sd": "ddim", "sd2": "dpmpp_2m_karras", "sdxl": "own"}[family]
    base = dataclasses.replace(TEST_BASE, sampler=sampler, steps=8) if family == "sd2" else TEST_BASE
    if family == "sd":  # the module's fp32 pipeline: backend openvino's default precision is fp32 (resolve_precision)
        opened = contextlib.nullcontext(request.getfixturevalue("fp32"))
    else:
        opened = EditPipeline(onnx_dir, model_dir, backend="openvino")
    with opened as pipe:
        assert pipe.graph_set.backend == "openvino" and pipe.graphs["unet_step"].precision == "fp32"
        noise = pipe.initial_noise(base)
        ours = pipe.decode(pipe.generate_base(base, noise=noise).final_latent)
    np.testing.assert_allclose(ours, diffusers_reference(model_dir, base, noise, sampler, sdxl=family == "sdxl"), atol=1e-4)
