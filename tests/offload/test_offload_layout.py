"""Rule 5: unpack returns the saved tensor's exact size, stride, dtype and device, and its values.

Inductor's compiled backward asserts the strides of what it saved (a ``clone()``
on pack breaks it), and eager kernels may take a different code path for a
different layout, so layout preservation is part of bitwise correctness.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from offload_testkit import (
    Recorder,
    SaveView,
    assert_really_offloaded,
    assert_same_grads,
    compiled_toy_reference,
    cpu_ctx,
    loss_of,
    twin_of,
)


VIEWS = {
    "transpose": lambda x: x.transpose(0, 2),
    "permute": lambda x: x.permute(2, 0, 1),
    "strided_slice": lambda x: x[:, ::2, 1:],
    "storage_offset": lambda x: x[3:, 4:, :],
    "flat_offset": lambda x: x.reshape(-1)[100:700],
    "expand_stride0": lambda x: x[:, :1, :].expand(8, 16, 12),
    "scalar_expand": lambda x: x[1, 2, 3].expand(4, 5),
    "overlapping_unfold": lambda x: x.reshape(-1).unfold(0, 64, 16),
    # A whole contiguous tensor is reloaded as itself (_Copies._load); these check its layout survives,
    # the second with a size-1 dimension whose stride a contiguous tensor of that size would not have.
    "whole": lambda x: x * 1,
    "whole_size1_stride": lambda x: (x * 1).as_strided((8, 1, 192), (192, 7, 1)),
}
MUST_OFFLOAD = {"transpose", "permute", "strided_slice", "storage_offset", "flat_offset", "expand_stride0",
                "whole", "whole_size1_stride"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(VIEWS))
def test_saved_view_round_trips_with_its_layout(name, dtype):
    """A view saved for backward comes back with the same size, stride, dtype, device and values."""
    make_view = VIEWS[name]
    base = torch.randn(8, 16, 12).to(dtype)
    x = base.clone().requires_grad_()
    expect = make_view(x.detach())
    expect_layout = (expect.size(), expect.stride())
    expect_value = expect.clone()

    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    seen: list[dict] = []
    with ctx:
        # An activation (x itself is held by its AccumulateGrad, and a live original is not reloaded:
        # NOTE [ Copy schedule ] item 6): nothing holds it after forward, so backward reads its copy.
        act = x * 1
        y = SaveView.apply(act, make_view, seen)
        del act
    y.sum().backward()

    (s,) = seen
    assert (s["size"], s["stride"]) == expect_layout, f"{name}: layout {s['size']}/{s['stride']} != {expect_layout}"
    assert s["dtype"] == dtype and s["device"] == x.device
    assert torch.equal(s["value"], expect_value), f"{name}: values changed on the round trip"
    decisions = {r.decision for r in rec.records}
    if name in MUST_OFFLOAD:
        assert decisions == {"offloaded"}, f"{name}: {[(r.decision, r.reason) for r in rec.records]}"
        notes = {r.note for r in ctx.ledger.records}  # (its freed address may hold the reload: notes, not pointers)
        assert not notes & {"reused_original", "reused_source"}, f"{name}: offloaded but backward read the original"
        assert ctx.ledger.summary()["h2d_bytes"] > 0
    # The grad is the twin's, bit for bit.
    x2 = base.clone().requires_grad_()
    SaveView.apply(x2, make_view, []).sum().backward()
    assert torch.equal(x.grad, x2.grad)


class _AtenOps(TorchDispatchMode):
    """The names of the aten ops run while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", [(8, 16, 12), (96,)], ids=["3d", "1d"])
def test_a_whole_tensors_reload_is_the_reloaded_tensor_itself(shape):
    """A whole contiguous tensor with one saver comes back as the tensor its reload allocated: no view or
    set_ rebuilds it (each costs about as much host time as the copy's own launch)."""
    x = torch.randn(shape, requires_grad=True)
    seen: list[dict] = []
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        y = SaveView.apply(x, lambda v: v * 2, seen)
    with _AtenOps() as ops:
        y.sum().backward()
    assert [r.decision for r in rec.records] == ["offloaded"]
    assert {"copy_", "clone"} & set(ops.names), ops.names  # (it was reloaded: a clone, on a CPU device)
    rebuilt = {"set_", "view", "as_strided"} & set(ops.names)
    assert not rebuilt, f"the reload was rebuilt with {sorted(rebuilt)}: {ops.names}"
    (s,) = seen
    assert torch.equal(s["value"], x.detach() * 2) and s["stride"] == (x * 2).stride()


