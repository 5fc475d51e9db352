"""Every autograd pattern works under offloading, bit for bit (DESIGN.md Rule 1: a handle owns its
host copy until autograd drops it, so there is no forward/backward phase state machine to break)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from offload_testkit import (
    Recorder,
    TanhMLP,
    assert_reconciles,
    assert_really_offloaded,
    assert_same_grads,
    cpu_ctx,
    loss_of,
    make_inputs,
    make_model,
    run_step,
    twin_of,
)


def _in_use(ctx) -> int:
    gc.collect()
    return ctx.pool.stats()["in_use_bytes"]


# --------------------------------------------------------------------------- re-entry


def test_retain_graph_then_second_backward():
    """Rule 1: backward(retain_graph=True) then backward() unpacks every handle twice, grads bitwise."""
    model, inputs = make_model("toy"), make_inputs("toy")
    twin = twin_of(model)
    ctx = cpu_ctx()
    want = loss_of(twin, inputs)
    want.backward(retain_graph=True)
    want.backward()
    with ctx:
        got = loss_of(model, inputs)
    got.backward(retain_graph=True)
    assert ctx.pool.stats()["in_use_bytes"] > 0, "Rule 1: host copies must outlive the first unpack"
    got.backward()
    assert torch.equal(got, want)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
    assert ctx.ledger.summary()["steps"] == 2
    del got
    assert _in_use(ctx) == 0


def test_retain_graph_three_backwards_then_free():
    """Rule 1: a retained graph survives three backwards; its host copies go when the graph is dropped."""
    model, inputs = make_model("mlp"), make_inputs("mlp")
    twin = twin_of(model)
    ctx = cpu_ctx()
    want = loss_of(twin, inputs)
    with ctx:
        got = loss_of(model, inputs)
    for _ in range(3):
        want.backward(retain_graph=True)
        got.backward(retain_graph=True)
    assert_same_grads(model, twin)
    assert ctx.pool.stats()["in_use_bytes"] > 0
    del got
    assert _in_use(ctx) == 0, "dropping the retained graph must release every host copy"


def test_autograd_grad_wrt_params_and_input():
    """torch.autograd.grad (not .backward) through offloaded tensors equals the twin's, inputs included."""
    model = make_model("mlp")
    twin = twin_of(model)
    x, y = make_inputs("mlp")
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ctx = cpu_ctx()
    want = torch.autograd.grad(loss_of(twin, (x1, y)), [x1, *twin.parameters()])
    with ctx:
        loss = loss_of(model, (x2, y))
    got = torch.autograd.grad(loss, [x2, *model.parameters()])
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"grad #{i} differs"
    assert_really_offloaded(ctx)
    assert ctx.ledger.summary()["steps"] == 1


