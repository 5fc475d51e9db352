"""Readable output shared by the profilers: text tables, per-step PNG plots, JSON and YAML.

matplotlib is optional (``pip install 'offload[plot]'``): it is imported only
when a plot is asked for, and its absence is reported as a ``ProfilingError``
that says how to install it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ._util import to_plain
from .errors import ProfilingError

__all__ = ["format_bytes", "format_table", "plot_series", "write_json", "write_yaml"]

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def format_bytes(n: int | float | None, unit: str = "auto") -> str:
    """``1536 -> '1.50 KiB'``; ``unit`` is one of B, KiB, MiB, GiB or ``auto``."""
    if n is None:
        return "-"
    if unit == "auto":
        unit = "B"
        for u in ("GiB", "MiB", "KiB"):
            if abs(n) >= _UNITS[u]:
                unit = u
                break
    if unit not in _UNITS:
        raise ValueError(f"format_bytes: unit={unit!r} is not one of {sorted(_UNITS)} or 'auto'")
    if unit == "B":
        return f"{int(n)} B"
    return f"{n / _UNITS[unit]:.2f} {unit}"


def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    *,
    title: str | None = None,
    byte_columns: Sequence[str] = (),
    unit: str = "auto",
) -> str:
    """Fixed-width text table; ``byte_columns`` are rendered with ``format_bytes``."""
    byte_cols = set(byte_columns)

    def cell(col: str, v: Any) -> str:
        if col in byte_cols and isinstance(v, (int, float)):
            return format_bytes(v, unit)
        if isinstance(v, float):
            return f"{v:.3f}"
        return "-" if v is None else str(v)

    body = [[cell(c, r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(columns)]
    first_left = [True] + [False] * (len(columns) - 1)

    def line(vals: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if left else v.rjust(w) for v, w, left in zip(vals, widths, first_left)
        ).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(line(columns))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(b) for b in body)
    return "\n".join(out) + "\n"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ProfilingError(
            "profiling plots need matplotlib, which is not installed: "
            "pip install 'offload[plot]' (or pip install matplotlib)"
        ) from e
    return plt


def plot_series(
    series: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    x: Sequence[Any] | None = None,
    title: str = "",
    xlabel: str = "step",
    unit: str = "MiB",
) -> Path:
    """Write one PNG with a line per series (byte values shown in ``unit``)."""
    if unit not in _UNITS:
        raise ValueError(f"plot_series: unit={unit!r} is not one of {sorted(_UNITS)}")
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        for name, ys in series.items():
            xs = list(x) if x is not None else list(range(len(ys)))
            ax.plot(range(len(ys)), [v / _UNITS[unit] for v in ys], marker="o", label=name)
            if x is not None:
                ax.set_xticks(range(len(xs)))
                ax.set_xticklabels([str(v) for v in xs], rotation=30, ha="right", fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if series:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def write_json(data: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_plain(data), indent=2, sort_keys=False) + "\n")
    return path


def write_yaml(data: Any, path: str | Path) -> Path:
    """YAML that ``yaml.safe_load`` reads back (plain types only, no python tags)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        yaml.safe_dump(to_plain(data), f, sort_keys=False, default_flow_style=False)
    return path
