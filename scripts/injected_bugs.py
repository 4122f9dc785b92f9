"""The suite's power, shown: realistic one-line bugs injected into a copy of the repository, each
of which the default suite (``-m "not slow"``) must catch.

Each bug is a named patch, (file, exact old text, new text), applied to its own copy of the
tracked files at ``--ref`` (``git archive``), never to the working tree. The copy's code is what
the tests import: the package installs editable as ``edit_rt.runtime`` -> ``runtime/`` and
``edit_rt.export`` -> ``export/`` (pyproject's package-dir), so each copy gets a small shim
folder, ``.injected/edit_rt/{runtime,export}`` (links to the copy's own folders), put first on
``PYTHONPATH``; Python's path finder runs before the editable install's finder, so the copy wins,
and the harness checks that it does (``edit_rt.runtime.__file__`` inside the copy) before it
trusts any result. Subprocesses the tests start inherit ``PYTHONPATH``.

For each bug it runs the few default-suite tests most likely to catch it (``pytest -x``), and
once, the same tests on the unpatched copy, which must pass (so each failure is its bug's).

    .venv/bin/python scripts/injected_bugs.py --out out/injected-bugs
    .venv/bin/python scripts/injected_bugs.py --out out/injected-bugs --only kv-mix-sign,auth-skipped

writes ``injected_bugs.json`` and ``injected_bugs.md`` (bug, file:line, the test that caught it,
seconds) under ``--out``; the exit code is 0 only when the clean run passed and every bug was caught.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("injected_bugs")

REPO = Path(__file__).resolve().parents[1]
# One test run's ceiling: a bug that makes the loop spin instead of fail shows as a timeout (not
# a catch), and the harness moves on.
TIMEOUT_S = 900
SHIM = ".injected"


@dataclass(frozen=True)
class Bug:
    name: str
    what: str  # the mistake, in words
    file: str  # relative to the repository root
    old: str  # exact text, found exactly once in ``file``
    new: str
    tests: tuple[str, ...]  # pytest node ids (a test name without parameters runs them all)


BUGS = (
    Bug("kv-mix-sign", "strength mix sign flipped: K = K_base - s (K_edit - K_base)",
        "runtime/model/directions.py",
        "        d *= s\n",
        "        d *= -s\n",
        ("tests/test_pipeline.py::test_strength_interpolates_kv",
         "tests/test_directions.py::test_two_directions_tail_equals_diffusers_fed_the_mixed_embeddings")),
    Bug("tail-entry-off-by-one", "a tail enters from x_{s+1} instead of x_s (off by one in its start step)",
        "runtime/loop/resolve.py",
        "        return state.latent(row.start_step)[0].copy()\n",
        "        return state.latent(row.start_step + 1)[0].copy()\n",
        ("tests/test_pipeline.py::test_identity_edit_reproduces_base",)),
    Bug("mask-blend-skipped", "the keep mask never reaches latent_blend (every row written as unmasked)",
        "runtime/loop/row_scheduler.py",
        "        keep = self.zero_keep if row.keep is None else row.keep.astype(np.float32)\n",
        "        keep = self.zero_keep\n",
        ("tests/test_pipeline.py::test_masked_edit_keeps_base_outside_mask",)),
    Bug("cfg-swapped", "cond and uncond swapped in the step graph's classifier-free guidance",
        "export/compile/graphs.py",
        "        pred = out_uncond + g * (out_cond - out_uncond)\n",
        "        pred = out_cond + g * (out_uncond - out_cond)\n",
        ("tests/test_pipeline.py::test_full_generation_equals_diffusers_pipeline",)),
    Bug("ddim-eps-coefficient", "DDIM's eps coefficient 1 - alpha_prev instead of sqrt(1 - alpha_prev)",
        "runtime/model/scheduler_ddim.py",
        '    coefs[:, COEFS.index("eps")] = np.sqrt(np.float32(1) - alpha_prev)\n',
        '    coefs[:, COEFS.index("eps")] = np.float32(1) - alpha_prev\n',
        ("tests/test_samplers.py::test_every_step_equals_diffusers",
         "tests/test_pipeline.py::test_full_generation_equals_diffusers_pipeline")),
    Bug("euler-sigma-index", "Euler's eps coefficient divided by sqrt(sigma^2 + 1) of this step, not the next",
        "runtime/model/sampler_euler.py",
        '        coefs[:, COL["eps"]] = (down - s) / sqrt1p(s_next)\n',
        '        coefs[:, COL["eps"]] = (down - s) / sqrt1p(s)\n',
        ("tests/test_samplers.py::test_every_step_equals_diffusers",)),
    Bug("slot-leak", "a finished row's resident base window is never released",
        "runtime/loop/row_scheduler.py",
        "        if self._windows is not None:\n            for windows in self._windows:\n                windows.release(row)\n",
        "",
        ("tests/test_gpu_rules.py::test_a_masked_rows_base_latents_stay_on_the_device",)),
    Bug("auth-skipped", "the bearer token compare skipped: any bearer token is accepted",
        "runtime/web/credentials.py",
        "            return secrets.compare_digest(credential, self.token)\n",
        "            return bool(credential)\n",
        ("tests/test_answers.py::test_a_401_names_the_schemes_it_takes",)),
    Bug("store-checksum-ignored", "a stored base's sha256 only checked for presence: a damaged file loads",
        "runtime/storage/store_codec.py",
        '    if content_sha256(tensors, meta) != meta.get("sha256"):\n',
        '    if not meta.get("sha256"):\n',
        ("tests/test_store.py::test_truncated_or_corrupt_files_are_refused_and_dropped",)),
    Bug("bucket-pad-unmasked", "a pow2 bucket's padding rows left out of the given-u suffix: they run the UNet's uncond half",
        "runtime/loop/row_scheduler.py",
        "            given = _floor_pow2(min(e + b - n, b - fewest))\n",
        "            given = _floor_pow2(min(e, b - fewest))\n",
        ("tests/test_unguided_rows.py::test_all_unguided_calls_on_the_simulated_gpu_run_no_uncond_row",
         "tests/test_gpu_rules.py::test_rows_run_at_padded_buckets_and_padding_changes_no_row")),
    Bug("negative-kv-index", "each row's negative-prompt K/V set index off by one (enumerate from 1)",
        "runtime/loop/uncond_sets.py",
        "        return {key: k for k, key in enumerate(self.sets)}\n",
        "        return {key: k for k, key in enumerate(self.sets, 1)}\n",
        ("tests/test_slots.py::test_more_negative_prompts_than_sets_wait_and_match_alone",
         "tests/test_batcher.py::test_rows_of_different_bases_and_steps_share_calls_and_match_alone")),
    Bug("preview-decoder", "previews decoded by the full VAE where the export has the tiny decoder",
        "runtime/pipeline/decoders.py",
        "        return self.decode(latents, self.preview_decoder)\n",
        "        return self.decode(latents)\n",
        ("tests/test_tiny_decoder.py::test_previews_go_through_the_tiny_decoder_when_there_is_one",)),
    Bug("speed-lora-schedule", "the speed LoRA's schedule never applied to a generated base (condition inverted)",
        "runtime/config/run_config.py",
        "        if base.image is not None or not self.speed_adapters:\n",
        "        if base.image is None or not self.speed_adapters:\n",
        ("tests/test_speed_lora.py::test_a_config_naming_the_speed_lora_runs_its_schedule",)),
    Bug("unguided-scale", "an unguided row (u = 0 given) keeps its CFG scale instead of running at 1",
        "runtime/loop/rows.py",
        "            self.guidance = 1.0\n",
        "",
        ("tests/test_unguided_rows.py::test_an_unguided_generation_equals_diffusers_at_that_guidance",)),
    Bug("deadline-ignored", "a request's deadline never enforced (only a cancel expires it)",
        "runtime/loop/jobs.py",
        "        return self.cancelled.is_set() or time.monotonic() > self.deadline\n",
        "        return self.cancelled.is_set()\n",
        ("tests/test_batcher.py::test_expired_requests_are_dropped_at_the_next_step",)),
    Bug("config-unknown-key", "a run file's unknown key silently ignored instead of refused",
        "runtime/config/run_config.py",
        'STRICT = ConfigDict(extra="forbid")\n',
        'STRICT = ConfigDict(extra="ignore")\n',
        ("tests/test_cli.py::test_bad_config_is_refused_with_field_and_fix",)),
)


@dataclass
class Outcome:
    name: str
    what: str
    where: str  # file:line
    tests: list[str]
    status: str  # caught | missed | timeout | no-tests
    caught_by: str = ""
    message: str = ""
    seconds: float = 0.0
    ran: int = 0
    failures: list[str] = field(default_factory=list)


# --- the copies ------------------------------------------------------------------------------


def extract(ref: str, dest: Path) -> None:
    """The tracked files at ``ref`` into ``dest``, with the import shim."""
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", ref], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"error: git archive {ref} failed; pass a --ref this repository has")
    shim = dest / SHIM / "edit_rt"
    shim.mkdir(parents=True)
    for name in ("runtime", "export"):  # relative: a copy of the copy links to its own folders
        (shim / name).symlink_to(Path("..", "..", name))


def where_and_check(bug: Bug, root: Path) -> str:
    """``file:line`` of the bug's old text in ``root``; one line naming the bug if it is not there once."""
    text = (root / bug.file).read_text()
    count = text.count(bug.old)
    if count != 1:
        raise SystemExit(f"error: bug {bug.name}: its old text occurs {count} times in {bug.file} (needs 1); "
                         "update the patch in scripts/injected_bugs.py to the code as it is now")
    return f"{bug.file}:{text[: text.index(bug.old)].count(chr(10)) + 1}"


