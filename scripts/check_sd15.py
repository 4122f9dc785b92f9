"""`make check-sd15`: the real-size check. A random-weight SD 1.5 at its true size, through every
stage a user runs, each stage timed and measured.

Stages, each its own subprocess (its wall time, its peak RSS: the process tree's summed RSS
sampled every 0.2 s, and the exact peak of the process itself from ``wait4``; the disk its
folders take after it):

    build             export/sd_random.write_random_sd: the diffusers folder (UNet 859.5 M, VAE
                      83.7 M, CLIP text 123.1 M parameters, the real CLIP tokenizer)
    single_file       that folder as one .safetensors in the original (ldm) key layout
    convert           export/compile/checkpoint.diffusers_from_single_file: the file back to a folder
    export            edit-rt export of the first folder
    export_converted  edit-rt export of the converted folder; every .onnx / .onnx_data file must
                      be byte-identical to the first folder's (sha256)
    engines           edit-rt engines (ORT CPU)
    cpu_engines       the CPU engines side by side (export/bench/cpu_engines.py): ort-cpu,
                      openvino fp32 and bf16, each at N = 1 and 4 rows in a process of its own,
                      a 2-step tail timed after a warm-up one (a 2-step base; the tail's entry
                      step, whose unconditional halves the base gave, then a full step), 2
                      threads; written to cpu-engines.json and the report's cpu_engines
    interactive       a slider move on each CPU engine, a process each (export/bench/slider_move.py):
                      today's default (a 30-step DDIM base, a 6-step tail, the VAE), few-step
                      (LCM at 4 steps, a 1-step tail, guidance off, the tiny decoder) and the
                      few-step move through the server (HTTP, PNG), 2 moves each at new strengths
                      after a warm-up, beside the physical limit of the UNet rows each ran; on
                      the default engine also an unguided tail against a guided one and the tiny
                      decoder against the VAE; written to interactive.json and the report's
                      interactive
    run               edit-rt run: 4 edits at 512x512 (plain, masked, preserve: auto, strength
                      0.5), engines rows 1/4/4, 2 threads

Writes ``<out>/check-sd15.json`` (per stage: seconds, peak_rss_bytes, disk_bytes, ok, error;
the machine, the model's parameter counts, the run config, the graphs' hashes, the bars) and
prints a table. Exits 1 when a stage fails or is skipped, or (at --scale 1.0) a bar of issue
34 is missed: run peak RSS <= 10 GB, export peak <= 9 GB, the model's build/ <= 8 GB
(GB = 10^9 bytes). Without --keep the models and build/ are removed at the end (the JSON,
configs, logs and PNGs stay); rerunning a subset with --stages needs the earlier --keep.

    .venv/bin/python scripts/check_sd15.py --out build/check-sd15             # SD 1.5's size
    .venv/bin/python scripts/check_sd15.py --out /tmp/c --scale 0.1 --size 128 --steps 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import psutil

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("build", "single_file", "convert", "export", "export_converted", "engines", "cpu_engines", "interactive",
          "run")  # fmt: skip
# A stage runs only when the stages it reads from ran fine in this invocation or were left out
# of --stages (their outputs then have to be on disk from an earlier --keep run).
NEEDS = {"single_file": ("build",), "convert": ("single_file",), "export": ("build",),
         "export_converted": ("convert", "export"), "engines": ("export",), "cpu_engines": ("export",),
         "interactive": ("export",), "run": ("engines",)}  # fmt: skip
GB = 10**9
# issue 34's (and 40's) bars for SD 1.5 on 2 cores, checked at --scale 1.0 only
# (name, stage, what of its result, limit): "disk:<folder>" is a folder's size after the stage
BARS = (("run peak RSS", "run", "peak_rss_bytes", 10 * GB),
        ("run peak RSS on the default engine, 4 rows (issue 40)", "run", "peak_rss_bytes", 8 * GB), ("export peak RSS", "export", "peak_rss_bytes", 9 * GB),
        ("export (converted) peak RSS", "export_converted", "peak_rss_bytes", 9 * GB),
        ("build/ of the model (onnx + engines)", "engines", "disk:build_model", 8 * GB))  # fmt: skip
MODEL, CONVERTED = "sd15-random", "sd15-single"
EDIT_PROMPT = "a watercolor painting of a red fox in a snowy forest"
BASE_PROMPT = "a photo of a red fox in a snowy forest"


def log(text: str) -> None:
    print(f"[check-sd15] {text}", flush=True)


def human(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


# --- measuring ----------------------------------------------------------------------------


def tree_rss(proc: psutil.Process) -> int:
    """RSS of ``proc`` and all its descendants, summed (a process that exits meanwhile counts 0)."""
    total = 0
    try:
        members = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    for p in members:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


@dataclass
class Measured:
    """What one measured command did."""

    returncode: int
    seconds: float
    peak_rss_bytes: int  # max(sampled tree sum, the process's own exact peak)
    sampled_peak_bytes: int
    own_peak_bytes: int  # wait4's ru_maxrss: the peak of the process itself or of a reaped child


def measure(cmd: list[str], log_path: Path, env: Optional[dict] = None, interval: float = 0.2,
            heartbeat: Optional[float] = None, label: str = "") -> Measured:  # fmt: skip
    """Run ``cmd`` (stdout and stderr into ``log_path``), sampling its process tree's RSS every
    ``interval`` seconds; every ``heartbeat`` seconds print how far it is."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # a forked child's ru_maxrss starts at its parent's *peak* RSS (fork copies the memory map
    # with its high-water mark, and exec keeps the larger): a peak no higher than that says
    # nothing about the command, and the sampler's is taken
    parent_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with open(log_path, "wb") as sink:
        child = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    peak, done = 0, threading.Event()
    proc = psutil.Process(child.pid)

    def sample() -> None:
        nonlocal peak
        last_beat = start
        while not done.is_set():
            peak = max(peak, tree_rss(proc))
            now = time.perf_counter()
            if heartbeat and now - last_beat >= heartbeat:
                last_beat = now
                log(f"{label}: running, {now - start:.0f} s, peak RSS so far {human(peak)}")
            done.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # wait4, not Popen.wait: its rusage holds the exact peak RSS of the process (and of the
    # children it reaped), which a 0.2 s sampler can miss on a short spike.
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    child.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait on a reaped pid
    own = int(usage.ru_maxrss) * 1024  # kilobytes on Linux
    if own <= 1.05 * parent_rss:
        own = 0
    return Measured(child.returncode, round(seconds, 2), max(peak, own), peak, own)


