"""Readable numbers: the one byte formatter and the one table renderer (tabulate) of both packages.

tabulate, not rich: one call renders the same rows as a terminal table (``"simple"``) and as the
GitHub-markdown table the bench writes into its ``.md`` files (``"github"``), as plain strings with
no console object; rich (present only as another package's dependency) renders boxes for a
terminal and has no markdown table output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["BYTE_UNITS", "format_bytes", "render_table"]

BYTE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def format_bytes(n: int | float | None, unit: str = "auto") -> str:
    """``1536 -> '1.50 KiB'``; ``unit`` is one of B, KiB, MiB, GiB or ``auto``; None -> ``'-'``."""
    if n is None:
        return "-"
    if unit == "auto":
        unit = "B"
        for u in ("GiB", "MiB", "KiB"):
            if abs(n) >= BYTE_UNITS[u]:
                unit = u
                break
    if unit not in BYTE_UNITS:
        raise ValueError(f"format_bytes: unit={unit!r} is not one of {sorted(BYTE_UNITS)} or 'auto'")
    if unit == "B":
        return f"{int(n)} B"
    return f"{n / BYTE_UNITS[unit]:.2f} {unit}"


def render_table(rows: Sequence[Sequence[Any]], headers: Sequence[str], *, fmt: str = "simple",
                 title: str | None = None) -> str:
    """Rows (already formatted cells or numbers) under ``headers``; ``fmt``: ``"simple"`` for a terminal,
    ``"github"`` for markdown. The first column is left-aligned, the others right-aligned."""
    try:  # imported here: the engine itself never needs it (a GPU machine without a registry may lack it)
        from tabulate import tabulate
    except ImportError as e:
        raise ImportError("offload: printing a table needs tabulate, a dependency of offload: pip install tabulate "
                          "(on a machine without a package registry, its pure-Python wheel in .whl/ for "
                          "scripts/gpu_run.sh)") from e
    align = ("left",) + ("right",) * (len(headers) - 1)
    body = tabulate([[("-" if v is None else v) for v in r] for r in rows], headers=list(headers), tablefmt=fmt,
                    colalign=align, disable_numparse=True)
    return (f"{title}\n" if title else "") + body + "\n"

