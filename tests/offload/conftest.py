"""Fixtures for the offload engine tests (shared helpers live in offload_testkit.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch.nn.functional as F

from cpu_threads import one_cpu_thread  # autouse: one intra-op thread

__all__ = ["one_cpu_thread"]  # a fixture pytest finds here by name


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu),
                        pytest.param("emulated", marks=pytest.mark.emulated)])
def accel(request):
    """The accelerator of an ordering test: CUDA (marked gpu, skipped without one) and the emulator
    (late data + checker, marked emulated), which must report no hazard (accel_testkit.Accel)."""
    from accel_testkit import Accel

    a = Accel(request.param)
    with a:
        yield a
    a.check()


@pytest.fixture
def fake_libraries(monkeypatch):
    """Fake liger_kernel and cut_cross_entropy modules whose functions compute the loss with torch ops
    (reduction "sum") and count their calls."""
    calls = {"liger": 0, "cut_cross_entropy": 0}

    def make(name):
        def fn(h, w, y, bias=None, ignore_index=-100, reduction="mean"):
            calls[name] += 1
            return F.cross_entropy(F.linear(h, w, bias).float(), y, ignore_index=ignore_index, reduction=reduction)
        return fn

    liger = types.ModuleType("liger_kernel.transformers.functional")
    liger.liger_fused_linear_cross_entropy = make("liger")
    cce = types.ModuleType("cut_cross_entropy")
    cce.linear_cross_entropy = make("cut_cross_entropy")
    mods = {"liger_kernel": types.ModuleType("liger_kernel"),
            "liger_kernel.transformers": types.ModuleType("liger_kernel.transformers"),
            "liger_kernel.transformers.functional": liger, "cut_cross_entropy": cce}
    for k, v in mods.items():
        monkeypatch.setitem(sys.modules, k, v)
    return calls, monkeypatch
