"""Peak device memory of one training step, measured the way the budget is stated.

The budget is "the peak device memory the step may reach", i.e. what
``torch.cuda.max_memory_allocated`` reports. On an accelerator the meter reads
the caching allocator's counters. On CPU there is no such counter, so it uses
torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``), a
``TorchDispatchMode`` that sums the storages it sees (parameters, gradients,
buffers, activations, temporaries) and keeps their running peak.

Host buffers are not device memory. With ``OffloadActivations(device="cpu")``
the engine's host pool lives in the same address space as the "device", and
plain MemTracker starts counting a pooled buffer the first time a copy writes
into it (the buffer is the output of ``copy_``), which makes offloading look
like it costs memory. :class:`_HostExcludingTracker` drops such storages: a
storage is host memory when its bytes lie inside a buffer of one of the given
pools. The buffers are found two ways, so that a pool redesign (slabs, views)
does not break the rule:

* before the step, by walking the pool object (its attributes, containers and
  ``HostBuffer`` objects) for every tensor it holds, and
* during the step, by wrapping the pool instance's public methods: every buffer
  ``take``/``overflow`` hands out is recorded before a copy can write into it, and
  whatever a pool method allocates (a new chunk, a re-layout at the end of a step,
  as when ``warmup=0``) is host memory.

Containment is tested on data-pointer ranges, so a buffer that is a view into
a larger slab is covered by the slab's range and vice versa.

The subclass overrides two private MemTracker methods (``_track``, where a
storage is first counted, and ``_update_peak_stats``, to follow the running
total between block boundaries), reads ``_curr_mem_snap`` and replaces
``_mod_tracker`` with :class:`_NoModules`; checked against torch 2.13 by
``tests/planner`` (a torch that renames them fails those tests, not silently).

Only the running total is read, never MemTracker's per-module statistics, so
its module tracker is left out (issue 31). That tracker hooks every module
call (snapshots copied per call, a per-op loop over every module seen: most of
a tracked step's cost) and registers a gradient hook on every parameter of
every module that runs, which raises on a frozen parameter (every PEFT/LoRA
model). Without it, the total still counts everything: parameters, buffers and
existing gradients through ``track_external``; gradients created during the
step, activations and temporaries as the outputs of the ops that make them.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["MemoryMeter", "measure_step", "StepMeasurement", "host_clock", "BoundaryClock"]


def host_clock() -> Callable[[], float]:
    """The clock for CPU steps: this thread's CPU time when torch runs one intra-op thread
    (then all of forward and backward runs on the calling thread, and a shared machine's
    descheduling does not count), wall time otherwise."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _tensor_ranges(obj: Any, out: list[tuple[int, int]], seen: set[int], depth: int = 0) -> None:
    """Collect (start, end) byte ranges of every tensor reachable from ``obj``."""
    if depth > 6 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        try:
            st = obj.untyped_storage()
            start = st.data_ptr()
            out.append((start, start + st.nbytes()))
        except (RuntimeError, NotImplementedError):
            pass
        return
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    if isinstance(obj, dict):
        for v in list(obj.values()):
            _tensor_ranges(v, out, seen, depth + 1)
        return
    if isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
        for v in list(obj):
            _tensor_ranges(v, out, seen, depth + 1)
        return
    d = getattr(obj, "__dict__", None)
    if d is not None:
        for v in list(d.values()):
            _tensor_ranges(v, out, seen, depth + 1)
    for slot in getattr(type(obj), "__slots__", ()):
        v = getattr(obj, slot, None)
        if v is not None:
            _tensor_ranges(v, out, seen, depth + 1)


