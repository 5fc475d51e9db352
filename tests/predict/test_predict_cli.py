"""`python -m bench --predict`: every strategy's prediction, labelled, written where --out says."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from bench import cli

STEM = "predict_gpt2-xl_h100-sxm_s128"


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    """One cheap --predict run (GPT-2 XL, 1 block, s=128): (stdout, JSON, markdown)."""
    out = tmp_path_factory.mktemp("predict")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["--predict", "--model", "gpt2-xl", "--layers", "1", "--seq", "128", "--batch", "2",
                       "--no-max-context", "--quiet", "--out", str(out)])
    assert rc == 0
    return buf.getvalue(), json.loads((out / f"{STEM}.json").read_text()), (out / f"{STEM}.md").read_text()


def test_predict_cli_writes_labelled_rows_per_strategy(predicted):
    """--predict on a preset prints and writes one PREDICTED row per strategy, with the command that made it."""
    stdout, data, md = predicted
    assert "PREDICTED on h100-sxm" in stdout
    assert data["kind"] == "predicted" and "--predict" in data["command"]
    assert data["gpu"] == "h100-sxm" and data["gpu_spec"].startswith("h100-sxm:")
    rows = {r["strategy"]: r for r in data["rows"]}
    assert list(rows) == ["none", "ac", "offload", "offload_ac"]
    assert all(r["kind"] == "predicted" and r["gpu"] == "h100-sxm" for r in rows.values())
    assert rows["offload"]["offloaded_bytes"] > 0 and rows["none"]["offloaded_bytes"] == 0
    assert md.count("PREDICTED") >= 2


def test_predict_cli_derives_throughput_and_overheads_from_the_predicted_step(predicted):
    """Per strategy: tokens/s is batch x seq over the predicted step, "vs none"/"vs ac" the ratio of predicted
    steps (so none is 1 vs itself and ac vs none is the inverse of none vs ac), and the time columns say
    "predicted" and name the GPU."""
    _, data, md = predicted
    rows = {r["strategy"]: r for r in data["rows"]}
    for r in rows.values():
        assert r["tokens_per_s"] == pytest.approx(2 * 128 / r["step_seconds"])
        assert r["step_vs_none"] == pytest.approx(r["step_seconds"] / rows["none"]["step_seconds"])
        assert r["step_vs_ac"] == pytest.approx(r["step_seconds"] / rows["ac"]["step_seconds"])
    assert rows["none"]["step_vs_none"] == 1.0
    assert rows["ac"]["step_vs_none"] * rows["none"]["step_vs_ac"] == pytest.approx(1.0)
    header = next(line for line in md.splitlines() if line.startswith("| strategy"))
    for col in ("predicted step s on h100-sxm", "predicted tokens/s", "predicted copies exposed s", "awaited at issue",
                "predicted step vs none", "predicted step vs ac", "predicted link GB/s"):
        assert col in header


def test_predict_cli_link_rate_hides_the_copies_that_can_hide(predicted):
    """link_bytes_per_s_needed is 0 without copies and a finite rate with them (a copy awaited at issue, as
    backward's first reload is, does not make it infinite: its stall is the floor, within the exposed time)."""
    _, data, _ = predicted
    rows = {r["strategy"]: r for r in data["rows"]}
    assert rows["none"]["link_bytes_per_s_needed"] == 0 and rows["ac"]["link_bytes_per_s_needed"] == 0
    for name in ("offload", "offload_ac"):
        r = rows[name]
        assert r["link_bytes_per_s_needed"] > 0 and "link_note" not in r
        assert 0 <= r["exposed_copy_floor_seconds"] <= r["exposed_at_issue_seconds"] <= r["exposed_copy_seconds"]


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


# -- issue 45 item 3: the command line where users start ---------------------------------------------------


def _run(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(argv)
    return rc, buf.getvalue()


def test_predict_cli_default_table_fits_100_columns_and_full_adds_every_column(predicted, capsys):
    """The default output is a narrow table (every line within bench.predict.WIDTH = 100 columns) labelled
    PREDICTED; --full prints the markdown table with every column, as the .md file has."""
    from bench.predict import WIDTH

    stdout, _, md = predicted
    assert "PREDICTED" in stdout and "offload_ac" in stdout
    assert max(len(line) for line in stdout.splitlines()) <= WIDTH, stdout
    full_header = next(line for line in md.splitlines() if line.startswith("| strategy"))
    assert full_header not in stdout
    rc, full = _run(["--predict", "--model", "gpt2-xl", "--layers", "1", "--seq", "128", "--strategies", "none",
                     "--no-max-context", "--quiet", "--no-write", "--full"])
    assert rc == 0 and full_header in full


def test_predict_cli_draws_peak_and_step_per_strategy_next_to_the_table(predicted, tmp_path):
    """A PNG of the predicted peak and step per strategy lies next to the .md (which shows it) under --out."""
    out = tmp_path / "p"
    rc, _ = _run(["--predict", "--model", "gpt2-xl", "--layers", "1", "--seq", "128", "--strategies", "none,ac",
                  "--no-max-context", "--quiet", "--out", str(out)])
    png = out / f"{STEM}.png"
    assert rc == 0 and png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({png.name})" in (out / f"{STEM}.md").read_text()


def test_predict_cli_honours_strategies():
    """--strategies with --predict predicts exactly those strategies, in that order; an unknown one exits 2
    naming the valid ones."""
    rc, out = _run(["--predict", "--model", "gpt2-xl", "--layers", "1", "--seq", "128", "--strategies",
                    "offload_ac,ac", "--no-max-context", "--quiet", "--no-write"])
    rows = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in
            ("none", "ac", "offload", "offload_ac", "long_context")]
    assert rc == 0 and rows == ["offload_ac", "ac"], out
    rc, _ = _run(["--predict", "--model", "gpt2-xl", "--strategies", "ac,nope", "--no-write"])
    assert rc == 2


def test_predict_cli_writes_a_chrome_trace_per_strategy(tmp_path):
    """--predict-trace PATH (or --trace PATH with --predict) writes the predicted timeline as a Chrome trace: at
    PATH for one strategy, at PATH_<strategy>.json for several."""
    base = ["--predict", "--model", "gpt2-xl", "--layers", "1", "--seq", "128", "--no-max-context", "--quiet",
            "--no-write"]
    one = tmp_path / "one.json"
    assert _run([*base, "--strategies", "offload", "--predict-trace", str(one)])[0] == 0
    events = json.loads(one.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)
    assert _run([*base, "--strategies", "none,offload", "--trace", str(tmp_path / "t.json")])[0] == 0
    assert {p.name for p in tmp_path.glob("t_*.json")} == {"t_none.json", "t_offload.json"}


def test_llama31_preset_goes_past_8192_tokens_and_a_config_json_path_is_a_model(tmp_path):
    """llama3.1-8b is Llama-3.1-8B's config (llama3 RoPE scaling, 131072 positions), so --seq 16384 runs where
    llama3-8b (8192 positions) is refused; a Hugging Face config.json path (or its folder) is a model too,
    named by its folder."""
    from offload.predict.presets import model_config

    cfg = model_config("llama3.1-8b")
    assert cfg.max_position_embeddings == 131072 and cfg.rope_scaling["rope_type"] == "llama3"
    base = ["--seq", "16384", "--strategies", "ac", "--layers", "1", "--no-max-context", "--quiet"]
    assert _run(["--predict", "--model", "llama3-8b", *base, "--no-write"])[0] == 2
    rc, out = _run(["--predict", "--model", "llama3.1-8b", *base, "--no-write"])
    assert rc == 0 and "s=16384" in out
    folder = tmp_path / "My-Llama"
    small = model_config("llama3.1-8b")
    small.hidden_size, small.intermediate_size, small.num_attention_heads, small.num_key_value_heads = 256, 512, 4, 2
    small.save_pretrained(folder)
    for model in (folder / "config.json", folder):
        rc, _ = _run(["--predict", "--model", str(model), *base, "--out", str(tmp_path / "o")])
        data = json.loads((tmp_path / "o" / "predict_My-Llama_h100-sxm_s16384.json").read_text())
        assert rc == 0 and data["model"] == str(model) and [r["strategy"] for r in data["rows"]] == ["ac"]
    assert _run(["--predict", "--model", str(tmp_path / "missing.json"), "--no-write"])[0] == 2


def test_predict_without_transformers_names_the_extra(monkeypatch, capsys):
    """Without transformers, --predict exits 2 naming the extra that installs it (not a bare "No module named
    transformers"), as docs/predict.md does; the presets module from Python names it too."""
    from pathlib import Path

    from offload.predict import presets

    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # as if not installed
    assert cli.main(["--predict", "--model", "llama3.1-8b", "--no-write"]) == 2
    err = capsys.readouterr().err
    command = 'pip install -e ".[bench,hf]"'
    assert command in err, err
    assert command in (Path(__file__).resolve().parents[2] / "docs" / "predict.md").read_text()
    with pytest.raises(ImportError, match=r"offload\[hf\]"):
        presets.preset_config("llama3.1-8b")


def _rows(tmp_path, *extra: str) -> list[dict]:
    """The rows of one cheap --predict run (GPT-2 XL, 1 block, s=128) with ``extra`` arguments."""
    out = tmp_path / ("_".join(extra) or "default")
    args = ["--predict", "--model", "gpt2-xl", "--layers", "1", "--seq", "128", "--no-max-context", "--quiet",
            "--out", str(out), *extra]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(args) == 0
    (path,) = out.glob("*.json")
    return json.loads(path.read_text())["rows"]


def test_predict_cli_mixed_precision_keeps_fp32_state(tmp_path):
    """--mixed-precision bf16 predicts fp32 parameters and AdamW state (twice the default bf16 run's) with the
    compute in bf16, and every row names the regime."""
    pure = {r["strategy"]: r for r in _rows(tmp_path)}
    mixed = {r["strategy"]: r for r in _rows(tmp_path, "--mixed-precision", "bf16")}
    for name, r in mixed.items():
        assert "mixed bf16" in r["precision"] and "mixed" not in pure[name]["precision"]
        for kind in ("parameter", "optimizer"):
            assert r["state_bytes"][kind] == pytest.approx(2 * pure[name]["state_bytes"][kind], rel=1e-6)


def test_predict_cli_lora_trains_the_adapters_only(tmp_path):
    """--lora 4 predicts peft LoRA r=4 on the blocks' linear layers: AdamW state for the adapters only (a small
    fraction of the full fine-tune's), the base frozen."""
    pytest.importorskip("peft")
    full = {r["strategy"]: r for r in _rows(tmp_path)}
    lora = {r["strategy"]: r for r in _rows(tmp_path, "--lora", "4")}
    for name, r in lora.items():
        assert 0 < r["state_bytes"]["optimizer"] < 0.05 * full[name]["state_bytes"]["optimizer"]
        assert 0 < r["state_bytes"]["gradient"] < 0.05 * full[name]["state_bytes"]["gradient"]


def test_predict_cli_reads_gpu_spellings_and_refuses_unknown_ones(tmp_path, capsys):
    """--gpu h100sxm is h100-sxm; --gpu h100 exits 2 naming both H100 variants (no traceback)."""
    rows = _rows(tmp_path, "--gpu", "h100sxm")
    assert all(r["gpu"] == "h100-sxm" for r in rows)
    assert cli.main(["--predict", "--model", "gpt2-xl", "--gpu", "h100", "--no-write"]) == 2
    err = capsys.readouterr().err
    assert "'h100-sxm' or 'h100-pcie'" in err and "Traceback" not in err


def test_predict_cli_longest_context_search_reports_progress_and_its_time(tmp_path, capsys):
    """Each probe of the longest-context search is a progress line on stderr (not in the table on stdout), and
    "prediction took" includes the search."""
    out = tmp_path / "o"
    with contextlib.redirect_stdout(io.StringIO()) as buf:
        assert cli.main(["--predict", "--model", "gpt2-xl", "--layers", "1", "--seq", "512", "--gpu", "rtx-4090",
                         "--full", "--out", str(out)]) == 0
    rows = json.loads(next(out.glob("*.json")).read_text())["rows"]
    err = capsys.readouterr().err
    assert err.count("max_context on rtx-4090") >= len(rows) and "max_context on" not in buf.getvalue()
    for r in rows:
        took = float(next(line for line in buf.getvalue().splitlines() if line.startswith(f"| {r['strategy']} |"))
                     .rstrip(" |").rsplit("|", 1)[1])
        assert took >= r["max_context_seconds"] > 0


def test_predict_cli_refuses_a_lora_rank_below_one(capsys):
    """--lora 0 exits 2 naming the argument and a usual rank, before any prediction (no traceback)."""
    assert cli.main(["--predict", "--model", "gpt2-xl", "--lora", "0", "--no-write"]) == 2
    err = capsys.readouterr().err
    assert "--lora 0 must be a LoRA rank >= 1" in err and "Traceback" not in err
