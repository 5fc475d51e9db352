"""The schedule suite's kit: traces of the real engine, synthetic costs, mutants, a reference schedule.

Traces come from the real engine's stream calls (``offload.predict._record.Recorder``: the engine's
``StreamBackend`` on the emulated accelerator, real CPU tensors at tiny sizes). Durations are
synthetic and exact: every kernel takes ``KERNEL_NS``, a copy ``nbytes / rate`` with the rate set
per regime, the host ``HOST`` costs; so the properties hold to the nanosecond on any machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from offload import OffloadActivations, _schedule
from offload.predict import GPUS
from offload.predict._cost import HostCost
from offload.predict._record import Recorder
from offload.predict._timeline import Clock, TimelineResult, simulate
from offload.predict._trace import Copy, HostWork, Kernel, RecordEvent, Trace, WaitEvent

KERNEL_NS = 10_000
"""Every kernel takes 10 us (synthetic)."""
LAYERS, WIDTH, BATCH = 8, 32, 128
ACT_BYTES = BATCH * WIDTH * 4
"""Bytes of one saved activation (float32)."""
STASH = 2
"""The engine's max_fwd_stash_size in the suite (a small stash: offloading saves what it should)."""
HOST = HostCost(op_s=1e-6, event_s=0.0, alloc_s=0.0,
                work_s={"pack hook": 2e-6, "pack hook (keep)": 1e-6, "unpack hook": 2e-6,
                        "unpack hook (keep)": 1e-6})
"""Device-bound host costs: the host issues a kernel and its hooks in well under ``KERNEL_NS``."""
HOST_BOUND = dataclasses.replace(HOST, op_s=50e-6)
"""Host-bound: every op takes the host 5x a kernel's device time (and hooks as above)."""


def kernel_units(item: Any, gpu: Any) -> float:
    """Synthetic device cost: ``KERNEL_NS`` per kernel, ``nbytes / link rate`` per copy (no latency)."""
    if type(item) is Kernel:
        return KERNEL_NS / 1e9
    if type(item) is Copy:
        return item.nbytes / (gpu.d2h_bytes_per_s if item.direction == "d2h" else gpu.h2d_bytes_per_s)
    return 0.0


def host_bound_units(item: Any, gpu: Any) -> float:
    """As ``kernel_units`` but kernels take no device time (the host alone sets the pace)."""
    return 0.0 if type(item) is Kernel else kernel_units(item, gpu)


def gpu_at(rate: float) -> Any:
    """An H100 spec with both link directions at ``rate`` bytes/s."""
    return dataclasses.replace(GPUS["h100-sxm"], h2d_bytes_per_s=rate, d2h_bytes_per_s=rate)


NEED = ACT_BYTES / (KERNEL_NS / 1e9)
"""The link rate at which one activation's copy takes one kernel's time."""
AMPLE = gpu_at(100 * NEED)
SCARCE = gpu_at(0.3 * NEED)


def make_model(n_layers: int = LAYERS) -> tuple[nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n_layers):
        lin = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5)
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(BATCH, WIDTH, generator=g)


def capture(offload: bool, *, steps: int = 3, gpu: Any = None, cost: Callable = kernel_units,
            host: HostCost = HOST, region: int | None = None, n_layers: int = LAYERS, **engine_kw: Any) -> Trace:
    """The trace of the last of ``steps`` training steps (forward, backward) of the suite's model,
    with the engine (``offload``) or without; earlier steps warm the pool up (steady state).

    ``gpu``: the engine's event polls see that modelled device (a ``Clock`` with the suite's
    synthetic costs), as on a GPU, and the engine runs with its own schedule (no caps unless given);
    without it polls never report a copy done, and the in-flight copies are capped at ``STASH``.
    ``region=k``: only the model's first ``k`` modules are offloaded (the rest excluded, kept on the
    device): a plan's first blocks. ``n_layers``: Linear + ReLU pairs of the model."""
    model, x = make_model(n_layers)
    clock = Clock(gpu, host_cost=host, device_cost=cost) if gpu is not None else None
    with Recorder(clock=clock) as rec:
        ctx = None
        if offload:
            kw = {"min_offload_size": 0, **({} if gpu is not None else {"max_fwd_stash_size": STASH}),
                  **engine_kw}
            ctx = OffloadActivations(device="cpu", **kw)
            if region is not None:
                for m in list(model)[region:]:
                    ctx.exclude(m)
            rec.watch(ctx)
        for step in range(steps):
            with rec.record() if step == steps - 1 else contextlib.nullcontext() as trace:
                with ctx if ctx is not None else contextlib.nullcontext():
                    loss = model(x).sum()
                loss.backward()
            model.zero_grad(set_to_none=False)  # gradients stay: the step allocates activations
    return trace