class _HostRanges:
    """Byte ranges of host buffers; ``contains(ptr)`` says whether a storage is one."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []
        self._starts: list[int] = []
        self.inside_pool = 0
        """> 0 while a pool method runs: what it allocates (a new chunk) is host memory."""

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._ranges.insert(i, (start, end))

    def add_tensor(self, t: torch.Tensor | None) -> None:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            self.add(st.data_ptr(), st.data_ptr() + st.nbytes())

    def contains(self, ptr: int) -> bool:
        i = bisect.bisect_right(self._starts, ptr) - 1
        # Ranges may nest (a slab and its views): look back over a few starts.
        lo = max(-1, i - 64)
        while i > lo:
            s, e = self._ranges[i]
            if s <= ptr < e:
                return True
            i -= 1
        return False

    def __len__(self) -> int:
        return len(self._ranges)


class _NoModules:
    """Stands in for MemTracker's ``ModTracker``: no module hooks, never "in backward" (see the module doc)."""

    is_bw = False
    parents = frozenset({"Global"})

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, mod: nn.Module) -> None:
        return None

    def __enter__(self) -> "_NoModules":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _make_tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class _HostExcludingTracker(MemTracker):
        """MemTracker that never counts a storage lying inside a host buffer."""

        def __init__(self, host: _HostRanges, on_update: Callable[[int], None]) -> None:
            super().__init__()
            self._mod_tracker = _NoModules()
            self._host = host
            self._on_update = on_update

        def _track(self, reftype: Any, t: torch.Tensor) -> None:  # type: ignore[override]
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError, TypeError):
                ptr = 0
            if ptr and self._host.contains(ptr):
                return
            if ptr and self._host.inside_pool:  # the pool growing (its first take, with warmup=0)
                self._host.add_tensor(t)
                return
            super()._track(reftype, t)

        def _update_peak_stats(self, peak_state: Any) -> None:  # type: ignore[override]
            # The meter keeps the peak (MemTracker's own copies a snapshot at every new peak).
            self._on_update(self.current_total())

        def current_total(self) -> int:
            return int(sum(s.get("Total", 0) for s in self._curr_mem_snap.values()))

    return _HostExcludingTracker


class MemoryMeter:
    """Current and windowed-peak device memory while a step runs.

    ``with meter.tracking(model): run()``; inside, ``meter.level()`` is the
    bytes in use now and ``meter.window()`` returns the peak since the previous
    call to ``window()`` (and starts a new window). ``meter.peak`` is the peak
    of the whole tracked region.

    Args:
        device: the device whose memory is measured ("cpu" uses MemTracker).
        pools: host pools (``engine.pool``) whose buffers are not device memory.
    """

    def __init__(self, device: torch.device | str, pools: Iterable[Any] = ()) -> None:
        self.device = torch.device(device)
        self.pools = [p for p in pools if p is not None]
        self.peak = 0
        self._window_peak = 0
        self._tracker: Any = None
        self._host = _HostRanges()

    # -- CPU: MemTracker ------------------------------------------------------

    def _note(self, total: int) -> None:
        if total > self._window_peak:
            self._window_peak = total
        if total > self.peak:
            self.peak = total

    def level(self) -> int:
        if self.device.type == "cpu":
            return self._tracker.current_total() if self._tracker is not None else 0
        return int(torch.accelerator.memory_allocated(self.device))

    def window(self) -> int:
        """Peak since the last call (or since tracking began); starts a new window."""
        if self.device.type == "cpu":
            w = max(self._window_peak, self.level())
            self._window_peak = self.level()
            return w
        w = int(torch.accelerator.max_memory_allocated(self.device))
        self.peak = max(self.peak, w)
        torch.accelerator.reset_peak_memory_stats(self.device)
        return w

    def tracking(self, model: nn.Module | None, *external: Any) -> "_Tracking":
        """Track a step of ``model``; on CPU ``external`` (optimizers, tensors) is counted too, as MemTracker's
        ``track_external`` counts it (an optimizer's state, the step its state is created in included)."""
        return _Tracking(self, model, external)


