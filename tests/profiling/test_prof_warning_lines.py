"""Warnings from the profilers point at the user's line, whichever internal path raised them."""

from __future__ import annotations

import warnings

import pytest
import torch

from offload.profiling import MemProfilerCfg


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is about CUDA being absent")
def test_memprofiler_cfg_warning_points_at_the_callers_line():
    """MemProfilerCfg's CUDA-absent warning is attributed to this file (not profiling/config.py)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MemProfilerCfg(enabled=True, cuda_allocator_history=True)
    hits = [w for w in caught if "CUDA is not available" in str(w.message)]
    assert hits and all(w.filename == __file__ for w in hits), [(w.filename, w.lineno) for w in hits]


def test_every_warning_is_attributed_to_the_users_line():
    """Every warnings.warn in offload/ and profiling/ passes stacklevel=user_stacklevel() (a fixed
    stacklevel is right for one call path only); offload._warn.warn_user does the same."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in [*(root / "offload").rglob("*.py"), *(root / "profiling").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warn"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "warnings"):
                level = next((k.value for k in node.keywords if k.arg == "stacklevel"), None)
                if not (isinstance(level, ast.Call) and getattr(level.func, "id", "") == "user_stacklevel"):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, offenders