def patched_copy(bug: Bug, clean: Path, dest: Path) -> None:
    """``clean`` hard-linked into ``dest``, the bug's file written afresh (unlinked first, so the
    clean copy's inode is never touched)."""
    subprocess.run(["cp", "-al", str(clean), str(dest)], check=True)
    path = dest / bug.file
    text = path.read_text()
    path.unlink()
    path.write_text(text.replace(bug.old, bug.new, 1))


def env_for(copy: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(copy / SHIM), HF_HUB_OFFLINE="1",
               # no .pyc in the copies: they share inodes with the clean copy
               PYTHONDONTWRITEBYTECODE="1")
    return env


def check_imports(copy: Path) -> None:
    """The copy's code is what a test imports, not the editable install's."""
    probe = "import edit_rt.runtime as r, edit_rt.export as e; print(r.__file__); print(e.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=env_for(copy), capture_output=True,
                         text=True, check=True).stdout.split()
    if not all(Path(p).resolve().is_relative_to(copy.resolve()) for p in out):
        raise SystemExit(f"error: the copy at {copy} imports edit_rt from {out}, not from itself; "
                         "check the editable install's finder against the shim")
    log.info("the copy imports edit_rt from %s", Path(out[0]).resolve().parent)


# --- one pytest run --------------------------------------------------------------------------


