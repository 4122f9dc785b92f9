"""`edit-rt run CONFIG`: one base, every edit of the config as one batched tail, files out.

Writes to ``output_dir``: ``base.png``, ``edit_XX.png`` (each with its ``parameters`` chunk),
``grid.png`` (base first, then the edits, labelled) and ``report.json`` (times per stage, UNet
rows evaluated against regenerating every edit, the base state's size).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import resource
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import onnxruntime

from .. import __version__
from ..config.run_config import RunConfig
from ..errors import ConfigError, DamagedBaseError, ImageInputError
from ..model.edit import Direction, Edit, TailRow
from ..model.samplers import IMAGE_SAMPLER
from ..pipeline.assemble import pipeline_of, store_of
from ..pipeline.catalogue import catalogue_decoder, run_catalogue
from ..pipeline.images import contact_sheet, save_png
from ..pipeline.pnginfo import base_fields, directions_text, edit_fields, parameters_text
from ..pipeline.uploads import Upload, image_from_bytes
from ..storage.store import base_id

log = logging.getLogger(__name__)

# (total steps, description) -> an advance(n) callable; the CLI passes a progress bar here.
ProgressFactory = Callable[[int, str], Callable[[int], None]]


def _no_progress(total: int, description: str) -> Callable[[int], None]:
    return lambda n: None


@dataclass
class Timer:
    stages: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.stages[name] = round(time.perf_counter() - start, 4)


def edit_label(edit: Edit, strength: float, start_step: int, steps: int, preserve: str = "none",
               directions: Sequence[Direction] = ()) -> str:  # fmt: skip
    """``edit.label``, else a summary of what ran: ``strength`` and ``directions`` resolved (the
    defaults filled in), the tail, preserve, mask, seed, then the prompt and its directions."""
    if edit.label:
        return edit.label
    # The fields that tell the cells apart first: the grid cuts long labels.
    parts = [f"x{strength:g}"] if edit.prompt is not None else []
    parts.append(f"tail {steps - start_step}")
    if preserve == "auto":
        parts.append("auto")
    if edit.mask is not None:
        parts.append("masked")
    if edit.seed is not None:
        parts.append(f"seed {edit.seed}")
    prompts = [edit.prompt] if edit.prompt is not None else []
    if directions:
        prompts.append(directions_text(directions))
    return " ".join(parts) + ": " + " + ".join(prompts)


def grid_rows(edit_rows: Sequence[int], n_edits: int, per_row: int = 4) -> list[list[int]]:
    """The grid's rows of image indices (0: the base, k: edit k - 1): the base and the plain
    edits four to a row, in order, and each sweep (an edit of ``edit_rows`` > 1) on a row of
    its own, its positions left to right."""
    spans = [(sum(edit_rows[:i]), n) for i, n in enumerate(edit_rows)] if sum(edit_rows) == n_edits else [(i, 1) for i in range(n_edits)]
    rows: list[list[int]] = [[0]]
    for first, n in spans:
        cells = [1 + first + j for j in range(n)]
        if n > 1:
            rows += [cells, []]
        elif len(rows[-1]) < per_row:
            rows[-1] += cells
        else:
            rows.append(cells)
    return [r for r in rows if r]


def image_of(cfg: RunConfig) -> Upload:
    """``base.image``, read as the server reads an upload (the same checks, the same key)."""
    path, s = Path(cfg.base.image), cfg.serve
    try:
        return image_from_bytes(path.read_bytes(), (cfg.base.width, cfg.base.height), "base.image", s.max_image_bytes,
                                s.resize_uploads, s.max_image_pixels)  # fmt: skip
    except ImageInputError as err:
        raise ConfigError(f"{err} ({path})") from None
    except OSError as err:
        raise ConfigError(f"base.image: {path} cannot be read ({err.strerror})") from None


def writable_or_refuse(folder: Path, field: str) -> None:
    """Make ``folder`` and write a probe file in it, or say which setting to change."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ConfigError(f"{field}: {folder} is not a writable folder ({err.strerror}); pick another") from None


