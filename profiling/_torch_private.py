"""Every private torch API the profiling package touches, in one place, with why.

Keep this module small: each function wraps one private call so a torch
upgrade that moves it breaks here, visibly, and nowhere else.
"""

from __future__ import annotations

import torch

# Shared with the engine: one wrapper for autograd's end-of-backward callback.
from offload._torch_private import queue_end_of_backward  # noqa: F401


def cuda_record_memory_history(max_entries: int | None) -> None:
    """Start (``max_entries`` > 0) or stop (``None``) the CUDA allocator history.

    Why private: ``torch.cuda.memory._record_memory_history`` is the only API
    for allocator traces; it is underscore-named but documented. On a CPU build
    it raises AttributeError, so callers gate on ``torch.cuda.is_available()``.
    """
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(enabled="all", max_entries=max_entries)


def cuda_dump_snapshot(path: str) -> None:
    """Write the allocator snapshot pickle read by ``torch.cuda._memory_viz`` / pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)


class _NoHandle:
    """A stand-in hook handle whose ``remove()`` does nothing."""

    def remove(self) -> None:
        pass


def memtracker_skip_frozen_params(mem_tracker: object, model: object) -> None:
    """Keep ``MemTracker`` from hooking parameters that cannot have a gradient.

    Why private: ``MemTracker._track_module_params_and_buffers`` registers a
    gradient hook on every parameter it meets unless one is recorded in
    ``_param_to_grad_hook_handles``; for a frozen parameter (LoRA/QLoRA base
    weights, ``requires_grad=False``) ``register_hook`` raises and the step
    dies. Recording no-op handles for them makes MemTracker skip them (they
    never receive a gradient); MemTracker clears the table on exit, so call
    this after each ``__enter__``.
    """
    handles = mem_tracker._param_to_grad_hook_handles  # type: ignore[attr-defined]
    for p in model.parameters():  # type: ignore[attr-defined]
        if not p.requires_grad and handles.get(p, None) is None:
            handles[p] = (_NoHandle(), _NoHandle())
