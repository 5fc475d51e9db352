"""The engine's pack side: classify -> act -> record, once per saved tensor.

``_pack`` is the pack hook ``__enter__`` pushes. It reads a tensor's facts once,
asks ``policy.classify`` (the one Python statement of the rules), then acts
(keeps the tensor in a tuple handle, or offloads it: a shared host copy when
its storage was copied already this step, Rule 7, else a new copy through
``_Copies._copy_out``) and records the decision in the ledger's logs (NOTE
[ Ledger logs ]) and for the observers. ``offload/_native/pack.cpp`` restates
the keep path in C++ (``native_hooks=True``); ``tests/offload/test_native.py``
compares the two record by record. A mixin of ``OffloadActivations``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import _torch_private, policy
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
_PARAMETER, _BUFFER, _UNSUPPORTED_TYPE = policy.PARAMETER, policy.BUFFER, policy.UNSUPPORTED_TYPE


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
    _owner_memo: dict[tuple[int, int, int], tuple[frozenset[int], frozenset[int]]]
    _order_compact_at: int
    tiers: Any

    # _pack runs for every saved tensor on the kernel-launching thread: its CPU time is step
    # time (``python -m bench.hook_cost``). A plain tensor with a storage takes this path, each
    # fact about it read once; everything else (subclasses, sparse, nested, quantized, zero
    # tensors, pass-through) goes through _pack_other. It reads classify -> act -> record.
    def _pack(self, t: torch.Tensor) -> Any:
        cls = type(t)
        if (cls is not _Tensor and cls is not _Parameter) or not self.enabled:
            return self._pack_other(t)
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            shape = t.shape  # a strided nested tensor has no single shape: it raises
        except (RuntimeError, NotImplementedError):
            return self._pack_other(t)  # no plain storage: sparse, mkldnn, efficient zeros
        try:
            ts = self._tls.state
        except AttributeError:
            ts = self._thread()
        dtype = t.dtype
        nbytes = shape.numel() * dtype.itemsize  # t.nbytes, without a tensor getter
        # -- classify
        reason = _classify(t, self.device, self.min_offload_size, ts.excluded_depth > 0, self._static_ptrs,
                           self._running_owner, nbytes, ptr, ts.after_head)
        if reason is _UNSUPPORTED_TYPE:
            return self._pack_other(t)  # nothing done yet: quantized, nested
        # -- act
        device = t.device
        dev = self._device_name if device == self.device else (_DEVICE_NAMES.get(device) or _device_name(device))
        step = self._step_ref() or self._open_step()  # (a _Step is always true)
        stack = ts.module_stack  # _module_of, inlined: its named case is one dict read
        module = (_module_names.get(id(stack[-1])) or _module_of(ts)) if stack else ""
        ledger = self.ledger
        if reason:
            # Kept: a tuple handle (no __del__): the tensor, detached when it has autograd history
            # (Rule 10; _saved_alias inlined), and the version to check at unpack (Rule 6).
            handle: Any = (t if t.is_leaf else t.detach(), t._version, step)
            # The record as a tuple, tuple(shape) not the torch.Size (NOTE [ Ledger logs ]).
            rec: Any = (next(self._seq), ledger.current_step, nbytes, tuple(shape), dtype, dev, module,
                        KEPT, reason, ptr, len(st))  # len: st.nbytes() without the argument parsing
            ledger.kept_log[reason].append(nbytes)  # every reason has its list (Ledger.reset)
        else:
            rec = PackRecord(next(self._seq), ledger.current_step, nbytes, tuple(shape),
                             _DTYPE_NAMES.get(dtype) or policy.dtype_name(dtype), dev, module,
                             KEPT, reason, ptr, st.nbytes())
            handle = self._offload(t, rec, (dev, ptr), ts, step, dtype, device)
            if handle is None:  # no room on the host (Rule 9)
                handle = (_saved_alias(t), t._version, step)
            reason = rec.reason
            if rec.decision == OFFLOADED:
                ledger.offloaded_log.append(nbytes)
                ledger.d2h_log.append(rec.copy_bytes)
            else:
                ledger.log_kept(reason, nbytes)
        # -- record
        ledger._open_used = True
        if reason is not _PARAMETER and reason is not _BUFFER:
            unique = self._unique_bytes(t, dev, ptr, dtype.itemsize, nbytes)
            if unique:
                ledger.unique_log.append(unique)
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
        """``_pack`` for everything but a plain tensor with a storage (and for pass-through)."""
        seq = next(self._seq)
        es = t.element_size()
        nbytes = t.numel() * es
        try:
            st = t.untyped_storage()
            ptr, storage_nbytes = st.data_ptr(), st.nbytes()
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
            handle: Any = (_saved_alias(t), t._version, step)
        else:
            handle = self._offload_or_keep(t, rec, key, ts, step, dtype, device)
        # -- record
        unique = 0
        r = rec.reason
        if r != policy.PARAMETER and r != policy.BUFFER and r != policy.UNSUPPORTED_TYPE:
            # The bytes this save's span adds to the step's union of saved spans
            # (offload._spans: what the profilers count too).
            if ident[0] == "id":
                lo_b, hi_b = 0, nbytes
            elif reason == policy.DISABLED:
                lo_b, hi_b = byte_span(t)
            else:
                lo_b = t.storage_offset() * es
                hi_b = lo_b + nbytes if t.is_contiguous() else byte_span(t)[1]
            unique = self._seen.add_span(t, ident, lo_b, hi_b)
        self.ledger.add(rec, unique)
        if self._observers or _tls.__dict__.get("observers"):
            _notify(self, t, rec)
        return handle

    def _unique_bytes(self, t: torch.Tensor, dev: str, ptr: int, itemsize: int, nbytes: int) -> int:
        """The bytes this save's span adds to the step's union of saved spans (offload._spans:
        what the profilers count too)."""
        if not ptr:  # an empty storage (all at address 0): keyed by the tensor itself
            return self._seen.add_span(t, ("id", id(t)), 0, nbytes)
        lo_b = t.storage_offset() * itemsize
        hi_b = lo_b + nbytes if t.is_contiguous() else byte_span(t)[1]
        ident: Any = (dev, ptr)
        seen = self._seen.entries
        entry = seen.get(ident)
        # A storage not seen this step (most saves), or seen through a saver now dead (its
        # address reused): SpanSet.add_span's own first case, inlined.
        if (entry is None or (type(entry) is tuple and entry[0]() is None)) and hi_b > lo_b:
            base = t._base
            seen[ident] = (weakref.ref(t if base is None else base), lo_b, hi_b)
            return hi_b - lo_b
        return self._seen.add_span(t, ident, lo_b, hi_b)

    def _open_step(self) -> _Step:
        """The open ledger step's ``_Step`` (new after every close), which each handle holds."""
        step = self._step_ref()
        if step is None:
            step = _Step(self)
            self._step_ref = weakref.ref(step)
        return step

    def _running_owner(self, ptr: int) -> str:
        """PARAMETER / BUFFER when a parameter or buffer of a running module lives on ``ptr``.

        Catches buffers (RoPE tables) and parameters saved through storage
        aliases without knowing the model in advance. The storages of the
        running modules' parameters and buffers are collected once per step
        for each (innermost, outermost, depth) of the module stack, so an
        offload candidate costs one set lookup (the memo is dropped at every
        outermost enter: FSDP2 re-gathers parameters into new storages).
        """
        stack = current_modules_view()
        if not stack:
            return ""
        key = (id(stack[-1]), id(stack[0]), len(stack))
        owned = self._owner_memo.get(key)
        if owned is None:
            owned = self._owner_memo[key] = policy.owned_storages(stack)
        if ptr in owned[0]:
            return _PARAMETER
        if ptr in owned[1]:
            return _BUFFER
        return ""

    # -- offloading ---------------------------------------------------------------

    def _offload_or_keep(self, t: torch.Tensor, rec: PackRecord, key: tuple[str, int], ts: "_ThreadState",
                         step: _Step, dtype: torch.dtype, device: torch.device) -> Any:
        """The handle of an offload candidate: offloaded, or kept where the host has no room (Rule 9)."""
        handle = self._offload(t, rec, key, ts, step, dtype, device)
        return handle if handle is not None else (_saved_alias(t), t._version, step)

    def _offload(self, t: torch.Tensor, rec: PackRecord, key: tuple[str, int], ts: "_ThreadState",
                 step: _Step, dtype: torch.dtype, device: torch.device) -> _Offloaded | None:
        """An offloaded handle for ``t``: its storage's host copy of this step (Rule 7) or a new one;
        None (reason ``host_budget``) when the host has no room."""
        base = t._base
        if base is None:
            base = t
        version = t._version
        offset = t.storage_offset()
        conj, neg = t.is_conj(), t.is_neg()
        ref = self._dedupe.get(key) if self.dedupe else None
        hc = ref() if ref is not None else None
        if hc is not None:  # (a dead first saver is a reused address, not a shared storage: no call)
            base_ref = hc.base_ref
            hc = self._shared_copy(t, key, hc) if base_ref is not None and base_ref() is not None else None
        entry = None
        if hc is not None:
            rec.reason = policy.DUPLICATE_STORAGE
            rec.tier = hc.tier
        else:
            made = self._copy_out(t, rec, dtype, device, offset, version, base, conj or neg)
            if made is None:
                rec.reason = policy.HOST_BUDGET
                return None
            hc, entry = made
            if self.dedupe:
                self._dedupe[key] = weakref.ref(hc)
        h = _Offloaded()
        h.engine = self
        h.step = step
        h.hc = hc
        hc.users += 1
        # Lazy conj/neg bits live on the view, not in the bytes (Rule 5). layout: (shape, stride,
        # offset in elements of the host copy, dtype, device, conj, neg), one tuple, not seven slots.
        es = dtype.itemsize
        h.layout = (rec.shape, t.stride(), (offset * es - hc.lo) // es, dtype, device, conj, neg)
        # Rule 6: an empty alias sharing t's version counter, not its storage
        # (a weak reference where the tensor refuses one).
        h.version = version
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

    def _shared_copy(self, t: torch.Tensor, key: tuple[str, int], hc: _HostCopy) -> _HostCopy | None:
        """``hc`` (this step's host copy of storage ``key``) if it holds ``t``'s current bytes (Rule 7)."""
        # Same storage only while the first saver's base is alive on it and
        # unmodified since its copy.
        b = policy.live_base(hc.base_ref, key)
        if b is None or b._version != hc.version:
            return None
        es = t.element_size()
        lo, hi = policy.span_elems(t)
        lo_b, hi_b = lo * es, hi * es
        if lo_b < hc.lo or hi_b > hc.lo + hc.nbytes or (lo_b - hc.lo) % es:
            return None
        if hc.synchronous and t.device.type == "cpu" and hi_b > lo_b:
            if hc.tier == "disk":
                return None  # its bytes are in a file: copy again rather than read it back to compare
            # Writes through an alias with its own version counter (.data,
            # numpy, DLPack) are invisible to the version test: compare the
            # bytes (the copy is complete; this is cheaper than a new copy).
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
            h.order = order
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
