"""The planner's promise on models it was not built on (issue 24): every returned plan fits its budget
(predicted and measured), ``min_peak_bytes`` is a real plan's peak, anything else is a clear error."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.planner import find_blocks, plan_from_cost

from planner_testkit import (SharedBlock, SharedTable, Staged, WideStem, make_encoder_and_step, make_model_and_step,
                             step_for)

_KW = dict(timed=1, bandwidth_gb_s=10.0)


def _solve(p0: offload.Plan, model: torch.nn.Module, budget: int) -> offload.Plan:
    return plan_from_cost(p0.cost, budget, model=model, device="cpu", unplanned_peak=p0.unplanned_peak_bytes,
                          unplanned_s=p0.unplanned_step_seconds)


def _sweep(model: torch.nn.Module, step, p0: offload.Plan, n: int = 6, measure: int = 3) -> None:
    """Every budget from below the smallest reachable peak to the no-plan peak: a plan that fits, or an error."""
    lo, hi = p0.min_peak_bytes, p0.unplanned_peak_bytes
    assert lo < hi
    budgets = [lo] + [lo + (hi - lo) * k // n for k in range(1, n)]
    measured = 0
    for b in budgets:
        p = _solve(p0, model, b)
        assert p.predicted_peak_bytes <= b, p.report()
        assert max(v for v, _ in p.cost.events(p.decisions)) <= b
        if measured < measure:
            peak, _ = p.measure(model, step, warmup=1, timed=0)
            assert peak <= b, p.report()
            measured += 1
    with pytest.raises(offload.OffloadError) as e:
        _solve(p0, model, lo - 1)
    assert f"budget_bytes={lo - 1}" in str(e.value) and f"{lo} B" in str(e.value)


@pytest.fixture(scope="module")
def encoder():
    torch.set_num_threads(1)
    model, step = make_encoder_and_step()
    return model, step, offload.plan(model, step, budget_bytes=1 << 40, **_KW)


def test_encoder_every_budget_fits(encoder) -> None:
    """nn.TransformerEncoder (its input needs no grad, so block 0's backward ends in the last window)."""
    _sweep(*encoder)


def test_min_peak_is_a_real_plans_peak(encoder) -> None:
    model, step, p0 = encoder
    p = _solve(p0, model, p0.min_peak_bytes)
    assert p.predicted_peak_bytes == p0.min_peak_bytes
    peak, _ = p.measure(model, step, warmup=1, timed=0)
    assert peak <= p0.min_peak_bytes


def test_wide_stem_min_peak_fits() -> None:
    """The stem's temporary (before the first block) is a peak the solver must see."""
    torch.manual_seed(0)
    model = WideStem()
    step = step_for(model, torch.randn(8, 64, 32))
    p0 = offload.plan(model, step, budget_bytes=1 << 40, **_KW)
    _sweep(model, step, p0, n=3, measure=2)


def test_infeasible_error_names_budget_smallest_peak_and_holder() -> None:
    torch.manual_seed(0)
    model = WideStem()
    step = step_for(model, torch.randn(8, 64, 32))
    p0 = offload.plan(model, step, budget_bytes=1 << 40, **_KW)
    with pytest.raises(offload.OffloadError) as e:
        offload.plan(model, step, budget_bytes=p0.min_peak_bytes - 1, **_KW)
    msg = str(e.value)
    assert f"budget_bytes={p0.min_peak_bytes - 1}" in msg
    assert f"{p0.min_peak_bytes} B" in msg
    # What holds it: the stem's forward or backward, outside every candidate block.
    assert "stem" in msg or "end of backward" in msg
    assert "outside every candidate block" in msg
    assert f"Raise budget_bytes to at least {p0.min_peak_bytes}, or shrink the step" in msg  # one clause each


def test_finer_blocks_fit() -> None:
    """The Linear layers as candidates (what the infeasible-budget error used to recommend)."""
    model, step = make_encoder_and_step(layers=2)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "linear" in n]
    p0 = offload.plan(model, step, budget_bytes=1 << 40, blocks=names, **_KW)
    for frac in (0.25, 0.5, 0.75):
        b = p0.cost.base + int(frac * (p0.unplanned_peak_bytes - p0.cost.base))
        try:
            p = offload.plan(model, step, budget_bytes=b, blocks=names, **_KW)
        except offload.OffloadError:
            assert b < p0.min_peak_bytes
            continue
        peak, _ = p.measure(model, step, warmup=1, timed=0)
        assert peak <= b, p.report()


