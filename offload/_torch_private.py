"""Every use of a private PyTorch API in the engine lives here, each with its reason.

Keeping them in one small module means a PyTorch upgrade that moves one of them
breaks one file, and the rest of the engine reads as public-API code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "neg_view",
    "graph_task_id",
    "queue_end_of_backward",
    "register_host_memory",
    "unregister_host_memory",
    "version_tracker",
    "profiler_enabled",
    "top_saved_tensors_hooks",
]


def graph_task_id() -> int:
    """Id of the autograd graph task running on this thread, -1 outside backward.

    Why private: there is no public way to tell that a new backward pass began,
    and the engine closes a ledger step and drains its stash once per pass.
    """
    return torch._C._current_graph_task_id()


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass finishes (must be called during it).

    Why private: ``Variable._execution_engine.queue_callback`` is the only hook
    into the end of a graph task; torch.utils.checkpoint uses it the same way.
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def register_host_memory(t: torch.Tensor) -> bool:
    """Page-lock an existing CPU tensor's memory in place (CUDA only).

    Why private: ``torch.empty(..., pin_memory=True)`` goes through the
    CachingHostAllocator, which rounds every block up to a power of two (up to
    ~2x host RAM for odd activation sizes). Registering an exact-size pageable
    allocation with cudaHostRegister keeps the host footprint at the bytes we
    store. Returns False (and registers nothing) when it is unavailable or fails.
    """
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    try:
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    except Exception:
        return False
    return int(rc) == 0


def unregister_host_memory(t: torch.Tensor) -> None:
    """Undo :func:`register_host_memory` before the tensor's memory is freed."""
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:
        pass


def neg_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` with the lazy negation bit set (the inverse of resolving it).

    Why private: a saved tensor can carry the neg bit (e.g. the imaginary part
    of a conjugate view); the engine copies raw storage bytes, so it must set
    the bit again on the reloaded view, and only ``torch._neg_view`` does that.
    """
    return torch._neg_view(t)


_EMPTY: dict[torch.device, torch.Tensor] = {}
"""One empty tensor per device: what a version tracker's data is swapped for."""


def version_tracker(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor | None:
    """An empty tensor that shares ``t``'s version counter but not its storage.

    Why private: autograd keeps no version counter for tensors saved through
    hooks, and the engine must raise autograd's in-place error even when every
    Python reference to the saved tensor is gone (a temporary). A detached
    alias shares the version counter; assigning its ``.data`` an empty tensor
    then drops its storage (so the source memory can still be freed) and keeps
    the shared counter: ``set_data`` shallow-copies the new data into the alias
    without touching its version counter (an implementation detail of
    ``Tensor.data``'s setter). Unlike ``set_()`` it never bumps the counter, so
    the version that another thread (or autograd's own check of a tensor saved
    without hooks) reads at the same time is never off by one. Returns None
    when the tensor does not allow it (the caller falls back to a weak
    reference to the tensor).
    """
    try:
        if device is None:
            device = t.device
        empty = _EMPTY.get(device)
        if empty is None:
            empty = _EMPTY[device] = torch.empty(0, device=device)
        tracker = t.detach()
        tracker.data = empty
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        return None
    return tracker


def profiler_enabled() -> bool:
    """True while a torch (autograd/kineto) profiler is recording on this process.

    Why private: ``record_function`` costs a dispatcher call even with no
    profiler running; the engine's hooks run once per saved tensor, so they
    open their trace ranges only when this cheap flag says someone listens.
    """
    return torch._C._autograd._profiler_enabled()


def top_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost (pack, unpack) saved-tensors hooks of this thread, or None.

    Why private: ``offload.attach`` repairs an engine left entered by a
    ``KeyboardInterrupt`` in forward (forward hooks do not run for a
    BaseException); it may only pop the hooks if they are still the engine's.
    """
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


# The hooks run once per saved tensor: they call the C functions themselves
# (the same calls as ``graph_task_id`` / ``profiler_enabled`` above, which say
# why each is private), without a Python frame around them.
graph_task_id_c: Callable[[], int] = torch._C._current_graph_task_id
"""``graph_task_id`` without its Python frame."""
profiler_enabled_c: Callable[[], bool] = torch._C._autograd._profiler_enabled
"""``profiler_enabled`` without its Python frame."""
