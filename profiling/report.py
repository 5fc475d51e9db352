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

from offload._format import BYTE_UNITS, format_bytes, render_table

from ._util import to_plain
from .errors import ProfilingError

__all__ = [
    "format_bytes",
    "format_table",
    "plot_series",
    "plot_step_memory",
    "plot_module_bytes",
    "write_json",
    "write_yaml",
]

def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    *,
    title: str | None = None,
    byte_columns: Sequence[str] = (),
    unit: str = "auto",
) -> str:
    """Text table (``offload._format.render_table``); ``byte_columns`` are rendered with ``format_bytes``."""
    byte_cols = set(byte_columns)

    def cell(col: str, v: Any) -> str:
        if col in byte_cols and isinstance(v, (int, float)):
            return format_bytes(v, unit)
        if isinstance(v, float):
            return f"{v:.3f}"
        return "-" if v is None else str(v)

    return render_table([[cell(c, r.get(c)) for c in columns] for r in rows], columns, title=title)


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
    if unit not in BYTE_UNITS:
        raise ValueError(f"plot_series: unit={unit!r} is not one of {sorted(BYTE_UNITS)}")
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        for name, ys in series.items():
            xs = list(x) if x is not None else list(range(len(ys)))
            ax.plot(range(len(ys)), [v / BYTE_UNITS[unit] for v in ys], marker="o", label=name)
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


def _bar_unit(total_max: float, unit: str) -> str:
    if unit != "auto":
        if unit not in BYTE_UNITS:
            raise ValueError(f"plot: unit={unit!r} is not one of {sorted(BYTE_UNITS)} or 'auto'")
        return unit
    for u in ("GiB", "MiB", "KiB"):
        if total_max >= BYTE_UNITS[u]:
            return u
    return "B"


_STACK_COLORS = ("#4c72b0", "#8172b3", "#dd8452", "#55a868", "#c44e52", "#937860", "#da8bc3", "#8c8c8c",
                 "#ccb974", "#64b5cd")


def plot_step_memory(
    layers: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    x: Sequence[Any] | None = None,
    title: str = "Device memory per step",
    xlabel: str = "step",
    unit: str = "auto",
    host_layers: Sequence[str] = ("activations offloaded (host)",),
) -> Path:
    """One stacked bar per step: each ``layers`` entry is a layer (bytes), bottom first.

    Bars start at zero (no truncated axis). ``host_layers`` are drawn hatched
    on top: bytes that would be on the device without offloading but sit on
    the host; each bar is labelled with its device total (and the total with
    them), so a step's composition and what offloading saved read at a glance.
    """
    plt = _pyplot()
    names = list(layers)
    n = max((len(v) for v in layers.values()), default=0)
    xs = [str(v) for v in (x if x is not None else range(n))]
    totals = [sum(float(layers[k][i] or 0) for k in names) for i in range(n)]
    u = _bar_unit(max(totals, default=0.0), unit)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.6 * n + 4), 4.5))
    try:
        bottom = [0.0] * n
        device = [0.0] * n
        for i, name in enumerate(names):
            vals = [float(layers[name][j] or 0) / BYTE_UNITS[u] for j in range(n)]
            host = name in host_layers
            ax.bar(range(n), vals, bottom=bottom, label=name, color=_STACK_COLORS[i % len(_STACK_COLORS)],
                   edgecolor="white", linewidth=0.5, hatch="//" if host else None, alpha=0.55 if host else 1.0)
            bottom = [b + v for b, v in zip(bottom, vals)]
            if not host:
                device = [d + v for d, v in zip(device, vals)]
        for j, t in enumerate(totals):
            on_dev = device[j] * BYTE_UNITS[u]
            label = format_bytes(t) if on_dev == t else f"device {format_bytes(on_dev)}\n(of {format_bytes(t)})"
            ax.annotate(label, (j, t / BYTE_UNITS[u]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(n))
        ax.set_xticklabels(xs, rotation=30 if n > 8 else 0, ha="right" if n > 8 else "center", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(u)
        ax.set_ylim(0, max(bottom, default=1.0) * 1.2 or 1.0)
        fig.suptitle(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def plot_module_bytes(
    modules: Mapping[str, Mapping[str, Any]],
    path: str | Path,
    *,
    title: str = "Saved-for-backward bytes per module: offloaded vs kept (by reason)",
    unit: str = "auto",
    top: int = 20,
) -> Path:
    """Horizontal stacked bars, one per module: ``offloaded_bytes`` then each ``kept_by_reason`` entry.

    ``modules`` maps a module name to a dict with ``offloaded_bytes`` and
    ``kept_by_reason`` (as ``PackedBytesTracker.summary()["modules"]`` has).
    The ``top`` modules by total are shown, largest at the top.
    """
    plt = _pyplot()
    rows = sorted(
        ((name or "(outside modules)", int(m.get("offloaded_bytes", 0)), dict(m.get("kept_by_reason", {})))
         for name, m in modules.items()),
        key=lambda r: -(r[1] + sum(r[2].values())),
    )[:top]
    rows = [r for r in rows if r[1] + sum(r[2].values()) > 0][::-1]
    reasons = sorted({k for _, _, kept in rows for k in kept})
    u = _bar_unit(max((r[1] + sum(r[2].values()) for r in rows), default=0), unit)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.35 * len(rows) + 1.5)))
    try:
        left = [0.0] * len(rows)
        segments = [("offloaded", [r[1] for r in rows])] + [
            ("kept: outside any engine" if k == "no_engine" else f"kept: {k}", [r[2].get(k, 0) for r in rows])
            for k in reasons
        ]
        colors = ["#55a868", "#c44e52", "#dd8452", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974",
                  "#64b5cd", "#4c72b0"]
        for i, (label, vals) in enumerate(segments):
            if not any(vals):
                continue
            v = [x / BYTE_UNITS[u] for x in vals]
            ax.barh(range(len(rows)), v, left=left, label=label, color=colors[i % len(colors)],
                    edgecolor="white", linewidth=0.5)
            left = [a + b for a, b in zip(left, v)]
        ax.set_xlim(0, max(left, default=1.0) * 1.05 or 1.0)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([r[0] for r in rows], fontsize=7)
        ax.set_xlabel(u)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
        if rows:
            ax.legend(fontsize=8, loc="lower right")
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
