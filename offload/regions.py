"""Regions that stay on the device: NoOpManager, module exclusion, the output head.

The output head is excluded by default because its activations are consumed
first in backward (so there is no compute to hide the reload behind) and,
for large vocabularies, are the biggest tensors of the step.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from ._warn import user_stacklevel
from ._exclusion import RegionHandle, exclude_module, keep_after_module, warn_unused_regions
from ._handles import _Kept
from .engine import OffloadActivations


log = logging.getLogger(__name__)

__all__ = [
    "NoOpManager",
    "RegionHandle",
    "exclude_module",
    "keep_after_module",
    "exclude_output_head",
    "find_backbone",
    "warn_unused_regions",
    "find_output_head",
    "get_act_offloading_ctx_manager",
]


class NoOpManager(torch.autograd.graph.saved_tensors_hooks):
    """Leave every tensor saved inside the block where it is (torchtune-compatible).

    It shadows any enclosing OffloadActivations (only the innermost hooks run),
    so what it keeps is invisible to that engine's ledger; prefer
    ``ctx.excluded()`` or ``ctx.exclude(module)``, which keep the same tensors
    and still record them. Unlike a bare identity hook, it keeps autograd's
    in-place check (Rule 6).
    """

    def __init__(self) -> None:
        super().__init__(_Kept, _Kept.unpack)


def find_backbone(model: nn.Module) -> nn.Module | None:
    """The body of a Hugging Face model with a head (``LlamaModel`` in ``LlamaForCausalLM``), or None.

    Looked through DDP / ``torch.compile`` wrappers and PEFT (``get_base_model()``);
    the body is the model's ``base_model`` when that is a submodule.
    """
    model = _unwrap(model)
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # PEFT
    body = getattr(inner, "base_model", None)
    return body if isinstance(body, nn.Module) and body is not inner else None


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP / DataParallel / torch.compile wrappers keep the real model inside.
    for attr in ("module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module) and inner is not model:
            return _unwrap(inner)
    return model


def find_output_head(model: nn.Module) -> nn.Module | None:
    """The module that computes the logits, or None.

    Looked for, in order: HF's ``get_output_embeddings()``, ``model.output``
    (or its ``.linear`` when ``output`` is a torchtune-style TiedLinear that is
    not itself a module), ``model.lm_head``, and a Linear whose weight is an
    Embedding's weight (a tied head).
    """
    model = _unwrap(model)
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Module):
            return head
    for name in ("output", "lm_head"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
        inner = getattr(head, "linear", None)
        if isinstance(inner, nn.Module):
            return inner
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tied = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) in embeddings]
    if tied:
        return tied[-1]
    return None


def exclude_output_head(engine: "OffloadActivations", model: nn.Module) -> list[RegionHandle]:
    """Keep ``model``'s output head, and what runs after it, on ``engine``'s device; [] if no head is found.

    The head (``find_output_head``) is excluded with ``keep_after=True`` until
    ``model``'s next call, so the loss computed on its output stays too. For a
    Hugging Face model, what runs after its body (``find_backbone``) is kept as
    well: a fused head never runs the head module (TRL's SFTTrainer). The
    handles' ``remove()`` undo it.
    """
    head = find_output_head(model)
    if head is None:
        return []
    region = exclude_module(engine, head, keep_after=True, root=model)
    handles = [region]
    body = find_backbone(model)
    root = _unwrap(model)
    if body is not None:
        after_body = keep_after_module(engine, body)
        handles.append(after_body)
        # Two ways to keep the same tail: either one running is enough, and only neither running is
        # a sign of a stale compiled graph. The head alone runs when the model calls a part of its
        # body directly (OPTForCausalLM calls self.model.decoder, never self.model); the body alone
        # when no head module runs (TRL's fused head).
        region.optional = True
        after_body.optional = lambda: region.fired > 0
    elif hasattr(root, "skip_output_layer"):
        # torchtune's LinearCrossEntropyLoss sets model.skip_output_layer and projects
        # through the head itself, in the loss, outside the context: no head runs by design.
        root_ref = weakref.ref(root)
        region.optional = lambda: bool(getattr(root_ref(), "skip_output_layer", False))
    log.info("%s: output head %s excluded%s", type(model).__name__, type(head).__name__,
             f", and what runs after {type(body).__name__}" if body is not None else "")
    return handles


def get_act_offloading_ctx_manager(
    model: nn.Module,
    enable_activation_offloading: bool = True,
    *,
    warn_if_no_head: bool = True,
    **kwargs: Any,
) -> "OffloadActivations | contextlib.nullcontext":
    """An OffloadActivations for ``model`` with its output head excluded (torchtune's and TRL's API).

    torchtune calls it as ``(model, enable_activation_offloading)``; TRL as
    ``(model=..., use_pin_memory=..., use_streams=..., min_offload_size=...,
    max_fwd_stash_size=..., warn_if_no_head=...)`` with no enable flag (so it
    defaults to True). ``kwargs`` go to OffloadActivations unchanged
    (``config=`` included; ``model`` defaults to this model so its parameters
    and buffers are known up front). Returns a null context when offloading is
    disabled. Warns, with the fix, when no head is found (unless
    ``warn_if_no_head=False``).
    """
    if not isinstance(enable_activation_offloading, bool):
        raise TypeError(
            f"get_act_offloading_ctx_manager: enable_activation_offloading="
            f"{enable_activation_offloading!r} is not a bool (got "
            f"{type(enable_activation_offloading).__name__}). The second positional argument is "
            "torchtune's enable flag; pass other settings by name, or use offload.compat.trl for "
            "TRL's signature."
        )
    if not enable_activation_offloading:
        return contextlib.nullcontext()
    kwargs.setdefault("model", model)
    ctx = OffloadActivations(**kwargs)
    handles = exclude_output_head(ctx, model)
    if not handles and warn_if_no_head:
        warnings.warn(
            f"get_act_offloading_ctx_manager: no output head found on {type(model).__name__} "
            "(looked for get_output_embeddings(), .output, .lm_head and a Linear tied to an "
            "Embedding), so the head's activations will be offloaded too: they are needed first "
            "in backward, so their reload cannot overlap compute and costs step time for little "
            "memory. Fix: call ctx.exclude(<your head module>) on the returned context, or pass "
            "warn_if_no_head=False if the model has no such head.",
            stacklevel=user_stacklevel(),
        )
    return ctx
