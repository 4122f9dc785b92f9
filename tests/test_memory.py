"""Memory that fits the work, one copy of the weights on disk, and progress a user can see.

- a call runs at the rows that fit in memory (the rest in later calls), with the same edits;
- the step graph's self-attention sliced one head at a time equals the unsliced attention of
  the PyTorch UNet (Polygraphy's comparator, as every graph is checked);
- the CPU engines of a graph with external data use the exported file (no second copy), and
  every file export writes has the umask's mode;
- `edit-rt export` and `edit-rt run` without a terminal print a line per stage, with seconds
  and bytes; each image of a run is on disk before the next is decoded.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.engine.memory import MARGIN, MemoryPlan, memory_plan, process_rss

from .conftest import TEST_BASE, sample_rows
from .test_graphs import assert_graph_matches_torch
from .test_hardening import CLI


def test_a_plan_counts_the_rows_that_fit_beside_what_is_held():
    plan = MemoryPlan(weights=4 * 2**30, step_row=700 * 2**20, decode_row=900 * 2**20, free=MARGIN + 2 * 700 * 2**20 + 1)
    assert plan.step_rows(32) == 2 and plan.step_rows(1) == 1
    assert plan.decode_rows(8) == 1  # one image at a time (and never none once a step row fits)
    assert MemoryPlan(1, 1, 2**20, free=MARGIN + 3 * 2**20 + 1).decode_rows(8) == 3  # small images: as many as fit
    assert MemoryPlan(1, 700 * 2**20, 1, free=MARGIN).step_rows(32) == 0
    assert MemoryPlan(1, 1, 1, free=None).step_rows(32) == 32  # nothing known: no limit


def test_a_budget_counts_what_the_process_already_holds(onnx_dir):
    manifest = load_manifest(onnx_dir)
    plan = memory_plan(manifest, (16, 16), budget=3 * 2**30, held=2**30)
    assert plan.free == 2 * 2**30
    # the manifest's weights: every graph's, as the export counted them
    assert plan.weights == sum(g["weight_bytes"] for g in manifest.data["graphs"].values())


def test_a_call_runs_at_the_rows_that_fit_and_gives_the_same_edits(onnx_dir, model_dir, pipeline, base_state, monkeypatch):
    """A budget with room for two step rows: five edits run as calls of at most two rows (the
    others wait for a slot), and each edit's latent is the one the unbounded pipeline gives."""
    from edit_rt.runtime.engine import memory
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    rows = sample_rows()
    reference = pipeline.run_tail(base_state, rows)
    row = memory_plan(pipeline.manifest, base_state.latents.shape[2:], budget=0, held=0).step_row
    monkeypatch.setattr(memory, "process_rss", lambda: 2**30)  # what the process holds, fixed for the test
    budget = 2**30 + MARGIN + int(2.5 * row)
    with EditPipeline(onnx_dir, model_dir, max_memory=budget) as small:
        shape = small.latent_shape(TEST_BASE)
        scheduler = small.batcher(shape).scheduler
        assert scheduler.max_rows == 2, scheduler.max_rows
        ours = small.run_tail(base_state, rows)
        assert scheduler.stats.calls >= 3  # 5 rows, at most 2 a call
    np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_a_size_no_row_fits_is_refused_naming_what_it_needs(onnx_dir, model_dir):
    from edit_rt.runtime.errors import ConfigError
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    with EditPipeline(onnx_dir, model_dir, max_memory=process_rss() + 2**20) as small:  # 1 MiB more than held
        with pytest.raises(ConfigError) as err:
            small.latent_shape(TEST_BASE)
    text = str(err.value)
    assert "needs about" in text and "for one step row" in text and "engines.max_memory_gb" in text and "\n" not in text


@pytest.fixture(scope="module")
def sliced_onnx_dir(model_dir, tmp_path_factory) -> Path:
    from edit_rt.export.compile.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("sliced") / "tiny-sd" / "onnx"
    export_onnx(model_dir, out, attention_slicing=1, external_data_threshold_mb=0.0)
    return out


def test_self_attention_one_head_at_a_time_equals_the_unsliced_unet(sliced_onnx_dir, model_dir):
    """The graph sliced by heads against PyTorch's UNet step with its attention whole."""
    assert load_manifest(sliced_onnx_dir).data["graphs"]["unet_step"]["slice_heads"] == 1
    assert_graph_matches_torch("unet_step", sliced_onnx_dir, model_dir)


def test_auto_slicing_is_off_at_small_sizes_and_on_at_sd_sizes(model_dir):
    """"auto": SD 1.5's 64x64 latents (8 heads x 4096^2 scores, 512 MiB a row) are sliced,
    the tiny model's 16x16 are not; diffusers' UNet built from SD 1.5's own config."""
    from diffusers import UNet2DConditionModel

    from edit_rt.export.compile.onnx_export import slice_heads_for

    import torch

    sd15 = UNet2DConditionModel.load_config(str(Path(__file__).resolve().parents[1] / "export" / "compile" / "checkpoint_configs" / "sd1" / "unet"))
    with torch.device("meta"):  # the architecture, no 3.4 GB of weights
        unet = UNet2DConditionModel.from_config(sd15)
    assert slice_heads_for(unet, "auto") == 1
    tiny = UNet2DConditionModel.from_pretrained(str(model_dir / "unet"))
    assert slice_heads_for(tiny, "auto") == 0 and slice_heads_for(tiny, 2) == 2


