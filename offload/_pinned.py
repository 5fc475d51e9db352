"""Host memory for the pool's chunks: pinned by PyTorch's caching allocator, registered with
cudaHostRegister, or pageable; and handing released pinned memory back to CUDA.

See NOTE [ Host pool layout ] in ``offload/pool.py`` for why chunks from the caching
allocator are powers of two.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from . import _torch_private
from ._arena import _PAGE

__all__ = ["PIN_ALLOCATORS", "pinned_chunk", "unregister_when_dropped", "return_pinned_cache",
           "host_allocator_bytes", "HOST_ALLOC_OBSERVERS", "host_empty"]

PIN_ALLOCATORS = ("caching", "exact")
"""How pinned chunks are made: "caching" = torch.empty(pin_memory=True) (PyTorch's
CachingHostAllocator; chunks are powers of two, so its rounding wastes nothing);
"exact" = page-aligned pageable memory registered with cudaHostRegister as a whole
chunk (CUDA only; falls back to "caching" when registration fails)."""


def pinned_chunk(nbytes: int, pin_allocator: str, device_type: str | None) -> tuple[torch.Tensor, bool] | str:
    """A page-locked uint8 tensor of ``nbytes`` as (tensor, registered by cudaHostRegister),
    or the error text when pinning failed (the caller decides whether to fall back)."""
    if pin_allocator == "exact" and device_type == "cuda":
        raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
        offset = (-raw.data_ptr()) % _PAGE
        region = raw[offset:offset + nbytes]
        if _torch_private.register_host_memory(region):
            return region, True
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False
    except RuntimeError as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"


def _unregister(region: torch.Tensor) -> None:
    # Runs when the chunk is dropped. An async copy may still read it, and
    # unregistering under one is undefined: wait first.
    torch.cuda.synchronize()
    _torch_private.unregister_host_memory(region)


def unregister_when_dropped(owner: object, region: torch.Tensor) -> None:
    """Unregister a cudaHostRegister'ed ``region`` once ``owner`` (its chunk) is collected."""
    weakref.finalize(owner, _unregister, region)


def return_pinned_cache(device_type: str | None) -> None:
    """Hand the caching allocator's freed pinned blocks back to the driver (else PyTorch keeps them).

    The device is synchronized first. PyTorch's caching host allocator keeps a freed block that a
    stream used (every async copy records its stream) out of its free list until events it records
    at the free have completed, and it looks at those events only inside a later pinned allocation
    or ``empty_cache`` (``ATen/core/CachingHostAllocator.h``). At the end of the first step, where
    the pool re-lays itself out, backward's copies and kernels are still queued, so an
    ``empty_cache`` right after the free finds the events pending, and the pool never allocates
    again to look a second time: the first step's blocks would stay pinned for the whole run.
    Releases are rare (the re-layout once, a trim when shapes shrink for good, ``clear``): one
    synchronize each.
    """
    if device_type is not None and device_type != "cpu":
        mod = getattr(torch, device_type, None)
        sync = getattr(mod, "synchronize", None)
        if sync is not None and getattr(mod, "is_initialized", lambda: True)():
            sync()
    _torch_private.empty_host_cache()


def host_allocator_bytes() -> int | None:
    """PyTorch's pinned allocator's ``allocated_bytes.current`` (process-wide), None if unreadable."""
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except Exception:
        return None


HOST_ALLOC_OBSERVERS: list[Callable[[torch.Tensor], None]] = []
"""Called with every unpinned host buffer the pools make (``host_empty``): ``offload.predict``'s capture
tells host memory from device memory this way when both are CPU tensors. Empty otherwise."""


def host_empty(nbytes: int) -> torch.Tensor:
    """A new unpinned host buffer of ``nbytes`` (told to ``HOST_ALLOC_OBSERVERS``)."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    for fn in HOST_ALLOC_OBSERVERS:
        fn(t)
    return t
