"""`python -m bench --predict`: every strategy's prediction, labelled, written where --out says."""

from __future__ import annotations

import json

from bench import cli


def test_predict_cli_writes_labelled_rows_per_strategy(tmp_path, capsys):
    """--predict on a preset prints and writes one PREDICTED row per strategy, with the command that made it."""
    rc = cli.main(["--predict", "--model", "gpt2-xl", "--layers", "1", "--seq", "128", "--no-max-context",
                   "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "PREDICTED on h100-sxm" in out
    data = json.loads((tmp_path / "predict_gpt2-xl_h100-sxm_s128.json").read_text())
    assert data["kind"] == "predicted" and "--predict" in data["command"]
    rows = {r["strategy"]: r for r in data["rows"]}
    assert list(rows) == ["none", "ac", "offload", "offload_ac"]
    assert all(r["kind"] == "predicted" and r["gpu"] == "h100-sxm" for r in rows.values())
    assert rows["offload"]["offloaded_bytes"] > 0 and rows["none"]["offloaded_bytes"] == 0
    assert (tmp_path / "predict_gpt2-xl_h100-sxm_s128.md").read_text().count("PREDICTED") >= 2


def test_predict_cli_refuses_a_model_that_is_not_a_preset(capsys):
    """--predict with a non-preset --model exits 2 naming the presets."""
    assert cli.main(["--predict", "--model", "toy", "--no-write"]) == 2
    assert "llama3-8b" in capsys.readouterr().err


def test_predict_cli_world_size_predicts_one_rank(tmp_path, capsys):
    """--world-size 4 predicts one FSDP2 rank: labelled so, written under its own name, a smaller peak than 1 GPU."""
    base = ["--predict", "--model", "gpt2-xl", "--layers", "2", "--seq", "128", "--no-max-context", "--quiet",
            "--out", str(tmp_path)]
    assert cli.main(base) == 0 and cli.main(base + ["--world-size", "4"]) == 0
    assert "one rank of FSDP2 over 4 GPUs" in capsys.readouterr().out
    one = json.loads((tmp_path / "predict_gpt2-xl_h100-sxm_s128.json").read_text())["rows"]
    four = json.loads((tmp_path / "predict_gpt2-xl_h100-sxm_s128_x4.json").read_text())["rows"]
    assert all(r["world_size"] == 4 for r in four) and all(r["world_size"] == 1 for r in one)
    for a, b in zip(one, four):
        assert b["peak_bytes"] < a["peak_bytes"], (a["strategy"], a["peak_bytes"], b["peak_bytes"])
