"""``offload.plan(..., target=...)``: a plan for a GPU this machine does not have, from predictions only
(NOTE [ Planning on a target ] in offload/planner/predicted.py; issue 33 item 6, issue 34 item 4)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from planner_testkit import make_encoder_and_step, make_model_and_step

import offload
from offload.errors import OffloadError
from offload.planner import plan_from_cost
from offload.planner.predicted import _predict
from offload.predict import GPUS

SPEC = GPUS["h100-sxm"]


@pytest.fixture
def nothing_measured(monkeypatch):
    """Every way the planner measures on this machine raises."""
    from offload.planner import cost, meter, planning

    def refuse(*a, **k):
        raise AssertionError("offload.plan(target=...) measured on this machine")

    monkeypatch.setattr(meter.MemoryMeter, "__init__", refuse)
    monkeypatch.setattr(planning, "measure_step", refuse)
    monkeypatch.setattr(cost, "_probe", refuse)
    monkeypatch.setattr(planning.Plan, "measure", refuse)


@pytest.fixture(scope="module")
def toy():
    """The toy Llama's all-keep target plan (its cost model holds every predicted profile)."""
    torch.set_num_threads(1)
    model, step = make_model_and_step()
    return model, step, offload.plan(model, step, budget_bytes="100%", target="h100-sxm")


