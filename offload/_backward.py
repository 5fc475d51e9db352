"""The engine's backward side: one ``_Pass`` per autograd graph task, reloads and prefetch.

An offloaded handle's unpack (``_reload``) checks its version (Rule 6), takes
the bytes from where they are (the still-alive source, a sibling's reloaded
base, a prefetch, or a new host-to-device copy), rebuilds the tensor with its
original layout (Rule 5) and loads the handles packed just before it (backward
order) within the prefetch budget. The end of a graph task releases what it
held and closes the ledger step after the last pass, or, while another thread's forward is
open, at that forward's outermost exit (Rules 1, 11, 12 of NOTE
[ Offload lifetime rules ] in ``offload/engine.py``). A mixin of
``OffloadActivations``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from . import _torch_private, _verify
from ._fake import FAKE_TENSOR as _FAKE_TENSOR
from ._handles import _HostCopy, _inplace_error, _Offloaded, live_original
from .streams import Copy

if TYPE_CHECKING:
    import threading

    from ._schedule import _Schedule

_graph_task_id = _torch_private.graph_task_id_c
_Tensor = torch.Tensor
_UINT8 = torch.uint8


class _Pass:
    """One autograd graph task's view of the engine (Rule 12).

    Queued as the graph task's end-of-backward callback: called when the pass
    finishes; released (``__del__``) with the graph task when it fails, so a
    failed backward cleans up as soon as autograd drops it.
    """

    __slots__ = ("engine", "gid", "touched", "prefetched", "prefetched_bytes", "ended", "order", "frontier",
                 "ceiling", "reserve", "allowance", "next_read", "unpacks", "__weakref__")

    def __init__(self, engine: Any, gid: int) -> None:
        self.engine = engine
        self.gid = gid
        # Weak: these must not keep host copies (or reloaded device bytes)
        # alive after the graph is freed.
        self.touched: list[weakref.ref] = []
        self.prefetched: list[weakref.ref] = []
        self.prefetched_bytes = 0
        self.ended = False
        # The reload window (NOTE [ Copy schedule ] item 3, set by _Schedule.begin_pass): the pack order
        # reloads walk backwards from ``frontier``, the memory ceiling and reserve, the bytes the last
        # allocator reading allows, and the unpack count at which it may be read again.
        self.order: list[weakref.ref] | None = None
        self.frontier = 0
        self.ceiling: int | None = None
        self.reserve = 0
        self.allowance = 0
        self.next_read = 0
        self.unpacks = 0

    def __call__(self) -> None:
        self.engine._end_pass(self)

    def __del__(self) -> None:
        if not self.ended:
            try:
                self.engine._end_pass(self)
            except Exception:  # interpreter shutdown
                pass


def _live_before(h: _Offloaded, order: list[weakref.ref], lookahead: int = 64) -> Iterator[_Offloaded]:
    """The live handles packed just before ``h`` on its thread, nearest first (backward order: what
    prefetch and disk read-ahead load next), at most ``lookahead`` of them. Lock held: compaction
    renumbers ``h.index``."""
    i = min(h.index, len(order)) - 1
    while i >= 0 and lookahead > 0:
        x = order[i]()
        i -= 1
        if x is not None:
            lookahead -= 1
            yield x


class _Backward:
    """Backward-side methods of ``OffloadActivations`` (its ``__init__`` sets the state)."""

    _backend: Any
    _lock: "threading.RLock"
    _passes: "weakref.WeakValueDictionary[int, _Pass]"
    _last_pass: tuple[int, weakref.ref] | None
    _close_pending: bool
    _tls: Any
    _threads: Any
    _sched: "_Schedule"
    prefetch_bytes: int | None
    tiers: Any

    def _begin_backward_pass(self, order: list[weakref.ref] | None = None) -> _Pass | None:
        """This graph task's pass state, created (and its end queued) at its first unpack; ``order``: the
        pack order its reloads walk (the unpacked handle's, or its step's last)."""
        gid = _graph_task_id()
        if gid < 0:
            return None  # unpacked outside backward (e.g. grad_fn._saved_*): nothing to track
        last = self._last_pass  # (gid, weak _Pass): skips the WeakValueDictionary per unpack
        if last is not None and last[0] == gid:
            p = last[1]()
            if p is not None and not p.ended:
                return p
        p = self._passes.get(gid)
        if p is None:
            with self._lock:
                p = self._passes.get(gid)
                if p is None:
                    p = _Pass(self, gid)
                    self._sched.begin_pass(p, order)
                    self._passes[gid] = p
                    _torch_private.queue_end_of_backward(p)
        if p.order is None and order is not None:  # its first unpacks had no offloaded handle to follow
            self._sched.begin_pass(p, order)
        self._last_pass = (gid, weakref.ref(p))  # graph task ids are never reused
        return p

    def _kept_unpacked(self, step: Any) -> None:
        """A kept handle of ``step`` was unpacked: the reloads of its pass may start (NOTE [ Copy schedule ]
        item 3)."""
        p = self._begin_backward_pass(step.order)
        if p is not None:
            p.unpacks += 1
            if p.frontier:
                self._sched.ahead(p, self._load)

    def _reload(self, h: _Offloaded) -> torch.Tensor:
        """The unpack of an offloaded handle."""
        p = self._begin_backward_pass(h.order)
        tracker = h.tracker
        tensor = type(tracker) is _Tensor or type(tracker) is _FAKE_TENSOR  # (else a weak reference)
        now = tracker._version if tensor else getattr(tracker(), "_version", h.version)
        if now != h.version:
            shape, _, _, dtype = h.layout[:4]
            raise _inplace_error(shape, dtype, now, h.version)
        entry = h.stash
        hc = h.hc
        src = entry.src if entry is not None else None  # read once: a poll may drop it any time after
        if src is not None and hc.users == 1:
            # The source is still alive (its copy may be in flight): use it as is. Not when
            # other handles share the host copy: they get views of one reloaded base, and an
            # in-place write through one must be seen by the others' checks (Rule 6).
            h.rec.note = "reused_source"
            # Allocated on the producer stream: a consumer on another stream is recorded (Rule 4).
            self._backend.record_consumer(src, entry.copy, "reused_source_record_stream")
            # Consumed: the engine holds it no longer than autograd does (NOTE [ Copy schedule ] item 5).
            self._sched.consumed(entry)
            if p is not None:
                self._load_ahead(h, p)  # the reloads after it start now, as after any unpack
            if hc.gathered is not None:  # the gathered elements, dense: back into the view's size and stride
                return _scattered(h.layout, src)
            return src  # (entry.src may be None by now: loading ahead polls the stash, which releases it)
        if hc.held is None and hc.prefetched is None:  # (a peek: _device_bytes locks)
            live = live_original(h)
            if live is not None:  # its bytes are on the device anyway: no load (NOTE [ Copy schedule ] item 6)
                return self._from_original(h, hc, live, p)
            # a new load
            base, copy = self._load(hc, h.rec)
            held = None
        else:
            base, copy, held = self._device_bytes(h, hc)
        if copy.done is not None:  # (a synchronous copy is complete)
            self._wait(copy)
        if held is None and hc.checksum is not None:  # a new base: checked once (NOTE [ Verified offload ])
            rec = h.rec
            # (A disk-tier copy has no host tensor left; its file is CRC-checked by the disk tier.)
            host = hc.buf.tensor if hc.tier != "disk" else base
            flat = base if base.dtype is _UINT8 else base.view(-1).view(_UINT8)
            _verify.check_reload(hc.checksum, flat, host, copy.done, module=rec.module,
                                 shape=h.layout[0], dtype=rec.dtype, step=rec.step)
        out = self._rebuild(h, hc, base, copy)
        if p is not None:
            with self._lock:
                if hc.used == 0:
                    p.touched.append(weakref.ref(hc))
                hc.used += 1
                # Keep the bytes on the device until every sibling view has been
                # unpacked once, instead of reloading the storage per view.
                if hc.used < hc.users:
                    hc.held = held if held is not None else (base, copy, base._version)
                else:
                    hc.held = None
            self._load_ahead(h, p)
        return out

    def _from_original(self, h: _Offloaded, hc: _HostCopy, base: torch.Tensor, p: _Pass | None) -> torch.Tensor:
        """The saved tensor as a view of its live original (``live_original``): what autograd would have
        unpacked without the engine. A view of it, detached, shares its version counter, so an in-place
        write through one unpacked tensor is seen by its siblings' checks (Rule 6)."""
        shape, stride, offset, dtype, device, conj, neg = h.layout
        h.rec.note = "reused_original"
        out = _lazy_bits(base.detach().as_strided(shape, stride, hc.lo // dtype.itemsize + offset), conj, neg)
        if p is not None:
            with self._lock:
                if hc.used == 0:
                    p.touched.append(weakref.ref(hc))
                hc.used += 1
            self._load_ahead(h, p)
        return out

    def _load_ahead(self, h: _Offloaded, p: _Pass) -> None:
        """After the unpack of ``h``: issue the reloads of the handles packed before it while there is room
        (NOTE [ Copy schedule ] item 3) and read ahead on disk."""
        p.unpacks += 1
        sched = self._sched
        sched.reached(p, h)
        if p.frontier:
            sched.ahead(p, self._load)
        if self.tiers.disk is not None:
            self._disk_readahead(h)

    def _disk_readahead(self, h: _Offloaded) -> None:
        """Start reading the disk-tier copies packed just before ``h`` (backward order: the order
        prefetch uses) on the disk tier's reader thread, up to ``disk_readahead_bytes``."""
        order = h.order
        if order is None:
            return
        disk = self.tiers.disk
        with self._lock:
            for x in _live_before(h, order):
                hc = x.hc
                if hc.tier != "disk" or hc.used >= hc.users or hc.prefetched is not None:
                    continue
                if live_original(x) is not None:
                    continue  # never reloaded (NOTE [ Copy schedule ] item 6): a read of it would finish unused
                if hc.buf.read is None and not disk.prefetch(hc.buf):
                    if hc.buf.state == "on_disk":
                        break  # the read-ahead budget is full

    def _device_bytes(self, h: _Offloaded, hc: _HostCopy) -> tuple[torch.Tensor, Copy, Any]:
        """The reloaded flat base of ``hc`` and its copy: a sibling's, a prefetch's, or a new load;
        with the sibling's ``held`` entry when there was one."""
        with self._lock:
            held, pre = hc.held, hc.prefetched
            if held is None and pre is not None:
                hc.prefetched = None
                q = self._passes.get(pre[2])
                if q is not None:
                    q.prefetched_bytes -= hc.nbytes
        if held is not None:
            base, copy, version = held
            if base._version != version:
                # A sibling's reloaded tensor was modified in place during this
                # backward: autograd raises here too (Rule 6).
                shape, _, _, dtype = h.layout[:4]
                raise _inplace_error(shape, dtype, base._version, version)
            return base, copy, held
        if pre is not None:
            return pre[0], pre[1], None
        base, copy = self._load(hc, h.rec)
        return base, copy, None

    def _rebuild(self, h: _Offloaded, hc: _HostCopy, base: torch.Tensor, copy: Copy) -> torch.Tensor:
        """The saved tensor again, from the reloaded base: original size, stride and offset (Rule 5)."""
        shape, stride, offset, dtype, device, conj, neg = h.layout
        es = dtype.itemsize
        if hc.gathered is not None:  # the view's elements, dense: scattered back into its size and stride
            if copy.stream is not None:  # Rule 4: the reloaded base is read on the current stream
                self._backend.record_consumer(base, copy, "record_stream")
            return _scattered(h.layout, base.view(dtype).as_strided(shape, hc.gathered))
        typed = base.dtype is not _UINT8  # reloaded as the tensor itself (_Copies._load: a whole tensor's only user)
        if typed and (hc.users > 1 or base.stride() != stride):
            # A user added since its load, or a size-1 dimension with another stride: its bytes, rebuilt
            # as any copy's.
            base, typed = base.view(-1).view(_UINT8), False
        if typed:
            out = base  # its size, stride and dtype already
        elif hc.users > 1 and hc.nbytes % es == 0:
            # Views of one base share its version counter, so an in-place
            # write through one reloaded tensor is seen by the others (Rule 6).
            out = base.view(dtype).as_strided(shape, stride, offset)
        elif offset == 0 and len(shape) == 1 and stride == (1,) and shape[0] * es == hc.nbytes:
            # The whole reloaded base as a 1-D tensor: a dtype view of it is a
            # third of the cost of set_ on a new tensor (the base has no other user).
            out = base.view(dtype)
        else:
            out = torch.empty(0, dtype=dtype, device=device).set_(base.untyped_storage(), offset, shape, stride)
        out = _lazy_bits(out, conj, neg)
        if copy.stream is not None:  # Rule 4: consumed on another stream than allocated
            self._backend.record_consumer(out, copy, "record_stream")
        return out

    @property
    def prefetch_budget(self) -> int:
        """Bytes backward may load ahead of need without allocator statistics (``prefetch_bytes`` resolved;
        NOTE [ Copy schedule ] item 3): ``prefetch_bytes`` when set; else twice the largest copy on a side
        stream, and 0 with synchronous copies (CPU, ``use_streams=False``), where a load ahead overlaps
        nothing. With allocator statistics (CUDA) the device's headroom sizes it instead."""
        if self.prefetch_bytes is not None:
            return self.prefetch_bytes
        if self._backend is None or self._backend.name == "sync":
            return 0
        return 2 * self._sched.max_copy

    def _end_pass(self, p: _Pass) -> None:
        """A graph task ended (or failed): release what it held; close the step after the last one."""
        with self._lock:
            if p.ended:
                return
            p.ended = True
            if self._passes.get(p.gid) is p:
                del self._passes[p.gid]
            for ref in p.prefetched:
                hc = ref()
                if hc is not None and hc.prefetched is not None and hc.prefetched[2] == p.gid:
                    # Never consumed: the block goes back to its allocation
                    # stream's pool, so order that stream after the H2D write
                    # before dropping it (Rule 4).
                    copy = hc.prefetched[1]
                    self._backend.release_after(copy, copy.stream, "unused_prefetch_release_waits_copy")
                    hc.prefetched = None
            p.prefetched.clear()
            for ref in p.touched:
                hc = ref()
                if hc is not None:
                    hc.held = None  # consumed (waited on) by compute: safe to drop
                    hc.used = 0
            p.touched.clear()
            if self._passes:
                return  # a nested or concurrent pass is still running (Rule 11)
            if self._forward_open_elsewhere():
                # Rule 12: another thread is between two saves of its forward; closing now would
                # clear the dedupe and span maps under it. Its outermost exit closes the step.
                self._close_pending = True
                return
        self._end_step()

    def _forward_open_elsewhere(self) -> bool:
        """Whether a thread other than this one is inside the engine (a forward open: Rule 12)."""
        mine = getattr(self._tls, "state", None)
        with self._lock:
            return any(ts.enter_depth > 0 for ts in list(self._threads) if ts is not mine)

    def _close_deferred_step(self) -> None:
        """At an outermost exit: close the step a backward on another thread left open for this
        forward (Rule 12), once no pass runs and no other thread is inside the engine."""
        with self._lock:
            if not self._close_pending or self._passes or self._forward_open_elsewhere():
                return
            self._close_pending = False
        self._end_step()

    def _end_step(self) -> None:
        """Release every in-flight source, renumber the pack orders, close the ledger step."""
        with self._lock:
            self._sched.drain()
            for ts in list(self._threads):
                self._compact(ts.order)
        self.close_step()


def _lazy_bits(out: torch.Tensor, conj: bool, neg: bool) -> torch.Tensor:
    """``out`` with the saved view's lazy conjugate and negative bits (Rule 5: they live on the view, not in
    its bytes)."""
    if conj:
        out = out.conj()
    return _torch_private.neg_view(out) if neg else out


def _scattered(layout: tuple, dense: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``layout``'s size and stride (Rule 5: what torch.compile's backward asserts) holding
    ``dense``'s elements: a gathered copy's view again, on the current stream."""
    shape, stride, _, dtype, device = layout[:5]
    out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    out.copy_(dense)
    return out
