"""bench/predicted_vs_measured.py: a measured bench JSON next to offload.predict's numbers for the same
workload, per strategy. A tiny CPU bench run stands in for the GPU one (its device mapped with --gpu)."""

from __future__ import annotations

import json

import pytest

from bench import cli
from bench import predicted_vs_measured as pvm

STRATS = ("none", "ac", "offload", "offload_ac", "sac")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A tiny CPU bench results JSON (1 block, h=32, s=16, 1 step) with four predictable strategies and sac."""
    out = tmp_path_factory.mktemp("measured")
    rc = cli.main(["--seq", "16", "--strategies", ",".join(STRATS), "--steps", "1", "--warmup", "0", "--dim", "32",
                   "--layers", "1", "--vocab", "64", "--no-probe", "--no-plot", "--quiet", "--no-predict",
                   "--out", str(out)])
    assert rc == 0
    (path,) = out.glob("tiny_*.json")
    return path


@pytest.fixture(scope="module")
def compared(measured):
    """The comparison written by the CLI, as gpu_run.sh's predict phase runs it (--results DIR)."""
    assert pvm.main(["--results", str(measured.parent), "--gpu", "h100-sxm", "--quiet"]) == 0
    out = measured.parent / "predicted_vs_measured.json"
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_every_measured_strategy_is_there_and_every_predictable_one_on_both_sides(compared, measured):
    """Each strategy the bench ran appears once; none/ac/offload/offload_ac carry a measured and a predicted
    side for the same workload on the named GPU spec; one offload.predict has no model of says so."""
    data, md = compared
    assert data["kind"] == "predicted_vs_measured"
    (f,) = data["files"]
    assert f["measured_file"] == measured.name and f["gpu"] == "h100-sxm" and f["gpu_from"] == "--gpu"
    assert f["workload"]["dim"] == 32 and f["workload"]["seq_len"] == 16 and f["workload"]["n_layers"] == 1
    assert list(f["strategies"]) == list(STRATS)
    for name in STRATS[:4]:
        r = f["strategies"][name]
        assert r["measured"]["status"] == "ok" and r["predicted"]["status"] == "ok", r
        assert r["predicted"]["step_seconds"] > 0 and r["predicted"]["peak_allocated_bytes"] > 0
        assert r["predicted"]["assumptions"]
    assert f["strategies"]["sac"]["predicted"] is None and "sac" in f["strategies"]["sac"]["not_predicted"]
    assert "PREDICTED on h100-sxm" in md and all(f"| {name} |" in md for name in STRATS[:4])


def test_ratios_are_predicted_over_measured_where_both_exist(compared):
    """Every ratio is predicted / measured, and null exactly where a side is missing or the measured is 0."""
    (f,) = compared[0]["files"]
    for r in f["strategies"].values():
        for metric in pvm.METRICS:
            p, m = (r["predicted"] or {}).get(metric), r["measured"].get(metric)
            if p is None or not m:
                assert r["ratio"][metric] is None, (metric, r)
            else:
                assert r["ratio"][metric] == pytest.approx(p / m), (metric, r)


def test_the_engine_offloads_the_same_bytes_predicted_and_measured(compared):
    """The engine on fake tensors makes the real run's decisions: offloaded bytes agree exactly (ratio 1)."""
    (f,) = compared[0]["files"]
    for name in ("offload", "offload_ac"):
        r = f["strategies"][name]
        assert r["measured"]["offloaded_bytes"] > 0 and r["ratio"]["offloaded_bytes"] == 1.0, r


def test_device_names_map_to_gpu_specs_and_an_unknown_one_is_an_error_naming_it():
    """'NVIDIA H100 80GB HBM3' is h100-sxm and 'NVIDIA H200' is h200; every mapped spec exists; an unknown
    device (the CPU, without --gpu) is refused naming the device and the fix."""
    from offload.predict import GPUS

    assert pvm.gpu_for_device("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert pvm.gpu_for_device("NVIDIA H200") == "h200"
    assert set(pvm.DEVICE_GPUS.values()) <= set(GPUS)
    with pytest.raises(pvm.PredictedVsMeasuredError, match=r"'cpu'.*--gpu"):
        pvm.gpu_for_device("cpu")
    with pytest.raises(pvm.PredictedVsMeasuredError, match="h100-sxm"):
        pvm.gpu_for_device("NVIDIA H100 80GB HBM3", "h100")


def test_cli_refuses_a_cpu_run_without_gpu_and_a_folder_without_bench_results(measured, tmp_path, capsys):
    """Exit 2 with the reason: the CPU run's device has no spec; an empty folder has no bench JSON."""
    assert pvm.main([str(measured), "--out", str(tmp_path / "x.json"), "--quiet"]) == 2
    assert "'cpu'" in capsys.readouterr().err
    assert pvm.main(["--results", str(tmp_path)]) == 2
    assert "no bench results JSON" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
