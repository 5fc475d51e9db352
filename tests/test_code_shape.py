"""Size limits of issue 22: no module in ``offload/`` over 600 lines, no function over 60.

Lengths are counted as written: a module's lines, a function's lines from its ``def`` to
its last line (``end_lineno - lineno + 1``, docstring and decorators' own lines aside).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "offload"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60

# Functions still over the limit, each a known debt with an owner. An entry must name a
# function that exists and is still too long: a stale one fails too, so it is removed as
# soon as the function is shortened. Empty: no debt left.
EXCEPTIONS: set[str] = set()


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _shape() -> tuple[dict[str, int], dict[str, int]]:
    """Lines per module and per function ("path::Qual.name"), paths relative to the repository."""
    modules, functions = {}, {}
    root = PACKAGE.parent
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        modules[rel] = len(text.splitlines())
        for name, node in _functions(ast.parse(text, filename=rel)):
            functions[f"{rel}::{name}"] = node.end_lineno - node.lineno + 1
    return modules, functions


@pytest.fixture(scope="module")
def shape() -> tuple[dict[str, int], dict[str, int]]:
    return _shape()


def test_no_module_over_the_limit(shape):
    """Every module of offload/ has at most MAX_MODULE_LINES lines."""
    modules, _ = shape
    assert len(modules) > 20, "the walk found too few modules: is PACKAGE right?"
    over = {m: n for m, n in modules.items() if n > MAX_MODULE_LINES}
    assert not over, (f"modules over {MAX_MODULE_LINES} lines: {over}; split them by concept "
                      "(one concept per module, STYLE.md)")


def test_no_function_over_the_limit(shape):
    """Every function of offload/ has at most MAX_FUNCTION_LINES lines, except the listed debts."""
    _, functions = shape
    over = {f: n for f, n in functions.items() if n > MAX_FUNCTION_LINES and f not in EXCEPTIONS}
    assert not over, (f"functions over {MAX_FUNCTION_LINES} lines: {over}; extract well-named steps "
                      "(not by cramming lines)")


@pytest.mark.parametrize("name", sorted(EXCEPTIONS) or [pytest.param(None, marks=pytest.mark.skip(
    reason="no exception is listed: every function is within the limit"))])
def test_each_exception_is_still_needed(shape, name):
    """An exception names a function that exists and is still over the limit (else: delete it)."""
    _, functions = shape
    assert name in functions, f"{name} no longer exists: remove it from EXCEPTIONS"
    assert functions[name] > MAX_FUNCTION_LINES, (
        f"{name} is {functions[name]} lines, within the limit now: remove it from EXCEPTIONS")


def test_the_walk_sees_long_functions_and_methods():
    """The counter finds a nested method and measures it from def to last line."""
    src = "class A:\n    def f(self):\n" + "        x = 1\n" * 70 + "\ndef g():\n    def h():\n        pass\n"
    found = {name: node.end_lineno - node.lineno + 1 for name, node in _functions(ast.parse(src))}
    assert found == {"A.f": 71, "g": 3, "g.h": 2}
