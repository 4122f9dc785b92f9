"""The house's rules, checked from the code itself (its imports and its string literals).

- no import circle among ``runtime/`` or ``export/`` modules (read from each file's AST, not
  from a tool under test);
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

from edit_rt.runtime.manifest import load_manifest
from edit_rt.runtime.step_signature import StepSignature

ROOT = Path(__file__).resolve().parents[1]


def _imports(folder: str) -> dict[str, set[str]]:
    """module -> the sibling modules it imports (relative or edit_rt.<folder>.x), at any depth."""
    package = f"edit_rt.{folder}"
    modules = {p.stem for p in (ROOT / folder).glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in (ROOT / folder).glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level == 1:
                    names = [base] if base else [a.name for a in node.names]
                elif base.startswith(package + "."):
                    names = [base[len(package) + 1 :]]
                elif base == package:
                    names = [a.name for a in node.names]
                else:
                    continue
                found |= {n.split(".")[0] for n in names if n.split(".")[0] in modules}
        graph[path.stem] = found - {path.stem}
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


def test_runtime_imports_no_torch_world_and_no_cli():
    # cli is the top (it may import anything); ray_serve needs Ray, which takes seconds to import
    modules = sorted(p.stem for p in (ROOT / "runtime").glob("*.py") if p.stem not in ("__init__", "cli", "ray_serve"))
    code = ("import sys, importlib\n"
            f"for m in {modules!r}:\n    importlib.import_module('edit_rt.runtime.' + m)\n"
            "bad = [m for m in ('torch', 'diffusers', 'transformers', 'onnx', 'edit_rt.runtime.cli', 'edit_rt.export') if m in sys.modules]\n"
            "print(','.join(bad))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


# the step graph's fixed inputs (not per layer); "latents" and "next_latents" are left out: the
# VAE and latent_blend graphs have inputs of those names too
STEP_NAMES = {"timestep", "alpha_t", "alpha_prev", "guidance", "uncond_index", "uncond_given", "self_ref",
              "uncond_out", "attn_maps"}  # fmt: skip
LOOP_FILES = ["runtime/slots.py", "runtime/rows.py", "runtime/batcher.py", "runtime/resolve.py", "runtime/backend.py",
              "runtime/backend_ort.py", "runtime/backend_trt.py", "runtime/pipeline.py", "export/parity.py",
              "scripts/gpu_bench.py"]  # fmt: skip


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
    groups = [[sig.latents], [sig.entry_uncond], [sig.set_index], [sig.row_ref], list(sig.step_scalars),
              list(sig.row_scalars), list(sig.row_kv), list(sig.set_kv), list(sig.row_cond), list(sig.set_cond)]  # fmt: skip
    named = [n for group in groups for n in group]
    assert sorted(named) == sorted(t.name for t in manifest.graphs["unet_step"].inputs)
    assert len(named) == len(set(named))
    assert set(sig.step_scalars.values()) == {"timesteps", "alpha_t", "alpha_prev"}
    assert sig.row_scalars == {"guidance": "guidance"} and sig.attn_maps is not None