def tail_rows(cfg: RunConfig) -> list[TailRow]:
    """The config's edits as the rows they run (edit.resolve_edit, as the server resolves them)."""
    return [cfg.tail_row(e, f"edits[{i}]") for i, e in enumerate(cfg.edits)]


@contextmanager
def _no_stage(name: str) -> Iterator[None]:
    yield


def run_config(cfg: RunConfig, progress: ProgressFactory = _no_progress,
               stage: Callable[[str], Any] = _no_stage) -> dict[str, Any]:  # fmt: skip
    """Run ``cfg`` end to end and return the report (also written to report.json).

    ``progress`` makes a bar per counted stage (base, edit tail), ``stage(name)`` is a context
    for the uncounted ones (loading, decoding each image). Each image is written as soon as it
    is decoded, so a run killed while decoding keeps the images before it. (A plan config,
    ``plan:``, runs run_plan.py's instead.)"""
    if cfg.plan is not None:
        raise ConfigError("plan: a plan config runs run_plan (`edit-rt run` chooses it)")
    timer = Timer()
    base, T = cfg.base, cfg.base.steps
    rows = tail_rows(cfg)
    _refuse_before_work(cfg)
    upload = None
    if base.image is not None:  # a base from an image: its key holds the pixels' hash
        if base.sampler not in (None, IMAGE_SAMPLER):
            raise ConfigError(f"base.sampler: {base.sampler}, but a base from an image is inverted with DDIM and its "
                              "edits run DDIM; remove base.sampler (or set ddim)")  # fmt: skip
        upload = image_of(cfg)
        base = dataclasses.replace(base, image=upload.key, sampler=IMAGE_SAMPLER)
    with timer.stage("load"):
        pipe = pipeline_of(cfg)
        pipe.check_decoder(cfg.decoder)  # decoder: taesd on an export without one, before any step
        if cfg.catalogue is not None:
            catalogue_decoder(cfg, pipe)  # and catalogue.decoder
        if upload is not None:  # encoded by the decoder's own autoencoder: its key says which (uploads.py)
            base = dataclasses.replace(base, image=upload.key_for(pipe.encoder_for(cfg.decoder)))
        # what can be refused is, before the graphs' seconds of loading: the size, its memory
        shape = pipe.latent_shape(base)  # and the rows per call that fit at it
        with stage("loading the graphs"):
            pipe.activate()
    # what runs, named in the base (its store key, its PNG's Sampler)
    base = dataclasses.replace(base, sampler=pipe.sampler_of(base))
    catalogue = None
    try:
        store = store_of(cfg, pipe.manifest.fingerprint)
        bid = base_id(pipe.manifest.fingerprint, base)
        stats = pipe.batcher(shape).scheduler.stats  # what the step loop ran
        rows_per_call, images_per_decode = pipe.batcher(shape).scheduler.max_rows, pipe.decode_rows(shape)
        counted = [dataclasses.replace(stats)]
        with timer.stage("base_generation"):
            state, base_source = _base_state(cfg, pipe, store, bid, base, upload, progress)
        counted.append(dataclasses.replace(stats))
        with timer.stage("edit_tail"):
            row_steps = sum(T - r.start_step for r in rows)
            results = pipe.edit(state, rows, progress=progress(row_steps, "edit tail"), decode=False)
        counted.append(dataclasses.replace(stats))
        with timer.stage("decode"), output_errors(cfg.output_dir):
            written = _write_images(cfg, pipe, state, base, bid, rows, results, stage)
        if cfg.catalogue is not None:  # after the edits, image by image (catalogue.py)
            with timer.stage("catalogue"), output_errors(cfg.output_dir):
                catalogue = run_catalogue(cfg, pipe, state, base, bid, progress)
            counted.append(dataclasses.replace(stats))
    finally:
        pipe.deactivate()

    with timer.stage("write"), output_errors(cfg.output_dir):
        contact_sheet(written.images, written.labels, rows=grid_rows(cfg.edit_rows, len(written.images) - 1)).save(
            cfg.output_dir / "grid.png")  # fmt: skip
    n = len(rows) + (catalogue["run"] if catalogue is not None else 0)
    unet_rows = _unet_rows(counted, T, n)
    report = {
        "edit_rt_version": __version__,
        "config": str(cfg.source) if cfg.source else None,
        "model": str(cfg.model),
        "backend": pipe.graph_set.backend,
        "backend_reason": pipe.graph_set.reason,
        "graphs": {name: str(path) for name, path in pipe.graph_set.files.items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "onnxruntime": onnxruntime.__version__, "threads": cfg.threads or "all"},  # fmt: skip
        "base": {"prompt": base.prompt, "negative_prompt": base.negative_prompt, "seed": base.seed,
                 "steps": T, "guidance": base.guidance, "size": f"{base.width}x{base.height}", "sampler": base.sampler},  # fmt: skip
        "edits": written.report,
        "files": written.files + ["grid.png"],
        "seconds": timer.stages,
        "unet_rows": unet_rows,
        # what this process held at its peak, and the rows a call ran at (engine/memory.py)
        "memory": {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "step_rows_per_call": rows_per_call, "images_per_decode": images_per_decode},  # fmt: skip
        "decoder": cfg.decoder,  # what decoded the images (pipeline/decoders.py)
        "base_state_bytes": state.nbytes,
        "base_id": bid,
        "base_source": base_source,
        "store": store.stats(),
    }
    if catalogue is not None:
        report["catalogue"] = {**catalogue, "unet_rows": unet_rows["catalogue"]}
    with output_errors(cfg.output_dir):
        (cfg.output_dir / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _refuse_before_work(cfg: RunConfig) -> None:
    """What can be refused before minutes of work: a catalogue's edits and sliders (its rows are
    made as they run), and an output folder that cannot be written."""
    if cfg.catalogue is not None:
        for i, edit in enumerate(cfg.catalogue.edits):
            cfg.tail_row(edit, f"catalogue.edits[{i}]")
        for j, slider in enumerate(cfg.catalogue.sliders):
            if slider.adapter is not None and slider.adapter not in cfg.adapters:
                raise ConfigError(f"catalogue.sliders[{j}].adapter: {slider.adapter!r} is not in adapters: "
                                  f"({', '.join(cfg.adapters) or 'none'}); add it there or name one of those")  # fmt: skip
    writable_or_refuse(cfg.output_dir, "output_dir")


def _base_state(cfg: RunConfig, pipe, store, bid: str, base, upload, progress: ProgressFactory):
    """The base's state and where it came from: the store (a base kept with at least the
    config's window), inverted from ``base.image``, or generated; a new one is kept."""
    T = base.steps
    tier = store.tier(bid)
    try:
        state = store.get(bid) if tier else None
    except DamagedBaseError as err:  # set aside by the store (an older version's file, say): made again
        log.warning("%s", err)
        state = None
    if state is not None and state.window_start <= cfg.cache.window_start:
        return state, f"store ({tier})"
    if upload is not None:
        state = pipe.invert(upload.pixels, base, cfg.cache.window_start, progress=progress(2 * (T - cfg.cache.window_start), "inversion"),
                            encoder=pipe.encoder_for(cfg.decoder))  # fmt: skip
        source = "inverted"
    else:
        state = pipe.generate_base(base, cfg.cache.window_start, progress=progress(T, "base"))
        source = "generated"
    store.put(state)
    return state, source


@dataclass
class _Written:
    """The images a run wrote, in the grid's order, with their labels and report entries."""

    images: list = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    report: list[dict] = field(default_factory=list)


def _write_images(cfg: RunConfig, pipe, state, base, bid: str, rows: list[TailRow], results, stage) -> _Written:
    """base.png then each edit_XX.png, decoded and written one by one (each with its parameters)."""
    out, T, fingerprint = _Written(), base.steps, state.fingerprint
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    with stage("decoding base.png"):
        out.images.append(pipe.base_image(state, cfg.decoder))
        save_png(cfg.output_dir / "base.png", out.images[0],
                 parameters_text(base.prompt, base.negative_prompt, base_fields(base, cfg.model_name, fingerprint, bid)))  # fmt: skip
    out.files.append("base.png")
    out.labels.append("base: " + base.prompt)
    # masked and preserve: auto edits show the base's own pixels outside their masks
    decoded = pipe.render_each(state, rows, results, cfg.decoder) if rows else iter(())
    for k, (edit, row) in enumerate(zip(cfg.edits, rows)):
        name = f"edit_{k:02d}.png"
        with stage(f"decoding {name}"):
            out.images.append(next(decoded))
            fields = edit_fields(base, row, cfg.model_name, fingerprint, bid, results[k].preserve, results[k].uncond)
            save_png(cfg.output_dir / name, out.images[-1], parameters_text(row.prompt, base.negative_prompt, fields))
        label = edit_label(edit, row.strength, row.start_step, T, results[k].preserve, row.directions)
        out.files.append(name)
        out.labels.append(label)
        directions = {"directions": [dataclasses.asdict(d) for d in row.directions]} if row.directions else {}
        out.report.append({"file": name, "label": label, "prompt": row.prompt, "strength": row.strength,
                           "start_step": row.start_step, "tail_steps": T - row.start_step,
                           "guidance": row.guidance, "masked": row.mask is not None, "seed": row.seed,
                           "preserve": results[k].preserve, "uncond": results[k].uncond,
                           "deepcache": row.deepcache, **directions})  # fmt: skip
    return out


def _unet_rows(counted: list, T: int, n: int) -> dict[str, Any]:
    """What the scheduler ran (``counted``: its stats before the base, after it, after the edit
    tail and, with a catalogue, after it), against regenerating each of ``n`` images and the base.

    Not arithmetic on the config: a stored base costs no UNet row, an inversion its rows
    backwards and forwards; a tail's reference rows (structure keeping) count, and entry-step
    reuse skips the unconditional half of a row at its entry step. A catalogue's rows count in
    the total and in what regenerating every image would have cost, as the edits' do. Each row
    is one unet_step row: two UNet evaluations (unconditional + conditional)."""
    before, based, done = counted[:3]
    last = counted[-1]
    base_rows = based.row_steps - before.row_steps
    tail_rows_run = done.row_steps - based.row_steps
    catalogue_rows = last.row_steps - done.row_steps
    total = base_rows + tail_rows_run + catalogue_rows
    return {
        "base": base_rows,
        "edit_tails": tail_rows_run,
        "catalogue": catalogue_rows,
        "total": total,
        "reference_rows": last.reference_steps - based.reference_steps,
        "half_rows_skipped": last.uncond_rows_skipped - before.uncond_rows_skipped,
        # rows at guidance <= 1 (the conditional prediction alone): their row-steps, and the
        # unconditional halves of those the UNet did not run (the rest: a GPU bucket's rounding, or
        # one a call on an export without step_all_given)
        "unguided_rows": last.unguided_row_steps - before.unguided_row_steps,
        "unguided_halves_skipped": last.unguided_rows_skipped - before.unguided_rows_skipped,
        "padding_rows": (last.rows_computed - before.rows_computed) - total,
        "regenerating_every_edit": T * (n + 1),
        "saving": round(1 - total / (T * (n + 1)), 4),
    }


@contextmanager
def output_errors(folder: Path) -> Iterator[None]:
    """A write into ``output_dir`` that fails (a full disk, say) as one line naming the fix."""
    try:
        yield
    except OSError as err:
        raise ConfigError(f"output_dir: writing in {folder} failed ({err.strerror or err}); free space there "
                          "or choose another output_dir") from None  # fmt: skip
