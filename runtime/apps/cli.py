"""The ``edit-rt`` command line: parse, load the config, call one function, show the result.

``model`` and ``export`` need the export extras (torch, diffusers, onnx); they are imported only
when those commands run, so the runtime installs and runs without them.

Every refusal is one line on stderr, ``error: ...``, and exit status 2: the project's own errors
(:class:`EditRtError`) and click's usage errors alike (a missing argument, an unknown option, a
value that is no number: click's words, without its boxed usage, which ``--help`` shows). Ctrl-C
ends a command quietly with status 130 (128 + SIGINT), as shells and make read an interrupt.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.table import Table

try:  # typer >= 0.22 carries its own copy of click, whose exceptions are not click's
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - an older typer over click itself
    from click import exceptions as click_errors
NO_ARGS = getattr(click_errors, "NoArgsIsHelpError", ())  # click >= 8.2: `edit-rt` alone, answered with the help

from .. import __version__
from ..config.load import is_text_config, load_config, load_text_config, revalidated
from ..config.run_config import RunConfig
from ..errors import ConfigError, EditRtError
from .progress import Reporter, human_bytes, reporter
from .summaries import print_bench, print_run

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Batched edit tails for Stable Diffusion.")

# Every number a command takes has both bounds, refused before any work (typer's min/max; the
# lists by _listed): generous for real use, far below what would exhaust memory or run for days.
MAX_SEED = 2**63 - 1  # the config's seeds (model/schema.py Seed): torch takes any such int64
MAX_BENCH_ROWS = 1024  # an edit batch N is one step call's rows: the engines' own bound (config/run_config.py Rows)
MAX_LISTED = 32  # values of one list option: each is a bench point, every one run --repeats times
MAX_REPEATS = 100  # past ~10 runs a median moves by noise; each repeat runs every point again
# Bases and prompts read by quality/gates: 50 and 100 by default, each one a generation and its
# edits; 10,000 is days on a CPU, past what any of their ratios needs.
MAX_EVAL_ITEMS = 10_000
MAX_PORT = 65535  # TCP's ports (0: one the system picks), as serve.port


def _version(value: bool) -> None:
    if value:
        print(f"edit-rt {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version.")) -> None:
    """Batched edit tails for Stable Diffusion."""
console = Console(stderr=True)


def plain(text: str) -> None:
    """A library's message as it is: brackets in it ("edit-rt[gpu]") are no markup."""
    console.print(text, markup=False)


def _export_module(name: str):
    """Import ``edit_rt.export.<name>`` (``compile.onnx_export``: a stage's folder and module), or
    say which extras to install. The one place the runtime loads ``export/``."""
    try:
        return importlib.import_module(f"edit_rt.export.{name}")
    except ImportError as err:
        raise EditRtError(
            f"this command needs the export extras ({err.name} is missing): pip install 'edit-rt[export]'"
        ) from None


@contextmanager
def _progress() -> Iterator[Reporter]:
    """Bars with their ETA on a terminal, log lines elsewhere (progress.py); the reporter is the
    ``(total, description) -> advance`` factory the long functions take."""
    with reporter(console) as rep:
        yield rep


def _quiet_third_parties() -> None:
    """transformers' and diffusers' hints (torchvision, accelerate) go to the log, not the screen."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.captureWarnings(True)  # warnings.warn(...) -> the "py.warnings" logger


def _export_text(config: Path) -> None:
    """`edit-rt export` of a text config: its model's two graphs (export/compile/text_export.py)."""
    cfg = load_text_config(config)
    if not (cfg.model / "config.json").is_file() or not (cfg.model / "model.safetensors").is_file():
        raise ConfigError(f"model: {cfg.model} holds no text model (config.json, model.safetensors); train one "
                          "(`make train-text`) or fix the path")  # fmt: skip
    out = _export_module("compile.text_export").export_text(cfg.model, cfg.onnx_dir)
    console.print(f"wrote {out} (text_full.onnx, text_cached.onnx, text_manifest.json, tokenizer.json)")


