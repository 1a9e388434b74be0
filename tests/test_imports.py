"""The import graph of the project, read from the source (``ast``), every import counted:
module level, function-local and ``TYPE_CHECKING`` alike.

- no circle among the project's modules;
- layers import downward only: ``invariants`` (0) <- ``specdec`` (1) <- ``proofs``,
  ``specdec.forensics``, ``specdec.cli``, ``benchmarks`` (2); so ``invariants`` imports
  nothing of ``specdec``;
- inside ``specdec``: ``engine -> strategies -> phases``: the phases reach neither the engine
  nor a strategy, the strategies never reach the engine;
- ``proofs`` takes from the engine package only the index math (``specdec.layout``), the
  mutant catalogue (``specdec.mutants``) and the strategy registry (``specdec.strategies``,
  which loads no strategy: checked in a fresh interpreter).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("invariants", "specdec", "proofs", "benchmarks")
#: (prefix, layer): the longest matching prefix decides
LAYERS = (("invariants", 0), ("specdec", 1), ("specdec.forensics", 2), ("specdec.cli", 2),
          ("proofs", 2), ("benchmarks", 2))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known) -> set[str]:
    """The project modules ``name`` (at ``path``) imports, anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    out: set = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, up level - 1 packages
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known}
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def cycles(graph: dict) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> int:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


def upward(graph: dict) -> list[str]:
    return [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
            for a in sorted(graph) for b in sorted(graph[a]) if layer(b) > layer(a)]


def reach(graph: dict, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_parser_sees_every_kind_of_import(graph):
    assert "specdec.forensics.audit" in graph["specdec.cli"]       # function-local
    assert "specdec.phases" in graph["specdec.strategies"]          # TYPE_CHECKING
    assert "specdec.layout" in graph["specdec.batch"]               # from . import layout
    assert "specdec.strategies" in graph["specdec.strategies.eqspec"]  # from . import Name
    assert "invariants.view" in graph["specdec.phases"]             # absolute


def test_no_import_circle(graph):
    assert cycles(graph) == []


def test_layers_import_downward_only(graph):
    assert upward(graph) == []
    assert not any(b.startswith("specdec") for a in graph if layer(a) == 0 for b in graph[a])


def test_phases_reach_neither_the_engine_nor_a_strategy(graph):
    bad = {m for m in reach(graph, "specdec.phases")
           if m == "specdec.engine" or m.startswith("specdec.strategies")}
    assert bad == set()
    for m in graph:
        if m.startswith("specdec.strategies"):
            assert "specdec.engine" not in reach(graph, m), m


def test_proofs_take_only_the_layout_the_mutants_and_the_registry(graph):
    # ``specdec`` itself: ``from specdec import layout`` runs the package's lazy __init__
    allowed = {"specdec", "specdec.layout", "specdec.mutants", "specdec.strategies"}
    taken = {b for a in graph if layer(a) == 2 and a.startswith("proofs") for b in graph[a]
             if b.startswith("specdec")}
    assert taken <= allowed, taken - allowed
    code = ("import sys, proofs, proofs.registry, proofs.__main__; "
            "obs = proofs.registry.obligations(); "
            "print(len(obs), sorted(m for m in ('torch', 'specdec.engine', 'specdec.phases') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split(maxsplit=1)
    assert int(out[0]) > 50 and out[1].strip() == "[]"


def test_the_checks_find_a_planted_circle_and_an_upward_arrow():
    planted = {"specdec.a": {"specdec.b"}, "specdec.b": {"specdec.c"}, "specdec.c": {"specdec.a"},
               "invariants.x": {"specdec.a"}, "proofs.y": {"specdec.a"}}
    assert cycles(planted) == [["specdec.a", "specdec.b", "specdec.c"]]
    assert upward(planted) == ["invariants.x (layer 0) imports specdec.a (layer 1)"]