def test_nested_candidates_refused_by_name() -> None:
    model, step = make_model_and_step()
    with pytest.raises(ValueError, match=r"layers\.1\.attn.*inside.*layers\.1|layers\.1.*contains.*layers\.1\.attn"):
        find_blocks(model, ["layers.0", "layers.1", "layers.1.attn"])


def test_container_candidates_refused_by_name() -> None:
    """A list of lists: the containers never run; the error names them and what to pass instead."""
    model = Staged()
    with pytest.raises(ValueError, match=r"stages\.0.*ModuleList.*stages\.0\.0"):
        find_blocks(model, ["stages.0", "stages.1"])


def test_staged_model_default_blocks_are_the_leaves() -> None:
    model = Staged()
    assert [n for n, _ in find_blocks(model)] == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"]
    step = step_for(model, torch.randn(4, 8, 32))
    p = offload.plan(model, step, budget_bytes=1 << 40, **_KW)
    assert set(p.decisions) == {"stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"}


def test_never_called_candidate_named() -> None:
    model, step = make_model_and_step()
    model.extra = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"extra.*never ran"):
        offload.plan(model, step, budget_bytes=1 << 40, blocks=["layers.0", "extra"], **_KW)


def test_block_called_twice_is_profiled_per_call() -> None:
    torch.manual_seed(0)
    model = SharedBlock()
    step = step_for(model, torch.randn(8, 32, 64))
    p0 = offload.plan(model, step, budget_bytes=1 << 40, **_KW)
    assert [b.name for b in p0.cost.blocks] == ["layers.0", "layers.1", "layers.2", "layers.1"]
    for frac in (0.0, 0.5):
        b = p0.min_peak_bytes + int(frac * (p0.unplanned_peak_bytes - p0.min_peak_bytes))
        p = _solve(p0, model, b)
        assert set(p.decisions.values()) != {"keep"}
        peak, _ = p.measure(model, step, warmup=1, timed=0)
        assert peak <= b, p.report()
        assert abs(p.predicted_peak_bytes / peak - 1) <= 0.10, p.report()


def test_every_decision_combination_fits_its_prediction_with_shared_saves() -> None:
    """Blocks that share a saved tensor the model made once (a rotary table: held while any block keeps it,
    so offloading it in the last block frees nothing) and return attention weights the model drops a block
    later: for every assignment of decisions, the measured peak is at most the predicted one (it was above
    by the table's bytes, and by a layer's weights when keep and recompute were mixed)."""
    import dataclasses
    import itertools

    torch.manual_seed(0)
    model = SharedTable(n=2)
    x, head = torch.randn(2, 48, 32, requires_grad=True), torch.randn(32, 2048)

    def step() -> torch.Tensor:  # a wide head: its window is the step's peak, where the table is held or not
        return (model(x) @ head).square().mean()

    p0 = offload.plan(model, step, budget_bytes=1 << 40, **_KW)
    names = list(p0.decisions)
    assert p0.cost.shared_saves  # the table, saved by every block
    for decs in itertools.product(("keep", "offload", "recompute", "recompute_offload"), repeat=len(names)):
        d = dict(zip(names, decs))
        p = dataclasses.replace(p0, decisions=d)
        predicted = p0.cost.peak(d)
        measured, _ = p.measure(model, step, warmup=1, timed=0)
        assert measured <= predicted, (decs, measured, predicted)
