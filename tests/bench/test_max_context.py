"""bench.max_context (``python -m bench --predict --max-context``) on a tiny Llama: the fitted longest
context is the predictor's own answer (fits there, not one granule further), the phase peaks are the
prediction's peak, and the table says why a row does not fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench import max_context as mc  # noqa: E402
from offload.predict import GPUS, predict_step  # noqa: E402

SEQS = (1024, 2048, 3072)


def _tiny() -> mc.Workload:
    def model_fn(layers):
        def build():
            cfg = transformers.LlamaConfig(num_hidden_layers=layers or 2, hidden_size=256, intermediate_size=512,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                                           max_position_embeddings=1 << 16)
            cfg._attn_implementation = "sdpa"
            return transformers.LlamaForCausalLM(cfg)
        return build

    def step_fn(model, seq):
        tokens = torch.randint(0, 2048, (1, seq))
        return model(input_ids=tokens, labels=tokens).loss

    return mc.Workload("tiny", "tiny Llama", model_fn, step_fn)


@pytest.fixture
def tiny(monkeypatch):
    w = _tiny()
    monkeypatch.setitem(mc.WORKLOADS, "tiny", w)
    return w


@pytest.mark.parametrize("strategy", ["ac", "long_context"])
def test_fitted_context_is_the_predictors_answer(tiny, strategy):
    """Fit at three lengths, pick a budget, and the fitted longest context fits that budget when predicted
    directly while one granule more does not."""
    fit = mc.fit_workload(tiny, strategy, seqs=SEQS, cards=("h100-sxm",), progress=False)
    usable = int(fit.peak(5 * mc.GRANULARITY + mc.GRANULARITY // 2))
    seq, why = fit.longest(usable)
    assert seq == 5 * mc.GRANULARITY and why == ""
    gpu = dataclasses.replace(GPUS["h100-sxm"], memory_bytes=usable + GPUS["h100-sxm"].reserve_bytes)

    def predicted(s):
        return predict_step(tiny.model_fn(None), lambda m: tiny.step_fn(m, s), gpu=gpu, strategy=strategy,
                            optimizer=lambda p: torch.optim.AdamW(p))

    assert predicted(seq).fits and not predicted(seq + mc.GRANULARITY).fits


def test_phase_peaks_make_the_predicted_peak(tiny):
    """The larger of the forward+backward and optimizer-step peaks is the prediction's peak."""
    p = predict_step(tiny.model_fn(None), lambda m: tiny.step_fn(m, 1024), gpu="h100-sxm", strategy="none",
                     optimizer=lambda p: torch.optim.AdamW(p))
    peaks = mc.phase_peaks(p.trace)
    assert max(peaks.values()) == p.peak_bytes and peaks["optimizer"] > 0


def test_table_says_what_stops_a_row_and_the_tiers(tiny, tmp_path):
    """run_max_context on the tiny workload: every (card, strategy) has a row; a card too small says the
    peak it would need; offloading rows name the host tier and its rate; the verified row (when its
    workload is run) is predicted directly."""
    res = mc.run_max_context(workloads=("tiny",), strategies=("none", "long_context"), seqs=SEQS, verify=False,
                             progress=False, cards=("h100-sxm", "rtx-4090"))
    rows = {(r["card"], r["strategy"]): r for r in res["rows"]}
    assert len(rows) == 4
    lc = rows[("h100-sxm", "long_context")]
    assert lc["max_context"] > rows[("h100-sxm", "none")]["max_context"] > 0
    assert lc["runs_at"].startswith(("pinned", "pageable", "disk")) and lc["host_bytes"] > 0
    assert sum(lc["host_split"].values()) == lc["host_bytes"]
    text = mc.format_markdown(res)
    assert "PREDICTED" in text and "h100-sxm | long_context" in text
    small = mc.Fit("tiny", "none", list(SEQS), [10, 20, 30], 5 << 30, [0, 0, 0], [1.0, 2.0, 3.0])
    assert small.longest(4 << 30) == (0, "the optimizer step alone peaks at 5.0 GiB")


def test_host_split_follows_the_tiers_order():
    """Pinned first (half the RAM), then pageable (to 90 %), then disk."""
    h = mc.Host(100 << 30, "test")
    assert h.split(10 << 30) == {"pinned": 10 << 30, "pageable": 0, "disk": 0}
    s = h.split(120 << 30)
    assert s["pinned"] == 50 << 30 and s["pageable"] == int(90 * (1 << 30)) - (50 << 30) and \
        sum(s.values()) == 120 << 30


def test_committed_table_backs_the_readme():
    """The committed table predicts Llama-3.1-8B LoRA on h100-sxm at >= Unsloth's published 342,733 tokens, or
    docs/long-context.md says which resource stops it short (device memory, its per-token growth from the
    file's fit, the host memory it uses); its direct prediction fits, its host memory is named, and the README
    quotes the file's number."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    res = json.loads((root / "bench/results/predicted/max_context_llama3.1-8b.json").read_text())
    row = next(r for r in res["rows"] if (r["workload"], r["card"], r["strategy"]) == mc.VERIFY)
    assert sum(row["host_split"].values()) == row["host_bytes"] > 0
    assert res["verify"]["fits"] and res["verify"]["seq"] == row["max_context"]
    assert len(res["rows"]) == len(mc.CARDS) * len(mc.STRATEGIES) * len(mc.WORKLOADS)
    if row["max_context"] < 342_733:
        fit = next(f for f in res["fits"] if (f["workload"], f["strategy"]) == (mc.VERIFY[0], mc.VERIFY[2]))
        slope = (fit["step_peaks"][-1] - fit["step_peaks"][0]) / (fit["seqs"][-1] - fit["seqs"][0])
        doc = " ".join((root / "docs/long-context.md").read_text().split())
        assert (f"What stops it is device memory, not the host: the peak grows by {slope / 1024:.0f} KiB per token"
                in doc), doc
        assert f"the host holds {row['host_bytes'] / 2**30:.0f} GiB" in doc
    assert f"{row['max_context']:,}" in (root / "README.md").read_text()
