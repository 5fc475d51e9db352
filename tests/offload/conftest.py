"""Fixtures for the offload engine tests (shared helpers live in offload_testkit.py)."""

from __future__ import annotations

import pytest

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