def _engines_text(config: Path) -> None:
    """`edit-rt engines` of a text config: TensorRT plans of its two graphs where TensorRT runs
    (ONNX Runtime and OpenVINO run the exported graphs as they are)."""
    from ..engine.backend_trt import trt_unavailable_reason

    cfg = load_text_config(config)
    require_text_export(cfg)
    reason = trt_unavailable_reason()
    if reason is not None:
        plain(f"TensorRT is unavailable ({reason}): a text model runs its exported graphs on ort-cpu or openvino, "
              "which need no engines")  # fmt: skip
        return
    e = cfg.engines
    out = _export_module("compile.text_engines").text_trt_engines(cfg.onnx_dir, cfg.engines_dir / "trt", e.max_rows, e.precision)
    console.print(f"trt: {out}/ (text_full, text_cached; rows 1-{e.max_rows}, {e.precision})")


def require_text_export(cfg) -> None:
    from ..model.text_manifest import TextManifest

    TextManifest.load(cfg.onnx_dir)  # says `edit-rt export` where there is none


@app.command()
def model(
    out: Path = typer.Option(Path("build/models/tiny-sd"), help="Folder to write the diffusers model to."),
    seed: int = typer.Option(0, min=0, max=MAX_SEED, help="Seed of the random weights."),
    preset: str = typer.Option("tiny", help="tiny, bench (SD 1.x sizes), tiny-sd2 (SD 2.x switches), tiny-sdxl, sd15 / sd15-small (random SD 1.5: true size / 0.1 of its widths)."),
) -> None:
    """Write a small random model (seeded weights): the embedded default and the test families."""
    if out.exists() and not out.is_dir():  # before torch loads, not as diffusers' traceback after
        raise ConfigError(f"--out: {out} is a file, not a folder; choose a folder (it is created)")
    tiny = _export_module("world.tiny_model")
    try:
        if preset in ("sd15", "sd15-small"):
            path = _export_module("world.sd_random").write_random_sd(out, seed=seed, scale=1.0 if preset == "sd15" else 0.1)
        elif preset == "tiny-sdxl":
            path = tiny.write_tiny_sdxl(out, seed=seed)
        else:
            path = tiny.write_tiny_model(out, seed=seed, preset=preset)
    except OSError as err:  # a folder that cannot be written, a full disk
        raise EditRtError(f"--out: cannot write {err.filename or out} ({err.strerror or err}); choose a folder "
                          "this user can write, with room for the model") from None  # fmt: skip
    console.print(f"wrote {path}")


@app.command()
def export(config: Path = typer.Argument(..., help="Run config naming `model:` and `build_dir:`."),
           force: bool = typer.Option(False, "--force", help="Export even when the existing export is current.")) -> None:
    """Export the config's model to ONNX under build_dir/<model>/onnx/ (a single-file
    checkpoint is first converted, once, into build_dir/<model>/diffusers/). Skipped when that
    folder already holds the export of the same weights, settings, code and tools."""
    from ..engine.memory import refuse_sizes_no_row_fits
    from ..pipeline.assemble import require_model

    if is_text_config(config):
        return _export_text(config)
    cfg = load_config(config)
    require_model(cfg)  # a wrong path before torch loads
    if cfg.single_file:
        checkpoint = _export_module("compile.checkpoint")
        checkpoint.diffusers_from_single_file(cfg.model, cfg.model_dir, family=cfg.family, config_dir=cfg.checkpoint_config, say=plain)
    # a size not even one step row fits in is refused before the export's minutes, not after them
    refuse_sizes_no_row_fits(cfg.model_dir, cfg.backend, cfg.served_sizes(), cfg.engines.max_memory_gb)
    current = _export_module("compile.export_inputs")
    inputs = current.export_inputs(cfg.export.opset, cfg.export.external_data_threshold_mb, cfg.export.variant,
                                   cfg.adapter_slots, cfg.export.adapter_rank, cfg.export.attention_slicing,
                                   cfg.export.tiny_vae)  # fmt: skip
    if not force and current.why_export(cfg.model_dir, cfg.onnx_dir, inputs) is None:
        console.print(f"{cfg.onnx_dir} is current (same weights, settings, code and tools): export skipped "
                      "(--force exports again)")  # fmt: skip
        if cfg.adapters:
            _convert_adapters(cfg, skip_current=True)
        return
    exporter = _export_module("compile.onnx_export")
    with _progress() as bars:
        manifest = exporter.export_onnx(
            cfg.model_dir, cfg.onnx_dir, opset=cfg.export.opset,
            external_data_threshold_mb=cfg.export.external_data_threshold_mb, progress=bars.export_event,
            variant=cfg.export.variant, adapter_slots_n=cfg.adapter_slots, adapter_rank=cfg.export.adapter_rank,
            attention_slicing=cfg.export.attention_slicing, tiny_vae=cfg.export.tiny_vae,
        )  # fmt: skip
    graphs = json.loads(manifest.read_text())["graphs"]
    sizes = ", ".join(f"{name} {human_bytes(g['file_bytes'])}" for name, g in graphs.items())
    total = sum(p.stat().st_size for p in manifest.parent.iterdir() if p.is_file())
    console.print(f"wrote {manifest.parent}: {human_bytes(total)} ({sizes}, manifest.json)")
    if cfg.adapters:
        _convert_adapters(cfg, skip_current=True)


