"""A plan that assumes a host budget (issue 25): never more offload than the host tiers hold, and the
report says which tier each block's copies land in."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import offload
from offload.planner import plan_from_cost
from offload.planner.host import host_bytes, host_capacity


def _with(cost, **ekw):
    return dataclasses.replace(cost, engine_kwargs={**cost.engine_kwargs, **ekw})


def _kw(plan, model):
    return dict(model=model, device="cpu", unplanned_peak=plan.unplanned_peak_bytes, unplanned_s=1.0)


def test_plan_fits_the_host_tiers(profiled, tmp_path) -> None:
    """At a budget whose fastest plan offloads, a smaller host budget makes the plan offload at most
    what the tiers hold (the rest recomputed), still under budget_bytes; a disk tier lets it offload
    again, and host_tiers / the report say the bytes land on disk."""
    model, _, plan = profiled
    # Timings fixed, not measured: a recompute costs more than an offload here (as on this CPU when
    # idle), so the fastest plan at this budget offloads whatever the shared machine's noise did to the
    # profile's single timed step.
    cost = copy.deepcopy(plan.cost)
    for b in cost.blocks:
        for d in ("recompute", "recompute_offload"):
            b.options[d].seconds = max(b.options[d].seconds, b.options["offload"].seconds) + 1.0
    budget = cost.peak({n: "recompute" for n in cost.names})
    free = plan_from_cost(cost, budget, **_kw(plan, model))
    need = host_bytes(cost, free.decisions)
    assert need > 0, "the unconstrained plan offloads at this budget"
    for host in (0, need // 2):
        c = _with(cost, host_budget_bytes=host)
        p = plan_from_cost(c, budget, **_kw(plan, model))
        assert host_bytes(c, p.decisions) <= host == host_capacity(c.engine_kwargs), (host, p.decisions)
        assert p.predicted_peak_bytes <= budget
        assert sum(sum(r.values()) for r in p.host_tiers.values()) == host_bytes(c, p.decisions)
        assert all(set(r) <= {"pool"} for r in p.host_tiers.values()), p.host_tiers
    c = _with(cost, host_budget_bytes=need // 4, disk_dir=str(tmp_path), disk_budget_bytes=1 << 30)
    p = plan_from_cost(c, budget, **_kw(plan, model))
    assert host_bytes(c, p.decisions) == need and p.decisions == free.decisions
    tiers = {t for r in p.host_tiers.values() for t in r}
    assert tiers == {"pool", "disk"}, p.host_tiers
    assert "host tiers:" in p.report() and "disk" in p.report()
    assert p.to_dict()["host_tiers"] == p.host_tiers


def test_no_plan_fits_names_the_host_settings(profiled) -> None:
    """Below what recompute alone reaches, a zero host budget leaves no plan: the error names it."""
    model, _, plan = profiled
    cost = _with(plan.cost, host_budget_bytes=0)
    rec = plan.cost.peak({n: "recompute" for n in plan.cost.names})
    if plan.min_peak_bytes >= rec:
        pytest.skip("recompute alone reaches the smallest peak on this profile")
    with pytest.raises(offload.OffloadError, match="host tiers hold 0 B.*host_budget_bytes"):
        plan_from_cost(cost, plan.min_peak_bytes, **_kw(plan, model))


def test_plan_keyword_reaches_the_applied_engine() -> None:
    """offload.plan(..., host_budget_bytes=...) profiles without it and applies it to the plan's engine."""
    from planner_testkit import make_model_and_step

    torch.set_num_threads(1)
    model, step = make_model_and_step()
    p = offload.plan(model, step, budget_bytes=1 << 40, timed=0, bandwidth_gb_s=10.0, host_budget_bytes=1 << 20)
    assert p.engine_kwargs["host_budget_bytes"] == 1 << 20
    handle = p.apply(model)
    try:
        assert handle.engine.pool.capacity_bytes == 1 << 20
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="host_budget_bytes"):
        offload.plan(model, step, budget_bytes=1 << 40, host_budget_bytes=-1)
