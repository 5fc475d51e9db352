"""A model of the CUDA caching allocator's device memory: what a predicted step holds, and when.

NOTE [ Device memory model ]
1. Sizes. A request of ``n > 0`` bytes takes ``block_bytes(n)``: rounded up to a multiple of 512
   bytes (``kMinBlockSize`` in c10/cuda/CUDACachingAllocator.cpp), so at least 512; a request of 0
   bytes takes no block (the allocator returns a null pointer). Large requests are rounded the same
   way for *allocated* bytes; the 2 MiB / 20 MiB segments they are carved from count in *reserved*
   memory, which this model does not predict (fragmentation beyond rounding is not modelled).
2. Stream order. A block is handed out on one stream. ``record_stream(block, s)`` says another
   stream uses it too. When the host frees a block that another stream may still be using, the
   allocator cannot reuse it until that stream's work queued before the free is done (it records an
   event and checks it at later allocations): the block is *held*. torch's ``memory_allocated`` no
   longer counts a held block, but no allocation can use its bytes, so this model counts it in
   ``in_use`` (allocated + held) until it is released, and its peak is the peak of ``in_use``:
   a slow copy shows up in the peak. ``peak_allocated_bytes`` is the peak of allocated bytes alone
   (what ``torch.cuda.max_memory_allocated`` reports).
3. Clock. Every call takes an optional time ``now`` (seconds on the step's clock, non-decreasing);
   ``free(block, now=t, release_at=r)`` holds the block until ``r`` (a timeline replay knows when
   the recorded streams' work is done; ``None``: released at once). ``advance(t)`` releases what is
   due by ``t``; every call advances first. Without a clock (program order), ``replay`` holds a
   block freed with pending uses on another stream until the next host synchronization that
   orders the host after that stream (an upper bound).

Interface for a timeline replay (``offload.predict._timeline``): build ``DeviceMemory()``, call
``alloc``, ``record_stream``, ``free`` and ``advance`` with clock times as the replay reaches each
trace item (``Alloc``, ``RecordStream``, ``Free``) and as held blocks become free; read ``peak_bytes``,
``peak_time`` and ``breakdown_at_peak()``.

Categories (``_trace.Alloc.category``): parameter, gradient, optimizer, activation, copy (a reloaded
activation), kv_cache (a KV cache the model returned), logits (logits-shaped tensors outside the model's
modules: the loss and the logits' gradients), other (the step's inputs, gradients between modules in
backward, the optimizer step's temporaries). Activations are also counted by the module that allocated them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._trace import Alloc, Free, HostSync, Item, RecordStream, Trace

__all__ = ["MIN_BLOCK_BYTES", "CATEGORIES", "block_bytes", "DeviceMemory", "replay", "Replay"]

MIN_BLOCK_BYTES = 512
"""The caching allocator's rounding (``kMinBlockSize``): every block is a multiple of it."""
CATEGORIES = ("parameter", "gradient", "optimizer", "activation", "copy", "kv_cache", "logits", "other")
"""What a device block holds (NOTE [ Capture ] items 5, 8, 9 in ``_capture.py``)."""