def _convert_adapters(cfg, skip_current: bool = False) -> None:
    from edit_rt.runtime.engine.manifest import load_manifest
    from edit_rt.runtime.errors import ModelError
    from edit_rt.runtime.model.adapters import lora_source

    converter = _export_module("compile.adapters")
    for name, source in cfg.adapters.items():  # a malformed file: one line, before the model loads
        try:
            path = lora_source(source)
        except OSError as err:
            raise ModelError(f"adapters.{name}: {source}: {err.strerror or err}") from None
        converter.check_safetensors(path)
    written = converter.convert_adapters(cfg.require_model_dir(), load_manifest(cfg.onnx_dir), cfg.adapters, cfg.adapters_dir,
                                         skip_current=skip_current)  # fmt: skip
    for name, path in written.items():
        console.print(f"adapter {name}: wrote {path}")
    if skip_current and len(written) < len(cfg.adapters):
        kept = [name for name in cfg.adapters if name not in written]
        console.print(f"adapters {', '.join(kept)}: current, kept (`edit-rt adapters` converts them again)")


@app.command()
def adapters(config: Path = typer.Argument(..., help="Run config naming `adapters:` (name: LoRA file).")) -> None:
    """Convert the config's LoRA files for its exported model (seconds; no graph is exported again)."""
    cfg = load_config(config)
    if not cfg.adapters:
        # nothing asked of it cannot be done: a usage error, as every other CLI refusal (exit 2)
        raise ConfigError(f"{config}: no adapters: configured (adapters: {{name: path/to/lora.safetensors}})")
    from ..pipeline.assemble import require_build, require_model

    require_model(cfg)  # then the export they are converted for
    require_build(cfg)
    _convert_adapters(cfg)


@app.command()
def engines(config: Path = typer.Argument(..., help="Run config: model, base size, engines profile.")) -> None:
    """Build the engines this machine can run: ONNX Runtime CPU always, TensorRT where present."""
    from ..engine.manifest import load_manifest
    from ..pipeline.assemble import profile_of, require_build, require_model

    if is_text_config(config):
        return _engines_text(config)
    cfg = load_config(config)
    require_model(cfg)
    require_build(cfg)  # a single file not yet converted is said so, before its missing graphs
    builder = _export_module("compile.engines")
    manifest = load_manifest(cfg.onnx_dir)
    profile = profile_of(cfg, manifest)
    from ..engine.backend_trt import trt_unavailable_reason
    from ..engine.engines import graphs_of

    reason = trt_unavailable_reason()
    with _progress() as bars:
        advance = bars(len(graphs_of(manifest)) * (1 if reason else 2), "engines")
        built = builder.build_engines(cfg.onnx_dir, cfg.engines_dir, profile, cfg.engines.precision, say=plain,
                                      trt_reason=reason, progress=lambda name: advance(1))  # fmt: skip
    for backend, engine_set in built.items():
        console.print(
            f"{backend}: {engine_set.root}/ ({', '.join(engine_set.graphs)}; rows {profile.min_batch}/{profile.opt_batch}/"
            f"{profile.max_batch}, {engine_set.precision})"
        )


