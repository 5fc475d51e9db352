"""Copy backends: a side-stream backend for accelerators and a synchronous one.

Both move raw bytes between a device tensor and a host buffer; the engine
decides what to move and keeps everything alive for as long as the rules in
``engine.py`` (NOTE [ Offload lifetime rules ]) require.

Side streams: one per direction, made lazily, so a reload never queues behind offloads it does not
depend on (same-direction copies serialise on one copy engine anyway, and the two directions run
concurrently: torchrec PR #4315). A reload of bytes an offload wrote is still ordered after that
offload: the source leaves the stash only after the compute stream waited on the D2H (Rule 2), and
the H2D stream waits on the compute stream; a host buffer a reload read is reused only after the
compute stream waited on that reload (at its use, or before an unused prefetch is dropped).

Side-stream ordering (see Rules 2-4):
  * D2H: the side stream first waits on the *live* current stream, so the copy
    runs after the kernel that produced the tensor.
  * H2D: the destination is allocated on the live current (compute) stream,
    never on the side stream, so the caching allocator ties the block to the
    stream that will read it; the side stream waits on compute before writing
    (the block may have been freed by queued compute work), and compute waits
    on the copy's event before reading. If a later consumer runs on another
    stream, the engine calls ``record_stream`` for it.

NOTE [ Ordering faults ]
Each ordering call below can be switched off, one at a time, by name
(``offload.testing.inject_fault(name)``; tests only): the emulated suite must
fail for every one of them (tests/offload/test_emulated_faults.py lists which
test catches which). ``_FAULTS`` is empty in every real run, so each check is
one falsy test. A call the engine makes from several places takes the name of
its call site (``site=``), so each place is switched off on its own.
In this module:
  d2h_waits_producer   side.wait_stream(compute) before a D2H (Rule 2)
  h2d_waits_compute    side.wait_stream(compute) before an H2D (Rule 4)
  copy_event           done.record(side) after each copy (Rules 2, 4)
  live_current_stream  current_stream() looked up at every call (Rule 3)
  compute_outside_side the compute stream read outside the side-stream context (Rule 3)
  h2d_alloc_on_compute reload destinations allocated on the compute stream (Rule 4)
  h2d_waits_d2h        side.wait_event(d2h done) before an H2D of bytes whose D2H compute has not
                       waited on yet (a copy shared by several saves, Rule 7; the two side streams)
Engine call sites (``site=``) of ``wait``, ``record_consumer``, ``release_after``:
  compute_waits_copy   _copies._wait: compute.wait_event(done) before a reload is read (Rule 4)
  stall_waits_copy     _copies._wait, the timed branch (the copy not done yet): the same wait
  record_stream        _backward._rebuild: record_stream for a reload read on another stream (Rule 4)
  reused_source_record_stream  _backward._reload: the same for a reused in-flight source
  stash_release_waits_copy     _schedule._Schedule: producer.wait_event(done) before an in-flight
                       source leaves the list of copies in flight (Rule 2)
  consumed_source_record_stream  _schedule._Schedule.consumed: record_stream(d2h side stream) on a
                       source backward used as it is while its D2H still runs, before it is dropped
                       (Rule 2: the allocator reuses its block only once the copy is done)
  unused_prefetch_release_waits_copy  _backward._end_pass: allocation stream waits for a
                       prefetch never consumed in its pass before it is dropped (Rule 4)
  dropped_prefetch_release_waits_copy  _handles._HostCopy.__del__: the same for a prefetch
                       whose handles died unconsumed during the pass (Rule 4)
Elsewhere:
  disk_write_waits_copy  disk.DiskStore._write: the writer thread synchronizes on the D2H into
                       the staging buffer before it reads the bytes for the file
  verify_host_after_copy _verify.check_reload, on a mismatch: the host synchronizes on the reload's
                       copy before it sums the host copy (to name the side that differed)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

_perf_counter = time.perf_counter

__all__ = ["Copy", "SyncBackend", "StreamBackend", "make_backend"]

FAULT_NAMES = ("d2h_waits_producer", "h2d_waits_compute", "copy_event", "live_current_stream",
               "compute_outside_side", "h2d_alloc_on_compute", "h2d_waits_d2h", "compute_waits_copy", "stall_waits_copy",
               "record_stream", "reused_source_record_stream", "stash_release_waits_copy",
               "consumed_source_record_stream",
               "unused_prefetch_release_waits_copy", "dropped_prefetch_release_waits_copy",
               "disk_write_waits_copy", "verify_host_after_copy")
_FAULTS: set[str] = set()
"""Ordering calls switched off (NOTE [ Ordering faults ]): only offload.testing.inject_fault adds to it."""
_DEVICE_MODULES: list[tuple[str, object]] = []
"""(device type, module) pairs standing in for ``torch.<type>`` in backends built from now on, innermost
last: offload.testing.EmulatedAccelerator registers itself for "cpu" while it is entered."""


@dataclass(eq=False, slots=True)
class Copy:
    """One issued copy: its completion event (None when synchronous) and timing."""

    done: object | None
    """Event recorded after the copy on the side stream; None for synchronous copies."""
    seconds: float | None = None
    """Measured duration when known at issue time (synchronous backend)."""
    start: object | None = None
    """Timing event recorded before the copy (stream backend, when timing is on)."""
    stream: object | None = None
    """For H2D: the stream the destination was allocated on."""

    def query(self) -> bool:
        return self.done is None or self.done.query()

    def elapsed(self) -> float | None:
        """Seconds the copy took, once known."""
        if self.seconds is not None:
            return self.seconds
        if self.start is not None and self.done is not None and self.done.query():
            self.seconds = self.start.elapsed_time(self.done) / 1e3
        return self.seconds


class SyncBackend:
    """Plain blocking copies on the current stream (CPU, or streams turned off)."""

    name = "sync"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host_device = device.type == "cpu"  # a reload is a clone (one op, not an allocation and a copy)

    def current_stream(self):
        return None

    def d2h(self, src: torch.Tensor, dst: torch.Tensor) -> Copy:
        return Copy(None, self.d2h_seconds(src, dst))

    def d2h_seconds(self, src: torch.Tensor, dst: torch.Tensor) -> float:
        """``d2h`` returning only the copy's duration (the engine's per-tensor path)."""
        t0 = _perf_counter()
        dst.copy_(src)
        return _perf_counter() - t0

    def h2d(self, src: torch.Tensor, after: Copy | None = None,
            pinned: bool | None = None) -> tuple[torch.Tensor, Copy]:
        t0 = _perf_counter()
        if self._host_device:
            out = src.clone()  # (flat bytes, or a whole tensor: _Copies._load)
        else:
            out = torch.empty_like(src, device=self.device)
            out.copy_(src)
        return out, Copy(None, _perf_counter() - t0)

    def wait(self, copy: Copy, site: str) -> None:
        pass

    def release_after(self, copy: Copy, producer_stream, site: str) -> None:
        pass

    def record_consumer(self, t: torch.Tensor, copy: Copy, site: str) -> None:
        pass

    def keep_for_copy(self, t: torch.Tensor, copy: Copy, site: str) -> None:
        pass


def _device_module(device: torch.device):
    for dev_type, mod in reversed(_DEVICE_MODULES):
        if dev_type == device.type:
            return mod
    return torch.get_device_module(device.type)


class StreamBackend:
    """Async copies on one side stream per engine, ordered with events."""

    name = "stream"

    def __init__(self, device: torch.device, *, timing: bool = True, module: object | None = None) -> None:
        self.device = device
        self.timing = timing
        # The device module: torch.cuda (torch.xpu, ...), or a stand-in with its surface
        # (offload.testing.EmulatedAccelerator) passed here or registered in _DEVICE_MODULES.
        self._mod = module if module is not None else _device_module(device)
        self._sides: dict[str, object] = {}  # "d2h" / "h2d" -> its side stream, made on first use
        self._cached = None  # only for the live_current_stream fault
        # A stand-in device module may want to know which tensors are host memory (the
        # emulator: their reuse is deferred by events, as torch's pinned allocator does).
        self._host = getattr(self._mod, "_host_memory", None)
        self._record_ok: bool | None = None  # record_stream works on this device's tensors (keep_for_copy)
        self.memory_stats = self._memory_stats_fn()
        """``() -> (allocated bytes, their peak)`` of the device's allocator (host-side counters, no
        synchronization), or None where the device module has none (NOTE [ Copy schedule ])."""

    # The device module (torch.cuda, torch.xpu, ...) is used for streams and
    # events rather than the generic torch.Stream/torch.Event: its Stream,
    # Event and stream() context interoperate on every torch >= 2.4, while
    # mixing generic and device-specific objects does not.

    def _memory_stats_fn(self):
        mod = self._mod
        if mod is torch.cuda:
            from ._torch_private import cuda_allocated_and_peak

            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return lambda: cuda_allocated_and_peak(index)
        allocated = getattr(mod, "memory_allocated", None)
        peak = getattr(mod, "max_memory_allocated", None)
        if allocated is None or peak is None:
            return None
        device = self.device
        return lambda: (int(allocated(device)), int(peak(device)))

    def _side_stream(self, direction: str):
        """The side stream of copies in ``direction`` ("d2h" or "h2d"), on the right device."""
        s = self._sides.get(direction)
        if s is None:
            s = self._sides[direction] = self._mod.Stream(device=self.device)
        return s

    def current_stream(self):
        """The live compute stream (Rule 3: looked up at every call, never cached)."""
        if _FAULTS and "live_current_stream" in _FAULTS:
            if self._cached is None:
                self._cached = self._mod.current_stream(self.device)
            return self._cached
        return self._mod.current_stream(self.device)

    def _event(self):
        return self._mod.Event(enable_timing=self.timing)

    def _issue(self, fn, wait_fault: str, direction: str, after: Copy | None = None) -> Copy:
        """Run ``fn`` (one copy) on ``direction``'s side stream, ordered after the live compute stream
        (and after ``after``, a copy on another side stream, when given)."""
        side = self._side_stream(direction)
        compute = self.current_stream()
        if not (_FAULTS and wait_fault in _FAULTS):
            side.wait_stream(compute)
        if after is not None and after.done is not None and not (_FAULTS and "h2d_waits_d2h" in _FAULTS):
            side.wait_event(after.done)
        start = None
        with self._mod.stream(side):
            if _FAULTS and "compute_outside_side" in _FAULTS:
                compute = self.current_stream()  # torchtitan #2581: this is the side stream
            if self.timing:
                start = self._event()
                start.record(side)
            fn()
            done = self._event()
            if not (_FAULTS and "copy_event" in _FAULTS):
                done.record(side)
        return Copy(done, None, start, compute)

    def d2h(self, src: torch.Tensor, dst: torch.Tensor) -> Copy:
        if self._host is not None:
            self._host(dst)
        return self._issue(lambda: dst.copy_(src, non_blocking=True), "d2h_waits_producer", "d2h")

    def h2d(self, src: torch.Tensor, after: Copy | None = None,
            pinned: bool | None = None) -> tuple[torch.Tensor, Copy]:
        """Copy ``src`` (contiguous) to a new device tensor of its dtype and shape; ``after``: the D2H
        that wrote ``src``, when compute has not waited on it yet; ``pinned``: whether ``src`` is
        page-locked, when the caller knows (else ``src.is_pinned()`` asks the driver: a
        ``cudaPointerGetAttributes`` per reload)."""
        if self._host is not None:
            self._host(src)
        non_blocking = src.is_pinned() if pinned is None else pinned
        if _FAULTS and "h2d_alloc_on_compute" in _FAULTS:
            side = self._side_stream("h2d")
            with self._mod.stream(side):
                out = torch.empty_like(src, device=self.device)
            # The engine still believes the block is the compute stream's (the bug: Rule 4).
            return out, self._issue(lambda: out.copy_(src, non_blocking=non_blocking), "h2d_waits_compute",
                                    "h2d", after)
        # Allocate on the compute stream (outside the side-stream context): Rule 4.
        out = torch.empty_like(src, device=self.device)
        return out, self._issue(lambda: out.copy_(src, non_blocking=non_blocking), "h2d_waits_compute",
                                "h2d", after)

    def wait(self, copy: Copy, site: str) -> None:
        """Make the live compute stream wait for ``copy`` (Rule 4). ``site``: the caller's fault name."""
        if copy.done is not None and not (_FAULTS and site in _FAULTS):
            self.current_stream().wait_event(copy.done)

    def keep_for_copy(self, t: torch.Tensor, copy: Copy, site: str) -> None:
        """Rule 2: ``copy`` (a D2H on the side stream) may still read ``t``: the allocator reuses its block,
        once freed, only after the work queued there now is done, so nothing waits. Where the device's
        tensors take no ``record_stream`` (a stand-in device without a dispatch mode), the producer stream
        waits on the copy instead. ``site``: the fault name."""
        if _FAULTS and site in _FAULTS:
            return
        if self._record_ok is not False:
            try:
                t.record_stream(self._side_stream("d2h"))
                self._record_ok = True
                return
            except (NotImplementedError, RuntimeError):
                if self._record_ok:
                    raise
                self._record_ok = False
        self.release_after(copy, copy.stream, site)

    def record_consumer(self, t: torch.Tensor, copy: Copy, site: str) -> None:
        """Rule 4: ``t`` (allocated on ``copy.stream``) is read on the live stream: tell the allocator.
        ``site``: the caller's fault name."""
        consumer = self.current_stream()
        if copy.stream is not None and consumer != copy.stream and not (_FAULTS and site in _FAULTS):
            t.record_stream(consumer)

    def release_after(self, copy: Copy, producer_stream, site: str) -> None:
        """Order the producer stream after ``copy`` before the source block can be reused.

        The source was allocated on ``producer_stream``; once that stream waits on
        the copy's event, any later reuse of the freed block by the allocator is
        queued behind the copy, so the Python reference can be dropped without a
        host synchronize (Rule 2). ``site``: the caller's fault name.
        """
        if copy.done is not None and producer_stream is not None and not (_FAULTS and site in _FAULTS):
            producer_stream.wait_event(copy.done)


def make_backend(device: torch.device, use_streams: bool, *, timing: bool = True) -> SyncBackend | StreamBackend:
    """Streams for an accelerator when asked for; synchronous copies otherwise."""
    mod = _device_module(device) if hasattr(torch, device.type) else None
    stand_in = mod is not None and mod is not getattr(torch, device.type)
    if use_streams and (device.type != "cpu" or stand_in) and all(
        hasattr(mod, n) for n in ("Stream", "Event", "stream", "current_stream")
    ):
        return StreamBackend(device, timing=timing, module=mod)
    return SyncBackend(device)
