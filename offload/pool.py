"""Host buffer pool: buffers carved from a few large chunks, pinned where possible, capped.

NOTE [ Host pool layout ]
Activation sizes change with the sequence length, so a pool that caches
buffers by exact size reuses almost nothing when the length varies every step
(and PyTorch's caching pinned allocator, which rounds every block up to a power
of two, then holds up to ~4x the bytes in use). This pool instead owns a few
large *chunks* and hands out views of them:

- A take is served best-fit from the free ranges of all chunks (smallest free
  range that fits; ties go to the oldest chunk and the lowest offset). A give
  returns the range and merges it with free neighbours, so a step that frees
  everything leaves every chunk whole again and the next step, whatever its
  shapes, packs into the same memory.
- Pinned chunks from ``pin_allocator="caching"`` are powers of two:
  PyTorch's CachingHostAllocator rounds each pinned block up to a power of
  two, so a power-of-two chunk costs exactly its size underneath (the pool's
  ``reserved_bytes`` is the real pinned footprint). Otherwise (pageable
  memory, or ``"exact"`` = cudaHostRegister, registered per chunk and
  unregistered when released) chunks are whole pages.
- Growth: when nothing fits, a new chunk of about 1/8 of what is reserved is
  added (headroom, so a loop whose lengths vary stops allocating once its
  longest steps were seen). A request bigger than that gets a chunk of its
  own, whose remainder serves other requests. During the first step,
  page-granular pools add chunks of exactly the size needed instead (nothing
  is rounded underneath, so the first step holds ~1.0x its peak too).
- Re-layout: growth has to guess, so at the end of the first step the pool
  replays that step's requests against candidate chunk sets (power of two:
  the binary digits of its peak, rounded up by 1/64 at a time; pages: one
  chunk of that size) and swaps its chunks for the first set they pack into
  (power of two: only if that is smaller; blocks of a size it had come back
  from PyTorch's cache). The same requests then pack the same way in every
  later step: a static-shape loop holds ~1.01x its peak and never allocates
  again.
- Replay: the takes of a step repeat the previous step's, so their ranges
  can too. A give *parks* its range (it stays carved, out of the arena). At
  the end of a *pure* step (every take before the first give, everything
  given back: a training step's forward then backward), which began with
  nothing in use and ended with the chunks it began with, its parked ranges
  become the replay list, in take order, and the next step's i-th take gets
  the i-th range back (with its view tensor) while its sizes match and it
  has given nothing back yet. That is exactly the range best fit would carve:
  the previous step carved its first i takes from the same state (or
  replayed a step that did). At the first take that does not match (another
  size, a take after a give), every parked and not yet replayed range goes
  back to the arena, which then holds exactly what it would hold without
  replay, and carving goes on from there; an impure step, a re-layout, a
  trim that may release chunks and ``clear`` do the same. So a loop whose
  shapes repeat pays no arena work and no slicing per take, and every
  decision that shapes the footprint (carving, growth, re-layout, trim) is
  the one the arena alone would make.
- Trim (the engine calls it after every step) releases only whole free
  chunks, and only when the reserved bytes exceed 1.25x the largest step
  peak of the last ``trim_window`` steps: a loop whose shapes shrank for good
  gives memory back, one that merely varies does not churn.
- The cap (``capacity_bytes``) bounds the chunk bytes. A request that cannot
  fit even in an empty pool fails at once, and free chunks are released to
  make room only when that actually makes the request fit.

Measured on request traces recorded from the toy Llama, with the pinned
allocator's rounding and cache modelled: ``python -m bench.pool_replay``
(``bench/results/cpu/pool_replay.json``).

Why not the PyTorch settings: ``PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb``
(stop rounding pinned blocks above a size) and ``pinned_use_cuda_host_register``
(pin with malloc + cudaHostRegister; blocks are still rounded) are process-wide,
read once before CUDA starts, and change every other pinned allocation of the
job; power-of-two chunks make the rounding cost nothing whatever they are set to. ``torch.cuda.host_memory_stats()`` is reported in
``stats()`` (``host_allocator_bytes``) to check the real pinned footprint, and
released pinned chunks are handed back to CUDA with
``torch.accelerator.empty_host_cache()`` (``torch._C._host_emptyCache()`` on a torch
without it, such as 2.11: ``offload/_torch_private.py``; otherwise the caching allocator
keeps them).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import _pinned
from ._arena import _PAGE, _Arena, _Chunk, _page_ceil, _pow2_ceil, _pow2_floor, plan_chunks, trim_choice
from ._pinned import PIN_ALLOCATORS
from .sizes import SizeLike, to_bytes

__all__ = ["HostPool", "HostBuffer", "PIN_ALLOCATORS"]

logger = logging.getLogger("offload.pool")

_REC_LIMIT = 1 << 20
"""Most take/give events recorded for one step (the record is dropped beyond it)."""
_ALIGN = 64
"""Every buffer starts on a 64-byte boundary (cache line; any dtype view is aligned)."""


@dataclass(eq=False, slots=True)
class HostBuffer:
    """One host buffer handed out by the pool (a view of one of its chunks)."""

    tensor: torch.Tensor
    """Flat uint8 tensor of exactly ``nbytes`` bytes."""
    nbytes: int
    """Size in bytes."""
    pinned: bool
    """Page-locked (async copies possible)."""
    registered: bool = False
    """Pinned by cudaHostRegister (its chunk is unregistered when released)."""
    pooled: bool = True
    """Counted in the pool (False for one-off pageable overflow buffers)."""
    chunk: _Chunk | None = field(default=None, repr=False)
    """The chunk it is carved from while taken; None once given back."""
    offset: int = field(default=0, repr=False)
    """Byte offset in the chunk."""
    span: int = field(default=0, repr=False)
    """Bytes it occupies in the chunk (``nbytes`` rounded up to the alignment)."""
    serial: int = field(default=-1, repr=False)
    """The pool's take number (to record the step's requests for re-layout and trim)."""
    cache: Any = field(default=None, repr=False)
    """The user's own object for this range (the engine's typed view of it, with its dtype and shape),
    handed back with the range when a replayed take gets the same range again; None after a carve."""


class HostPool:
    """Host buffers carved from power-of-two chunks, with a byte cap and usage statistics.

    See NOTE [ Host pool layout ] at the top of this module. Thread-safe.
    Tuning knobs are class attributes (the bench's trace replay varies them).

    Accounting: ``received_bytes`` counts the bytes of every successful
    :meth:`take`; ``overflow_bytes`` / ``overflow_count`` count the one-off
    buffers made by :meth:`overflow` (``on_host_budget="pageable"``), so an
    engine's copied bytes reconcile as ``d2h_bytes == received_bytes +
    overflow_bytes``.
    """

    min_chunk_bytes = 64 << 10
    """Smallest chunk: tiny workloads stay tiny, big ones grow by fractions of what they hold."""
    growth = 1 / 8
    """New chunk size as a fraction of the reserved bytes: few chunks, and headroom for
    longer sequences, so a varying-length loop stops allocating (the first step's excess
    is undone by its re-layout)."""
    relayout_above = 1.04
    """After the first step, re-plan the chunks if they exceed this multiple of its peak."""
    trim_slack = 1.25
    """Trim keeps up to this multiple of the largest recent step peak."""
    replay = True
    """Give a repeated step the previous pure step's ranges without arena work (same placement)."""
    grow_gate: Callable[[int], bool] | None = None
    """Asked before a new chunk of that many bytes (the RAM ceiling); held memory never asks."""

    def __init__(
        self,
        *,
        pin: bool,
        capacity_bytes: SizeLike | None = None,
        device_type: str | None = None,
        pin_allocator: str = "caching",
        trim_window: int = 32,
        refuse_unpinned: bool = False,
    ) -> None:
        if pin_allocator not in PIN_ALLOCATORS:
            raise ValueError(
                f"HostPool: pin_allocator={pin_allocator!r} is not one of {PIN_ALLOCATORS}."
            )
        if trim_window < 1:
            raise ValueError(f"HostPool: trim_window={trim_window!r} must be at least 1 step.")
        self.pin = pin
        """Try to page-lock new chunks (only meaningful with an accelerator)."""
        self.pin_allocator = pin_allocator
        """"caching" or "exact" (see ``PIN_ALLOCATORS``)."""
        self.capacity_bytes = to_bytes(capacity_bytes, "capacity_bytes", owner="HostPool", allow_none=True)
        """Cap on reserved (chunk) bytes; None means no cap."""
        self.trim_window = trim_window
        """Steps of peaks that :meth:`trim` remembers before releasing memory."""
        self.refuse_unpinned = refuse_unpinned
        """With ``pin``: a chunk that cannot be pinned is not made (the take is refused, so the
        engine moves it to its next host tier) instead of being made pageable."""
        self.last_pin_error = ""
        """The error of the latest failed pinned allocation ("" if none failed)."""
        self._device_type = device_type
        self._lock = threading.Lock()
        self._arena = _Arena()
        # Replay (NOTE [ Host pool layout ]). Ranges given back and not in the arena, as
        # (serial, nbytes, view, cache, chunk, offset, span); the previous pure step's takes in
        # order, as (nbytes, view, cache, chunk, offset, span), not yet re-taken from _replay_pos on.
        self._parked: list[tuple[int, int, torch.Tensor, Any, _Chunk, int, int]] = []
        self._replay: list[tuple[int, torch.Tensor, Any, _Chunk, int, int]] = []
        self._replay_pos = 0
        self._gave = False  # a buffer was given back in this step
        self._pure = True  # no take after a give in this step
        self._step_chunks = (0, 0)  # (allocations, released chunks) when this step began
        self._seq = 0
        self._steps = 0
        self._step_peaks: collections.deque[int] = collections.deque(maxlen=trim_window)
        # This step's requests (spans, and events: k >= 0 takes spans[k], k < 0 gives back
        # take -k - 1), for the first step's re-layout and to check that trim keeps enough.
        self._rec_spans: list[int] = []
        self._rec_events: list[int] = []
        self._rec_base = 0  # take number of spans[0]
        self._rec_clean = True  # the step began with nothing in use and no take was refused
        self._takes = 0
        self._relaid = False
        # Byte gauges and their peaks; _used_span: bytes of chunks handed out (aligned spans).
        self._reserved = self._in_use = self._peak_reserved = self._peak_in_use = 0
        self._used_span = self._window_peak_span = self._window_peak_in_use = 0
        # Counters (stats()).
        self._allocations = self._reuses = self._pin_failures = self._evictions = 0
        self._received_bytes = self._trimmed = self._released_chunks = self._relayouts = 0
        self._refused = self._never_fit = self._overflow_bytes = self._overflow_count = self._gate_refused = 0
        self._stepped = False  # a step that used the pool has ended

    # -- chunks -------------------------------------------------------------

    @property
    def _pow2(self) -> bool:
        """Chunks come from PyTorch's caching pinned allocator, which rounds blocks to powers of two."""
        return self.pin and self.pin_allocator == "caching"

    def _round(self, nbytes: int) -> int:
        """The chunk size that holds ``nbytes`` with nothing wasted underneath."""
        return _pow2_ceil(nbytes) if self._pow2 else _page_ceil(nbytes)

    def _round_down(self, nbytes: int) -> int:
        return _pow2_floor(nbytes) if self._pow2 else nbytes // _PAGE * _PAGE

    def _new_tensor(self, nbytes: int) -> tuple[torch.Tensor, bool, bool] | None:
        """(tensor, pinned, registered) for a new chunk of ``nbytes``; None if it cannot be pinned
        and ``refuse_unpinned``."""
        if self.pin:
            made = _pinned.pinned_chunk(nbytes, self.pin_allocator, self._device_type)
            if not isinstance(made, str):
                return made[0], True, made[1]
            self.last_pin_error = made
            self._pin_failures += 1
            if self.refuse_unpinned:
                return None
        return _pinned.host_empty(nbytes), False, False

    def _add_chunk(self, nbytes: int) -> _Chunk | None:
        made = self._new_tensor(nbytes)
        if made is None:
            return None
        tensor, pinned, registered = made
        self._seq += 1
        chunk = _Chunk(self._seq, tensor, nbytes, pinned, registered)
        if registered:
            _pinned.unregister_when_dropped(chunk, tensor)
        self._arena.add(chunk)
        self._allocations += 1
        self._reserved += nbytes
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        return chunk

    def _release_chunk(self, chunk: _Chunk) -> None:
        """Drop a wholly free chunk (a registered one unregisters itself when collected)."""
        self._arena.remove(chunk)
        self._reserved -= chunk.nbytes
        self._released_chunks += 1
        chunk.tensor = None

    def _free_chunks(self) -> list[_Chunk]:
        return [c for c in self._arena.chunks.values() if c.used == 0]

    def _growth_size(self, need: int) -> int:
        """Size of the chunk to add for a request of ``need`` aligned bytes."""
        if not self._pow2 and not self._stepped:
            return self._round(need)  # first step, nothing rounded underneath: exact fit until re-layout
        target = max(self.min_chunk_bytes, int(self._reserved * self.growth))
        return max(self._round_down(target), self._round(need))

    def _make_room(self, need: int) -> bool:
        """Add a chunk for ``need`` bytes under the cap; release free chunks only if that makes it fit."""
        size = self._growth_size(need)
        cap = self.capacity_bytes
        if cap is None:
            return self._grow(size)
        smallest = self._round(need)
        if smallest > cap:
            self._never_fit += 1  # could not fit even in an empty pool: fail fast, evict nothing
            return False
        if self._reserved + smallest > cap:
            free = sorted(self._free_chunks(), key=lambda c: (c.last_step, c.seq))
            if sum(c.nbytes for c in free) < self._reserved + smallest - cap:
                return False  # releasing every free chunk would still not make room
            for c in free:  # least recently used first, only as many as needed
                if self._reserved + smallest <= cap:
                    break
                self._release_chunk(c)
                self._evictions += 1
        room = cap - self._reserved
        return self._grow(max(smallest, min(size, self._round_down(room))))

    def _grow(self, nbytes: int) -> bool:
        """Add a chunk of ``nbytes`` unless ``grow_gate`` refuses new memory (counted)."""
        if self.grow_gate is not None and not self.grow_gate(nbytes):
            self._gate_refused += 1
            return False
        return self._add_chunk(nbytes) is not None

    # -- take / give --------------------------------------------------------

    def take(self, nbytes: int) -> HostBuffer | None:
        """A buffer of exactly ``nbytes`` (a view of a chunk), or None if the cap leaves no room."""
        with self._lock:
            pos = self._replay_pos
            replay = self._replay
            if pos < len(replay) and replay[pos][0] == nbytes and not self._gave:
                _n, view, cache, chunk, off, span = replay[pos]
                self._replay_pos = pos + 1
                self._reuses += 1
            else:
                if self._gave:
                    self._pure = False
                if self._parked or pos < len(replay):
                    self._unpark()  # the arena now holds what it would hold without replay
                span = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN or _ALIGN
                got = self._arena.carve(span)
                if got is not None:
                    self._reuses += 1
                elif self._make_room(span):
                    got = self._arena.carve(span)
                else:
                    self._refused += 1
                    self._rec_clean = False
                    return None
                chunk, off = got
                view = chunk.tensor[off:off + nbytes]
                cache = None
            chunk.last_step = self._steps
            used = self._used_span = self._used_span + span
            if used > self._window_peak_span:
                self._window_peak_span = used
            in_use = self._in_use = self._in_use + nbytes
            if in_use > self._window_peak_in_use:
                self._window_peak_in_use = in_use
                if in_use > self._peak_in_use:
                    self._peak_in_use = in_use
            self._received_bytes += nbytes
            serial = self._takes
            self._takes += 1
            if self._rec_clean:
                if len(self._rec_events) >= _REC_LIMIT:  # no trim for ages (forward-only use): stop
                    self._rec_clean = False
                    self._rec_spans, self._rec_events = [], []
                else:
                    self._rec_events.append(len(self._rec_spans))
                    self._rec_spans.append(span)
            return HostBuffer(view, nbytes, chunk.pinned, chunk.registered, True, chunk, off, span, serial, cache)

    def _unpark(self) -> None:
        """Return every parked range and every range left to replay to the arena (lock held)."""
        free = self._arena.free
        for _serial, _nbytes, _view, _cache, chunk, off, span in self._parked:
            free(chunk, off, span)
        self._parked = []
        self._drop_replay()

    def _drop_replay(self) -> None:
        """Return the ranges not re-taken from the replay list to the arena; end the replay (lock held)."""
        free = self._arena.free
        for _nbytes, _view, _cache, chunk, off, span in self._replay[self._replay_pos:]:
            free(chunk, off, span)
        self._replay = []
        self._replay_pos = 0

    def _end_step_replay(self) -> None:
        """Make the step that just ended the next step's replay list if it was pure (lock held)."""
        parked = self._parked
        base = self._rec_base
        # Replaying is exact only from the state this step started in: nothing in use, no
        # refusal (_rec_clean), and the same chunks at its start and end.
        if (self._pure and self._in_use == 0 and parked and self._rec_clean
                and self._step_chunks == (self._allocations, self._released_chunks)
                and all(p[0] >= base for p in parked) and len(parked) == self._takes - base):
            self._drop_replay()  # what this step did not re-take goes back to the arena
            parked.sort(key=lambda p: p[0])
            self._replay = [p[1:] for p in parked]
            self._parked = []
        else:
            self._unpark()
        self._gave = False
        self._pure = True

    def overflow(self, nbytes: int) -> HostBuffer:
        """A one-off pageable buffer outside the pool (``on_host_budget="pageable"``).

        Not reserved and never reused, but counted: ``overflow_bytes`` and
        ``overflow_count`` in :meth:`stats` (so ``d2h_bytes == received_bytes +
        overflow_bytes`` for the engine's copies).
        """
        with self._lock:
            self._overflow_bytes += nbytes
            self._overflow_count += 1
        return HostBuffer(_pinned.host_empty(nbytes), nbytes, pinned=False, pooled=False)

    def give(self, buf: HostBuffer) -> None:
        """Return a buffer taken with :meth:`take`; its bytes serve any later take."""
        if not buf.pooled:
            return
        with self._lock:
            chunk = buf.chunk
            if chunk is None:
                raise RuntimeError("HostPool.give: this buffer was already given back (or not taken "
                                   "from a pool); giving it twice would hand its bytes out twice.")
            buf.chunk = None
            self._in_use -= buf.nbytes
            self._used_span -= buf.span
            if self.replay:
                self._parked.append((buf.serial, buf.nbytes, buf.tensor, buf.cache, chunk, buf.offset, buf.span))
            else:
                self._arena.free(chunk, buf.offset, buf.span)
            self._gave = True
            if self._rec_clean and buf.serial >= self._rec_base:
                self._rec_events.append(self._rec_base - buf.serial - 1)

    # -- end of step: re-layout and trim --------------------------------------

    def _relayout(self) -> None:
        """At the end of the first step, swap its chunks for the smallest set its requests
        provably pack into: for power-of-two chunks when they exceed ``relayout_above`` x its
        peak (growth had to guess), for page-granular ones always (one chunk instead of one
        per request). Later steps with the same requests pack the same way, so a static loop
        never allocates again."""
        spans, events = self._rec_spans, self._rec_events
        if self._pow2:
            if self._reserved <= self.relayout_above * self._window_peak_span:
                return
            limit = self._reserved - 1
        else:
            # The first step got exact-fit chunks, shaped by its own lengths: merge them into one
            # (a longer step then packs into it and its growth), even at a little more memory.
            if len(self._arena.chunks) == 1:
                return
            limit = self._reserved + self._reserved // 32
        sizes = plan_chunks(spans, events, limit, pow2=self._pow2, min_chunk_bytes=self.min_chunk_bytes,
                            capacity_bytes=self.capacity_bytes)
        if sizes is None:
            return
        released = self._free_chunks()
        for chunk in released:
            self._release_chunk(chunk)
        # Sizes the old chunks had come back from the caching allocator's cache
        # (no new pinning); the rest of the old blocks are handed back to CUDA
        # before the other new chunks are pinned, so the footprint never holds both.
        old = collections.Counter(c.nbytes for c in released)
        again = []
        for size in sizes:
            if old[size] > 0:
                old[size] -= 1
                again.append(size)
        for size in again:
            self._add_chunk(size)
        self._released_pinned(released)
        for size in (collections.Counter(sizes) - collections.Counter(again)).elements():
            self._add_chunk(size)
        self._relayouts += 1
        logger.debug("HostPool: first step re-laid out as %d chunks (%d B) for a peak of %d B",
                     len(sizes), self._reserved, self._window_peak_in_use)

    def _released_pinned(self, chunks: list[_Chunk]) -> None:
        """Hand released caching-allocator blocks back to CUDA (else PyTorch keeps them cached)."""
        if any(c.pinned and not c.registered for c in chunks):
            _pinned.return_pinned_cache(self._device_type)

    def _trim_to(self, keep: int, clean: bool) -> list[_Chunk]:
        """Release free chunks down to about ``keep`` bytes (see :meth:`trim`)."""
        step = (self._rec_spans, self._rec_events) if clean else None
        gone = trim_choice(list(self._arena.chunks.values()), self._reserved, keep, step)
        for chunk in gone:
            self._release_chunk(chunk)
        return gone

    def trim(self) -> int:
        """End of a step: release whole free chunks the recent steps did not need.

        Keeps up to ``trim_slack`` (1.25) times the largest step peak (chunk bytes
        used) of the last ``trim_window`` steps (a step = the time between two
        trims), and acts only once a full window has passed since the start or
        the last release, so it never churns. A static loop never loses a
        chunk; a varying one keeps what its longest recent step used; a loop
        whose shapes shrank for good gives the excess back after
        ``trim_window`` steps (newest chunks first; when the reserved bytes are
        still over twice the need, the largest free chunks go too and the next
        step regrows what it needs, once). The first step that used the pool
        may also re-lay its chunks out (``_relayout``).
        Returns the bytes released.
        """
        with self._lock:
            self._end_step_replay()
            clean = self._rec_clean and self._in_use == 0 and bool(self._rec_spans)
            if not self._relaid and self._window_peak_in_use:
                self._relaid = True
                if clean:
                    self._unpark()
                    self._relayout()
            self._steps += 1
            self._stepped = self._stepped or self._window_peak_in_use > 0
            self._step_peaks.append(self._window_peak_span)
            self._window_peak_in_use = self._in_use
            self._window_peak_span = self._used_span
            trimmed = []
            if len(self._step_peaks) == self.trim_window:  # a full window since the start or the last release
                keep = max(int(self.trim_slack * max(self._step_peaks)), self._used_span, self.min_chunk_bytes)
                if self._reserved > keep:  # else _trim_to releases nothing: the replay stays
                    self._unpark()
                    trimmed = self._trim_to(keep, clean)
                if trimmed:
                    self._step_peaks.clear()  # judge the new layout over a full window again
            self._rec_spans, self._rec_events = [], []
            self._rec_base = self._takes
            self._rec_clean = self._in_use == 0
            self._step_chunks = (self._allocations, self._released_chunks)
            freed = sum(c.nbytes for c in trimmed)
            self._trimmed += freed
        if trimmed:
            logger.debug("HostPool.trim released %d chunks (%d B); reserved %d B", len(trimmed), freed,
                         self._reserved)
        self._released_pinned(trimmed)
        return freed

    def clear(self) -> None:
        """Release every wholly free chunk (buffers in use stay valid)."""
        with self._lock:
            self._unpark()
            released = self._free_chunks()
            for chunk in released:
                self._release_chunk(chunk)
        self._released_pinned(released)

    # -- accounting ---------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        """Bytes of all chunks (for "caching" chunks, the real pinned bytes underneath)."""
        return self._reserved

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the buffers taken and not given back (requested sizes)."""
        return self._in_use

    def storage_bytes(self) -> int:
        """Bytes of the host memory the pool holds now, read from its allocations themselves.

        The sum of the distinct storages behind every live chunk (free or in use),
        not the pool's own counters: what a footprint measurement should use.
        """
        with self._lock:
            seen: dict[int, int] = {}
            for c in self._arena.chunks.values():
                if c.tensor is not None:
                    st = c.tensor.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
            return sum(seen.values())

    def stats(self) -> dict[str, int | None]:
        """Snapshot of the pool's counters (bytes and counts).

        ``allocations`` counts chunks made, ``reuses`` takes served from existing
        chunks, ``evictions`` free chunks released to make room under the cap,
        ``relayouts`` first-step re-layouts, ``refused`` takes that returned None
        (``never_fit``: of those, requests bigger than the cap itself),
        ``overflow_*`` the one-off buffers of :meth:`overflow`.
        ``host_allocator_bytes`` is PyTorch's pinned allocator's
        ``allocated_bytes.current`` (process-wide) when this pool pins on CUDA, else None.
        """
        with self._lock:
            st = {
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
                "chunks": len(self._arena.chunks),
                "released_chunks": self._released_chunks,
                "relayouts": self._relayouts,
                "refused": self._refused,
                "never_fit": self._never_fit,
                "ram_ceiling_refused": self._gate_refused,
                "overflow_bytes": self._overflow_bytes,
                "overflow_count": self._overflow_count,
            }
        st["host_allocator_bytes"] = self._host_allocator_bytes()
        return st

    def _host_allocator_bytes(self) -> int | None:
        if not (self.pin and self._device_type == "cuda" and self.pin_allocator == "caching"):
            return None
        return _pinned.host_allocator_bytes()