class _Tracking:
    def __init__(self, meter: MemoryMeter, model: nn.Module | None, external: tuple = ()) -> None:
        self.meter = meter
        self.model = model
        self.external = external
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> MemoryMeter:
        m = self.meter
        m.peak = 0
        if m.device.type != "cpu":
            torch.accelerator.synchronize(m.device)
            torch.accelerator.reset_peak_memory_stats(m.device)
            m.peak = 0
            return m
        for pool in m.pools:
            ranges: list[tuple[int, int]] = []
            _tensor_ranges(pool, ranges, set())
            for s, e in ranges:
                m._host.add(s, e)
            self._wrap(pool)
        m._tracker = _make_tracker_class()(m._host, m._note)
        if self.model is not None or self.external:
            m._tracker.track_external(*([self.model] if self.model is not None else []), *self.external)
        m._tracker.__enter__()
        m._window_peak = m.peak = m._tracker.current_total()
        return m

    def _wrap(self, pool: Any) -> None:
        """Wrap the pool instance's public methods: whatever they allocate (a chunk, a re-layout at the
        end of a step) is host memory, and every buffer ``take``/``overflow`` hands out is recorded."""
        host = self.meter._host
        for name in dir(type(pool)):
            if name.startswith("_") or name in vars(pool):
                continue
            if not callable(getattr(type(pool), name, None)) or isinstance(getattr(type(pool), name), type):
                continue
            orig = getattr(pool, name)
            records = name in ("take", "overflow")

            def wrapped(*a: Any, _orig: Callable = orig, _records: bool = records, **k: Any) -> Any:
                host.inside_pool += 1
                try:
                    buf = _orig(*a, **k)
                finally:
                    host.inside_pool -= 1
                if _records and buf is not None:
                    host.add_tensor(getattr(buf, "tensor", buf if isinstance(buf, torch.Tensor) else None))
                return buf

            setattr(pool, name, wrapped)
            self._undo.append(lambda p=pool, n=name: delattr(p, n))

    def __exit__(self, *exc: Any) -> None:
        m = self.meter
        try:
            if m.device.type != "cpu":
                torch.accelerator.synchronize(m.device)
                # window() resets the allocator's peak: keep the largest seen.
                m.peak = max(m.peak, int(torch.accelerator.max_memory_allocated(m.device)))
            elif m._tracker is not None:
                m._tracker.__exit__(*exc)
                m._tracker = None
        finally:
            for u in reversed(self._undo):
                u()
            self._undo.clear()


@dataclass
class StepMeasurement:
    """Peak memory and step time of one configuration."""

    peak_bytes: int
    """Peak device memory of the measured step (see the module docstring)."""
    step_seconds: float | None
    """Median of the timed steps (synchronised on accelerators; on CPU timed by
    :func:`host_clock`; the profile uses the same statistic and clock); None when no step was timed."""
    step_seconds_all: list[float] = field(default_factory=list)
    """Every timed step's seconds (their spread is the measurement's noise)."""


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure_step(
    run: Callable[[], Any],
    *,
    device: torch.device | str,
    model: nn.Module | None = None,
    pools: Iterable[Any] = (),
    warmup: int = 1,
    timed: int = 3,
    before_each: Callable[[], None] | None = None,
) -> StepMeasurement:
    """Warm up, measure the peak of one step, then time ``timed`` steps without the tracker (keeps the median).

    ``run`` performs one whole training step (forward and backward); ``pools``
    are the host pools of any engine it uses (their buffers are left out on CPU).
    ``before_each`` runs before every step (e.g. zeroing gradients in place).
    """
    dev = torch.device(device)
    pools = list(pools)
    for _ in range(warmup):
        if before_each:
            before_each()
        run()
    if before_each:
        before_each()
    meter = MemoryMeter(dev, pools)
    with meter.tracking(model):
        run()
    times = []
    clock = host_clock() if dev.type == "cpu" else time.perf_counter
    for _ in range(timed):
        if before_each:
            before_each()
        _sync(dev)
        t0 = clock()
        run()
        _sync(dev)
        times.append(clock() - t0)
    return StepMeasurement(peak_bytes=meter.peak, step_seconds=statistics.median(times) if times else None,
                           step_seconds_all=times)


class BoundaryClock:
    """Times at block boundaries: timing events on an accelerator (read after a synchronize), the host
    clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type != "cpu" and hasattr(torch, device.type)
        self.device = device
        self._host = host_clock()

    def now(self) -> Any:
        if self.cuda:
            ev = torch.Event(device=self.device, enable_timing=True)
            ev.record()
            return ev
        return self._host()

    def seconds(self, a: Any, b: Any) -> float:
        if a is None or b is None:
            return 0.0
        if self.cuda:
            return a.elapsed_time(b) / 1e3
        return b - a
