"""Rule 7 and the keep reasons: what the engine refuses to offload, and that it says why."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from offload import REASONS, OffloadError, is_static_tensor
from offload_testkit import (
    Recorder,
    assert_reconciles,
    assert_really_offloaded,
    assert_same_grads,
    cpu_ctx,
    make_inputs,
    loss_of,
    make_model,
    run_step,
    twin_of,
)


def test_contract_reasons_exist():
    """Every keep reason named in the contract is in offload.REASONS."""
    need = {"too_small", "parameter", "other_device", "excluded_region", "duplicate_storage",
            "host_budget", "unsupported_type", "disabled"}
    assert need <= set(REASONS), need - set(REASONS)


def test_is_static_tensor():
    """is_static_tensor: True for a Parameter and its weight.t() view, False for activations."""
    lin = nn.Linear(4, 4)
    assert is_static_tensor(lin.weight)
    assert is_static_tensor(lin.weight.t())
    assert not is_static_tensor(torch.randn(4, 4))
    assert not is_static_tensor(lin(torch.randn(2, 4)))


def test_parameters_and_weight_views_never_offloaded():
    """Rule 7: Linear's saved weight.t() view and a directly saved Parameter are kept with reason "parameter"."""
    lin = nn.Linear(64, 64)
    scale = nn.Parameter(torch.randn(64))
    x = torch.randn(8, 64, requires_grad=True)
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        h = lin(x)  # saves x and lin.weight.t()
        out = (h * scale).sum()  # saves h and the Parameter itself
    param_ptrs = {lin.weight.untyped_storage().data_ptr(), scale.untyped_storage().data_ptr()}
    by_ptr = {}
    for r in rec.records:
        by_ptr.setdefault(r.storage_key, []).append(r)
    static = [r for r in rec.records if r.storage_key in param_ptrs]
    assert len(static) == 2, [(r.shape, r.reason) for r in rec.records]
    for r in static:
        assert (r.decision, r.reason) == ("kept", "parameter"), r
        assert r.copy_bytes == 0
    assert rec.records_for(h)[0].decision == "offloaded"
    out.backward()
    lin2, scale2 = nn.Linear(64, 64), nn.Parameter(scale.detach().clone())
    lin2.load_state_dict(lin.state_dict())
    x2 = x.detach().clone().requires_grad_()
    (lin2(x2) * scale2).sum().backward()
    assert torch.equal(lin.weight.grad, lin2.weight.grad)
    assert torch.equal(scale.grad, scale2.grad)
    assert torch.equal(x.grad, x2.grad)


