"""`edit-rt bench` at its smallest size: the report's shape and that every number is finite.

This checks the benchmark runs and reports what it promises; it does not judge speed (that is
`make bench`'s job, on the bench model, side by side in one process).
"""

from __future__ import annotations

import json
import math

import pytest

from edit_rt.export.bench.throughput import DEEPCACHE, DEEPCACHE_FULL, UNCOND_METHOD, run_bench
from edit_rt.runtime.config.load import config_from_dict


def _finite(value) -> bool:
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return True


def _bench_config(tmp_path, model_dir, onnx_dir):
    return config_from_dict({
        "model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path),
        "base": {"prompt": "a red circle", "steps": 4, "width": 32, "height": 32},
        "engines": {"min_batch": 1, "opt_batch": 2, "max_batch": 2},
    })  # fmt: skip


def test_bench_points_count_their_unet_rows_and_ratios_are_of_their_seconds(tmp_path, model_dir, onnx_dir, capsys):
    """The measured points without the LoRA slots' section (an export and diffusers sweeps of its
    own: the slow test below): each point's UNet rows are what its method runs (diffusers' 2N
    per step, a tail's N at its entry step), and each comparison is the ratio of the seconds of
    the points it names."""
    report = run_bench(_bench_config(tmp_path, model_dir, onnx_dir), ns=(1, 2), fractions=(0.5,), repeats=1,
                       say=lambda s: None, sliders=False, catalogue_sizes=(2,))  # fmt: skip
    assert json.loads((tmp_path / "bench.json").read_text()) == json.loads(json.dumps(report))
    rows = {(p["method"], p["n"]): p["unet_rows"] for p in report["points"]}
    # 4 steps x 2 halves x 2 rows; a 2-step tail of 2 rows: its entry step takes u from the base
    assert rows[("diffusers", 2)] == 8 and rows[("edit-rt tail", 2)] == 4 and rows[("img2img", 2)] == 4
    seconds = {(p["method"], p["n"]): p["seconds"] for p in report["points"]}
    for c in report["comparisons"]:
        n, tail = c["n"], seconds[("edit-rt tail", c["n"])]
        assert c["speedup_vs_diffusers"] == pytest.approx(seconds[("diffusers", n)] / tail)
        assert c["uncond_reuse_speedup"] == pytest.approx(tail / seconds[(UNCOND_METHOD, n)])
    assert "sliders" not in report and _finite(report)
    from edit_rt.runtime.apps.summaries import print_bench

    print_bench(report, tmp_path)
    printed = " ".join(capsys.readouterr().out.split())
    assert "server, 2 concurrent" in printed and "LoRA slots" not in printed


