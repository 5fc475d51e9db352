"""The engine's pack side: classify -> act -> record, once per saved tensor.

``_pack`` is the pack hook ``__enter__`` pushes. It reads a tensor's facts once,
asks ``policy.classify`` (the one Python statement of the rules), then acts
(keeps the tensor in a tuple handle, or offloads it: a shared host copy when
its storage was copied already this step, Rule 7, else a new copy through
``_Copies._copy_out``) and records the decision in the ledger's logs (NOTE
[ Ledger logs ]) and for the observers. ``offload/_native/pack.cpp`` restates
the keep path in C++ (``native_hooks``), and for an offload candidate makes the
same ``_offload`` / ``_log_offload`` calls with the facts it read; ``tests/offload/test_native.py``
compares the two record by record. A mixin of ``OffloadActivations``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import _torch_private, policy
from ._fake import FAKE_TENSOR as _FAKE_TENSOR
from ._fake import fake_storage_id
from ._handles import _HostCopy, _Offloaded, _saved_alias, _Step
from ._observers import _notify, _observer_count, _tls
from ._spans import SpanSet, byte_span
from .ledger import KEPT, OFFLOADED, Ledger, PackRecord, record_from_log
from .modules import _names as _module_names
from .modules import current_module_name, current_modules_view

if TYPE_CHECKING:
    import threading

    from .engine import _ThreadState

_classify = policy._classify
_device_name = policy.device_name
_DEVICE_NAMES = policy._DEVICE_NAMES
_DTYPE_NAMES = policy._DTYPE_NAMES
_Tensor = torch.Tensor
_Parameter = nn.Parameter
# The reasons, as module globals: the pack hook compares them by identity.
_PARAMETER, _BUFFER = policy.PARAMETER, policy.BUFFER
_REASON_BY_TYPE = policy.REASON_BY_TYPE
_PLAIN_TYPES = frozenset((_Tensor, _Parameter))
"""The types ``_pack`` takes (a subclass goes to ``_pack_other``)."""
_PLAIN_ITEMSIZE: dict[torch.dtype, int] = {}
"""dtype -> item size, for each dtype seen whose tensors hold their values in their bytes (not quantized)."""


def _plain_itemsize(t: torch.Tensor) -> int:
    """``t.dtype``'s item size, remembered in ``_PLAIN_ITEMSIZE``; 0 for a quantized tensor (its
    scale and zero point are not in its bytes: ``_pack_other`` keeps it)."""
    if t.is_quantized:
        return 0
    dtype = t.dtype
    size = _PLAIN_ITEMSIZE[dtype] = dtype.itemsize
    return size


def _owner_lookup(memo: dict[tuple[int, int, int], tuple[frozenset[int], frozenset[int]]]) -> Callable[[int], str]:
    """The engine's ``owner(ptr)`` for ``policy._classify``: PARAMETER / BUFFER when a parameter or
    buffer of a running module lives on ``ptr``, else "".

    Catches buffers (RoPE tables) and parameters saved through storage aliases
    without knowing the model in advance. The storages of the running modules'
    parameters and buffers are collected once per step for each (innermost,
    outermost, depth) of the module stack, so an offload candidate costs one set
    lookup; the engine clears ``memo`` at every outermost enter (FSDP2 re-gathers
    parameters into new storages). A closure over the memo, made once per engine:
    a bound method would be made again for every pack, and one kept on the engine
    would hold the engine in a cycle.
    """

    def owner(ptr: int) -> str:
        stack = current_modules_view()
        if not stack:
            return ""
        key = (id(stack[-1]), id(stack[0]), len(stack))
        owned = memo.get(key)
        if owned is None:
            owned = memo[key] = policy.owned_storages(stack)
        if ptr in owned[0]:
            return _PARAMETER
        if ptr in owned[1]:
            return _BUFFER
        return ""

    return owner


def _module_of(ts: "_ThreadState") -> str:
    """The running module's qualified name (``current_module_name``; its named case is one dict read)."""
    stack = ts.module_stack
    if not stack:
        return ""
    module = _module_names.get(id(stack[-1]))
    return module if module is not None else current_module_name()


