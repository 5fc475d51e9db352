"""The happens-before checker: PyTorch's CUDA sanitizer core fed from CPU ops, plus frees.

``torch.cuda._sanitizer.EventHandler`` (the core of ``TORCH_CUDA_SANITIZER=1``)
is device-agnostic: it takes stream ids, event ids and data pointers. This
module feeds it every aten op the emulator sees (keyed by *storage*, so two
views of one storage conflict), and adds what it lacks:

* **Frees.** The CUDA caching allocator hands a freed block to the next
  allocation on the block's *allocation stream* at once, unless
  ``record_stream`` named another stream. So when the last reference to a
  storage drops, every access to it on another stream must already be ordered
  before the allocation stream's current position (a wait on an event, a
  synchronize), or be on a stream ``record_stream`` named. Otherwise the
  block may be overwritten while the access is still queued: the deletion
  race of torchtune #1867. The sanitizer itself only forgets the pointer.
* **Reports** that name both sides by stream *name* and keep the sanitizer's
  own text (operators, argument names, Python stacks, allocation stack).
"""

from __future__ import annotations

import bisect
import inspect
import threading
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .._torch_private import sanitizer_core

# PyTorch's CUDA sanitizer core, loaded without activating the GPU trace (no Python callback on
# CUDA's allocator or events: offload._torch_private.sanitizer_core says why).
_sanitizer = sanitizer_core()
FACTORY_FUNCTION_REGEX = _sanitizer.FACTORY_FUNCTION_REGEX
Access = _sanitizer.Access
AccessType = _sanitizer.AccessType
ArgumentHandler = _sanitizer.ArgumentHandler
EventHandler = _sanitizer.EventHandler
SynchronizationError = _sanitizer.SynchronizationError
TensorInfo = _sanitizer.TensorInfo
UnsynchronizedAccessError = _sanitizer.UnsynchronizedAccessError

__all__ = ["Hazard", "HazardError", "Checker", "FreeBeforeAccessError"]

aten = torch.ops.aten


def _stack() -> traceback.StackSummary:
    """The caller's Python stack, outermost first (as the sanitizer captures it)."""
    s = _FastStackSummary.extract(traceback.walk_stack(inspect.currentframe()))
    s.reverse()
    return s


class _FastStackSummary(traceback.StackSummary):
    """``StackSummary.extract`` without linecache (no ``os.stat`` per file per op): lines are read
    when a report is formatted. A third of the checker's cost per op otherwise."""

    @classmethod
    def extract(klass, frame_gen, *, limit=None, lookup_lines=True, capture_locals=False):  # noqa: N804
        out = klass()
        append = out.append
        summary = traceback.FrameSummary
        for f, lineno in frame_gen:
            append(summary(f.f_code.co_filename, lineno, f.f_code.co_name, lookup_line=False))
        return out


class _FastTraceback:
    """What ``torch.cuda._sanitizer`` sees as its ``traceback`` module while a checker is active:
    the same API, a cheaper ``StackSummary.extract`` (see ``_FastStackSummary``)."""

    StackSummary = _FastStackSummary
    walk_stack = staticmethod(traceback.walk_stack)


_fast_users = [0]
_fast_lock = threading.Lock()


def _use_fast_stacks(on: bool) -> None:
    """Swap the sanitizer module's ``traceback`` for ``_FastTraceback`` while any checker is entered."""
    sanitizer = _sanitizer

    with _fast_lock:
        _fast_users[0] += 1 if on else -1
        if on and _fast_users[0] == 1:
            sanitizer.traceback = _FastTraceback  # type: ignore[assignment]
        elif not on and _fast_users[0] == 0:
            sanitizer.traceback = traceback


_MACHINERY = ("offload/testing/", "torch/utils/_python_dispatch", "torch/_compile.py", "torch/_dynamo/",
              "torch/cuda/_sanitizer.py")
"""Frames of the checker's own machinery, left out of reports."""
_FRAMES = 16
"""Innermost frames shown per stack in a report."""


def _user_frames(stack: traceback.StackSummary | None) -> str:
    """A stack without the frames of torch's dispatch machinery and of this package."""
    if not stack:
        return "    (no stack recorded)\n"
    keep = [f for f in stack if not any(m in f.filename.replace("\\", "/") for m in _MACHINERY)]
    keep = (keep or list(stack))[-_FRAMES:]
    return "".join(traceback.StackSummary.from_list(keep).format())


class FreeBeforeAccessError(SynchronizationError):
    """A storage freed while an access to it on another stream was not ordered before the free."""

    def __init__(self, data_ptr: int, allocation_stack_trace: traceback.StackSummary | None,
                 alloc_stream: int, free_stack: traceback.StackSummary, access: Access) -> None:
        self.data_ptr = data_ptr
        self.allocation_stack_trace = allocation_stack_trace
        self.alloc_stream = alloc_stream
        self.free_stack = free_stack
        self.access = access


