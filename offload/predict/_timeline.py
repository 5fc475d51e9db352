"""The timeline of one step on a named GPU: ``simulate`` replays a ``Trace`` (NOTE [ Simulated timeline ] in
``_sim.py``) and ``TimelineResult`` holds what it predicts: time, stalls (``_stalls.py``), memory and a
Chrome trace (``_chrome.py``). Everything here is a prediction for the spec it was given.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from ._cost import DeviceCost, HostCost, device_seconds
from ._sim import Clock, _ns, _Sim
from ._stalls import Stall, label_stalls
from ._trace import Copy, Kernel, Trace
from .gpus import GPUSpec, resolve_gpu

__all__ = ["simulate", "TimelineResult", "Stall", "Clock"]


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
        from ._chrome import chrome_events, write_chrome_trace
        meta = {"predicted": True, "gpu": self.gpu.name, "assumes": self.gpu.describe(),
                "step_seconds": self.step_seconds, "exposed_copy_seconds": self.exposed_copy_seconds}
        write_chrome_trace(chrome_events(self._sim, self.trace, self.stalls, self.gpu.name), meta, path)


def simulate(trace: Trace, gpu: str | GPUSpec = "h100-sxm", *, host_cost: HostCost | Callable | None = None,
             device_cost: DeviceCost | None = None) -> TimelineResult:
    """Predict the timeline of ``trace`` on ``gpu`` (NOTE [ Simulated timeline ] in ``_sim.py``).

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