@app.command()
def parity(config: Path = typer.Argument(..., help="Run config: model and build_dir.")) -> None:
    """Compare every graph across PyTorch, plain ONNX and each built engine; write parity.md."""
    cfg = load_config(config)
    checker = _export_module("compile.parity")
    report = checker.parity_report(cfg)
    console.print(f"wrote {report.path} ({report.passed}/{report.total} comparisons pass)")
    if report.passed != report.total:
        raise EditRtError(f"{report.total - report.passed} parity comparisons failed; see {report.path}")


def _listed(text: str, kind: type, valid, what: str) -> tuple:
    """A comma-separated option's values, each within its bounds and at most MAX_LISTED of them,
    or a usage error (click names the option) saying what it takes: before any work, as
    typer's min/max are. Counted before any value is converted: a list of a million costs
    nothing."""
    values: tuple = ()
    if text.count(",") < MAX_LISTED:
        try:
            values = tuple(kind(v) for v in text.split(","))
        except ValueError:  # not a number, or an int of more than 4,300 digits
            values = ()
    if not values or not all(valid(v) for v in values):  # nan fails every comparison
        shown = repr(text) if len(text) <= 64 else f"{text[:48]!r}... ({len(text)} characters)"
        raise typer.BadParameter(f"{shown} is not a comma-separated list of at most {MAX_LISTED} {what}")
    return values


@app.command()
def bench(
    config: Path = typer.Argument(..., help="Bench config (configs/bench.yaml)."),
    batch_sizes: tuple = typer.Option(
        "1,4,16", "--ns", metavar="N,...",
        help=f"Edit batch sizes N, comma-separated (each in [1, {MAX_BENCH_ROWS}], at most {MAX_LISTED}).",
        parser=lambda text: _listed(text, int, lambda n: 1 <= n <= MAX_BENCH_ROWS, f"integers in [1, {MAX_BENCH_ROWS}], e.g. 1,4,16"),
    ),
    tail_fractions: tuple = typer.Option(
        "0.1,0.2,0.4", "--fractions", metavar="K/T,...",
        help=f"Tail fractions K/T, comma-separated (each in (0, 1], at most {MAX_LISTED}).",
        parser=lambda text: _listed(text, float, lambda f: 0 < f <= 1, "numbers in (0, 1], e.g. 0.1,0.2"),
    ),
    repeats: int = typer.Option(3, min=1, max=MAX_REPEATS, help="Runs per point; the median is reported."),
) -> None:
    """Measure edit throughput against diffusers (full generation and img2img); write bench.json/png."""
    cfg = load_config(config)
    _require_model(cfg)
    bench_module = _export_module("bench.throughput")
    with _progress() as bars:
        report = bench_module.run_bench(cfg, batch_sizes, tail_fractions, repeats, say=plain, progress=bars)
    print_bench(report, cfg.output_dir)


def _require_model(cfg: RunConfig) -> None:
    """The config's diffusers folder, refused in one line when missing (before torch loads it
    and fails in its own words)."""
    from ..engine.manifest import model_files

    model_files(cfg.require_model_dir())


