"""Every private torch API the profiling package touches, in one place, with why.

Keep this module small: each function wraps one private call so a torch
upgrade that moves it breaks here, visibly, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass finishes.

    Why private: autograd has no public "end of backward" callback; the
    execution engine's ``queue_callback`` is what ``torch.utils.checkpoint``
    and FSDP use for the same purpose. Only valid while a backward is running
    (we call it from an unpack hook, which autograd runs during backward).
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


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
