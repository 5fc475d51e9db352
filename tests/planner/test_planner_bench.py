"""``python -m bench --plan`` / ``--max-seq`` on a very small workload: files, fit, predicted vs measured,
and torch's auto-AC ILP arm in the same output."""

from __future__ import annotations

import re

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
    spreads = res["profile_step_seconds"]  # each profiled decision's timed steps: what set the noise band
    assert {"keep", "offload", "recompute"} <= set(spreads) and res["noise_seconds"] >= max(
        d["max"] - d["min"] for d in spreads.values())
    # torch's auto-AC ILP arm: one point per budget, measured by the same meter, in the JSON and the md.
    ilp = res["ilp"]
    assert ilp["name"] == "torch_ilp" and ilp["status"] == "ok", ilp
    assert [p["fraction"] for p in ilp["points"]] == [0.25, 0.5, 0.75]
    assert {p["status"] for p in ilp["points"]} <= {"ok", "infeasible"}, ilp["points"]
    solved = [p for p in ilp["points"] if p["status"] == "ok"]
    assert solved, ilp["points"]
    for p in solved:
        assert p["decisions"] and p["measured_peak_bytes"] > 0 and p["measured_step_s"] > 0
        assert p["predicted_peak_bytes"] <= p["budget_bytes"]
    for p in ilp["points"]:
        if p["status"] == "infeasible":
            assert "sac_milp" in p["reason"] and "budget_bytes=" in p["reason"]
    md = (tmp_path / f"{stem}.md").read_text()
    assert "torch auto-AC ILP (`torch_ilp`" in md and len(re.findall(r"^\|\s*0\.50\s*\|", md, re.M)) == 2


def test_max_seq_planner_at_least_none() -> None:
    wl = PRESETS["tiny"].replace(dim=64, n_heads=1, n_layers=2, seq_len=32, vocab_size=128)
    res = run_max_seq(wl, "cpu", arms=("none", "planner"), max_doublings=1, progress=False)
    rows = {r["arm"]: r for r in res["rows"]}
    assert rows["none"]["max_seq"] == 32  # the budget is none's own peak at --seq
    assert rows["planner"]["max_seq"] >= 32
    assert rows["planner"]["peak_bytes"] <= res["budget_bytes"]


def test_bench_plan_other_models(tmp_path) -> None:
    """``--model``: the planner on models it was not built on; every planned point fits its budget (measured)
    and is compared with the fastest fixed arm that fits."""
    for model in ("encoder", "hf_gpt2"):
        out = tmp_path / model
        assert main(["--plan", "--model", model, *_SMALL, "--steps", "1", "--warmup", "1", "--no-plot",
                     "--out", str(out)]) == 0
        (path,) = out.glob("plan_*.json")
        assert path.name == f"plan_{model}_L3_s32_b2_float32.json"
        res = json.loads(path.read_text())
        assert res["model"] == model
        assert all(a["status"] == "ok" for a in res["arms"]), res["arms"]
        fitted = [p for p in res["planned"] if p["status"] == "ok"]
        assert fitted, res["planned"]
        for p in fitted:
            assert p["measured_peak_bytes"] <= p["budget_bytes"]
            assert p["vs_fastest_fixed"] in ("ok", "slower", "no fixed arm fits")
        for p in res["planned"]:
            if p["status"] != "ok":
                assert "budget_bytes=" in p["reason"] and "smallest peak" in p["reason"]
