"""ModuleMemoryStats (MemTracker on CPU): exact parameter/input/output bytes, orders, baseline."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from offload.profiling import ModuleMemoryStats, ProfilingError, estimate_module_runtimes, estimate_sac

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
    assert data["runtime_source"] == "measured_under_memtracker" and len(data["modules"]) == 4
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


# ------------------------------------------------------------------ issue 9, items 10 and 12
class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update, as LoRA fine-tuning sets it up."""

    def __init__(self, d_in: int, d_out: int, r: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(d_in, r, bias=False)
        self.lora_b = nn.Linear(r, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def _lora_model() -> nn.Module:
    return nn.Sequential(LoRALinear(16, 32), nn.ReLU(), LoRALinear(32, 8))


def test_frozen_parameters_do_not_crash():
    """MemTracker hooked every parameter and raised on requires_grad=False ones (LoRA/QLoRA)."""
    model = _lora_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    stats = ModuleMemoryStats(model, opt)
    with stats:
        for i in range(2):
            if i:
                stats.reset()  # MemTracker keeps one iteration
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    rows = {r["fqn"]: r for r in stats.modules()}
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    assert rows["Sequential"]["param_bytes"] == every
    assert rows["Sequential"]["grad_bytes"] == trainable < every
    assert rows["Sequential.0.base"]["grad_bytes"] == 0
    assert rows["Sequential.0"]["act_total_by_device"] == {"cpu": rows["Sequential.0"]["act_total_bytes"]}
    assert set(stats.peak_by_device()) == {"cpu"}


def test_cpu_refusal_names_real_api():
    """The CUDA-only estimators' error points at something that exists (it named runtime_source='measured')."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    with pytest.raises(ProfilingError) as e:
        estimate_sac(lambda: None, lambda s: None)
    assert "runtime_source=" not in str(e.value) and "measure_times" in str(e.value)
    assert hasattr(ModuleMemoryStats, "measure_times")


def test_measure_times_without_memtracker():
    """measure_times re-times modules outside MemTracker's dispatch mode and says so."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    stats = ModuleMemoryStats(model)
    with stats:
        model(torch.randn(4, 16)).sum().backward()
    assert stats.runtime_source == "measured_under_memtracker"
    stats.measure_times(lambda: model(torch.randn(4, 16)).sum().backward(), steps=2)
    assert stats.runtime_source == "measured"
    assert all(r["fw_ms"] > 0 and r["bw_ms"] >= 0 for r in stats.modules())
    assert "measured times" in stats.table()


def test_torch_ilp_reads_our_profile(toy):
    """torch's own parse_module_info / get_peak_memory_runtime_baseline accept the emitted dict
    (feeding our stats used to raise KeyError 'param_per_module') and agree with peak_baseline()."""
    ilp = pytest.importorskip("torch.distributed._tools.ilp_utils")
    from offload.profiling import module_info_for_ilp

    model, tokens, _ = toy
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        model(tokens).float().mean().backward()
        opt.step()
        opt.zero_grad()

    info = module_info_for_ilp(model, step, optimizer=opt)
    names = [s["fqn"] for s in info["mod_stats"]]
    assert names[0] == "ToyLlama" and "ToyLlama.layers.0.attn" in names
    assert sorted(names) == sorted(info["mod_order"]["fw_pre_order"])
    graph = ilp.parse_module_info(info)
    peak, ms = ilp.get_peak_memory_runtime_baseline(graph)
    root = graph.nodes[0]
    assert root["fqn"] == "ToyLlama"
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert root["param_per_module"] == params
    assert peak >= params + max(n["act_total"] for n in graph.nodes) > params
    assert ms > 0
    # ancestor matrix: the root is an ancestor of every module, a block of its children
    assert graph.ad_matrix[0].sum() == len(graph.nodes)
    blk = graph.name2node["ToyLlama.layers.0"]["index"]
    assert graph.ad_matrix[blk][graph.name2node["ToyLlama.layers.0.attn"]["index"]] == 1


def test_sac_stats_on_cpu_fill_the_ilp_fields(toy):
    """collect_sac_stats runs torch's SACEstimator on CPU (a CPU clock per operator) without touching the
    model, and module_info_for_ilp(sac_forward=) makes the blocks AC candidates for torch's sac_milp."""
    pytest.importorskip("pwlf")
    ilp = pytest.importorskip("torch.distributed._tools.ilp_utils")
    from offload.profiling import collect_sac_stats, module_info_for_ilp

    model, tokens, _ = toy
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sac = collect_sac_stats(model, lambda: model(tokens))
    assert "ToyLlama.layers.0" in sac.sac_mod_stats and "ToyLlama.layers.0.attn.wqkv" not in sac.sac_mod_stats
    blk = sac.sac_mod_stats["ToyLlama.layers.0"]
    assert len(blk.func_names) == len(blk.runtimes) == len(blk.memory) > 10 and sum(blk.runtimes) > 0
    for n, p in model.named_parameters():  # read as fake tensors, never changed, never replaced
        assert type(p) is nn.Parameter and torch.equal(p, before[n]) and p.grad is None, n

    info = module_info_for_ilp(model, lambda: model(tokens).float().mean().backward(),
                               sac_forward=lambda: model(tokens))
    by = {s["fqn"]: s for s in info["mod_stats"]}
    assert not by["ToyLlama.layers.0"]["is_leaf"] and by["ToyLlama.layers.0.attn.wqkv"]["is_leaf"]
    assert by["ToyLlama.layers.0"]["sac_memory"] > 0 and by["ToyLlama.layers.0"]["n_segments"] >= 1
    ilp.parse_module_info(info)  # torch's parser accepts it


def test_sac_stats_modes_say_what_they_need(toy):
    """An unknown mode is a ValueError naming it; torch's CUDA-only timers refuse on CPU instead of aborting."""
    from offload.profiling import collect_sac_stats

    model, tokens, _ = toy
    with pytest.raises(ValueError, match="mode='roofline'"):
        collect_sac_stats(model, lambda: model(tokens), mode="roofline")
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    for mode in ("operator-level-cost-model", "operator-level-benchmark"):
        with pytest.raises(ProfilingError, match="needs CUDA"):
            collect_sac_stats(model, lambda: model(tokens), mode=mode)
