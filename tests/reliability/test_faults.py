"""Faults around the engine: it stays consistent, the next step is exact, nothing leaks.

Each test breaks one step in a different place, then checks three things:
the pool has nothing in use once the broken graph is collected, the engine
holds no reference to the broken step's activations, and the next step's loss
and grads equal a never-broken twin's bitwise.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload import OffloadError, active_engine

from ._common import (
    CFG,
    assert_grads_equal,
    assert_ledger_consistent,
    engine,
    in_use_after_gc,
    make_batch,
    make_model,
    train_step,
    twin,
)


class Boom(RuntimeError):
    """The injected fault."""


class RaiseInBackward(torch.autograd.Function):
    """Identity in forward (saving its input), raises in backward once armed."""

    armed = True

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if RaiseInBackward.armed:
            raise Boom("injected fault in backward")
        return grad


def _raise_message(exc_type, fn, *args, **kwargs) -> str:
    """Call ``fn``, expect ``exc_type``, return its message and drop its traceback
    (a live traceback would keep the broken graph, and so its host copies, alive)."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return str(e)
    raise AssertionError(f"expected {exc_type.__name__}")


def _raise_in_forward(module, args, out):
    raise Boom("injected fault in forward")


def _watch_block_output(model) -> tuple[list, object]:
    """Weak references to every block-0 output made while the hook is installed."""
    refs: list = []
    h = model.layers[0].register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
    return refs, h


def _assert_no_leak(ctx, refs, what: str) -> None:
    gc.collect()
    alive = [r for r in refs if r() is not None]
    assert not alive, f"{what}: {len(alive)} activation(s) of the broken step are still referenced"
    assert ctx.pool.stats()["in_use_bytes"] == 0, f"{what}: pool still in use: {ctx.pool.stats()}"
    assert active_engine() is None, f"{what}: an engine is still active on this thread"


def _assert_next_step_exact(model, ref, ctx, seed: int = 7) -> None:
    """One clean step on ``model`` (under ``ctx``) and its twin ``ref`` (without): bitwise equal."""
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    batch = make_batch(CFG, 2, 24, seed=seed)
    before = ctx.ledger.summary()["offloaded_count"]
    loss_ref = train_step(ref, batch)
    loss = train_step(model, batch, ctx)
    assert torch.equal(loss, loss_ref)
    assert_grads_equal(ref, model, "step after the fault")
    assert ctx.ledger.summary()["offloaded_count"] > before, "the clean step offloaded nothing"
    assert in_use_after_gc(ctx) == 0
    assert_ledger_consistent(ctx.ledger.summary())


def test_exception_in_forward():
    """An exception mid-forward leaves no hooks installed, nothing in use, nothing referenced."""
    model = make_model()
    ref = twin(model)
    ctx = engine()
    refs, watch = _watch_block_output(model)
    fault = model.layers[1].register_forward_hook(_raise_in_forward)
    _raise_message(Boom, train_step, model, make_batch(CFG, 2, 16), ctx)
    fault.remove()
    watch.remove()
    assert ctx.ledger.summary()["offloaded_count"] > 0, "fault fired before anything was offloaded"
    _assert_no_leak(ctx, refs, "exception in forward")
    # The hooks are gone: a forward outside the context packs nothing into this engine.
    packed = ctx.ledger.summary()["packed_count"]
    train_step(twin(ref), make_batch(CFG, 2, 16))
    assert ctx.ledger.summary()["packed_count"] == packed
    _assert_next_step_exact(model, ref, ctx)


def _fail_in_backward(model, ctx) -> None:
    """One step whose backward raises inside a custom Function in block 1."""
    inject = model.layers[1].register_forward_hook(lambda m, a, out: RaiseInBackward.apply(out))
    RaiseInBackward.armed = True
    try:
        msg = _raise_message(Boom, train_step, model, make_batch(CFG, 2, 16), ctx)
    finally:
        RaiseInBackward.armed = False
        inject.remove()
    assert "injected" in msg


def test_exception_in_backward_releases_everything():
    """A custom Function raising in backward leaves nothing in use once the graph is collected."""
    model = make_model()
    ctx = engine()
    refs, watch = _watch_block_output(model)
    _fail_in_backward(model, ctx)
    watch.remove()
    _assert_no_leak(ctx, refs, "exception in backward")


def test_exception_in_backward_next_step_exact():
    """After a backward that raised, the engine is usable: the next step is exact and drains the pool."""
    model = make_model()
    ref = twin(model)
    ctx = engine()
    refs, watch = _watch_block_output(model)
    _fail_in_backward(model, ctx)
    watch.remove()
    gc.collect()
    assert not [r for r in refs if r() is not None], "the failed step's activations are still referenced"
    assert active_engine() is None
    _assert_next_step_exact(model, ref, ctx)


def test_abort_between_forward_and_backward():
    """Dropping a graph without backward releases its host copies; the next step is exact."""
    model = make_model()
    ref = twin(model)
    ctx = engine()
    refs, watch = _watch_block_output(model)
    tokens, _ = make_batch(CFG, 2, 16)
    with ctx:
        logits = model(tokens)
    watch.remove()
    assert ctx.pool.stats()["in_use_bytes"] > 0, "nothing held on the host before the abort"
    del logits
    _assert_no_leak(ctx, refs, "abort before backward")
    _assert_next_step_exact(model, ref, ctx)


def test_several_aborted_forwards_then_step():
    """Three forwards dropped without backward, then a normal step: no growth, exact grads."""
    model = make_model()
    ref = twin(model)
    ctx = engine()
    for seed in range(3):
        with ctx:
            out = model(make_batch(CFG, 2, 16, seed=seed)[0])
        del out
        assert in_use_after_gc(ctx) == 0
    _assert_next_step_exact(model, ref, ctx)