def _sweep(p):
    """Budgets from the smallest reachable peak to the peak without a plan."""
    lo, hi = p.min_peak_bytes, p.unplanned_peak_bytes
    return [lo + (hi - lo) * k // 4 for k in range(4)]


def _labelled(p):
    return p.target is SPEC and "PREDICTED for h100-sxm" in p.report() and p.to_dict()["target"]["kind"] == "predicted"


@pytest.mark.parametrize("make", [make_model_and_step, make_encoder_and_step], ids=["toy_llama", "encoder"])
def test_a_target_plan_measures_nothing_here_and_its_predicted_step_fits(make, nothing_measured):
    """With target=, nothing is measured on this machine, the plan is labelled PREDICTED with the spec, and
    predict_step with the plan peaks within the budget (half-way between the smallest peak and no plan)."""
    torch.set_num_threads(1)
    model, step = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe = offload.plan(model, step, budget_bytes="100%", target="h100-sxm", verify=False)
    budget = (probe.min_peak_bytes + probe.unplanned_peak_bytes) // 2
    p = plan_from_cost(probe.cost, budget, model=model, device="cuda", unplanned_peak=probe.unplanned_peak_bytes,
                       unplanned_s=probe.unplanned_step_seconds, check=lambda q: _predict(model, step, q, SPEC).peak_bytes)
    assert any(d != "keep" for d in p.decisions.values()), p.decisions
    assert _predict(model, step, p, SPEC).peak_bytes <= budget
    assert _labelled(probe)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "planning changed the model"


def test_every_budget_from_the_minimum_to_no_plan_holds_on_the_prediction(toy):
    """For budgets between the smallest reachable peak and the unplanned predicted peak, offload.plan's
    target plan is verified by predict_step: its whole-step predicted peak is within the budget."""
    model, step, probe = toy
    budget = _sweep(probe)[1]
    p = offload.plan(model, step, budget_bytes=budget, target=SPEC)
    assert p.verified_peak_bytes is not None and p.verified_peak_bytes <= budget, p.report()
    assert _predict(model, step, p, SPEC).peak_bytes <= budget
    assert _labelled(p)
    for b in _sweep(probe):  # the same solve and predicted verification offload.plan runs, per budget
        q = plan_from_cost(probe.cost, b, model=model, device="cuda", unplanned_peak=probe.unplanned_peak_bytes,
                           unplanned_s=probe.unplanned_step_seconds,
                           check=lambda x: _predict(model, step, x, SPEC).peak_bytes)
        assert _predict(model, step, q, SPEC).peak_bytes <= b, (b, q.decisions)


def test_a_tighter_budget_never_gives_fewer_non_keep_decisions(toy):
    """Monotone: lowering the budget never lowers the number of blocks that are not kept."""
    _model, _step, probe = toy
    counts = []
    for b in reversed(_sweep(probe)):
        q = plan_from_cost(probe.cost, b, model=None, device="cuda", unplanned_peak=probe.unplanned_peak_bytes,
                           unplanned_s=probe.unplanned_step_seconds)
        counts.append(sum(d != "keep" for d in q.decisions.values()))
    assert counts == sorted(counts) and counts[-1] > 0, counts


def test_a_budget_below_the_minimum_is_refused_naming_the_target(toy):
    """A budget no plan reaches (the parameters alone) raises the planner's OffloadError, naming budget_bytes and
    the target, and advising a budget above the one refused (the lowest plan's predicted peak)."""
    import re

    model, step, _probe = toy
    budget = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(OffloadError, match=r"budget_bytes=.*cannot be met.*PREDICTED for target='h100-sxm'") as e:
        offload.plan(model, step, budget_bytes=budget, target="h100-sxm")
    advised = int(re.search(r"Raise budget_bytes to at least (\d+)", str(e.value)).group(1))
    assert advised > budget


def test_a_budget_above_the_card_is_refused():
    """A budget above the target's usable memory is refused, naming both (a plan within it need not fit)."""
    model, step = make_model_and_step()
    with pytest.raises(ValueError, match=r"above h100-sxm's usable memory \(78.65 GiB"):
        offload.plan(model, step, budget_bytes=SPEC.usable_bytes + 1, target="h100-sxm")


def test_batchnorm_blocks_get_a_plan_for_every_budget_a_plan_meets():
    """With BatchNorm blocks (never recomputed) every budget between the lowest predicted plan's peak and the
    step without a plan gets a plan whose prediction is within it, and a budget below is refused advising a
    budget above the refused one (the cost model's bounds alone refused budgets its own plans met)."""
    import re

    from planner_testkit import BNNet, step_for

    torch.manual_seed(0)
    model = BNNet(d=256, n=3)
    step = step_for(model, torch.randn(256, 256))
    lowest = offload.plan(model, step, budget_bytes="100%", target="h100-sxm")
    offload_all = {n: "offload" for n in lowest.decisions}
    floor = _predict(model, step, dataclasses.replace(lowest, decisions=offload_all), SPEC).peak_bytes
    for budget in (floor, (floor + lowest.unplanned_peak_bytes) // 2):
        p = offload.plan(model, step, budget_bytes=budget, target="h100-sxm")
        assert p.verified_peak_bytes <= budget, (budget, p.verified_peak_bytes, p.decisions)
    with pytest.raises(OffloadError) as e:
        offload.plan(model, step, budget_bytes=floor // 2, target="h100-sxm")
    assert int(re.search(r"at least (\d+)", str(e.value)).group(1)) > floor // 2


def test_mixed_precision_target_plan_is_planned_under_autocast():
    """plan(target=, mixed_precision=bf16) profiles and verifies the step under bf16 autocast (its step without a
    plan peaks lower than fp32's), and a measured plan refuses mixed_precision with the fix."""
    model, step = make_model_and_step()
    fp32 = offload.plan(model, step, budget_bytes="100%", target="h100-sxm", verify=False)
    mixed = offload.plan(model, step, budget_bytes="100%", target="h100-sxm", verify=False,
                         mixed_precision=torch.bfloat16)
    assert mixed.unplanned_peak_bytes < fp32.unplanned_peak_bytes
    with pytest.raises(ValueError, match="torch.autocast"):
        offload.plan(model, step, budget_bytes=1 << 30, mixed_precision=torch.bfloat16)


def test_target_typos_and_machine_arguments_are_refused(toy):
    """A misspelt target gets did-you-mean; device= and bandwidth_gb_s= with a target are refused."""
    model, step, _ = toy
    with pytest.raises((KeyError, ValueError), match="h100-sxm"):
        offload.plan(model, step, budget_bytes=1 << 30, target="h100-sx")
    with pytest.raises(ValueError, match="device"):
        offload.plan(model, step, budget_bytes=1 << 30, device="cpu", target="h100-sxm")
    with pytest.raises(ValueError, match="bandwidth_gb_s"):
        offload.plan(model, step, budget_bytes=1 << 30, bandwidth_gb_s=5.0, target="h100-sxm")


def test_a_budget_share_is_a_share_of_the_targets_usable_memory(toy):
    """budget_bytes="50%" plans for half of the target's usable memory, not of this machine's."""
    model, step, _ = toy
    small = dataclasses.replace(SPEC, memory_bytes=SPEC.reserve_bytes + (8 << 20))
    p = offload.plan(model, step, budget_bytes="50%", target=small)
    assert p.budget_bytes == small.usable_bytes // 2


@pytest.mark.slow
def test_a_faster_link_never_gives_a_slower_predicted_plan(toy):
    """With 10x the host link (h2d and d2h), the plan's predicted step is never slower (within the noise
    band the tie-break may use)."""
    model, step, probe = toy
    budget = _sweep(probe)[1]
    fast = dataclasses.replace(SPEC, h2d_bytes_per_s=10 * SPEC.h2d_bytes_per_s,
                               d2h_bytes_per_s=10 * SPEC.d2h_bytes_per_s)
    slow_p = offload.plan(model, step, budget_bytes=budget, target=SPEC, verify=False)
    fast_p = offload.plan(model, step, budget_bytes=budget, target=fast, verify=False)
    assert fast_p.predicted_step_seconds <= slow_p.predicted_step_seconds + fast_p.cost.noise_s
