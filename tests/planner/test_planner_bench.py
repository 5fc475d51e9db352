"""``python -m bench --plan`` / ``--max-seq`` on a very small workload: files, fit, predicted vs measured."""

from __future__ import annotations

import json

from bench.cli import main
from bench.plan import run_max_seq
from bench.workloads import PRESETS

_SMALL = ["--preset", "tiny", "--dim", "64", "--layers", "3", "--seq", "32", "--vocab", "128", "--quiet"]


def test_bench_plan_writes_table_json_png(tmp_path) -> None:
    assert main(["--plan", *_SMALL, "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]) == 0
    stem = "plan_tiny_L3_s32_b2_float32"
    res = json.loads((tmp_path / f"{stem}.json").read_text())
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
    assert "| budget" in (tmp_path / f"{stem}.md").read_text()
    assert {a["name"] for a in res["arms"]} == {"none", "ac", "sac", "offload", "offload_ac"}
    assert all(a["status"] == "ok" for a in res["arms"])
    fitted = [p for p in res["planned"] if p["status"] == "ok"]
    assert [p["fraction"] for p in res["planned"]] == [0.25, 0.5, 0.75]
    assert fitted, res["planned"]
    for p in fitted:
        assert p["measured_peak_bytes"] <= p["budget_bytes"]
        assert abs(p["peak_error"]) <= 0.10


def test_max_seq_planner_at_least_none() -> None:
    wl = PRESETS["tiny"].replace(dim=64, n_heads=1, n_layers=2, seq_len=32, vocab_size=128)
    res = run_max_seq(wl, "cpu", arms=("none", "planner"), max_doublings=1, progress=False)
    rows = {r["arm"]: r for r in res["rows"]}
    assert rows["none"]["max_seq"] == 32  # the budget is none's own peak at --seq
    assert rows["planner"]["max_seq"] >= 32
    assert rows["planner"]["peak_bytes"] <= res["budget_bytes"]