@app.command()
def quality(
    config: Path = typer.Argument(..., help="Config of the shapes model (configs/shapes.yaml)."),
    bases: int = typer.Option(50, min=1, max=MAX_EVAL_ITEMS, help="Bases drawn from the shapes world."),
    sliders: str = typer.Option("with", help="The concept sliders' section (sliders.json): with, only, or without."),
    few_step: bool = typer.Option(False, "--few-step", help="The base's speed LoRA schedule (configs/shapes-lcm.yaml): "
                                  "1- and 2-step tails against img2img with LCMScheduler and the LoRA; no sliders."),
) -> None:
    """Measure edit success and preservation with the shapes reader, against img2img; write quality.json."""
    cfg = load_config(config)
    if few_step:
        _require_model(cfg)
        _few_step_quality(cfg, bases)
        return
    if sliders not in ("with", "only", "without"):
        raise ConfigError(f"--sliders: {sliders!r} is not one of with, only, without")
    _require_model(cfg)  # before the sliders' section says it skips anything
    if sliders != "without" and (cfg.model_dir / "sliders").is_dir():
        _slider_quality(cfg, bases)
    elif sliders != "without":
        console.print(f"no sliders in {cfg.model_dir / 'sliders'}: the slider section is skipped (make sliders trains them)")
    if sliders == "only":
        return
    module = _export_module("eval.quality")
    with _progress() as bars:
        report = module.run_quality(cfg, bases=bases, say=lambda text: None, progress=bars)
    table = Table(title=f"edit-rt quality: {bases} bases, T={report['steps']}", title_justify="left")
    two = any("other_kept" in r for r in report["rows"])  # world 2: the other object of two
    for column in ("method", "edit", "K/T", "strength", "success", "preserved", "both", "untouched PSNR", "IoU",
                   *(("other kept", "other PSNR") if two else ()), "changed"):  # fmt: skip
        table.add_column(column)
    for r in report["rows"]:
        changed = " ".join(f"{f} {v:.2f}" for f, v in r["changed"].items() if v)
        iou = "-" if r["silhouette_iou"] is None else f"{r['silhouette_iou']:.2f}"
        other = ()
        if two:
            other = ("-", "-") if "other_kept" not in r else (
                f"{r['other_kept']:.2f}", f"{r['other_psnr']:.1f} dB ({r['other_psnr_at_least_35']:.2f})")
        table.add_row(r["method"], r["kind"], f"{r['tail_fraction']:g}", f"{r['strength']:g}", f"{r['success']:.2f}",
                      f"{r['preservation']:.2f}", f"{r['success_and_preserved']:.2f}",
                      f"{r['untouched_psnr']:.1f} dB ({r['untouched_psnr_at_least_35']:.2f})", iou, *other, changed)  # fmt: skip
    Console().print(table)
    f0 = report["default_tail_fraction"]
    targets = Table(title=f"targets at the default tail (K/T {f0:g}): met / checked", title_justify="left")
    for column in ("method", "edit", "strength", "met", "not met"):
        targets.add_column(column)
    for t in report["targets"]:
        if t["tail_fraction"] == f0:
            missed = ", ".join(f"{k} {c['value']:.2f} < {c['goal']:g}" for k, c in t["checks"].items() if not c["met"] and c["value"] is not None)
            met = sum(c["met"] for c in t["checks"].values())
            targets.add_row(t["method"], t["kind"], f"{t['strength']:g}", f"{met}/{len(t['checks'])}", missed or "-")
    Console().print(targets)
    if report.get("oracle_ceiling"):
        console.print("oracle-mask ceiling (gates.json): " + ", ".join(f"{k} {v:.2f}" for k, v in report["oracle_ceiling"].items()))
    following = ", ".join(f"{k} {v:.2f}" for k, v in (report["prompt_following"] or {}).items())
    console.print(f"prompt following ({following}); bases read as prompted: {report['base_prompt_following']:.2f}")
    console.print(f"wrote {cfg.output_dir}/quality.json and quality.png")