@pytest.mark.slow  # ~40-90 s; the default run keeps the points and ratios (test above)
def test_bench_smoke_report_shape(tmp_path, model_dir, onnx_dir, capsys):
    cfg = config_from_dict({
        "model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path),
        "base": {"prompt": "a red circle", "steps": 4, "width": 32, "height": 32},
        "engines": {"min_batch": 1, "opt_batch": 2, "max_batch": 2},
    })  # fmt: skip
    report = run_bench(cfg, ns=(1, 2), fractions=(0.5,), repeats=1, say=lambda s: None,
                       sliders={"slots": 2, "rank": 4, "points": 3})  # fmt: skip
    assert json.loads((tmp_path / "bench.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    methods = {(p["method"], p["n"], p["tail_fraction"]) for p in report["points"]}
    assert methods == {("edit-rt full", 1, None), ("diffusers", 1, None), ("diffusers", 2, None),
                       ("img2img", 1, 0.5), ("img2img", 2, 0.5), ("edit-rt tail", 1, 0.5), ("edit-rt tail", 2, 0.5),
                       (UNCOND_METHOD, 1, 0.5), (UNCOND_METHOD, 2, 0.5), (DEEPCACHE_FULL, 1, None),
                       *((m, n, 0.5) for m in DEEPCACHE.values() for n in (1, 2))}  # fmt: skip
    for p in report["points"]:
        assert p["seconds"] > 0 and p["edits_per_s"] == p["n"] / p["seconds"] and p["runs"] == [round(p["seconds"], 4)]
    rows = {(p["method"], p["n"]): p["unet_rows"] for p in report["points"]}
    assert rows[("diffusers", 2)] == 8 and rows[("edit-rt tail", 2)] == 4 and rows[("img2img", 2)] == 4
    seconds = {(p["method"], p["n"]): p["seconds"] for p in report["points"]}
    (c1, c2) = report["comparisons"]
    for c in (c1, c2):
        assert c["tail_steps"] == 2 and c["ideal_speedup_vs_diffusers"] > 0 and 0 < c["efficiency"]
        assert c["efficiency_probe"] > 0
        # one repeat: each ratio is the one it names, of the points' seconds (which way up it is)
        n, tail = c["n"], seconds[("edit-rt tail", c["n"])]
        assert c["speedup_vs_diffusers"] == pytest.approx(seconds[("diffusers", n)] / tail)
        assert c["speedup_vs_img2img"] == pytest.approx(seconds[("img2img", n)] / tail)
        assert c["uncond_reuse_speedup"] == pytest.approx(tail / seconds[(UNCOND_METHOD, n)])
        for k, method in DEEPCACHE.items():
            assert c[f"deepcache_{k}_speedup"] == pytest.approx(tail / seconds[(method, n)])
    assert report["deepcache_generation_speedup"]["median"] > 0
    catalogue = report["catalogue"]  # N, 4N, 16N rows for the largest N = 2
    assert set(catalogue["sizes"]) == {"2", "8", "32"} and catalogue["edits_per_s_over_smallest"]["2"] == 1.0
    assert report["base_state_bytes"] > 0 and report["machine"]["threads"] >= 1
    serve = report["server_vs_run"]  # 2 concurrent requests to the in-process server vs one tail
    assert serve["n"] == 2 and serve["server_edits_per_s"] > 0 and serve["run_edits_per_s"] > 0
    entry = report["entry_reuse"]  # 2 rows joined at once: both take u from the base
    assert entry["half_rows_skipped"] == 2 and entry["half_rows"] == 2 * 2 * 2
    unguided = report["interactive"]["unguided_vs_guided"]  # 2 rows x 2 steps: no u computed, vs 2N less the entry's
    assert unguided["n"] == 2 and unguided["unet_rows_unguided"] == 2 * 2 and unguided["unet_rows_guided"] == 2 * 2 * 2 - 2
    assert unguided["ratio"] > 0 and unguided["seconds_unguided"] > 0
    move = report["slider_move"]  # one row, its prompt encoded: the move against its UNet calls
    assert move["tail_steps"] == 2 and move["move_over_unet"] >= 1.0 and move["seconds_move_unet"] > 0
    inv = report["inversion"]
    assert inv["rows_backwards"] == inv["rows_forward"] == 4 and inv["seconds_invert"] > 0
    kept = report["structure_cost"]  # 1 row x 2 steps, the first kept with one reference row
    assert kept["n"] == 1 and kept["structure_steps"] == 1 and kept["row_steps_ratio"] == 1.5 and kept["seconds_structure"] > 0
    sliders = report["sliders"]  # LoRA slots against the graph without, and a sweep as one tail
    assert sliders["slots"] == 2 and sliders["rank"] == 4 and sliders["sweep"]["points"] == 3
    assert sliders["ratio_one_adapter_over_plain"] > 0 and sliders["load"]["engine_builds"] == 0
    low, high = sliders["ratio_spread"]["one_adapter"]  # at least 3 interleaved repeats, whatever --repeats
    assert low <= sliders["ratio_one_adapter_over_plain"] <= high and len(sliders["seconds"]) == 4
    assert _finite(report)
    from edit_rt.runtime.apps.summaries import print_bench  # the CLI's summary reads every measurement

    print_bench(report, tmp_path)
    printed = " ".join(capsys.readouterr().out.split())
    for line in ("server, 2 concurrent", "entry-step reuse", "a slider move (1 row x 2 steps", "a base from an image", "interactive: 2 unguided rows x 2 steps", "preserve: auto", "structure keeping, 1 rows",
                 "LoRA slots (2 x rank 4)", "base.deepcache 3: a generation", "catalogues (2-step tails, PNGs written): 2 rows"):
        assert line in printed, line


def test_cpu_engines_side_by_side(tmp_path, model_dir, onnx_dir):
    """Issue 40's table at its smallest: each engine in its own process from one config file,
    the same base and the same captured step inputs; fp32 OpenVINO agrees with ONNX Runtime (the
    reference) to fp32 noise, bf16 is measurably coarser, every number is finite."""
    import yaml

    from edit_rt.export.bench.cpu_engines import ENGINES, measure_engines
    from edit_rt.runtime.engine.backend_ov import bf16_unavailable_reason

    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path), "threads": 2,
        "base": {"prompt": "a red circle", "steps": 4, "width": 32, "height": 32},
        "engines": {"min_batch": 1, "opt_batch": 2, "max_batch": 2},
    }))  # fmt: skip
    report = measure_engines(config, ns=(2,), k=2, repeats=1, say=lambda s: None, probe_size=512)
    names = [e for e in ("ort-cpu", "openvino fp32", "openvino bf16") if bf16_unavailable_reason() is None or "bf16" not in e]
    assert report["engines"] == names and len(ENGINES) == 3 and report["failed"] == []
    points = {p["engine"]: p for p in report["points"]}
    assert set(points) == set(names) and all(p["n"] == 2 and p["tail_steps"] == 2 for p in points.values())
    assert report["gflop_per_unet_row"] > 0 and report["machine_limit_gflops"]["fp32"] > 0
    # 2 rows x 2 steps: the entry step runs 2 conditional rows and no unconditional one (both
    # came from the base), the next step both halves of both: 2 + 4 UNet rows a tail
    assert all(p["unet_rows_per_tail"] == 6 for p in report["points"])
    ort, ov = points["ort-cpu"], points["openvino fp32"]
    assert ort["max_abs_diff_step_vs_ort"] == 0 and ort["speedup_vs_ort"] == 1.0
    scale = ort["latent_scale"]
    assert ov["max_abs_diff_step_vs_ort"] < 1e-4 * scale and ov["max_abs_diff_eps_vs_ort"] < 1e-4
    assert ov["max_abs_diff_tail_vs_ort"] < 1e-4 * scale
    for p in points.values():
        assert p["seconds"] > 0 and p["peak_rss_bytes"] > 50e6 and p["gflops_per_s"] > 0
    for name, p in points.items():  # each child ran the engine it was asked for
        assert p["backend"] == name.split()[0] and p["reason"].startswith("chosen in the config")
    if "openvino bf16" in points:
        low = points["openvino bf16"]
        assert low["max_abs_diff_eps_vs_ort"] > 10 * max(ov["max_abs_diff_eps_vs_ort"], 1e-7)
    assert _finite(report)
