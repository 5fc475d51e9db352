"""Turn a :class:`BenchResult` into a stdout table, JSON, markdown and a PNG."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from offload._format import render_table

from bench.hardware import peak_for
from bench.results import BenchResult, StrategyResult, to_jsonable
from bench.targets import SOURCE, evaluate_targets
from bench.trace_summary import format_markdown as format_trace_markdown

__all__ = ["SHORT_COLUMNS", "format_tables", "write_json", "write_markdown", "write_png", "write_all"]

_MiB = float(1 << 20)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _f(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _correct(s: StrategyResult) -> str:
    c = s.correctness
    if c is not None and c.against == s.name:  # a reference checked against its own earlier step
        if c.mode == "noise_floor" and not c.bitwise_equal:
            return f"reference, run-to-run max|d| {c.max_abs_diff:.1e} ({', '.join(c.nondeterministic_ops)})"
        return "reference" if c.bitwise_equal else f"reference, NOT repeatable (max|d| {c.max_abs_diff:.1e})"
    if c is None:
        return "reference" if s.name == "none" else "—"
    vs = "" if c.against == "none" else f" vs {c.against}"
    if c.bitwise_equal:
        return "bitwise" + vs
    if c.mode == "noise_floor":
        return {True: "within noise", False: "NO, beyond noise", None: "inconclusive"}[c.within_noise] + \
            f"{vs} (max|d| {c.max_abs_diff:.1e})"
    if c.mode == "tolerance":  # reordered sums (tiles): relative difference against the allowed one
        return f"{'within tolerance' if c.within_noise else 'NO, beyond tolerance'}{vs} (rel|d| {c.max_abs_diff:.1e})"
    return f"NO{vs} (max|d| {c.max_abs_diff:.1e})"


def _rows_main(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    head = ["strategy", "step ms", "IQR ms", "min / max ms", "CPU ms", "issue ms", "tok/s", "x none", "x ac", "act MiB",
            "act x none", "peak alloc MiB", "host MiB", "loss & grads vs ref"]
    rows = []
    for s in result.strategies:
        if not s.ok:
            continue
        rows.append([
            s.name,
            _f(s.median_s * 1e3, ".1f"),
            _f(s.times.iqr_s * 1e3, ".1f"),
            f"{s.times.min_s * 1e3:.1f} / {s.times.max_s * 1e3:.1f}" if s.times.n else "—",
            _f(_median(s.times.cpu_seconds) * 1e3 if s.times.cpu_seconds else None, ".1f"),
            _f(_median(s.times.issue_seconds) * 1e3 if s.times.issue_seconds else None, ".1f"),
            _f(s.tokens_per_s, ",.0f"),
            _f(result.time_ratio(s.name, "none"), ".3f"),
            _f(result.time_ratio(s.name, "ac"), ".3f"),
            _f(s.activation_bytes / _MiB if s.activation_bytes is not None else None, ".1f"),
            _f(result.activation_ratio(s.name, "none"), ".3f"),
            _f(s.peak_allocated_bytes / _MiB if s.peak_allocated_bytes is not None else None, ".0f"),
            _f(s.host_bytes / _MiB if s.host_bytes is not None else None, ".1f"),
            _correct(s),
        ])
    return head, rows


def _rows_engine(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    head = ["strategy", "packed MiB", "offloaded MiB", "kept MiB (by reason)", "D2H GB/s", "H2D GB/s",
            "of ceiling", "exposed copy ms (mean)", "pool allocs after warm-up", "host measured / held"]
    ceil = result.ceiling
    rows = []
    for s in result.strategies:
        e = s.engine
        if not s.ok or e is None:
            continue
        kept = ", ".join(f"{k} {v / _MiB:.1f}" for k, v in sorted(e.kept_by_reason.items(), key=lambda kv: -kv[1]))
        frac = []
        if ceil and ceil.kind == "memcpy":
            pass  # CPU: no meaningful ratio (_CPU_CEILING)
        elif ceil and ceil.d2h_gb_s and e.d2h_gb_s:
            frac.append(f"{e.d2h_gb_s / ceil.d2h_gb_s:.0%}")
        if ceil and ceil.kind != "memcpy" and ceil.h2d_gb_s and e.h2d_gb_s:
            frac.append(f"{e.h2d_gb_s / ceil.h2d_gb_s:.0%}")
        rows.append([
            s.name,
            _f(e.packed_bytes / _MiB, ".1f"),
            _f(e.offloaded_bytes / _MiB, ".1f"),
            f"{e.kept_bytes / _MiB:.1f}" + (f" ({kept})" if kept else ""),
            _f(e.d2h_gb_s, ".2f"),
            _f(e.h2d_gb_s, ".2f"),
            " / ".join(frac) or "—",
            _f(e.stall_seconds * 1e3, ".2f"),
            str(e.pool_allocations_after_warmup),
            _f(e.host_footprint_ratio, ".3f"),
        ])
    return head, rows


_NOT_APPLICABLE = {
    "peak alloc MiB": "no device memory counter: host and device are one memory",
    "of ceiling": "the engine's copies are memcpys of cache-resident tensors, which the 64 MB memcpy ceiling "
                  "does not bound",
    "D2H GB/s": "nothing was copied", "H2D GB/s": "nothing was copied",
}
"""Why a column can be empty for every strategy (shown once, in one line, when it is left out)."""
_CPU_CEILING = _NOT_APPLICABLE["of ceiling"]


def _applicable(head: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]], list[str]]:
    """Leave out the columns that are empty ("—") for every row; returns them too."""
    keep = [i for i, h in enumerate(head) if i == 0 or any(r[i] != "—" for r in rows)]
    dropped = [h for i, h in enumerate(head) if i not in keep]
    return [head[i] for i in keep], [[r[i] for i in keep] for r in rows], dropped


def _not_shown(result: BenchResult, dropped: list[str]) -> str:
    if not dropped:
        return ""
    why = "; ".join(f"{h} ({_NOT_APPLICABLE.get(h, 'empty for every strategy')})" for h in dropped)
    return f"Not shown on {result.meta.get('device_name', 'this device')}: {why}."


def _table(head: list[str], rows: list[list[str]], fmt: str) -> tuple[str, list[str]]:
    head, rows, dropped = _applicable(head, rows)
    if fmt == "github":
        rows = [[c.replace("|", "/") for c in r] for r in rows]
    return render_table(rows, head, fmt=fmt).rstrip("\n"), dropped


def _head_study(result: BenchResult) -> list[str]:
    off, exc = result.get("offload"), result.get("offload_head_excluded")
    if not off or not exc or not off.ok or not exc.ok or not off.engine or not exc.engine:
        return []
    t = result.time_ratio("offload_head_excluded", "offload")
    a = result.activation_ratio("offload_head_excluded", "offload")
    head_kept = exc.engine.kept_by_reason.get("excluded_region", 0.0)
    head_moved = sum(v for k, v in off.engine.module_offloaded_bytes.items() if k.endswith(".output"))
    return [
        "Head study (output head offloaded = `offload`, kept on device = `offload_head_excluded`):",
        f"  step time excluded / offloaded = {_f(t, '.3f')}; activation memory excluded / offloaded = {_f(a, '.3f')}",
        f"  head bytes offloaded per step by `offload`: {head_moved / _MiB:.2f} MiB; "
        f"kept as excluded_region by `offload_head_excluded`: {head_kept / _MiB:.2f} MiB",
    ]


def _skipped(result: BenchResult) -> list[str]:
    return [f"  {s.name}: {s.status}: {s.reason}" for s in result.strategies if not s.ok]


def _header(result: BenchResult) -> list[str]:
    wl, m = result.workload, result.meta
    lines = [
        f"workload {wl['name']}: h={wl['dim']} layers={wl['n_layers']} heads={wl['n_heads']} vocab={wl['vocab_size']} "
        f"s={wl['seq_len']} b={wl['batch']} {wl['dtype']} ({wl['param_count'] / 1e6:.1f}M params, "
        f"{wl['tokens_per_step']} tokens/step)",
        f"device {m.get('device_name')} | torch {m.get('torch')} | {m.get('torch_threads')} threads | "
        f"{m.get('steps')} measured steps after {m.get('warmup')} warm-up, {m.get('order')} | commit {m.get('git_commit')}",
    ]
    if m.get("order") == "interleaved":
        lines.append("ratios (x none, x ac) are medians of per-round paired step-time ratios")
    if m.get("loadavg_1m_at_start") is not None:
        lines.append(f"machine load (1-min avg) at start {m.get('loadavg_1m_at_start')}, at end "
                     f"{m.get('loadavg_1m_at_end')} on {m.get('cpu_count')} CPUs")
    if result.ceiling:
        c = result.ceiling
        lines.append(f"copy ceiling ({c.note}): D2H {_f(c.d2h_gb_s, '.2f')} GB/s, H2D {_f(c.h2d_gb_s, '.2f')} GB/s")
    peak = peak_for(str(m.get("device_name", "")))
    base = result.get("none")
    if peak is not None and base is not None and base.achieved_tflops:
        lines.append(f"none: {base.achieved_tflops:.0f} TFLOP/s of model FLOPs = "
                     f"{base.achieved_tflops / peak.bf16_dense_tflops:.0%} of the {peak.name.upper()} "
                     f"dense bf16 peak ({peak.bf16_dense_tflops:.0f}, datasheet)")
    if "fit_layers" in m:
        f = m["fit_layers"]
        lines.append(f"layers that fit at {f['budget_frac']:.0%} of device memory: {f['fits']} (of {f['requested']})")
    return lines


SHORT_COLUMNS = ("strategy", "step time x none (95% CI)", "activation MiB (x none)", "loss & grads vs ref")
"""The leading table's columns: what a strategy costs in time, what it saves in memory, and whether its
gradients are the reference's (every other figure: ``--full``, and the run's .md and .json)."""


def _rows_short(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    rows = []
    for s in result.strategies:
        if not s.ok:
            continue
        t, ci = result.time_ratio(s.name, "none"), result.time_ratio_ci(s.name, "none")
        time = _f(t, ".3f") + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if t is not None and ci else "")
        a = result.activation_ratio(s.name, "none")
        act = _f(s.activation_bytes / _MiB if s.activation_bytes is not None else None, ".1f")
        rows.append([s.name, time, act + (f" ({a:.2f}x)" if a is not None else ""), _correct(s)])
    return list(SHORT_COLUMNS), rows


def _detail(result: BenchResult) -> list[str]:
    """Every column (the main and engine tables, left-out columns, the head study): ``--full``."""
    main, dropped = _table(*_rows_main(result), "simple")
    out = ["All figures:", main]
    eh, er = _rows_engine(result)
    if er:
        engine, more = _table(eh, er, "simple")
        out += ["", "Engine accounting (per step, measured steps):", engine]
        dropped += more
    if dropped:
        out += ["", _not_shown(result, dropped)]
    hs = _head_study(result)
    return out + ([""] + hs if hs else [])


def format_tables(result: BenchResult, full: bool = False) -> str:
    """The readable stdout report: the run's header, then :data:`SHORT_COLUMNS` for every strategy that ran,
    what did not run and the targets' verdicts; ``full`` adds every other column and each target's figures
    (the .md and .json files always hold them all)."""
    head, rows = _rows_short(result)
    out = _header(result) + ["", render_table(rows, head, fmt="simple").rstrip("\n")]
    if full:
        out += [""] + _detail(result)
    sk = _skipped(result)
    if sk:
        out += ["", "Not run:"] + sk
    out += ["", f"Performance targets (defined in {SOURCE}):"]
    for t in evaluate_targets(result):
        out.append(f"  [{t.verdict}] {t.target}")
        if full:
            out.append(f"      {t.measured}" + (f"  ({t.note})" if t.note else ""))
    src = next((s.activation_source for s in result.strategies if s.ok), "")
    if src:
        out += ["", f"activation = {src}"]
    if full:
        out.append("host = bytes of host copies (CPU: allocated inside each arm's pack hook in the profiled step); "
                   "CPU ms = process CPU time per step (median); issue ms = wall time until the step's Python returned, "
                   "before the device synchronize (median; near step ms on a GPU: the host set the pace)")
    else:
        out.append("Every other figure (step ms and spread, tok/s, peak and host MiB, engine accounting, the "
                   "targets' measurements): python -m bench --full, and the .md / .json the run writes.")
    return "\n".join(out)


def write_json(result: BenchResult, path: Path) -> None:
    data = to_jsonable(result)
    data["ratios"] = {
        s.name: {
            "time_x_none": result.time_ratio(s.name, "none"),
            "time_x_ac": result.time_ratio(s.name, "ac"),
            "cpu_time_x_none": result.time_ratio(s.name, "none", "cpu"),
            "cpu_time_x_none_ci95": result.time_ratio_ci(s.name, "none", "cpu"),
            "time_x_none_ci95": result.time_ratio_ci(s.name, "none"),
            "activation_x_none": result.activation_ratio(s.name, "none"),
            "activation_x_ac": result.activation_ratio(s.name, "ac"),
        }
        for s in result.strategies if s.ok
    }
    if not data.get("targets"):
        data["targets"] = to_jsonable(evaluate_targets(result))
    path.write_text(json.dumps(data, indent=1) + "\n")


def write_markdown(result: BenchResult, path: Path, json_name: str, png_name: str | None) -> None:
    m = result.meta
    lines = [f"# bench: {result.workload['run_id']} on {m.get('device_name')}", ""]
    lines += [f"Command: `{m.get('command')}`  ", f"Date: {m.get('date_utc')}, commit `{m.get('git_commit')}`, "
              f"torch {m.get('torch')}, Python {m.get('python')}  ", f"Data: [`{json_name}`]({json_name})", ""]
    lines += [line + "  " for line in _header(result)] + [""]
    main, dropped = _table(*_rows_main(result), "github")
    lines.append(main)
    eh, er = _rows_engine(result)
    if er:
        engine, more = _table(eh, er, "github")
        lines += ["", "Engine accounting (per step):", "", engine]
        dropped += more
    if dropped:
        lines += ["", _not_shown(result, dropped)]
    hs = _head_study(result)
    if hs:
        lines += [""] + [h.strip() + "  " for h in hs]
    sk = _skipped(result)
    if sk:
        lines += ["", "Not run:", ""] + [f"- {s.strip()}" for s in sk]
    traced = format_trace_markdown({s.name: s.trace for s in result.strategies if s.ok and s.trace})
    if traced:
        lines += ["", traced.rstrip("\n")]
    lines += ["", f"## Performance targets (defined in `{SOURCE}`)", ""]
    lines.append(_table(["target", "measured", "verdict", "note"],
                        [[t.target, t.measured, t.verdict, t.note or "—"] for t in evaluate_targets(result)],
                        "github")[0])
    src = next((s.activation_source for s in result.strategies if s.ok), "")
    lines += ["", f"Activation memory: {src}.  ",
              "Host MiB: bytes of host copies (CPU: allocated inside each arm's pack hook in the profiled step).  ",
              "CPU ms: process CPU time per step (median).  ",
              "Issue ms: wall time until the step's Python returned, before the device synchronize (median): on a GPU, "
              "near step ms where the host set the pace."]
    if png_name:
        lines += ["", f"![activation memory vs step time]({png_name})"]
    path.write_text("\n".join(lines) + "\n")


_MARKER_PT = 7.0
"""Marker size in the plot (points)."""
_SPREAD_PT = _MARKER_PT + 2.0
"""Centre-to-centre distance, in points, of markers spread apart so that none hides another."""


def _spread(columns: list[tuple[float, float, float]], min_dist: float) -> list[float]:
    """Sideways offsets, in multiples of ``min_dist``, for points drawn as vertical columns ``(x, bottom,
    top)`` (a marker and its error bar), such that no two columns less than ``min_dist`` apart in x overlap
    in y: those that would are grouped, and each group is laid out left to right, ``min_dist`` apart, in
    order of x (then of index), centred on where its points are."""
    n = len(columns)
    group = list(range(n))  # group[i]: the group point i belongs to (its lowest member)
    while True:
        offsets = [0.0] * n
        for g in set(group):
            members = sorted((i for i in range(n) if group[i] == g), key=lambda i: (columns[i][0], i))
            for k, i in enumerate(members):
                offsets[i] = k - (len(members) - 1) / 2
        x = [c[0] + o * min_dist for c, o in zip(columns, offsets)]
        clash = next(((i, j) for i in range(n) for j in range(i + 1, n) if group[i] != group[j]
                      and abs(x[i] - x[j]) < min_dist and columns[i][1] < columns[j][2]
                      and columns[j][1] < columns[i][2]), None)
        if clash is None:
            return offsets
        merged, into = max(group[clash[0]], group[clash[1]]), min(group[clash[0]], group[clash[1]])
        group = [into if g == merged else g for g in group]


def _spread_overlapping(ax, drawn: list) -> int:
    """Move the markers and error bars of ``drawn`` errorbar containers that would overlap on screen
    sideways by :data:`_SPREAD_PT` steps (a display offset: the data stay the strategies' own figures);
    returns how many moved. Call after the layout is final: it freezes the axes' limits."""
    from matplotlib.transforms import offset_copy

    ax.set_xlim(ax.get_xlim())
    ax.set_ylim(ax.get_ylim())
    fig = ax.figure
    step = _SPREAD_PT * fig.dpi / 72  # pixels
    columns = []
    for c in drawn:
        line, _, bars = c.lines
        x, y = ax.transData.transform(line.get_xydata()[0])
        ys = [y - step / 2, y + step / 2]  # the marker, and the bar's ends
        ys += [float(p[1]) for b in bars for seg in b.get_segments() for p in ax.transData.transform(seg)]
        columns.append((float(x), min(ys), max(ys)))
    offsets = _spread(columns, step)
    for c, o in zip(drawn, offsets):
        if o:
            moved = offset_copy(ax.transData, fig=fig, x=o * _SPREAD_PT, y=0.0, units="points")
            line, caps, bars = c.lines
            for artist in (line, *caps, *bars):
                artist.set_transform(moved)
                artist.set_clip_on(False)  # a marker moved past the axes' edge stays visible
    return sum(1 for o in offsets if o)


def write_png(result: BenchResult, path: Path) -> bool:
    """Activation memory vs step time, one point per strategy. False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pts = [s for s in result.strategies if s.ok and s.activation_bytes is not None and s.times.n]
    fig, ax = plt.subplots(figsize=(9, 5))
    # One marker and colour per strategy, named in a legend beside the axes: labels never overlap,
    # however close two strategies land (offload / offload_sync, ac / offload_ac); markers that would
    # hide one another are spread sideways below.
    markers = "osD^vP*Xhp<>"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = []
    for i, s in enumerate(pts):
        x, y = s.activation_bytes / _MiB, s.median_s * 1e3
        lo, hi = s.times.p25_s * 1e3, s.times.p75_s * 1e3
        drawn.append(ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt=markers[i % len(markers)], capsize=3,
                                 color=colors[i % len(colors)], label=s.name, markersize=_MARKER_PT, alpha=0.85))
    wl = result.workload
    on_cpu = str(result.meta.get("device_name", "")).lower() == "cpu"
    ax.set_xlabel("activation memory per step, MiB" + (" (CPU: host copies included)" if on_cpu else
                                                        " (device memory; host copies not included)"))
    ax.set_ylabel("step time, median ms (bars: IQR)")
    ax.set_title(f"{wl['run_id']} on {result.meta.get('device_name')}", fontsize=10)
    ax.annotate("better", xy=(0.03, 0.05), xytext=(0.16, 0.2), xycoords="axes fraction",
                textcoords="axes fraction", arrowprops={"arrowstyle": "->", "color": "0.4"}, color="0.4",
                fontsize=9, ha="center")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False, title="strategy")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    if _spread_overlapping(ax, drawn):
        ax.text(1.01, 0.0, f"Markers and bars that would\noverlap are spread sideways,\n{_SPREAD_PT:.0f} pt apart: a drawing "
                "offset,\nnot memory (figures: the .md)", transform=ax.transAxes,
                ha="left", va="bottom", fontsize=7, color="0.4")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _atomically(path: Path, write) -> object:
    """``write(tmp)`` then rename onto ``path``: a process killed mid-write leaves the previous file whole
    (the bench rewrites its files after every strategy)."""
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        made = write(tmp)
        if tmp.exists():
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return made


def write_all(result: BenchResult, out_dir: Path, plot: bool = True) -> list[Path]:
    """JSON, markdown and (if matplotlib is there) PNG under ``out_dir``, named by the workload's run id.

    Each file is replaced atomically, so it can be rewritten after every strategy."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = result.workload["run_id"]
    written = []
    json_path = out_dir / f"{stem}.json"
    _atomically(json_path, lambda p: write_json(result, p))
    written.append(json_path)
    png_path = out_dir / f"{stem}.png"
    png_ok = plot and _atomically(png_path, lambda p: write_png(result, p))
    if png_ok:
        written.append(png_path)
    md_path = out_dir / f"{stem}.md"
    _atomically(md_path, lambda p: write_markdown(result, p, json_path.name,
                                                  png_path.name if png_ok or png_path.exists() else None))
    written.append(md_path)
    return written
