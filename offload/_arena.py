"""Free-range bookkeeping of the host pool's chunks, and the re-layout and trim planners.

``_Arena`` carves best-fit ranges from a set of chunks and merges frees; it
owns no memory, so ``plan_chunks`` can replay a recorded step against
candidate chunk sets with the same rules. See NOTE [ Host pool layout ] in
``offload/pool.py`` for why the pool works this way.
"""

from __future__ import annotations

import bisect

import torch

__all__ = ["_Arena", "_Chunk", "packs", "plan_chunks", "trim_choice"]

_PAGE = 4096


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _page_ceil(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


class _Chunk:
    """One allocation the pool carves buffers from."""

    __slots__ = ("seq", "tensor", "nbytes", "pinned", "registered", "used", "starts", "ends",
                 "last_step", "__weakref__")

    def __init__(self, seq: int, tensor: torch.Tensor, nbytes: int, pinned: bool, registered: bool) -> None:
        self.seq = seq
        self.tensor: torch.Tensor | None = tensor
        self.nbytes = nbytes
        self.pinned = pinned
        self.registered = registered
        self.used = 0
        """Bytes of this chunk handed out (aligned spans)."""
        self.starts: dict[int, int] = {0: nbytes}
        """Free ranges: offset -> size."""
        self.ends: dict[int, int] = {nbytes: 0}
        """Free ranges: end offset -> offset (to merge with a freed left neighbour)."""
        self.last_step = 0
        """The last step (trim count) in which a buffer was carved from this chunk."""


class _Arena:
    """Free ranges of a set of chunks: best-fit carving and merging frees (no memory of its own,
    so the planner can pack a recorded step into candidate chunk sets with the same rules)."""

    __slots__ = ("chunks", "index")

    def __init__(self) -> None:
        self.chunks: dict[int, _Chunk] = {}
        self.index: list[tuple[int, int, int]] = []
        """Free ranges as (size, chunk seq, offset), sorted: best fit, then oldest chunk, lowest offset."""

    def add(self, chunk: _Chunk) -> None:
        self.chunks[chunk.seq] = chunk
        bisect.insort(self.index, (chunk.nbytes, chunk.seq, 0))

    def remove(self, chunk: _Chunk) -> None:
        """Forget a wholly free chunk."""
        del self.chunks[chunk.seq]
        self._unindex(chunk.nbytes, chunk.seq, 0)

    def carve(self, span: int) -> tuple[_Chunk, int] | None:
        """The smallest free range of at least ``span`` bytes, split at its start."""
        i = bisect.bisect_left(self.index, (span,))
        if i == len(self.index):
            return None
        size, seq, off = self.index.pop(i)
        chunk = self.chunks[seq]
        del chunk.starts[off]
        del chunk.ends[off + size]
        if size > span:
            rest = off + span
            bisect.insort(self.index, (size - span, seq, rest))
            chunk.starts[rest] = size - span
            chunk.ends[off + size] = rest
        chunk.used += span
        return chunk, off

    def free(self, chunk: _Chunk, off: int, size: int) -> None:
        """Return ``[off, off + size)`` of ``chunk``, merged with free neighbours."""
        chunk.used -= size
        left = chunk.ends.pop(off, None)
        if left is not None:
            lsize = chunk.starts.pop(left)
            self._unindex(lsize, chunk.seq, left)
            off, size = left, size + lsize
        rsize = chunk.starts.pop(off + size, None)
        if rsize is not None:
            del chunk.ends[off + size + rsize]
            self._unindex(rsize, chunk.seq, off + size)
            size += rsize
        chunk.starts[off] = size
        chunk.ends[off + size] = off
        bisect.insort(self.index, (size, chunk.seq, off))

    def _unindex(self, size: int, seq: int, off: int) -> None:
        del self.index[bisect.bisect_left(self.index, (size, seq, off))]


def packs(sizes: list[int], spans: list[int], events: list[int]) -> bool:
    """Whether a recorded step (``events``: k >= 0 takes ``spans[k]``, k < 0 gives back
    take ``-k - 1``) packs into fresh chunks of ``sizes`` without growing."""
    arena = _Arena()
    for seq, size in enumerate(sizes):
        arena.add(_Chunk(seq, None, size, False, False))
    where: dict[int, tuple[_Chunk, int]] = {}
    for ev in events:
        if ev >= 0:
            got = arena.carve(spans[ev])
            if got is None:
                return False
            where[ev] = got
        else:
            k = -ev - 1
            chunk, off = where.pop(k)
            arena.free(chunk, off, spans[k])
    return True


def plan_chunks(spans: list[int], events: list[int], limit: int, *, pow2: bool, min_chunk_bytes: int,
                capacity_bytes: int | None) -> list[int] | None:
    """The smallest chunk set (found in a few tries) that a recorded step packs into, if its
    total is at most ``limit`` (and ``capacity_bytes``): power-of-two chunks (the binary digits of
    the total) when ``pow2``, else one page-granular chunk."""
    used = peak = 0
    for ev in events:
        used += spans[ev] if ev >= 0 else -spans[-ev - 1]
        peak = max(peak, used)
    if peak == 0:
        return None
    if pow2:
        grain = max(min_chunk_bytes, _pow2_floor(peak // 64))
    else:
        grain = max(_PAGE, _page_ceil(peak // 64))
    total = -(-peak // grain) * grain
    if capacity_bytes is not None:
        limit = min(limit, capacity_bytes)
    for _ in range(16):
        if total > limit:
            return None
        if pow2:
            sizes = [1 << b for b in range(total.bit_length() - 1, -1, -1) if total >> b & 1]
        else:
            sizes = [total]
        if packs(sizes, spans, events):
            return sizes
        total += grain
    return None


def trim_choice(chunks: list[_Chunk], reserved: int, keep: int,
                step: tuple[list[int], list[int]] | None) -> list[_Chunk]:
    """The wholly free chunks of ``chunks`` (``reserved`` bytes in all) to release to bring the
    pool down to about ``keep`` bytes; ``step`` is the step just ended as (spans, events), None
    when it was not recorded cleanly. Empty when releasing would leave less than ``keep`` bytes
    that the step does not provably pack into."""
    free = [c for c in chunks if c.used == 0]
    gone: list[_Chunk] = []
    left = reserved
    for chunk in sorted(free, key=lambda c: -c.seq):  # newest first, never below keep
        if left - chunk.nbytes >= keep:
            gone.append(chunk)
            left -= chunk.nbytes
    # Still over twice the need: the free chunks are bigger than the excess (one merged
    # chunk): release them anyway, the next step regrows what it needs once.
    for chunk in sorted(free, key=lambda c: -c.nbytes):
        if left <= 2 * keep:
            break
        if chunk not in gone:
            gone.append(chunk)
            left -= chunk.nbytes
    if not gone:
        return []
    if left >= keep:
        # Only if the step just ended still packs into what stays: a loop whose steps
        # repeat never has to allocate again.
        stay = [c.nbytes for c in sorted(chunks, key=lambda c: c.seq) if c not in gone]
        if step is None or not packs(stay, *step):
            return []
    return gone
