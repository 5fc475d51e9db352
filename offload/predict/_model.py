"""Building the model a capture runs: under fake tensors, cast, registered, with Hugging Face's mask code
kept on the path a real run takes, and the real model's state swapped for fake twins (NOTE [ Capture ]
in ``_capture.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from ..modules import register_model
from ..planner.blocks import find_blocks

__all__ = ["fake_parameters"]


class _FakeDeepCopy(TorchFunctionMode):
    """``copy.deepcopy`` of a fake tensor, in the running fake mode: torch's own makes the copy in a new
    fake mode, which the running one then refuses ("Mixing fake modes"), e.g. ``nn.TransformerEncoder``
    deep-copies its layer. Entered only while the model is built."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__deepcopy__ and type(args[0]) is FakeTensor:
            t, memo = args
            if id(t) not in memo:
                with torch.no_grad():
                    out = t.clone()
                out = nn.Parameter(out, t.requires_grad) if getattr(t, "_is_param", False) else \
                    out.requires_grad_(t.requires_grad)
                memo[id(t)] = out
            return memo[id(t)]
        return func(*args, **kwargs)


def _hf_masks_as_real(stack: contextlib.ExitStack) -> None:
    """Hugging Face's mask code treats a fake tensor as a sign of tracing and then builds an explicit
    causal mask (B x 1 x S x S, and GQA keys and values expanded for it) where a real run passes
    ``is_causal=True``. While capturing: a fake scalar (the query offset) is not "tracing", and
    sequences are not packed (default position ids; packing cannot be read from fake values). A fake
    padding mask still makes the explicit mask: its values are unknown (an assumption the prediction
    states)."""
    import sys

    mu = sys.modules.get("transformers.masking_utils")
    orig = getattr(mu, "is_tracing", None)
    packed = getattr(mu, "find_packed_sequence_indices", None)
    if orig is None or packed is None:
        return

    def is_tracing(tensor: Any = None) -> bool:
        return orig(None) if type(tensor) is FakeTensor and tensor.dim() == 0 else orig(tensor)

    def find_packed_sequence_indices(position_ids: Any, *args: Any, **kwargs: Any) -> Any:
        return None if type(position_ids) is FakeTensor else packed(position_ids, *args, **kwargs)

    for name, fn, old in (("is_tracing", is_tracing, orig),
                          ("find_packed_sequence_indices", find_packed_sequence_indices, packed)):
        setattr(mu, name, fn)
        stack.callback(setattr, mu, name, old)


def _cast(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters and buffers to ``dtype``, in place (``Module.to`` would swap fake
    parameters, which refuses tensors that are weakly referenced)."""
    with torch.no_grad():
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
            for k, b in m._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    m._buffers[k] = b.to(dtype)


def _build(model_fn: Callable[[], nn.Module], dtype: torch.dtype | None, fake: bool) -> nn.Module:
    with _FakeDeepCopy() if fake else contextlib.nullcontext():
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload.predict: model_fn() must return an nn.Module, got {type(model).__name__}")
    if dtype is not None:
        _cast(model, dtype)
    register_model(model)
    return model


def _block_names(model: nn.Module) -> list[str]:
    try:
        return [n for n, _ in find_blocks(model)]
    except ValueError:  # no nn.ModuleList: activations are grouped by module
        return []


@contextlib.contextmanager
def fake_parameters(model: nn.Module):
    """While inside (and inside a capture, whose fake mode makes them): ``model``'s parameters and buffers
    are fake ones of the same shape, stride, dtype and ``requires_grad`` (a tied weight stays one tensor);
    the real ones are put back on exit, untouched (NOTE [ Capture ] item 7)."""
    memo: dict[int, torch.Tensor] = {}
    undo: list[tuple[dict, str, Any]] = []

    def twin(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in memo:
            with torch.no_grad():
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            memo[id(t)] = nn.Parameter(f, t.requires_grad) if param else f
        return memo[id(t)]

    try:
        for m in model.modules():
            for table, param in ((m._parameters, True), (m._buffers, False)):
                for k, t in list(table.items()):
                    if t is not None:
                        undo.append((table, k, t))
                        table[k] = twin(t, param)
        yield model
    finally:
        for table, k, t in reversed(undo):
            table[k] = t
