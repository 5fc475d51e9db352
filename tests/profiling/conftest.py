"""Fixtures for the profiling tests (models live in _prof_models.py)."""

from __future__ import annotations

import pytest
import torch

from bench.model import ToyLlama, ToyLlamaConfig, make_batch

from _prof_models import MLP


@pytest.fixture
def mlp() -> MLP:
    return MLP()


@pytest.fixture
def toy() -> tuple[ToyLlama, torch.Tensor, torch.Tensor]:
    model = ToyLlama(ToyLlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=2))
    tokens, targets = make_batch(model.cfg, 2, 16)
    return model, tokens, targets
