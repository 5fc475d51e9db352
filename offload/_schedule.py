"""The copy schedule: when a device-to-host copy frees its source, and when reloads start.

NOTE [ Copy schedule ]
The engine's copies are windowed by device memory, not by counts. One ``_Schedule`` per engine
owns the state (the in-flight copies and their sources, the memory budget, the reload window);
the pack and unpack hooks call it, and the predictor (``offload.predict``) and the emulator
(``offload.testing``) drive the same object through the same engine.

1. Forward. An offloaded tensor's source stays alive, in the in-flight list, until its copy is
   known to be done (Rule 2 of NOTE [ Offload lifetime rules ]) or compute waits on it. The list
   is polled (event queries in issue order, stopping at the first copy still running: one copy
   stream finishes in order) at every pack, kept or offloaded, and at every entry to and exit
   from the engine; a finished copy's source is dropped then, without any stream wait.
2. Device memory is counted by the caching allocator in the host's order, and the host runs ahead
   of the device: a source dropped only once the host sees its copy done is often dropped after
   the forward's last allocation, so the step's peak would not fall. A source whose copy may still
   run is therefore released with a stream wait (the producer stream waits on the copy's event:
   the allocator can then hand its block to the next allocation on that stream at once), and
   compute waits on a copy only where a bound requires it, on the oldest copies, as late as it
   can. The bound, in order:
   - ``device_budget_bytes`` when set: the allocator's count plus the copy just issued stays within
     it (statistics read only when an estimate from the bytes saved since the last reading could
     cross it);
   - else, from the second step on, "every offloaded byte but a tail is off the device by the
     forward's end, and the device never holds more before": the bytes in flight may exceed the tail
     only by what the forward still saves and keeps (the allocations their freed blocks can serve:
     the smallest of the last four steps' forwards, in the ledger's distinct saved bytes less its
     offloaded bytes, less the largest save). The tail is up to eight of the largest copies within
     1/8 of the bytes the forward offloads, at least two: copies overlap compute, and the last ones
     need not all be done by the forward's end; where the forward is shorter than its copies at the
     link's rate, they run on behind the loss and the first blocks' backward, and the peak still falls
     by >= 7/8 of the bytes moved. (Eight copies, not the whole 1/8: where everything is offloaded
     the link is behind all forward long and the whole 1/8 would stay in flight, a larger peak for a
     few percent of step time.) Blocks offloaded early (a plan's first blocks) then copy behind the
     later blocks' compute and are released, with waits as late as that allows, before the
     forward's last allocations; a step that offloads everything releases each source as soon
     as the next copy is queued (its forward runs at the link's pace, as it must);
   - else (the first step, with no history): the engine's earlier bounds, 5 copies and 1 GiB.
   Caps set by the user (``max_fwd_stash_size``, ``max_inflight_bytes``) apply too. Every wait
   that meets a copy still running is timed (events around it: the ledger's ``stall_seconds``)
   and counted (``d2h_waits``). ``device_budget_bytes`` larger than the device never waits: the
   cut is then what finished moving.
3. Backward. Every unpack, of a kept tensor or an offloaded one, may issue reloads: the newest
   packed offloaded handles not yet on the device (backward order), as far ahead as the device's
   headroom allows. The headroom is ``ceiling - allocated - reserve``: the ceiling is what the
   device held when the step last left the engine (the end of its forward: never an earlier step's
   peak, so offloading's cut stays; reloads fill only memory backward has freed below it), or the
   budget when lower; the reserve (1/32 of the ceiling, at least twice the largest copy and at least
   the largest save, whose gradient is backward's largest temporary: the logits' at the loss, made
   above the forward's end) leaves room for the backward's own temporaries. Allocator statistics are read only when the last
   reading's allowance is spent and at most once every ``_READ_EVERY`` unpacks (a read costs
   tens of microseconds on CUDA). So an offloaded region's reloads overlap the backward of the
   blocks after it (TransformerEngine starts reloading layer i at the backward of layer
   L-1-N+i: "as soon as memory allows"). Twice the largest copy may always be loaded ahead (the
   window the engine always took: without allocator statistics, on CPU backends and the plain
   emulator, it is the whole window). ``prefetch_bytes``, when set, caps the bytes loaded ahead;
   0 turns loading ahead off.
4. A reload waits on its copy's event only where compute reads it (Rule 4); an unused reload is
   released at the end of its pass after the allocation stream waited on it.
5. A source still alive when backward unpacks its tensor is used as it is (no reload), and dropped
   then: with ``record_stream`` on the copy stream if its copy may still run (the allocator reuses
   its block only after the copy; nothing waits), so the engine holds a tensor in backward no longer
   than autograd does.
6. An original something else keeps alive (another block's kept save, a model-level tensor such as
   the rotary tables or a mask, a hidden state the caller holds) is neither reloaded nor loaded
   ahead: its unpack is a view of it (``live_original``: the first saver's base, still on its
   storage, its version unchanged since the copy). Offloading it freed nothing; reloading it would
   put its bytes on the device twice (a measured plan overshot its budget by the rotary tables).
"""

