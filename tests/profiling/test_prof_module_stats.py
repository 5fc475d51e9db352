"""ModuleMemoryStats (MemTracker on CPU): exact parameter/input/output bytes, orders, baseline."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from profiling import ModuleMemoryStats, ProfilingError, estimate_module_runtimes, estimate_sac

F32 = 4


def test_exact_bytes_and_orders(tmp_path):
    """Parameter, input and output bytes match the shapes; forward/backward orders are the call orders."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(4, 16, requires_grad=True)
    stats = ModuleMemoryStats(model)
    with stats:
        model(x).sum().backward()
    rows = {r["fqn"]: r for r in stats.modules()}
    assert list(rows) == ["Sequential", "Sequential.0", "Sequential.1", "Sequential.2"]
    assert rows["Sequential.0"]["param_bytes"] == (16 * 32 + 32) * F32
    assert rows["Sequential.2"]["param_bytes"] == (32 * 8 + 8) * F32
    assert rows["Sequential"]["param_bytes"] == rows["Sequential.0"]["param_bytes"] + rows["Sequential.2"]["param_bytes"]
    assert rows["Sequential.0"]["input_bytes"] == 4 * 16 * F32
    assert rows["Sequential.0"]["output_bytes"] == 4 * 32 * F32
    assert rows["Sequential.2"]["output_bytes"] == 4 * 8 * F32
    assert rows["Sequential.1"]["is_leaf"] and not rows["Sequential"]["is_leaf"]
    assert stats.order["fw_pre_order"] == ["Sequential", "Sequential.0", "Sequential.1", "Sequential.2"]
    assert stats.order["fw_post_order"] == ["Sequential.0", "Sequential.1", "Sequential.2", "Sequential"]
    assert stats.order["bw_pre_order"][-1] == "Sequential.0"
    assert all(r["fw_ms"] > 0 for r in rows.values())
    assert rows["Sequential"]["bw_ms"] > 0
    peak, ms = stats.peak_baseline()
    assert peak >= rows["Sequential"]["param_bytes"] and ms > 0
    assert stats.peak()["PARAM"] == rows["Sequential"]["param_bytes"]
    data = json.loads(stats.to_json(tmp_path / "s.json").read_text())
    assert data["runtime_source"] == "measured" and len(data["modules"]) == 4
    assert "Sequential.2" in stats.table()


def test_reset_and_toy_model(toy):
    """After reset() only the latest step's figures remain; the toy model's blocks are all reported."""
    model, tokens, _ = toy
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = ModuleMemoryStats(model, opt)
    with stats:
        for i in range(2):
            if i:
                stats.reset()
            model(tokens).float().mean().backward()
            opt.step()
            opt.zero_grad()
    fqns = [r["fqn"] for r in stats.modules()]
    assert fqns[0] == "ToyLlama" and "ToyLlama.layers.1.mlp.w2" in fqns
    assert stats.order["fw_pre_order"].count("ToyLlama") == 1
    root = stats.modules()[0]
    assert root["act_total_bytes"] > 0 and root["param_bytes"] == sum(
        p.numel() * p.element_size() for p in model.parameters()
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_estimators_refuse_without_cuda():
    """The CUDA-only estimators raise a clear error instead of aborting the process."""
    with pytest.raises(ProfilingError, match="needs CUDA"):
        estimate_module_runtimes(lambda: None, lambda s: None)
    with pytest.raises(ProfilingError, match="needs CUDA"):
        estimate_sac(lambda: None, lambda s: None)
