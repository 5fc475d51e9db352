"""offload.plan on the shared toy Llama (CPU, device="cpu" engine): fit, prediction, bitwise grads, API."""

from __future__ import annotations

import json

import pytest
import torch

import offload
from offload.planner import plan_from_cost
from offload.planner.meter import measure_step
from offload.planner.profile import run_step, zero_grads_

from planner_testkit import make_model_and_step


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _budget(plan: offload.Plan, frac: float) -> int:
    base = plan.cost.base
    return base + int(frac * (plan.unplanned_peak_bytes - base))


def test_budget_above_unplanned_peak_keeps_everything(profiled) -> None:
    model, step, plan = profiled
    assert set(plan.decisions) == {f"layers.{i}" for i in range(4)}  # FQNs from the model root
    assert set(plan.decisions.values()) == {"keep"}
    at = plan_from_cost(plan.cost, plan.unplanned_peak_bytes, model=model, device="cpu",
                        unplanned_peak=plan.unplanned_peak_bytes, unplanned_s=plan.unplanned_step_seconds)
    assert set(at.decisions.values()) == {"keep"}
    # The all-keep prediction is the unplanned step's peak.
    assert at.predicted_peak_bytes == pytest.approx(plan.unplanned_peak_bytes, rel=0.02)


@pytest.mark.parametrize("frac", [0.25, 0.5, 0.75])
def test_budget_fits_and_prediction_within_10pct(profiled, frac: float) -> None:
    model, step, plan = profiled
    budget = _budget(plan, frac)
    p = plan_from_cost(plan.cost, budget, model=model, device="cpu", unplanned_peak=plan.unplanned_peak_bytes,
                       unplanned_s=plan.unplanned_step_seconds)
    assert set(p.decisions.values()) != {"keep"}
    assert p.predicted_peak_bytes <= budget
    peak, _ = p.measure(model, step, warmup=1, timed=1)
    assert peak <= budget, p.report()
    assert abs(p.predicted_peak_bytes / peak - 1) <= 0.10, p.report()
    assert "measured" in p.report() and p.to_dict()["measured_peak_bytes"] == peak


def test_every_decision_mix_predicted_within_10pct(profiled) -> None:
    """Mixed plans (not seen in profiling, which is uniform per decision) are predicted too."""
    model, step, plan = profiled
    names = plan.cost.names
    for combo in (("keep", "offload", "recompute", "recompute_offload"),
                  ("recompute_offload", "recompute", "offload", "keep")):
        p = offload.Plan(decisions=dict(zip(names, combo)), budget_bytes=0, predicted_peak_bytes=0,
                         predicted_step_seconds=0.0, cost=plan.cost, device="cpu",
                         engine_kwargs=plan.engine_kwargs)
        predicted = plan.cost.peak(p.decisions)
        peak, _ = p.measure(model, step, warmup=1, timed=0)
        assert abs(predicted / peak - 1) <= 0.10, (combo, predicted, peak)


def test_planned_gradients_bitwise_equal_unplanned() -> None:
    model, step = make_model_and_step()
    zero_grads_(model)
    run_step(step)
    ref = _grads(model)
    ref_loss = step().detach()
    for combo in (("keep", "offload", "recompute", "recompute_offload"),
                  ("recompute_offload",) * 4, ("offload",) * 4):
        p = offload.Plan(decisions={f"layers.{i}": d for i, d in enumerate(combo)}, budget_bytes=0,
                         predicted_peak_bytes=0, predicted_step_seconds=0.0, cost=None, device="cpu",
                         engine_kwargs={"prefetch_bytes": 0})
        handle = p.apply(model)
        try:
            for _ in range(2):  # second step reuses the pool
                zero_grads_(model)
                loss = step()
                loss.backward()
            st = handle.engine.ledger.step_totals[-1]
        finally:
            handle.remove()
        assert torch.equal(loss.detach(), ref_loss)
        for g, r in zip(_grads(model), ref):
            assert torch.equal(g, r), combo
        assert st.offloaded_bytes > 0  # the engine did move bytes


