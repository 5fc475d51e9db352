"""Fixtures for the integration tests (attach, config, HF / Lightning / peers' call forms)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# The engine tests' shared helpers (toy models, bitwise grad checks).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "offload"))


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """One intra-op thread: the models are tiny and the CI machine has 2 shared cores."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
