"""Fixtures for the prediction tests (models live in predict_testkit.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """One intra-op thread: the models here are tiny, and the machine is shared."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
