"""Helpers shared by the planner tests: the tiny toy Llama and its step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.model import ToyLlama, ToyLlamaConfig, make_batch

CFG = ToyLlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=128)


def make_model_and_step(seed: int = 0):
    """A 4-block toy Llama (h=64) and a zero-argument step returning its loss (batch 2, seq 64)."""
    torch.manual_seed(seed)
    model = ToyLlama(CFG)
    tokens, targets = make_batch(CFG, 2, 64)

    def step() -> torch.Tensor:
        logits = model(tokens)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return model, step
