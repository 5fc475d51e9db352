"""A predicted timeline as a Chrome trace (the JSON ``chrome://tracing`` and Perfetto open).

Process "host": the issue thread (hook work and host blocks as slices). Process "device
(predicted)": one thread per stream (kernels, copies, stalls) and a device-memory counter. Times
are microseconds, as the format wants.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ._trace import Copy, HostWork, Kernel

if TYPE_CHECKING:
    from ._sim import _Sim
    from ._stalls import Stall
    from ._trace import Trace

__all__ = ["write_chrome_trace", "chrome_events"]

_HOST, _DEVICE = 0, 1


def _slice(name: str, pid: int, tid: int, start_ns: int, dur_ns: int, **args: Any) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start_ns / 1e3, "dur": dur_ns / 1e3,
            "args": args}


def chrome_events(sim: "_Sim", trace: "Trace", stalls: "list[Stall]", gpu_name: str) -> list[dict[str, Any]]:
    """The trace events of a replayed step (see the module docstring)."""
    ev: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": _HOST, "args": {"name": "host (predicted)"}},
        {"name": "process_name", "ph": "M", "pid": _DEVICE,
         "args": {"name": f"device (predicted, {gpu_name})"}},
        {"name": "thread_name", "ph": "M", "pid": _HOST, "tid": 0, "args": {"name": "issue"}},
    ]
    for s in sorted(sim.on_stream):
        ev.append({"name": "thread_name", "ph": "M", "pid": _DEVICE, "tid": s,
                   "args": {"name": trace.streams.get(s, f"stream {s}")}})
    for i, it in enumerate(trace.items):
        t = type(it)
        if t is Kernel:
            ev.append(_slice(it.op, _DEVICE, it.stream, sim.start[i], sim.dur[i], flops=it.flops,
                             bytes=it.bytes, module=it.module, phase=it.phase))
        elif t is Copy:
            ev.append(_slice(f"{it.direction} {it.nbytes} B" + ("" if it.pinned else " pageable"), _DEVICE,
                             it.stream, sim.start[i], sim.dur[i], module=it.module, phase=it.phase))
        elif t is HostWork and sim.host_ns[i]:
            ev.append(_slice(it.what, _HOST, 0, sim.issue[i] - sim.host_ns[i], sim.host_ns[i]))
    for a, b, i in sim.host_blocks:
        why = getattr(trace.items[i], "why", "") or type(trace.items[i]).__name__
        ev.append(_slice(f"blocked: {why}", _HOST, 0, a, b - a))
    for st in stalls:
        ev.append(_slice(f"stall: {st.cause}", _DEVICE, st.stream, st.start_ns, st.ns, item=st.item, copy=st.copy))
    for t, b in sim.memory():
        ev.append({"name": "device memory (step)", "ph": "C", "pid": _DEVICE, "ts": t / 1e3,
                   "args": {"allocated_bytes": b}})
    return ev


def write_chrome_trace(events: list[dict[str, Any]], metadata: dict[str, Any], path: str) -> None:
    """Write ``events`` (``chrome_events``) to ``path`` as Chrome trace JSON with ``metadata`` (the caller labels
    it as a prediction for its spec)."""
    doc = {"traceEvents": events, "displayTimeUnit": "ns", "metadata": metadata}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
