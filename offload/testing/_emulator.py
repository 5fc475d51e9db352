"""EmulatedAccelerator: the stream and event surface of ``torch.cuda``, on CPU tensors, checked.

NOTE [ Emulated streams ]
An ``EmulatedAccelerator`` stands in for ``torch.cuda`` inside the engine's
``StreamBackend`` (``offload.streams``): while it is entered (``with acc:``),
engines built for ``device="cpu"`` get a stream backend whose streams, events
and ``stream()`` contexts are the emulator's, and a ``TorchDispatchMode`` sees
every aten op on the entering thread. Nothing in ``torch.cuda`` is patched.

1. Streams. ``Stream()`` makes a stream (a ``torch.Stream`` with its own id,
   so ``tensor.record_stream(s)`` reaches the mode); ``current_stream()`` is
   thread-local and changes inside ``with acc.stream(s)``, as CUDA's does.
2. Checking. Every op is attributed to the live current stream and fed to
   the sanitizer core (``offload.testing._checker``), with stream waits,
   event records and synchronizations: an access on one stream that
   conflicts with an access on another without a happens-before order is a
   ``Hazard``, and so is a free of a storage while an access on another
   stream is not ordered before it (and not covered by ``record_stream``).
3. Late data (``late=True``). Ops issued on a side stream (any stream but
   the default one and those made with ``Stream(late=False)``, and a stream
   parked with ``_sleep``, while the other streams then run as issued) are queued and run
   only when something orders after them: a ``wait_event``/``wait_stream``
   that reaches them, a ``synchronize``, an ``Event.query()`` after ``lag``
   polls, an op that needs a value on the host (``.item()``), or, with a
   ``seed``, at random points. Until then their outputs hold poison (0xFF
   bytes: NaN for floats), and so does every ``empty`` allocation, so a
   missing wait reads wrong bytes and a bitwise test fails even where the
   checker would be silent.
4. Events report "not done" for ``lag`` polls even in checking mode, so the
   engine's in-flight bookkeeping (stash, stall timing) takes its GPU paths.

What it cannot see: timing, real DMA engines, pinned-memory behaviour,
kernels that bypass the dispatcher (Inductor's generated kernels, C++ extensions),
and host reads of host memory are attributed to the current stream.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .. import streams as _streams
from ._aten_ops import (_EMPTY_OPS, _METADATA_OPS, _alias, _empty_like_meta, _host_visible, _mutated_returns,
                        _noop, _poison, _returns_tensors, _to_meta)
from ._checker import Checker, Hazard, HazardError, _use_fast_stacks

__all__ = ["EmulatedAccelerator", "EmulatedStream", "EmulatedEvent"]

aten = torch.ops.aten
_ids = itertools.count(1)
"""Stream and event ids, unique in the process (``torch.Stream`` compares ids)."""


class EmulatedEvent:
    """``torch.cuda.Event`` on an emulated accelerator."""

    def __init__(self, acc: "EmulatedAccelerator", enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.acc = acc
        self.id = next(_ids)
        self.stream: EmulatedStream | None = None
        self.index = 0
        self.polls = 0
        self.time: float | None = None
        acc._check("event_created", self.id)

    def record(self, stream: "EmulatedStream | None" = None) -> None:
        self.acc._record(self, stream if stream is not None else self.acc.current_stream())

    def query(self) -> bool:
        return self.acc._query(self)

    def synchronize(self) -> None:
        self.acc._sync_event(self)

    def wait(self, stream: "EmulatedStream | None" = None) -> None:
        (stream if stream is not None else self.acc.current_stream()).wait_event(self)

    def elapsed_time(self, end: "EmulatedEvent") -> float:
        if self.time is None or end.time is None:
            raise RuntimeError("offload.testing: elapsed_time on an event that was not recorded")
        end.synchronize()
        return max(end.time - self.time, 0.0) * 1e3

    def __del__(self) -> None:
        try:
            self.acc._check("event_deleted", self.id)
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"EmulatedEvent({self.id}, stream={self.stream.name if self.stream else None})"


class EmulatedStream(torch.Stream):
    """``torch.cuda.Stream`` on an emulated accelerator: a ``torch.Stream`` (CPU type) with its own id."""

    def __new__(cls, acc: "EmulatedAccelerator", sid: int, name: str) -> "EmulatedStream":
        return super().__new__(cls, stream_id=sid, device_type=0, device_index=0)

    def __init__(self, acc: "EmulatedAccelerator", sid: int, name: str) -> None:
        self.acc = acc
        self.id = sid
        self.name = name
        self.queue: deque[Callable[[], None]] = deque()
        self.issued = 0
        self.executed = 0
        self.running: int | None = None  # the thread running this stream's oldest queued op
        self.parked = False
        self.late = sid != 0

    def wait_event(self, event: EmulatedEvent) -> None:
        self.acc._wait(self, event)

    def wait_stream(self, stream: "EmulatedStream") -> None:
        ev = EmulatedEvent(self.acc)
        ev.record(stream)
        self.wait_event(ev)

    def record_event(self, event: EmulatedEvent | None = None) -> EmulatedEvent:
        event = event if event is not None else EmulatedEvent(self.acc)
        event.record(self)
        return event

    def query(self) -> bool:
        return self.executed >= self.issued

    def synchronize(self) -> None:
        self.acc._sync_stream(self)

    def __enter__(self) -> "EmulatedStream":
        self._cm = self.acc.stream(self)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)

    def __repr__(self) -> str:
        return f"EmulatedStream({self.name!r}, id={self.id})"


class _Mode(TorchDispatchMode):
    """Sees every aten op on the thread that entered the emulator."""

    def __init__(self, acc: "EmulatedAccelerator") -> None:
        super().__init__()
        self.acc = acc

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile compiles with this mode off and runs the compiled code under it (by default
        Dynamo falls back to eager under a dispatch mode): the ops of a graph that runs aten ops
        (``backend="aot_eager"``) are seen one by one; Inductor's own kernels are not."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.acc._dispatch(func, types, args, kwargs or {})


class EmulatedAccelerator:
    """An accelerator made of CPU tensors whose streams really order (or fail to order) work.

    Use it as a context manager around building and running an engine
    (``OffloadActivations(device="cpu")`` then gets the side-stream backend on
    this emulator), then call ``assert_no_hazards()``. See NOTE [ Emulated streams ].

    Args:
        late: queue side-stream work and run it only when something orders
            after it, with poison in its outputs until then (a missing wait
            changes bytes). False: every op runs when issued (checking only).
        seed: with ``late``, also run queued work at random points (a
            ``random.Random(seed)`` picks them: the same seed, the same schedule).
        lag: polls of ``Event.query()`` that report "not done" before it runs
            the event's work and reports done.
        check: feed the happens-before checker (off: only the stream semantics).
        raise_on_hazard: raise ``HazardError`` at the op that causes a hazard
            (frees are reported in ``hazards`` only: they happen in destructors).
        dispatch: see every aten op (a ``TorchDispatchMode``; ``torch.compile``
            compiles with it off and runs the compiled code under it). False:
            streams and events only, nothing checked or run late (instruction
            counts of the engine's own bookkeeping).
    """

    type = "cpu"

    def __init__(self, *, late: bool = False, seed: int | None = None, lag: int = 2, check: bool = True,
                 raise_on_hazard: bool = False, flush_probability: float = 0.2, dispatch: bool = True) -> None:
        if not isinstance(late, bool):
            raise TypeError(f"EmulatedAccelerator: late={late!r} must be True or False")
        if not isinstance(lag, int) or lag < 0:
            raise ValueError(f"EmulatedAccelerator: lag={lag!r} must be an int >= 0 (polls before an event is done)")
        if not dispatch and (late or check):
            raise ValueError("EmulatedAccelerator: dispatch=False sees no op, so it can neither check "
                             "(check=False) nor run work late (late=False); pass both as False")
        self.dispatch = dispatch
        self.late = late
        self.lag = lag
        self.seed = seed
        self.flush_probability = flush_probability
        self._rng = random.Random(seed) if (late and seed is not None) else None
        self.device = torch.device("cpu")
        self._names: dict[int, str] = {0: "default"}
        self.checker = Checker(self._names, raise_on_hazard=raise_on_hazard) if check else None
        self._lock = threading.RLock()
        self._ran = threading.Condition(self._lock)  # notified whenever a queued op finished running
        self._tls = threading.local()
        self._streams: list[EmulatedStream] = []
        self.default = EmulatedStream(self, 0, "default")
        self._streams.append(self.default)
        self._entered = 0
        self.flushes = 0
        """Queued ops run so far (late mode)."""

    # -- the torch.cuda surface the engine uses --------------------------------------

    def Stream(self, device: Any = None, priority: int = 0, *, late: bool = True,  # noqa: N802
               name: str | None = None) -> EmulatedStream:
        """A new stream. ``late=False``: its work runs when issued even in late mode (a compute
        stream of the test's own: only side streams should run late)."""
        sid = next(_ids)
        s = EmulatedStream(self, sid, name or f"stream{len(self._streams)}")
        s.late = late
        with self._lock:
            self._streams.append(s)
            self._names[sid] = s.name
        self._check("stream_created", sid)
        return s

    def Event(self, enable_timing: bool = False, blocking: bool = False,  # noqa: N802
              interprocess: bool = False) -> EmulatedEvent:
        return EmulatedEvent(self, enable_timing, blocking, interprocess)

    def current_stream(self, device: Any = None) -> EmulatedStream:
        return getattr(self._tls, "current", None) or self.default

    def default_stream(self, device: Any = None) -> EmulatedStream:
        return self.default

    def set_stream(self, stream: EmulatedStream) -> None:
        self._tls.current = stream

    @contextmanager
    def stream(self, stream: EmulatedStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        prev = self.current_stream()
        self._tls.current = stream
        try:
            yield
        finally:
            self._tls.current = prev

    def synchronize(self, device: Any = None) -> None:
        for s in list(self._streams):
            self._flush(s, s.issued)
        self._check("device_synchronized")

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def _host_memory(self, t: torch.Tensor) -> None:
        """``t`` is a host buffer (the engine's backend says so): frees of host memory are not checked,
        as torch's pinned allocator defers their reuse until the copies that used them are done."""
        if self.checker is not None:
            self.checker.host_memory(t)

    def _sleep(self, cycles: int = 0) -> None:
        """``torch.cuda._sleep``: park the current stream; with ``late`` its next ops wait until ordered."""
        self.current_stream().parked = True

    # -- activation -------------------------------------------------------------

    def __enter__(self) -> "EmulatedAccelerator":
        modes = getattr(self._tls, "modes", None)
        if modes is None:
            modes = self._tls.modes = []
        mode = _Mode(self) if self.dispatch else None
        if mode is not None:
            mode.__enter__()
        modes.append(mode)
        if self.checker is not None:
            _use_fast_stacks(True)
        with self._lock:
            self._entered += 1
            _streams._DEVICE_MODULES.append(("cpu", self))
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.synchronize()
        finally:
            mode = self._tls.modes.pop()
            if mode is not None:
                mode.__exit__(*exc)
            if self.checker is not None:
                _use_fast_stacks(False)
            with self._lock:
                self._entered -= 1
                _streams._DEVICE_MODULES.remove(("cpu", self))

    # -- results --------------------------------------------------------------------

    @property
    def hazards(self) -> list[Hazard]:
        """Every hazard found so far (the first 200)."""
        return list(self.checker.hazards) if self.checker is not None else []

    def assert_no_hazards(self) -> None:
        """Raise ``HazardError`` naming the first hazard when there is any."""
        if self.checker is not None and self.checker.count:
            raise HazardError(self.hazards, self.checker.count)

    def clear(self) -> None:
        """Forget the hazards found so far."""
        if self.checker is not None:
            self.checker.hazards.clear()
            self.checker.count = 0

    def summary(self) -> dict[str, Any]:
        """Counts for a bench JSON: ops checked, hazards, queued ops run late."""
        c = self.checker
        return {"late": self.late, "seed": self.seed, "ops_checked": c.ops if c else 0,
                "hazards": c.count if c else 0, "late_ops_run": self.flushes,
                "hazard_reports": [str(h) for h in self.hazards[:5]]}

    # -- internals: the checker ----------------------------------------------------------

    def _check(self, what: str, *a: Any) -> None:
        if self.checker is not None:
            getattr(self.checker, what)(*a)

    # -- internals: queues --------------------------------------------------------------

    def _lazy(self, s: EmulatedStream) -> bool:
        # While a stream is parked (_sleep: a long kernel), the others run as issued, as a GPU's
        # free streams do: work not ordered after the parked stream's then runs before it.
        if not self.late:
            return False
        if s.parked:
            return True
        return s.late and not any(x.parked for x in self._streams)

    def _submit(self, s: EmulatedStream, fn: Callable[[], None] | None) -> None:
        """Issue one op (``fn`` runs its effect; None: nothing to run) on stream ``s``."""
        with self._lock:
            s.issued += 1
            if self._lazy(s):
                s.queue.append(fn or _noop)
                return
            index = s.issued
            pending = s.executed < index - 1
        if pending:
            self._flush(s, index - 1)
        if fn is not None:
            fn()
        with self._lock:
            s.executed = max(s.executed, index)  # not s.issued: another thread may have queued since

    def _flush(self, s: EmulatedStream, upto: int) -> None:
        """Run stream ``s``'s queued ops up to issue index ``upto``.

        A stream is FIFO, as on a GPU: its ops run one at a time, in issue order, and count as
        executed (what an event's completion reads) only once they have run. Another thread
        flushing the same stream meanwhile waits for the running op instead of taking the next
        one or trusting a count that ran ahead of it.
        """
        me = threading.get_ident()
        while True:
            with self._ran:
                while s.running is not None and s.running != me and s.executed < upto:
                    self._ran.wait()
                if s.executed >= upto or not s.queue:
                    if s.executed >= s.issued:
                        s.parked = False
                    return
                fn = s.queue.popleft()
                outer, s.running = s.running, me
                self.flushes += 1
            prev = getattr(self._tls, "bypass", False)
            self._tls.bypass = True
            try:
                with torch._C._AutoDispatchBelowADInplaceOrView():
                    fn()
            finally:
                self._tls.bypass = prev
                with self._ran:
                    s.executed += 1
                    s.running = outer
                    self._ran.notify_all()

    def _random_flush(self) -> None:
        rng = self._rng
        if rng.random() >= self.flush_probability:
            return
        busy = [s for s in self._streams if s.executed < s.issued]
        if busy:
            s = rng.choice(busy)
            self._flush(s, rng.randint(s.executed + 1, s.issued))

    # -- internals: events --------------------------------------------------------------

    def _record(self, ev: EmulatedEvent, s: EmulatedStream) -> None:
        with self._lock:
            ev.stream, ev.index, ev.polls = s, s.issued, 0
        if s.issued <= s.executed:
            ev.time = time.perf_counter()
        else:
            def stamp(ev=ev) -> None:
                ev.time = time.perf_counter()
            ev.time = time.perf_counter()
            self._submit(s, stamp)
            ev.index = s.issued
        self._check("event_recorded", ev.id, s.id)

    def _done(self, ev: EmulatedEvent) -> bool:
        return ev.stream is None or ev.stream.executed >= ev.index

    def _ready(self, ev: EmulatedEvent) -> bool:
        """Whether a poll of ``ev`` may report it done: after ``lag`` polls (``offload.predict``'s capture
        asks its modelled device instead)."""
        ev.polls += 1
        return ev.polls > self.lag

    def _query(self, ev: EmulatedEvent) -> bool:
        if not self._ready(ev):
            return False
        if not self._done(ev):
            self._flush(ev.stream, ev.index)
        # A query that says "done" orders the host after the event, as on a GPU.
        self._check("event_synchronized", ev.id)
        return True

    def _sync_event(self, ev: EmulatedEvent) -> None:
        if ev.stream is not None:
            self._flush(ev.stream, ev.index)
        ev.polls = self.lag + 1
        self._check("event_synchronized", ev.id)

    def _sync_stream(self, s: EmulatedStream) -> None:
        self._flush(s, s.issued)
        self._check("stream_synchronized", s.id)

    def _wait(self, s: EmulatedStream, ev: EmulatedEvent) -> None:
        other, index = ev.stream, ev.index
        if other is not None and other is not s:
            self._submit(s, lambda: self._flush(other, index))
        self._check("event_waited", ev.id, s.id)

    # -- internals: the dispatch mode ------------------------------------------------------

    def _dispatch(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        if getattr(self._tls, "bypass", False):
            return func(*args, **kwargs)
        if func is aten.record_stream.default:
            if self.checker is not None:
                sid = args[1].stream_id
                self.checker.record_stream(args[0], sid)
            return None
        if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
            return func(*args, **kwargs)  # a tensor subclass: its own dispatch decides
        s = self.current_stream()
        if self._rng is not None:
            self._random_flush()
        metadata = (func in _METADATA_OPS or torch.Tag.inplace_view in func.tags
                    or not (_returns_tensors(func) or _host_visible(func) or _mutated_returns(func, args, kwargs)[0]))
        h = self.checker.parse_inputs(func, args, kwargs) if self.checker is not None else None
        out = self._issue(func, args, kwargs, s, metadata)
        if h is not None:
            self.checker.launched(h, func, out, s.id, metadata_only=metadata)
            if _host_visible(func):
                # The host waited for the result (e.g. .item()): it is ordered after the stream.
                self.checker.stream_synchronized(s.id)
        return out

    def _issue(self, func: Any, args: tuple, kwargs: dict, s: EmulatedStream, metadata: bool) -> Any:
        if not self.late:
            return func(*args, **kwargs)
        if metadata:
            out = func(*args, **kwargs)  # no bytes: runs now (queued ops hold aliases, see below)
            self._submit(s, None)
            return out
        if torch.Tag.nondeterministic_seeded in func.tags:
            self._flush(s, s.issued)  # (random ops run in issue order: the RNG stream stays the same)
            out = func(*args, **kwargs)
            self._submit(s, None)
            return out
        if _host_visible(func):
            self._flush(s, s.issued)  # the host waits for the stream (e.g. .item())
            return func(*args, **kwargs)
        if not _returns_tensors(func) and not _mutated_returns(func, args, kwargs)[0]:
            return func(*args, **kwargs)  # metadata queries (is_pinned, sizes): no bytes read
        if func in _EMPTY_OPS:
            out = func(*args, **kwargs)
            pytree.tree_map_(_poison, out)  # uninitialised memory holds garbage
            self._submit(s, None)
            return out
        if not self._lazy(s):
            self._submit(s, None)  # runs what is queued before it
            return func(*args, **kwargs)
        ok, ret = _mutated_returns(func, args, kwargs)
        # The queued op runs on aliases taken now: a later set_/resize_/in-place view of the
        # caller's tensor objects must not change what it reads or writes.
        qargs, qkwargs = pytree.tree_map_only(torch.Tensor, _alias, (args, kwargs))
        if ok:
            self._submit(s, lambda: func(*qargs, **qkwargs))
            return ret
        if func._schema.returns and all(r.alias_info is not None and not r.alias_info.is_write
                                        for r in func._schema.returns):
            self._submit(s, None)
            return func(*args, **kwargs)  # a view: metadata only
        # A new tensor: its shape now (from the meta kernel: the inputs may still be poison), its
        # bytes when the op runs (poison until then).
        try:
            margs, mkwargs = pytree.tree_map_only(torch.Tensor, _to_meta, (args, kwargs))
            out = pytree.tree_map_only(torch.Tensor, _empty_like_meta, func(*margs, **mkwargs))
        except Exception:  # no meta kernel: run it when issued, after what is queued before it
            self._submit(s, None)
            self._flush(s, s.issued)
            return func(*args, **kwargs)
        pytree.tree_map_(_poison, out)

        def run() -> None:
            res = func(*qargs, **qkwargs)
            for o, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(res)):
                if isinstance(o, torch.Tensor):
                    o.copy_(r)

        self._submit(s, run)
        return out

