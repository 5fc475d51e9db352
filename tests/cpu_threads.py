"""One intra-op thread for a test folder's tests: ``from cpu_threads import one_cpu_thread`` in its conftest.

The models in these folders are ms-scale, and on the shared 2-core CI machine two OpenMP threads contending
with other processes make a step 5-50x slower (a 50-step reliability run: 15 s with 2 threads, 1.7 s with
1). The thread count does not change a bitwise comparison: a twin and its offloaded run share the setting.
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["one_cpu_thread"]


@pytest.fixture(autouse=True)
def one_cpu_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
