"""pyflakes finds nothing in the project's Python: no unused import, undefined name or shadowed definition
(issue 44 item 6). A name imported to be re-exported goes in ``__all__``, which pyflakes reads (it does
not read ``# noqa``)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("offload", "profiling", "bench", "tests", "examples", "scripts")


def test_pyflakes_finds_nothing():
    """pyflakes over every Python folder of the repository reports nothing (each finding is listed)."""
    api = pytest.importorskip("pyflakes.api", reason="pyflakes is in the test extra")
    from pyflakes.reporter import Reporter

    out, err = io.StringIO(), io.StringIO()
    found = api.checkRecursive([str(ROOT / f) for f in FOLDERS if (ROOT / f).is_dir()], Reporter(out, err))
    assert found == 0 and not err.getvalue(), out.getvalue() + err.getvalue()
