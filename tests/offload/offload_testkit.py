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


class SaveView(torch.autograd.Function):
    """y = 3x; saves ``make_view(x)`` and reports what backward gets back for it."""

    @staticmethod
    def forward(ctx, x, make_view, seen):
        v = make_view(x)
        ctx.save_for_backward(v)
        ctx.seen = seen
        return x * 3

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        ctx.seen.append(
            dict(size=v.size(), stride=v.stride(), dtype=v.dtype, device=v.device, value=v.detach().clone(),
                 offset=v.storage_offset(), ptr=v.data_ptr())
        )
        return g * 3 + v.sum(), None, None


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


# -- the pack hook's fast paths against the general path ---------------------------------


def saved_tensor_cases(p: nn.Parameter, frozen: nn.Parameter, n: int, dtype: torch.dtype) -> dict:
    """Tensors the pack hook meets, by kind (built outside any engine: nothing here is packed)."""
    import warnings

    act = (torch.randn(n, requires_grad=True) * 2).to(dtype)
    flagged = torch.randn(n)
    flagged._is_param = True  # what nn.Parameter sets on tensors it cannot subclass
    flagged_act = torch.randn(n, requires_grad=True).sin()
    flagged_act._is_param = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested / quantized construction warnings
        nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
        quantized = torch.quantize_per_tensor(torch.randn(n), 0.1, 0, torch.qint8)
    return {
        "activation": act,
        "activation_view": act[1:],
        "activation_t": act.view(2, n // 2).t(),  # not contiguous, the whole storage
        "activation_head": act[: n // 2],
        "activation_mid": act[n // 4: 3 * n // 4],  # overlaps the head from an offset
        "activation_strided": act[::2],  # gaps: its span is longer than its bytes
        "leaf_input": torch.randn(n, requires_grad=True),
        "no_grad_leaf": torch.randn(n).to(dtype),
        "int_leaf": torch.randint(0, 9, (n,)),
        "parameter": p,
        "frozen_parameter": frozen,
        "parameter_view": p.view(2, n // 2).t(),  # history: a non-leaf view of a weight
        "frozen_parameter_view": frozen[::2],  # no history: a leaf view of a weight
        "parameter_alias": p.detach(),  # a weight's storage through a plain tensor (static ptrs)
        "flagged_leaf": flagged,
        "flagged_with_history": flagged_act,
        "empty": torch.empty(0, requires_grad=True) * 1,
        "scalar": torch.tensor(3.0, requires_grad=True) * 2,
        "meta": torch.empty(n, device="meta", requires_grad=True) * 2,
        "nested": nested,
        "quantized": quantized,
        "sparse": torch.randn(4, 4).to_sparse(),
        # Lazy bits on the view, not in the bytes (Rule 5): a conjugate view of a complex activation,
        # and a negative view of a real one.
        "conj_view": (torch.randn(n, dtype=torch.cfloat, requires_grad=True) * 2).conj(),
        "neg_view": torch._neg_view(act),
    }


SAVED_TENSOR_KINDS = sorted(saved_tensor_cases(
    nn.Parameter(torch.zeros(8)), nn.Parameter(torch.zeros(8), requires_grad=False), 8, torch.float32))
"""The kinds ``saved_tensor_cases`` builds, plus "buffer" (a running module's buffer) when a model is given."""

RECORD_FIELDS = ("step", "nbytes", "shape", "dtype", "device", "module", "decision", "reason", "storage_key",
                 "storage_nbytes", "copy_bytes", "note")
"""PackRecord fields two engines that decided alike agree on (all but seq and timings)."""


def assert_pack_matches_general(kinds: list[str], min_size: int, excluded: bool, after_head: bool,
                                with_model: bool, dtype: torch.dtype, in_backward: bool, *,
                                native: bool = False) -> None:
    """Pack ``kinds`` through the engine's fast hook (``_pack``, or with ``native`` the C++ hook
    ``__enter__`` pushes) and through the general path (``_pack_other``, via ``policy.classify``):
    equal records, totals and unique bytes, and handles that unpack to equal values."""

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.randn(8))
            self.frozen = nn.Parameter(torch.randn(8), requires_grad=False)
            self.register_buffer("table", torch.randn(8))

        def forward(self, run):
            return run(self)

    torch.manual_seed(0)
    holder = Holder()
    cases = saved_tensor_cases(holder.p, holder.frozen, 8, dtype)
    cases["buffer"] = holder.table
    kinds = list(kinds) + (["buffer"] if with_model else [])
    model = holder if with_model else None
    engines = [OffloadActivations(device="cpu", min_offload_size=min_size, model=model, native_hooks=native),
               OffloadActivations(device="cpu", min_offload_size=min_size, model=model)]

    def run(module):
        handles: tuple[list, list] = ([], [])
        for eng in engines:
            ts = eng._thread()
            ts.excluded_depth = int(excluded)
            ts.after_head = after_head
        fast = engines[0]._native.hook_for(engines[0], engines[0]._thread()) if native else engines[0]._pack
        for kind in kinds:
            t = cases[kind]
            handles[0].append(fast(t))
            handles[1].append(engines[1]._pack_other(t))
        return handles

    class Backward(torch.autograd.Function):  # packs made while a backward pass runs (Rule 11)
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            got.append(holder(run))
            return g

    got: list = []
    y = Backward.apply(torch.randn(2, requires_grad=True)).sum()  # (built before the engines: nothing saved)
    with engines[0], engines[1]:
        if in_backward:
            y.backward()
        else:
            got.append(holder(run))
    fast_handles, general_handles = got[0]
    recs = [list(e.ledger.records) for e in engines]
    assert len(recs[0]) == len(recs[1]) == len(kinds)
    for kind, a, b in zip(kinds, *recs):
        have = {f: getattr(a, f) for f in RECORD_FIELDS}
        want = {f: getattr(b, f) for f in RECORD_FIELDS}
        assert have == want, (kind, have, want)
    sums = [e.ledger.summary() for e in engines]
    for key in ("packed_count", "packed_bytes", "offloaded_count", "offloaded_bytes", "kept_count", "kept_bytes",
                "kept_by_reason", "kept_count_by_reason", "unique_bytes", "d2h_bytes"):
        assert sums[0][key] == sums[1][key], (key, sums[0][key], sums[1][key])
    for kind, ha, hb in zip(kinds, fast_handles, general_handles):
        if kind in ("meta", "nested", "quantized", "sparse"):
            continue  # no values to compare (or no torch.equal for them): the records above decide
        ua, ub = engines[0].unpack_hook(ha), engines[1].unpack_hook(hb)
        assert torch.equal(ua, ub) and ua.stride() == ub.stride(), kind


def pack_case_strategies() -> dict[str, Any]:
    """Hypothesis strategies for ``assert_pack_matches_general``'s arguments (``@given(**...)``)."""
    from hypothesis import strategies as st

    return dict(kinds=st.lists(st.sampled_from(SAVED_TENSOR_KINDS), min_size=1, max_size=6),
                min_size=st.sampled_from([0, 16, 1 << 40]), excluded=st.booleans(), after_head=st.booleans(),
                with_model=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
                in_backward=st.booleans())


def compiled_toy_reference(n_layers: int = 1, backend: Any = "inductor") -> tuple[nn.Module, nn.Module, tuple,
                                                                                 torch.Tensor, dict]:
    """A toy Llama, its ``torch.compile``'d module (``backend``), inputs, and the compiled loss and grads
    without offloading (same kernels, same numerics); grads are zeroed after. Call
    ``torch._dynamo.reset()`` around it."""
    torch.manual_seed(0)
    model = ToyLlama(dataclasses.replace(TINY, n_layers=n_layers))
    compiled = torch.compile(model, backend=backend)
    inputs = make_inputs("toy")
    want = loss_of(compiled, inputs)
    want.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return model, compiled, inputs, want, ref


def require_native():
    """The C++ extension (offload._native), loaded; skips where it cannot be built, except in CI
    (``CI=true``), where that is a failure: CI must test it."""
    import os

    import pytest

    from offload import _native

    try:
        return _native.load(announce=False)
    except _native.NativeUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build offload's native extension: {e}")
        pytest.skip(f"offload's native extension cannot be built here: {e}")