def _two_heads(model, tokens):
    logits = model(tokens)  # (B, T, vocab)
    aux = torch.tanh(model.tok_embeddings(tokens) @ model.output.weight.t())  # a second head, (B, T, vocab)
    return logits, aux


def test_branch_backpropagated_late_or_never():
    """Saved tensors of a branch the step's backward does not reach stay valid after the step
    closes (a later backward through it is exact) and are released when the branch is dropped."""
    model = make_model()
    ref = twin(model)
    ctx = engine()
    tokens, targets = make_batch(CFG, 2, 16)
    with ctx:
        logits, aux = _two_heads(model, tokens)
    logits_r, aux_r = _two_heads(ref, tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(logits_r.flatten(0, 1), targets.flatten()).backward()
    assert_grads_equal(ref, model, "main loss")
    assert ctx.ledger.summary()["steps"] == 1
    assert in_use_after_gc(ctx) > 0, "the un-backpropagated branch's host copies were released early"
    aux.square().mean().backward()
    aux_r.square().mean().backward()
    assert_grads_equal(ref, model, "late backward through the second head")
    with ctx:
        unused = _two_heads(model, tokens)  # never backpropagated at all
    assert in_use_after_gc(ctx) > 0
    del unused, aux, logits
    assert in_use_after_gc(ctx) == 0
    assert_ledger_consistent(ctx.ledger.summary())


def test_model_that_saves_nothing():
    """A forward that saves no tensor for backward: no records, exact grads, no error."""
    w = nn.Parameter(torch.randn(16, 16))
    w_ref = nn.Parameter(w.detach().clone())
    ctx = engine()
    with ctx:
        loss = (w + 1.0).sum()  # add and sum save no tensor
    loss.backward()
    (w_ref + 1.0).sum().backward()
    assert torch.equal(w.grad, w_ref.grad)
    s = ctx.ledger.summary()
    assert s["packed_count"] == 0, s
    assert_ledger_consistent(s)
    assert in_use_after_gc(ctx) == 0


def _zero_size_graph(x, w, e):
    y = torch.tanh(x @ w)  # (0, 16): saves the empty x and the empty output
    z = (e.transpose(0, 2) * 2.0).sigmoid()  # (3, 0, 4) non-contiguous empty
    full = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    return (full @ w).exp().sum() + y.sum() + z.sum() + torch.cat([y, full @ w]).pow(2).sum()


def test_zero_size_tensors():
    """Zero-element saves (contiguous and strided) pass through; grads are exact."""
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(0, 16, requires_grad=True)
    e = torch.randn(4, 0, 3, requires_grad=True)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (x, w, e)]
    ctx = engine()
    with ctx:
        loss = _zero_size_graph(x, w, e)
    loss.backward()
    _zero_size_graph(ref_leaves[0], ref_leaves[1], ref_leaves[2]).backward()
    for got, want in zip((x, w, e), ref_leaves):
        assert got.grad.shape == want.grad.shape
        assert torch.equal(got.grad, want.grad)
    s = ctx.ledger.summary()
    assert s["offloaded_count"] > 0, s
    zero = [r for r in ctx.ledger.records if r.nbytes == 0]
    assert zero and all(r.decision == "kept" for r in zero), zero
    assert_ledger_consistent(s)
    assert in_use_after_gc(ctx) == 0


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _mlp_step(model, x, ctx=None):
    if ctx is None:
        loss = model(x).square().sum()
    else:
        with ctx:
            loss = model(x).square().sum()
    loss.backward()
    return loss.detach()


BUDGET = 4096
SMALL = (4, 16)  # 256 B per saved activation: a whole step fits in BUDGET
LARGE = (128, 16)  # 8 KiB per saved activation: one tensor is 2x BUDGET


@pytest.mark.parametrize("policy", ["keep", "pageable", "raise"])
def test_single_tensor_larger_than_budget(policy):
    """One saved tensor bigger than host_budget_bytes follows the policy; the next step is exact."""
    torch.manual_seed(0)
    model = Mlp()
    ref = twin(model)
    ctx = engine(host_budget_bytes=BUDGET, on_host_budget=policy)
    x = torch.randn(*LARGE)
    if policy == "raise":
        msg = _raise_message(OffloadError, _mlp_step, model, x, ctx)
        assert "host_budget_bytes" in msg and str(BUDGET) in msg, msg
        assert active_engine() is None
        assert in_use_after_gc(ctx) == 0
        model.zero_grad(set_to_none=True)
    else:
        assert torch.equal(_mlp_step(model, x, ctx), _mlp_step(ref, x))
        assert_grads_equal(ref, model, f"large tensor, policy {policy}")
        s = ctx.ledger.summary()
        if policy == "keep":
            assert s["kept_count_by_reason"].get("host_budget", 0) > 0, s
        else:
            assert s["kept_count_by_reason"].get("host_budget", 0) == 0, s
            assert s["offloaded_count"] > 0, s
        assert_ledger_consistent(s)
        assert ctx.pool.stats()["peak_reserved_bytes"] <= BUDGET, ctx.pool.stats()
        assert in_use_after_gc(ctx) == 0
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    # The same engine then handles a step that fits its budget, exactly.
    x = torch.randn(*SMALL)
    assert torch.equal(_mlp_step(model, x, ctx), _mlp_step(ref, x))
    assert_grads_equal(ref, model, f"small step after the large one, policy {policy}")
    assert ctx.ledger.records[-1].decision == "offloaded"
    assert in_use_after_gc(ctx) == 0