def test_cpu_engines_use_the_exported_weights_and_files_follow_the_umask(sliced_onnx_dir, model_dir, base_state, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    """A graph past the copy limit (SD 1.5's UNet; here the limit is lowered to the tiny
    model's UNet) is its own CPU engine: the engines folder holds no second copy of its
    weights, and the pipeline runs it; what export wrote has the umask's mode."""
    from edit_rt.export.compile import engines as engine_builds
    from edit_rt.export.compile.engines import build_engines
    from edit_rt.runtime.engine.graph_set import graphs_from_artifacts
    from edit_rt.runtime.engine.profiles import EditBatchProfile

    manifest = load_manifest(sliced_onnx_dir)
    mask = os.umask(0)
    os.umask(mask)
    for path in sliced_onnx_dir.iterdir():
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask, path
    profile = EditBatchProfile(1, 2, 4, 16, 16)
    monkeypatch.setattr(engine_builds, "COPY_LIMIT", manifest.data["graphs"]["unet_step"]["weight_bytes"] - 1)
    engines = tmp_path / "engines"
    built = build_engines(sliced_onnx_dir, engines, profile, trt_reason="test")["ort-cpu"]
    entry = built.graphs["unet_step"]
    assert entry["optimized"] is False and built.path("unet_step").resolve() == manifest.path("unet_step").resolve()
    assert not list((engines / "ort-cpu").glob("unet_step.onnx*"))  # the small graphs are copied, optimized
    assert built.graphs["kv_proj"].get("optimized", True) and (engines / "ort-cpu" / "kv_proj.onnx").is_file()
    graphs = graphs_from_artifacts(manifest, engines, "ort-cpu", 0, profile).graphs
    assert graphs["unet_step"].path.resolve() == manifest.path("unet_step").resolve() and not graphs["unet_step"].optimized
    assert graphs["vae_encoder"].lazy and not graphs["unet_step"].lazy
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    with EditPipeline(sliced_onnx_dir, model_dir, engines_dir=engines) as pipe:  # sliced, optimized as it loads
        assert "make engines" in pipe.graph_set.reason
        ours = pipe.generate_base(TEST_BASE)
    np.testing.assert_allclose(ours.final_latent, base_state.final_latent, atol=1e-4)


def test_export_and_run_without_a_terminal_say_each_stage(tmp_path, model_dir, onnx_dir):
    """stderr is a pipe here: every graph's start and end with seconds and bytes, the size of
    what was written, and run's loading and per-image decoding, each a plain line."""
    cfg = {"model": str(model_dir), "build_dir": str(tmp_path / "build"), "output_dir": str(tmp_path / "out"),
           "base": {"prompt": "a red circle", "steps": 4, "width": 32, "height": 32},
           "edits": [{"prompt": "a blue circle"}, {"prompt": "a green circle"}]}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    r = subprocess.run([*CLI, "export", str(tmp_path / "config.yaml")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    for graph in ("text_encoder", "kv_proj", "unet_step", "latent_blend", "vae_decoder", "vae_encoder"):
        assert f"export: {graph} (" in r.stderr and f"export: {graph} done in " in r.stderr, r.stderr
    assert "Constant folding" not in r.stderr and "Warning" not in r.stderr, r.stderr
    assert "wrote " in r.stderr and " MB (" in r.stderr, r.stderr
    r = subprocess.run([*CLI, "run", str(tmp_path / "config.yaml")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    for line in ("loading the graphs: done", "base: 4/4", "decoding base.png: done", "decoding edit_01.png: done"):
        assert line in r.stderr, r.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["memory"]["peak_rss_bytes"] > 0 and report["memory"]["step_rows_per_call"] >= 1


def test_each_image_is_written_before_the_next_is_decoded(tmp_path, model_dir, onnx_dir):
    from edit_rt.runtime.config.load import load_config
    from edit_rt.runtime.apps.run import run_config

    cfg = {"model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path / "out"),
           "base": {"prompt": "a red circle", "steps": 4, "width": 32, "height": 32},
           "edits": [{"prompt": "a blue circle"}, {"prompt": "a green circle"}, {"prompt": "a red square"}]}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    on_disk: dict[str, set[str]] = {}

    from contextlib import contextmanager

    @contextmanager
    def stage(name: str):
        on_disk[name] = {p.name for p in (tmp_path / "out").glob("*.png")}
        yield

    run_config(load_config(tmp_path / "config.yaml"), stage=stage)
    assert on_disk["decoding edit_00.png"] == {"base.png"}
    assert on_disk["decoding edit_02.png"] == {"base.png", "edit_00.png", "edit_01.png"}


def test_lazy_graphs_load_on_first_use(onnx_dir, model_dir):
    """vae_encoder (uploads only) is not loaded by activate(), and loads when first used."""
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    with EditPipeline(onnx_dir, model_dir) as pipe:
        encoder = pipe.graphs["vae_encoder"]
        assert encoder.session is None and pipe.graphs["unet_step"].session is not None
        latent = pipe.decoders.encode_image(np.full((32, 32, 3), 0.5, np.float32))
        assert encoder.session is not None and latent.shape == (1, 4, 16, 16)

