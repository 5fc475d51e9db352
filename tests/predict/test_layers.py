"""offload.predict's modules import downward only, type hints included: the simulation (``_sim``) owns the types
the stall labeller and the Chrome trace writer read, and the timeline calls down to all three (issue 44: the
timeline used to call the writer and the labeller, which imported the timeline's types back)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "offload" / "predict"


def _imports(path: Path) -> set[str]:
    """Modules of offload.predict that ``path`` imports anywhere (functions and TYPE_CHECKING blocks included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            out.update(a.name for a in node.names)
    return {m for m in out if (PKG / f"{m}.py").exists()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_predict_modules_import_downward_only():
    """No import circle among offload/predict's modules, even through imports made only for type hints."""
    graph = {p.stem: _imports(p) for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert graph["_timeline"] >= {"_sim", "_stalls", "_chrome"}  # the timeline calls down to them
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_check_sees_a_circle():
    """The checker finds a circle when there is one (a type-hint import back from a lower layer)."""
    assert _cycle({"_timeline": {"_stalls"}, "_stalls": {"_timeline"}}) == ["_stalls", "_timeline", "_stalls"]
