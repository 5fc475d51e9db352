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
