"""Host-memory pressure: ``host_budget_bytes`` and the RAM ceiling are enforced by ``on_host_budget``.

Small budgets force every path of Rule 9: "keep" leaves what does not fit on
the device (reason ``host_budget``), "pageable" moves it to one-off unpooled
memory (the pageable tier), "raise" stops with an OffloadError naming the
setting. A pinned allocation that fails moves the request to the next tier
(NOTE [ Host tiers ]; here: pageable_budget_bytes=None), counted in the
pool's ``pin_failures`` and noted per record (``tier="pageable"``,
``note="pin_failed"``). tests/reliability/test_disk_tier.py covers the disk tier.
Grads stay bitwise equal to a no-offload twin on every path that trains.
"""

from __future__ import annotations

import pytest
import torch

import offload._pinned
from offload import OffloadError, active_engine

from ._common import (
    CFG,
    assert_grads_equal,
    assert_ledger_consistent,
    engine,
    in_use_after_gc,
    make_batch,
    make_model,
    train_step,
    twin,
)

BATCH = make_batch(CFG, 2, 32)


def _step_needs() -> dict:
    """What one unconstrained step offloads: pool bytes and offloaded count."""
    probe = engine()
    train_step(make_model(), BATCH, probe)
    s = probe.ledger.summary()
    return {"bytes": probe.pool.stats()["received_bytes"], "count": s["offloaded_count"]}


def _twin_steps(ctx, steps: int = 2):
    """``steps`` steps of a model under ``ctx`` and of its no-offload twin; grads compared each step."""
    model = make_model()
    ref = twin(model)
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        batch = make_batch(CFG, 2, 32, seed=i)
        assert torch.equal(train_step(model, batch, ctx), train_step(ref, batch))
        assert_grads_equal(ref, model, f"step {i}")
    return model


def test_keep_policy_keeps_what_does_not_fit():
    """on_host_budget="keep": the overflow stays on the device as reason host_budget; the pool
    never reserves more than the budget; grads bitwise equal."""
    need = _step_needs()
    budget = int(0.4 * need["bytes"])
    ctx = engine(host_budget_bytes=budget, on_host_budget="keep")
    _twin_steps(ctx)
    s = ctx.ledger.summary()
    assert s["kept_count_by_reason"].get("host_budget", 0) > 0, s["kept_count_by_reason"]
    assert 0 < s["offloaded_count"] < 2 * need["count"], s
    stats = ctx.pool.stats()
    assert stats["peak_reserved_bytes"] <= budget, (stats, budget)
    assert s["d2h_bytes"] == stats["received_bytes"], (s["d2h_bytes"], stats)
    kept = [r for r in ctx.ledger.records if r.reason == "host_budget"]
    assert all(r.decision == "kept" and r.copy_bytes == 0 for r in kept)
    assert_ledger_consistent(s)
    assert in_use_after_gc(ctx) == 0


def test_pageable_policy_moves_everything_outside_the_pool():
    """on_host_budget="pageable": nothing is kept for the budget, the overflow is offloaded to
    unpooled pageable memory (recorded), the pool stays within its budget; grads bitwise equal."""
    need = _step_needs()
    budget = int(0.4 * need["bytes"])
    ctx = engine(host_budget_bytes=budget, on_host_budget="pageable")
    _twin_steps(ctx)
    s = ctx.ledger.summary()
    assert s["kept_count_by_reason"].get("host_budget", 0) == 0, s["kept_count_by_reason"]
    assert s["offloaded_count"] == 2 * need["count"], (s["offloaded_count"], need)
    overflow = [r for r in ctx.ledger.records if r.tier == "pageable" and r.decision == "offloaded"]
    assert overflow and all(r.decision == "offloaded" and not r.pinned for r in overflow)
    assert s["tiers"]["pageable"]["bytes"] == sum(r.copy_bytes for r in overflow) > 0, s["tiers"]
    stats = ctx.pool.stats()
    assert stats["peak_reserved_bytes"] <= budget, (stats, budget)
    assert_ledger_consistent(s)
    assert in_use_after_gc(ctx) == 0