def test_a_saver_added_after_a_whole_tensors_reload_gets_its_bytes():
    """A whole tensor reloaded as itself (one saver at its load), then shared by a second saver (its
    users grown since: a checkpoint's recompute can save again) is rebuilt from its bytes, per layout."""
    t = torch.randn(6, 1, 10)
    ctx = cpu_ctx()
    with ctx:
        h = ctx._pack(t)
    hc = h.hc
    assert hc.typed is not None and hc.users == 1
    base, copy = ctx._load(hc, h.rec)
    assert base.dtype == t.dtype and base.shape == t.shape  # loaded as the tensor
    hc.users = 2  # a second saver since its load
    out = ctx._rebuild(h, hc, base, copy)
    assert torch.equal(out, t) and out.stride() == t.stride() and out.dtype == t.dtype


def test_disjoint_views_of_one_storage_both_come_back():
    """Two disjoint views of one storage saved in turn both unpack to their own values (dedupe is span-safe)."""
    w = torch.randn(32, 32)
    x = torch.randn(16, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ctx = cpu_ctx()
    with ctx:
        a = x @ w  # (16, 32)
        p = a[:, :8].sin()  # saves the left 8 columns
        q = a[:, 8:].cos()  # saves the right 24 columns of the same storage
        r = a[4:].tanh()  # a row slice overlapping both
        loss = p.sum() + q.pow(2).sum() + r.sum()
    loss.backward()
    a2 = x2 @ w
    (a2[:, :8].sin().sum() + a2[:, 8:].cos().pow(2).sum() + a2[4:].tanh().sum()).backward()
    assert torch.equal(x.grad, x2.grad)
    assert_really_offloaded(ctx)


def test_small_view_then_whole_tensor_of_same_storage():
    """A narrow view saved before its whole base (the first copy covers less) still round-trips both."""
    x = torch.randn(16, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ctx = cpu_ctx()
    with ctx:
        a = x * 1.5 + 0.25
        loss = a[:2, :3].sin().sum() + a.sin().sum() + a.t().exp().sum()
    loss.backward()
    a2 = x2 * 1.5 + 0.25
    (a2[:2, :3].sin().sum() + a2.sin().sum() + a2.t().exp().sum()).backward()
    assert torch.equal(x.grad, x2.grad)
    s = assert_really_offloaded(ctx)
    # Everything saved above lives in at most a's storage, the exp result and x: nothing is moved twice.
    assert s["offloaded_bytes"] <= 2 * a.numel() * a.element_size() + 64, s


def test_torch_compile_model_under_ctx_bitwise():
    """A torch.compile'd toy Llama (saved q/k/v views) runs under the engine with strides intact, bitwise."""
    torch._dynamo.reset()
    # Reference: the same compiled module without offloading (same kernels, same numerics).
    model, compiled, inputs, want, ref = compiled_toy_reference()
    ctx = cpu_ctx()
    with ctx:
        got = loss_of(compiled, inputs)
    got.backward()
    assert torch.equal(got, want)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
    assert_really_offloaded(ctx)
    gc.collect()
    assert ctx.pool.stats()["in_use_bytes"] == 0
    torch._dynamo.reset()


class _PeekFlags(torch.autograd.Function):
    """Saves ``make(a)`` and reports the conj/neg bits backward gets back for it."""

    @staticmethod
    def forward(ctx, a, make, seen):
        v = make(a)
        ctx.save_for_backward(v)
        ctx.seen = seen
        seen.append(("pack", v.is_conj(), v.is_neg()))
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        ctx.seen.append(("unpack", v.is_conj(), v.is_neg()))
        return g, None, None


@pytest.mark.parametrize("name", ["conj", "neg"])
def test_conj_and_neg_bit_views_round_trip(name):
    """Rule 5: a lazily conjugated (x.conj()) or negated (x.conj().imag) view comes back with its bit set."""
    make = (lambda a: a.conj()) if name == "conj" else (lambda a: a.conj().imag)
    z = torch.randn(256, dtype=torch.complex64, requires_grad=True)
    seen: list = []
    ctx = cpu_ctx()
    with ctx:
        y = _PeekFlags.apply(z, make, seen)
    y.abs().sum().backward()
    assert seen[1][1:] == seen[0][1:], f"{name}: (is_conj, is_neg) {seen[0][1:]} at pack, {seen[1][1:]} at unpack"


@pytest.mark.parametrize("name", ["conj", "neg"])
def test_conj_and_neg_bit_views_grads_bitwise(name):
    """Grads through saved conj / neg-bit views equal the no-offload grads bit for bit."""
    x = torch.randn(64, 64, dtype=torch.complex64, requires_grad=True)
    w = torch.randn(64, 64, dtype=torch.complex64 if name == "conj" else torch.float32, requires_grad=True)

    def f(x, w):
        v = x.conj() if name == "conj" else x.conj().imag  # mul saves v for w's grad
        return (v * w).abs().sum()

    ctx = cpu_ctx()
    with ctx:
        loss = f(x, w)
    loss.backward()
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    f(x, w).backward()
    assert torch.equal(got[0], x.grad), f"{name}: x.grad differs from the no-offload grad"
    assert torch.equal(got[1], w.grad), f"{name}: w.grad differs from the no-offload grad"
    assert_really_offloaded(ctx)


def test_bool_int_complex_and_empty_saves_bitwise():
    """Saved bool masks (dropout), int64 indices, complex values and zero-size tensors round-trip exactly."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 32)  # saves int64 indices
            self.drop = nn.Dropout(0.3)  # saves a bool-ish mask
            self.lin = nn.Linear(32, 32)

        def forward(self, idx):
            h = self.drop(self.emb(idx))
            h = h.masked_fill(h > 0.5, 0.0)  # saves a bool mask
            z = torch.view_as_complex(self.lin(h).reshape(*h.shape[:-1], 16, 2))
            e = h[:, :0].sin().sum()  # a zero-size save
            return (z * z).abs().sum() + e

    torch.manual_seed(0)
    model = Mixed()
    twin = twin_of(model)
    idx = torch.randint(0, 50, (8, 12))
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    torch.manual_seed(1)
    with ctx:
        got = model(idx)
    got.backward()
    torch.manual_seed(1)
    want = twin(idx)
    want.backward()
    assert torch.equal(got, want)
    assert_same_grads(model, twin)
    dtypes = {r.dtype for r in rec.records if r.decision == "offloaded"}
    assert {"torch.int64", "torch.bool", "torch.complex64"} <= dtypes, dtypes
    zero = [r for r in rec.records if 0 in r.shape]
    assert zero and all(r.decision == "kept" and r.reason == "too_small" for r in zero), zero


def test_channels_last_conv_bitwise():
    """A channels_last conv net (saved NHWC-strided activations) is bitwise under offloading."""
    from offload_testkit import ConvNet

    torch.manual_seed(0)
    model = ConvNet().to(memory_format=torch.channels_last)
    twin = twin_of(model)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    ctx = cpu_ctx()
    with ctx:
        got = model(x).square().sum()
    got.backward()
    want = twin(x).square().sum()
    want.backward()
    assert torch.equal(got, want)
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)


def test_torch_compile_whole_model_head_exclusion_not_silently_lost():
    """Under whole-model torch.compile the ctx manager still excludes the head, or warns that it cannot."""
    # Silence is the bug: the head's logits, the largest activations, would be offloaded against the
    # documented default and nothing would say so.
    import warnings

    from offload import get_act_offloading_ctx_manager

    torch._dynamo.reset()
    model, compiled, inputs, want, ref = compiled_toy_reference()
    with warnings.catch_warnings(record=True) as got_warnings:
        warnings.simplefilter("always")
        ctx = get_act_offloading_ctx_manager(compiled, True, device="cpu", min_offload_size=0)
        with ctx:
            got = loss_of(compiled, inputs)
        got.backward()
    assert torch.equal(got, want)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
    excluded = ctx.ledger.summary()["kept_by_reason"].get("excluded_region", 0)
    engine_warned = [w for w in got_warnings if "offload" in str(w.message).lower()]
    assert excluded > 0 or engine_warned, (
        "head exclusion silently lost under torch.compile: no excluded_region record and no warning; "
        f"records' modules: {sorted({r.module for r in ctx.ledger.records})}"
    )
    torch._dynamo.reset()
