"""Shared helpers for the reliability tests (issue 5).

One tiny ToyLlama config, a reference/offloaded twin pair, a training step
that runs the forward inside the engine and ``backward()`` outside it (as in
torchtune), and bitwise comparisons that name the first parameter that differs.
"""

from __future__ import annotations

import copy
import gc
import os

import torch
import torch.nn.functional as F
from torch import nn

from bench.model import ToyLlama, ToyLlamaConfig, make_batch

__all__ = [
    "CFG",
    "make_model",
    "twin",
    "train_step",
    "grads_of",
    "assert_grads_equal",
    "assert_params_equal",
    "assert_ledger_consistent",
    "engine",
    "in_use_after_gc",
    "rss_bytes",
    "make_batch",
]

CFG = ToyLlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, max_seq_len=128)
"""Small enough that one fwd+bwd is a few ms on the 2-core CI machine."""


def make_model(seed: int = 0, cfg: ToyLlamaConfig = CFG) -> ToyLlama:
    torch.manual_seed(seed)
    return ToyLlama(cfg)


def twin(model: nn.Module) -> nn.Module:
    """An identical copy: the no-offload reference for ``model``."""
    return copy.deepcopy(model)


def train_step(model: nn.Module, batch, ctx=None) -> torch.Tensor:
    """Forward (inside ``ctx`` when given), next-token loss, backward outside ``ctx``."""
    tokens, targets = batch
    if ctx is None:
        logits = model(tokens)  # (B, T, vocab)
    else:
        with ctx:
            logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    return loss.detach()


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "to_local"):  # DTensor under FSDP2
            g = g.to_local()
        out[name] = None if g is None else g.detach().clone()
    return out


def assert_grads_equal(ref: nn.Module | dict, got: nn.Module | dict, what: str = "") -> None:
    """Every grad bitwise equal (torch.equal); the message names the first that is not."""
    a = ref if isinstance(ref, dict) else grads_of(ref)
    b = got if isinstance(got, dict) else grads_of(got)
    assert a.keys() == b.keys(), f"{what}: parameter names differ: {sorted(a)} vs {sorted(b)}"
    for name in a:
        x, y = a[name], b[name]
        if x is None or y is None:
            assert x is None and y is None, f"{what}: grad of {name} is None in only one run"
            continue
        assert torch.equal(x, y), (
            f"{what}: grad of {name} differs with offloading: "
            f"max abs diff {(x.double() - y.double()).abs().max().item():.3e}"
        )


def assert_params_equal(ref: nn.Module, got: nn.Module, what: str = "") -> None:
    for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), f"{what}: parameter {name} differs"


def assert_ledger_consistent(summary: dict) -> None:
    """packed = offloaded + kept, in bytes and in counts; kept splits exactly by reason."""
    s = summary
    assert s["packed_bytes"] == s["offloaded_bytes"] + s["kept_bytes"], s
    assert s["packed_count"] == s["offloaded_count"] + s["kept_count"], s
    assert sum(s["kept_by_reason"].values()) == s["kept_bytes"], s
    assert sum(s["kept_count_by_reason"].values()) == s["kept_count"], s


def engine(**kw):
    """An engine that really offloads on CPU (device="cpu"), everything by default."""
    from offload import OffloadActivations

    kw.setdefault("device", "cpu")
    kw.setdefault("min_offload_size", 0)
    return OffloadActivations(**kw)


def in_use_after_gc(ctx) -> int:
    gc.collect()
    return ctx.pool.stats()["in_use_bytes"]


def rss_bytes() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss
