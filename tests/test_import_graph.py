"""The package's import graph is acyclic (issue 22: engine.py, regions.py, attach.py,
_native and compat._peer_attributes used to import each other in a circle; issue 44: bench.partial_offload
and bench.predicted_vs_measured), and the pieces the engine composes never import the engine back at run
time (imports under TYPE_CHECKING are type hints only). The repo's bench/ tools are scanned too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "offload"
FOLDERS = {PKG: "offload", ROOT / "profiling": "offload.profiling", ROOT / "bench": "bench"}
"""Each scanned folder and the package it installs as (the repo's profiling/ folder is offload.profiling;
bench/ is a repo tool run from the checkout)."""
TOP = {name.split(".")[0] for name in FOLDERS.values()}
"""Top-level packages whose imports are edges of the graph."""


def _module_name(path: Path) -> str:
    folder = next(f for f in FOLDERS if f in path.parents)
    parts = (FOLDERS[folder], *path.relative_to(folder).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    base = mod.split(".")
    base = base if is_pkg else base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _runtime_imports(path: Path) -> set[str]:
    """Modules of the package this module imports, where it runs (lazy imports in functions included;
    imports under TYPE_CHECKING, for type hints only, left out)."""
    mod, is_pkg = _module_name(path), path.name == "__init__.py"
    out: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node.body)  # an import run later (a lazy import) is a dependency too
                continue
            if isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_pkg, node.level, node.module) if node.level else (node.module or "")
                if target.split(".")[0] in TOP:
                    out.add(target)
                    out.update(f"{target}.{a.name}" for a in node.names)  # `from . import x` imports x
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.split(".")[0] in TOP)
            for field in ("body", "orelse", "finalbody", "handlers"):
                if isinstance(node, (ast.If, ast.Try, ast.With)) and hasattr(node, field):
                    visit(getattr(node, field))

    visit(ast.parse(path.read_text()).body)
    return out


def _graph() -> dict[str, set[str]]:
    mods = {_module_name(p): p for folder in FOLDERS for p in folder.rglob("*.py")}
    # A package is always imported before its modules: an edge to an enclosing package is no cycle.
    return {m: {t for t in _runtime_imports(p) if t in mods and t != m and not m.startswith(t + ".")}
            for m, p in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := dfs(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := dfs(m)):
            return found
    return None


def test_the_package_import_graph_has_no_cycle():
    graph = _graph()
    assert "offload.engine" in graph and graph["offload.engine"], "the scan found no imports: it is broken"
    assert graph["offload.profiling.packed"], "the scan missed offload.profiling (the profiling/ folder)"
    assert graph["bench.partial_offload"], "the scan missed the bench/ folder"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_what_the_engine_composes_does_not_import_it_at_run_time():
    graph = _graph()
    for leaf in ("offload.attach", "offload._native", "offload.compat._peer_attributes", "offload._exclusion",
                 "offload._packing", "offload._copies", "offload._backward", "offload._handles",
                 "offload._observers", "offload.policy", "offload.streams", "offload.tiers", "offload.pool"):
        assert "offload.engine" not in graph[leaf], f"{leaf} imports offload.engine (not for type hints only)"


def test_the_scan_sees_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _all_imports(path: Path) -> set[str]:
    """Modules of offload.predict that ``path`` (in it) imports anywhere, functions and TYPE_CHECKING blocks
    included."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
    return {m for m in out if (path.parent / f"{m}.py").exists()}


def test_predict_modules_import_downward_only_type_hints_included():
    """offload.predict's modules import downward only, type hints included: the simulation (``_sim``) owns the
    types the stall labeller and the Chrome trace writer read, and the timeline calls down to all three (issue
    44: the timeline called the writer and the labeller, which imported the timeline's types back)."""
    folder = PKG / "predict"
    graph = {p.stem: _all_imports(p) for p in folder.glob("*.py") if p.stem != "__init__"}
    assert graph["_timeline"] >= {"_sim", "_stalls", "_chrome"}  # the timeline calls down to them
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert _cycle({"_timeline": {"_stalls"}, "_stalls": {"_timeline"}})  # (the check sees a type-hint circle)
