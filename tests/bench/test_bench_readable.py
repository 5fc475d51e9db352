"""The bench's output reads right on the device it ran on: columns that do not apply are left out with
one line why, no ratio to a ceiling that does not bound the copies, a progress bar whose total is right
from its first tick with nothing printed through it, and a plot whose labels cannot overlap."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from bench.harness import BenchConfig, cpu_memory_profile, run_bench
from bench.report import format_tables, write_markdown, write_png
from bench.results import Ceiling
from bench.workloads import PRESETS

WL = PRESETS["tiny"].replace(dim=32, n_heads=1, n_layers=1, seq_len=16, batch=1, vocab_size=64)
STRATEGIES = ("none", "offload", "offload_sync", "compile", "trl", "save_on_cpu")


@pytest.fixture(scope="module")
def cpu_result():
    cfg = BenchConfig(workload=WL, strategies=STRATEGIES, steps=2, warmup=1, progress=False)
    ceiling = Ceiling(kind="memcpy", d2h_gb_s=0.01, h2d_gb_s=0.01, size_bytes=64 << 20, note="cpu memcpy, 64 MB")
    return run_bench(cfg, {"device": "cpu", "device_name": "cpu"}, ceiling=ceiling)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU report")
def test_cpu_report_leaves_out_what_does_not_apply_saying_why_once(cpu_result, tmp_path):
    """No column of dashes (peak device memory), no '% of ceiling' (a tiny ceiling would give >100%), and
    one line naming each left-out column with its reason, in the full stdout report and in the markdown."""
    text = format_tables(cpu_result, full=True)
    write_markdown(cpu_result, tmp_path / "r.md", "r.json", None)
    for out in (text, (tmp_path / "r.md").read_text()):
        header_lines = [line for line in out.splitlines() if line.lstrip("| ").startswith("strategy")]
        assert header_lines and not any("peak alloc" in h or "of ceiling" in h for h in header_lines)
        (why,) = [line for line in out.splitlines() if line.startswith("Not shown on cpu:")]
        assert "peak alloc MiB (" in why and "of ceiling (" in why
        assert not [p for p in re.findall(r"(\d+)%", out) if int(p) > 100], "a ratio above 100% on CPU"


def test_progress_total_is_right_from_the_first_tick(capsys):
    """GPU-only strategies are skipped (and said so) before the bar starts: every total it shows is the
    same, equal to the steps that ran, and no note line interrupts it."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU skip path")
    cfg = BenchConfig(workload=WL, strategies=("none", "compile", "trl", "offload"), steps=2, warmup=1,
                      progress=True)
    result = run_bench(cfg, {"device": "cpu"})
    err = capsys.readouterr().err
    totals = {int(t) for t in re.findall(r"\d+/(\d+) \[", err)}
    assert totals == {2 * (1 + 2 + 1)}, totals
    first_bar = err.index("bench:")
    for name in ("compile", "trl"):
        assert result.get(name).status == "skipped"
        assert err.index(f"{name}: skipped") < first_bar


def test_profiled_step_prints_no_kineto_lines(capfd):
    """Kineto's 'USDT: ... profiler_start/stop' lines (written to fd 2 by C++) do not reach stderr; other
    output of the step does."""
    def step():
        torch.randn(64, 64, requires_grad=True).sum().backward()
        print("kept line", file=sys.stderr)

    cpu_memory_profile(step)
    err = capfd.readouterr().err
    assert "USDT" not in err and "kept line" in err


def test_plot_labels_every_strategy_once_with_axis_titles_and_direction(cpu_result, tmp_path, monkeypatch):
    """The PNG names each plotted strategy once, in a legend (never overlapping), its axes say what is
    counted, and an arrow says which way is better."""
    plt = pytest.importorskip("matplotlib.pyplot")
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    assert write_png(cpu_result, tmp_path / "p.png")
    (ax,) = figs[0].axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(labels) == sorted(s.name for s in cpu_result.strategies if s.ok)
    assert "MiB" in ax.get_xlabel() and "host copies" in ax.get_xlabel() and "ms" in ax.get_ylabel()
    assert any(t.get_text() == "better" for t in ax.texts)
