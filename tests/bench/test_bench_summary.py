"""What ``python -m bench`` shows first: a short table (strategy, step time x none with its CI, activation
memory, gradients verdict) for every strategy, every other figure in ``--full`` and in the files, and a plot
where strategies with the same figures stay distinguishable. Built on a small synthetic result (no bench run)
except the one test of the command line's wiring."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest

from bench import cli
from bench.report import SHORT_COLUMNS, format_tables, write_json, write_markdown, write_png
from bench.results import BenchResult, Ceiling, Correctness, EngineStats, StepTimes, StrategyResult

_MiB = 1 << 20
TWINS = ("offload", "offload_sync", "offload_head_excluded")
"""Strategies given exactly the same figures below (as on CPU, where they land on one point)."""


def _engine() -> EngineStats:
    return EngineStats(steps=8, packed_bytes=66e6, offloaded_bytes=45e6, kept_bytes=21e6,
                       kept_by_reason={"parameter": 14e6, "duplicate_storage": 7e6}, d2h_bytes=45e6,
                       d2h_seconds=3e-3, h2d_bytes=45e6, h2d_seconds=3e-3, stall_seconds=6e-3,
                       peak_inflight_bytes=1 << 20, pool_reserved_bytes=50 << 20, pool_peak_reserved_bytes=50 << 20,
                       pool_peak_in_use_bytes=50 << 20, pool_allocations_total=12, pool_allocations_after_warmup=0,
                       pool_pin_failures=0, held_bytes_last_step=50 << 20, host_bytes_measured=50 << 20)


def _arm(name: str, ms: float, act_mib: float, *, equal: bool = True, engine: bool = False) -> StrategyResult:
    secs = [ms / 1e3 * (1 + 0.01 * ((k * 7) % 5)) for k in range(8)]  # 8 steps, a little spread
    return StrategyResult(
        name=name, description=name, status="ok", tokens_per_step=512, flops_per_step=1e9,
        times=StepTimes(seconds=secs, cpu_seconds=list(secs)), activation_bytes=int(act_mib * _MiB),
        activation_source="synthetic: peak bytes during one step", host_copy_bytes=int(act_mib * _MiB) // 2,
        engine=_engine() if engine else None,
        correctness=None if name == "none" else Correctness(equal, equal, 10, 0.0 if equal else 1e-3),
    )


def synthetic() -> BenchResult:
    """A CPU-like run of nine strategies (three of them identical) and one skipped."""
    wl = {"name": "tiny", "dim": 64, "n_layers": 2, "n_heads": 2, "vocab_size": 128, "seq_len": 32, "batch": 2,
          "dtype": "float32", "param_count": 100_000, "tokens_per_step": 512, "run_id": "synthetic"}
    arms = [_arm("none", 160.0, 57.5), _arm("ac", 205.0, 18.8), _arm("sac", 183.0, 36.6, equal=False)]
    arms += [_arm(n, 180.0, 65.1, engine=True) for n in TWINS]
    arms += [_arm("account_only", 162.0, 57.5), _arm("save_on_cpu", 181.0, 74.3)]  # bars overlap none's
    arms.append(StrategyResult(name="trl", description="trl", status="skipped", reason="GPU-only peer"))
    ceiling = Ceiling(kind="memcpy", d2h_gb_s=13.0, h2d_gb_s=13.0, size_bytes=64 << 20, note="cpu memcpy")
    meta = {"device": "cpu", "device_name": "cpu", "order": "interleaved", "steps": 8, "warmup": 1}
    return BenchResult(meta=meta, workload=wl, ceiling=ceiling, strategies=arms)


@pytest.fixture
def result() -> BenchResult:
    return synthetic()


def _tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every tabulate "simple" table in ``text``: (header cells, row cells), cut at its dash line's columns."""
    lines, found = text.splitlines(), []
    for k, line in enumerate(lines):
        if k == 0 or not re.fullmatch(r"-+( +-+)*", line):
            continue
        spans = [m.span() for m in re.finditer(r"-+", line)]
        spans = [(a, spans[i + 1][0] if i + 1 < len(spans) else None) for i, (a, _) in enumerate(spans)]
        cells = [lambda row, a=a, b=b: row[a:b].strip() for a, b in spans]
        body = list(itertools.takewhile(str.strip, lines[k + 1:]))
        found.append(([c(lines[k - 1]) for c in cells], [[c(r) for c in cells] for r in body]))
    return found


def test_stdout_leads_with_the_short_table_of_every_strategy(result):
    """The first table printed has the four short columns and one row per strategy that ran, each with its
    time ratio to none (with a CI), its activation memory and its gradients verdict; it is the only table."""
    text = format_tables(result)
    (head, rows), *more = _tables(text)
    assert head == list(SHORT_COLUMNS) and not more, (head, len(more))
    ran = [s for s in result.strategies if s.ok]
    assert [r[0] for r in rows] == [s.name for s in ran]
    for s, (_, time, act, grads) in zip(ran, rows):
        ratio, ci = result.time_ratio(s.name, "none"), result.time_ratio_ci(s.name, "none")
        assert time == f"{ratio:.3f} ({ci[0]:.3f}-{ci[1]:.3f})", (s.name, time)
        assert act == f"{s.activation_bytes / _MiB:.1f} ({result.activation_ratio(s.name, 'none'):.2f}x)", act
        if s.name == "none":
            assert grads == "reference"
        else:
            assert grads == "bitwise" if s.correctness.bitwise_equal else grads.startswith("NO"), (s.name, grads)
    assert "trl: skipped" in text  # what did not run is still said


