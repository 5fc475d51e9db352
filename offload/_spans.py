"""Distinct saved bytes in one step: the union of the byte ranges the saved views span, per storage.

``offload.policy.StorageSet`` answers "first save of this storage?" and counts
the whole storage; a batch slice ``data[:4]`` of a 2.5 MB tensor then counts
2.5 MB while its saves keep 5 KB reachable through the view. The engine's
ledger and the profilers' trackers count what the views can touch instead
(so their ``unique_bytes`` agree): each storage's saved ranges are merged,
and a save adds only the bytes no earlier save of that storage covered.
Storage identity is live, as in ``StorageSet``: a range set is dropped when
its first saver's base dies (the allocator may reuse the address).
"""

from __future__ import annotations

import weakref
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

import torch

from .policy import _weak, live_base, span_elems, storage_identity

__all__ = ["SpanSet", "byte_span"]


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) bytes of its storage that ``t`` can touch; (0, its bytes) when it has no single span."""
    try:
        lo, hi = span_elems(t)
    except (RuntimeError, NotImplementedError, TypeError):
        return 0, t.numel() * t.element_size()
    es = t.element_size()
    return lo * es, hi * es


class _Ranges:
    """Sorted, disjoint [lo, hi) byte ranges of one storage."""

    __slots__ = ("base", "starts", "ends")

    def __init__(self, base: Callable[[], torch.Tensor | None]) -> None:
        self.base = base
        self.starts: list[int] = []
        self.ends: list[int] = []

    @classmethod
    def first(cls, base: Callable[[], torch.Tensor | None], lo: int, hi: int) -> "_Ranges":
        """A range set holding one range (the common case: built without a merge)."""
        r = cls.__new__(cls)
        r.base = base
        r.starts, r.ends = ([lo], [hi]) if hi > lo else ([], [])
        return r

    def add(self, lo: int, hi: int) -> int:
        """Merge [lo, hi); return the bytes it added."""
        if hi <= lo:
            return 0
        starts, ends = self.starts, self.ends
        if len(starts) == 1 and starts[0] <= lo and hi <= ends[0]:
            return 0  # already covered (a repeated save of one storage)
        i = bisect_left(ends, lo)  # first range that ends at or after lo
        j = i
        covered = 0
        new_lo, new_hi = lo, hi
        while j < len(starts) and starts[j] <= hi:
            covered += min(ends[j], hi) - max(starts[j], lo)
            new_lo, new_hi = min(new_lo, starts[j]), max(new_hi, ends[j])
            j += 1
        starts[i:j] = [new_lo]
        ends[i:j] = [new_hi]
        return (hi - lo) - covered


class SpanSet:
    """Per step: bytes each save adds to the union of saved spans of its storage."""

    def __init__(self) -> None:
        self.entries: dict[tuple[Any, int], _Ranges | tuple[Callable[[], torch.Tensor | None], int, int]] = {}
        """key -> the first save's (weak base, lo, hi) while one range covers every save of that
        storage (the common case, no object built), else _Ranges. The engine's pack hook adds a
        storage not seen yet itself (``add_span`` inlined); anything else goes through ``add_span``."""

    def add(self, t: torch.Tensor) -> int:
        """Bytes of ``t``'s span not covered by an earlier save of the same storage this step."""
        key, _size = storage_identity(t)
        if key[0] == "id":  # no plain storage: the tensor itself, once
            return self.add_span(t, key, 0, t.numel() * t.element_size())
        lo, hi = byte_span(t)
        return self.add_span(t, key, lo, hi)

    def add_span(self, t: torch.Tensor, key: tuple[Any, int], lo: int, hi: int) -> int:
        """``add`` for a caller that already has ``t``'s storage key and byte span [lo, hi).

        The engine's pack hook calls this once per saved tensor: a storage not
        seen this step, or seen through the same base object, is settled
        without re-reading the storage pointer.
        """
        entry = self.entries.get(key)
        base = t._base
        if base is None:
            base = t
        if entry is not None:
            single = type(entry) is tuple
            ref = entry[0] if single else entry.base
            b = ref()
            if b is not None and (b is base or live_base(ref, key) is not None):
                if single:
                    if entry[1] <= lo and hi <= entry[2]:
                        return 0  # within the first save's span (a repeated save)
                    entry = self.entries[key] = _Ranges.first(ref, entry[1], entry[2])
                return entry.add(lo, hi)
        if hi <= lo:
            lo = hi = 0
        try:
            ref = weakref.ref(base)
        except TypeError:  # subclasses that refuse weakrefs
            ref = _weak(base)
        self.entries[key] = (ref, lo, hi)
        return hi - lo

    def clear(self) -> None:
        self.entries.clear()
