"""bench.partial_offload: the predicted trade-off of offloading the first k blocks (docs/gpu-run.md cites it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import partial_offload as po
from bench.workloads import PRESETS

ROOT = Path(__file__).resolve().parents[2]
CITED = ROOT / "bench/results/predicted/partial_offload_8b_L32_s4096_h200.json"


@pytest.fixture(scope="module")
def tiny():
    wl = PRESETS["tiny"].replace(n_layers=3, seq_len=64)
    settings = {name: po.SETTINGS[name] for name in ("default (5 tensors, 1 GiB)", "bytes only, 4 GiB")}
    return po.frontier(wl, "h100-sxm", [0, 1, 2, 3], settings, progress=False)


def test_more_blocks_offloaded_move_more_bytes_and_none_is_the_reference(tiny):
    for name in ("default (5 tensors, 1 GiB)", "bytes only, 4 GiB"):
        rows = [r for r in tiny["rows"] if r["setting"] == name]
        assert [r["k"] for r in rows] == [0, 1, 2, 3]
        assert rows[0]["offloaded_bytes"] == 0
        assert rows[0]["step_vs_none"] == pytest.approx(1.0, abs=0.01)  # nothing moved: the step of none
        moved = [r["offloaded_bytes"] for r in rows]
        assert all(a < b for a, b in zip(moved, moved[1:])), moved
        for r in rows:
            assert r["step_vs_none"] == pytest.approx(r["step_seconds"] / tiny["none"]["step_seconds"])


def test_a_looser_bound_never_waits_longer_on_copies(tiny):
    """The forward waits for a copy only when a bound is reached: loosening the bound cannot add exposed
    copy time at the same k (a schedule property of the predicted timeline)."""
    by = {(r["setting"], r["k"]): r for r in tiny["rows"]}
    for k in (1, 2, 3):
        tight, loose = by[("default (5 tensors, 1 GiB)", k)], by[("bytes only, 4 GiB", k)]
        assert loose["exposed_copy_seconds"] <= tight["exposed_copy_seconds"] + 1e-9, (k, loose, tight)


def test_best_within_picks_the_most_bytes_under_the_ratio():
    rows = [{"setting": "s", "k": k, "offloaded_bytes": k * 10, "step_vs_none": r}
            for k, r in ((0, 1.0), (1, 1.01), (2, 1.029), (3, 1.2))]
    assert po.best_within(rows, "s")["k"] == 2
    assert po.best_within(rows, "s", ratio=1.005)["k"] == 0
    assert po.best_within(rows, "other") is None


def test_cli_writes_predicted_files_and_refuses_bad_block_counts(tmp_path, capsys):
    assert po.main(["--preset", "tiny", "--layers", "2", "--seq", "64", "--gpu", "h100-sxm", "--ks", "0,2",
                    "--out", str(tmp_path), "--quiet"]) == 0
    doc = json.loads((tmp_path / "partial_offload_tiny_L2_s64_h100-sxm.json").read_text())
    assert doc["kind"] == "predicted" and doc["command"].startswith("python -m bench.partial_offload")
    md = (tmp_path / "partial_offload_tiny_L2_s64_h100-sxm.md").read_text()
    assert "PREDICTED" in md and doc["gpu_spec"] in md
    assert po.main(["--preset", "tiny", "--layers", "2", "--ks", "0,3", "--no-write", "--quiet"]) == 2
    assert "--ks [3] outside 0..2" in capsys.readouterr().err


def test_cited_file_matches_a_fresh_prediction():
    """The committed 8B file (docs/gpu-run.md) against a fresh run of two of its points: predictions are
    deterministic (fake tensors, a simulated timeline), so every figure must be equal."""
    doc = json.loads(CITED.read_text())
    wl = PRESETS["8b"].replace(seq_len=doc["workload"]["seq_len"], n_layers=doc["workload"]["n_layers"])
    name = "bytes only, 4 GiB"
    fresh = po.frontier(wl, doc["gpu"], [4], {name: po.SETTINGS[name]}, progress=False)
    assert fresh["none"] == doc["none"]
    old = next(r for r in doc["rows"] if r["setting"] == name and r["k"] == 4)
    assert json.loads(json.dumps(fresh["rows"][0])) == old
