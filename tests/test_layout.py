"""The house's rules, checked from the code itself (its imports and its string literals).

- no import circle among ``runtime/`` or ``export/`` modules (read from each file's AST, not
  from a tool under test); each package's rooms in a declared order (runtime's layers, export's
  stages), no module importing a room above its own;
- between the packages: only ``runtime/apps/cli.py`` names ``export/``, and ``export/`` never
  imports ``runtime/apps/``;
- importing every ``runtime/`` module pulls in no torch, diffusers, transformers or onnx (the
  builder library), and no module of the CLI;
- the step loop, the parity check and the GPU bench never spell a step-graph input's name: they
  take names from the manifest's roles (step_signature.py);
- the signature covers every input of the exported step graph, each by exactly one role.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.engine.step_signature import StepSignature

ROOT = Path(__file__).resolve().parents[1]


def _module_of(path: Path) -> str:
    """runtime/loop/slots.py -> edit_rt.runtime.loop.slots (the package mapping of pyproject)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["edit_rt", *parts])


def _imports(folder: str) -> dict[str, set[str]]:
    """module -> the modules of ``folder`` it imports (absolute or relative), at any depth."""
    files = {_module_of(p): p for p in (ROOT / folder).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for candidate in [base, *(f"{base}.{a.name}" for a in node.names)]:
                if candidate in files and candidate != name:
                    found.add(candidate)
        graph[name] = found
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


@pytest.mark.parametrize("folder", ["runtime", "export"])
def test_no_import_circles(folder):
    assert _cycle(_imports(folder)) == []


def test_the_circle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# Each package's rooms, bottom first: a module imports only modules of its own room or of rooms
# below it. runtime's root modules (errors.py, metrics.py, __init__.py) are the floor every layer
# stands on; export's stages are in the order they run.
RUNTIME_LAYERS = ["", "model", "config", "engine", "loop", "storage", "pipeline", "serving", "web", "scale", "apps"]
EXPORT_STAGES = ["", "compile", "world", "eval", "bench"]


def _room(module: str, package: str) -> str:
    """edit_rt.runtime.loop.slots -> "loop"; edit_rt.runtime.errors -> "" (the package's root)."""
    rest = module[len(package) + 1 :].split(".") if module != package else []
    return rest[0] if len(rest) > 1 else ""


def _upward(package: str, folder: str, order: list[str]) -> list[str]:
    graph = _imports(folder)
    rank = {room: k for k, room in enumerate(order)}
    bad = []
    for module, targets in graph.items():
        for target in targets:
            src, dst = _room(module, package), _room(target, package)
            if rank[dst] > rank[src]:
                bad.append(f"{module} -> {target}")
    return sorted(bad)


def test_every_room_is_in_the_declared_order():
    for package, folder, order in (("edit_rt.runtime", "runtime", RUNTIME_LAYERS), ("edit_rt.export", "export", EXPORT_STAGES)):
        rooms = {_room(m, package) for m in _imports(folder)}
        assert rooms == set(order), (folder, rooms ^ set(order))


@pytest.mark.parametrize("package,folder,order", [("edit_rt.runtime", "runtime", RUNTIME_LAYERS),
                                                  ("edit_rt.export", "export", EXPORT_STAGES)])  # fmt: skip
def test_no_room_imports_a_room_above_it(package, folder, order):
    assert _upward(package, folder, order) == []


def test_the_layer_check_finds_an_upward_import(tmp_path, monkeypatch):
    """The check itself: the real import graph with one upward edge added (loop -> serving)."""
    graph = _imports("runtime")
    graph["edit_rt.runtime.loop.slots"] = graph["edit_rt.runtime.loop.slots"] | {"edit_rt.runtime.serving.service"}
    monkeypatch.setitem(globals(), "_imports", lambda folder: graph)
    assert _upward("edit_rt.runtime", "runtime", RUNTIME_LAYERS) == ["edit_rt.runtime.loop.slots -> edit_rt.runtime.serving.service"]


def _edit_rt_imports(path: Path) -> set[str]:
    """Every edit_rt module a file imports: its absolute imports, and what it hands
    ``importlib.import_module`` or ``__import__`` (``f"edit_rt.export.{name}"`` counts as
    ``edit_rt.export``). A module run as another process (``python -m ...``) is not imported."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("edit_rt"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("edit_rt")}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__"):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.JoinedStr):  # an f-string: its leading literal
                arg = arg.values[0] if arg.values else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value.rstrip("."))
    return found


def test_only_the_cli_loads_export_and_export_never_loads_the_applications():
    """The rules between the two packages (issue 39): runtime/ below apps/cli.py never names
    export/ (statically or by a string it imports); export/ imports runtime's layers below the
    applications (apps/: run, the Python API, the CLI, which loads export/ itself)."""
    runtime_naming_export = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "runtime").rglob("*.py")
        if any(m.startswith("edit_rt.export") for m in _edit_rt_imports(p))
    )
    assert runtime_naming_export == ["runtime/apps/cli.py"]
    export_loading_apps = sorted(
        f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / "export").rglob("*.py") for m in _edit_rt_imports(p)
        if m.startswith("edit_rt.runtime.apps")
    )
    assert export_loading_apps == []


def test_runtime_imports_no_torch_world_and_no_cli():
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


# the step graph's fixed inputs (not per layer); "latents" and "next_latents" are left out: the
# VAE and latent_blend graphs have inputs of those names too
# ("history" and "history_out" too: latent_blend's)
STEP_NAMES = {"timestep", "alpha_t", "coefs", "noise", "guidance", "uncond_index", "uncond_given", "uncond_slope", "self_ref",
              "uncond_out", "attn_maps"}  # fmt: skip
LOOP_FILES = ["runtime/loop/slots.py", "runtime/loop/rows.py", "runtime/loop/batcher.py", "runtime/loop/resolve.py",
              "runtime/loop/solver_slots.py", "runtime/loop/uncond_sets.py", "runtime/loop/bindings.py",
              "runtime/engine/backend.py", "runtime/engine/backend_ort.py", "runtime/engine/backend_trt.py",
              "runtime/pipeline/edit_pipeline.py", "export/compile/parity.py", "scripts/gpu_bench.py"]  # fmt: skip


def test_the_loop_never_spells_a_step_input_name():
    spelled = {}
    for file in LOOP_FILES:
        strings = {n.value for n in ast.walk(ast.parse((ROOT / file).read_text())) if isinstance(n, ast.Constant)}
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