def test_every_detail_column_is_in_full_and_in_the_files(result, tmp_path):
    """The columns left out of the short table are printed by --full and written to the markdown; the JSON
    holds every strategy's raw figures and ratios."""
    full = format_tables(result, full=True)
    detail = [h for head, _ in _tables(full) for h in head if h not in SHORT_COLUMNS]
    assert len(detail) >= 10 and "tok/s" in detail and "offloaded MiB" in detail, detail
    write_markdown(result, tmp_path / "r.md", "r.json", None)
    md_heads = {c.strip() for line in (tmp_path / "r.md").read_text().splitlines() if line.startswith("| strategy")
                for c in line.strip("|").split("|")}
    assert set(detail) <= md_heads, set(detail) - md_heads
    write_json(result, tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    ran = {s.name for s in result.strategies if s.ok}
    assert set(data["ratios"]) == ran and all(data["ratios"][n]["time_x_none_ci95"] for n in ran)
    by_name = {s["name"]: s for s in data["strategies"]}
    assert all(by_name[n]["times"]["seconds"] and by_name[n]["activation_bytes"] for n in ran)
    assert all(by_name[n]["engine"]["offloaded_bytes"] for n in TWINS)


def _drawn(result: BenchResult, tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    assert write_png(result, tmp_path / "p.png")
    (ax,) = figs[0].axes
    return figs[0], ax, {c.get_label(): c.lines[0] for c in ax.containers}


def _bar_extents(ax) -> dict[str, tuple[float, float, float]]:
    """Per strategy, its error bar as drawn: (x, bottom, top) in display pixels."""
    out = {}
    for c in ax.containers:
        (bar,) = c.lines[2]
        (seg,) = bar.get_segments()
        (x0, y0), (_, y1) = bar.get_transform().transform(seg)
        out[c.get_label()] = (x0, min(y0, y1), max(y0, y1))
    return out


def test_plot_markers_of_identical_strategies_do_not_coincide(result, tmp_path, monkeypatch):
    """Strategies with the same memory and time are drawn at least one marker apart on the saved figure,
    and no two error bars closer than a marker overlap; each point stays within a few markers of its true
    position, the data are kept exact, and a note says so."""
    fig, ax, lines = _drawn(result, tmp_path, monkeypatch)
    assert set(lines) == {s.name for s in result.strategies if s.ok}
    px = fig.dpi / 72
    at = {n: line.get_transform().transform(line.get_xydata())[0] for n, line in lines.items()}
    for (a, pa), (b, pb) in itertools.combinations(at.items(), 2):
        size = max(lines[a].get_markersize(), lines[b].get_markersize()) * px
        assert math.dist(pa, pb) >= size, f"{a} and {b} are drawn {math.dist(pa, pb):.1f} px apart (< {size:.1f})"
    for name, line in lines.items():
        s = result.get(name)
        assert tuple(line.get_xydata()[0]) == (s.activation_bytes / _MiB, s.median_s * 1e3), name
        true = ax.transData.transform(line.get_xydata())[0]
        assert math.dist(true, at[name]) <= 3 * line.get_markersize() * px, name
    assert len({tuple(at[n]) for n in TWINS}) == len(TWINS)
    size = max(line.get_markersize() for line in lines.values()) * px
    for (a, (xa, lo_a, hi_a)), (b, (xb, lo_b, hi_b)) in itertools.combinations(_bar_extents(ax).items(), 2):
        assert abs(xa - xb) >= size or hi_a <= lo_b or hi_b <= lo_a, f"the bars of {a} and {b} overlap"
    assert any("apart" in t.get_text() for t in ax.texts)
    assert len({(line.get_marker(), line.get_color()) for line in lines.values()}) == len(lines)


def test_plot_moves_nothing_when_no_markers_overlap(result, tmp_path, monkeypatch):
    """Strategies far apart are drawn exactly at their figures, with no note about moved markers."""
    result.strategies = [s for s in result.strategies if s.name in ("none", "ac", "offload")]
    fig, ax, lines = _drawn(result, tmp_path, monkeypatch)
    for line in lines.values():
        assert (line.get_transform().transform(line.get_xydata()) == ax.transData.transform(line.get_xydata())).all()
    assert not any("apart" in t.get_text() for t in ax.texts)


def test_main_prints_the_short_table_and_full_on_request(capsys):
    """`python -m bench` prints the short table only; `--full` adds the detail tables."""
    argv = ["--dim", "32", "--layers", "1", "--seq", "16", "--batch", "1", "--vocab", "64", "--steps", "2",
            "--warmup", "0", "--strategies", "none,offload", "--quiet", "--no-write", "--no-probe"]
    assert cli.main(argv) == 0
    short = _tables(capsys.readouterr().out)
    assert [head for head, _ in short] == [list(SHORT_COLUMNS)] and [r[0] for r in short[0][1]] == ["none", "offload"]
    assert cli.main([*argv, "--full"]) == 0
    full = _tables(capsys.readouterr().out)
    assert full[0][0] == list(SHORT_COLUMNS) and len(full) == 3  # + all figures + engine accounting