@dataclass
class Hazard:
    """One ordering error: two accesses (or an access and a free) on different streams, unordered."""

    kind: str
    """``"unordered access"`` (two accesses, one a write) or ``"free before access"``."""
    data_ptr: int
    """Data pointer of the storage both touch."""
    streams: tuple[str, str]
    """Names of the streams of (the later event, the earlier access)."""
    ops: tuple[str, str]
    """Operators of (the later event, the earlier access); ``"free"`` for a free."""
    error: SynchronizationError = field(repr=False)
    """The sanitizer's error object (``current_access`` / ``previous_access`` and stacks)."""

    def __str__(self) -> str:
        e = self.error
        if isinstance(e, UnsynchronizedAccessError):
            cur, prev = e.current_access, e.previous_access
            return (
                f"offload.testing: unordered access on storage {self.data_ptr:#x}: stream "
                f"{self.streams[0]!r} {cur.type} it in\n    {cur.operator}\nwith no wait on stream "
                f"{self.streams[1]!r}, which earlier was {prev.type} it in\n    {prev.operator}\n"
                f"-- stack of the later access (stream {self.streams[0]!r}):\n{_user_frames(cur.stack_trace)}"
                f"-- stack of the earlier access (stream {self.streams[1]!r}):\n{_user_frames(prev.stack_trace)}"
                f"-- allocation stack:\n{_user_frames(e.allocation_stack_trace)}"
            )
        assert isinstance(e, FreeBeforeAccessError)
        a = e.access
        return (
            f"offload.testing: storage {self.data_ptr:#x} allocated on stream {self.streams[0]!r} was freed "
            f"(its last reference dropped) while stream {self.streams[1]!r} {a.type} it in\n    {a.operator}\n"
            f"was not ordered before the free (no wait of stream {self.streams[0]!r} on it, no host "
            f"synchronize, no record_stream({self.streams[1]!r})): the allocator may hand the block out "
            f"again while that access is still queued.\n"
            f"-- stack of the free:\n{_user_frames(e.free_stack)}"
            f"-- stack of the access (stream {self.streams[1]!r}):\n{_user_frames(a.stack_trace)}"
            f"-- allocation stack:\n{_user_frames(e.allocation_stack_trace)}"
        )


class HazardError(AssertionError):
    """Raised by ``EmulatedAccelerator.assert_no_hazards`` (and at once with ``raise_on_hazard=True``)."""

    def __init__(self, hazards: list[Hazard], total: int | None = None) -> None:
        self.hazards = hazards
        n = total if total is not None else len(hazards)
        super().__init__(
            f"offload.testing: {n} stream-ordering hazard(s); the first:\n{hazards[0]}" if hazards else "no hazards"
        )