def test_double_backward_gradient_penalty():
    """Double backward (a gradient penalty through tanh) works on offloaded tensors, bitwise."""
    model = TanhMLP()
    twin = twin_of(model)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 16, generator=g)
    ctx = cpu_ctx()

    def penalised(m, x, ctx=None):
        x = x.clone().requires_grad_()
        if ctx is None:
            out = m(x)
        else:
            with ctx:
                out = m(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = out.mean() + gx.pow(2).sum()
        loss.backward()
        return loss.detach()

    want = penalised(twin, x)
    got = penalised(model, x, ctx)
    assert torch.equal(got, want)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
    assert _in_use(ctx) == 0


# --------------------------------------------------------------------------- several graphs


def test_two_forwards_summed_one_backward():
    """Two forwards in one context, losses summed, one backward: bitwise, one ledger step."""
    model = make_model("toy")
    twin = twin_of(model)
    a, b = make_inputs("toy", seed=1), make_inputs("toy", seed=2)
    ctx = cpu_ctx()
    want = loss_of(twin, a) + loss_of(twin, b)
    want.backward()
    with ctx:
        got = loss_of(model, a) + loss_of(model, b)
    got.backward()
    assert torch.equal(got, want)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
    assert ctx.ledger.summary()["steps"] == 1
    assert _in_use(ctx) == 0


def test_two_contexts_entered_then_backward_in_reverse_order():
    """Forward f1, forward f2 (each its own `with`), then backward f2 before f1: bitwise, two steps."""
    model = make_model("toy")
    twin = twin_of(model)
    a, b = make_inputs("toy", seed=1), make_inputs("toy", seed=2)
    ctx = cpu_ctx()
    w1, w2 = loss_of(twin, a), loss_of(twin, b)
    w2.backward()
    w1.backward()
    with ctx:
        l1 = loss_of(model, a)
    with ctx:
        l2 = loss_of(model, b)
    l2.backward()
    assert ctx.pool.stats()["in_use_bytes"] > 0, "f1's host copies must survive f2's backward"
    l1.backward()
    assert torch.equal(l1, w1) and torch.equal(l2, w2)
    assert_same_grads(model, twin)
    assert ctx.ledger.summary()["steps"] == 2
    assert _in_use(ctx) == 0


def test_backward_of_first_forward_between_two_forwards():
    """f1 forward, f2 forward, backward f1, a new f3 forward, then backward f2 and f3: bitwise."""
    model = make_model("mlp")
    twin = twin_of(model)
    ins = [make_inputs("mlp", seed=s) for s in (1, 2, 3)]
    ctx = cpu_ctx()
    w = [loss_of(twin, ins[0]), loss_of(twin, ins[1])]
    w[0].backward()
    w.append(loss_of(twin, ins[2]))
    w[1].backward()
    w[2].backward()
    with ctx:
        l1 = loss_of(model, ins[0])
        l2 = loss_of(model, ins[1])
    l1.backward()
    with ctx:
        l3 = loss_of(model, ins[2])
    l2.backward()
    l3.backward()
    for a, b in zip((l1, l2, l3), w):
        assert torch.equal(a, b)
    assert_same_grads(model, twin)
    assert ctx.ledger.summary()["steps"] == 3
    assert _in_use(ctx) == 0


def test_grad_accumulation_four_micro_batches():
    """Gradient accumulation over 4 micro-batches equals the twin's accumulated grads bitwise."""
    model = make_model("toy", torch.bfloat16)
    twin = twin_of(model)
    ctx = cpu_ctx()
    for i in range(4):
        inputs = make_inputs("toy", seed=20 + i)
        want = run_step(twin, inputs)
        got = run_step(model, inputs, ctx)
        assert torch.equal(got, want), f"micro-batch {i}"
        assert ctx.pool.stats()["in_use_bytes"] == 0, f"micro-batch {i} leaked host buffers"
    assert_same_grads(model, twin)
    s = assert_really_offloaded(ctx)
    assert s["steps"] == 4
    assert_reconciles(s)


def test_forward_without_backward_releases_everything():
    """A forward whose graph is dropped unused (eval-style) frees its host copies; the next step is exact."""
    model = make_model("mlp")
    twin = twin_of(model)
    ctx = cpu_ctx()
    with ctx:
        unused = loss_of(model, make_inputs("mlp", seed=5))
    assert ctx.pool.stats()["in_use_bytes"] > 0
    del unused
    assert _in_use(ctx) == 0
    inputs = make_inputs("mlp")
    assert torch.equal(run_step(model, inputs, ctx), run_step(twin, inputs))
    assert_same_grads(model, twin)


# --------------------------------------------------------------------------- checkpoint


class _CkptNet(nn.Module):
    """pre Linear -> checkpoint(block) -> post Linear; the block saves 5 tensors of its own."""

    def __init__(self, use_ckpt: bool) -> None:
        super().__init__()
        self.use_ckpt = use_ckpt
        self.pre = nn.Linear(16, 16)
        self.block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.post = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        h = checkpoint(self.block, h, use_reentrant=False) if self.use_ckpt else self.block(h)
        return self.post(h)


def _count_saved(fn) -> int:
    """How many saved tensors plain (non-engine) hooks see while running ``fn``."""
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return n[0], out


def test_checkpoint_inside_ctx_only_checkpoint_inputs_reach_engine():
    """Non-reentrant checkpoint inside the context: the engine packs only the checkpoint's input, bitwise."""
    model = _CkptNet(use_ckpt=True)
    twin = twin_of(model)
    x, y = make_inputs("mlp")
    x = x[:, :16].contiguous()
    n_plain, want = _count_saved(lambda: twin(x).pow(2).sum())
    n_no_ckpt, _ = _count_saved(lambda: _CkptNet(False)(x).pow(2).sum())
    assert n_plain < n_no_ckpt  # sanity: checkpoint hides the block's saves from outer hooks
    want.backward()
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        got = model(x).pow(2).sum()
    assert ctx.ledger.summary()["packed_count"] == n_plain, "the engine saw tensors saved inside the block"
    assert not [r for r in rec.records if ".block" in r.module], [r.module for r in rec.records]
    got.backward()
    assert torch.equal(got, want)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
    assert _in_use(ctx) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_toy_checkpoint_blocks_inside_ctx_bitwise(dtype):
    """ToyLlama with checkpointed blocks under the engine: bitwise, nothing recorded inside a block."""
    model = make_model("toy", dtype)
    model.checkpoint_blocks = True
    twin = twin_of(model)
    inputs = make_inputs("toy")
    n_plain, _ = _count_saved(lambda: loss_of(twin_of(model), inputs))
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    want = run_step(twin, inputs)
    got = run_step(model, inputs, ctx)
    assert torch.equal(got, want)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
    s = ctx.ledger.summary()
    assert s["packed_count"] == n_plain
    inner = [r.module for r in rec.records if ".attn" in r.module or ".mlp" in r.module]
    assert not inner, f"recompute or inner saves leaked into the engine: {inner}"
    assert _in_use(ctx) == 0


@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "full_recompute"])
def test_ctx_entered_inside_checkpointed_function(early_stop):
    """The context entered inside a checkpointed function (recompute re-enters it during backward): bitwise."""
    model = _CkptNet(use_ckpt=False)
    twin = twin_of(model)
    x = make_inputs("mlp")[0][:, :16].contiguous()
    ctx = cpu_ctx()

    def inner(h):
        h = h.sin()  # saved by checkpoint's own hook: backward triggers a recompute
        with ctx:
            return model.block(h)

    want = twin.post(twin.block(twin.pre(x).sin())).pow(2).sum()
    want.backward()
    with set_checkpoint_early_stop(early_stop):
        got = model.post(checkpoint(inner, model.pre(x), use_reentrant=False)).pow(2).sum()
        got.backward()
    assert torch.equal(got, want)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
    assert _in_use(ctx) == 0


