"""The discrete-event simulation of a ``Trace`` (the lower layer of ``_timeline``), and the ``Clock`` that runs
it alongside a capture.

NOTE [ Simulated timeline ]
1. The host issues the items in program order; issuing item ``i`` takes ``host_cost(i)``
   (launch, event call, hook). A device item enters its stream's queue when its issue ends.
2. Each stream runs its queue in order; an item starts when it is issued, the item before it on
   its stream has ended, and (``WaitEvent``) the latest ``RecordEvent`` of that event issued
   before the wait has run. A wait on an event never recorded is a no-op, as in CUDA.
3. Resources: kernels run one at a time on the compute units (a training kernel fills the GPU);
   copies run on one copy engine per direction, so same-direction copies serialise (in the
   order they became ready) and the two directions overlap (torchrec PR #4315).
4. The host blocks on a ``HostSync`` until its target's work issued before it is done, and on a
   pageable ``Copy`` until the copy is done.
5. Time is integer nanoseconds (each duration rounded once), so equal schedules give equal
   times on every machine, with no float-equality trouble.
6. Device memory: an ``Alloc`` counts from its issue; a ``Free`` is effective at its issue when
   only the allocating stream used the block (the caching allocator reuses it in that stream's
   order), else once every stream recorded on it (``RecordStream``) has run the work queued on
   it before the free: the allocator cannot hand the block out before.
7. The clock of a capture (``Clock``): the same simulation, run as the items are recorded, so
   the engine's event polls during a capture see the modelled device. A poll at the host's
   current time (after every item issued so far) reports an event done when its record has
   run by then. It is exact: no item issued later can start before the host's current time,
   so what has run by then is what the full replay of the finished trace runs by then.
The stalls (each gap on a stream that runs kernels, with its cause) are labelled in ``_stalls.py`` and
the results assembled in ``_timeline.py``, which call down here. Everything is a prediction for the
spec it was given.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

from ._cost import DeviceCost, HostCost, device_seconds
from ._trace import COMPUTE_STREAM, Alloc, Copy, Free, HostSync, Kernel, RecordEvent, RecordStream, WaitEvent
from .gpus import GPUSpec, resolve_gpu

__all__ = ["Clock"]

_DEVICE = (Kernel, Copy, RecordEvent, WaitEvent)


def _ns(seconds: float) -> int:
    if not seconds >= 0 or seconds == math.inf:
        raise ValueError(f"offload.predict: a duration must be finite and >= 0 seconds, got {seconds!r}")
    return round(seconds * 1e9)


class _Sim:
    """The event-driven simulation (NOTE [ Simulated timeline ]); times in integer ns."""

    def __init__(self, items: list, host_ns: list[int], dur_ns: list[int]) -> None:
        n = len(items)
        self.items, self.host_ns, self.dur = list(items), list(host_ns), list(dur_ns)
        self.issue, self.start, self.end, self.ready = [-1] * n, [-1] * n, [-1] * n, [-1] * n
        self.dep = [-1] * n  # WaitEvent / HostSync('event'): the RecordEvent it waits for
        self.queues: dict[int, deque[int]] = {}
        self.on_stream: dict[int, list[int]] = {}  # stream -> its items in issue order
        self.stream_end: dict[int, int] = {}
        self.res_free = {"compute": 0, "d2h": 0, "h2d": 0}
        self.host_t = self.h = self.host_busy = 0
        self.blocked: tuple[int, list[int]] | None = None  # (item, items whose end releases the host)
        self.host_blocks: list[tuple[int, int, int]] = []  # (from, to, item)
        self.last_record: dict[int, int] = {}
        self.block_streams: dict[int, tuple[int, set[int]]] = {}  # block -> (alloc stream, recorded)
        self.free_after: dict[int, list[int]] = {}  # Free item -> items whose end makes it effective

    def add(self, item: Any, host_ns: int, dur_ns: int) -> None:
        """Append one item issued after all the others (a ``Clock``'s capture: NOTE rule 7)."""
        self.items.append(item)
        self.host_ns.append(host_ns)
        self.dur.append(dur_ns)
        for a in (self.issue, self.start, self.end, self.ready, self.dep):
            a.append(-1)

    # -- the host -----------------------------------------------------------------------------

    def walk(self) -> None:
        """Issue items in program order until the host blocks or the trace ends."""
        items, n = self.items, len(self.items)
        while self.h < n and self.blocked is None:
            i = self.h
            it = items[i]
            self.h += 1
            self.host_t += self.host_ns[i]
            self.host_busy += self.host_ns[i]
            self.issue[i] = self.host_t
            if isinstance(it, _DEVICE):
                self._enqueue(i, it)
                if type(it) is Copy and not it.pinned:
                    self.blocked = (i, [i])  # a pageable copy is synchronous for the host
            elif type(it) is HostSync:
                self.blocked = (i, self._sync_targets(it))
            else:
                self._host_item(i, it)
            if self.blocked is not None and not self.blocked[1]:
                self.blocked = None  # nothing to wait for

    def _enqueue(self, i: int, it: Any) -> None:
        s = it.stream
        if type(it) is RecordEvent:
            self.last_record[it.event] = i
        elif type(it) is WaitEvent:
            self.dep[i] = self.last_record.get(it.event, -1)
        q = self.queues.get(s)
        if q is None:
            q = self.queues[s] = deque()
            self.on_stream[s] = []
            self.stream_end[s] = 0
        q.append(i)
        self.on_stream[s].append(i)

    def _last_on(self, s: int) -> list[int]:
        items = self.on_stream.get(s)
        return [items[-1]] if items else []

    def _sync_targets(self, it: HostSync) -> list[int]:
        if it.kind == "event":
            j = self.last_record.get(it.target, -1)
            return [j] if j >= 0 else []
        if it.kind == "stream":
            return self._last_on(it.target)
        if it.kind == "item":
            return self._last_on(COMPUTE_STREAM if it.target is None else it.target)
        if it.kind == "device":
            return [j for s in self.on_stream for j in self._last_on(s)]
        raise ValueError(f"offload.predict: HostSync.kind={it.kind!r} is not 'event', 'stream', 'item' or 'device'")

    def _host_item(self, i: int, it: Any) -> None:
        t = type(it)
        if t is Alloc:
            self.block_streams[it.block] = (it.stream, set())
        elif t is RecordStream:
            if it.block in self.block_streams:
                self.block_streams[it.block][1].add(it.stream)
        elif t is Free:
            alloc = self.block_streams.get(it.block)
            if alloc is not None:
                self.free_after[i] = [j for s in alloc[1] - {alloc[0]} for j in self._last_on(s)]

    def _release(self) -> int | None:
        """When the blocked host may go on (None: not known yet)."""
        _, targets = self.blocked
        end = self.end
        if any(end[j] < 0 for j in targets):
            return None
        return max(self.host_t, max(end[j] for j in targets))

    # -- the device ---------------------------------------------------------------------------

    def _candidate(self) -> tuple[int, int, int, int, str | None] | None:
        """(start, ready, item, stream, resource) of the stream head that can start first."""
        best = None
        items, end = self.items, self.end
        for s, q in self.queues.items():
            if not q:
                continue
            i = q[0]
            ready = max(self.issue[i], self.stream_end[s])
            it = items[i]
            t = type(it)
            res = None
            if t is WaitEvent and self.dep[i] >= 0:
                d = end[self.dep[i]]
                if d < 0:
                    continue  # its event has not run yet
                ready = max(ready, d)
            elif t is Kernel:
                res = "compute"
            elif t is Copy:
                res = it.direction
                if res not in self.res_free:
                    raise ValueError(f"offload.predict: Copy.direction={res!r} is not 'd2h' or 'h2d'")
            start = max(ready, self.res_free[res]) if res else ready
            key = (start, ready, i, s, res)
            if best is None or key < best:
                best = key
        return best

    def run(self, *, now: bool = False) -> None:
        """Simulate every item; ``now``: only until the host's current time, with more items to come
        (what has run by then is final: NOTE rule 7)."""
        self.walk()
        while True:
            cand = self._candidate()
            if self.blocked is not None:
                rel = self._release()
                if rel is not None and (cand is None or cand[0] > rel):
                    self.host_blocks.append((self.host_t, rel, self.blocked[0]))
                    self.host_t, self.blocked = rel, None
                    self.walk()
                    continue
            if cand is None:
                if self.blocked is not None or self.h < len(self.items):
                    raise RuntimeError("offload.predict: the timeline is stuck (this is a bug, please report): "
                                       f"host at item {self.h}, blocked on {self.blocked}")
                return
            if now and self.blocked is None and cand[0] > self.host_t:
                return  # an item issued later may run before it
            start, ready, i, s, res = cand
            self.queues[s].popleft()
            self.start[i], self.ready[i] = start, ready
            self.end[i] = e = start + self.dur[i]
            self.stream_end[s] = e
            if res:
                self.res_free[res] = e

    # -- results ------------------------------------------------------------------------------

    def memory(self) -> list[tuple[int, int]]:
        """(time ns, bytes allocated in this step) at every change (NOTE rule 6)."""
        deltas: list[tuple[int, int]] = []
        sizes: dict[int, int] = {}
        for i, it in enumerate(self.items):
            t = type(it)
            if t is Alloc:
                sizes[it.block] = it.nbytes
                deltas.append((self.issue[i], it.nbytes))
            elif t is Free and it.block in sizes:
                at = max([self.issue[i]] + [self.end[j] for j in self.free_after.get(i, ())])
                deltas.append((at, -sizes.pop(it.block)))
        deltas.sort()  # frees before allocations at one instant: the block is reusable then
        out, cur = [(0, 0)], 0
        for t, d in deltas:
            cur += d
            if out[-1][0] == t:
                out[-1] = (t, cur)
            else:
                out.append((t, cur))
        return out


class Clock:
    """The timeline of a step being captured, advanced as its items are recorded (NOTE rule 7): what the
    engine's ``Event.query`` sees while ``offload.predict`` captures a step for ``gpu``."""

    def __init__(self, gpu: str | GPUSpec, *, host_cost: HostCost | Callable | None = None,
                 device_cost: DeviceCost | None = None) -> None:
        self.gpu = resolve_gpu(gpu)
        self._hc = host_cost if host_cost is not None else HostCost()
        self._dc = device_cost if device_cost is not None else device_seconds
        self._sim = _Sim([], [], [])

    def add(self, item: Any) -> None:
        """The next item the host issues."""
        t = type(item)
        dur = _ns(self._dc(item, self.gpu)) if t is Kernel or t is Copy else 0
        self._sim.add(item, _ns(self._hc(item)), dur)

    def done(self, event: int) -> bool:
        """Whether the device has run the latest record of ``event`` by the host's current time (an event
        never recorded is done, as in CUDA)."""
        sim = self._sim
        sim.run(now=True)
        r = sim.last_record.get(event)
        return r is None or 0 <= sim.end[r] <= sim.host_t

    @property
    def host_seconds(self) -> float:
        """The host's current time in the modelled step."""
        return self._sim.host_t / 1e9
