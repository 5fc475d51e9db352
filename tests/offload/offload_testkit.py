"""Shared models and checks for the offload engine tests.

Every correctness test here follows torchtune's pattern: build a model, take a
no-offload twin with ``copy.deepcopy`` before any step, run the same step on
both (the model under ``OffloadActivations``, the twin without), then compare
the loss and every gradient with ``torch.equal``. Offloading moves bytes and
must never change a single bit.

CPU tests use ``device="cpu"`` so the engine really copies CPU tensors into its
host pool and back; ``assert_really_offloaded`` guards against a pass-through
engine passing a bitwise test trivially.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.model import ToyLlama, ToyLlamaConfig, make_batch  # noqa: F401
from offload import OffloadActivations

__all__ = [
    "TINY",
    "MLP",
    "TanhMLP",
    "ConvNet",
    "make_model",
    "make_inputs",
    "loss_of",
    "cpu_ctx",
    "twin_of",
    "assert_same_grads",
    "assert_really_offloaded",
    "assert_reconciles",
    "grads_of",
    "Recorder",
    "no_gc",
]

TINY = ToyLlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, max_seq_len=64)
"""Toy Llama small enough for ms-scale CPU steps (2 blocks, h=32)."""

BATCH, SEQ = 2, 16


class MLP(nn.Module):
    """Linear -> GELU -> Linear -> SiLU -> Linear; every activation is worth offloading at min size 0."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.silu(self.fc2(F.gelu(self.fc1(x)))))


class TanhMLP(nn.Module):
    """Twice-differentiable MLP (tanh), for gradient-penalty double backward."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class ConvNet(nn.Module):
    """Conv -> BatchNorm -> ReLU -> MaxPool -> Conv -> GELU -> Linear (buffers included)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, 8, 8)
        h = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)  # (B, 8, 4, 4)
        h = F.gelu(self.conv2(h))
        return self.head(h.flatten(1))  # (B, 10)


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Reference counting only: what is freed here is not held by a cycle."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def make_model(kind: str, dtype: torch.dtype = torch.float32, *, seed: int = 0) -> nn.Module:
    """One of "mlp", "conv", "toy", "toy_tied" in ``dtype``, deterministically initialised."""
    torch.manual_seed(seed)
    if kind == "mlp":
        m: nn.Module = MLP()
    elif kind == "conv":
        m = ConvNet()
    elif kind == "toy":
        m = ToyLlama(TINY)
    elif kind == "toy_tied":
        m = ToyLlama(dataclasses.replace(TINY, tie_embeddings=True))
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    return m.to(dtype)


def make_inputs(kind: str, dtype: torch.dtype = torch.float32, *, seed: int = 1) -> tuple:
    """Deterministic inputs for ``make_model(kind)``: (x, target)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return torch.randn(16, 32, generator=g).to(dtype), torch.randint(0, 8, (16,), generator=g)
    if kind == "conv":
        return torch.randn(4, 3, 8, 8, generator=g).to(dtype), torch.randint(0, 10, (4,), generator=g)
    if kind in ("toy", "toy_tied"):
        return make_batch(TINY, BATCH, SEQ, seed=seed)
    raise ValueError(f"unknown model kind {kind!r}")


def loss_of(model: nn.Module, inputs: tuple) -> torch.Tensor:
    """Cross-entropy of the model's logits (float32 reduction for every dtype)."""
    x, y = inputs
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def cpu_ctx(**kwargs: Any) -> OffloadActivations:
    """An engine that really offloads CPU tensors: device="cpu", every size qualifies."""
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("min_offload_size", 0)
    return OffloadActivations(**kwargs)


def twin_of(model: nn.Module) -> nn.Module:
    """The no-offload reference: a deep copy taken before any step."""
    return copy.deepcopy(model)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def assert_same_grads(model: nn.Module, twin: nn.Module) -> None:
    """Every parameter's grad is bitwise equal (torch.equal) to the twin's; None matches None."""
    got, want = dict(model.named_parameters()), dict(twin.named_parameters())
    assert got.keys() == want.keys()
    checked = 0
    for name, p in got.items():
        q = want[name]
        if q.grad is None:
            assert p.grad is None, f"{name}: grad appeared only with offloading"
            continue
        assert p.grad is not None, f"{name}: grad missing with offloading"
        assert p.grad.dtype == q.grad.dtype and p.grad.shape == q.grad.shape, name
        assert torch.equal(p.grad, q.grad), (
            f"{name}: grads differ, max abs diff "
            f"{(p.grad.float() - q.grad.float()).abs().max().item():.3e}"
        )
        checked += 1
    assert checked > 0, "no parameter received a gradient: the test checks nothing"


def assert_really_offloaded(ctx: OffloadActivations) -> dict:
    """The engine moved bytes (so a pass-through engine cannot pass a bitwise test)."""
    s = ctx.ledger.summary()
    assert s["offloaded_bytes"] > 0 and s["offloaded_count"] > 0, s
    return s


def assert_reconciles(s: dict) -> None:
    """packed = offloaded + kept (bytes and counts), and kept_by_reason sums to kept."""
    assert s["packed_bytes"] == s["offloaded_bytes"] + s["kept_bytes"], s
    assert s["packed_count"] == s["offloaded_count"] + s["kept_count"], s
    assert sum(s["kept_by_reason"].values()) == s["kept_bytes"], s
    assert sum(s["kept_count_by_reason"].values()) == s["kept_count"], s


class Recorder:
    """Observer that keeps (tensor id, shape, record) for every pack of one engine.

    Holding ``id`` and not the tensor keeps the observer from extending lifetimes.
    """

    def __init__(self) -> None:
        self.events: list[tuple[int, tuple, Any]] = []

    def __call__(self, event: Any) -> None:
        self.events.append((id(event.tensor), tuple(event.tensor.shape), event.record))

    def records_for(self, t: torch.Tensor) -> list[Any]:
        # id() alone is reused once a saved temporary dies: match the storage too.
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            ptr = None  # no plain storage (sparse, subclasses): id only
        return [r for i, _, r in self.events if i == id(t) and (ptr is None or r.storage_key == ptr)]

    def by_reason(self, reason: str) -> list[Any]:
        return [r for _, _, r in self.events if r.reason == reason]

    @property
    def records(self) -> list[Any]:
        return [r for _, _, r in self.events]


def run_step(
    model: nn.Module,
    inputs: tuple,
    ctx: Any | None = None,
    *,
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor] = loss_of,
) -> torch.Tensor:
    """Forward (inside ``ctx`` when given) then backward outside it, as torchtune does."""
    if ctx is None:
        loss = loss_fn(model, inputs)
    else:
        with ctx:
            loss = loss_fn(model, inputs)
    loss.backward()
    return loss.detach()


__all__.append("run_step")
