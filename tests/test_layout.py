"""The house's rules, checked from the code itself (its imports and its string literals).

- the import contracts of pyproject.toml (``[tool.importlinter]``) hold: runtime's layers and
  export's stages, no import circle, runtime/ without export/ or the torch world, export/ below
  runtime's applications. import-linter reads them from the static imports; each contract is
  shown to break on one added import of the kind it forbids;
- what import-linter cannot see: the modules named by a string (``importlib.import_module``):
  of runtime/, only ``runtime/apps/cli.py`` names ``export/``, and export/ never names
  ``runtime/apps/``; and what importing every ``runtime/`` module really loads: no torch,
  diffusers, transformers or onnx (the builder library), and no module of the CLI;
- the step loop, the parity check and the GPU bench never spell a step-graph input's name: they
  take names from the manifest's roles (step_signature.py);
- the signature covers every input of the exported step graph, each by exactly one role.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from importlinter import configuration
from importlinter.application import use_cases
from importlinter.application.app_config import settings

from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.engine.step_signature import StepSignature

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

configuration.configure()  # import-linter's adapters (file system, graph builder), as its CLI sets them


def _lint(contracts: tuple[str, ...] = ()) -> bool:
    """lint-imports over pyproject's contracts (or those ids only), uncached: True when kept.
    Its report goes to stdout, which pytest shows when a test fails."""
    return use_cases.lint_imports(config_filename=str(PYPROJECT), limit_to_contracts=contracts, cache_dir=None, no_logo=True)


def test_the_import_contracts_hold(capsys):
    kept = _lint()
    report = capsys.readouterr().out
    assert kept, report
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in report, report


class _GraphWithOneMoreImport:
    """import-linter's graph builder, returning the real graph with one import added."""

    def __init__(self, real, importer: str, imported: str):
        self.real, self.importer, self.imported = real, importer, imported

    def build(self, *args, **kwargs):
        graph = self.real.build(*args, **kwargs)
        graph.add_import(importer=self.importer, imported=self.imported, line_number=1, line_contents="added by the test")
        return graph


@pytest.mark.parametrize("contract,importer,imported,reported", [
    ("runtime-layers", "edit_rt.runtime.model.edit", "edit_rt.runtime.serving.service", None),  # upward
    ("runtime-layers", "edit_rt.runtime.engine.manifest", "edit_rt.runtime.model.edit", None),  # between independent siblings
    ("runtime-layers", "edit_rt.runtime.loop.row_scheduler", "edit_rt.runtime.storage.related_index", None),
    ("runtime-layers", "edit_rt.runtime.newroom", "edit_rt.runtime.errors", "not listed as layers: - edit_rt.runtime.newroom"),
    ("export-stages", "edit_rt.export.compile.graphs", "edit_rt.export.world.shapes", None),
    ("no-cycles", "edit_rt.runtime.loop.rows", "edit_rt.runtime.loop.row_scheduler", "No cycles are allowed in edit_rt.runtime.loop."),
    ("runtime-without-export", "edit_rt.runtime.pipeline.text", "edit_rt.export.compile.graphs", None),
    ("runtime-without-torch", "edit_rt.runtime.pipeline.text", "torch", None),
    ("export-below-apps", "edit_rt.export.eval.gates", "edit_rt.runtime.apps.run", None),
])  # fmt: skip
def test_each_contract_breaks_on_an_import_it_forbids(monkeypatch, capsys, contract, importer, imported, reported):
    builder = _GraphWithOneMoreImport(settings.GRAPH_BUILDER, importer, imported)
    monkeypatch.setitem(settings._config, "GRAPH_BUILDER", builder)
    assert not _lint((contract,))
    # the report names the added import (or the folder no layer holds, or the package whose
    # circle it closes): the contract broke on it, not on an error of the configuration
    report = " ".join(capsys.readouterr().out.split())
    assert (reported or f"{importer} -> {imported}") in report, report


@functools.cache
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of a file's syntax tree (``ast.walk``'s order), parsed once per run: the rules
    below read the same files (runtime/ by four of them)."""
    return tuple(ast.walk(ast.parse(path.read_text())))


def _modules_named_by_strings(path: Path) -> set[str]:
    """The modules a file hands ``importlib.import_module`` or ``__import__`` by a literal
    (``f"edit_rt.export.{name}"`` counts as ``edit_rt.export``): the imports import-linter
    cannot see. A module run as another process (``python -m ...``) is not imported."""
    found = set()
    for node in _nodes(path):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__"):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.JoinedStr):  # an f-string: its leading literal
                arg = arg.values[0] if arg.values else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value.rstrip("."))
    return found


def test_only_the_cli_loads_export_by_name_and_export_never_loads_the_applications():
    """The rules between the two packages where a module is named by a string: of runtime/, only
    apps/cli.py loads export/ (its ``model`` and ``export`` commands), none loads the torch
    world, and export/ never loads runtime/apps/."""
    def named(folder: str, packages: tuple[str, ...]) -> list[str]:
        return sorted(f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / folder).rglob("*.py") for m in _modules_named_by_strings(p)
                      if any(m == pkg or m.startswith(f"{pkg}.") for pkg in packages))  # fmt: skip

    assert named("runtime", ("edit_rt.export",)) == ["runtime/apps/cli.py: edit_rt.export"]
    assert named("runtime", ("torch", "diffusers", "transformers", "onnx")) == []
    assert named("export", ("edit_rt.runtime.apps",)) == []


def test_runtime_imports_no_torch_world_and_no_cli():
    """What importing runtime/ really loads, third-party imports included (import-linter sees
    only the first module of a third-party package, not what it imports in turn)."""
    # cli is the top (it may import anything); ray_serve needs Ray, which takes seconds to import
    modules = sorted(m for m in map(_module_of, (ROOT / "runtime").rglob("*.py"))
                     if not m.endswith((".cli", ".ray_serve")))  # fmt: skip
    code = ("import sys, importlib\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            "bad = [m for m in ('torch', 'diffusers', 'transformers', 'onnx', 'edit_rt.runtime.apps.cli', 'edit_rt.export') if m in sys.modules]\n"
            "print(','.join(bad))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def _module_of(path: Path) -> str:
    """runtime/loop/row_scheduler.py -> edit_rt.runtime.loop.row_scheduler (the package mapping of pyproject)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["edit_rt", *parts])


# the step graph's fixed inputs (not per layer); "latents" and "next_latents" are left out: the
# VAE and latent_blend graphs have inputs of those names too
# ("history" and "history_out" too: latent_blend's)
STEP_NAMES = {"timestep", "alpha_t", "coefs", "noise", "guidance", "uncond_index", "uncond_given", "uncond_slope", "self_ref",
              "uncond_out", "attn_maps"}  # fmt: skip
LOOP_FILES = ["runtime/loop/row_scheduler.py", "runtime/loop/rows.py", "runtime/loop/batcher.py", "runtime/loop/resolve.py",
              "runtime/loop/solver_slots.py", "runtime/loop/uncond_sets.py", "runtime/loop/bindings.py",
              "runtime/engine/backend.py", "runtime/engine/backend_ort.py", "runtime/engine/backend_trt.py",
              "runtime/pipeline/edit_pipeline.py", "export/compile/parity.py", "scripts/gpu_bench.py"]  # fmt: skip


def test_the_loop_never_spells_a_step_input_name():
    spelled = {}
    for file in LOOP_FILES:
        strings = {n.value for n in _nodes(ROOT / file) if isinstance(n, ast.Constant)}
        if strings & STEP_NAMES:
            spelled[file] = sorted(strings & STEP_NAMES)
    assert spelled == {}


def test_the_signature_covers_every_step_input_by_one_role(onnx_dir):
    manifest = load_manifest(onnx_dir)
    sig = StepSignature.from_manifest(manifest)
    groups = [[sig.latents], [sig.entry_uncond], [sig.entry_slope], [sig.set_index], [sig.row_ref], [sig.step_coefs], [sig.history],
              [sig.step_noise], list(sig.step_scalars),
              list(sig.row_scalars), list(sig.row_kv), list(sig.set_kv), list(sig.row_cond), list(sig.set_cond)]  # fmt: skip
    named = [n for group in groups for n in group]
    assert sorted(named) == sorted(t.name for t in manifest.graphs["unet_step"].inputs)
    assert len(named) == len(set(named))
    assert set(sig.step_scalars.values()) == {"timesteps", "alpha_t"}
    assert sig.row_scalars == {"guidance": "guidance"} and sig.attn_maps is not None


