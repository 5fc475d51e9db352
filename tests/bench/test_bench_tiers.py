"""python -m bench --tiers and --max-seq --host-budget: they run, write table / JSON / PNG, and their
numbers reconcile (every copied byte in one tier; host-only arms never touch the disk)."""

from __future__ import annotations

import json

import pytest

from bench import cli

SMALL = ["--seq", "32", "--layers", "2", "--dim", "64", "--vocab", "128", "--quiet"]


def test_tiers_bench_writes_table_json_and_plot(tmp_path):
    """Every arm reconciles; budgets split the copies as configured; files are written to --out."""
    out = tmp_path / "out"
    assert cli.main(["--tiers", "--steps", "2", "--warmup", "1", "--out", str(out), *SMALL]) == 0
    (jp,) = out.glob("tiers_*.json")
    res = json.loads(jp.read_text())
    rows = {r["arm"]: r for r in res["rows"]}
    assert set(rows) == {"host_only", "host_only@25", "host_only@50", "disk@25", "disk@50"}
    assert all(r["reconciled"] for r in rows.values())
    step = res["step_copied_bytes"]
    assert rows["host_only"]["tiers_per_step"]["pool"]["bytes"] == step
    for arm in ("disk@25", "disk@50", "host_only@25", "host_only@50"):
        t = rows[arm]["tiers_per_step"]
        assert t["pool"]["bytes"] <= rows[arm]["settings"]["host_budget_bytes"], arm
    for arm in ("disk@25", "disk@50"):
        t = rows[arm]["tiers_per_step"]
        assert t["disk"]["bytes"] > 0 and rows[arm]["kept_host_budget_bytes_per_step"] == 0, arm
        assert rows[arm]["disk"]["write_gb_s"] > 0
    assert rows["host_only@25"]["tiers_per_step"]["disk"]["bytes"] == 0
    assert res["target"]["ratio"] > 0 and "disk_probe" in res
    assert (out / jp.name.replace(".json", ".png")).exists()
    assert "x host_only" in (out / jp.name.replace(".json", ".md")).read_text()


def test_max_seq_with_host_budget_compares_disk(tmp_path):
    """--max-seq --host-budget: three arms; the disk tier never trains a shorter sequence."""
    out = tmp_path / "out"
    assert cli.main(["--max-seq", "--host-budget", "0.25", "--out", str(out), *SMALL]) == 0
    (jp,) = out.glob("maxseq_host_*.json")
    rows = {r["arm"]: r for r in json.loads(jp.read_text())["rows"]}
    assert set(rows) == {"none", "offload_host_only", "offload_host_disk"}
    assert (rows["offload_host_disk"]["max_seq"] or 0) >= (rows["offload_host_only"]["max_seq"] or 0)


@pytest.mark.parametrize("option", ["--host-budget", "--budget-mib"])
def test_budget_options_read_mib_or_a_size_with_a_unit(option, capsys):
    """A bare number stays MiB; a string with a unit goes through offload's size parser (exact decimal);
    an ambiguous unit, zero or a non-number exits 2 naming the option and the accepted forms."""
    dest = {"--host-budget": "host_budget_bytes", "--budget-mib": "budget_bytes"}[option]
    for text, nbytes in [("0.25", 1 << 18), ("512", 512 << 20), ("2GB", 2_000_000_000), ("4.1GB", 4_100_000_000),
                         ("1.5GiB", 3 << 29), ("512 MiB", 512 << 20)]:
        assert getattr(cli.parse_args([option, text]), dest) == nbytes, text
    assert getattr(cli.parse_args([]), dest) is None
    for bad in ("16G", "0", "-1", "lots", "nan"):
        with pytest.raises(SystemExit) as e:
            cli.parse_args([option, bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and option in err and "GB" in err and "MiB" in err, (bad, err)