@app.command()
def gates(
    config: Path = typer.Argument(..., help="Config of a shapes model (configs/shapes64.yaml)."),
    prompts: int = typer.Option(100, min=1, max=MAX_EVAL_ITEMS, help="Generations read for prompt following."),
    bases: int = typer.Option(50, min=1, max=MAX_EVAL_ITEMS, help="Bases of the oracle-mask ceiling and the maps' overlap."),
) -> None:
    """Measure a shapes model's gates (prompt following, the oracle-mask ceiling, the maps'
    overlap with the edited object); write gates.json into the model folder."""
    cfg = load_config(config)
    report = _export_module("eval.gates").run_gates(cfg, prompts=prompts, bases=bases, say=lambda text: None)
    table = Table(title=f"gates of {cfg.model_dir}: {prompts} prompts, {bases} bases", title_justify="left")
    for column in ("gate", "goal", "measured", "met"):
        table.add_column(column)
    for name, g in report["gates"].items():
        measured = "-" if g["measured"] is None else f"{g['measured']:.2f}"
        table.add_row(name, f">= {g['goal']:g}", measured, "yes" if g["met"] else "no")
    Console().print(table)
    console.print(f"wrote {cfg.model_dir / 'gates.json'}")


def _few_step_quality(cfg, bases: int) -> None:
    module = _export_module("eval.quality_few_step")
    with _progress() as bars:
        report = module.run_few_step_quality(cfg, bases=bases, say=lambda text: None, progress=bars)
    table = Table(title=f"edit-rt quality, few-step: {bases} bases, {report['sampler']} {report['steps']} steps, "
                        f"guidance {report['guidance']:g}", title_justify="left")  # fmt: skip
    for column in ("method", "edit", "tail", "strength", "UNet rows", "success", "preserved", "both", "untouched PSNR", "IoU"):
        table.add_column(column)
    for r in report["rows"]:
        iou = "-" if r["silhouette_iou"] is None else f"{r['silhouette_iou']:.2f}"
        table.add_row(r["method"], r["kind"], f"{r['tail_steps']}/{report['steps']}", f"{r['strength']:g}", f"{r['unet_rows_per_edit']:g}",
                      f"{r['success']:.2f}", f"{r['preservation']:.2f}", f"{r['success_and_preserved']:.2f}",
                      f"{r['untouched_psnr']:.1f} dB ({r['untouched_psnr_at_least_35']:.2f})", iou)  # fmt: skip
    Console().print(table)
    following = ", ".join(f"{k} {v:.2f}" for k, v in (report["prompt_following"] or {}).items())
    console.print(f"prompt following ({following}); bases read as prompted: {report['base_prompt_following']:.2f}; "
                  f"identity edits: at most {report['identity_grey_levels']['max']:g} grey levels off the base")  # fmt: skip
    console.print("not run on a few-step chain: " + "; ".join(f"{m} ({why})" for m, why in report["left_out"].items()))
    console.print(f"wrote {cfg.output_dir}/quality.json ({report['seconds']:g} s)")


def _slider_quality(cfg, bases: int) -> None:
    module = _export_module("eval.quality_sliders")
    report = module.slider_quality(cfg, cfg.model_dir / "sliders", bases=bases, say=lambda text: None)
    table = Table(title=f"concept sliders: {bases} bases, scales -2..2 in {len(report['scales'])}, "
                        f"{report['tail_steps']}-step tails", title_justify="left")  # fmt: skip
    for column in ("method", "slider", "UNet steps/image", "rho >= 0.9", "median rho", "range", "preserved", "scene kept"):
        table.add_column(column)
    for method, entry in report["methods"].items():
        for name, m in entry["metrics"].items():
            kept = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            table.add_row(method, name, str(entry["unet_steps_per_image"]), f"{m['share_rho_ge_0.9']:.2f}",
                          f"{m['median_rho']:.2f}", f"{m['range']:.3f}", kept(m["preserved"]), kept(m["scene_preserved"]))  # fmt: skip
    Console().print(table)
    for key, m in report["two_sliders"].items():
        console.print(f"two sliders: {key}: rho >= 0.9 on {m['share_rho_ge_0.9']:.2f} of bases (median {m['median_rho']:.2f})")
    console.print(f"wrote {cfg.output_dir}/sliders.json and sliders.png")