class _Args(ArgumentHandler):
    """The sanitizer's argument parser for CPU tensors, keyed by storage (it skips non-CUDA tensors).

    Host buffers (storages in ``host``) are not keyed here: the engine's pool carves disjoint buffers
    out of one chunk, and copies into different buffers of one chunk on the two side streams touch no
    common byte, so each accessed view's byte range is kept (``host_views``) and the checker compares
    ranges (``Checker._segments``): views that overlap conflict wherever they start."""

    def __init__(self, host: set[int] | frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.host = host
        self.storages: dict[int, Any] = {}
        self.inputs: set[int] = set()
        self.host_views: list[tuple[int, int, int, bool, bool, str | None, bool]] = []
        """(storage pointer, first byte, end byte, is_write, metadata_only, name, is_output) per host view."""
        self._parsing_outputs = False

    def _handle_argument(self, value: Any, is_write: bool, metadata_only: bool, name: str | None = None,
                         is_output: bool = False) -> None:
        if type(value) is not torch.Tensor and not isinstance(value, torch.Tensor):
            return
        if value.device.type != "cpu" or value.layout is not torch.strided:
            return
        try:
            st = value.untyped_storage()
            ptr = st.data_ptr()
        except (RuntimeError, NotImplementedError):
            return
        if not ptr:
            return  # an empty storage: nothing to race on
        self.storages.setdefault(ptr, st)
        if not is_output:
            self.inputs.add(ptr)
        if ptr in self.host:
            start = value.data_ptr()
            span = 1 + sum((n - 1) * abs(s) for n, s in zip(value.shape, value.stride())) if value.numel() else 0
            self.host_views.append((ptr, start, start + span * value.element_size(), is_write, metadata_only,
                                    name, is_output))
            return
        self.add(ptr, is_write, metadata_only, name, is_output)

    def add(self, key: int, is_write: bool, metadata_only: bool, name: str | None, is_output: bool) -> None:
        """One access to what the sanitizer knows as ``key`` (a storage, or a byte range of a host buffer)."""
        if is_write:
            self.dataptrs_written.add(key)
        elif not metadata_only:
            self.dataptrs_read.add(key)
        aliases = self.tensor_aliases.setdefault(key, [])
        if name is not None:
            aliases.append(name)
        if is_output:
            self.outputs.add(key)


@dataclass(eq=False)
class _Live:
    """What the checker knows of one live storage."""

    ref: Any
    alloc_stream: int
    recorded: set[int] = field(default_factory=set)
    host: bool = False
    """Host memory: its reuse waits for the copies that used it (torch's pinned allocator)."""


class Checker:
    """Feeds one ``EventHandler`` and tracks frees; owned by an ``EmulatedAccelerator``."""

    def __init__(self, names: dict[int, str], *, raise_on_hazard: bool = False, max_hazards: int = 200) -> None:
        self.handler = EventHandler()
        self.names = names
        self.raise_on_hazard = raise_on_hazard
        self.max_hazards = max_hazards
        self.hazards: list[Hazard] = []
        self.count = 0
        self.ops = 0
        self._live: dict[int, _Live] = {}
        self._host: set[int] = set()  # storages marked host memory (host_memory): checked per byte range
        self._segs: dict[int, list[int]] = {}  # host storage -> the first bytes of its ranges (``_segments``)
        self._lock = threading.RLock()

    # -- streams and events (the sanitizer's trace callbacks) ----------------------

    def stream_created(self, sid: int) -> None:
        with self._lock:
            self.handler._handle_stream_creation(sid)

    def event_created(self, eid: int) -> None:
        with self._lock:
            self.handler._handle_event_creation(eid)

    def event_deleted(self, eid: int) -> None:
        with self._lock:
            if eid in self.handler.syncs.recorded_sync_states:
                self.handler._handle_event_deletion(eid)

    def event_recorded(self, eid: int, sid: int) -> None:
        with self._lock:
            self.handler._handle_event_record(eid, sid)

    def event_waited(self, eid: int, sid: int) -> None:
        with self._lock:
            self.handler._handle_event_wait(eid, sid)

    def stream_synchronized(self, sid: int) -> None:
        with self._lock:
            self.handler._handle_stream_synchronization(sid)

    def event_synchronized(self, eid: int) -> None:
        with self._lock:
            self.handler._handle_event_synchronization(eid)

    def device_synchronized(self) -> None:
        with self._lock:
            self.handler._handle_device_synchronization()

    # -- ops ------------------------------------------------------------------

    def parse_inputs(self, func: Any, args: tuple, kwargs: dict) -> _Args:
        h = _Args(self._host)
        h.parse_inputs(func._schema, args, kwargs, is_factory=bool(FACTORY_FUNCTION_REGEX.match(func._schema.name)))
        return h

    def launched(self, h: _Args, func: Any, outputs: Any, sid: int, metadata_only: bool = False) -> None:
        """Record one op issued on stream ``sid`` (after it was parsed and issued)."""
        schema = func._schema
        h.parse_outputs(schema, outputs, is_factory=bool(FACTORY_FUNCTION_REGEX.match(schema.name)))
        with self._lock:
            self.ops += 1
            for ptr, st in h.storages.items():
                self._track(ptr, st, sid, fresh=ptr not in h.inputs)
            storage_of: dict[int, int] = {}  # a host range's key -> its storage
            for ptr, start, end, is_write, meta, name, is_output in h.host_views:
                for key in self._segments(ptr, h.storages[ptr].nbytes(), start, end):
                    h.add(key, is_write, meta, name, is_output)
                    storage_of[key] = ptr
            if metadata_only:
                return  # set_, resize_ of an empty tensor, in-place views: no bytes touched
            errors = self.handler._handle_kernel_launch(
                sid, h.dataptrs_read - h.dataptrs_written, h.dataptrs_written, h.outputs, schema, h.tensor_aliases
            )
            seen = set()
            for e in errors:
                # One hazard per storage and earlier access: a view over several ranges conflicts once.
                ptr = storage_of.get(e.data_ptr, e.data_ptr)
                if (ptr, e.previous_access.seq_num) in seen:
                    continue
                seen.add((ptr, e.previous_access.seq_num))
                e.data_ptr = ptr
                self._report(Hazard("unordered access", ptr,
                                    (self._name(e.current_access.stream), self._name(e.previous_access.stream)),
                                    (str(e.current_access.operator.name), str(e.previous_access.operator.name)), e))

    def record_stream(self, t: torch.Tensor, sid: int) -> None:
        """``t.record_stream(stream)``: a free of ``t``'s storage waits for ``sid``'s work issued so far."""
        with self._lock:
            info = self._live_of(t, sid)
            if info is not None:
                info.recorded.add(sid)

    def host_memory(self, t: torch.Tensor) -> None:
        """``t``'s storage is a host buffer: its free is not checked (see ``_Live.host``)."""
        with self._lock:
            info = self._live_of(t, 0)
            if info is not None:
                info.host = True
                self._host.add(t.untyped_storage().data_ptr())

    def _live_of(self, t: torch.Tensor, sid: int) -> _Live | None:
        """What is known of ``t``'s storage, tracked from now on (seen on ``sid`` if new; lock held);
        None for a storage without bytes."""
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        if not ptr:
            return None
        self._track(ptr, st, sid, fresh=False)
        return self._live[ptr]

    # -- storages and frees -----------------------------------------------------

    def _track(self, ptr: int, st: Any, sid: int, *, fresh: bool) -> None:
        info = self._live.get(ptr)
        if info is not None and info.ref() is st:
            return
        if info is not None:  # a new storage at an address whose free was not seen
            self._forget(ptr)
        if fresh:
            self.handler._handle_memory_allocation(ptr)
        else:
            self.handler.tensors_accessed.ensure_tensor_does_not_exist(ptr)
            self.handler.tensors_accessed.create_tensor(ptr, None)
        # Storages keep their Python object while the C++ storage lives (PyObject
        # preservation), so the weak reference dies exactly when the storage is freed.
        ref = weakref.ref(st, lambda r, ptr=ptr: self._freed(ptr, r))
        # A storage first seen as an input came from before the checker: allocated on
        # the default stream, as far as anyone can tell.
        self._live[ptr] = _Live(ref, sid if fresh else 0, host=st.data_ptr() in self._host)

    def _segments(self, ptr: int, nbytes: int, start: int, end: int) -> list[int]:
        """The keys of host storage ``ptr``'s bytes ``[start, end)`` (lock held). The storage is cut into
        ranges at every accessed view's first and end byte, each known to the sanitizer by its first byte
        (the storage's own pointer for the first); a range cut in two gives both halves its accesses so
        far. An access touches every range it covers, so two views that share a byte share a range."""
        segs = self._segs.setdefault(ptr, [ptr])
        if start >= end:
            return []
        accesses = self.handler.tensors_accessed.accesses
        for x in (start, end):
            i = bisect.bisect_right(segs, x)
            if x < ptr + nbytes and segs[i - 1] != x:
                ta = accesses.get(segs[i - 1])
                if ta is not None:
                    accesses[x] = TensorInfo(ta.allocation_stack_trace, list(ta.reads), ta.write)
                segs.insert(i, x)
        return segs[bisect.bisect_left(segs, start):bisect.bisect_left(segs, end)]

    def _forget(self, ptr: int) -> None:
        self._live.pop(ptr, None)
        self._host.discard(ptr)
        for key in self._segs.pop(ptr, [ptr])[1:]:  # a host buffer's other ranges
            self.handler.tensors_accessed.accesses.pop(key, None)
        if ptr in self.handler.tensors_accessed.accesses:
            self.handler._handle_memory_deallocation(ptr)

    def _freed(self, ptr: int, ref: Any) -> None:
        with self._lock:
            info = self._live.get(ptr)
            if info is None or info.ref is not ref:
                return
            ta = self.handler.tensors_accessed.accesses.get(ptr)
            if ta is not None and not info.host:
                accesses = ([ta.write] if ta.write is not None else []) + list(ta.reads)
                free_stack = None
                for a in accesses:
                    if a.stream == info.alloc_stream or a.stream in info.recorded:
                        continue
                    if self.handler.syncs.is_ordered_after(info.alloc_stream, a.seq_num, a.stream):
                        continue
                    if free_stack is None:
                        free_stack = _stack()
                    e = FreeBeforeAccessError(ptr, ta.allocation_stack_trace, info.alloc_stream, free_stack, a)
                    self._report(Hazard("free before access", ptr,
                                        (self._name(info.alloc_stream), self._name(a.stream)),
                                        ("free", str(a.operator.name)), e))
                    break
            self._forget(ptr)

    # -- reports ------------------------------------------------------------------

    def _name(self, sid: int) -> str:
        return self.names.get(sid, f"stream {sid}")

    def _report(self, hazard: Hazard) -> None:
        self.count += 1
        if len(self.hazards) < self.max_hazards:
            self.hazards.append(hazard)
        if self.raise_on_hazard:
            raise HazardError([hazard])



