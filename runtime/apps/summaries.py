"""What ``edit-rt`` prints when a command is done: the summary tables and lines of ``run`` and
``bench`` (rich tables on stdout; the reports themselves are the JSON files beside them)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table


def print_bench(report: dict, output_dir: Path) -> None:
    """`edit-rt bench`'s table (edits/s per method, N and K/T, against the ideal) and its side measurements."""
    m = report["machine"]
    title = (
        f"edit-rt bench: {report['unet_parameters'] / 1e6:.1f} M UNet, latents {report['latent']}, T={report['steps']}, "
        f"{report['backend']}, {m['threads']} threads ({m['cpus']} CPUs), median of {report['repeats']}"
    )
    table = Table(title=title, title_justify="left")
    for column in ("N", "K/T", "(a) diffusers edits/s", "(b) img2img edits/s", "(d) edit-rt edits/s",
                   "(d)/(a)", "ideal", "efficiency", "(d)/(b)", "(e)/(d) uncond base",
                   "(f)/(d) deepcache 3"):  # fmt: skip
        table.add_column(column, justify="right")
    points = {(p["method"], p["n"], p["tail_fraction"]): p for p in report["points"]}
    for c in report["comparisons"]:
        n, f = c["n"], c["tail_fraction"]
        table.add_row(
            str(n), f"{f:g}", f"{points[('diffusers', n, None)]['edits_per_s']:.2f}",
            f"{points[('img2img', n, f)]['edits_per_s']:.2f}", f"{points[('edit-rt tail', n, f)]['edits_per_s']:.2f}",
            f"{c['speedup_vs_diffusers']:.1f}x", f"{c['ideal_speedup_vs_diffusers']:.1f}x", f"{c['efficiency']:.2f}",
            f"{c['speedup_vs_img2img']:.2f}x", f"{c['uncond_reuse_speedup']:.2f}x", f"{c['deepcache_3_speedup']:.2f}x",
        )  # fmt: skip
    out = Console()
    out.print(table)
    if "deepcache_generation_speedup" in report:
        g = report["deepcache_generation_speedup"]
        out.print(f"base.deepcache 3: a generation {g['median']:.2f}x as fast (spread {g['spread'][0]:.2f}-{g['spread'][1]:.2f})")
    steps = report["per_step_row_seconds"]
    out.print(
        "per-row CFG step (ms): torch " + ", ".join(f"N={n} {v * 1e3:.1f}" for n, v in steps["torch"].items())
        + " | runtime " + ", ".join(f"N={n} {v * 1e3:.1f}" for n, v in steps["runtime"].items())
    )  # fmt: skip
    full = points[("edit-rt full", 1, None)]
    out.print(f"(c) edit-rt full generation: {full['seconds']:.2f} s; base state {report['base_state_bytes'] / 1024:.0f} KiB per base")
    extras = {  # the side-by-side measurements, when the report has them
        "server_vs_run": lambda d: (
            f"server, {d['n']} concurrent single-edit requests of one base ({d['tail_steps']}-step tails): "
            f"{d['server_edits_per_s']:.2f} edits/s vs {d['run_edits_per_s']:.2f} as one run tail ({d['ratio']:.2f}x)"),
        "entry_reuse": lambda d: (
            f"entry-step reuse, {d['n']} rows x {d['tail_steps']} steps: {d['half_rows_skipped']} of "
            f"{d['half_rows']} half-rows skipped ({d['expected_saving']:.1%}), tail "
            f"{d['seconds_without']:.2f} s -> {d['seconds_with']:.2f} s ({d['measured_saving']:.1%} faster)"),
        "slider_move": lambda d: (
            f"a slider move (1 row x {d['tail_steps']} steps, prompt encoded): {d['seconds_move']:.3f} s, its UNet calls "
            f"{d['seconds_move_unet']:.3f} s ({d['move_over_unet']:.2f}x); the first edit, encoding: {d['seconds_first_edit']:.3f} s; "
            f"the page's drag through the server: {d['page_drag_seconds']:.3f} s ({d['page_drag_over_unet']:.2f}x its UNet calls)"),
        "catalogue": lambda d: (
            f"catalogues ({d['tail_steps']}-step tails, PNGs written): " + ", ".join(
                f"{n} rows {v['edits_per_s']:.2f} edits/s ({d['edits_per_s_over_smallest'][n]:.2f}x, peak {v['peak_rss_mb']:.0f} MB)"
                for n, v in d["sizes"].items())),
        "inversion": lambda d: (
            f"a base from an image: {d['seconds_invert']:.2f} s ({d['rows_backwards']} rows back, one at a time, + "
            f"{d['rows_forward']} one-step rows forward, batched) vs {d['seconds_generate']:.2f} s to generate one "
            f"({d['ratio']:.2f}x)"),
        "preserve_cost": lambda d: (
            f"preserve: auto, {d['n']} rows x {d['tail_steps']} steps ({d['map_steps']} on the maps graph): "
            f"{d['seconds_auto']:.2f} s vs {d['seconds_none']:.2f} s without ({d['ratio']:.2f}x)"),
        "structure_cost": lambda d: (
            f"structure keeping, {d['n']} rows x {d['tail_steps']} steps ({d['structure_steps']} with a reference "
            f"row): {d['seconds_structure']:.2f} s vs {d['seconds_none']:.2f} s without ({d['ratio']:.2f}x; "
            f"{d['row_steps_ratio']:.2f}x the rows)"),
        "bucket_cost": lambda d: (
            f"padded buckets (pow2, the GPU default), tails of {d['sizes']} rows x {d['tail_steps']} steps: "
            f"{d['rows_computed_pow2']} rows computed for {d['rows_asked']} asked ({d['rows_ratio']:.2f}x), "
            f"{d['seconds_pow2']:.2f} s vs {d['seconds_exact']:.2f} s at exact counts ({d['ratio']:.2f}x)"),
        "sliders": lambda d: (
            f"LoRA slots ({d['slots']} x rank {d['rank']}), {d['n']} rows x {d['tail_steps']} steps: idle "
            f"{d['ratio_slots_idle_over_plain']:.2f}x, 1 adapter {d['ratio_one_adapter_over_plain']:.2f}x, "
            f"{d['slots']} adapters {d['ratio_all_adapters_over_plain']:.2f}x the graph without slots; a "
            f"{d['sweep']['points']}-point sweep as one tail {d['sweep']['seconds_edit_rt']:.2f} s vs "
            f"{d['sweep']['seconds_diffusers']:.2f} s for diffusers' set_adapters + regeneration "
            f"({d['sweep']['speedup']:.1f}x; rows ideal {d['sweep']['ideal_rows_ratio']:.1f}x); a new LoRA: "
            f"{d['load']['convert_seconds']:.2f} s to convert, {d['load']['slot_load_seconds'] * 1000:.0f} ms into a slot, "
            "no rebuild"),
    }  # fmt: skip
    for key, line in extras.items():
        if report.get(key):
            out.print(line(report[key]))
    interactive = {  # bench.json's interactive section, one line per measurement it has
        "unguided_vs_guided": lambda d: (
            f"interactive: {d['n']} unguided rows x {d['tail_steps']} steps {d['seconds_unguided']:.2f} s vs "
            f"{d['seconds_guided']:.2f} s at guidance {d['guidance']:g} ({d['ratio']:.2f}x, spread "
            f"{d['ratio_spread'][0]:.2f}-{d['ratio_spread'][1]:.2f}; UNet rows {d['unet_rows_unguided']} vs "
            f"{d['unet_rows_guided']}, {d['unet_rows_ratio']:.2f}x)"),
        "taesd_vs_vae": lambda d: (
            f"interactive: a {d['image_size'][0]}x{d['image_size'][1]} decode by the tiny decoder "
            f"{d['seconds_taesd'] * 1e3:.1f} ms vs the VAE {d['seconds_vae'] * 1e3:.1f} ms ({d['ratio']:.3f}x, spread "
            f"{d['ratio_spread'][0]:.3f}-{d['ratio_spread'][1]:.3f})"),
        "slider_moves": lambda d: "\n".join(
            f"interactive: a slider move on {name}: few-step (LCM, a {c['few_step']['tail_steps']}-step tail, "
            f"{c['few_step']['decoder']}) {c['few_step']['seconds']:.3f} s, {c['few_step']['over_limit']:.2f}x its "
            f"{c['few_step']['unet_rows']} UNet rows' limit; today's default ({c['default']['steps']} DDIM steps, a "
            f"{c['default']['tail_steps']}-step tail, {c['default']['decoder']}) {c['default']['seconds']:.3f} s "
            f"({c['default']['over_limit']:.2f}x its {c['default']['unet_rows']} rows' limit)"
            + (f"; few-step through the server {c['server']['seconds']:.3f} s" if "server" in c else "")
            for name, c in ((name, r["cases"]) for name, r in d["engines"].items())),
    }  # fmt: skip
    for key, line in interactive.items():
        if key in report.get("interactive", {}):
            out.print(line(report["interactive"][key]))
    out.print(f"wrote {output_dir}/bench.json and bench.png")