# --------------------------------------------------------------------------- in-place detection


@pytest.mark.parametrize("size", ["offloaded", "kept"])
def test_inplace_change_of_saved_tensor_raises_like_autograd(size):
    """Rule 6: modifying a saved tensor in place before backward raises autograd's in-place error."""
    x = torch.randn(64, 64, requires_grad=True)
    # Without offloading autograd itself raises; the engine must keep that behaviour.
    h = x * 2
    z = h.sin()
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()

    min_size = 0 if size == "offloaded" else 1 << 30
    ctx = cpu_ctx(min_offload_size=min_size)
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        h = x * 2
        z = h.sin()
    (r,) = rec.records_for(h)
    assert r.decision == size, r
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_inplace_change_after_forward_with_retain_graph_second_backward_raises():
    """Rule 6: an in-place change between two backwards of a retained graph is still caught."""
    x = torch.randn(64, 64, requires_grad=True)
    ctx = cpu_ctx()
    with ctx:
        h = x * 2
        z = h.sin().sum()
    z.backward(retain_graph=True)
    h.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_inplace_before_backward_that_is_legal_still_works():
    """An in-place op on a tensor that autograd did not save is allowed and stays bitwise."""
    x = torch.randn(32, 32, requires_grad=True)
    ctx = cpu_ctx()
    with ctx:
        h = x * 2  # mul by a python scalar saves nothing
        h.add_(1)
        z = (h.exp() * 3).sum()
    z.backward()
    x2 = x.detach().clone().requires_grad_()
    h2 = x2 * 2
    h2.add_(1)
    (h2.exp() * 3).sum().backward()
    assert torch.equal(x.grad, x2.grad)


# --------------------------------------------------------------------------- exceptions


class _Boom(Exception):
    pass


def test_exception_mid_forward_leaves_engine_usable():
    """An exception mid-forward leaks no host buffer and the same engine's next step is bitwise."""
    model = make_model("mlp")
    twin = twin_of(model)
    ctx = cpu_ctx()

    def explode(module, args, out):
        raise _Boom("mid-forward failure")

    handle = model.fc2.register_forward_hook(explode)
    try:
        with ctx:
            loss_of(model, make_inputs("mlp", seed=9))
    except _Boom:
        pass
    else:
        pytest.fail("the forward hook did not raise")
    handle.remove()
    assert _in_use(ctx) == 0, "the aborted forward's host copies leaked"
    inputs = make_inputs("mlp")
    assert torch.equal(run_step(model, inputs, ctx), run_step(twin, inputs))
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
    assert _in_use(ctx) == 0


