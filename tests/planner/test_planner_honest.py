"""Honest costs and clear errors (issue 24): recompute never looks free, timings are medians with their
spread in strict JSON, warmup=0 accounting, every argument checked at the call and named."""

from __future__ import annotations

import json
import math

import pytest
import torch

import offload

from planner_testkit import Staged, make_model_and_step, step_for

_KW = dict(timed=2, bandwidth_gb_s=10.0)


def _strict(text: str) -> dict:
    def bad(c: str) -> None:
        raise ValueError(f"not strict JSON: {c}")

    return json.loads(text, parse_constant=bad)


@pytest.fixture(scope="module")
def planned():
    torch.set_num_threads(1)
    model, step = make_model_and_step()
    p0 = offload.plan(model, step, budget_bytes=1 << 40, **_KW)
    return model, step, p0


def test_recompute_costs_at_least_the_blocks_forward(planned) -> None:
    _, _, p0 = planned
    samples = [t for b in p0.cost.blocks for t in b.options["keep"].fwd_s_all]
    for b in p0.cost.blocks:
        fwd = b.options["keep"].fwd_s  # pooled over the toy's equal layers
        assert b.options["keep"].fwd_s_all and min(samples) <= fwd <= max(samples), b.name
        for d in ("recompute", "recompute_offload"):
            o = b.options[d]
            assert o.recompute_s >= fwd - 1e-12, (b.name, d, o.recompute_s, fwd)
            assert o.seconds >= b.options["keep"].seconds


def test_json_is_strict_with_medians_and_spread(planned) -> None:
    model, step, p0 = planned
    data = _strict(p0.to_json())
    for row in data["modules"]:
        sp = row["forward_s"]
        assert sp["n"] == 2 and sp["min"] <= sp["median"] <= sp["max"]
    p = offload.plan(model, step, budget_bytes=p0.min_peak_bytes, timed=0, bandwidth_gb_s=10.0)
    p.measure(model, step, warmup=1, timed=0)
    data = _strict(p.to_json())  # timed=0: no time measured is null, never NaN
    assert data["measured_peak_bytes"] == p.measured_peak_bytes


def test_warmup_zero_counts_no_host_buffer(planned) -> None:
    """With warmup=0 the host pool grows during the measured step: its chunks are not device memory."""
    model, step, p0 = planned
    p = offload.Plan(decisions={n: "offload" for n in p0.decisions}, budget_bytes=1 << 40, predicted_peak_bytes=0,
                     predicted_step_seconds=0.0, cost=p0.cost, device="cpu", engine_kwargs=p0.engine_kwargs)
    cold, _ = p.measure(model, step, warmup=0, timed=0)
    warm, _ = p.measure(model, step, warmup=1, timed=0)
    assert cold == warm


def test_bad_arguments_named_at_the_call() -> None:
    model, step = make_model_and_step()
    cases = [
        (dict(model="model"), TypeError, "model='model'"),
        (dict(step=3), TypeError, "step=3"),
        (dict(budget_bytes=1.5), ValueError, "budget_bytes=1.5"),
        (dict(budget_bytes="lots"), ValueError, "budget_bytes='lots'"),
        (dict(budget_bytes="150%"), ValueError, "budget_bytes='150%'"),
        (dict(bandwidth_gb_s=math.nan), ValueError, "bandwidth_gb_s=nan"),
        (dict(bandwidth_gb_s=(1.0, -2.0)), ValueError, "bandwidth_gb_s="),
        (dict(warmup=-1), ValueError, "warmup=-1"),
        (dict(timed=-1), ValueError, "timed=-1"),
        (dict(solver="fastest"), ValueError, "solver='fastest'"),  # even when no solving is needed
        (dict(device="xpu"), ValueError, "device='xpu'"),
        (dict(device="nonsense"), ValueError, "device='nonsense'"),
        (dict(use_streams="yes"), TypeError, "use_streams='yes'"),
        (dict(blocks="layers.0"), TypeError, "blocks='layers.0'"),
    ]
    for kw, exc, text in cases:
        args = dict(model=model, step=step, budget_bytes=1 << 40)
        args.update(kw)
        with pytest.raises(exc) as e:
            offload.plan(**args)
        assert text in str(e.value), (kw, str(e.value))
    assert all(p.grad is None for p in model.parameters())  # nothing ran


def test_staged_error_names_containers_not_indices() -> None:
    """The reported list-of-lists case: the error names the FQNs and the cause."""
    model = Staged()
    step = step_for(model, torch.randn(4, 8, 32))
    with pytest.raises(ValueError) as e:
        offload.plan(model, step, budget_bytes=1 << 40, blocks=[model.stages[0], model.stages[1]], **_KW)
    msg = str(e.value)
    assert "'stages.0'" in msg and "container" in msg and "[0, 1" not in msg


def test_budget_as_a_share_of_the_device(planned) -> None:
    """``budget_bytes="50%"``: half the device's memory (host RAM on CPU), resolved into bytes."""
    import psutil

    model, step, _ = planned
    p = offload.plan(model, step, budget_bytes="50%", timed=0, bandwidth_gb_s=10.0)
    assert p.budget_bytes == psutil.virtual_memory().total // 2
