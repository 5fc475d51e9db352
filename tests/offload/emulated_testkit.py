"""Shared workouts for the emulated-accelerator tests (offload.testing.EmulatedAccelerator).

``ordering_workout`` drives every ordering call of the engine's stream path at
least once: in-flight sources released at once (stash 1, 1 byte in flight),
prefetch, a backward that changes stream midway (prefetched reloads consumed on
another stream than they were allocated on: ``record_stream``), and a second
step on a user stream created after the engine (the live current stream).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from offload_testkit import cpu_ctx, loss_of, make_inputs, make_model, twin_of

__all__ = ["ordering_workout", "switch_stream_in_backward"]


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
