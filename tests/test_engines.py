"""`edit-rt engines`, the engines.json contract, backend choice, buffer binding and parity.

Everything here runs on the CPU. The TensorRT path's GPU-free logic (profile shapes, buckets,
the ONNX Runtime TensorRT options, the Polygraphy profile, stale and foreign detection) is
tested here; running plans needs a GPU and is marked ``gpu``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from edit_rt.export.compile.engines import build_engines
from edit_rt.runtime.engine.backend_trt import trt_unavailable_reason
from edit_rt.runtime.engine.engines import load_engines
from edit_rt.runtime.engine.graph_set import cpu_name, engine_tools
from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.engine.profiles import EditBatchProfile, ort_trt_profile_options
from edit_rt.runtime.errors import ArtifactError
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline, TailRow

from .cli_in_process import edit_rt
from .conftest import TEST_BASE, sample_rows

PROFILE = EditBatchProfile(min_batch=1, opt_batch=4, max_batch=8, latent_height=16, latent_width=16)
TRT_MISSING = trt_unavailable_reason()


@pytest.fixture(scope="module")
def engines_dir(onnx_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engines")
    messages = []
    build_engines(onnx_dir, out, PROFILE, "fp16", say=messages.append)
    if TRT_MISSING:
        assert messages == [f"TensorRT is unavailable ({TRT_MISSING}): built the ONNX Runtime CPU engines only"]
    return out


def test_cpu_engines_and_engines_json(engines_dir, onnx_dir):
    data = json.loads((engines_dir / "ort-cpu" / "engines.json").read_text())
    manifest = load_manifest(onnx_dir)
    assert data["backend"] == "ort-cpu" and data["device"] == cpu_name()
    assert data["profile"] == {"min_batch": 1, "opt_batch": 4, "max_batch": 8, "latent_height": 16, "latent_width": 16,
                               "max_sets": 4, "vae_scale": 1, "vae_max_batch": 8, "extra_sizes": [],
                               "adapter_slots": 0, "adapter_rank": 0, "step_all_given": True}  # fmt: skip
    assert data["tools"] == engine_tools("ort-cpu")
    for graph, entry in data["graphs"].items():
        assert entry["source_sha256"] == manifest.data["graphs"][graph]["sha256"]
        assert (engines_dir / "ort-cpu" / entry["file"]).is_file()
    # The saved graphs are ONNX Runtime's rewrite, not copies of the exported ones.
    assert (engines_dir / "ort-cpu" / "unet_step.onnx").read_bytes() != (onnx_dir / "unet_step.onnx").read_bytes()


def test_edit_tail_through_cpu_engines_equals_plain_onnx(engines_dir, onnx_dir, pipeline, base_state):
    with EditPipeline(onnx_dir, engines_dir=engines_dir, batch_profile=(1, 4, 8)) as engine_pipe:
        assert engine_pipe.graph_set.files["unet_step"] == engines_dir / "ort-cpu" / "unet_step.onnx"
        ours = engine_pipe.run_tail(base_state, sample_rows())
        images = engine_pipe.decode(ours)
    plain = pipeline.run_tail(base_state, sample_rows())
    # Same fp32 math, graph rewritten (fusions, NCHWc layouts): fp32 reordering noise only.
    np.testing.assert_allclose(ours, plain, atol=1e-4)
    np.testing.assert_allclose(images, pipeline.decode(plain), atol=1e-4)


@pytest.mark.parametrize(
    "tamper,needle",
    [
        (lambda d: d["graphs"]["unet_step"].update(source_sha256="0" * 64), "unet_step.onnx is stale"),
        (lambda d: d.update(device="another CPU"), "was built on 'another CPU'"),
        (lambda d: d["tools"].update(onnxruntime="0.0.1"), "built with onnxruntime 0.0.1"),
        (lambda d: d.update(version=99), "not an edit-rt engines.json"),
    ],
)
def test_stale_or_foreign_engines_are_refused(engines_dir, onnx_dir, tmp_path, tamper, needle):
    copy = tmp_path / "engines"
    shutil.copytree(engines_dir, copy)
    path = copy / "ort-cpu" / "engines.json"
    data = json.loads(path.read_text())
    tamper(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="make engines") as err:
        EditPipeline(onnx_dir, engines_dir=copy)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_trt_engines_for_another_latent_size_are_refused(engines_dir, onnx_dir, tmp_path):
    copy = tmp_path / "engines"
    shutil.copytree(engines_dir / "ort-cpu", copy / "ort-cpu")
    with pytest.raises(ArtifactError, match="built for 16x16 latents, this run needs 32x32"):
        load_engines(copy / "ort-cpu", load_manifest(onnx_dir), "ort-cpu", engine_tools("ort-cpu"), cpu_name(), [(32, 32)])


def test_more_rows_than_the_profile_join_as_slots_free_up(onnx_dir, pipeline, base_state):
    rows = sample_rows() + sample_rows()  # 10 rows, max_batch 4
    calls = []
    with EditPipeline(onnx_dir, batch_profile=(1, 2, 4)) as small:
        step = small.graphs["unet_step"]
        original_bind = step.bind

        def spy_bind(inputs, outputs):
            binding = original_bind(inputs, outputs)
            original_run = binding.run
            binding.run = lambda: (calls.append(inputs["latents"].shape[0]), original_run())[1]
            return binding

        step.bind = spy_bind
        split = small.run_tail(base_state, rows)
    assert max(calls) == 4 and sum(calls) == sum(TEST_BASE.steps - r.start_step for r in rows)
    np.testing.assert_allclose(split, pipeline.run_tail(base_state, rows), atol=1e-5)


def test_profile_shapes_and_ort_tensorrt_options(onnx_dir):
    manifest = load_manifest(onnx_dir)
    shapes = PROFILE.shapes(manifest.graphs["unet_step"].inputs)
    assert shapes["latents"] == ((1, 4, 16, 16), (4, 4, 16, 16), (8, 4, 16, 16))
    # the negative prompts' K/V: 1 set at min and opt, max_sets at max; the layer has 8 heads of 4
    assert shapes["uncond_k_0"] == ((8, 4, 77), (8, 4, 77), (8, 4, 4 * 77))
    assert shapes["cond_v_0"] == ((1, 8, 77, 4), (4, 8, 77, 4), (8, 8, 77, 4))
    # rows at their entry step: none up to all but one
    assert shapes["uncond_given"] == ((0, 4, 16, 16), (0, 4, 16, 16), (7, 4, 16, 16))
    assert shapes["timestep"] == ((1,), (4,), (8,))
    options = ort_trt_profile_options(PROFILE, manifest.graphs["vae_decoder"].inputs)
    assert options == {
        "trt_profile_min_shapes": "latents:1x4x16x16",
        "trt_profile_opt_shapes": "latents:4x4x16x16",
        "trt_profile_max_shapes": "latents:8x4x16x16",
    }


def test_every_shape_the_loop_binds_lies_inside_the_polygraphy_profile(onnx_dir, base_state):
    """The profile `make engines` builds from the config, as Polygraphy holds it, against the
    shapes the step loop really binds: tails of 1..8 rows (padded to the GPU's buckets), rows
    at their entry step, up to max_sets negative prompts."""
    import dataclasses

    from polygraphy.backend.trt import Profile

    from edit_rt.runtime.loop.jobs import Job, Request

    manifest = load_manifest(onnx_dir)
    profile = Profile()
    built = dataclasses.replace(PROFILE, step_all_given=manifest.step_all_given)  # as build_engines takes it
    for name, (lo, opt, hi) in built.shapes(manifest.graphs["unet_step"].inputs, "unet_step").items():
        profile.add(name, min=lo, opt=opt, max=hi)
    bound = []
    with EditPipeline(onnx_dir, batch_profile=(1, 4, 8), buckets="pow2") as pipe:
        step = pipe.graphs["unet_step"]
        original = step.bind
        step.bind = lambda inputs, outputs: (bound.append({n: v.shape for n, v in inputs.items()}), original(inputs, outputs))[1]
        others = [pipe.generate_base(dataclasses.replace(TEST_BASE, negative_prompt=neg)) for neg in ("a", "b", "c")]
        states = [base_state, *others]
        for n in range(1, 9):
            request = Request(f"n{n}", decode=False)
            jobs = [Job(request, k, states[k % 4].base, TailRow(f"edit {k}", 1.0, 7 - k % 3, 7.5), state=states[k % 4])
                    for k in range(n)]  # fmt: skip
            pipe.batcher(base_state.latents.shape[1:]).run(request, jobs)
    assert len(bound) > 8
    for shapes in bound:
        for name, shape in shapes.items():
            lo, hi = tuple(profile[name].min), tuple(profile[name].max)
            assert all(a <= d <= b for a, d, b in zip(lo, shape, hi)), (name, shape, lo, hi)


def test_engines_and_parity_commands(onnx_dir, model_dir, tmp_path):
    build = tmp_path / "build"
    shutil.copytree(onnx_dir, build / model_dir.name / "onnx")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir), "build_dir": str(build),
        "base": {"prompt": "x", "width": 32, "height": 32, "steps": 4},
        "engines": {"min_batch": 1, "opt_batch": 2, "max_batch": 4},
    }))  # fmt: skip
    result = edit_rt("engines", str(config))  # as the console script runs it, in this process
    assert result.returncode == 0, result.stderr
    if TRT_MISSING:
        assert "TensorRT is unavailable" in result.stderr
    assert (build / model_dir.name / "engines" / "ort-cpu" / "engines.json").is_file()
    result = edit_rt("parity", str(config))
    assert result.returncode == 0, result.stderr
    report = json.loads((build / model_dir.name / "parity.json").read_text())
    assert {r["backend"] for r in report} >= {"onnx", "ort-cpu-engine"}
    assert {r["graph"] for r in report} == {"text_encoder", "kv_proj", "unet_step", "unet_step_shallow", "latent_blend",
                                            "vae_decoder", "vae_encoder"}  # fmt: skip
    assert all(r["pass"] for r in report)
    assert "| unet_step | ort-cpu-engine |" in (build / model_dir.name / "parity.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(TRT_MISSING is not None, reason=f"TensorRT unavailable: {TRT_MISSING}")
def test_trt_edit_tail_matches_onnx_runtime(engines_dir, onnx_dir, pipeline, base_state):
    with EditPipeline(onnx_dir, backend="trt", engines_dir=engines_dir, batch_profile=(1, 4, 8), image_size=(32, 32)) as trt_pipe:
        ours = trt_pipe.run_tail(base_state, sample_rows())
    # fp16 engines against fp32 ONNX Runtime, through up to 8 chained steps.
    np.testing.assert_allclose(ours, pipeline.run_tail(base_state, sample_rows()), atol=5e-2)


def test_vae_has_its_own_smaller_profile(onnx_dir):
    manifest = load_manifest(onnx_dir)
    profile = EditBatchProfile(1, 8, 32, 16, 16, 4, 2, vae_max_batch=8)
    assert profile.shapes(manifest.graphs["vae_decoder"].inputs, "vae_decoder")["latents"][2] == (8, 4, 16, 16)
    assert profile.shapes(manifest.graphs["unet_step"].inputs, "unet_step")["latents"][2] == (32, 4, 16, 16)


def test_strongly_typed_fp16_graph_keeps_the_ddim_update_fp32(onnx_dir, tmp_path):
    """The fp16 ONNX a strongly typed plan is built from: K/V inputs fp16, latents, scalars and
    outputs fp32, the guidance and DDIM nodes fp32; against the fp32 graph on ONNX Runtime CPU
    within fp16's error (and not equal: it did compute in fp16)."""
    import onnx
    import onnxruntime as ort

    from edit_rt.export.compile.engines import typed_onnx
    from edit_rt.export.compile.parity import random_feeds

    manifest = load_manifest(onnx_dir)
    typed = typed_onnx(manifest, "unet_step", "fp16", tmp_path)
    model = onnx.load(str(typed))
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output, *model.graph.value_info]}
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    assert types["cond_k_0"] == f16 and types["cond_v_3"] == f16
    assert all(types[n] == f32 for n in ("latents", "alpha_t", "coefs", "history", "guidance", "uncond_given", "uncond_slope", "next_latents",
                                         "uncond_out", "history_out"))
    ddim = [n for n in model.graph.node if not n.name.startswith("/unet/") and n.op_type in ("Mul", "Add", "Sub", "Div")]
    assert ddim and not any(types.get(o) == f16 for n in ddim for o in n.output)  # (shape arithmetic is int64)
    assert sum(types.get(o) == f16 for n in model.graph.node if n.name.startswith("/unet/") for o in n.output) > 100
    fp16 = ort.InferenceSession(str(typed), providers=["CPUExecutionProvider"])
    fp32 = ort.InferenceSession(str(onnx_dir / "unet_step.onnx"), providers=["CPUExecutionProvider"])
    feeds = random_feeds(manifest, "unet_step", 4, 2, np.random.default_rng(0), hw=16)
    half = {i.name: feeds[i.name].astype(np.float16) if i.type == "tensor(float16)" else feeds[i.name] for i in fp16.get_inputs()}
    names = [o.name for o in fp16.get_outputs()]
    for name, ours, reference in zip(names, fp16.run(None, half), fp32.run(None, feeds)):
        assert ours.dtype == np.float32
        # fp16's resolution is 2^-10 of a value: the x_0 in history_out reaches ~20 on these
        # random (implausible) latents at small alpha_t, the latents ~5; deep_out, the features
        # inside the UNet (DeepCache's), has passed through more fp16 layers than the outputs
        error = np.abs(ours - reference).max()
        bound = 4e-3 if name == "deep_out" else 2e-3
        assert 0 < error < bound * max(1.0, float(np.abs(reference).max())), (name, error)
    assert typed_onnx(manifest, "vae_decoder", "fp32", tmp_path) == manifest.path("vae_decoder")
