"""The pipeline is composed, not assembled from mixins (STYLE.md habit 5), checked from its code:

- no class of ``runtime/pipeline/`` derives from another (a Protocol aside): a concept's object is held and called
  (``EditPipeline.text``, ``.preservation``, ``.decoders``, ``.memory_fit``), never mixed in;
- every ``self.<name>`` a class reads is its own: a method, property or class-level field of its
  body, or an attribute its own ``__init__`` sets; and no method but ``__init__`` creates one.
  A mixin reading the state another class's ``__init__`` made breaks both.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime/pipeline",)


def _self_attributes(node: ast.AST, ctx: type) -> set[str]:
    return {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ctx) and isinstance(n.value, ast.Name) and n.value.id == "self"}  # fmt: skip


def composition_faults(source: str, filename: str) -> list[str]:
    """One line per class of ``source`` that derives from another, reads an attribute it never
    declares, or creates one outside ``__init__``."""
    faults = []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        where = f"{filename}:{cls.lineno} {cls.name}"
        # a Protocol only declares the calls a caller makes (loop/resolve.py's Model): nothing is inherited
        if bases := [ast.unparse(b) for b in cls.bases if ast.unparse(b) not in ("Protocol", "typing.Protocol")]:
            faults.append(f"{where} derives from {', '.join(bases)}")
        body = set()  # methods, properties and class-level fields (a dataclass's)
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                body.add(item.target.id)
            elif isinstance(item, ast.Assign):
                body |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        methods = [m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        init = next((m for m in methods if m.name == "__init__"), None)
        declared = body | (_self_attributes(init, ast.Store) if init is not None else set())
        for method in methods:
            if undeclared := _self_attributes(method, ast.Load) - declared:
                faults.append(f"{where}.{method.name} reads self.{', self.'.join(sorted(undeclared))}, "
                              "which its own __init__ never sets")  # fmt: skip
            if method is not init and (created := _self_attributes(method, ast.Store) - declared):
                faults.append(f"{where}.{method.name} creates self.{', self.'.join(sorted(created))} outside __init__")
    return faults


@pytest.mark.parametrize("package", PACKAGES)
def test_every_class_reads_only_the_state_it_declares_and_mixes_nothing_in(package):
    files = sorted((ROOT / package).glob("*.py"))
    assert files, f"{package} has no Python files: the check would pass on nothing"
    faults = [f for path in files for f in composition_faults(path.read_text(), str(path.relative_to(ROOT)))]
    assert not faults, "\n".join(faults)


def test_the_check_names_a_mixin_and_the_state_it_borrows():
    """The check itself, on the shape it forbids: a mixin reading what its host's __init__ made."""
    mixin = (
        "class Decoding:\n"
        "    def decode(self, x):\n"
        "        return self.graphs['vae'](x)\n"
        "class Pipeline(Decoding):\n"
        "    def __init__(self, graphs):\n"
        "        self.graphs = graphs\n"
        "    def warm(self):\n"
        "        self.cache = {}\n"
    )
    assert composition_faults(mixin, "m.py") == [
        "m.py:1 Decoding.decode reads self.graphs, which its own __init__ never sets",
        "m.py:4 Pipeline derives from Decoding",
        "m.py:4 Pipeline.warm creates self.cache outside __init__",
    ]
