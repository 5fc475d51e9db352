"""Record a step run by the real engine on the emulated accelerator into a ``Trace``.

``Recorder`` is an ``EmulatedAccelerator`` (``offload.testing``) that also writes what the
host issued, in program order: every aten op that does device work (a ``Kernel``), every
host<->device copy the engine's ``StreamBackend`` makes (a ``Copy``), every event record,
stream wait and host synchronize, every allocation and free of a device storage, and the
engine's hooks and new pinned host memory (``HostWork``). The tensors are real CPU tensors (tiny
sizes are fine: the schedule is what matters), so the same engine code that runs on a GPU makes
the schedule; nothing of the engine is re-implemented here.

    with Recorder() as rec:
        ctx = OffloadActivations(device="cpu")   # the stream backend on the recorder's streams
        rec.watch(ctx)
        with rec.record() as trace:
            with ctx:
                loss = model(x).sum()
            loss.backward()
    simulate(trace, "h100-sxm")

Event queries always answer "not done" (the engine then takes its in-flight paths, as on a
GPU under load), unless a ``clock`` (``offload.predict.Clock``) models the device: then a poll
says what that device has run by the host's time, and ``memory_allocated`` reports the device
storages the step allocated and still holds (NOTE [ Copy schedule ] reads both). Storages are "device"
memory except the engine's host buffers (pool chunks and pageable copies), which count as
pinned when the engine pins (``use_pin_memory``) as it would on a GPU. Recording sees the
thread that entered the recorder (backward of CPU tensors runs there too).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from ..testing import EmulatedAccelerator
from ..testing._aten_ops import _EMPTY_OPS, _METADATA_OPS, _host_visible, _mutated_returns, _returns_tensors
from ._cost import pinned_alloc_seconds
from ._trace import (COMPUTE_STREAM, Alloc, Copy, Free, HostSync, HostWork, Kernel, RecordEvent, RecordStream,
                     Trace, WaitEvent)

__all__ = ["Recorder"]

aten = torch.ops.aten
_WHY = {"wait": "use", "release_after": "free", "d2h": "order", "h2d": "order"}
"""Backend method -> ``WaitEvent.why`` of the waits it makes."""


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.layout is torch.strided]


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    f = flop_registry.get(func._overloadpacket)
    if f is None:
        return 0
    try:
        return int(f(*args, **kwargs, out_val=out))
    except Exception:  # a shape the counter does not handle: no FLOPs, memory time only
        return 0


class Recorder(EmulatedAccelerator):
    """An emulated accelerator that records the step into a ``Trace`` (see the module docstring)."""

    def __init__(self, *, check: bool = False, clock: Any = None) -> None:
        super().__init__(late=False, lag=10**9, check=check)
        self.clock = clock
        self._sizes: dict[int, int] = {}  # device block -> bytes, while alive (memory_allocated)
        self._allocated = self._peak = 0
        self.trace: Trace | None = None
        self._sids: dict[int, int] = {0: COMPUTE_STREAM}
        self._eids: dict[int, int] = {}
        self._blocks: dict[int, int] = {}  # storage data_ptr -> block id (live device storages)
        self._block_ids = iter(range(1, 1 << 62))
        self._host_ptrs: dict[int, bool] = {}  # host storage data_ptr -> pinned on a GPU
        self._host_ids: dict[tuple[int, int], int] = {}  # (data_ptr, nbytes) -> Copy.host of its last D2H
        self._rtls = threading.local()
        self._rlock = threading.RLock()

    # -- what the caller uses ---------------------------------------------------------------

    @contextmanager
    def record(self) -> Iterator[Trace]:
        """Record everything issued inside the block into a new ``Trace``."""
        trace = self.trace = Trace()
        try:
            yield trace
        finally:
            self.trace = None
            self._name_streams(trace)

    def watch(self, engine: Any) -> None:
        """Record ``engine``'s hooks (``HostWork`` at their measured cost), the reasons of its stream
        waits, and its new host memory. Call once, before the engine is entered."""
        pack, unpack = engine.pack_hook, engine.unpack_hook
        from .._handles import _Offloaded

        def pack_hook(t: torch.Tensor) -> Any:
            # Issued before what the hook does; the cheaper label until the hook says it offloaded, so a
            # clock's polls inside the hook never see more host time than the replay will.
            at = len(self.trace.items) if self.trace is not None else -1
            self._emit(HostWork(0.0, "pack hook (keep)"))
            h = pack(t)
            if at >= 0 and self.trace is not None and isinstance(h, _Offloaded):
                self.trace.items[at] = HostWork(0.0, "pack hook")
            return h

        def unpack_hook(h: Any) -> Any:
            self._emit(HostWork(0.0, "unpack hook" if isinstance(h, _Offloaded) else "unpack hook (keep)"))
            return unpack(h)

        engine.pack_hook, engine.unpack_hook = pack_hook, unpack_hook
        backend = engine._backend
        for name, why in _WHY.items():
            if hasattr(backend, name) and hasattr(backend, "_side_stream"):
                setattr(backend, name, self._tagged(getattr(backend, name), why))
        pin = bool(engine.use_pin_memory)
        pool = engine.pool
        pool._new_tensor = self._host_alloc(pool._new_tensor, pinned=pin)
        pool.overflow = self._host_alloc(pool.overflow, pinned=False)

    # -- wrappers -----------------------------------------------------------------------------

    def _tagged(self, fn: Any, why: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            prev = getattr(self._rtls, "why", "")
            self._rtls.why = why
            self._rtls.in_h2d = fn.__name__ == "h2d"
            try:
                return fn(*a, **k)
            finally:
                self._rtls.why, self._rtls.in_h2d = prev, False
        return call

    def _host_alloc(self, fn: Any, *, pinned: bool) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            prev = getattr(self._rtls, "host", False)
            self._rtls.host = True
            try:
                out = fn(*a, **k)
            finally:
                self._rtls.host = prev
            if out is not None:
                t = out[0] if isinstance(out, tuple) else out.tensor
                st = t.untyped_storage()
                self._host_ptrs[st.data_ptr()] = pinned
                weakref.finalize(st, self._host_ptrs.pop, st.data_ptr(), None)
                if pinned and isinstance(out, tuple):
                    self._emit(HostWork(pinned_alloc_seconds(t.nbytes), "pinned allocation"))
            return out
        return call

    # -- ids ------------------------------------------------------------------------------------

    def _sid(self, s: Any) -> int:
        sid = self._sids.get(s.id)
        if sid is None:
            sid = self._sids[s.id] = len(self._sids)
        return sid

    def _eid(self, ev: Any) -> int:
        eid = self._eids.get(ev.id)
        if eid is None:
            eid = self._eids[ev.id] = len(self._eids) + 1
        return eid

    def _emit(self, item: Any) -> None:
        if self.trace is not None:
            with self._rlock:
                self.trace.append(item)
                if self.clock is not None:
                    self.clock.add(item)

    # -- the modelled device (a clock) ------------------------------------------------------------

    def _ready(self, ev: Any) -> bool:
        if self.clock is not None and self.trace is not None:
            return self.clock.done(self._eid(ev))
        return super()._ready(ev)

    def memory_allocated(self, device: Any = None) -> int:
        """Bytes of the device storages the recorder saw allocated and alive now."""
        return self._allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        return self._peak

    def _name_streams(self, trace: Trace) -> None:
        dirs: dict[int, set[str]] = {}
        for it in trace.items:
            if type(it) is Copy:
                dirs.setdefault(it.stream, set()).add(it.direction)
        names = {frozenset({"d2h"}): "offload (d2h)", frozenset({"h2d"}): "reload (h2d)",
                 frozenset({"d2h", "h2d"}): "copies (d2h + h2d)"}
        for s in set(self._sids.values()) - {COMPUTE_STREAM}:
            trace.streams[s] = names.get(frozenset(dirs.get(s, ())), f"stream {s}")

    # -- the emulator's stream surface, recorded --------------------------------------------

    def _record(self, ev: Any, s: Any) -> None:
        super()._record(ev, s)
        self._emit(RecordEvent(self._sid(s), self._eid(ev)))

    def _wait(self, s: Any, ev: Any) -> None:
        super()._wait(s, ev)
        self._emit(WaitEvent(self._sid(s), self._eid(ev), getattr(self._rtls, "why", "")))

    def _sync_event(self, ev: Any) -> None:
        super()._sync_event(ev)
        self._emit(HostSync("event", self._eid(ev), "Event.synchronize"))

    def _sync_stream(self, s: Any) -> None:
        super()._sync_stream(s)
        self._emit(HostSync("stream", self._sid(s), "Stream.synchronize"))

    def synchronize(self, device: Any = None) -> None:
        super().synchronize(device)
        self._emit(HostSync("device", None, "synchronize"))

    # -- aten ops ---------------------------------------------------------------------------------

    def _dispatch(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        if getattr(self._tls, "bypass", False):
            return super()._dispatch(func, types, args, kwargs)
        if self.trace is None:  # not recording: device storages are still counted (memory_allocated)
            in_ptrs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            out = super()._dispatch(func, types, args, kwargs)
            self._allocs(out, in_ptrs, self._sid(self.current_stream()))
            return out
        if func is aten.record_stream.default:
            b = self._blocks.get(args[0].untyped_storage().data_ptr())
            if b is not None:
                self._emit(RecordStream(b, self._sid_of_id(args[1].stream_id)))
            return super()._dispatch(func, types, args, kwargs)
        s = self._sid(self.current_stream())
        if _host_visible(func):
            out = super()._dispatch(func, types, args, kwargs)
            self._emit(HostSync("item", s, str(func)))
            return out
        ins = _tensors((args, kwargs))
        in_ptrs = {t.untyped_storage().data_ptr() for t in ins}
        out = super()._dispatch(func, types, args, kwargs)
        self._allocs(out, in_ptrs, s)
        if func is aten.copy_.default and self._copy(args[0], args[1], s):
            return out
        if func in _EMPTY_OPS or func in _METADATA_OPS or torch.Tag.inplace_view in func.tags:
            return out
        if not (_returns_tensors(func) or _mutated_returns(func, args, kwargs)[0]):
            return out
        if func._schema.returns and all(r.alias_info is not None and not r.alias_info.is_write
                                        for r in func._schema.returns):
            return out  # a view
        outs = _tensors(out)
        nbytes = sum(t.numel() * t.element_size() for t in ins + outs)
        dtype = next((t.dtype for t in ins if t.is_floating_point()), None)
        blocks = tuple(sorted({b for t in ins + outs
                               if (b := self._blocks.get(t.untyped_storage().data_ptr())) is not None}))
        phase = "backward" if torch._C._current_graph_task_id() >= 0 else "forward"
        self._emit(Kernel(s, str(func), _flops(func, args, kwargs, out), nbytes, dtype, "", phase, blocks))
        return out

    def _sid_of_id(self, stream_id: int) -> int:
        sid = self._sids.get(stream_id)
        if sid is None:
            sid = self._sids[stream_id] = len(self._sids)
        return sid

    def _allocs(self, out: Any, in_ptrs: set[int], s: int) -> None:
        """Alloc items for the device storages ``out`` holds that no input held (new storages)."""
        if getattr(self._rtls, "host", False):
            return
        for t in _tensors(out):
            st = t.untyped_storage()
            p = st.data_ptr()
            if p in in_ptrs or p in self._blocks or p in self._host_ptrs or not st.nbytes():
                continue
            b = next(self._block_ids)
            self._blocks[p] = b
            weakref.finalize(st, self._freed, p, b)
            cat = "copy" if getattr(self._rtls, "in_h2d", False) else "activation"
            self._sizes[b] = st.nbytes()
            self._allocated += st.nbytes()
            self._peak = max(self._peak, self._allocated)
            self._emit(Alloc(b, st.nbytes(), s, cat))

    def _freed(self, ptr: int, block: int) -> None:
        if self._blocks.get(ptr) == block:
            del self._blocks[ptr]
        self._allocated -= self._sizes.pop(block, 0)
        self._emit(Free(block))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, s: int) -> bool:
        """Record a host<->device copy (True), or say it is a device copy (False)."""
        dp, sp = dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr()
        host_dst, host_src = dp in self._host_ptrs, sp in self._host_ptrs
        if host_dst == host_src:
            return False
        nbytes = dst.numel() * dst.element_size()
        key = (dst.data_ptr() if host_dst else src.data_ptr(), nbytes)
        dev = self._blocks.get(sp if host_dst else dp)
        if host_dst:
            host = self._host_ids[key] = next(self._block_ids)
        else:
            host = self._host_ids.get(key, -1)
        pinned = self._host_ptrs[dp if host_dst else sp]
        phase = "backward" if torch._C._current_graph_task_id() >= 0 else "forward"
        self._emit(Copy(s, "d2h" if host_dst else "h2d", nbytes, pinned, "", phase,
                        () if dev is None else (dev,), host))
        return True