def test_apply_remove_restores_model_exactly() -> None:
    model, step = make_model_and_step()
    before = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    p = offload.Plan(decisions={f"layers.{i}": "recompute_offload" for i in range(4)}, budget_bytes=0,
                     predicted_peak_bytes=0, predicted_step_seconds=0.0, cost=None, device="cpu")
    handle = p.apply(model)
    assert all("forward" in model.layers[i].__dict__ for i in range(4))
    with pytest.raises(RuntimeError, match="already has a plan installed"):
        p.apply(model)
    handle.remove()
    handle.remove()  # idempotent
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == before
    assert isinstance(handle.engine, offload.OffloadActivations)


def test_meter_leaves_host_buffers_out() -> None:
    """Plain MemTracker counts the engine's pooled host buffers; the planner's meter does not."""
    model, step = make_model_and_step()
    engine = offload.OffloadActivations(device="cpu", model=model)

    def run() -> None:
        with engine:
            loss = step()
        loss.backward()

    kw = dict(device="cpu", model=model, warmup=1, timed=0, before_each=lambda: zero_grads_(model))
    unplanned = measure_step(lambda: run_step(step), **kw).peak_bytes
    with_pool = measure_step(run, pools=[engine.pool], **kw).peak_bytes
    plain = measure_step(run, pools=[], **kw).peak_bytes
    assert with_pool < unplanned  # offloading saves device memory ...
    assert plain > with_pool + engine.pool.stats()["peak_in_use_bytes"] // 2  # ... which plain tracking hides


def test_unreachable_budget_raises_offload_error(profiled) -> None:
    model, step, plan = profiled
    with pytest.raises(offload.OffloadError) as e:
        plan_from_cost(plan.cost, plan.cost.base + 1, model=model, device="cpu",
                       unplanned_peak=plan.unplanned_peak_bytes, unplanned_s=1.0)
    msg = str(e.value)
    assert f"budget_bytes={plan.cost.base + 1}" in msg
    assert f"{plan.min_peak_bytes} B" in msg  # the smallest reachable peak
    assert "parameters" in msg and "gradients" in msg and "What holds it" in msg
    assert plan.cost.where(plan_from_cost(plan.cost, plan.min_peak_bytes, model=model, device="cpu",
                                          unplanned_peak=plan.unplanned_peak_bytes,
                                          unplanned_s=1.0).decisions) in msg


def test_report_and_json(profiled) -> None:
    model, step, plan = profiled
    p = plan_from_cost(plan.cost, _budget(plan, 0.5), model=model, device="cpu",
                       unplanned_peak=plan.unplanned_peak_bytes, unplanned_s=plan.unplanned_step_seconds)
    text = p.report()
    for name, d in p.decisions.items():
        assert name in text and d in text
    assert "synchronous" in text  # CPU copies: the report says their time is exposed
    data = json.loads(p.to_json())
    assert data["decisions"] == p.decisions
    assert data["predicted_peak_bytes"] == p.predicted_peak_bytes
    assert {r["module"] for r in data["modules"]} == set(p.decisions)


def test_bad_arguments() -> None:
    model, step = make_model_and_step()
    with pytest.raises(ValueError, match="budget_bytes=-5"):
        offload.plan(model, step, budget_bytes=-5)
    with pytest.raises(ValueError, match="nope"):
        offload.plan(model, step, budget_bytes=1 << 30, blocks=["nope"])
    with pytest.raises(TypeError, match="scalar loss"):
        offload.plan(model, lambda: 3.0, budget_bytes=1 << 30, timed=0, warmup=0)
    with pytest.raises(ValueError, match="not one of"):
        offload.Plan(decisions={"layers.0": "drop"}, budget_bytes=0, predicted_peak_bytes=0,
                     predicted_step_seconds=0.0, cost=None, device="cpu").apply(model)
    assert all(p.grad is None for p in model.parameters())  # grads left as found (None)


