"""Copy backends: a side-stream backend for accelerators and a synchronous one.

Both move raw bytes between a device tensor and a host buffer; the engine
decides what to move and keeps everything alive for as long as the rules in
``engine.py`` (NOTE [ Offload lifetime rules ]) require.

Side-stream ordering (see Rules 2-4):
  * D2H: the side stream first waits on the *live* current stream, so the copy
    runs after the kernel that produced the tensor.
  * H2D: the destination is allocated on the live current (compute) stream,
    never on the side stream, so the caching allocator ties the block to the
    stream that will read it; the side stream waits on compute before writing
    (the block may have been freed by queued compute work), and compute waits
    on the copy's event before reading. If a later consumer runs on another
    stream, the engine calls ``record_stream`` for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

_perf_counter = time.perf_counter

__all__ = ["Copy", "SyncBackend", "StreamBackend", "make_backend"]


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

    def current_stream(self):
        return None

    def d2h(self, src: torch.Tensor, dst: torch.Tensor) -> Copy:
        return Copy(None, self.d2h_seconds(src, dst))

    def d2h_seconds(self, src: torch.Tensor, dst: torch.Tensor) -> float:
        """``d2h`` returning only the copy's duration (the engine's per-tensor path)."""
        t0 = _perf_counter()
        dst.copy_(src)
        return _perf_counter() - t0

    def h2d(self, src: torch.Tensor) -> tuple[torch.Tensor, Copy]:
        t0 = time.perf_counter()
        out = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
        out.copy_(src)
        return out, Copy(None, time.perf_counter() - t0)

    def wait(self, copy: Copy) -> None:
        pass

    def release_after(self, copy: Copy, producer_stream) -> None:
        pass


def _device_module(device: torch.device):
    return torch.get_device_module(device.type)


class StreamBackend:
    """Async copies on one side stream per engine, ordered with events."""

    name = "stream"

    def __init__(self, device: torch.device, *, timing: bool = True) -> None:
        self.device = device
        self.timing = timing
        self._mod = _device_module(device)
        self._side = None  # created lazily on first use, on the right device

    # The device module (torch.cuda, torch.xpu, ...) is used for streams and
    # events rather than the generic torch.Stream/torch.Event: its Stream,
    # Event and stream() context interoperate on every torch >= 2.4, while
    # mixing generic and device-specific objects does not.

    def _side_stream(self):
        if self._side is None:
            self._side = self._mod.Stream(device=self.device)
        return self._side

    def current_stream(self):
        """The live compute stream (Rule 3: looked up at every call, never cached)."""
        return self._mod.current_stream(self.device)

    def _event(self):
        return self._mod.Event(enable_timing=self.timing)

    def _issue(self, fn) -> Copy:
        """Run ``fn`` (one copy) on the side stream, ordered after the live compute stream."""
        side = self._side_stream()
        compute = self.current_stream()
        side.wait_stream(compute)
        start = None
        with self._mod.stream(side):
            if self.timing:
                start = self._event()
                start.record(side)
            fn()
            done = self._event()
            done.record(side)
        return Copy(done, None, start, compute)

    def d2h(self, src: torch.Tensor, dst: torch.Tensor) -> Copy:
        return self._issue(lambda: dst.copy_(src, non_blocking=True))

    def h2d(self, src: torch.Tensor) -> tuple[torch.Tensor, Copy]:
        # Allocate on the compute stream (outside the side-stream context): Rule 4.
        out = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
        return out, self._issue(lambda: out.copy_(src, non_blocking=src.is_pinned()))

    def wait(self, copy: Copy) -> None:
        """Make the live compute stream wait for ``copy`` (Rule 4)."""
        if copy.done is not None:
            self.current_stream().wait_event(copy.done)

    def release_after(self, copy: Copy, producer_stream) -> None:
        """Order the producer stream after ``copy`` before the source block can be reused.

        The source was allocated on ``producer_stream``; once that stream waits on
        the copy's event, any later reuse of the freed block by the allocator is
        queued behind the copy, so the Python reference can be dropped without a
        host synchronize (Rule 2).
        """
        if copy.done is not None and producer_stream is not None:
            producer_stream.wait_event(copy.done)


def make_backend(device: torch.device, use_streams: bool, *, timing: bool = True) -> SyncBackend | StreamBackend:
    """Streams for an accelerator when asked for; synchronous copies otherwise."""
    mod = getattr(torch, device.type, None)
    if use_streams and device.type != "cpu" and all(
        hasattr(mod, n) for n in ("Stream", "Event", "stream", "current_stream")
    ):
        return StreamBackend(device, timing=timing)
    return SyncBackend(device)
