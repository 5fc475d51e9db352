"""Host buffer pool: exact-size reuse across steps, pinned where possible, capped.

Buffers are keyed by their exact byte size (no power-of-two rounding), so a
static-shape training loop allocates during its first step and then only
reuses. A capacity cap bounds the bytes reserved; when a new size does not
fit, free buffers of other sizes are released first (oldest first), and only
then does ``take`` report that the budget is full.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import _torch_private

__all__ = ["HostPool", "HostBuffer", "PIN_ALLOCATORS"]

PIN_ALLOCATORS = ("caching", "exact")
"""How pinned buffers are made: "caching" = torch.empty(pin_memory=True) (PyTorch's
CachingHostAllocator, proven, but it rounds blocks up to a power of two);
"exact" = page-aligned pageable memory registered with cudaHostRegister at the
exact size (CUDA only; falls back to "caching" when registration fails)."""

_PAGE = 4096


def _unregister(raw: torch.Tensor) -> None:
    # Runs when the buffer's memory is about to be freed. An async copy may
    # still read it, and unregistering under one is undefined: wait first.
    torch.cuda.synchronize()
    _torch_private.unregister_host_memory(raw)


def _registered_buffer(nbytes: int) -> HostBuffer | None:
    """An exact-size pinned buffer on pages no other allocation shares.

    cudaHostRegister works on whole pages, and registering a page twice fails,
    so the registered range is page-aligned inside a slightly larger pageable
    allocation; it is unregistered before that allocation can be freed.
    """
    size = -(-nbytes // _PAGE) * _PAGE
    raw = torch.empty(size + 2 * _PAGE, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % _PAGE
    region = raw[offset:offset + size]
    if not _torch_private.register_host_memory(region):
        return None
    view = region[:nbytes]
    weakref.finalize(view, _unregister, region)
    return HostBuffer(view, nbytes, pinned=True, registered=True)


@dataclass(eq=False)
class HostBuffer:
    """One host allocation handed out by the pool."""

    tensor: torch.Tensor
    """Flat uint8 tensor of exactly ``nbytes`` bytes."""
    nbytes: int
    """Size in bytes."""
    pinned: bool
    """Page-locked (async copies possible)."""
    registered: bool = False
    """Pinned by cudaHostRegister on pages of its own (unregistered when collected)."""
    pooled: bool = True
    """Counted in the pool (False for one-off pageable overflow buffers)."""


class HostPool:
    """Exact-size host buffer cache with a byte cap and usage statistics."""

    def __init__(
        self,
        *,
        pin: bool,
        capacity_bytes: int | None = None,
        device_type: str | None = None,
        pin_allocator: str = "caching",
    ) -> None:
        if pin_allocator not in PIN_ALLOCATORS:
            raise ValueError(
                f"HostPool: pin_allocator={pin_allocator!r} is not one of {PIN_ALLOCATORS}."
            )
        self.pin = pin
        """Try to page-lock new buffers (only meaningful with an accelerator)."""
        self.pin_allocator = pin_allocator
        """"caching" or "exact" (see ``PIN_ALLOCATORS``)."""
        self.capacity_bytes = capacity_bytes
        """Cap on reserved bytes; None means no cap."""
        self._device_type = device_type
        self._lock = threading.Lock()
        self._free: "OrderedDict[int, list[HostBuffer]]" = OrderedDict()
        self._reserved = 0
        self._in_use = 0
        self._peak_reserved = 0
        self._peak_in_use = 0
        self._allocations = 0
        self._reuses = 0
        self._pin_failures = 0
        self._evictions = 0
        self._received_bytes = 0
        self._window_peak_in_use = 0
        self._trimmed = 0

    # -- allocation -------------------------------------------------------

    def _allocate(self, nbytes: int, pin: bool) -> HostBuffer:
        if pin and self.pin_allocator == "exact" and self._device_type == "cuda":
            buf = _registered_buffer(nbytes)
            if buf is not None:
                return buf
        if pin:
            try:
                return HostBuffer(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), nbytes, True)
            except RuntimeError:
                pass
            self._pin_failures += 1
        return HostBuffer(torch.empty(nbytes, dtype=torch.uint8), nbytes, pinned=False)

    def _release(self, buf: HostBuffer) -> None:
        buf.tensor = None  # a registered buffer unregisters itself when collected

    def _release_free_until(self, limit: int) -> tuple[int, int]:
        """Release free buffers, least recently returned size first, until at most
        ``limit`` bytes are reserved (or none is free). Returns (count, bytes)."""
        count = released = 0
        while self._reserved > limit and self._free:
            size, bufs = next(iter(self._free.items()))
            buf = bufs.pop()
            if not bufs:
                del self._free[size]
            self._reserved -= buf.nbytes
            count += 1
            released += buf.nbytes
            self._release(buf)
        return count, released

    def _evict_for(self, nbytes: int) -> bool:
        """Free cached buffers of other sizes until ``nbytes`` more fit under the cap."""
        count, _ = self._release_free_until(self.capacity_bytes - nbytes)
        self._evictions += count
        return self._reserved + nbytes <= self.capacity_bytes

    def take(self, nbytes: int) -> HostBuffer | None:
        """A buffer of exactly ``nbytes``, or None if the cap leaves no room."""
        with self._lock:
            bufs = self._free.get(nbytes)
            if bufs:
                buf = bufs.pop()
                if not bufs:
                    del self._free[nbytes]
                self._reuses += 1
            else:
                if self.capacity_bytes is not None and not self._evict_for(nbytes):
                    return None
                buf = self._allocate(nbytes, self.pin)
                self._allocations += 1
                self._reserved += nbytes
                self._peak_reserved = max(self._peak_reserved, self._reserved)
            self._in_use += nbytes
            self._peak_in_use = max(self._peak_in_use, self._in_use)
            self._window_peak_in_use = max(self._window_peak_in_use, self._in_use)
            self._received_bytes += nbytes
            return buf

    def overflow(self, nbytes: int) -> HostBuffer:
        """A one-off pageable buffer outside the pool (``on_host_budget="pageable"``)."""
        return HostBuffer(torch.empty(nbytes, dtype=torch.uint8), nbytes, pinned=False, pooled=False)

    def give(self, buf: HostBuffer) -> None:
        """Return a buffer taken with :meth:`take`; it will be reused for the same size."""
        if not buf.pooled:
            return
        with self._lock:
            self._in_use -= buf.nbytes
            self._free.setdefault(buf.nbytes, []).append(buf)
            self._free.move_to_end(buf.nbytes)

    def trim(self) -> int:
        """Release free buffers, least recently returned sizes first, until the
        reserved bytes are no more than the peak in use since the last trim.

        The engine calls this at the end of every step: a static-shape loop
        loses nothing (every free buffer is reused next step), while a loop with
        changing shapes cannot accumulate one buffer set per shape ever seen.
        Returns the bytes released.
        """
        with self._lock:
            _, released = self._release_free_until(max(self._window_peak_in_use, self._in_use))
            self._trimmed += released
            self._window_peak_in_use = self._in_use
            return released

    def clear(self) -> None:
        """Release every free buffer (buffers in use stay valid)."""
        with self._lock:
            self._release_free_until(-1)

    # -- accounting -------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def in_use_bytes(self) -> int:
        return self._in_use

    def stats(self) -> dict[str, int | None]:
        """Snapshot of the pool's counters (bytes and counts)."""
        with self._lock:
            return {
                "reserved_bytes": self._reserved,
                "in_use_bytes": self._in_use,
                "peak_reserved_bytes": self._peak_reserved,
                "peak_in_use_bytes": self._peak_in_use,
                "allocations": self._allocations,
                "reuses": self._reuses,
                "pin_failures": self._pin_failures,
                "evictions": self._evictions,
                "trimmed_bytes": self._trimmed,
                "received_bytes": self._received_bytes,
                "capacity_bytes": self.capacity_bytes,
            }