def run(trace: Trace, gpu: Any, *, host: HostCost = HOST, cost: Callable = kernel_units) -> TimelineResult:
    return simulate(trace, gpu, host_cost=host, device_cost=cost)


def offloaded_bytes(trace: Trace) -> int:
    """Bytes copied to the host from storages the step allocated (what offloading can free)."""
    allocated = {it.block for it in trace.items if type(it).__name__ == "Alloc"}
    return sum(it.nbytes for it in trace.items
               if type(it) is Copy and it.direction == "d2h" and set(it.blocks) & allocated)


# -- the mutants: schedule bugs the suite must catch ------------------------------------------

@contextlib.contextmanager
def _patched(obj: Any, name: str, fn: Callable[[Callable], Callable]) -> Iterator[None]:
    orig = getattr(obj, name)
    setattr(obj, name, fn(orig))
    try:
        yield
    finally:
        setattr(obj, name, orig)


def _no_prefetch(orig: Callable) -> Callable:
    return lambda self, p, load: None


def _sync_after_offload(orig: Callable) -> Callable:
    def d2h(self, src, dst):
        copy = orig(self, src, dst)
        copy.done.synchronize()
        return copy
    return d2h


def _one_stream(orig: Callable) -> Callable:
    return lambda self, direction: orig(self, "d2h")


def _reload_waited_at_issue(orig: Callable) -> Callable:
    def load(self, hc, rec):
        dev, copy = orig(self, hc, rec)
        self._wait(copy)
        return dev, copy
    return load


def _offload_waited_at_pack(orig: Callable) -> Callable:
    def copy_out(self, *a, **k):
        made = orig(self, *a, **k)
        if made is not None and made[1] is not None:
            self._backend.wait(made[1].copy, "compute_waits_copy")
        return made
    return copy_out


def _per_tensor_pinned(orig: Callable) -> Callable:
    from offload.pool import HostBuffer

    def take(self, nbytes):
        made = self._new_tensor(nbytes)  # a fresh (pinned, on a GPU) allocation for every tensor
        return None if made is None else HostBuffer(made[0][:nbytes], nbytes, made[1], made[2], pooled=False)
    return take


def _stash_until_forward_ends(orig: Callable) -> Callable:
    def push(self, entry):
        with self.lock:
            self.inflight.append(entry)
            self.inflight_bytes += entry.nbytes
    return push


def _no_poll(orig: Callable) -> Callable:
    return lambda self: None


def _drain_at_exit(orig: Callable) -> Callable:
    def exit_(self, *exc):
        orig(self, *exc)
        if self._thread().enter_depth == 0:
            self._sched.drain()
    return exit_


def _kept_unpack_loads_nothing(orig: Callable) -> Callable:
    return lambda self, step: self._begin_backward_pass(step.order)


def _count_cap(orig: Callable) -> Callable:
    def bound(self, upcoming):
        while len(self.inflight) > 1:  # the engine's old default: compute waits to honour a count
            self._release(self.inflight[0], wait=True)
        return orig(self, upcoming)
    return bound


