"""One profiled plan of the toy model, shared by the planner tests."""

from __future__ import annotations

import pytest
import torch
from planner_testkit import make_model_and_step


@pytest.fixture(scope="module")
def profiled():
    """One profile of the toy model (budget above the no-plan peak: all keep)."""
    import offload

    torch.set_num_threads(1)
    model, step = make_model_and_step()
    plan = offload.plan(model, step, budget_bytes=1 << 40, timed=1, bandwidth_gb_s=10.0)
    return model, step, plan
