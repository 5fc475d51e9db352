"""Shared tiny toy Llama and one profiled plan for the planner tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.model import ToyLlama, ToyLlamaConfig, make_batch

CFG = ToyLlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=128)


def make_model_and_step(seed: int = 0):
    torch.manual_seed(seed)
    model = ToyLlama(CFG)
    tokens, targets = make_batch(CFG, 2, 64)

    def step() -> torch.Tensor:
        logits = model(tokens)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return model, step


@pytest.fixture(scope="module")
def profiled():
    """One profile of the toy model (budget above the no-plan peak: all keep)."""
    import offload

    torch.set_num_threads(1)
    model, step = make_model_and_step()
    plan = offload.plan(model, step, budget_bytes=1 << 40, timed=1, bandwidth_gb_s=10.0)
    return model, step, plan