def test_toy_model_parameters_all_kept():
    """On the toy Llama no record whose storage is a parameter's is ever offloaded."""
    model = make_model("toy_tied")
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    run_step(model, make_inputs("toy"), ctx)
    hits = [r for r in rec.records if r.storage_key in ptrs]
    assert hits, "the toy model saves weight views; the test would check nothing"
    assert all(r.decision == "kept" and r.reason == "parameter" for r in hits), [
        (r.module, r.decision, r.reason) for r in hits if r.reason != "parameter"
    ]


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 32 * 32).reshape(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self.gain  # mm saves the buffer (1 KiB+), as RoPE tables are saved


@pytest.mark.parametrize("pass_model", [True, False], ids=["model_given", "no_model"])
def test_buffers_kept(pass_model):
    """Rule 7: a registered buffer saved for backward stays on its device, recorded as "buffer".

    No observer: the ledger's records, so that the C++ pack hook (the default, ``native_hooks="auto"``)
    decides too (it hands observed packs to Python).
    """
    m = _WithBuffer()
    x = torch.randn(16, 32, requires_grad=True)
    ctx = cpu_ctx(model=m) if pass_model else cpu_ctx()
    with ctx:
        out = m(x).sum()
        if pass_model:
            # Outside m.forward the engine can only know the buffer because it was given the model.
            out = out + (m.lin(x) @ m.gain).sum()
    gptr = m.gain.untyped_storage().data_ptr()
    hits = [r for r in ctx.ledger.records if r.storage_key == gptr]
    assert len(hits) == (2 if pass_model else 1), "the buffer was not saved as expected"
    for r in hits:
        assert (r.decision, r.reason) == ("kept", "buffer"), r
    assert ctx.ledger.summary()["kept_count_by_reason"]["buffer"] == len(hits)
    out.backward()


def test_duplicate_storage_offloaded_once():
    """Rule 7: a storage saved twice is copied once; the second save is kept as "duplicate_storage"."""
    x = torch.randn(32, 64, requires_grad=True)
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        h = x * 2.0 + 1.0  # a fresh activation (scalar mul/add save nothing)
        y = h * h  # mul saves h twice (the same Python object)
        z = h.t().sin()  # and a full-storage view of it
        loss = (y.sum() + z.sum())
        in_use_after_fwd = ctx.pool.stats()["in_use_bytes"]
    hs = [r for r in rec.records if r.storage_key == h.untyped_storage().data_ptr()]
    assert len(hs) == 3, [(r.shape, r.decision, r.reason) for r in hs]
    assert sum(r.decision == "offloaded" for r in hs) == 1
    dups = [r for r in hs if r.decision == "kept"]
    assert all(r.reason == "duplicate_storage" and r.copy_bytes == 0 for r in dups), dups
    s = ctx.ledger.summary()
    assert s["offloaded_bytes"] == in_use_after_fwd == h.numel() * h.element_size(), (
        f"engine says it offloaded {s['offloaded_bytes']} B, the pool holds {in_use_after_fwd} B"
    )
    assert s["kept_by_reason"].get("duplicate_storage", 0) == 2 * h.numel() * h.element_size()
    assert_reconciles(s)
    loss.backward()
    x2 = x.detach().clone().requires_grad_()
    h2 = x2 * 2.0 + 1.0
    ((h2 * h2).sum() + h2.t().sin().sum()).backward()
    assert torch.equal(x.grad, x2.grad)


def test_pool_received_bytes_equal_copied_bytes_on_toy_model():
    """DESIGN accounting: bytes the engine copied (d2h_bytes, sum of copy_bytes) equal what its pool holds."""
    model = make_model("toy")
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        loss = loss_of(model, make_inputs("toy"))
    s = ctx.ledger.summary()
    pool = ctx.pool.stats()
    assert s["offloaded_bytes"] > 0
    assert s["d2h_bytes"] == sum(r.copy_bytes for r in rec.records) == pool["in_use_bytes"], (s, pool)
    # A view's copy may cover its whole storage span (Rule 5 keeps its strides), never less than it.
    for r in rec.records:
        if r.decision == "offloaded":
            assert r.nbytes <= r.copy_bytes <= r.storage_nbytes, r
        else:
            assert r.copy_bytes == 0, r
    loss.backward()


def test_address_reuse_is_not_a_duplicate():
    """A new storage at the address of one already offloaded and freed is copied again, not deduped."""
    x = torch.randn(64, 64, requires_grad=True)
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        h = x
        for _ in range(8):
            h = (h * 1.0).tanh()  # tanh saves its output; the previous one dies once offloaded
        loss = h.sum()
    assert not rec.by_reason("duplicate_storage"), [(r.seq, r.storage_key) for r in rec.records]
    loss.backward()
    x2 = x.detach().clone().requires_grad_()
    h2 = x2
    for _ in range(8):
        h2 = (h2 * 1.0).tanh()
    h2.sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_other_device_tensor_kept():
    """A tensor on a device other than the engine's (here "meta") is kept with reason "other_device"."""
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    m = torch.randn(64, 64, device="meta", requires_grad=True)
    c = torch.randn(64, 64, requires_grad=True)
    with ctx:
        ym = m.sin()  # saves a meta tensor
        yc = c.sin()  # saves a cpu tensor
    (r,) = rec.records_for(m)
    assert (r.decision, r.reason) == ("kept", "other_device"), r
    assert rec.records_for(c)[0].decision == "offloaded"
    del ym, yc


def test_too_small_kept():
    """A tensor below min_offload_size is kept with reason "too_small"; one above it is offloaded."""
    ctx = cpu_ctx(min_offload_size=1024)
    rec = Recorder()
    ctx.add_observer(rec)
    small = torch.randn(16, requires_grad=True)  # 64 B
    big = torch.randn(1024, requires_grad=True)  # 4 KiB
    with ctx:
        loss = small.sin().sum() + big.sin().sum()
    (rs,) = rec.records_for(small)
    (rb,) = rec.records_for(big)
    assert (rs.decision, rs.reason, rs.copy_bytes) == ("kept", "too_small", 0)
    assert (rb.decision, rb.reason) == ("offloaded", "")
    assert rb.nbytes == 4096
    loss.backward()
    assert torch.equal(small.grad, small.detach().cos()) and torch.equal(big.grad, big.detach().cos())


def test_inplace_between_two_saves_is_not_deduped():
    """A storage modified in place between two saves is copied again, not shared at its old version."""
    x = torch.randn(64, 64, requires_grad=True)
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        h = x * 2.0
        a = h.sin()  # saves h at version 0 (this graph is never backwarded)
        h.mul_(3.0)
        b = h.cos()  # saves h at version 1: must not share the version-0 host copy
    (g,) = torch.autograd.grad(b.sum(), x)
    h2 = x * 2.0
    a2 = h2.sin()
    h2.mul_(3.0)
    (g2,) = torch.autograd.grad(h2.cos().sum(), x)
    assert torch.equal(g, g2)
    assert not rec.by_reason("duplicate_storage")
    del a, a2


def test_sparse_tensor_kept_as_unsupported_type():
    """A sparse (non-strided) tensor saved for backward is kept with reason "unsupported_type", grads exact."""
    s = torch.randn(32, 32).relu().to_sparse().requires_grad_()
    w = torch.randn(32, 16, requires_grad=True)
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        y = torch.sparse.mm(s, w).sum()
    (r,) = rec.records_for(s)
    assert (r.decision, r.reason) == ("kept", "unsupported_type")
    y.backward()
    g = w.grad.clone()
    w.grad = None
    torch.sparse.mm(s, w).sum().backward()
    assert torch.equal(g, w.grad)


def _nf4():
    try:
        from torchao.quantization import NF4Tensor, to_nf4  # torchao >= 0.18
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4  # torchao <= 0.17
        except ImportError:
            pytest.skip("torchao with NF4Tensor is not installed (torchao.quantization / torchao.dtypes.nf4tensor)")
    return NF4Tensor, to_nf4


def test_nf4_weight_kept_as_unsupported_type_and_grads_correct():
    """A torchao NF4Tensor saved for backward is kept with reason "unsupported_type"; input grads stay bitwise."""
    NF4Tensor, to_nf4 = _nf4()
    torch.manual_seed(0)
    w = to_nf4(torch.randn(256, 64, dtype=torch.bfloat16))  # NF4 needs numel % (64*256) == 0
    assert isinstance(w, NF4Tensor)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ctx = cpu_ctx()
    rec = Recorder()
    ctx.add_observer(rec)
    with ctx:
        h = torch.nn.functional.linear(x, w)  # saves the NF4 weight
        loss = h.float().sin().sum()
    sub = rec.by_reason("unsupported_type")
    assert sub, [(r.shape, r.dtype, r.decision, r.reason) for r in rec.records]
    assert all(r.decision == "kept" and r.copy_bytes == 0 for r in sub)
    loss.backward()
    torch.nn.functional.linear(x2, w).float().sin().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert_really_offloaded(ctx)  # the plain activations around it still moved


# --------------------------------------------------------------------------- host budget (Rule 9)


def _mlp_pair():
    model = make_model("mlp")
    return model, twin_of(model), make_inputs("mlp")


def test_host_budget_keep_policy_keeps_overflow_on_device():
    """Rule 9, on_host_budget="keep": beyond host_budget_bytes tensors stay put (reason "host_budget"), bitwise."""
    model, twin, inputs = _mlp_pair()
    probe = cpu_ctx()
    run_step(twin_of(model), inputs, probe)
    full = probe.ledger.summary()["offloaded_bytes"]
    budget = full // 2
    ctx = cpu_ctx(host_budget_bytes=budget, on_host_budget="keep")
    got = run_step(model, inputs, ctx)
    assert torch.equal(got, run_step(twin, inputs))
    assert_same_grads(model, twin)
    s = ctx.ledger.summary()
    assert s["kept_by_reason"].get("host_budget", 0) > 0, s
    assert 0 < s["offloaded_bytes"] <= budget, s
    assert s["pool"]["peak_reserved_bytes"] <= budget or s["pool"]["capacity_bytes"] <= budget, s["pool"]
    assert_reconciles(s)


def test_host_budget_raise_policy_raises_offload_error():
    """Rule 9, on_host_budget="raise": exceeding the budget raises OffloadError naming host_budget_bytes."""
    model, _, inputs = _mlp_pair()
    ctx = cpu_ctx(host_budget_bytes=1024, on_host_budget="raise")
    with pytest.raises(OffloadError, match="host_budget_bytes"):
        run_step(model, inputs, ctx)
    assert issubclass(OffloadError, RuntimeError)
    gc.collect()
    assert ctx.pool.stats()["in_use_bytes"] == 0


def test_virtual_memory_ceiling_applies_policy():
    """Rule 9: a system-RAM ceiling below current use keeps tensors ("host_budget") or raises naming the setting."""
    model, twin, inputs = _mlp_pair()
    ctx = cpu_ctx(virtual_memory_safe_pct=0.001, on_host_budget="keep")
    assert torch.equal(run_step(model, inputs, ctx), run_step(twin, inputs))
    assert_same_grads(model, twin)
    s = ctx.ledger.summary()
    assert s["offloaded_count"] == 0 and s["kept_by_reason"].get("host_budget", 0) > 0, s
    with pytest.raises(OffloadError, match="virtual_memory_safe_pct"):
        run_step(model, inputs, cpu_ctx(virtual_memory_safe_pct=0.001, on_host_budget="raise"))


def test_host_budget_keep_over_several_steps():
    """Rule 9: with a budget, several steps stay bitwise, never exceed the cap and free every buffer."""
    model, twin, inputs = _mlp_pair()
    budget = 8192
    ctx = cpu_ctx(host_budget_bytes=budget, on_host_budget="keep")
    for i in range(3):
        inputs = make_inputs("mlp", seed=i)
        assert torch.equal(run_step(model, inputs, ctx), run_step(twin, inputs))
        st = ctx.pool.stats()
        assert st["in_use_bytes"] == 0 and st["peak_reserved_bytes"] <= budget, st
    assert_same_grads(model, twin)
    assert ctx.ledger.summary()["steps"] == 3


def test_host_budget_pageable_policy_runs_bitwise():
    """Rule 9, on_host_budget="pageable": over-budget tensors still round-trip exactly (never a silent drop)."""
    model, twin, inputs = _mlp_pair()
    ctx = cpu_ctx(host_budget_bytes=1024, on_host_budget="pageable")
    got = run_step(model, inputs, ctx)
    assert torch.equal(got, run_step(twin, inputs))
    assert_same_grads(model, twin)
    assert_reconciles(ctx.ledger.summary())


@pytest.mark.parametrize("how", ["model_freed", "weight_replaced", "other_model"])
def test_storage_of_a_gone_parameter_is_an_activation_again(how):
    """A storage that held a parameter of the engine's model is kept as 'parameter' only while that
    parameter is the model's: once the model is freed, the weight replaced or another model given
    (update_model_params), a tensor saved on that storage is offloaded like any activation (before, a
    stale address set kept it on the device, and the ledger called it a parameter)."""
    store = torch.randn(64, 64)  # the weight's bytes; an activation will live on them later
    lin = nn.Linear(64, 64)
    lin.weight = nn.Parameter(store)  # shares store's storage
    ctx = cpu_ctx(model=lin)
    x = store.detach().requires_grad_()  # a leaf on that storage, as a new activation at a dead weight's address
    ptr = store.untyped_storage().data_ptr()

    def decision() -> tuple[str, str]:
        with ctx:
            y = x.sin()
        y.sum().backward()
        step = ctx.ledger.current_step - 1
        recs = [r for r in ctx.ledger.records if r.step == step and r.storage_key == ptr]
        assert len(recs) == 1, recs
        return recs[0].decision, recs[0].reason

    assert decision() == ("kept", "parameter")  # the weight's storage, while it is the weight's
    if how == "model_freed":
        del lin
        gc.collect()
    elif how == "weight_replaced":
        lin.weight = nn.Parameter(torch.randn(64, 64))
    else:
        ctx.update_model_params(nn.Linear(3, 3))
    assert decision() == ("offloaded", "")
    x.grad = None