def print_run(report: dict, output_dir: Path) -> None:
    """`edit-rt run`'s table (a file per edit) and its UNet rows against regenerating every edit."""
    if "variants" in report:
        return print_plans(report, output_dir)
    if "rows" in report and "kind" in report:
        return print_text(report, output_dir)
    table = Table(title=f"edit-rt run: {len(report['edits'])} edits on one base", title_justify="left")
    for column in ("file", "edit", "tail steps"):
        table.add_column(column)
    table.add_row("base.png", report["base"]["prompt"], str(report["base"]["steps"]))
    for e in report["edits"]:
        table.add_row(e["file"], e["label"], str(e["tail_steps"]))
    out = Console()
    out.print(table)
    s, rows = report["seconds"], report["unet_rows"]
    out.print(
        f"UNet rows run: {rows['total']} (base {rows['base']} + tails {rows['edit_tails']}"
        + (f" + catalogue {rows['catalogue']}" if rows.get("catalogue") else "") + "; "
        f"{rows['half_rows_skipped']} unconditional halves taken from the base) vs "
        f"{rows['regenerating_every_edit']} regenerating every edit ({rows['saving']:.0%} fewer)"
    )
    out.print(f"base {report['base_id']}: {report['base_source']}")
    out.print("seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()))
    out.print(f"wrote {output_dir}/ (grid.png, report.json, {len(report['files']) - 1} PNGs)")
    if "catalogue" in report:
        c = report["catalogue"]
        out.print(f"catalogue: {c['rows']} rows ({c['run']} run, {c['resumed']} resumed from their files) in {c['folder']}/")


def print_plans(report: dict, output_dir: Path) -> None:
    """A plan run's table (a row per variant: done as asked, collision, comfort, utility)."""
    table = Table(title=f"edit-rt run: {len(report['variants'])} plans from one base plan", title_justify="left")
    for column in ("plan", "success", "collision", "peak accel", "peak jerk", "progress m", "utility"):
        table.add_column(column)
    for k, v in enumerate([report["base"], *report["variants"]]):
        s = v["scores"]
        name = ("base: " if k == 0 else "") + v["label"] + (" (best)" if k - 1 == report["best"] else "")
        table.add_row(name, str(s["success"]), str(s["collision"]), f"{s['peak_accel']:.2f}", f"{s['peak_jerk']:.1f}",
                      f"{s['progress']:.1f}", f"{v['utility']:.1f}")  # fmt: skip
    out = Console()
    out.print(table)
    rows = report["unet_rows"]
    out.print(f"UNet rows run: {rows['total']} (base {rows['base']} + variants {rows['variants']}) vs "
              f"{rows['sampling_every_variant']} sampling every variant from noise")  # fmt: skip
    out.print("seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in report["seconds"].items()))
    out.print(f"wrote {output_dir}/ (plans.png, plans.json)")


def print_text(report: dict, output_dir: Path) -> None:
    """A text run's table (a line per continuation, span edit and styled text: its file, tokens, first line)."""
    table = Table(title=f"edit-rt run: {len(report['rows'])} continuations ({report['kind']})", title_justify="left")
    for column in ("file", "tokens", "finish", "first line"):
        table.add_column(column)
    for r in report["rows"]:
        table.add_row(r["file"], str(r["tokens"]), r["finish_reason"], _first_line(r["text"]))
    for e in report["edits"]:
        table.add_row(e["file"], f"span {e['span_tokens'][0]}..{e['span_tokens'][1]}", "", _first_line(e["text"]))
    for s in report.get("style", []):
        table.add_row(s["file"], f"{s['changed']} changed", "", _first_line(s["text"]))
    out = Console()
    out.print(table)
    calls = report["calls"]
    out.print(f"graph calls: {calls['forwards']} for {calls['decoded']} tokens ({calls['tokens_per_forward']:.2f} tokens a call per row)")
    out.print("seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in report["seconds"].items()))
    files = len(report["rows"]) + len(report["edits"]) + len(report.get("style", []))
    out.print(f"wrote {output_dir}/ (text.json, {files} .txt)")


def _first_line(text: str) -> str:
    """A continuation's first line with text in it (it often begins with a line break)."""
    return next((line.strip() for line in text.split("\n") if line.strip()), "")[:60]
