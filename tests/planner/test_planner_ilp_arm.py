"""torch's auto-AC ILP arm (bench/ilp_arm.py): torch's decisions applied as selective AC on the toy Llama."""

from __future__ import annotations

import sys

import pytest
import torch

from bench.ilp_arm import IlpInfeasible, apply_ilp, op_policies, profile_for_ilp, run_ilp_arm, solve

from planner_testkit import make_model_and_step


def _train(model: torch.nn.Module, step) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    loss = step()
    loss.backward()
    return loss.detach()


@pytest.fixture(scope="module")
def ilp_profile():
    """One ILP profile of the 4-block toy Llama (MemTracker + SACEstimator timed on CPU)."""
    torch.set_num_threads(1)
    model, step = make_model_and_step()
    prof = profile_for_ilp(model, step, lambda: _train(model, step))
    return model, step, prof


def test_profile_feeds_torch_ilp(ilp_profile) -> None:
    """Blocks and their attention/MLP are AC candidates with SAC statistics; leaves are not."""
    model, step, prof = ilp_profile
    stats = {m["fqn"]: m for m in prof.module_info["mod_stats"]}
    assert "ToyLlama.layers.0" in prof.candidates and "ToyLlama.layers.3.mlp" in prof.candidates
    assert stats["ToyLlama.layers.0.mlp.w1"]["is_leaf"] and not stats["ToyLlama.layers.0"]["is_leaf"]
    blk = stats["ToyLlama.layers.0"]
    assert blk["sac_memory"] > 0 and blk["sac_runtime"] > 0 and blk["n_segments"] >= 1
    assert len(blk["slopes"]) == blk["n_segments"]
    assert prof.sac_mode == "cpu-benchmark" and prof.baseline_peak_bytes > 0


def test_ilp_applied_grads_bitwise_equal(ilp_profile) -> None:
    """The model with torch's ILP decisions applied computes the unplanned loss and gradients bitwise."""
    model, step, prof = ilp_profile
    ref_loss = _train(model, step)
    ref = [p.grad.clone() for p in model.parameters()]
    base = prof.baseline_peak_bytes
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    decisions, _, peak = solve(prof, params * 2 + (base - 2 * params) * 6 // 10)  # 60% of its activations
    assert decisions, "the budget must make torch's ILP checkpoint something, or this test checks nothing"
    assert peak > 0
    policies = op_policies(prof, decisions)
    assert any(0 < sum(ops) < len(ops) for ops in policies.values())  # selective, not all-or-nothing
    handle = apply_ilp(model, policies)
    try:
        loss = _train(model, step)
        handle.check()
    finally:
        handle.remove()
    assert torch.equal(loss, ref_loss), (loss.item(), ref_loss.item())
    for (name, p), g in zip(model.named_parameters(), ref):
        assert torch.equal(p.grad, g), name
    assert all("forward" not in vars(m) for m in model.modules())  # remove() restored every unit


def test_infeasible_budget_says_why(ilp_profile) -> None:
    """A budget below parameters + gradients: no plan, and the error names the budget and torch's baseline."""
    model, step, prof = ilp_profile
    with pytest.raises(IlpInfeasible, match=r"budget_bytes=1000 .*Infeasible.*no-AC peak"):
        solve(prof, 1000)


def test_arm_skipped_without_pwlf(monkeypatch, ilp_profile) -> None:
    """Without the ilp extra the arm is recorded as skipped with the import error, and nothing runs."""
    model, step, _ = ilp_profile
    monkeypatch.setitem(sys.modules, "pwlf", None)
    res = run_ilp_arm(model, step, [(0.5, 1 << 30)], measure=lambda run: pytest.fail("measured"),
                      before_each=lambda: None)
    assert res["status"] == "skipped" and "pwlf" in res["reason"] and "offload[ilp]" in res["reason"]
    assert res["points"] == []