from __future__ import annotations

import weakref
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING, Any, Callable

from ._copies import _span
from ._disk_record import ready as _disk_ready
from ._handles import _StashEntry, live_original
from .streams import Copy

if TYPE_CHECKING:
    import threading

    from ._backward import _Pass
    from ._handles import _HostCopy, _Offloaded
    from .ledger import Ledger

__all__ = ["_Schedule"]

_FIRST_FORWARD_CAPS = (5, 1 << 30)
"""NOTE item 2: the bounds of a step with no history (copies, bytes in flight)."""
_HISTORY = 4
"""Steps whose forwards' bytes the end-of-forward bound remembers (NOTE item 2)."""
_WINDOW, _TAIL = 8, 8
"""NOTE item 2: the copies that may stay in flight when the forward ends: up to eight of the largest size seen
within 1/8 of the bytes a forward offloads (so the peak still falls by >= 7/8 of them), at least two."""
_READ_EVERY = 16
"""Unpacks between two reads of the allocator's statistics while reloads wait for room (NOTE item 3)."""
_RESERVE_FRACTION = 32
"""The reserve of NOTE item 3: 1/32 of the ceiling (at least twice the largest copy)."""


class _Schedule:
    """The engine's copy schedule (NOTE [ Copy schedule ]): in-flight copies, their sources, the
    memory budget and the reload window."""

    def __init__(self, backend: Any, ledger: "Ledger", lock: "threading.RLock", tiers: Any, *,
                 max_count: int | None, max_bytes: int | None, budget: int | None,
                 prefetch_bytes: int | None) -> None:
        self.backend = backend
        self.ledger = ledger
        self.lock = lock
        self.inflight: deque[_StashEntry] = deque()
        """In-flight device-to-host copies whose source is still alive, in issue order (NOTE item 1)."""
        self.inflight_bytes = 0
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.budget = budget
        self.prefetch_cap = prefetch_bytes
        self.max_copy = 0
        """Bytes of the largest copy made so far (the reserve and the window without statistics)."""
        self.history: deque[int] = deque(maxlen=_HISTORY)
        """Bytes the last steps' forwards saved and kept (distinct saved less offloaded: NOTE item 2)."""
        self.moved: deque[int] = deque(maxlen=_HISTORY)
        """Bytes the last steps' forwards offloaded (NOTE item 2: the window's share)."""
        self.max_save = 0
        """Bytes of the largest distinct save seen."""
        self._stats = getattr(backend, "memory_stats", None)  # (None: no allocator statistics)
        self._tiers = tiers  # its disk tier reads ahead a record a reload waits for (NOTE item 3)
        self._log: list[int] | None = None  # the ledger's distinct-bytes log read so far, and where
        self._off: list[int] | None = None  # its offloaded-bytes log
        self._cur = self._saved = self._ocur = self._moved = 0
        self._step_seen = False  # the open step's forward bytes are in ``history``
        self._est: tuple[int, int] | None = None  # (allocated at the last reading, saved bytes then)
        self.fwd_end = 0
        """Allocated bytes at the step's last exit from the engine (NOTE item 3: the reloads' ceiling)."""

    # -- forward: sources of copies in flight (NOTE items 1 and 2) -------------------------------

    def progress(self) -> tuple[int, int]:
        """(distinct bytes saved, bytes offloaded) through the engine in the open step so far: the ledger's
        logs, read incrementally (they start again when a step closes)."""
        ledger = self.ledger
        log, off = ledger.unique_log, ledger.offloaded_log
        n, m = len(log), len(off)
        if log is not self._log or off is not self._off or n < self._cur or m < self._ocur:
            self._log, self._off = log, off  # a new ledger, or its logs were consumed (a step closed)
            self._cur = self._ocur = self._saved = self._moved = 0
        if n > self._cur:
            total, big = self._saved, self.max_save
            for v in islice(log, self._cur, n):
                total += v
                if v > big:
                    big = v
            self._saved, self.max_save, self._cur = total, big, n
        if m > self._ocur:
            self._moved += sum(islice(off, self._ocur, m))
            self._ocur = m
        return self._saved, self._moved

    def exited(self) -> None:
        """An outermost exit from the engine (a forward, or a block of one, ended): the in-flight copies as at
        a kept pack; what the device holds now is the reloads' ceiling, should backward start next."""
        if self.inflight:
            self.kept()
        if self._stats is not None and self.max_copy:
            stats = self._stats()
            if stats is not None:
                self.fwd_end = stats[0]

    def end_step(self) -> None:
        """The step closed (its logs were consumed: ``progress`` reads them from the start again)."""
        self._log = None
        self._step_seen = False
        self._est = None
        self.fwd_end = 0

    def push(self, entry: _StashEntry) -> None:
        """A device-to-host copy was issued: hold its source until the copy is done or a bound needs it."""
        with self.lock:
            self.inflight.append(entry)
            self.inflight_bytes += entry.nbytes
            if entry.nbytes > self.max_copy:
                self.max_copy = entry.nbytes
            self.ledger.note_inflight(self.inflight_bytes)
            self.poll()
            if self.inflight:
                self._bound(entry.nbytes)

    def kept(self) -> None:
        """A kept pack while copies are in flight: drop what finished, then keep the bound (NOTE item 2)."""
        with self.lock:
            self.poll()
            if self.inflight:
                self._bound(0)

    def _bound(self, upcoming: int) -> None:
        """Release the oldest sources (compute waits on their copies) while a bound of NOTE item 2 needs
        it; ``upcoming``: bytes of the copy just issued (an estimate of the next allocation)."""
        inflight = self.inflight
        cap_n, cap_b = self.max_count, self.max_bytes
        if self.budget is None and not self.history:
            cap_n = _FIRST_FORWARD_CAPS[0] if cap_n is None else min(cap_n, _FIRST_FORWARD_CAPS[0])
            cap_b = _FIRST_FORWARD_CAPS[1] if cap_b is None else min(cap_b, _FIRST_FORWARD_CAPS[1])
        while inflight and ((cap_n is not None and len(inflight) > cap_n)
                            or (cap_b is not None and self.inflight_bytes > cap_b)):
            self._release(inflight[0], wait=True)
        if not inflight:
            return
        if self.budget is not None:
            self._within_budget(upcoming)
        elif self.history:
            saved, moved = self.progress()
            # What the forward still saves and keeps (the allocations freed sources can serve), less
            # the largest save, plus the tail that may still be in flight when the forward ends.
            window = max(2 * self.max_copy, min(_WINDOW * self.max_copy, min(self.moved) // _TAIL))
            left = max(min(self.history) - (saved - moved) - self.max_save, 0) + window
            while inflight and self.inflight_bytes > left:
                self._release(inflight[0], wait=True)

    def _within_budget(self, upcoming: int) -> None:
        """``device_budget_bytes``: the allocator's count (read only when an estimate could cross it)."""
        if self._stats is None:
            return
        saved = self.progress()[0]
        est = self._est
        if est is not None and est[0] + (saved - est[1]) + upcoming <= self.budget:
            return
        stats = self._stats()
        if stats is None:
            return
        allocated = stats[0]
        while self.inflight and allocated + upcoming > self.budget:
            allocated -= self._release(self.inflight[0], wait=True)
        self._est = (allocated, saved)

    def poll(self) -> None:
        """Drop the sources of the copies that are done (oldest first; no wait)."""
        with self.lock:
            inflight = self.inflight
            while inflight and (inflight[0].src is None or inflight[0].copy.query()):
                self._release(inflight[0], wait=False)

    def drain(self) -> None:
        """Release every source, ordering its producer stream after its copy (end of a step, a failed
        forward)."""
        with self.lock:
            while self.inflight:
                self._release(self.inflight[0], wait=True, bound=False)

    def consumed(self, e: _StashEntry) -> None:
        """Backward used ``e``'s source as it is (NOTE item 5): drop it now. If its copy may still run, the
        allocator is told the copy stream uses it (``record_stream``: its block is reused only after the
        copy), so nothing waits and the engine holds it no longer than autograd does."""
        with self.lock:
            if e.src is not None:
                if not e.copy.query():
                    self.backend.keep_for_copy(e.src, e.copy, "consumed_source_record_stream")
                self._drop(e, wait=False, bound=False)

    def _release(self, e: _StashEntry, *, wait: bool, bound: bool = True) -> int:
        """Drop the oldest entry's source; ``wait``: its copy may still run, so the producer stream waits on
        it first (Rule 2), timed, unless a poll now finds it done. Returns the entry's bytes."""
        self.inflight.popleft()
        return self._drop(e, wait=wait, bound=bound)

    def _drop(self, e: _StashEntry, *, wait: bool, bound: bool) -> int:
        """Drop ``e``'s source (Rule 2: after a wait on its copy where ``wait`` and a poll does not find it
        done); an entry released out of order stays in the list, sourceless, until it reaches the front."""
        if e.src is None:
            return 0
        if wait and not e.copy.query():  # (done: the host knows, no wait needed)
            self._timed_wait(e.copy, bound)
        self.inflight_bytes -= e.nbytes
        e.src = None
        return e.nbytes

    def _timed_wait(self, copy: Copy, bound: bool) -> None:
        """The producer stream waits on a D2H still running: timed like a reload's stall (events around the
        wait) when the engine times copies, and counted when a bound required it (``bound``; not at a drain)."""
        backend = self.backend
        stream = copy.stream
        timing = getattr(backend, "timing", False) and stream is not None
        if timing:
            start = backend._event()
            start.record(stream)
        backend.release_after(copy, stream, "stash_release_waits_copy")
        if timing:
            end = backend._event()
            end.record(stream)
            self.ledger.add_copy_time(None, "stall", Copy(end, None, start, stream))
        if bound:
            self.ledger.note_d2h_wait()

    # -- backward: reloads ahead of need (NOTE item 3) ------------------------------------------

    def begin_pass(self, p: "_Pass", order: list[weakref.ref] | None) -> None:
        """A backward pass's first unpack: the step's forward is over (its saved bytes go to ``history``);
        where the pass's reloads start and how much room they may take."""
        first = not self._step_seen
        if first:
            self._step_seen = True
            saved, moved = self.progress()
            if saved > 0:
                self.history.append(max(saved - moved, 0))
                self.moved.append(moved)
        p.order = order
        p.frontier = len(order) if order is not None else 0
        cap = self.prefetch_cap
        if cap == 0 or (cap is None and getattr(self.backend, "name", "sync") == "sync"):
            p.frontier = 0  # nothing loads ahead (by default synchronous copies overlap nothing)
            return
        stats = self._stats() if self._stats is not None else None
        if stats is None:
            p.ceiling = None
            return
        allocated = stats[0]
        ceiling = self.fwd_end or allocated  # this step's forward, never an older peak: the cut stays
        if self.budget is not None:
            ceiling = min(ceiling, self.budget)
        p.ceiling = ceiling
        # (the largest save: its gradient is backward's largest temporary, e.g. the logits' at the loss,
        # allocated above the forward's end while reloads would already fill the room below it)
        p.reserve = max(2 * self.max_copy, ceiling // _RESERVE_FRACTION, self.max_save)
        p.allowance = ceiling - p.reserve - allocated
        p.next_read = p.unpacks + _READ_EVERY

    def reached(self, p: "_Pass", h: "_Offloaded") -> None:
        """Backward reached ``h`` (unpacked it): nothing packed after it is loaded ahead any more."""
        if h.order is p.order and h.index < p.frontier:
            p.frontier = h.index

    def ahead(self, p: "_Pass", load: Callable[["_HostCopy", Any], tuple[Any, Copy]]) -> None:
        """Issue reloads from ``p``'s frontier down (newest packed first) while there is room (``load``
        starts one copy)."""
        order = p.order
        if order is None or p.frontier <= 0:
            return
        with _span("offload::prefetch"), self.lock:
            i = min(p.frontier, len(order)) - 1
            while i >= 0:
                x = order[i]()
                if x is not None:
                    hc = x.hc
                    if not (hc.prefetched is not None or hc.held is not None or hc.used >= hc.users
                            or (x.stash is not None and x.stash.src is not None)
                            or live_original(x) is not None):
                        if hc.tier == "disk" and not _disk_ready(hc.buf):
                            self._tiers.disk.prefetch(hc.buf)  # read it on the reader thread, if room
                            break  # (being written or read: retried at the next unpack, never waited on)
                        if not self._room(p, hc.nbytes):
                            break
                        dev, copy = load(hc, x.rec)
                        hc.prefetched = (dev, copy, p.gid)
                        p.prefetched_bytes += hc.nbytes
                        p.prefetched.append(weakref.ref(hc))
                i -= 1
            p.frontier = i + 1

    def _room(self, p: "_Pass", nbytes: int) -> bool:
        """Whether a reload of ``nbytes`` may be issued now (and, if so, count it)."""
        cap = self.prefetch_cap
        if cap is not None:
            if p.prefetched_bytes + nbytes > cap:
                return False
            if p.ceiling is None:
                return True
        if p.prefetched_bytes + nbytes <= 2 * self.max_copy:
            return True  # the window every backward may take (what the engine always loaded ahead)
        if p.ceiling is None:  # no allocator statistics: the window alone (NOTE item 3)
            return False
        if p.allowance < nbytes:
            if p.unpacks < p.next_read:
                return False
            p.next_read = p.unpacks + _READ_EVERY
            stats = self._stats()
            if stats is None:
                return False
            p.allowance = p.ceiling - p.reserve - stats[0]
            if p.allowance < nbytes:
                return False
        p.allowance -= nbytes
        return True
