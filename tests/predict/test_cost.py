"""The cost model (offload.predict._cost) against published anchors: achieved dense GEMM rates,
measured host-link rates, FLOP (not MAC) counting; and the host costs' sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils import flop_counter

from offload.predict import GPUS
from offload.predict._cost import (HOOK_COST, HostCost, attention_flops, copy_seconds, kernel_seconds,
                                   pinned_alloc_seconds)
from offload.predict._trace import Copy, HostWork, Kernel, RecordEvent

ROOT = Path(__file__).resolve().parents[2]


def _gemm(n: int, dtype: torch.dtype = torch.bfloat16) -> Kernel:
    """An n x n x n GEMM as torch's flop counter counts it (2 FLOPs per multiply-add)."""
    flops = flop_counter.mm_flop((n, n), (n, n))
    return Kernel(0, "aten.mm.default", flops, 3 * n * n * dtype.itemsize, dtype)


@pytest.mark.parametrize("gpu,mamf_tflops", [("h100-sxm", 794.5), ("a100-80gb", 271.2), ("gh200", 828.6)])
def test_large_bf16_gemm_runs_at_the_published_mamf(gpu, mamf_tflops):
    """A large bf16 GEMM's predicted rate is the published maximum achievable matmul FLOPS (ml-engineering
    MAMF table) within 1%. Counting MACs (half the FLOPs) or NVIDIA's sparse peak (twice the dense one)
    would be off by 2x."""
    k = _gemm(16384)
    rate = k.flops / (kernel_seconds(k, GPUS[gpu]) - GPUS[gpu].launch_s)
    assert rate / 1e12 == pytest.approx(mamf_tflops, rel=0.01)


def test_peaks_are_dense_and_flops_are_not_macs():
    """H100 bf16 peak is the dense 989 TFLOP/s (not the 1979 'with sparsity'), and an n^3 GEMM is 2 n^3
    FLOPs (torch's flop counter), so the achieved rate stays below the dense peak."""
    h100 = GPUS["h100-sxm"]
    assert h100.peak_flops[torch.bfloat16] == 989e12
    k = _gemm(8192)
    assert k.flops == 2 * 8192**3
    rate = k.flops / (kernel_seconds(k, h100) - h100.launch_s)
    assert 0.5 * 989e12 < rate < 989e12


def test_memory_bound_kernel_runs_at_achieved_hbm_rate():
    """A kernel with no FLOPs takes its bytes over the achieved HBM rate, plus the launch."""
    h100 = GPUS["h100-sxm"]
    k = Kernel(0, "aten.add.Tensor", 0, 3_000_000_000, torch.bfloat16)
    assert kernel_seconds(k, h100) == pytest.approx(3e9 / (3.35e12 * h100.hbm_efficiency) + h100.launch_s)


@pytest.mark.parametrize("gpu,direction,gb_s", [("h100-sxm", "d2h", 53.0), ("h100-sxm", "h2d", 53.0),
                                                 ("gh200", "h2d", 342.0), ("gh200", "d2h", 295.0),
                                                 ("a100-80gb", "d2h", 25.0)])
def test_large_pinned_copy_runs_at_the_measured_link_rate(gpu, direction, gb_s):
    """A 1 GiB pinned copy runs at the measured single-GPU rate (PCIe Gen5 x16 ~53 GB/s, torchtitan and
    nvbandwidth #24; GH200 NVLink-C2C 342 / 295 GB/s, vLLM #6496; Gen4 ~25 GB/s, BaM #54) within 1%."""
    c = Copy(1, direction, 1 << 30, True)
    rate = c.nbytes / copy_seconds(c, GPUS[gpu])
    assert rate / 1e9 == pytest.approx(gb_s, rel=0.01)


def test_pageable_copy_runs_at_the_pageable_fraction():
    h100 = GPUS["h100-sxm"]
    pinned, pageable = Copy(1, "d2h", 1 << 30, True), Copy(1, "d2h", 1 << 30, False)
    ratio = (copy_seconds(pinned, h100) - h100.copy_latency_s) / (copy_seconds(pageable, h100) - h100.copy_latency_s)
    assert ratio == pytest.approx(h100.pageable_fraction)


def test_attention_flops_match_torch_counter_and_flash_accounting():
    """Non-causal forward attention FLOPs equal torch's SDPA count (two batched matmuls, FLOPs not MACs);
    a causal mask halves them; the backward is 2.5 forwards."""
    b, h, s, d = 2, 8, 1024, 64
    q = (b, h, s, d)
    assert attention_flops(b, h, s, s, d, causal=False, backward=False) == flop_counter.sdpa_flop_count(q, q, q)
    fwd = attention_flops(b, h, s, s, d, causal=True, backward=False)
    assert fwd * 2 == 4 * b * h * s * s * d
    assert attention_flops(b, h, s, s, d, causal=True, backward=True) == fwd * 5 // 2


def test_hook_cost_comes_from_the_hook_cost_bench():
    """The hooks' host cost is bench.hook_cost's instruction count of the offload path over the stated
    instruction rate (the numbers in _cost follow bench/results/cpu/hook_cost.json)."""
    doc = json.loads((ROOT / "bench/results/cpu/hook_cost.json").read_text())
    v = doc["instructions"]["variants"]["ours_offload"]
    assert HOOK_COST["pack hook"] == pytest.approx(v["per_pack_ir"] / 3e9, rel=0.01)
    assert HOOK_COST["unpack hook"] == pytest.approx(v["per_unpack_ir"] / 3e9, rel=0.01)


def test_host_cost_per_item():
    """HostCost charges kernels and copies a launch, events an event call, hook work its measured cost."""
    hc = HostCost(op_s=5e-6, event_s=1e-6)
    assert hc(Kernel(0, "aten.mm.default", 1, 1, None)) == 5e-6
    assert hc(Copy(1, "d2h", 10, True)) == 5e-6
    assert hc(RecordEvent(0, 1)) == 1e-6
    assert hc(HostWork(1e-3, "pack hook")) == pytest.approx(1e-3 + HOOK_COST["pack hook"])
    assert hc(HostWork(2e-6, "disk write")) == 2e-6


def test_fresh_pinned_memory_costs_what_torchtitan_measured():
    """Pinning a fresh 320 MB buffer per copy turned a 53.1 GB/s copy into an 11.2 GB/s one: the copy plus
    the allocation take 320 MB / 11.2 GB/s."""
    n = 320_000_000
    assert n / 53.1e9 + pinned_alloc_seconds(n) == pytest.approx(n / 11.2e9)