def test_the_shallow_signature_covers_its_inputs_and_drops_no_one_it_reads(onnx_dir):
    """``unet_step_shallow`` (DeepCache) by its own roles: every input it kept by one role, its
    deep features ``deep_in``, and the skipped layers' K/V left out (the exporter dropped them)."""
    manifest = load_manifest(onnx_dir)
    full, sig = StepSignature.from_manifest(manifest), StepSignature.from_manifest(manifest, "unet_step_shallow")
    groups = [[sig.latents], [sig.entry_uncond], [sig.entry_slope], [sig.set_index], [sig.row_ref], [sig.step_coefs], [sig.history],
              [sig.step_noise], [sig.deep_in], list(sig.step_scalars), list(sig.row_scalars), list(sig.row_kv), list(sig.set_kv),
              list(sig.row_cond), list(sig.set_cond)]  # fmt: skip
    named = [n for group in groups for n in group if n is not None]
    assert sorted(named) == sorted(t.name for t in manifest.graphs["unet_step_shallow"].inputs)
    assert sig.deep_in is not None and sig.deep_out is None and full.deep_out is not None and full.deep_in is None
    assert 0 < len(sig.row_kv) < len(full.row_kv)  # the tiny model's outer blocks attend; its deep ones are skipped


def test_the_gpu_extra_stops_below_each_packages_next_major():
    """Issue 38: TensorRT 11, onnxruntime-gpu 2 and cuda-python 14 are not what the GPU path was
    written against; the extra admits none of them (read with `packaging`, as pip reads it)."""
    import tomllib

    from packaging.requirements import Requirement

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    caps = {"tensorrt": "11", "onnxruntime-gpu": "2", "cuda-python": "14"}
    found = {}
    for line in extra:
        req = Requirement(line)
        found[req.name] = req.specifier
    assert set(found) == set(caps)
    for name, major in caps.items():
        assert not found[name].contains(major) and not found[name].contains(f"{major}.0.1"), (name, str(found[name]))
        assert found[name].contains(f"{int(major) - 1}.99"), (name, str(found[name]))  # the current major stays allowed


def test_the_openvino_extra_stops_below_next_year():
    """Issue 40: OpenVINO versions are year.release; the extra admits this year's releases and
    not 2027's, and make setup (CI) installs it."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (req,) = [Requirement(line) for line in project["optional-dependencies"]["openvino"]]
    assert req.name == "openvino" and req.specifier.contains("2026.4.1") and not req.specifier.contains("2027.0")
    assert "openvino" in (ROOT / "Makefile").read_text().split("$(VENV)/.installed:")[1].split("touch")[0]


def _classes(folder: Path):
    for path in sorted(folder.rglob("*.py")):
        for node in _nodes(path):
            if isinstance(node, ast.ClassDef):
                yield path.relative_to(ROOT), node


def test_the_service_and_the_pipeline_are_composed_not_mixed():
    """Issue 52: Service and EditPipeline each one class in one file; no class of serving/ or
    pipeline/ is assembled from several bases (a mixin reads attributes another class declares)."""
    mixed = [f"{path}: {node.name}({', '.join(ast.unparse(b) for b in node.bases)})"
             for folder in ("runtime/serving", "runtime/pipeline") for path, node in _classes(ROOT / folder)
             if len(node.bases) > 1]  # fmt: skip
    assert mixed == []
    homes = {name: sorted(str(p) for p, node in _classes(ROOT / "runtime") if node.name == name) for name in ("Service", "EditPipeline")}
    assert homes == {"Service": ["runtime/serving/service.py"], "EditPipeline": ["runtime/pipeline/edit_pipeline.py"]}


def test_only_the_web_layer_speaks_http():
    """The service raises the domain's errors (runtime/errors.py); only web/ makes an ApiError
    or knows a status, and no module below web/ imports the web framework."""
    outside = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        if path.is_relative_to(ROOT / "runtime" / "web"):
            continue
        for node in _nodes(path):
            if isinstance(node, ast.Name) and node.id == "ApiError":
                outside.append(f"{path.relative_to(ROOT)}:{node.lineno}: ApiError")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                outside += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                            if n.split(".")[0] in ("starlette", "fastapi", "uvicorn")]  # fmt: skip
    assert outside == []
