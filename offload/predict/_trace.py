"""The trace a predicted step is made of: what the host issued, in program order.

This is the contract between the three prediction layers (DESIGN.md, "Prediction"):

1. **Trace** (``_capture``): the user's step and the real engine run on fake tensors with the
   emulated accelerator's streams; every aten op, allocation, free, copy, event record, wait
   and host synchronize lands here, in the order the host issued it.
2. **Costs** (``_cost``): a :class:`~offload.predict.gpus.GPUSpec` turns each ``Kernel`` into
   device seconds and each host-side item into host seconds.
3. **Replay** (``_memory`` in program order, ``_timeline`` on a clock): streams run their queues
   in order, waits make dependencies, the allocator model frees blocks in stream order.

Streams are small ints (0 is the compute stream the step starts on); events and blocks are ints
unique within one trace. Every item is frozen; a trace is a plain list in issue order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Kernel", "Copy", "RecordEvent", "WaitEvent", "HostSync", "HostWork", "Alloc", "Free",
           "RecordStream", "Trace", "Item", "COMPUTE_STREAM"]

COMPUTE_STREAM = 0
"""The stream the step starts on (the default stream)."""


@dataclass(frozen=True, slots=True)
class Kernel:
    """A device op queued on ``stream`` (an aten op that is not a view or metadata-only)."""

    stream: int
    op: str
    """aten overload name, e.g. ``aten.mm.default``."""
    flops: int
    """Floating-point operations (torch.utils.flop_counter's count; 0 for non-matmul ops)."""
    bytes: int
    """Device memory read plus written, bytes."""
    dtype: torch.dtype | None
    """The dtype that sets the FLOP rate (the first floating input's)."""
    module: str = ""
    """FQN of the innermost module running it ('' outside any)."""
    phase: str = "forward"
    """'forward', 'backward', 'optimizer' or 'other'."""
    blocks: tuple[int, ...] = ()
    """Allocator blocks it reads or writes (for stream-ordered frees)."""


@dataclass(frozen=True, slots=True)
class Copy:
    """A host<->device copy queued on ``stream``."""

    stream: int
    direction: str
    """'d2h' or 'h2d'."""
    nbytes: int
    pinned: bool
    """Host side is page-locked (async); a pageable copy also blocks the host."""
    module: str = ""
    phase: str = "forward"
    blocks: tuple[int, ...] = ()
    """Device blocks it reads (d2h) or writes (h2d)."""
    host: int = -1
    """The host buffer it writes (d2h) or reads (h2d), unique within the trace: links a reload to
    its offload (-1: unknown)."""


@dataclass(frozen=True, slots=True)
class RecordEvent:
    """``event`` marks the current end of ``stream``'s queue."""

    stream: int
    event: int


@dataclass(frozen=True, slots=True)
class WaitEvent:
    """``stream`` runs nothing queued after this until ``event``'s work is done."""

    stream: int
    event: int
    why: str = ""
    """What the wait is for, for stall labels: 'use' (a copy's bytes are read next), 'free' (a
    block can be freed or reused after it), 'order' (stream order only), or '' (unknown)."""


@dataclass(frozen=True, slots=True)
class HostSync:
    """The host blocks until a device point: ``kind`` 'event' (``target`` an event), 'stream'
    (``target`` a stream), 'device' (every stream) or 'item' (a value read back: the compute
    stream, e.g. ``loss.item()``)."""

    kind: str
    target: int | None = None
    why: str = ""
    """What asked for it (e.g. 'disk writer wait', 'verify'), for stall labels."""


@dataclass(frozen=True, slots=True)
class HostWork:
    """Host time that issues nothing: a hook's Python cost, a pinned allocation, a disk write."""

    seconds: float
    what: str


@dataclass(frozen=True, slots=True)
class Alloc:
    """The caching allocator hands out ``block`` (``nbytes`` requested) on ``stream``."""

    block: int
    nbytes: int
    stream: int
    category: str
    """'parameter', 'gradient', 'optimizer', 'activation', 'copy' (an in-flight reload) or 'other'."""
    module: str = ""


@dataclass(frozen=True, slots=True)
class Free:
    """The host drops ``block``'s last reference: it goes back to the allocator once every stream
    recorded on it (``RecordStream``) has finished the work queued on it up to this point."""

    block: int


@dataclass(frozen=True, slots=True)
class RecordStream:
    """``Tensor.record_stream(stream)``: ``block`` is in use on ``stream`` too."""

    block: int
    stream: int


Item = Kernel | Copy | RecordEvent | WaitEvent | HostSync | HostWork | Alloc | Free | RecordStream


@dataclass
class Trace:
    """The items of one step in issue order, and what the capture knew about them."""

    items: list[Item] = field(default_factory=list)
    streams: dict[int, str] = field(default_factory=lambda: {COMPUTE_STREAM: "compute"})
    """Stream id -> name ('compute', 'offload d2h', ...)."""
    notes: dict[str, str] = field(default_factory=dict)
    """Assumptions the capture made (attention kernel, optimizer, ...), for the report."""

    def append(self, item: Item) -> None:
        self.items.append(item)
