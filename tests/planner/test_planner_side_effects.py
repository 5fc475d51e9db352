"""``offload.plan`` changes nothing (parameters, gradients, buffers, RNG states); a planned step changes
buffers exactly as the unplanned step; Hugging Face models plan with their KV cache off (issue 24)."""

from __future__ import annotations

import logging

import pytest
import torch

import offload

from planner_testkit import BNNet, hf_causal_lm, make_encoder_and_step, step_for

_KW = dict(timed=1, bandwidth_gb_s=10.0)


def _state(model: torch.nn.Module) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
    }


def _assert_same(a: dict, b: dict) -> None:
    for k in ("params", "grads", "buffers"):
        assert a[k].keys() == b[k].keys(), k
        for n in a[k]:
            x, y = a[k][n], b[k][n]
            assert (x is None) == (y is None), (k, n)
            assert x is None or torch.equal(x, y), (k, n)
    assert torch.equal(a["rng"], b["rng"])


def _bn():
    torch.manual_seed(0)
    model = BNNet()
    return model, step_for(model, torch.randn(32, 64))


@pytest.mark.parametrize("make,grads", [(_bn, "existing"), (_bn, "none"), (make_encoder_and_step, "existing")],
                         ids=["bn-accumulated-grads", "bn-no-grads", "encoder-accumulated-grads"])
def test_plan_leaves_model_bit_identical(make, grads: str) -> None:
    model, step = make()
    if grads == "existing":
        step().backward()  # accumulated gradients of a loop: plan() must not zero them
        step().backward()
    before = _state(model)
    p0 = offload.plan(model, step, budget_bytes=1 << 40, **_KW)
    _assert_same(before, _state(model))
    budget = p0.min_peak_bytes + (p0.unplanned_peak_bytes - p0.min_peak_bytes) // 3
    offload.plan(model, step, budget_bytes=budget, **_KW)  # profiles, solves, measures the plan
    _assert_same(before, _state(model))


def test_planned_step_updates_buffers_as_unplanned() -> None:
    """BatchNorm blocks are never recomputed (a recompute would update running stats twice); planned
    steps then change buffers, and gradients, exactly as unplanned ones."""
    model, step = _bn()
    twin, twin_step = _bn()
    p0 = offload.plan(model, step, budget_bytes=1 << 40, **_KW)
    assert set(p0.cost.no_recompute) == {f"layers.{i}" for i in range(3)}
    assert "running_mean" in p0.cost.no_recompute["layers.0"]
    p = offload.plan(model, step, budget_bytes=p0.min_peak_bytes, **_KW)
    assert "recompute" not in p.decisions.values() and "recompute_offload" not in p.decisions.values()
    assert "never recomputed" in p.report()
    forced = offload.Plan(decisions={**p.decisions, "layers.1": "recompute"}, budget_bytes=p.budget_bytes,
                          predicted_peak_bytes=0, predicted_step_seconds=0.0, cost=p.cost, device="cpu")
    with pytest.raises(ValueError, match="layers.1.*never recomputed.*running_mean"):
        forced.apply(model)  # a hand-made plan cannot recompute a buffer-mutating block either
    handle = p.apply(model)
    try:
        for _ in range(2):
            torch.manual_seed(1)
            step().backward()
            torch.manual_seed(1)
            twin_step().backward()
    finally:
        handle.remove()
    for (n, b), (_, tb) in zip(model.named_buffers(), twin.named_buffers()):
        assert torch.equal(b, tb), n
    for (n, q), (_, tq) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(q.grad, tq.grad), n


@pytest.mark.parametrize("kind", ["gpt2"])
def test_hf_model_plans_with_cache_off_and_restores_it(kind: str, caplog) -> None:
    model, step = hf_causal_lm(kind)
    assert model.config.use_cache is True
    before = _state(model)
    with caplog.at_level(logging.INFO, logger="offload.planner"):
        p0 = offload.plan(model, step, budget_bytes=1 << 40, **_KW)
    assert model.config.use_cache is True
    assert sum("use_cache=False" in r.getMessage() for r in caplog.records) == 1
    _assert_same(before, _state(model))
    p = offload.plan(model, step, budget_bytes=p0.min_peak_bytes, **_KW)
    assert set(p.decisions.values()) & {"recompute", "recompute_offload", "offload"}
    assert p.measured_peak_bytes <= p.budget_bytes
    handle = p.apply(model)
    assert model.config.use_cache is False
    try:
        step().backward()  # recomputes without appending to a KV cache
    finally:
        handle.remove()
    assert model.config.use_cache is True