def run_tests(copy: Path, tests: list[str], stop_first: bool, report: Path, log_path: Path) -> tuple[int, float, bool]:
    """pytest over ``tests`` in ``copy`` (the default suite's selection); (exit code, seconds, timed out)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
           f"--junitxml={report}", *(["-x"] if stop_first else []), *tests]
    start = time.monotonic()
    with open(log_path, "w") as out:
        # its own session: a timeout ends the servers the tests started too
        proc = subprocess.Popen(cmd, cwd=copy, env=env_for(copy), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=TIMEOUT_S)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code, timed_out = proc.wait(), True
    return code, time.monotonic() - start, timed_out


def junit_results(report: Path) -> tuple[int, list[tuple[str, str]]]:
    """(tests run, [(node id, first line of the failure)]) from pytest's JUnit XML."""
    if not report.exists():
        return 0, []
    ran, failed = 0, []
    for case in ET.parse(report).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        ran += 1
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
            message = (bad.get("message") or "").strip()
            failed.append((node, message.splitlines()[0][:200] if message else ""))
    return ran, failed


# --- the table -------------------------------------------------------------------------------


def markdown(clean: dict, outcomes: list[Outcome]) -> str:
    caught = sum(o.status == "caught" for o in outcomes)
    lines = [
        "# Injected bugs",
        "",
        f"Ref `{clean['ref']}` ({clean['commit'][:12]}); default suite (`-m \"not slow\"`), each bug's tests with `-x`.",
        f"Unpatched copy on the union of the tests: {clean['status']} ({clean['ran']} tests, {clean['seconds']:.0f} s).",
        f"Caught: {caught} of {len(outcomes)}.",
        "",
        "| bug | file:line | what | caught by | seconds |",
        "|---|---|---|---|---|",
    ]
    for o in outcomes:
        by = f"`{o.caught_by}`" if o.status == "caught" else f"**{o.status.upper()}** {o.message}".strip()
        lines.append(f"| {o.name} | `{o.where}` | {o.what} | {by} | {o.seconds:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/injected-bugs"))
    parser.add_argument("--ref", default="HEAD", help="the commit whose tracked files are copied (default HEAD)")
    parser.add_argument("--only", default="", help="comma-separated bug names (default: all)")
    parser.add_argument("--no-clean-run", action="store_true", help="skip the unpatched run (when iterating)")
    parser.add_argument("--keep", action="store_true", help="keep the copies under the temporary folder")
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.list:
        for bug in BUGS:
            print(f"{bug.name:24} {bug.file}: {bug.what}")
        return 0
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - {b.name for b in BUGS}
    if unknown:
        raise SystemExit(f"error: --only: unknown bug(s) {sorted(unknown)}; see --list")
    bugs = [b for b in BUGS if not names or b.name in names]

    out = (args.out if args.out.is_absolute() else Path.cwd() / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.ref], capture_output=True, text=True,
                            check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="injected-bugs-"))
    try:
        clean = work / "clean"
        extract(commit, clean)
        wheres = {bug.name: where_and_check(bug, clean) for bug in bugs}  # every patch applies, before any run
        check_imports(clean)
        union = list(dict.fromkeys(t for bug in bugs for t in bug.tests))
        summary = {"ref": args.ref, "commit": commit, "tests": union, "status": "skipped", "ran": 0, "seconds": 0.0}
        if not args.no_clean_run:
            log.info("unpatched: %d test ids", len(union))
            code, seconds, timed_out = run_tests(clean, union, False, out / "logs" / "clean.xml", out / "logs" / "clean.log")
            ran, failed = junit_results(out / "logs" / "clean.xml")
            status = "timeout" if timed_out else "passed" if code == 0 else f"FAILED ({len(failed)}: {[f for f, _ in failed]})"
            summary.update(status=status, ran=ran, seconds=round(seconds, 1))
            log.info("unpatched: %s, %d tests, %.0f s", status, ran, seconds)
        outcomes = []
        for bug in bugs:
            copy = work / bug.name
            patched_copy(bug, clean, copy)
            check_imports(copy)
            logs = out / "logs"
            code, seconds, timed_out = run_tests(copy, list(bug.tests), True, logs / f"{bug.name}.xml", logs / f"{bug.name}.log")
            ran, failed = junit_results(logs / f"{bug.name}.xml")
            if timed_out:
                status = "timeout"
            elif failed:
                status = "caught"
            else:
                status = "no-tests" if ran == 0 else "missed"
            o = Outcome(bug.name, bug.what, wheres[bug.name], list(bug.tests), status, seconds=round(seconds, 1), ran=ran,
                        failures=[f for f, _ in failed])  # fmt: skip
            if failed:
                o.caught_by, o.message = failed[0]
            elif ran == 0:  # a node id that no longer exists, or every test deselected as slow
                o.message = " | ".join((logs / f"{bug.name}.log").read_text().strip().splitlines()[-3:])[:300]
            outcomes.append(o)
            log.info("%-24s %-8s %5.0f s  %s", bug.name, status, seconds, o.caught_by)
            if not args.keep:
                shutil.rmtree(copy, ignore_errors=True)
        (out / "injected_bugs.json").write_text(json.dumps({"clean": summary, "bugs": [asdict(o) for o in outcomes]}, indent=2) + "\n")
        (out / "injected_bugs.md").write_text(markdown(summary, outcomes))
        log.info("wrote %s and %s", out / "injected_bugs.json", out / "injected_bugs.md")
        ok = all(o.status == "caught" for o in outcomes) and summary["status"] in ("passed", "skipped")
        return 0 if ok else 1
    finally:
        if args.keep:
            log.info("copies kept under %s", work)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
