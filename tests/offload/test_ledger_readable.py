"""A step and a summary print as one readable line; ledger.report() is a small table by decision and
kept reason (and by tier when the summary has tiers); trainers' logs carry the per-reason breakdown."""

from __future__ import annotations

import json
import re

import pytest
import torch

from offload import OffloadActivations, StepTotals
from offload._format import format_bytes
from offload.integrations import FIGURE_KEYS, step_figures


def _engine_after_steps(steps: int = 2) -> OffloadActivations:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.LayerNorm(64))
    ctx = OffloadActivations(device="cpu", min_offload_size=1024)
    for _ in range(steps):
        x = torch.randn(32, 64)
        with ctx:
            loss = model(x).sum() + model(x[:1]).sum()  # small tensors: too_small; weights: parameter
        loss.backward()
    return ctx


def test_step_totals_print_as_one_line_naming_every_reason():
    """str(StepTotals) is one short line with the packed, offloaded and kept bytes and every reason that
    kept bytes; repr stays the full dataclass for debugging."""
    t = _engine_after_steps().ledger.step_totals[-1]
    line = str(t)
    assert "\n" not in line and len(line) < 400 and line.startswith(f"step {t.step}:")
    for nbytes in (t.packed_bytes, t.offloaded_bytes, t.kept_bytes):
        assert format_bytes(nbytes) in line
    reasons = [r for r, b in t.kept_by_reason.items() if b]
    assert len(reasons) >= 2 and all(f"{r} {format_bytes(t.kept_by_reason[r])}" in line for r in reasons)
    assert f"{t!r}".startswith("StepTotals(")


def test_summary_is_a_dict_that_prints_as_one_line():
    """ledger.summary() keeps its dict contract (JSON-ready, same keys) and prints as one line."""
    s = _engine_after_steps().ledger.summary()
    assert isinstance(s, dict) and json.loads(json.dumps(s)) == dict(s)
    line = str(s)
    assert "\n" not in line and line.startswith(f"{s['steps']} steps:") and format_bytes(s["packed_bytes"]) in line


@pytest.mark.parametrize("fmt", ["simple", "github"])
def test_report_is_a_table_by_reason_that_adds_up(fmt):
    """report(): a row for offloaded, one per kept reason, and the total; the shares add up to 100%."""
    ctx = _engine_after_steps()
    s, text = ctx.ledger.summary(), ctx.ledger.report(fmt)
    text = text.split("by host tier", 1)[0]  # the tier table (issue 25's tiers) is checked below
    rows = [line for line in text.splitlines() if re.search(r"\d+\.\d%", line)]
    names = [re.split(r"\s{2,}|\|", line.strip(" |"))[0].strip() for line in rows]
    assert names[0] == "offloaded" and names[-1] == "packed (total)"
    assert {n.removeprefix("kept: ") for n in names[1:-1]} == {r for r, b in s["kept_by_reason"].items() if b}
    shares = [float(re.findall(r"(\d+\.\d)%", line)[-1]) for line in rows[:-1]]
    assert sum(shares) == pytest.approx(100.0, abs=0.1 * len(shares))
    if fmt == "github":
        assert all(line.startswith("|") for line in text.splitlines()[1:] if line.strip())


def test_report_has_a_tier_table_when_the_summary_has_tiers(monkeypatch):
    """Generic over a ``tiers`` mapping (host tiers): one row per tier, numbers or mappings of numbers."""
    ctx = _engine_after_steps(1)
    summary = ctx.ledger.summary
    tiers = {"pinned": {"bytes": 3 << 20, "count": 4}, "pageable": {"bytes": 1 << 20, "count": 1},
             "disk": {"bytes": 0, "count": 0}}
    monkeypatch.setattr(ctx.ledger, "summary", lambda *a, **k: type(summary())({**summary(), "tiers": tiers}))
    text = ctx.ledger.report()
    table = text.split("by host tier", 1)[1]
    assert all(name in table for name in tiers) and "3.00 MiB" in table
    assert "tiers pinned 3.00 MiB" in str(ctx.ledger.summary())


def test_trainer_figures_carry_the_kept_reasons():
    """step_figures: the fixed keys, then offload/kept_bytes/<reason> for each reason that kept bytes,
    summing to kept_bytes."""
    t = _engine_after_steps().ledger.step_totals[-1]
    figures = step_figures(t)
    assert list(figures)[:len(FIGURE_KEYS)] == list(FIGURE_KEYS)
    per_reason = {k.rsplit("/", 1)[1]: v for k, v in figures.items() if k.startswith("offload/kept_bytes/")}
    assert per_reason == {r: b for r, b in t.kept_by_reason.items() if b}
    assert sum(per_reason.values()) == figures["offload/kept_bytes"]
    assert step_figures(StepTotals(step=0))["offload/kept_bytes"] == 0


def test_engine_needs_no_table_library():
    """Without tabulate (a GPU machine with no package registry), offload imports, offloads and prints a
    step's line; only a table asks for it, naming the install."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['tabulate'] = None\n"
            "import torch, offload\n"
            "ctx = offload.OffloadActivations(device='cpu', min_offload_size=0)\n"
            "m = torch.nn.Linear(8, 8)\n"
            "with ctx:\n    loss = m(torch.randn(4, 8)).sum()\n"
            "loss.backward()\nprint(ctx.ledger.step_totals[-1])\n"
            "try:\n    ctx.ledger.report()\nexcept ImportError as e:\n    print('report:', e)\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 0: packed" in proc.stdout and "report: offload: printing a table needs tabulate" in proc.stdout
