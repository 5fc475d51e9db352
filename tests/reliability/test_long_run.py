"""Long runs with changing sequence lengths: bounded pool, flat RSS, reconciled ledger, exact grads.

The sequence length changes every step (so buffer sizes change and the
capped pool has to evict and reuse), the host budget is below what the
longest step would like to offload (so ``host_budget`` keeps happen too), and
every step is compared bitwise with a no-offload twin trained alongside.
The CI version runs 50 steps; the 1,000-step soak is marked ``slow``.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from torch import nn

from ._common import CFG, assert_ledger_consistent, grads_of, make_batch, make_model, rss_bytes, train_step, twin

SEQ_LENS = (8, 13, 16, 24, 31, 40, 48, 64)
RSS_SLACK_BYTES = 48 * 2**20
"""Allowed RSS growth after warm-up: allocator noise on a model whose activations are ~1 MiB."""


def _engine(device: torch.device, **kw):
    from offload import OffloadActivations

    return OffloadActivations(device="cpu" if device.type == "cpu" else None, min_offload_size=0, **kw)


def _offloadable_bytes(model: nn.Module, device: torch.device) -> int:
    """Bytes the pool receives for one step at the longest sequence, with no budget."""
    probe = _engine(device)
    train_step(twin(model), make_batch(CFG, 2, max(SEQ_LENS), device=device), probe)
    return probe.pool.stats()["received_bytes"]


def run_long(steps: int, device: torch.device, warmup: int) -> None:
    model = make_model().to(device)
    ref = twin(model)
    cap = int(0.6 * _offloadable_bytes(model, device))
    ctx = _engine(device, host_budget_bytes=cap, on_host_budget="keep")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    rng = random.Random(0)
    peak_reserved = 0
    rss_warm = None
    dev_warm = None
    for step in range(steps):
        batch = make_batch(CFG, 2, rng.choice(SEQ_LENS), device=device, seed=step)
        loss_ref = train_step(ref, batch)
        loss = train_step(model, batch, ctx)
        assert torch.equal(loss, loss_ref), f"step {step}: loss differs"
        got, want = grads_of(model), grads_of(ref)
        for name in want:
            assert torch.equal(got[name], want[name]), f"step {step}: grad of {name} differs"
        opt.step(), opt_ref.step()
        opt.zero_grad(set_to_none=True), opt_ref.zero_grad(set_to_none=True)
        stats = ctx.pool.stats()
        peak_reserved = max(peak_reserved, stats["reserved_bytes"])
        assert stats["reserved_bytes"] <= cap, f"step {step}: pool reserved {stats['reserved_bytes']} > cap {cap}"
        assert stats["in_use_bytes"] == 0, f"step {step}: {stats['in_use_bytes']} bytes still in use after backward"
        if step == warmup - 1:
            gc.collect()
            rss_warm = rss_bytes()
            if device.type == "cuda":
                torch.cuda.synchronize()
                dev_warm = torch.cuda.memory_allocated(device)
    gc.collect()
    rss_end = rss_bytes()
    growth = rss_end - rss_warm
    print(f"\n{steps} steps on {device}: RSS after warm-up {rss_warm / 2**20:.1f} MiB, at end "
          f"{rss_end / 2**20:.1f} MiB (growth {growth / 2**20:+.1f} MiB); pool peak reserved "
          f"{peak_reserved} B, cap {cap} B; pool {ctx.pool.stats()}")
    assert growth <= RSS_SLACK_BYTES, (
        f"RSS grew after warm-up: {rss_warm} -> {rss_end} B (+{growth / 2**20:.1f} MiB, "
        f"allowed {RSS_SLACK_BYTES / 2**20:.0f} MiB)"
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
        dev_end = torch.cuda.memory_allocated(device)
        assert dev_end <= dev_warm, f"device memory grew after warm-up: {dev_warm} -> {dev_end} B"

    s = ctx.ledger.summary()
    assert s["steps"] == steps, s["steps"]
    assert_ledger_consistent(s)
    assert s["offloaded_count"] > 0 and s["kept_count_by_reason"].get("host_budget", 0) > 0, (
        "the run should both offload and hit the host budget", s["kept_count_by_reason"])
    totals = ctx.ledger.step_totals
    assert len(totals) == steps
    for key in ("packed_bytes", "packed_count", "offloaded_bytes", "offloaded_count", "kept_bytes", "kept_count"):
        assert sum(getattr(t, key) for t in totals) == s[key], key
    for t in totals:
        assert t.packed_bytes == t.offloaded_bytes + t.kept_bytes, t
        assert t.packed_count == t.offloaded_count + t.kept_count, t
    assert s["d2h_bytes"] == ctx.pool.stats()["received_bytes"], (s["d2h_bytes"], ctx.pool.stats())
    assert len(ctx.ledger.records) <= ctx.ledger.max_records


def test_long_run_short_ci():
    """50 steps, changing shapes, CPU offload: pool within cap, RSS flat, ledger reconciled, exact."""
    run_long(50, torch.device("cpu"), warmup=15)


@pytest.mark.slow
def test_long_run_1000_steps():
    """The 1,000-step soak of the same checks."""
    run_long(1000, torch.device("cpu"), warmup=100)


@pytest.mark.gpu
def test_long_run_gpu_short():
    """GPU: 50 steps offloading from the GPU to pinned host memory with streams."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        run_long(50, torch.device("cuda"), warmup=15)


@pytest.mark.gpu
@pytest.mark.slow
def test_long_run_gpu_1000_steps():
    """GPU: the 1,000-step soak."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        run_long(1000, torch.device("cuda"), warmup=100)


def test_default_pool_stays_near_peak_use_with_new_lengths():
    """Default settings, a new sequence length most steps: pool reserved bytes stay within 2x the
    peak bytes in use (DESIGN: host footprint <= 1.05x peak offloaded bytes)."""
    model = make_model()
    ctx = _engine(torch.device("cpu"))
    rng = random.Random(0)
    for step in range(50):
        train_step(model, make_batch(CFG, 2, rng.randrange(8, 129), seed=step), ctx)
        model.zero_grad(set_to_none=True)
    stats = ctx.pool.stats()
    print(f"\npool reserved {stats['reserved_bytes'] / 2**20:.2f} MiB, peak in use "
          f"{stats['peak_in_use_bytes'] / 2**20:.2f} MiB, {stats['allocations']} allocations, "
          f"{stats['reuses']} reuses")
    assert stats["reserved_bytes"] <= 2 * stats["peak_in_use_bytes"], (
        f"pool reserved {stats['reserved_bytes']} B for a peak in use of {stats['peak_in_use_bytes']} B"
    )
