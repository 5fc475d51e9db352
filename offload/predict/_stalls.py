"""Why a stream that runs kernels sat idle: each gap of a simulated timeline, with its cause.

A gap before item ``i`` (its stream idle from the end of the item before it) has up to two parts:

1. until ``i`` was issued (the host was behind): **late issue** (the host was issuing: launch and
   hook costs), or **host block** (the host was blocked between issuing the item before and
   ``i``: a synchronize, a pageable copy);
2. from then until ``i`` could start: a ``WaitEvent`` on an event whose work ended in a copy is
   a copy wait, counted as exposed copy time and labelled

   - **wait on a free**: the wait orders a free or a reuse after the copy (``WaitEvent.why``
     'free': the engine's stash releasing an in-flight source);
   - **copy-engine queueing**: the copy waited for its direction's engine, or behind another
     copy on its own stream;
   - **early wait**: the wait comes before anything reads the copy's bytes (a device-to-host
     copy, or a reload no kernel reads before the stream's next wait for a copy's use);
   - **late issue**: the copy could only start when this stream reached the wait (issued at
     the point of use, or by a host that was behind: nothing to hide behind);
   - **link bandwidth**: the copy ran from before that point (or waited for its own offload
     to land) but took longer than the compute it could hide behind.

   A wait on other work is a **stream dependency**; a kernel waiting for another stream's
   kernel is **compute contention**.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._trace import Copy, Kernel, RecordEvent, WaitEvent

if TYPE_CHECKING:
    from ._sim import _Sim

__all__ = ["label_stalls", "Stall"]


@dataclass(frozen=True, slots=True)
class Stall:
    """A gap on a stream that runs kernels: it sat idle from ``start_ns`` for ``ns`` nanoseconds."""

    stream: int
    start_ns: int
    ns: int
    cause: str
    """'late issue', 'host block', 'early wait', 'copy-engine queueing', 'wait on a free',
    'link bandwidth', 'stream dependency' or 'compute contention' (see docs/timeline.md)."""
    item: int
    """Index in the trace of the item that started late."""
    copy: int = -1
    """Index of the copy it waited for (-1: not a copy wait)."""

    @property
    def start_s(self) -> float:
        return self.start_ns / 1e9

    @property
    def seconds(self) -> float:
        return self.ns / 1e9


def label_stalls(sim: "_Sim") -> list[Stall]:
    """Every gap on the streams that run kernels, in stream then time order."""
    pos = {i: k for items in sim.on_stream.values() for k, i in enumerate(items)}
    kernel_streams = sorted({it.stream for it in sim.items if type(it) is Kernel})
    out: list[Stall] = []
    for s in kernel_streams:
        prev_end = prev_issue = 0
        for i in sim.on_stream.get(s, ()):
            start = sim.start[i]
            if start > prev_end:
                issued = max(sim.issue[i], prev_end)
                if issued > prev_end:
                    # The host was blocked between issuing the item before and this one: the block
                    # held this item back (the issue that follows a synchronize counts with it).
                    blocked = any(a < sim.issue[i] and b > prev_issue for a, b, _ in sim.host_blocks)
                    out.append(Stall(s, prev_end, issued - prev_end, "host block" if blocked else "late issue", i))
                if start > issued:
                    cause, copy = _why_later(sim, pos, i, prev_end)
                    out.append(Stall(s, issued, start - issued, cause, i, copy))
            prev_end, prev_issue = max(prev_end, sim.end[i]), sim.issue[i]
    return out


def _why_later(sim: "_Sim", pos: dict[int, int], i: int, prev_end: int) -> tuple[str, int]:
    """(cause, awaited copy or -1) of item ``i`` starting after it was issued and its stream was free."""
    it = sim.items[i]
    if type(it) is not WaitEvent or sim.dep[i] < 0:
        return ("compute contention" if type(it) is Kernel else "stream dependency"), -1
    c = _awaited_copy(sim, pos, sim.dep[i])
    if c < 0:
        return "stream dependency", -1
    copy = sim.items[c]
    if it.why == "free":
        return "wait on a free", c
    if sim.start[c] > sim.ready[c]:
        return "copy-engine queueing", c
    if copy.direction == "d2h" or _not_read_before_next_use(sim, pos, i, copy):
        return "early wait", c
    held_by = _held_back_by(sim, pos, c)
    if held_by == "copy on its stream":
        return "copy-engine queueing", c
    if held_by == "another copy":
        return "link bandwidth", c  # its bytes were still on their way (its offload)
    if held_by == "issue" or sim.ready[c] >= prev_end:
        return "late issue", c  # it could start only when this stream reached the point of use
    return "link bandwidth", c


def _held_back_by(sim: "_Sim", pos: dict[int, int], c: int) -> str:
    """What set copy ``c``'s ready time: its 'issue', a 'copy on its stream' before it, 'another
    copy' it waited for (across streams), or 'other work'."""
    if sim.ready[c] == sim.issue[c]:
        return "issue"
    k = pos[c]
    items = sim.on_stream[sim.items[c].stream]
    while k > 0:
        k -= 1
        j = items[k]
        if sim.end[j] != sim.ready[c]:
            continue
        p = sim.items[j]
        if type(p) is Copy:
            return "copy on its stream"
        if type(p) is WaitEvent and sim.dep[j] >= 0:
            return "another copy" if _awaited_copy(sim, pos, sim.dep[j]) >= 0 else "other work"
        if type(p) is not RecordEvent:
            return "other work"
    return "other work"


def _awaited_copy(sim: "_Sim", pos: dict[int, int], r: int, depth: int = 16) -> int:
    """The copy whose end set the end of record ``r`` (following waits across streams), or -1."""
    while depth > 0:
        depth -= 1
        rec = sim.items[r]
        k = pos[r]
        if k == 0:
            return -1
        prev = sim.on_stream[rec.stream][k - 1]
        if sim.end[prev] != sim.end[r]:
            return -1  # the record ran when issued: not held back by earlier work
        p = sim.items[prev]
        if type(p) is Copy:
            return prev
        if type(p) is WaitEvent and sim.dep[prev] >= 0:
            r = sim.dep[prev]
        elif type(p) is RecordEvent:
            r = prev
        else:
            return -1
    return -1


def _not_read_before_next_use(sim: "_Sim", pos: dict[int, int], i: int, copy: Copy) -> bool:
    """Whether no kernel on ``i``'s stream reads the reload's blocks before the stream's next wait
    for a copy's use (known blocks only): the wait came before anything needed the bytes."""
    if not copy.blocks:
        return False
    blocks = set(copy.blocks)
    for j in sim.on_stream[sim.items[i].stream][pos[i] + 1:]:
        k = sim.items[j]
        if type(k) is Kernel and blocks & set(k.blocks):
            return False
        if type(k) is WaitEvent and k.why == "use":
            return True
    return True
