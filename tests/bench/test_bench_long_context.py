"""The bench's long_context strategy: tiled steps judged within the tolerance of reordered sums, which a
corrupted gradient still fails (bench.verdict.reordered_tolerance)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.harness import BenchConfig, run_bench
from bench.strategies import STRATEGIES, Prepared
from bench.verdict import Snapshot, compare, reordered_tolerance
from bench.workloads import PRESETS

WL = PRESETS["tiny"].replace(dim=32, n_heads=4, n_layers=2, seq_len=128, vocab_size=256, batch=1)


@pytest.mark.parametrize("deterministic_check", [False, True])
def test_long_context_is_within_tolerance_and_corruption_is_not(monkeypatch, deterministic_check):
    """long_context's loss and grads are within reordered_tolerance of none's (not bitwise: the tiles reorder
    sums), its engine offloaded and its ledger counts the tiles; the same strategy with one grad scaled by
    1.01 is reported beyond the tolerance."""
    base = STRATEGIES["long_context"]

    def corrupt(env):
        prepared = base.prepare(env)
        step = prepared.step

        def bad():
            loss = step()
            env.model.tok_embeddings.weight.grad.mul_(1.01)
            return loss

        return Prepared(step=bad, engine=prepared.engine, hooks=prepared.hooks)

    monkeypatch.setitem(STRATEGIES, "corrupt", dataclasses.replace(base, name="corrupt", prepare=corrupt))
    cfg = BenchConfig(workload=WL, strategies=("none", "long_context", "corrupt"), steps=1, warmup=0,
                      order="sequential", progress=False, deterministic_check=deterministic_check)
    by = {s.name: s for s in run_bench(cfg, {"device": "cpu"}).strategies}
    c = by["long_context"].correctness
    assert c.mode == "tolerance" and not c.bitwise_equal and c.within_noise, c
    assert c.verdict.startswith("within the tolerance")
    assert by["long_context"].engine.offloaded_bytes > 0
    bad = by["corrupt"].correctness
    assert bad.mode == "tolerance" and bad.within_noise is False and "DIFFERS" in bad.verdict


def test_reordered_tolerance_scales_with_the_dtype():
    """fp32: 64 epsilons; bf16: 4 of its own (coarser); a tensor off by order 1 is beyond either."""
    assert reordered_tolerance(torch.float32) == 64 * torch.finfo(torch.float32).eps
    assert reordered_tolerance(torch.bfloat16) == 4 * torch.finfo(torch.bfloat16).eps < 0.05
    ref = Snapshot(torch.tensor(1.0), [torch.ones(3)])
    assert not compare(ref, Snapshot(torch.tensor(1.0), [torch.tensor([1.0, 1.0, 2.0])]),
                       tolerance=reordered_tolerance(torch.bfloat16)).within_noise


@pytest.mark.slow  # ~30 s: the peak property is tests/offload/test_long_context.py's, the verdict the test above
def test_max_seq_long_context_trains_longer_than_ac_with_checked_grads():
    """--max-seq on the HF Llama at one budget (none's peak at the start length): long_context trains a
    longer sequence than ac and offload_ac, and each arm's loss and grads at its longest length check
    against none's (bitwise for ac and offload_ac, within the tolerance for long_context)."""
    pytest.importorskip("transformers")
    from bench.plan import run_max_seq

    wl = PRESETS["tiny"].replace(dim=32, n_heads=4, n_layers=2, seq_len=64, vocab_size=1024, batch=1)
    res = run_max_seq(wl, "cpu", arms=("ac", "offload_ac", "long_context"), model="hf_llama", check_grads=True,
                      max_doublings=1, progress=False)
    by = {r["arm"]: r for r in res["rows"]}
    assert by["long_context"]["max_seq"] > max(by["ac"]["max_seq"], by["offload_ac"]["max_seq"]), by
    assert by["ac"]["grads"] == by["offload_ac"]["grads"] == "bitwise equal"
    assert by["long_context"]["grads"].startswith("within the tolerance")
