"""Shared workouts for the emulated-accelerator tests (offload.testing.EmulatedAccelerator).

``ordering_workout`` drives every ordering call of the engine's stream path at
least once: in-flight sources released at once (stash 1, 1 byte in flight),
prefetch, a backward that changes stream midway (prefetched reloads consumed on
another stream than they were allocated on: ``record_stream``), and a second
step on a user stream created after the engine (the live current stream).
Two more reach the call sites it cannot: ``reused_source_workout`` (backward on
another stream reads sources still in flight) and ``unconsumed_prefetch_workout``
(a prefetch that backward never reads, dropped at the end of the pass or when its
handles die during it). ``disk_workout`` sends every offloaded tensor through the
disk tier's writer thread.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from offload_testkit import cpu_ctx, loss_of, make_inputs, make_model, twin_of

__all__ = ["disk_workout", "ordering_workout", "reused_source_workout", "switch_stream_in_backward",
           "unconsumed_prefetch_workout"]


def switch_stream_in_backward(acc: Any, module: nn.Module, stream: Any) -> Any:
    """From when ``module``'s output gradient arrives, backward runs on ``stream`` (ordered after the
    stream it was on). Returns the hook handle."""

    def on_grad(g: torch.Tensor) -> torch.Tensor:
        stream.wait_stream(acc.current_stream())
        g.record_stream(stream)  # the gradient, made on the old stream, is read and freed on the new one
        acc.set_stream(stream)
        return g

    def fwd_hook(mod, args, out):
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(on_grad)

    return module.register_forward_hook(fwd_hook)


def ordering_workout(acc: Any, **ctx_kw: Any) -> tuple[nn.Module, nn.Module, Any]:
    """Two steps of the toy Llama under ``acc`` and the no-offload twin's; returns (model, twin, ctx)."""
    model = make_model("toy")
    twin = twin_of(model)
    kw = dict(max_fwd_stash_size=1, max_inflight_bytes=1, prefetch_bytes=1 << 20)
    kw.update(ctx_kw)
    ctx = cpu_ctx(**kw)
    default = acc.default_stream()
    bwd = acc.Stream(late=False, name="backward")
    user = acc.Stream(late=False, name="user")  # created after the engine (Rule 3)
    handle = switch_stream_in_backward(acc, model.layers[0], bwd)
    for step, stream in enumerate((default, user)):
        inputs = make_inputs("toy", seed=step)
        stream.wait_stream(default)
        acc.set_stream(stream)
        with ctx:
            loss = loss_of(model, inputs)
        loss.backward()
        default.wait_stream(acc.current_stream())
        acc.set_stream(default)
        loss_of(twin, inputs).backward()
    handle.remove()
    acc.synchronize()
    return model, twin, ctx


def reused_source_workout(acc: Any, **ctx_kw: Any) -> tuple[nn.Module, nn.Module, Any]:
    """A step of the toy Llama with the stash unbounded, forward on the default stream and the whole
    backward on another: the last sources packed are still in the stash (their D2H in flight) when
    backward reads them, so they are used as they are ("reused_source") on a stream they were not
    allocated on. Untimed: the ledger's host reads of timing events would order the streams."""
    model = make_model("toy")
    twin = twin_of(model)
    inputs = make_inputs("toy")
    ctx = cpu_ctx(**{"timing": False, **ctx_kw})
    default = acc.default_stream()
    bwd = acc.Stream(late=False, name="backward")
    with ctx:
        loss = loss_of(model, inputs)
    bwd.wait_stream(default)
    with acc.stream(bwd):
        loss.backward()
    default.wait_stream(bwd)
    loss_of(twin, inputs).backward()
    acc.synchronize()
    return model, twin, ctx


def unconsumed_prefetch_workout(acc: Any, *, drop_first: bool, **ctx_kw: Any) -> tuple[nn.Module, nn.Module, Any]:
    """Forward A, forward B, backward B: B's prefetch walks on into A's saved tensor (packed just before,
    on this thread) and loads it; backward B never reads it, and no later reload orders compute after
    its copy. ``drop_first``: a hook in backward B drops graph A, so that prefetch's handle dies during
    the pass; otherwise the pass ends with it unconsumed and A's backward runs after."""
    g = torch.Generator().manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(8, 32, generator=g)) for _ in range(2)])
    twin = twin_of(model)
    ctx = cpu_ctx(**{"prefetch_bytes": 1 << 20, "max_fwd_stash_size": 1, **ctx_kw})
    for m, c in ((model, ctx), (twin, nullcontext())):
        pa, pb = m
        with c:
            graph_a = [pa.sin().exp().sum()]
            loss_b = pb.sin().exp().exp().sum()
        if drop_first:
            hook = pb.register_hook(lambda grad, graph_a=graph_a: graph_a.clear())
        loss_b.backward()
        if drop_first:
            hook.remove()
        else:
            graph_a.pop().backward()
    acc.synchronize()
    return model, twin, ctx


def disk_workout(acc: Any, disk_dir: str, **ctx_kw: Any) -> tuple[nn.Module, nn.Module, Any]:
    """A step of the toy Llama with no host budget: every offloaded tensor is copied into a staging
    buffer on the side stream, and written to a file by the disk tier's writer thread. The caller
    closes the returned engine."""
    model = make_model("toy")
    twin = twin_of(model)
    inputs = make_inputs("toy")
    ctx = cpu_ctx(**{"host_budget_bytes": 0, "disk_dir": disk_dir, **ctx_kw})
    try:
        with ctx:
            loss = loss_of(model, inputs)
        loss.backward()
        loss_of(twin, inputs).backward()
        acc.synchronize()
    except BaseException:
        ctx.close()
        raise
    return model, twin, ctx