def block_bytes(nbytes: int, round_bytes: int = MIN_BLOCK_BYTES) -> int:
    """Bytes the caching allocator hands out for a request of ``nbytes`` (0 for an empty request)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // round_bytes) * round_bytes


@dataclass(slots=True)
class _Block:
    size: int
    category: str
    module: str
    stream: int
    streams: set[int] | None = None
    """Other streams recorded on it (``record_stream``)."""
    held_until: float | None = None
    """Freed but held (stream order) until this time; None while allocated."""


class DeviceMemory:
    """Allocated and held device bytes over a step, by category, with the peak and what it is made of.

    ``round_bytes`` is the allocator's block granularity (512 on CUDA; 1 counts exact bytes, as
    torch's MemTracker does for CPU tensors). See NOTE [ Device memory model ]."""

    def __init__(self, *, round_bytes: int = MIN_BLOCK_BYTES) -> None:
        self.round_bytes = round_bytes
        self.blocks: dict[int, _Block] = {}
        self.allocated_bytes = 0
        self.held_bytes = 0
        self.peak_bytes = 0
        """Peak of allocated + held bytes."""
        self.peak_allocated_bytes = 0
        self.peak_allocated_bytes_less_gradients = 0
        """Peak of allocated bytes other than gradients: with every gradient allocated before the step (a
        loop that zeroes them in place, as the bench does), the step's peak is this plus all gradients."""
        self.peak_time: float | None = None
        self.cursor = -1
        """The caller's position (``replay``: the trace item being applied), remembered at the peak."""
        self.peak_item = -1
        """``cursor`` when the peak was reached (``replay``: the index of the item that reached it)."""
        self._now = 0.0
        self._by_cat = dict.fromkeys(CATEGORIES, 0)
        self._act_by_module: dict[str, int] = {}
        self._peak_snapshot: tuple[dict[str, int], dict[str, int], int] = (dict(self._by_cat), {}, 0)

    @property
    def in_use_bytes(self) -> int:
        """Allocated plus held bytes now."""
        return self.allocated_bytes + self.held_bytes

    def alloc(self, block: int, nbytes: int, *, category: str = "other", module: str = "", stream: int = 0,
              now: float | None = None) -> int:
        """Hand out ``block`` for a request of ``nbytes``; returns the bytes it takes."""
        self.advance(now)
        if block in self.blocks:
            raise ValueError(f"offload.predict: block {block} allocated twice (a trace bug, please report)")
        if category not in self._by_cat:
            raise ValueError(f"offload.predict: category={category!r} is not one of {CATEGORIES}")
        size = block_bytes(nbytes, self.round_bytes)
        self.blocks[block] = _Block(size, category, module, stream)
        self.allocated_bytes += size
        self._by_cat[category] += size
        if category == "activation":
            self._act_by_module[module] = self._act_by_module.get(module, 0) + size
        self._note_peak()
        return size

    def record_stream(self, block: int, stream: int) -> None:
        """``block`` is used on ``stream`` too (``Tensor.record_stream``)."""
        b = self.blocks.get(block)
        if b is not None and stream != b.stream:
            if b.streams is None:
                b.streams = set()
            b.streams.add(stream)

    def pending_streams(self, block: int) -> set[int]:
        """Streams other than its own recorded on ``block`` (a free must wait for them)."""
        b = self.blocks.get(block)
        return set(b.streams) if b is not None and b.streams else set()

    def free(self, block: int, *, now: float | None = None, release_at: float | None = None) -> None:
        """The host drops ``block``: released at once, or held until ``release_at`` (stream order)."""
        self.advance(now)
        b = self.blocks.get(block)
        if b is None or b.held_until is not None:
            return  # never allocated on the device (a host buffer, an empty request) or freed already
        self.allocated_bytes -= b.size
        if release_at is not None and release_at > self._now:
            b.held_until = release_at
            self.held_bytes += b.size
        else:
            self._release(block, b)
        self._note_peak()

    def hold(self, block: int) -> None:
        """Free ``block`` but hold it until ``release(block)`` (program-order replay: the time is unknown)."""
        self.free(block, release_at=float("inf"))

    def release(self, block: int) -> None:
        """Release a held block now."""
        b = self.blocks.get(block)
        if b is not None and b.held_until is not None:
            self.held_bytes -= b.size
            self._release(block, b)

    def advance(self, now: float | None) -> None:
        """Move the clock to ``now`` and release the held blocks that are due."""
        if now is None:
            return
        if now < self._now:
            raise ValueError(f"offload.predict: the memory clock went back from {self._now} to {now}")
        self._now = now
        if self.held_bytes:
            for block, b in list(self.blocks.items()):
                if b.held_until is not None and b.held_until <= now:
                    self.release(block)

    def _release(self, block: int, b: _Block) -> None:
        del self.blocks[block]
        self._by_cat[b.category] -= b.size
        if b.category == "activation":
            self._act_by_module[b.module] -= b.size

    def _note_peak(self) -> None:
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        rest = self.allocated_bytes - self._by_cat["gradient"]
        if rest > self.peak_allocated_bytes_less_gradients:
            self.peak_allocated_bytes_less_gradients = rest
        total = self.allocated_bytes + self.held_bytes
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_time = self._now
            self.peak_item = self.cursor
            acts = {m: n for m, n in self._act_by_module.items() if n}
            self._peak_snapshot = (dict(self._by_cat), acts, self.held_bytes)

    def breakdown_at_peak(self) -> dict[str, int]:
        """Bytes by category at the peak (``held``: freed blocks not yet released, counted in their
        category too), summing to ``peak_bytes``."""
        cats, _acts, held = self._peak_snapshot
        return {**cats, "held": held}

    def activations_at_peak(self) -> dict[str, int]:
        """Activation bytes live at the peak, by the module that allocated them."""
        return dict(self._peak_snapshot[1])


def replay(trace: Trace | list[Item], memory: DeviceMemory | None = None) -> DeviceMemory:
    """Run a trace's allocations and frees in program order (no clock): see NOTE [ Device memory model ]
    item 3. A block freed while another stream is recorded on it is held until a host synchronization
    that covers that stream (or the device)."""
    r = Replay(memory)
    for item in trace.items if isinstance(trace, Trace) else trace:
        r.feed(item)
    return r.memory


class Replay:
    """:func:`replay` one item at a time (the planner reads levels while a capture runs)."""

    def __init__(self, memory: DeviceMemory | None = None) -> None:
        self.memory = memory if memory is not None else DeviceMemory()
        self.held: dict[int, set[int]] = {}
        self.index = -1

    def feed(self, it: Item) -> None:
        mem, held = self.memory, self.held
        self.index += 1
        mem.cursor = self.index
        t = type(it)
        if t is Alloc:
            mem.alloc(it.block, it.nbytes, category=it.category, module=it.module, stream=it.stream)
        elif t is Free:
            streams = mem.pending_streams(it.block)
            if streams:
                mem.hold(it.block)
                held[it.block] = streams
            else:
                mem.free(it.block)
        elif t is RecordStream:
            mem.record_stream(it.block, it.stream)
        elif t is HostSync and held:
            for block, streams in list(held.items()):
                if it.kind == "device" or (it.kind == "stream" and it.target in streams and len(streams) == 1):
                    mem.release(block)
                    del held[block]