class _Packing:
    """Pack-side methods of ``OffloadActivations`` (its ``__init__`` sets the state)."""

    enabled: bool
    device: torch.device | None
    _device_name: str | None
    min_offload_size: int
    dedupe: bool
    prefetch_bytes: int | None
    ledger: Ledger
    _backend: Any
    _lock: "threading.RLock"
    _static_ptrs: dict[int, str]
    _dedupe: dict[tuple[str, int], weakref.ref]
    _seen: SpanSet
    _observers: Any
    _running_owner: Callable[[int], str]
    _order_compact_at: int
    _inflight: Any
    _sched: Any
    tiers: Any

    # _pack runs for every saved tensor on the kernel-launching thread: its CPU time is step
    # time (``python -m bench.hook_cost``). A plain tensor with a storage takes this path, each
    # fact about it read once and passed on; everything else (subclasses, sparse, nested,
    # quantized, zero tensors, pass-through) goes through _pack_other. classify -> act -> record.
    def _pack(self, t: torch.Tensor) -> Any:
        if type(t) not in _PLAIN_TYPES or not self.enabled:
            return self._pack_other(t)
        try:
            st = t.untyped_storage()  # sparse, mkldnn and efficient zeros have none: they raise
            ptr = st.data_ptr()
            shape = t.shape  # a strided nested tensor has no single shape: it raises
        except (RuntimeError, NotImplementedError):
            return self._pack_other(t)
        dtype = t.dtype
        itemsize = _PLAIN_ITEMSIZE.get(dtype) or _plain_itemsize(t)
        if not itemsize:  # quantized: its scale is not in its bytes
            return self._pack_other(t)
        ts = getattr(self._tls, "state", None) or self._thread()
        device, leaf = t.device, t.is_leaf
        on_device = device == self.device
        nbytes = shape.numel() * itemsize  # t.nbytes, without a tensor getter
        # -- classify (t is plain: its type, storage, layout and dtype are checked above)
        reason = _REASON_BY_TYPE.get(type(t))  # a Parameter: nothing else to ask
        if reason is None:
            base = t._base
            reason = _classify(t, self.device, self.min_offload_size, ts.excluded_depth > 0, self._static_ptrs,
                               self._running_owner, nbytes, ptr, ts.after_head, base, on_device, leaf)
        # -- act
        dev = self._device_name if on_device else (_DEVICE_NAMES.get(device) or _device_name(device))
        step = self._step_ref() or self._open_step()  # (a _Step is always true)
        stack = ts.module_stack  # _module_of, inlined: its named case is one dict read
        module = (_module_names.get(id(stack[-1])) or _module_of(ts)) if stack else ""
        ledger = self.ledger
        spanned = reason is not _PARAMETER and reason is not _BUFFER
        if spanned:  # the bytes of its storage t can touch: what an offload copies, and the span recorded
            offset, contiguous = t.storage_offset(), t.is_contiguous()
            lo_b, key = offset * itemsize, (dev, ptr)
            hi_b = lo_b + nbytes if contiguous else byte_span(t)[1]
            seen = self._seen.entries  # SpanSet.add_span's first case, inlined (a call costs ~0.7k a pack):
            entry = seen.get(key)  # a storage not seen this step, or seen through a saver now dead
            if ptr and hi_b > lo_b and (entry is None or (type(entry) is tuple and entry[0]() is None)):
                seen[key] = (weakref.ref(t if base is None else base), lo_b, hi_b)
                ledger.unique_log.append(hi_b - lo_b)
            else:
                self._record_span(t, key, lo_b, hi_b)
        if reason:
            self._inflight and self._sched.kept()  # finished copies free their sources (NOTE [ Copy schedule ])
            handle: Any = (t if leaf else t.detach(), t._version, step)  # Rule 10: detached; Rule 6: its version
            rec: Any = (next(self._seq), ledger.current_step, nbytes, tuple(shape), dtype, dev, module,
                        KEPT, reason, ptr, len(st))  # len: st.nbytes() without the argument parsing
            ledger.kept_log[reason].append(nbytes)  # each reason has its list (NOTE [ Ledger logs ])
        else:
            rec = PackRecord(next(self._seq), ledger.current_step, nbytes, tuple(shape),
                             _DTYPE_NAMES.get(dtype) or policy.dtype_name(dtype), dev, module,
                             KEPT, reason, ptr, len(st))
            handle = self._offload(t, rec, key, ts, step, dtype, device, base, itemsize, contiguous, lo_b, hi_b)
            _log_offload(ledger, rec, nbytes)
        # -- record
        ledger._open_used = True
        if _observer_count[0] and (self._observers or _tls.__dict__.get("observers")):
            self._record_observed(t, rec)
        else:
            ledger.records_log.append(rec)
        return handle

    def _record_observed(self, t: torch.Tensor, rec: Any) -> None:
        """Log ``rec`` and tell the pack observers; they and the records ring share one record."""
        if type(rec) is tuple:
            rec = record_from_log(rec)
        self.ledger.records_log.append(rec)
        _notify(self, t, rec)

    def _pack_other(self, t: torch.Tensor) -> Any:
        """``_pack`` for everything but a plain tensor with a storage (and for pass-through).

        Also the general path ``_pack`` (and the C++ hook) are tested against, record by record
        (``tests/offload/offload_testkit.assert_pack_matches_general``): it reads every fact
        through ``policy.classify``'s own checks, so it can decide and offload any tensor."""
        seq = next(self._seq)
        es = t.element_size()
        nbytes = t.numel() * es
        try:
            st = t.untyped_storage()
            # A fake tensor's storage has no address: its unique id stands in (offload._fake).
            ptr = st.data_ptr() if type(t) is not _FAKE_TENSOR else fake_storage_id(st)
            storage_nbytes = st.nbytes()
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            ptr, storage_nbytes = None, nbytes  # no plain storage: zero tensors, wrappers
        ts = getattr(self._tls, "state", None) or self._thread()
        # -- classify
        if not self.enabled:
            reason = policy.DISABLED
        else:
            reason = _classify(t, self.device, self.min_offload_size, ts.excluded_depth > 0, self._static_ptrs,
                               self._running_owner, nbytes, ptr, ts.after_head)
        # -- act
        device = t.device
        dev = _DEVICE_NAMES.get(device) or _device_name(device)
        if ptr:
            ident = key = (dev, ptr)
        else:
            # No storage (zero tensors, wrappers) or an empty one (all at
            # address 0): keyed by the tensor itself, so each save counts once.
            ident, key = ("id", id(t)), ("", 0)
        if reason == policy.UNSUPPORTED_TYPE or reason == policy.DISABLED:
            shape = policy.shape_of(t)  # strided nested tensors have no single shape
        else:
            shape = tuple(t.shape)
        dtype = t.dtype
        # Positional: a keyword call of this dataclass costs 2.5x as much.
        rec = PackRecord(seq, self.ledger.current_step, nbytes, shape,
                         _DTYPE_NAMES.get(dtype) or policy.dtype_name(dtype),
                         dev, current_module_name(), KEPT, reason, key[1], storage_nbytes)
        step = self._open_step()
        if reason:
            self._inflight and self._sched.kept()  # (NOTE [ Copy schedule ] items 1, 2)
            handle: Any = (_saved_alias(t), t._version, step)
        else:  # (the reference _pack is tested against: what _pack hands over is never offloaded)
            lo_b, hi_b = byte_span(t)
            handle = self._offload(t, rec, key, ts, step, dtype, device, t._base, es, t.is_contiguous(), lo_b, hi_b)
        # -- record
        unique = 0
        r = rec.reason
        if r != policy.PARAMETER and r != policy.BUFFER and r != policy.UNSUPPORTED_TYPE:
            # The bytes this save's span adds to the step's union of saved spans
            # (offload._spans: what the profilers count too).
            lo_b, hi_b = (0, nbytes) if ident[0] == "id" else byte_span(t)
            unique = self._seen.add_span(t, ident, lo_b, hi_b)
        self.ledger.add(rec, unique)
        if self._observers or _tls.__dict__.get("observers"):
            _notify(self, t, rec)
        return handle

    def _record_span(self, t: torch.Tensor, key: tuple[str, int], lo_b: int, hi_b: int) -> None:
        """Log the bytes this save's span ``[lo_b, hi_b)`` of its storage ``key`` (device, address)
        adds to the step's union of saved spans (offload._spans: what the profilers count too), where
        ``_pack``'s inlined first case (a storage not seen this step, or seen through a saver now dead)
        does not apply: ``SpanSet.add_span``."""
        if not key[1]:  # an empty storage (all at address 0): keyed by the tensor itself
            unique = self._seen.add_span(t, ("id", id(t)), 0, t.numel() * t.element_size())
        else:
            unique = self._seen.add_span(t, key, lo_b, hi_b)
        if unique:
            self.ledger.unique_log.append(unique)

    def _open_step(self) -> _Step:
        """The open ledger step's ``_Step`` (new after every close), which each handle holds."""
        step = self._step_ref()
        if step is None:
            step = _Step(self)
            self._step_ref = weakref.ref(step)
        return step

    # -- offloading ---------------------------------------------------------------

    def _offload(self, t: torch.Tensor, rec: PackRecord, key: tuple[str, int], ts: "_ThreadState",
                 step: _Step, dtype: torch.dtype, device: torch.device, base: torch.Tensor | None, es: int,
                 contiguous: bool, lo_b: int, hi_b: int, read: tuple[Any, int, bool, bool, tuple] | None = None) -> Any:
        """The handle of an offload candidate: its storage's host copy of this step (Rule 7) or a
        new one; kept (reason ``host_budget``) when the host has no room (Rule 9). The caller's
        facts come as arguments: ``base`` (``t._base``), ``es`` (its item size), ``contiguous``
        and the bytes ``[lo_b, hi_b)`` of its storage ``t`` can touch; ``read``: ``(version tracker
        or None, t._version, t.is_conj(), t.is_neg(), t.stride())`` when the caller read them (the
        C++ hook), else read here."""
        if base is None:
            base = t
        if read is None:
            tracker = None
            version = t._version
            conj, neg = t.is_conj(), t.is_neg()
            stride = None
        else:
            tracker, version, conj, neg, stride = read
        ref = self._dedupe.get(key) if self.dedupe else None
        hc = ref() if ref is not None else None
        if hc is not None:  # (a dead first saver is a reused address, not a shared storage: no call)
            base_ref = hc.base_ref
            live = base_ref is not None and base_ref() is not None
            hc = self._shared_copy(t, key, hc, device, es, lo_b, hi_b) if live else None
        entry = None
        if hc is not None:  # recorded as kept: no copy of its own (Rule 7)
            rec.reason = policy.DUPLICATE_STORAGE
            rec.tier = hc.tier
        else:
            made = self._copy_out(t, rec, dtype, device, contiguous, lo_b, hi_b, version, base, conj or neg)
            if made is None:
                rec.reason = policy.HOST_BUDGET
                return (_saved_alias(t), version, step)
            hc, entry = made
            if self.dedupe and hc.gathered is None:  # (a gathered copy holds one view's elements: not shared)
                self._dedupe[key] = weakref.ref(hc)
        h = _Offloaded()
        h.engine = self
        h.step = step
        h.hc = hc
        hc.users += 1
        # Lazy conj/neg bits live on the view, not in the bytes (Rule 5). layout: (shape, stride,
        # offset in elements of the host copy, dtype, device, conj, neg), one tuple, not seven slots.
        h.layout = (rec.shape, stride or t.stride(), (lo_b - hc.lo) // es if hc.gathered is None else 0, dtype,
                    device, conj, neg)
        # Rule 6: an empty alias sharing t's version counter, not its storage
        # (a weak reference where the tensor refuses one).
        h.version = version
        if tracker is None:
            tracker = _torch_private.version_tracker(t, device)
        h.tracker = tracker if tracker is not None else policy._weak(t)
        h.rec = rec
        h.stash = entry
        if self.prefetch_bytes or self._backend.name != "sync" or self.tiers.disk is not None:
            self._add_to_order(h, ts)
        else:  # nothing loads ahead of a synchronous copy (prefetch_budget): no order to keep
            h.index = -1
            h.order = None
        return h

    def _shared_copy(self, t: torch.Tensor, key: tuple[str, int], hc: _HostCopy, device: torch.device, es: int,
                     lo_b: int, hi_b: int) -> _HostCopy | None:
        """``hc`` (this step's host copy of storage ``key``) if it holds ``t``'s current bytes, its
        span ``[lo_b, hi_b)`` (Rule 7); ``device`` and ``es`` (item size) as ``_offload`` has them."""
        # Same storage only while the first saver's base is alive on it and
        # unmodified since its copy.
        b = policy.live_base(hc.base_ref, key)
        if b is None or b._version != hc.version:
            return None
        if lo_b < hc.lo or hi_b > hc.lo + hc.nbytes or (lo_b - hc.lo) % es:
            return None
        if hc.synchronous and device.type == "cpu" and hi_b > lo_b and type(t) is not _FAKE_TENSOR:
            # (A fake tensor has no bytes to compare: the version test above is all there is.)
            # Writes through an alias with its own version counter (.data,
            # numpy, DLPack) are invisible to the version test: compare the
            # bytes (the copy is complete; this is cheaper than a new copy).
            if hc.tier == "disk":  # the whole copy's bytes, against its staging or its CRC-32 (no read)
                now = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), hc.lo, (hc.nbytes,), (1,))
                return hc if self.tiers.disk.holds(hc.buf, now) else None
            now = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), lo_b, (hi_b - lo_b,), (1,))
            if not torch.equal(now, hc.buf.tensor[lo_b - hc.lo:hi_b - hc.lo]):
                return None
        return hc

    # -- the pack order backward prefetches along (Rule 12: per thread) -------------------

    def _add_to_order(self, h: _Offloaded, ts: "_ThreadState") -> None:
        """Append ``h`` to its thread's pack order (what prefetch walks backwards)."""
        order = ts.order
        with self._lock:
            if len(order) >= self._order_compact_at:
                self._compact(order)
                self._order_compact_at = max(1024, 2 * len(order))
            h.index = len(order)
            h.order = h.step.order = order
            order.append(weakref.ref(h))

    @staticmethod
    def _compact(order: list[weakref.ref]) -> None:
        """Drop dead handles from a pack-order list and renumber the live ones (lock held)."""
        live = []
        for r in order:
            h = r()
            if h is not None:
                h.index = len(live)
                live.append(r)
        order[:] = live


def _log_offload(ledger: Any, rec: PackRecord, nbytes: int) -> None:
    """Ledger.add's logs for an offload candidate (the offload path's share of ``_pack``'s record step)."""
    if rec.decision == OFFLOADED:
        ledger.offloaded_log.append(nbytes)
        ledger.tier_log[rec.tier].append(rec.copy_bytes)
    else:  # a shared copy (Rule 7), or no room on the host (Rule 9)
        ledger.log_kept(rec.reason, nbytes)
