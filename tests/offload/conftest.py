"""Fixtures for the offload engine tests (shared helpers live in offload_testkit.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """Run each test with one intra-op thread: the models here are ms-scale, and on a shared 2-core
    machine two OpenMP threads contending with other processes make a step 5-50x slower."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


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