def tree_bytes(path: Path) -> int:
    """Bytes the files under ``path`` take, each inode once (hard links are one copy on disk)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    seen, total = set(), 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen and not os.path.islink(os.path.join(dirpath, name)):
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def graph_files(onnx_dir: Path) -> dict[str, str]:
    """sha256 of every .onnx and .onnx_data file of an export folder, by file name (none: {})."""
    if not onnx_dir.is_dir():
        return {}
    return {p.name: sha256(p) for p in sorted(onnx_dir.iterdir()) if p.suffix in (".onnx", ".onnx_data")}


def safetensors_parameters(folder: Path) -> int:
    """Parameters in the safetensors files of ``folder`` (from their headers; nothing is loaded)."""
    total = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for d in entry["shape"]:
                    n *= d
                total += n
    return total


def machine() -> dict:
    vm = psutil.virtual_memory()
    return {"cpu_count": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
            "ram_bytes": vm.total, "ram_available_bytes": vm.available, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version()}  # fmt: skip


# --- the check's files --------------------------------------------------------------------


@dataclass
class Layout:
    """Where each stage reads and writes, under ``--out``."""

    out: Path

    @property
    def model(self) -> Path:
        return self.out / "models" / MODEL

    @property
    def single_file(self) -> Path:
        return self.out / "models" / f"{MODEL}.safetensors"

    @property
    def converted(self) -> Path:
        return self.out / "models" / CONVERTED

    @property
    def configs(self) -> Path:  # the scaled model's configs, for converting a scaled file
        return self.out / "models" / f"{MODEL}-configs"

    @property
    def build(self) -> Path:
        return self.out / "build"

    @property
    def run_dir(self) -> Path:
        return self.out / "run"

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    def config(self, converted: bool = False) -> Path:
        return self.out / ("check-sd15-single.yaml" if converted else "check-sd15.yaml")

    def disk(self) -> dict[str, int]:
        folders = {"model": self.model, "single_file": self.single_file, "converted": self.converted,
                   "build_model": self.build / MODEL, "build_converted": self.build / CONVERTED, "run": self.run_dir}  # fmt: skip
        return {name: tree_bytes(p) for name, p in folders.items() if p.exists()}


def run_config(layout: Layout, size: int, steps: int, tail: float, converted: bool = False, backend: str = "auto",
               precision: str = "fp16") -> dict:  # fmt: skip
    """The `edit-rt run` config of the check: one base, four edits of one tail (issue 34), on
    ``backend`` (auto: the default engine) at ``precision`` (bf16: openvino's)."""
    quarter = size // 2
    return {
        "model": str((layout.converted if converted else layout.model).resolve()),
        "build_dir": str(layout.build.resolve()),
        "output_dir": str((layout.run_dir if not converted else layout.out / "run-converted").resolve()),
        "backend": backend,  # auto: the default engine (docs/engines.md)
        "threads": 2,
        # issue 40's bar is a run within 8 GB: told so, auto takes the engine that fits it (ort-cpu
        # at this size; openvino fp32 needs ~13 GB at 4 rows, docs/engines.md)
        "engines": {"min_batch": 1, "opt_batch": 4, "max_batch": 4, "precision": precision, "max_memory_gb": 8.0},
        "base": {"prompt": BASE_PROMPT, "negative_prompt": "", "seed": 0, "steps": steps, "guidance": 7.5,
                 "width": size, "height": size},  # fmt: skip
        "cache": {"window_start": 0, "default_tail_fraction": tail, "default_strength": 1.0},
        "edits": [  # plain, masked to the top-left quarter, preserve: auto, half strength
            {"prompt": EDIT_PROMPT},
            {"prompt": EDIT_PROMPT, "mask": {"x": 0, "y": 0, "width": quarter, "height": quarter}},
            {"prompt": EDIT_PROMPT, "preserve": "auto"},
            {"prompt": EDIT_PROMPT, "strength": 0.5},
        ],
    }


def write_configs(layout: Layout, args) -> dict:
    import yaml

    layout.out.mkdir(parents=True, exist_ok=True)
    for converted in (False, True):
        cfg = run_config(layout, args.size, args.steps, args.tail, converted, args.backend, args.precision)
        layout.config(converted).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run_config(layout, args.size, args.steps, args.tail, backend=args.backend, precision=args.precision)


# --- the workers (each stage that is not an edit-rt command) -------------------------------


def worker_build(layout: Layout, args) -> None:
    from edit_rt.export.world.sd_random import write_random_sd

    shutil.rmtree(layout.model, ignore_errors=True)
    write_random_sd(layout.model, family="sd15", seed=args.seed, scale=args.scale)


def worker_single_file(layout: Layout, args) -> None:
    sys.path.insert(0, str(ROOT))
    from tests import ldm_layout
    layout.single_file.unlink(missing_ok=True)
    ldm_layout.write_single_file(layout.model, layout.single_file)


def worker_convert(layout: Layout, args) -> None:
    from edit_rt.export.compile import checkpoint, family_configs

    config_dir = None
    if args.scale != 1.0:  # the shipped configs are SD 1.5's widths: a narrower file needs its own
        shutil.rmtree(layout.configs, ignore_errors=True)
        for path in layout.model.rglob("*.json"):
            if path.parent.name != "tokenizer":
                target = layout.configs / path.relative_to(layout.model)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
        family_configs.clip_tokenizer_files(layout.configs / "tokenizer")  # as the shipped path builds it
        config_dir = layout.configs
    shutil.rmtree(layout.converted, ignore_errors=True)
    checkpoint.diffusers_from_single_file(layout.single_file, layout.converted, config_dir=config_dir)


def worker_cpu_engines(layout: Layout, args) -> None:
    from edit_rt.export.bench.cpu_engines import measure_engines, print_table

    report = measure_engines(layout.config(), ns=(1, 4), k=2, repeats=1, threads=2, base_steps=2, say=log)
    (layout.out / "cpu-engines.json").write_text(json.dumps(report, indent=2) + "\n")
    print_table(report, say=log)


def worker_interactive(layout: Layout, args) -> None:
    from edit_rt.export.bench.interactive import slider_move_keys
    from edit_rt.export.bench.slider_move import measure_slider_moves, print_table

    # 2 moves a case: at SD 1.5's size today's default move is ~43 s on ort-cpu, and the stage
    # runs three engines (with their bases, warm-ups and a server each) in ~20 minutes
    moves = measure_slider_moves(layout.config(), repeats=2, threads=2, sections=True, images=layout.out / "interactive",
                                 say=log)  # fmt: skip
    (layout.out / "interactive.json").write_text(json.dumps(slider_move_keys(moves), indent=2) + "\n")
    print_table(moves, say=log)
    if moves["default_engine"] not in moves["engines"]:
        raise SystemExit(f"interactive: the default engine ({moves['default_engine']}) measured no move")


WORKERS = {"build": worker_build, "single_file": worker_single_file, "convert": worker_convert,
           "cpu_engines": worker_cpu_engines, "interactive": worker_interactive}  # fmt: skip


def worker_main(stage: str, layout: Layout, args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    WORKERS[stage](layout, args)
    return 0


# --- the check ----------------------------------------------------------------------------


@dataclass
class StageResult:
    ok: bool = False
    skipped: Optional[str] = None
    seconds: Optional[float] = None
    peak_rss_bytes: Optional[int] = None
    sampled_peak_bytes: Optional[int] = None
    own_peak_bytes: Optional[int] = None
    disk_bytes: Optional[int] = None  # build/ after the stage
    written_bytes: Optional[int] = None  # growth of --out during the stage
    disk: dict = field(default_factory=dict)
    command: list = field(default_factory=list)
    log: Optional[str] = None
    error: Optional[str] = None


def edit_rt_command() -> list[str]:
    script = Path(sys.executable).with_name("edit-rt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "edit_rt.runtime.apps.cli"]


def stage_command(stage: str, layout: Layout, args) -> list[str]:
    if stage in WORKERS:
        return [sys.executable, str(Path(__file__).resolve()), "--worker", stage, "--out", str(layout.out),
                "--scale", repr(args.scale), "--seed", str(args.seed)]  # fmt: skip
    verb = "export" if stage.startswith("export") else stage
    return edit_rt_command() + [verb, str(layout.config(converted=stage == "export_converted"))]


def log_tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:] if line.strip())


def check_run_outputs(layout: Layout) -> tuple[dict, Optional[str]]:
    """The run's PNGs (base + 4 edits): present, and not one flat colour (what NaNs decode to)."""
    import numpy as np
    from PIL import Image

    images, missing = {}, []
    for name in ["base.png"] + [f"edit_{i:02d}.png" for i in range(4)]:
        path = layout.run_dir / name
        if not path.is_file():
            missing.append(name)
            continue
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"), dtype=np.float64)
            size = list(image.size)
        images[name] = {"size": size, "mean": round(float(pixels.mean()), 2), "std": round(float(pixels.std()), 2)}
    flat = [name for name, v in images.items() if v["std"] == 0.0]
    error = None
    if missing:
        error = f"run wrote no {', '.join(missing)} in {layout.run_dir}"
    elif flat:
        error = f"flat images (NaN or saturated latents): {', '.join(flat)}"
    return images, error


def compare_graphs(layout: Layout) -> tuple[dict, Optional[str]]:
    """Every graph file of the converted folder's export against the folder's own."""
    ours, theirs = (graph_files(layout.build / name / "onnx") for name in (MODEL, CONVERTED))
    files = {name: {"sha256": ours.get(name), "sha256_converted": theirs.get(name),
                    "bytes": tree_bytes(layout.build / MODEL / "onnx" / name) if name in ours else None}
             for name in sorted(set(ours) | set(theirs))}  # fmt: skip
    differ = [name for name, v in files.items() if v["sha256"] != v["sha256_converted"]]
    identical = bool(files) and not differ
    return ({"identical": identical, "files": files},
            None if identical else f"graphs differ from the folder's export: {', '.join(differ) or 'no graphs'}")  # fmt: skip


def run_stage(stage: str, layout: Layout, args, env: dict) -> tuple[StageResult, dict]:
    result, extra = StageResult(), {}
    result.command = stage_command(stage, layout, args)
    log_path = layout.logs / f"{stage}.log"
    result.log = str(log_path)
    before = tree_bytes(layout.out)
    log(f"{stage}: start ({' '.join(Path(c).name if i == 0 else c for i, c in enumerate(result.command))})")
    m = measure(result.command, log_path, env=env, heartbeat=args.heartbeat, label=stage)
    result.seconds, result.peak_rss_bytes = m.seconds, m.peak_rss_bytes
    result.sampled_peak_bytes, result.own_peak_bytes = m.sampled_peak_bytes, m.own_peak_bytes
    if m.returncode != 0:
        result.error = f"exit status {m.returncode}: {log_tail(log_path)}"
    else:
        result.ok = True
    result.written_bytes = tree_bytes(layout.out) - before
    if result.ok and stage == "export_converted":
        extra["graphs"], result.error = compare_graphs(layout)
        result.ok = result.error is None
    if result.ok and stage == "cpu_engines":
        extra["cpu_engines"] = json.loads((layout.out / "cpu-engines.json").read_text())
    if result.ok and stage == "interactive":
        extra["interactive"] = json.loads((layout.out / "interactive.json").read_text())
    if result.ok and stage == "run":
        extra["images"], result.error = check_run_outputs(layout)
        result.ok = result.error is None
    result.disk = layout.disk()  # before the clean-up below: what the stage left
    result.disk_bytes = tree_bytes(layout.build) if layout.build.exists() else 0
    if result.ok and not args.keep:  # what no later stage reads (at SD 1.5's size 4.3 GB a copy)
        spent = {"convert": [layout.single_file, layout.configs],
                 "export_converted": [layout.build / CONVERTED, layout.converted]}.get(stage, [])  # fmt: skip
        for path in spent:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    status = "ok" if result.ok else (f"skipped: {result.skipped}" if result.skipped else f"FAILED: {result.error}")
    log(f"{stage}: {status}; {result.seconds:.1f} s, peak RSS {human(result.peak_rss_bytes)}, "
        f"wrote {human(result.written_bytes)}, build/ {human(result.disk_bytes)}")  # fmt: skip
    return result, extra


def bars(results: dict[str, StageResult], scale: float) -> list[dict]:
    """Issue 34's bars: checked (``applies``) at the true size only, reported at every size."""
    out = []
    for name, stage, key, limit in BARS:
        r = results.get(stage)
        value = None
        if r is not None and r.ok:
            value = r.disk.get(key[5:]) if key.startswith("disk:") else getattr(r, key)
        applies = scale == 1.0 and value is not None
        out.append({"name": name, "stage": stage, "limit_bytes": limit, "value_bytes": value, "applies": applies,
                    "ok": (value <= limit) if applies else None})  # fmt: skip
    return out


def model_parameters(layout: Layout) -> dict:
    parts = {part: safetensors_parameters(layout.model / part) for part in ("unet", "vae", "text_encoder")
             if (layout.model / part).is_dir()}  # fmt: skip
    return {**parts, "total": sum(parts.values())} if parts else {}


def print_table(results: dict[str, StageResult], bar_rows: list[dict]) -> None:
    print(f"{'stage':<17} {'status':<8} {'seconds':>8} {'peak RSS':>10} {'build/':>10} {'written':>10}")
    for stage, r in results.items():
        status = "ok" if r.ok else ("skipped" if r.skipped else "FAILED")
        seconds = f"{r.seconds:.1f}" if r.seconds is not None else "-"
        print(f"{stage:<17} {status:<8} {seconds:>8} {human(r.peak_rss_bytes):>10} {human(r.disk_bytes):>10} "
              f"{human(r.written_bytes):>10}")  # fmt: skip
    for b in bar_rows:
        verdict = ("pass" if b["ok"] else "MISSED") if b["applies"] else "not checked (--scale < 1)"
        print(f"bar: {b['name']} {human(b['value_bytes'])} <= {human(b['limit_bytes'])}: {verdict}")


def print_interactive(section: dict) -> None:
    """The interactive stage's moves: each engine and case against its UNet rows' limit."""
    from edit_rt.export.bench.slider_move import print_table as print_moves

    print_moves(section["slider_moves"])
    print(f"a slider move on the default engine ({section['slider_moves']['default_engine']}): few-step "
          f"{section['few_step_move_seconds']:.2f} s ({section['few_step_move_over_limit']:.2f}x its UNet rows' limit; "
          f"issue 51's bar: 1.3x), today's default {section['default_move_seconds']:.2f} s")  # fmt: skip


def check(args) -> int:
    layout = Layout(Path(args.out))
    selected = [s for s in STAGES if s in args.stages]
    layout.logs.mkdir(parents=True, exist_ok=True)
    config = write_configs(layout, args)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("EDIT_RT_LOG", "INFO")  # the stage logs say what each command did
    report = {"version": 1, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
              "options": {"scale": args.scale, "steps": args.steps, "size": args.size, "tail": args.tail,
                          "seed": args.seed, "keep": args.keep, "stages": selected},
              "model": {"family": "sd15", "path": str(layout.model)}, "config": config}  # fmt: skip
    results: dict[str, StageResult] = {}
    for stage in selected:
        failed = [n for n in NEEDS.get(stage, ()) if n in results and not results[n].ok]
        if failed:
            results[stage] = StageResult(skipped=f"needs {', '.join(failed)}")
            log(f"{stage}: skipped (needs {', '.join(failed)})")
            continue
        results[stage], extra = run_stage(stage, layout, args, env)
        report.update(extra)
        if stage == "build" and results[stage].ok:
            report["model"]["parameters"] = model_parameters(layout)
    report["model"].setdefault("parameters", model_parameters(layout))
    report["stages"] = {name: asdict(r) for name, r in results.items()}
    report["bars"] = bar_rows = bars(results, args.scale)
    report["ok"] = all(r.ok for r in results.values()) and all(b["ok"] is not False for b in bar_rows)
    if not args.keep:
        for path in (layout.out / "models", layout.build):
            shutil.rmtree(path, ignore_errors=True)
    (layout.out / "check-sd15.json").write_text(json.dumps(report, indent=2) + "\n")
    print_table(results, bar_rows)
    if "interactive" in report:
        print_interactive(report["interactive"])
    log(f"wrote {layout.out / 'check-sd15.json'}: {'ok' if report['ok'] else 'NOT ok'}")
    return 0 if report["ok"] else 1


def parse_args(argv: Optional[list[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("build/check-sd15"), help="folder of the check's files and JSON")
    p.add_argument("--scale", type=float, default=1.0, help="model widths (1.0: SD 1.5's true size; bars only there)")
    p.add_argument("--steps", type=int, default=10, help="base steps (the edits run the last --tail of them)")
    p.add_argument("--tail", type=float, default=0.5, help="tail fraction of every edit")
    p.add_argument("--size", type=int, default=512, help="image width and height in pixels (a multiple of 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--backend", default="auto", help="the run stage's backend (auto: the default engine)")
    p.add_argument("--precision", default="fp16", choices=("fp16", "fp32", "bf16"),
                   help="the run stage's engines.precision (bf16: openvino on a CPU with it)")
    p.add_argument("--keep", action="store_true", help="keep the models and build/ (to rerun a subset of --stages)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--heartbeat", type=float, default=60.0, help="seconds between 'still running' lines (0: none)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        p.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    if not 0.0 < args.scale <= 1.0:
        p.error(f"--scale: must be in (0, 1], got {args.scale}")
    if args.size % 64 or args.size <= 0:
        p.error(f"--size: {args.size} is not a positive multiple of 64 (the UNet's latent multiple times the VAE's 8)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, Layout(Path(args.out)), args)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
