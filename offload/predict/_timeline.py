"""The timeline of one step on a named GPU: a discrete-event simulation of a ``Trace``.

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
The result's stalls (each gap on a stream that runs kernels, with its cause) are labelled in
``_stalls.py``. Everything here is a prediction for the spec it was given.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from ._cost import DeviceCost, HostCost, device_seconds
from ._stalls import Stall, label_stalls
from ._trace import (COMPUTE_STREAM, Alloc, Copy, Free, HostSync, Kernel, RecordEvent, RecordStream,
                     Trace, WaitEvent)
from .gpus import GPUSpec, resolve_gpu

__all__ = ["simulate", "TimelineResult", "Stall", "Clock"]

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


@dataclass
class TimelineResult:
    """A predicted step on ``gpu``: its time, its exposed copy time and stalls, its memory."""

    gpu: GPUSpec
    step_seconds: float
    """Predicted: from the first issue to the end of the last work, host or device."""
    exposed_copy_seconds: float
    """Predicted: time streams that run kernels sat idle waiting on a copy."""
    stalls: list[Stall]
    stall_causes: dict[str, float]
    """Predicted seconds of stall per cause."""
    host_busy_seconds: float
    """Host time spent issuing (launch, event calls, hooks), blocks excluded."""
    host_blocked_seconds: float
    kernel_seconds: float
    """Sum of kernel durations (the compute the step does)."""
    copy_seconds: dict[str, float]
    """Sum of copy durations per direction."""
    copy_bytes: dict[str, int]
    peak_memory_bytes: int
    """Predicted peak of device bytes allocated during the step (above what it started with)."""
    trace: Trace = field(repr=False)
    _sim: _Sim = field(repr=False)
    _again: Callable[[GPUSpec], "TimelineResult"] = field(repr=False)

    @property
    def memory(self) -> list[tuple[float, int]]:
        """Predicted (seconds, bytes allocated in this step) at every change."""
        return [(t / 1e9, b) for t, b in self._sim.memory()]

    def item_end_seconds(self, index: int) -> float:
        """Predicted: when trace item ``index`` ended on its stream (issued, for a host item)."""
        sim = self._sim
        return (sim.end[index] if sim.end[index] >= 0 else sim.issue[index]) / 1e9

    def memory_ns(self) -> list[tuple[int, int]]:
        """``memory`` in exact integer nanoseconds."""
        return self._sim.memory()

    def _at_link(self, rate: float) -> "TimelineResult":
        return self._again(replace(self.gpu, h2d_bytes_per_s=rate, d2h_bytes_per_s=rate))

    @cached_property
    def _unhideable(self) -> frozenset[int]:
        """Copies (trace indices) some stream still waits on with an unlimited link: awaited as soon as
        issued (the first reload of backward, say), so their latency shows at any rate."""
        return frozenset(st.copy for st in self._at_link(1e18).stalls if st.copy >= 0)

    @cached_property
    def exposed_copy_floor_seconds(self) -> float:
        """Predicted: exposed copy time with an unlimited host link (copies awaited as soon as issued)."""
        return self._at_link(1e18).exposed_copy_seconds if any(self.copy_bytes.values()) else 0.0

    @cached_property
    def exposed_at_issue_seconds(self) -> float:
        """Predicted: the part of ``exposed_copy_seconds`` spent waiting on copies awaited as soon as issued,
        which no link rate hides (an earlier issue or fewer bytes would)."""
        unhideable = self._unhideable
        return sum(st.ns for st in self.stalls if st.copy >= 0 and st.copy in unhideable) / 1e9

    @cached_property
    def link_bytes_per_s_needed(self) -> float:
        """Predicted: the host link rate (both directions) at which no stream waits on a copy that can hide,
        i.e. on any copy other than those awaited as soon as issued (``exposed_copy_floor_seconds``: what
        those still cost with an unlimited link). 0 without copies; ``inf`` when no copy can hide."""
        unhideable = self._unhideable

        def exposed(rate: float) -> bool:
            return any(st.copy >= 0 and st.copy not in unhideable for st in self._at_link(rate).stalls)
        n_copies = sum(1 for it in self.trace.items if type(it) is Copy)
        if n_copies == 0:
            return 0.0
        if len(unhideable) == n_copies:
            return math.inf
        lo, hi = 1e3, max(self.gpu.h2d_bytes_per_s, self.gpu.d2h_bytes_per_s)
        while exposed(hi):
            if hi >= 1e18:  # not monotone in the rate: no finite answer
                return math.inf
            lo, hi = hi, hi * 4
        if not exposed(lo):
            return lo
        while hi / lo > 1.001:  # bisect in log space to 0.1%
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if exposed(mid) else (lo, mid)
        return hi

    def summary(self) -> dict[str, Any]:
        """The predicted numbers as a JSON-ready dict, labelled with the spec they assume."""
        return {"predicted": True, "gpu": self.gpu.name, "assumes": self.gpu.describe(),
                "step_seconds": self.step_seconds, "exposed_copy_seconds": self.exposed_copy_seconds,
                "stall_causes": dict(self.stall_causes), "host_busy_seconds": self.host_busy_seconds,
                "host_blocked_seconds": self.host_blocked_seconds, "kernel_seconds": self.kernel_seconds,
                "copy_seconds": dict(self.copy_seconds), "copy_bytes": dict(self.copy_bytes),
                "peak_memory_bytes": self.peak_memory_bytes}

    def write_trace(self, path: str) -> None:
        """Write a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing): the host, each
        stream, the stalls and a device-memory counter."""
        from ._chrome import write_chrome_trace
        write_chrome_trace(self, path)


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


def simulate(trace: Trace, gpu: str | GPUSpec = "h100-sxm", *, host_cost: HostCost | Callable | None = None,
             device_cost: DeviceCost | None = None) -> TimelineResult:
    """Predict the timeline of ``trace`` on ``gpu`` (NOTE [ Simulated timeline ]).

    ``host_cost(item) -> seconds`` is the host's issue cost per item (default :class:`HostCost`);
    ``device_cost(item, gpu) -> seconds`` the device time of a kernel or copy (default the
    roofline and link model of ``_cost``). Both may be synthetic (the schedule tests use units).
    """
    spec = resolve_gpu(gpu)
    hc = host_cost if host_cost is not None else HostCost()
    dc = device_cost if device_cost is not None else device_seconds
    items = trace.items
    host_ns = [_ns(hc(it)) for it in items]

    def run(g: GPUSpec) -> TimelineResult:
        dur = [_ns(dc(it, g)) if type(it) in (Kernel, Copy) else 0 for it in items]
        sim = _Sim(items, host_ns, dur)
        sim.run()
        return _result(trace, g, sim, run)

    return run(spec)


def _result(trace: Trace, gpu: GPUSpec, sim: _Sim, again: Callable) -> TimelineResult:
    items = trace.items
    stalls = label_stalls(sim)
    causes_ns: dict[str, int] = {}
    for st in stalls:
        causes_ns[st.cause] = causes_ns.get(st.cause, 0) + st.ns
    copy_s = {"d2h": 0, "h2d": 0}
    copy_b = {"d2h": 0, "h2d": 0}
    kernel_ns = 0
    for i, it in enumerate(items):
        if type(it) is Copy:
            copy_s[it.direction] += sim.dur[i]
            copy_b[it.direction] += it.nbytes
        elif type(it) is Kernel:
            kernel_ns += sim.dur[i]
    end = max([sim.host_t] + sim.end)
    mem = sim.memory()
    return TimelineResult(
        gpu=gpu, step_seconds=end / 1e9,
        exposed_copy_seconds=sum(s.ns for s in stalls if s.copy >= 0) / 1e9,
        stalls=stalls, stall_causes={k: v / 1e9 for k, v in causes_ns.items()}, host_busy_seconds=sim.host_busy / 1e9,
        host_blocked_seconds=sum(b - a for a, b, _ in sim.host_blocks) / 1e9,
        kernel_seconds=kernel_ns / 1e9, copy_seconds={k: v / 1e9 for k, v in copy_s.items()},
        copy_bytes=copy_b, peak_memory_bytes=max(b for _, b in mem), trace=trace, _sim=sim, _again=again)
