"""strategy="long_context" in offload.predict: the fake run is the real run (decisions, tiles, device peak),
and on a full-width Llama block the tiles and the head's exclusion lower the predicted peak below
offload_ac's."""

from __future__ import annotations

import pytest
import torch

from offload._long_context import long_context
from offload.predict import STRATEGIES, predict_step
from offload.predict._capture import capture
from offload.predict._memory import replay
from offload.predict._strategies import Applied

from predict_testkit import CASES, adamw, hf


def _small_tiles(model: torch.nn.Module) -> Applied:
    """long_context with tiles of 8 tokens, so the 2 x 16-token test step runs 4 tiles a layer."""
    handle = long_context(model, device="cpu", virtual_memory_safe_pct=None, mlp_tokens=8, loss_tokens=8)
    return Applied(handle.engine, [handle.remove])


@pytest.mark.parametrize("name", ["toy_llama", "hf_llama", "gpt_oss", "bloom"])
def test_fake_long_context_run_is_the_real_run(name):
    """Fake and real long_context steps: the same ledger records, tiling counts (the MLP's bytes measured on
    fake storages too) and device peak; GPT-OSS's MLP returns two tensors, Bloom's takes two."""
    model_fn, step_fn = CASES[name]() if name in CASES else hf(name)
    if name == "gpt_oss":  # (its experts' grouped matmul has a meta kernel for bf16 only)
        model_fn = (lambda f: lambda: f().to(torch.bfloat16))(model_fn)
    real = capture(model_fn, step_fn, strategy=_small_tiles, optimizer=adamw, fake=False)
    fake = capture(model_fn, step_fn, strategy=_small_tiles, optimizer=adamw, fake=True)
    assert fake.records and fake.records == real.records
    assert fake.ledger_summary["tiling"] == real.ledger_summary["tiling"]
    assert fake.ledger_summary["tiling"]["mlp"]["bytes_not_saved"] > 0
    assert replay(fake.trace).peak_bytes == replay(real.trace).peak_bytes


def test_long_context_is_a_named_strategy_that_lowers_the_peak():
    """predict_step(strategy="long_context") on Llama-3-8B's shapes (2 blocks, 16K tokens): a lower predicted
    peak than offload_ac, its tiles in the ledger, and no more offloaded (both keep the head on the device)."""
    presets = pytest.importorskip("offload.predict.presets")
    pytest.importorskip("transformers")
    model_fn = presets.preset_model_fn("llama3-8b", layers=2)
    step_fn = presets.preset_step_fn(128256)
    assert "long_context" in STRATEGIES
    p = {s: predict_step(model_fn, lambda m: step_fn(m, 16384), gpu="h100-sxm", strategy=s, dtype=torch.bfloat16)
         for s in ("offload_ac", "long_context")}
    lc, oac = p["long_context"], p["offload_ac"]
    assert lc.peak_bytes < oac.peak_bytes and lc.offloaded_bytes <= oac.offloaded_bytes
    tiling = lc.ledger_summary["tiling"]
    assert tiling["mlp"]["tiles"] == 2 * 4 and tiling["loss"]["calls"] == 1  # 16384 / 4096 tokens a tile
    assert tiling["mlp"]["bytes_not_saved"] == 2 * 4 * 16384 * 14336 * 2  # gate, act, up, product in bf16