def test_raise_policy_names_the_setting():
    """on_host_budget="raise": OffloadError naming host_budget_bytes and its value; afterwards no
    engine is active, nothing is in use, and the model trains normally without the engine."""
    need = _step_needs()
    budget = int(0.4 * need["bytes"])
    ctx = engine(host_budget_bytes=budget, on_host_budget="raise")
    model = make_model()
    with pytest.raises(OffloadError) as info:
        train_step(model, BATCH, ctx)
    msg = str(info.value)
    assert f"host_budget_bytes={budget}" in msg and "on_host_budget" in msg, msg
    del info
    assert active_engine() is None
    assert in_use_after_gc(ctx) == 0
    model.zero_grad(set_to_none=True)
    ref = twin(model)
    train_step(model, BATCH)
    train_step(ref, BATCH)
    assert_grads_equal(ref, model, "plain step after the raise")


@pytest.mark.parametrize("policy", ["keep", "pageable"])
def test_ram_ceiling_keeps_everything(policy):
    """virtual_memory_safe_pct below current RAM use: no host memory is taken at all; every
    candidate is kept as host_budget (also under "pageable", which must respect the ceiling)."""
    ctx = engine(virtual_memory_safe_pct=0.01, on_host_budget=policy)
    _twin_steps(ctx, steps=1)
    s = ctx.ledger.summary()
    assert s["offloaded_count"] == 0, s
    assert s["kept_count_by_reason"].get("host_budget", 0) > 0, s["kept_count_by_reason"]
    assert ctx.pool.stats()["reserved_bytes"] == 0
    assert_ledger_consistent(s)


def test_ram_ceiling_raise_names_the_setting():
    """virtual_memory_safe_pct with on_host_budget="raise": the error names the RAM ceiling setting."""
    ctx = engine(virtual_memory_safe_pct=0.01, on_host_budget="raise")
    with pytest.raises(OffloadError, match="virtual_memory_safe_pct=0.01"):
        train_step(make_model(), BATCH, ctx)
    assert active_engine() is None
    assert in_use_after_gc(ctx) == 0


class _TorchWithoutPinning:
    """Stands in for ``torch`` inside offload._pinned: pinned allocations fail like an exhausted
    (or capped, as on WSL2) page-locked memory limit; everything else is real torch."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory: bool = False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (simulated pinned allocation failure)")
        return torch.empty(*args, **kwargs)


def _fail_pinning(monkeypatch) -> None:
    """Make the pool's pin step fail: no cudaHostRegister, no pinned torch.empty."""
    monkeypatch.setattr(offload._pinned, "torch", _TorchWithoutPinning())
    monkeypatch.setattr(offload._pinned._torch_private, "register_host_memory", lambda t: False)


def _check_pin_fallback(ctx, model, ref) -> None:
    batch = make_batch(CFG, 2, 32, device=next(model.parameters()).device)
    with pytest.warns(UserWarning, match="pinning host memory .* failed"):
        assert torch.equal(train_step(model, batch, ctx), train_step(ref, batch))
    assert_grads_equal(ref, model, "pinning failed")
    stats = ctx.pool.stats()
    assert stats["pin_failures"] > 0 and stats["allocations"] == 0 and stats["received_bytes"] == 0, stats
    offloaded = [r for r in ctx.ledger.records if r.decision == "offloaded"]
    assert offloaded and all(not r.pinned and r.tier == "pageable" for r in offloaded), offloaded[:3]
    assert any(r.note == "pin_failed" for r in offloaded)
    assert_ledger_consistent(ctx.ledger.summary())
    assert in_use_after_gc(ctx) == 0


def test_pin_failure_falls_back_to_pageable(monkeypatch):
    """A failed pinned allocation moves the request to the pageable tier, counted in pin_failures
    and recorded per tensor; the step is still exact. (CPU: pinning is forced on, then made to fail.)"""
    _fail_pinning(monkeypatch)
    ctx = engine(pageable_budget_bytes=None)
    ctx.pool.pin = True  # device="cpu" never pins; pretend it would, to reach the fallback
    model = make_model()
    _check_pin_fallback(ctx, model, twin(model))


@pytest.mark.gpu
def test_pin_failure_falls_back_to_pageable_gpu(monkeypatch):
    """GPU: the pinned allocation of a real device engine fails; pageable fallback, exact grads."""
    from offload import OffloadActivations

    _fail_pinning(monkeypatch)
    ctx = OffloadActivations(min_offload_size=0, pageable_budget_bytes=None)
    assert ctx.pool.pin, "a GPU engine should try to pin"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = make_model().cuda()
    with sdpa_kernel(SDPBackend.MATH):  # deterministic backward, for the bitwise comparison
        _check_pin_fallback(ctx, model, twin(model))