@app.command()
def serve(
    config: Path = typer.Argument(..., help="Config: model, base size and steps, store, serve."),
    host: Optional[str] = typer.Option(None, help="Listen here instead of serve.host."),
    port: Optional[int] = typer.Option(None, min=0, max=MAX_PORT, help="Listen here instead of serve.port."),
    ray: bool = typer.Option(False, "--ray", help="On Ray Serve: serve.ray.replicas workers behind one ingress "
                             "(pip install -e '.[ray]'; joins serve.ray.address or RAY_ADDRESS, else starts Ray)."),
    allow_no_token: bool = typer.Option(False, "--allow-no-token", help="Listen beyond loopback without a token "
                                        "(only behind something that checks who connects)."),
) -> None:
    """Serve the HTTP API and the editing page (127.0.0.1:8188 unless `serve:` or the flags say otherwise);
    a text config (text:), OpenAI's /v1/completions."""
    if is_text_config(config):
        cfg = load_text_config(config)
        require_text_export(cfg)
        if ray:
            raise ConfigError("--ray: a text config is served by one process (its decoding loop on one engine thread); drop --ray")
    else:
        cfg = load_config(config)
    if host is not None or port is not None:
        s = dataclasses.replace(cfg.serve, host=host or cfg.serve.host, port=cfg.serve.port if port is None else port)
        cfg = dataclasses.replace(cfg, serve=revalidated(s, "--host/--port"))
    # no listening line here: each path says it once its port is taken (a busy port is then
    # the only line printed)
    if ray:
        try:
            from ..scale.ray_serve import serve_forever as serve_on_ray
        except ImportError as err:
            raise EditRtError(f"--ray needs Ray Serve ({err.name} is missing): pip install -e '.[ray]'") from None
        serve_on_ray(cfg, say=plain, allow_no_token=allow_no_token)
        return
    from ..web.server import serve as serve_forever

    serve_forever(cfg, say=plain, allow_no_token=allow_no_token)


@app.command()
def run(config: Path = typer.Argument(..., help="Run config (YAML): model, base, edits.")) -> None:
    """Generate the base and run every edit as one batched tail; write PNGs, grid and report.
    A plan config (plan:) plans its scene's behaviours as one batched tail; writes plans.png and plans.json."""
    from ..pipeline.assemble import require_ready
    from .run import run_config
    from .run_plan import run_plan

    if is_text_config(config):
        from .run_text import run_text

        cfg = load_text_config(config)
        require_text_export(cfg)
        print_run(run_text(cfg), cfg.output_dir)
        return
    cfg = load_config(config)
    require_ready(cfg)  # the model, its export, its adapters: in that order, before any folder is made
    if cfg.plan is not None:
        print_run(run_plan(cfg), cfg.output_dir)
        return
    with _progress() as bars:
        report = run_config(cfg, progress=bars, stage=bars.stage)
    print_run(report, cfg.output_dir)


def main(args: Optional[list[str]] = None) -> None:
    """The ``edit-rt`` console script: run the command ``args`` name (None: ``sys.argv[1:]``)
    and exit with its status; tests call it with ``args`` to go the road a user's shell does."""
    _quiet_third_parties()
    logging.basicConfig(
        level=os.environ.get("EDIT_RT_LOG", "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        # not standalone: click's usage errors come here, to be said as every other error is
        status = app(args=args, standalone_mode=False, prog_name="edit-rt")  # its name in usage lines, however started
    except NO_ARGS as err:  # the help, as click shows it
        err.show()
        sys.exit(2)
    except click_errors.UsageError as err:
        # click's words and exit status, on one line; the usage itself is one --help away
        where = f"{err.ctx.command_path} --help" if err.ctx is not None else "edit-rt --help"
        _error(f"{' '.join(err.format_message().split()).rstrip('.')} (see {where})")
    except click_errors.ClickException as err:
        _error(" ".join(err.format_message().split()))
    except typer.Abort:  # an end of input at a prompt (Ctrl-C is typer's Exit(130))
        _error("aborted")
    except EditRtError as err:
        _error(str(err))
    sys.exit(status if isinstance(status, int) else 0)  # --help, --version, Ctrl-C (130): click's status


def _error(message: str) -> None:
    # Plain print: messages hold brackets ("[0, 9]") that rich would read as markup.
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
