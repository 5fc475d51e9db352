"""Constructor arguments: bad values fail loudly naming the argument; no-accelerator and CPU fallbacks."""

from __future__ import annotations

import warnings

import pytest
import torch

from offload import OffloadActivations
from offload_testkit import (
    MLP,
    Recorder,
    assert_really_offloaded,
    assert_same_grads,
    cpu_ctx,
    make_inputs,
    make_model,
    run_step,
    twin_of,
)

BAD = [
    ("max_fwd_stash_size", dict(max_fwd_stash_size=0)),
    ("max_fwd_stash_size", dict(max_fwd_stash_size=-3)),
    ("min_offload_size", dict(min_offload_size=-1)),
    ("max_inflight_bytes", dict(max_inflight_bytes=-1)),
    ("prefetch_bytes", dict(prefetch_bytes=-1)),
    ("host_budget_bytes", dict(host_budget_bytes=-1)),
    ("on_host_budget", dict(on_host_budget="bogus")),
    ("virtual_memory_safe_pct", dict(virtual_memory_safe_pct=-5)),
    ("virtual_memory_safe_pct", dict(virtual_memory_safe_pct=150)),
    ("device", dict(device="cuda:7")),
    ("device", dict(device="nonsense")),
    ("pin_allocator", dict(pin_allocator="mmap")),
]


@pytest.mark.parametrize("name,kwargs", BAD, ids=[f"{n}={list(k.values())[0]!r}" for n, k in BAD])
def test_bad_argument_names_itself(name, kwargs):
    """A bad constructor argument raises an error whose message names the argument and the value."""
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises((ValueError, TypeError, RuntimeError)) as ei:
        OffloadActivations(**kwargs)
    msg = str(ei.value)
    assert name in msg, msg
    assert repr(kwargs[name]) in msg or str(kwargs[name]) in msg, msg


def test_unknown_keyword_rejected():
    """A misspelt keyword is a TypeError, not silently ignored."""
    with pytest.raises(TypeError):
        OffloadActivations(device="cpu", min_offload_bytes=0)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator pass-through")
def test_no_accelerator_no_device_is_pass_through_with_one_warning():
    """No accelerator and device=None: one warning, nothing moved, every save recorded as "disabled"."""
    model = MLP()
    twin = twin_of(model)
    inputs = make_inputs("mlp")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ctx = OffloadActivations()
        rec = Recorder()
        ctx.add_observer(rec)
        ptrs = []
        h = ctx.add_observer(lambda ev: ptrs.append(ev.tensor.data_ptr()))
        run_step(model, inputs, ctx)
        h.remove()
    mine = [w for w in got if "numpy" not in str(w.message).lower()]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert "device" in str(mine[0].message)
    assert ctx.enabled is False and ctx.device is None
    s = ctx.ledger.summary()
    assert s["packed_count"] > 0 and s["offloaded_count"] == 0 and s["offloaded_bytes"] == 0
    assert s["kept_count"] == s["packed_count"]
    assert set(s["kept_by_reason"]) == {"disabled"}, s["kept_by_reason"]
    assert all(r.copy_bytes == 0 for r in rec.records)
    pool = ctx.pool.stats()
    assert pool["allocations"] == 0 and pool["reserved_bytes"] == 0
    run_step(twin, inputs)
    assert_same_grads(model, twin)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator pass-through")
def test_pass_through_unpack_returns_the_original_memory():
    """Pass-through unpack hands backward the very tensor that was saved (nothing moved)."""
    with pytest.warns(UserWarning):
        ctx = OffloadActivations()

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(c, x):
            y = x * 2
            c.save_for_backward(y)
            c.ptr = y.data_ptr()
            return y

        @staticmethod
        def backward(c, g):
            (y,) = c.saved_tensors
            assert y.data_ptr() == c.ptr
            return g * y

    x = torch.randn(64, 64, requires_grad=True)
    with ctx:
        out = Probe.apply(x)
    out.sum().backward()
    assert torch.equal(x.grad, x.detach() * 2)


def test_use_streams_on_cpu_falls_back_to_sync_copies():
    """use_streams=True with device="cpu" runs synchronous copies without error, bitwise."""
    model = make_model("toy")
    twin = twin_of(model)
    inputs = make_inputs("toy")
    ctx = OffloadActivations(use_streams=True, device="cpu", min_offload_size=0)
    assert ctx.enabled and ctx.device == torch.device("cpu")
    got = run_step(model, inputs, ctx)
    assert torch.equal(got, run_step(twin, inputs))
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
    assert getattr(ctx, "backend", "sync") == "sync"
    assert ctx.pool.stats()["pin_failures"] == 0, "nothing should try to pin without an accelerator"


def test_torchtune_positional_signature():
    """The shared head (use_pin_memory, use_streams) is positional; the peers disagree on the next two,
    so they are keyword-only (offload.compat.torchtune / .trl keep each peer's positional order)."""
    ctx = OffloadActivations(False, False, max_fwd_stash_size=2, min_offload_size=4096, device="cpu")
    assert (ctx.use_pin_memory, ctx.use_streams, ctx.max_fwd_stash_size, ctx.min_offload_size) == (False, False, 2, 4096)
    with pytest.raises(TypeError):
        OffloadActivations(False, False, 2, 4096, device="cpu")  # ambiguous between torchtune and TRL


@pytest.mark.parametrize("stash", [1, 5])
def test_small_stash_and_inflight_bounds_still_bitwise(stash):
    """Tiny max_fwd_stash_size / max_inflight_bytes / prefetch_bytes only change timing, never results."""
    model = make_model("toy")
    twin = twin_of(model)
    inputs = make_inputs("toy")
    ctx = cpu_ctx(max_fwd_stash_size=stash, max_inflight_bytes=1, prefetch_bytes=0)
    got = run_step(model, inputs, ctx)
    assert torch.equal(got, run_step(twin, inputs))
    assert_same_grads(model, twin)
    assert_really_offloaded(ctx)