def _tail_or_remaining(orig: Callable) -> Callable:
    def bound(self, upcoming):  # the schedule before: in flight up to the larger of the two, not their sum
        if self.budget is None and self.history and self.inflight and not (self.max_count or self.max_bytes):
            saved, moved = self.progress()
            tail = min(_schedule._WINDOW * self.max_copy, min(self.moved) // _schedule._TAIL)
            window = max(2 * self.max_copy, tail)
            left = max(min(self.history) - (saved - moved) - self.max_save, window)
            while self.inflight and self.inflight_bytes > left:
                self._release(self.inflight[0], wait=True)
            return None
        return orig(self, upcoming)
    return bound


def _window_of_two_copies(orig: Callable) -> Callable:
    return lambda self, p, nbytes: p.prefetched_bytes + nbytes <= 2 * self.max_copy


def mutant(name: str) -> contextlib.AbstractContextManager:
    """The engine with one schedule bug (the issue's list, plus the D2H twin of an early wait)."""
    from offload import _backward, _copies, engine, pool, streams
    stack = contextlib.ExitStack()
    sched = _schedule._Schedule
    patches = {
        "no_prefetch_in_backward": [(sched, "ahead", _no_prefetch)],
        "sync_after_each_offload": [(streams.StreamBackend, "d2h", _sync_after_offload)],
        "both_directions_one_stream": [(streams.StreamBackend, "_side_stream", _one_stream)],
        "reload_waited_at_issue": [(_copies._Copies, "_load", _reload_waited_at_issue)],
        "offload_waited_at_pack": [(_copies._Copies, "_copy_out", _offload_waited_at_pack)],
        "per_tensor_pinned_allocation": [(pool.HostPool, "take", _per_tensor_pinned)],
        "stash_released_at_forward_end": [(sched, "push", _stash_until_forward_ends), (sched, "kept", _no_poll),
                                          (engine.OffloadActivations, "__exit__", _drain_at_exit)],
        "kept_unpack_issues_no_reload": [(_backward._Backward, "_kept_unpacked", _kept_unpack_loads_nothing)],
        "compute_waits_to_honour_a_count": [(sched, "_bound", _count_cap)],
        "kept_pack_does_not_poll": [(sched, "kept", _no_poll)],
        "reloads_windowed_by_two_copies": [(sched, "_room", _window_of_two_copies)],
        "tail_or_remaining_forward": [(sched, "_bound", _tail_or_remaining)],
    }[name]
    for obj, attr, fn in patches:
        stack.enter_context(_patched(obj, attr, fn))
    return stack


MUTANTS = ("no_prefetch_in_backward", "sync_after_each_offload", "both_directions_one_stream",
           "reload_waited_at_issue", "offload_waited_at_pack", "per_tensor_pinned_allocation",
           "stash_released_at_forward_end", "kept_unpack_issues_no_reload", "compute_waits_to_honour_a_count",
           "kept_pack_does_not_poll", "reloads_windowed_by_two_copies", "tail_or_remaining_forward")


# -- the independent reference schedule (the scarce-bandwidth bound) ----------------------------

def reference_exposed_ns(trace: Trace, gpu: Any, *, stash: int, prefetch_bytes: int,
                         cost: Callable = kernel_units) -> int:
    """Compute-stream idle time of a work-conserving schedule of the same kernels and copies.

    Built from the trace's kernels and copies only (not from the engine's waits): each copy
    engine runs its copies back to back in order (offloads in program order, reloads in order of
    need), an offload as soon as its producer kernel ended, a reload as soon as its offload
    landed and the memory constraints allow. The constraints are the engine's settings, not its
    schedule: at most ``stash`` offloads in flight (the kernel after offload ``j + stash`` waits
    for offload ``j``), at most ``prefetch_bytes`` reloaded ahead of the reload being consumed,
    none before backward's first kernel. A reload is needed by the first kernel of the autograd
    node that reads it (the kernel after the last unpack before its first reader: autograd asks
    for every saved tensor of a node before the node's first kernel). A kernel starts when the
    one before it ended and the reloads it needs have landed.
    """
    items = trace.items
    ns = lambda it: round(cost(it, gpu) * 1e9)  # noqa: E731
    kernels = [i for i, it in enumerate(items) if type(it) is Kernel and it.stream == 0]
    kidx = {i: k for k, i in enumerate(kernels)}
    after = [0] * (len(items) + 1)  # program position -> index of the first kernel at or after it
    nxt = len(kernels)
    for i in range(len(items) - 1, -1, -1):
        nxt = kidx.get(i, nxt)
        after[i] = nxt
    d2h = [i for i, it in enumerate(items) if type(it) is Copy and it.direction == "d2h"]
    h2d = [i for i, it in enumerate(items) if type(it) is Copy and it.direction == "h2d"]
    producer = {j: max((kidx[k] for k in kernels if k < i and set(items[k].blocks) & set(items[i].blocks)),
                       default=-1) for j, i in enumerate(d2h)}
    gate: dict[int, list[int]] = {}
    for j in range(len(d2h) - stash):
        gate.setdefault(after[d2h[j + stash]], []).append(j)
    by_host = {items[i].host: j for j, i in enumerate(d2h)}
    need = {i: _need(items, kernels, after, i) for i in h2d}
    order = sorted(h2d, key=lambda i: (need[i], i))
    first_bwd = next((k for k, i in enumerate(kernels) if items[i].phase == "backward"), len(kernels))
    needed_at: dict[int, list[int]] = {}
    for r, i in enumerate(order):
        needed_at.setdefault(need[i], []).append(r)
    end = [0] * len(kernels)
    d2h_done: list[int] = []
    h2d_done: list[int] = []
    free = {"d2h": 0, "h2d": 0}

    def arrival(t: int) -> int:
        return end[t - 1] if t > 0 else 0

    def offload_until(j: int) -> None:
        while len(d2h_done) <= j:
            n = len(d2h_done)
            p = producer[n]
            free["d2h"] = max(free["d2h"], end[p] if p >= 0 else 0) + ns(items[d2h[n]])
            d2h_done.append(free["d2h"])

    def reload_until(r: int) -> None:
        while len(h2d_done) <= r:
            n = len(h2d_done)
            i = order[n]
            # Reload n may start once reload m is being consumed, where m is the latest reload with
            # bytes(m+1 .. n) <= prefetch_bytes; from backward's start when bytes(0 .. n) fit.
            m, held = n, 0
            while m >= 0:
                held += items[order[m]].nbytes
                if held > prefetch_bytes:
                    break
                m -= 1
            allowed = arrival(first_bwd if m < 0 else max(need[order[m]], first_bwd))
            dep = by_host.get(items[i].host)
            if dep is not None:
                offload_until(dep)
            start = max(free["h2d"], allowed, d2h_done[dep] if dep is not None else 0)
            free["h2d"] = start + ns(items[i])
            h2d_done.append(free["h2d"])

    idle = 0
    for t, i in enumerate(kernels):
        ready = arrival(t)
        for j in gate.get(t, ()):
            offload_until(j)
            ready = max(ready, d2h_done[j])
        for r in needed_at.get(t, ()):
            reload_until(r)
            ready = max(ready, h2d_done[r])
        idle += ready - arrival(t)
        end[t] = ready + ns(items[i])
    return idle


def _need(items: list, kernels: list[int], after: list[int], i: int) -> int:
    """Index (in ``kernels``) of the kernel that needs reload ``i``'s bytes (see the reference)."""
    blocks = set(items[i].blocks)
    reader = next((k for k in kernels if k > i and blocks & set(items[k].blocks)), None)
    if reader is None:
        return len(kernels)
    u = max((j for j in range(reader) if type(items[j]).__name__ == "HostWork"
             and items[j].what.startswith("unpack hook")), default=i)
    return after[u]


def forward_peak_bytes(res: TimelineResult) -> int:
    """Peak device bytes allocated by the step before its first backward kernel was issued."""
    sim = res._sim
    t_bwd = min((sim.issue[i] for i, it in enumerate(res.trace.items)
                 if type(it) is Kernel and it.phase == "backward"), default=None)
    return max(b for t, b in res.memory_ns() if t_bwd is None or t < t_bwd)


# -- the properties, as one checker (the mutation test runs it on each mutant) --------------------

SCARCE_RATES = (0.2, 0.3, 0.5)
"""Link rates, as fractions of ``NEED``, for the scarce-bandwidth bound."""
TOLERANCE = 0.01
"""The scarce bound's tolerance: 1% of the step's total copy time (each duration is rounded to
the nanosecond once, in the engine's timeline and in the reference alike)."""


def violations(off: Trace, none: Trace) -> dict[str, str]:
    """Each schedule property the offload trace ``off`` breaks (name -> what was seen), against
    the no-offload trace ``none`` of the same step."""
    out: dict[str, str] = {}
    a, n = run(off, AMPLE), run(none, AMPLE)
    if a.exposed_copy_seconds:
        out["ample: no wait on a copy"] = f"{a.exposed_copy_seconds * 1e9:.0f} ns exposed: {a.stall_causes}"
    hooks = a.host_busy_seconds - n.host_busy_seconds
    if not n.step_seconds <= a.step_seconds <= n.step_seconds + hooks:
        out["ample: step within no-offload + hooks"] = f"{a.step_seconds} vs {n.step_seconds} + {hooks}"
    ha, hn = (run(t, AMPLE, host=HOST_BOUND, cost=host_bound_units) for t in (off, none))
    if round((ha.step_seconds - hn.step_seconds) * 1e9) != round((ha.host_busy_seconds - hn.host_busy_seconds) * 1e9):
        out["host-bound: step = no-offload + hooks"] = f"{ha.step_seconds} vs {hn.step_seconds}"
    for f in SCARCE_RATES:
        g = gpu_at(f * NEED)
        s = run(off, g)
        ref = reference_exposed_ns(off, g, stash=STASH, prefetch_bytes=2 * ACT_BYTES)
        tol = TOLERANCE * sum(s.copy_seconds.values()) * 1e9
        got = round(s.exposed_copy_seconds * 1e9)
        if got > ref + tol:
            out[f"scarce {f}: within the reference bound"] = f"{got} ns > {ref} + {tol:.0f} ns: {s.stall_causes}"
    syncs = [it for it in off.items if type(it).__name__ == "HostSync"]
    if syncs:
        out["no host synchronize"] = f"{len(syncs)}: {syncs[0]}"
    pins = [it for it in off.items if type(it).__name__ == "HostWork" and it.what == "pinned allocation"]
    if pins:
        out["no pinned allocation"] = f"{len(pins)} in the step"
    bound = forward_peak_bytes(n) - offloaded_bytes(off) + (STASH + 2) * ACT_BYTES
    if forward_peak_bytes(a) > bound:
        out["forward memory"] = f"{forward_peak_bytes(a)} B > {bound} B"
    return out


# -- the copy schedule's own properties (NOTE [ Copy schedule ]), on captures with a clock -------------

REGION, REGION_LAYERS = 10, 24
"""The region captures: a model of 24 Linear + ReLU pairs whose first 10 modules (five pairs) are
offloaded, the 19 pairs after them kept: a plan's first blocks."""
OVERLAP = gpu_at(0.15 * NEED)
"""A link at which the region's reloads take longer than the region's own backward, and less than the
backward of the blocks after it: they hide only if issued before backward reaches the region."""
POLLED = gpu_at(0.5 * NEED)
"""A link at which the region's copies are still running when its last offloaded tensor is packed and are
done long before the forward's end: only polls at later (kept) packs free their sources in time."""
NEVER_WAIT = 1 << 40
"""A ``device_budget_bytes`` no step reaches: compute may then never wait on a copy (NOTE item 2)."""


TAIL_PAIRS, TAIL_KEPT = 64, 8
"""The tail captures: a model of 72 Linear + ReLU pairs whose first 64 pairs are offloaded, the last 8 kept."""
TAIL_LINK = gpu_at(0.4 * NEED)
"""A link at which the offloaded region's copies outlast the forward, by less than the tail (eight copies)."""


def forward_ns(res: TimelineResult) -> int:
    """When the step's first backward kernel started: the forward's length on the timeline."""
    sim = res._sim
    return min(sim.start[i] for i, it in enumerate(res.trace.items) if type(it) is Kernel and it.phase == "backward")


def schedule_captures() -> dict[str, Trace]:
    """The traces the schedule properties read (the engine's own schedule: no caps)."""
    return {"tail": capture(True, gpu=TAIL_LINK, region=2 * TAIL_PAIRS, n_layers=TAIL_PAIRS + TAIL_KEPT),
            "tail_none": capture(False, n_layers=TAIL_PAIRS + TAIL_KEPT),
            "no_wait": capture(True, gpu=POLLED, region=REGION, n_layers=REGION_LAYERS,
                               device_budget_bytes=NEVER_WAIT),
            "at_once": capture(True, gpu=POLLED, region=REGION, n_layers=REGION_LAYERS, max_fwd_stash_size=1,
                               max_inflight_bytes=1),
            "region": capture(True, gpu=OVERLAP, region=REGION, n_layers=REGION_LAYERS)}


def d2h_waits(trace: Trace) -> int:
    """Stream waits on a device-to-host copy's event (a source released before its copy was known done)."""
    d2h_streams = {it.stream for it in trace.items if type(it) is Copy and it.direction == "d2h"}
    recorded = {it.event: it.stream for it in trace.items if type(it) is RecordEvent}
    return sum(1 for it in trace.items if type(it) is WaitEvent and it.why == "free"
               and recorded.get(it.event) in d2h_streams)


def reloads_before_offloaded_unpack(trace: Trace) -> int:
    """Reloads issued in backward before its first unpack of an offloaded tensor (so by kept unpacks)."""
    n = 0
    for it in trace.items:
        if type(it) is HostWork and it.what == "unpack hook":
            return n
        if type(it) is Copy and it.direction == "h2d":
            n += 1
    return n


def reload_exposure_ns(res: TimelineResult) -> int:
    """Compute time spent waiting on reloads (stalls whose awaited copy is a host-to-device one)."""
    items = res.trace.items
    return sum(st.ns for st in res.stalls if st.copy >= 0 and items[st.copy].direction == "h2d")


def schedule_violations(traces: dict[str, Trace]) -> dict[str, str]:
    """Each copy-schedule property the captures break (name -> what was seen)."""
    out: dict[str, str] = {}
    region = traces["region"]
    got = reloads_before_offloaded_unpack(region)
    if not got:
        out["kept unpacks issue reloads"] = "no reload before backward's first offloaded unpack"
    n = d2h_waits(traces["no_wait"])
    if n:
        out["no compute wait on a copy while the budget holds"] = f"{n} waits on a D2H"
    polled = forward_peak_bytes(run(traces["no_wait"], POLLED))
    at_once = forward_peak_bytes(run(traces["at_once"], POLLED))
    if polled > at_once:
        out["a finished copy's source is freed at the next pack"] = (
            f"forward holds {polled} B, {polled - at_once} B more than releasing at once")
    tail, res, ref = traces["tail"], run(traces["tail"], TAIL_LINK), run(traces["tail_none"], TAIL_LINK)
    moved, rate = offloaded_bytes(tail), TAIL_LINK.d2h_bytes_per_s
    d2h_ns = sum(res._sim.end[i] - res._sim.start[i] for i, it in enumerate(tail.items)
                 if type(it) is Copy and it.direction == "d2h")
    # NOTE [ Copy schedule ] item 2 (the largest copy: one activation)
    tail_bytes = min(_schedule._WINDOW * ACT_BYTES, moved // _schedule._TAIL)
    overrun = max(0, d2h_ns - forward_ns(ref) - round(tail_bytes / rate * 1e9))
    waited = sum(st.ns for st in res.stalls if st.cause == "wait on a free")
    if waited > overrun + 2 * round(ACT_BYTES / rate * 1e9):
        out["the tail hides the copies' overrun"] = (
            f"compute waited {waited} ns on D2H copies; they outlast the forward by {overrun} ns beyond the tail")
    peak = forward_peak_bytes(res)
    bound = forward_peak_bytes(ref) - moved + tail_bytes + 2 * ACT_BYTES
    if peak > bound:
        out["the forward ends with no more than the tail in flight"] = f"{peak} B > {bound} B"
    exposed = reload_exposure_ns(run(region, OVERLAP))
    total = sum(1 for it in region.items if type(it) is Copy and it.direction == "h2d")
    if exposed or got < total:
        out["a region's reloads overlap the backward before it"] = (
            f"{got} of {total} reloads issued before backward reached the region; {exposed} ns waiting on them")
    return out
