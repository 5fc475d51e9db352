"""Property: for any small graph of ops, offloading every saved tensor changes no bit of any grad.

Hypothesis draws a few leaves (one of them a Parameter), a dtype, and a
sequence of ops (views, transposes, permutes, expands, slices, reductions,
elementwise and matmul; no in-place ops), optionally with the middle of the
graph under non-reentrant activation checkpointing and optionally with a
``retain_graph`` double backward. The same graph runs with and without
``OffloadActivations(device="cpu", min_offload_size=0)``; loss and every leaf
grad must be bitwise equal, the engine must see every saved tensor, and it
must never offload a Parameter or a view of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("hypothesis", reason="the property tests need hypothesis (pip install hypothesis)")

from hypothesis import HealthCheck, given, reject, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.autograd.graph import saved_tensors_hooks  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from offload import REASONS, is_static_tensor  # noqa: E402

from ._common import assert_ledger_consistent, engine, in_use_after_gc  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("OFFLOAD_PROPERTY_EXAMPLES", "60"))
MAX_NUMEL = 2048


def _fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        torch.broadcast_shapes(a.shape, b.shape)
        return True
    except RuntimeError:
        return False


def _unary(name: str, a: torch.Tensor) -> torch.Tensor:
    d = a.dim()
    if name == "t":
        return a.transpose(0, -1) if d >= 2 else a.unsqueeze(0).t()
    if name == "permute":
        return a.permute(*reversed(range(d))) if d else a
    if name == "narrow":
        return a.narrow(0, 1, a.size(0) - 1) if d and a.size(0) > 1 else a[...]
    if name == "flatten":
        return a.reshape(-1)
    if name == "unflatten":
        return a.view(2, -1) if d == 1 and a.numel() % 2 == 0 and a.numel() else a.unsqueeze(0)
    if name == "expand":
        return a.unsqueeze(0).expand(3, *a.shape)  # stride-0 view
    if name == "diag_view":
        return a.as_strided((min(a.shape[:2]),), (a.stride(0) + a.stride(1),), a.storage_offset()) if d == 2 else a
    if name == "sum":
        return a.sum(-1, keepdim=True) if d else a
    if name == "mean0":
        return a.mean(0) if d else a
    if name == "amax":
        return a.amax(-1) if d and a.size(-1) else a
    if name == "logsumexp":
        return a.float().logsumexp(-1).to(a.dtype) if d and a.size(-1) else a
    if name == "softmax":
        return a.softmax(-1) if d else a
    if name == "norm":
        return a.norm(dim=-1) if d and a.size(-1) else a
    if name == "index":
        return a.index_select(0, torch.tensor([0, 0]).clamp(max=a.size(0) - 1)) if d and a.size(0) else a
    if name == "contiguous":
        return a.contiguous()
    return {
        "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin, "square": torch.square,
        "relu": torch.relu, "gelu": nn.functional.gelu, "clone": torch.clone,
    }[name](a)


def _binary(name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _fits(a, b):
        b = a
    if name == "mul":
        return a * b
    if name == "add":
        return a + b
    if name == "div":
        return a / (b.abs() + 1)
    if name == "where":
        return torch.where(a > 0, a, b)
    if name == "matmul":
        if a.dim() == 2 and b.dim() == 2 and a.size(1) == b.size(1):
            return a @ b.t()
        if a.dim() == 2:
            return a @ a.t()
        return a * b
    if name == "cat":
        return torch.cat([a.reshape(-1), b.reshape(-1)])
    raise AssertionError(name)


UNARY = ("t", "permute", "narrow", "flatten", "unflatten", "expand", "diag_view", "sum", "mean0", "amax",
         "logsumexp", "softmax", "norm", "index", "contiguous", "tanh", "sigmoid", "sin", "square", "relu",
         "gelu", "clone")
BINARY = ("mul", "add", "div", "where", "matmul", "cat")


@dataclass(frozen=True)
class Graph:
    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]
    ops: tuple[tuple[str, int, int], ...]
    ckpt: tuple[int, int] | None
    """Op index range [lo, hi) run under non-reentrant checkpoint, or None."""
    twice: bool
    """Backward with retain_graph=True, then again (grads accumulate)."""
    seed: int


@st.composite
def graphs(draw) -> Graph:
    n_leaves = draw(st.integers(1, 3))
    shapes = tuple(
        tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))) for _ in range(n_leaves)
    )
    ops = tuple(
        (draw(st.sampled_from(UNARY + BINARY)), draw(st.integers(0, 63)), draw(st.integers(0, 63)))
        for _ in range(draw(st.integers(1, 10)))
    )
    ckpt = None
    if draw(st.booleans()) and len(ops) >= 2:
        lo = draw(st.integers(0, len(ops) - 1))
        ckpt = (lo, draw(st.integers(lo + 1, len(ops))))
    return Graph(
        dtype=draw(st.sampled_from((torch.float32, torch.float64, torch.bfloat16))),
        shapes=shapes, ops=ops, ckpt=ckpt, twice=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )


def _apply(pool: list[torch.Tensor], ops) -> list[torch.Tensor]:
    pool = list(pool)
    for name, i, j in ops:
        a, b = pool[i % len(pool)], pool[j % len(pool)]
        out = _unary(name, a) if name in UNARY else _binary(name, a, b)
        if out.numel() > MAX_NUMEL:
            out = out.sum()
        pool.append(out)
    return pool


def _leaves(g: Graph) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(g.seed)
    out = []
    for k, shape in enumerate(g.shapes):
        t = torch.randn(shape, generator=gen, dtype=torch.float64).to(g.dtype)
        out.append(nn.Parameter(t) if k == 0 else t.requires_grad_(k != 2))
    return out


def _run(g: Graph, ctx) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    leaves = _leaves(g)

    def forward():
        pool = list(leaves)
        if g.ckpt is None:
            pool = _apply(pool, g.ops)
        else:
            lo, hi = g.ckpt
            pool = _apply(pool, g.ops[:lo])
            n = len(pool)
            mid = checkpoint(lambda *ts: tuple(_apply(list(ts), g.ops[lo:hi])[n:]), *pool, use_reentrant=False)
            pool = _apply(pool + list(mid), g.ops[hi:])
        outs = [t for t in pool[len(leaves):] if t.requires_grad]
        if not outs:
            return None
        return sum((t.float().sum() * (0.5 + 0.25 * k) for k, t in enumerate(outs)), torch.zeros(()))

    with ctx:
        loss = forward()
    if loss is None:
        return None, []
    if g.twice:
        loss.backward(retain_graph=True)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


class _Count:
    """saved_tensors_hooks that only count: the reference run, and how many saves there are."""

    def __init__(self) -> None:
        self.n = 0
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        self.n += 1
        return t

    def __enter__(self):
        self._hooks.__enter__()

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_random_graph_grads_bitwise_equal(g: Graph):
    """Offloading every saved tensor of a random op graph leaves loss and grads bitwise unchanged."""
    count = _Count()
    try:
        want_loss, want = _run(g, count)
    except RuntimeError:
        reject()  # the graph itself is invalid (e.g. an op PyTorch rejects for this shape)
    ctx = engine()
    bad: list[str] = []
    ctx.add_observer(lambda ev: bad.append(str(tuple(ev.tensor.shape)))
                     if ev.record.decision == "offloaded" and is_static_tensor(ev.tensor) else None)
    got_loss, got = _run(g, ctx)
    if want_loss is None:
        assert got_loss is None
        return
    assert torch.equal(got_loss, want_loss), (got_loss, want_loss)
    for k, (x, y) in enumerate(zip(want, got)):
        assert (x is None) == (y is None), f"leaf {k}: grad present in only one run"
        if x is not None:
            assert x.shape == y.shape and x.stride() == y.stride(), (k, x.shape, x.stride(), y.stride())
            assert torch.equal(x, y), f"leaf {k}: grad differs, max abs diff {(x.double() - y.double()).abs().max()}"
    s = ctx.ledger.summary()
    assert s["packed_count"] == count.n, f"engine saw {s['packed_count']} saves, autograd made {count.n}"
    assert not bad, f"offloaded a Parameter or a view of one: {bad}"
    assert set(s["kept_count_by_reason"]) <= set(REASONS), s["kept_count_by_reason"]
    assert_ledger_consistent(s)
    assert in_use_after_gc(ctx) == 0