@pytest.mark.gpu
def test_gpu_prediction_within_5pct() -> None:
    model, step = make_model_and_step()
    model.cuda()
    tokens = torch.randint(0, 256, (2, 64), device="cuda")

    def gstep() -> torch.Tensor:
        return model(tokens).float().logsumexp(-1).mean()

    p0 = offload.plan(model, gstep, budget_bytes=1 << 40)
    p = plan_from_cost(p0.cost, _budget(p0, 0.5), model=model, device="cuda",
                       unplanned_peak=p0.unplanned_peak_bytes, unplanned_s=p0.unplanned_step_seconds)
    peak, _ = p.measure(model, gstep)
    assert peak <= p.budget_bytes
    assert abs(p.predicted_peak_bytes / peak - 1) <= 0.05, p.report()


def test_greedy_solver_plan_fits(profiled) -> None:
    model, step, plan = profiled
    budget = _budget(plan, 0.4)
    p = plan_from_cost(plan.cost, budget, model=model, device="cpu", unplanned_peak=plan.unplanned_peak_bytes,
                       unplanned_s=plan.unplanned_step_seconds, solver="greedy")
    exact = plan_from_cost(plan.cost, budget, model=model, device="cpu",
                           unplanned_peak=plan.unplanned_peak_bytes, unplanned_s=plan.unplanned_step_seconds)
    assert p.solver.startswith("greedy") and exact.solver.startswith("exact")
    assert p.predicted_peak_bytes <= budget
    # The exact plan is the fastest's tie-break: within the noise band of the fastest, which greedy never beats.
    assert p.predicted_step_seconds >= exact.predicted_step_seconds - plan.cost.noise_s - 1e-12


def test_smallest_reachable_peak_is_a_feasible_budget(profiled) -> None:
    model, step, plan = profiled
    p = plan_from_cost(plan.cost, plan.min_peak_bytes, model=model, device="cpu",
                       unplanned_peak=plan.unplanned_peak_bytes, unplanned_s=plan.unplanned_step_seconds)
    assert p.predicted_peak_bytes <= plan.min_peak_bytes
    peak, _ = p.measure(model, step, warmup=1, timed=0)
    assert peak <= plan.min_peak_bytes * 1.10


def test_find_blocks_default_and_explicit() -> None:
    from offload.planner import find_blocks

    model, _ = make_model_and_step()
    assert [n for n, _ in find_blocks(model)] == [f"layers.{i}" for i in range(4)]
    picked = find_blocks(model, [model.layers[1].attn, "layers.2.mlp"])
    assert picked == [("layers.1.attn", model.layers[1].attn), ("layers.2.mlp", model.layers[2].mlp)]
    with pytest.raises(ValueError, match="same module twice"):
        find_blocks(model, ["layers.0", model.layers[0]])
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        find_blocks(torch.nn.Linear(2, 2))


def test_submodule_candidates_predicted_within_10pct() -> None:
    """Candidates finer than blocks (attention and MLP of each layer) are planned and predicted too."""
    model, step = make_model_and_step()
    names = [f"layers.{i}.{s}" for i in range(4) for s in ("attn", "mlp")]
    base = offload.plan(model, step, budget_bytes=1 << 40, blocks=names, timed=1, bandwidth_gb_s=10.0)
    assert set(base.decisions) == set(names)
    budget = _budget(base, 0.5)
    p = plan_from_cost(base.cost, budget, model=model, device="cpu", unplanned_peak=base.unplanned_peak_bytes,
                       unplanned_s=base.unplanned_step_seconds)
    peak, _ = p.measure(model, step, warmup=1, timed=0)
    assert peak <= budget
    assert abs(p.predicted_peak_bytes / peak - 1) <= 0.10, p.report()