def test_exception_inside_excluded_head_does_not_leave_region_excluded():
    """An exception inside the excluded output head does not leave later saves marked excluded_region."""
    from offload import get_act_offloading_ctx_manager

    model = make_model("toy")
    twin = twin_of(model)
    ctx = get_act_offloading_ctx_manager(model, True, device="cpu", min_offload_size=0)

    def explode(module, args):
        raise _Boom("head failure")

    handle = model.output.register_forward_pre_hook(explode)
    try:
        with ctx:
            loss_of(model, make_inputs("toy", seed=9))
    except _Boom:
        pass
    handle.remove()
    gc.collect()
    rec = Recorder()
    with ctx:
        from offload import active_engine

        eng = active_engine()
        assert eng is not None
        h = eng.add_observer(rec)
        loss = loss_of(model, make_inputs("toy"))
    loss.backward()
    h.remove()
    run_step(twin, make_inputs("toy"))
    assert_same_grads(model, twin)
    wrong = [r.module for r in rec.by_reason("excluded_region") if not r.module.endswith("output")]
    assert not wrong, f"exclusion leaked past the failed head: {wrong[:5]}"
    assert any(r.decision == "offloaded" for r in rec.records)
    assert eng.pool.stats()["in_use_bytes"] == 0


def test_exception_mid_backward_then_next_step_is_clean():
    """Rule 1: a backward that raises frees every host copy once its graph is dropped; the next step is exact."""
    model = make_model("mlp")
    twin = twin_of(model)
    ctx = cpu_ctx()
    x, y = make_inputs("mlp", seed=4)
    x = x.clone().requires_grad_()
    with ctx:
        h = model.fc1(x)
        z = h.sin()  # saves h
        loss = model.fc3(F.silu(model.fc2(z))).sum() + z.sum()
    h.add_(1)  # invalidates the saved h
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    del loss, z, h
    assert _in_use(ctx) == 0
    model.zero_grad(set_to_none=True)
    inputs = make_inputs("mlp")
    assert torch.equal(run_step(model, inputs, ctx), run_step(twin, inputs))
    assert_same_grads(model, twin)
    assert _in_use(ctx) == 0
    assert_reconciles(ctx.ledger.summary())


def test_reentrant_checkpoint_inside_ctx_bitwise():
    """use_reentrant=True checkpoint inside the context (recompute runs in a nested backward): bitwise."""
    model = _CkptNet(use_ckpt=False)
    twin = twin_of(model)
    x = make_inputs("mlp")[0][:, :16].contiguous().requires_grad_()
    ctx = cpu_ctx()
    with ctx:
        got = model.post(checkpoint(model.block, model.pre(x), use_reentrant=True)).pow(2).sum()
    got.backward()
    x2 = x.detach().clone().requires_grad_()
    want = twin.post(twin.block(twin.pre(x2))).pow(2).sum()
    want.backward()
    assert torch.equal(got, want)
    assert_same_grads(model, twin)
    assert torch.equal(x.grad, x2.grad)
    assert_really_offloaded(ctx)
    assert _in_use(ctx) == 0


def test_same_engine_entered_twice_nested():
    """Re-entering the same engine inside itself works: bitwise, one ledger step, active_engine unchanged."""
    from offload import active_engine

    model = make_model("mlp")
    twin = twin_of(model)
    inputs = make_inputs("mlp")
    ctx = cpu_ctx()
    with ctx:
        with ctx:
            assert active_engine() is ctx
            a = loss_of(model, inputs)
        assert active_engine() is ctx
        b = loss_of(model, inputs)
    assert active_engine() is None
    (a + b).backward()
    (loss_of(twin, inputs) + loss_of(twin, inputs)).backward()
    assert_same_grads(model, twin)
    assert ctx.ledger.summary()["steps"] == 1
    assert _in_use(ctx) == 0


@pytest.mark.parametrize("kind", ["mlp", "toy"])
def test_backward_inside_the_context(kind):
    """TRL/HF-trainer pattern: forward and backward both inside the context, two steps, bitwise."""
    model, inputs = make_model(kind), make_inputs(kind)
    twin = twin_of(model)
    ctx = cpu_ctx()
    for _ in range(2):
        with ctx:
            loss = loss_of(model, inputs)
            loss.backward()
        run_step(twin, inputs)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
    assert ctx.ledger.summary()["steps"] == 2
    assert _in_use(ctx) == 0


def test_double_backward_entirely_inside_the_context():
    """A gradient penalty computed wholly inside the context (double-backward saves packed too) is bitwise."""
    model = TanhMLP()
    twin = twin_of(model)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))

    def penalised(m):
        xx = x.clone().requires_grad_()
        out = m(xx)
        (gx,) = torch.autograd.grad(out.sum(), xx, create_graph=True)
        (out.mean() + gx.pow(2).sum()).backward()

    ctx = cpu_ctx()
    with ctx:
        penalised(model)
    penalised(twin)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
    assert _in_use(ctx) == 0
