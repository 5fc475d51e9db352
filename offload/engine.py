"""OffloadActivations: move tensors saved for backward off the device and back.

A thin ``saved_tensors_hooks`` subclass. ``pack`` asks the policy, moves the
bytes into a pooled host buffer through a copy backend and returns a handle;
``unpack`` brings the bytes back (prefetching the next handles) and rebuilds
a tensor with the original size, stride and dtype. Every decision goes into
the ledger and to the pack observers.

NOTE [ Offload lifetime rules ]
Rule 1. A handle owns its host copy; the copy goes back to the pool when
        autograd drops the handle (graph freed), not at first unpack. So
        retain_graph, double backward, autograd.grad, several forwards before
        one backward, interleaved graphs and exceptions mid-forward need no
        phase state machine.
Rule 2. A source tensor stays alive until its device-to-host copy has
        completed (or its producer stream is ordered after the copy's event).
        In-flight copies are bounded in bytes (``max_inflight_bytes``) and in
        count (``max_fwd_stash_size``).
Rule 3. Streams are looked up live at pack/unpack time, never cached at
        construction: FSDP2, checkpoint recompute and custom Functions run
        backward on other streams.
Rule 4. Nothing the side stream writes is read by compute without an event
        wait. Reloaded tensors are allocated on the compute stream (never on
        the side stream); the side stream waits on compute before writing
        into them; a consumer on another stream gets ``record_stream``.
Rule 5. Unpack returns a tensor with the original size, stride, storage
        offset (relative to the bytes kept), dtype and device: the byte span
        of the storage is copied, not a compacted clone.
Rule 6. Hooks bypass autograd's in-place check, so the version counter is
        recorded at pack and checked at unpack, raising autograd's error.
Rule 7. Parameters, buffers and views of them are never offloaded; a
        storage saved twice in a step is offloaded once and shared.
Rule 8. Excluded regions still pass through pack and are recorded as kept
        with reason ``excluded_region``; NoOpManager (identity hooks) is
        invisible to accounting by design.
Rule 9. Host memory is budgeted (pool cap ``host_budget_bytes`` and system
        RAM ceiling ``virtual_memory_safe_pct``) and enforced by
        ``on_host_budget`` = keep | pageable | raise, never only a warning.
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _torch_private, policy
from .errors import OffloadError, _internal_assert
from .ledger import KEPT, OFFLOADED, Ledger, PackRecord
from .modules import current_module_name, current_modules, track_modules
from .pool import PIN_ALLOCATORS, HostBuffer, HostPool
from .streams import Copy, make_backend

if TYPE_CHECKING:
    from .regions import RegionHandle

__all__ = ["OffloadActivations", "PackEvent", "add_pack_observer", "active_engine"]

_ON_HOST_BUDGET = ("keep", "pageable", "raise")
_MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class PackEvent:
    """What an observer sees for every tensor the engine packs."""

    tensor: torch.Tensor
    """The tensor autograd saved (do not keep a reference: it defeats offloading)."""
    record: PackRecord
    """The ledger record of the decision."""
    engine: "OffloadActivations"
    """The engine that made the decision."""


_tls = threading.local()


def _engines() -> list["OffloadActivations"]:
    st = getattr(_tls, "engines", None)
    if st is None:
        st = _tls.engines = []
    return st


def _global_observers() -> "OrderedDict[int, Callable[[PackEvent], None]]":
    # OrderedDict, not dict: RemovableHandle keeps a weak reference to it.
    d = getattr(_tls, "observers", None)
    if d is None:
        d = _tls.observers = OrderedDict()
    return d


def active_engine() -> "OffloadActivations | None":
    """The innermost OffloadActivations entered on this thread, or None."""
    st = _engines()
    return st[-1] if st else None


def add_pack_observer(fn: Callable[[PackEvent], None]) -> RemovableHandle:
    """Call ``fn(event)`` for every pack of any engine active on this thread.

    This is how profilers measure an offloaded forward without installing
    their own saved-tensors hooks (only the innermost hooks run, so a
    profiler's hooks inside the engine's would silently turn offloading off).
    """
    d = _global_observers()
    h = RemovableHandle(d)
    d[h.id] = fn
    return h


# -- handles -----------------------------------------------------------------


def _inplace_error(shape: torch.Size, dtype: torch.dtype, now: int, expected: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{dtype} {list(shape)}] is at version {now}; expected version "
        f"{expected} instead. (Detected by offload: saved-tensor hooks bypass autograd's own "
        "check, so the engine checks the version itself. Hint: clone the tensor before "
        "modifying it in place, or do the in-place op after backward.)"
    )


class _Kept:
    """A tensor left where it is; only its version is checked at unpack (Rule 6)."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise _inplace_error(t.shape, t.dtype, t._version, self.version)
        return t


class _HostCopy:
    """Bytes [lo, lo + nbytes) of one storage, held in a host buffer (Rule 1).

    Shared by every handle whose tensor aliases that storage (Rule 7); goes
    back to the pool when the last handle is dropped.
    """

    __slots__ = ("buf", "pool", "lo", "nbytes", "prefetched", "held", "users", "used",
                 "version", "base_ref", "release", "__weakref__")

    def __init__(self, buf: HostBuffer, pool: HostPool, lo: int, nbytes: int) -> None:
        self.buf = buf
        self.pool = pool
        self.lo = lo
        self.nbytes = nbytes
        self.prefetched: tuple[torch.Tensor, Copy] | None = None
        # Reloaded device bytes, held while other handles sharing this copy
        # have not been unpacked yet in this backward pass.
        self.held: tuple[torch.UntypedStorage, Copy] | None = None
        self.users = 0
        self.used = 0
        # backend.release_after, to order a never-consumed prefetch's
        # allocation stream after its copy when this dies (Rule 4).
        self.release: Callable[[Copy, Any], None] | None = None
        self.version = 0
        self.base_ref: weakref.ref | None = None

    def __del__(self) -> None:
        try:
            if self.prefetched is not None and self.release is not None:
                copy = self.prefetched[1]
                self.release(copy, copy.stream)
            self.pool.give(self.buf)
        except Exception:  # interpreter shutdown: nothing left to return to
            pass


class _StashEntry:
    """A source tensor kept alive until its D2H copy is done (Rule 2)."""

    __slots__ = ("src", "copy", "nbytes")

    def __init__(self, src: torch.Tensor, copy: Copy, nbytes: int) -> None:
        self.src: torch.Tensor | None = src
        self.copy = copy
        self.nbytes = nbytes


class _Offloaded:
    """Handle returned by pack for an offloaded tensor."""

    __slots__ = ("hc", "shape", "stride", "offset", "dtype", "device", "version", "base_ref",
                 "rec", "index", "stash", "conj", "neg", "__weakref__")

    def unpack(self, engine: "OffloadActivations") -> torch.Tensor:
        return engine._reload(self)


def _base_of(t: torch.Tensor) -> torch.Tensor:
    b = t._base
    return t if b is None else b


# -- argument checks -----------------------------------------------------------


def _check_int(name: str, value: Any, minimum: int, why: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"OffloadActivations: {name}={value!r} is invalid: expected an int >= {minimum}"
            f"{' or None' if allow_none else ''} ({why})."
        )


def _resolve_device(device: Any) -> torch.device | None:
    if device is None:
        if not torch.accelerator.is_available():
            return None
        acc = torch.accelerator.current_accelerator()
        idx_fn = getattr(torch.accelerator, "current_device_index", None) or torch.accelerator.current_device_idx
        return torch.device(acc.type, idx_fn())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(
            f"OffloadActivations: device={device!r} is not a device ({e}). Pass None for the "
            "current accelerator, 'cpu' to offload CPU tensors into the host pool, or e.g. 'cuda:0'."
        ) from None
    if dev.type == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, dev.type, None)
    available = mod is not None and hasattr(mod, "is_available") and mod.is_available()
    if not available:
        raise ValueError(
            f"OffloadActivations: device={device!r} is not available on this machine "
            f"(torch.{dev.type}.is_available() is False). Pass None to use the current "
            "accelerator (pass-through when there is none) or 'cpu'."
        )
    idx = dev.index if dev.index is not None else mod.current_device()
    count = mod.device_count()
    if idx >= count:
        raise ValueError(
            f"OffloadActivations: device={device!r} does not exist: this machine has {count} "
            f"{dev.type} device(s) (indices 0..{count - 1})."
        )
    return torch.device(dev.type, idx)


# -- the engine ----------------------------------------------------------------


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Offload activations saved for backward to host memory; bring them back for backward.

    Enter it around the forward pass; run backward outside it (torchtune's
    usage). See NOTE [ Offload lifetime rules ] in this module.

    Args (torchtune-compatible head):
        use_pin_memory: page-lock host buffers when an accelerator is used.
        use_streams: copy on a side stream so copies overlap compute; silently
            synchronous on CPU or when the device has no streams.
        max_fwd_stash_size: most in-flight D2H copies whose source is kept alive.
        min_offload_size: tensors with fewer bytes stay on the device.

    Keyword-only:
        device: the device whose tensors are offloaded. None = the current
            accelerator (pass-through with one warning when there is none);
            "cpu" offloads CPU tensors into the host pool (exercises the whole
            path without a GPU).
        max_inflight_bytes: bound on bytes of in-flight D2H copies (sources alive).
        prefetch_bytes: how many bytes of upcoming handles backward loads ahead.
            None (default) = twice the largest single copy made so far: enough
            to keep the next copies in flight while compute uses the current
            one, without reloading the whole step at the first unpack (which
            would give the memory back). 0 turns prefetch off.
        host_budget_bytes: cap on host pool bytes; None = no fixed cap.
        on_host_budget: what happens to a tensor that does not fit: "keep" it on
            the device, copy it to unpooled "pageable" memory, or "raise" OffloadError.
        virtual_memory_safe_pct: system RAM use (percent) above which the pool
            allocates nothing new (the on_host_budget policy applies); None = off.
        model: optional model whose parameters and buffers are never offloaded
            (they are also detected without it, by storage, while modules run).
        dedupe: share one host copy between saves of the same storage.
        max_records: how many per-decision records the ledger retains.
        timing: time copies with device events (accelerators) or clocks (CPU).
        pin_allocator: "caching" (default: torch's pinned allocator, which rounds
            each block up to a power of two) or "exact" (CUDA: exact-size buffers
            registered with cudaHostRegister; not yet validated on a GPU).
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        max_fwd_stash_size: int = 5,
        min_offload_size: int = 1024,
        *,
        device: torch.device | str | None = None,
        max_inflight_bytes: int = 1024 * _MiB,
        prefetch_bytes: int | None = None,
        host_budget_bytes: int | None = None,
        on_host_budget: str = "keep",
        virtual_memory_safe_pct: float | None = 90.0,
        model: nn.Module | None = None,
        dedupe: bool = True,
        max_records: int = 10_000,
        timing: bool = True,
        pin_allocator: str = "caching",
    ) -> None:
        _check_int("max_fwd_stash_size", max_fwd_stash_size, 1,
                   "it bounds how many tensors may have a device-to-host copy in flight")
        _check_int("min_offload_size", min_offload_size, 0, "a size in bytes")
        _check_int("max_inflight_bytes", max_inflight_bytes, 1, "a size in bytes")
        _check_int("prefetch_bytes", prefetch_bytes, 0,
                   "a size in bytes; 0 turns prefetch off, None sizes it from the copies", allow_none=True)
        _check_int("host_budget_bytes", host_budget_bytes, 0, "a size in bytes", allow_none=True)
        _check_int("max_records", max_records, 0, "a count of records")
        if pin_allocator not in PIN_ALLOCATORS:
            raise ValueError(
                f"OffloadActivations: pin_allocator={pin_allocator!r} is not one of "
                f"{PIN_ALLOCATORS}: 'caching' uses PyTorch's pinned allocator, 'exact' registers "
                "exact-size buffers with cudaHostRegister (no power-of-two rounding)."
            )
        if on_host_budget not in _ON_HOST_BUDGET:
            raise ValueError(
                f"OffloadActivations: on_host_budget={on_host_budget!r} is not a policy; "
                f"choose one of {_ON_HOST_BUDGET}."
            )
        if virtual_memory_safe_pct is not None and not (0 < float(virtual_memory_safe_pct) <= 100):
            raise ValueError(
                f"OffloadActivations: virtual_memory_safe_pct={virtual_memory_safe_pct!r} is invalid: "
                "expected a percentage in (0, 100], or None to turn the RAM ceiling off."
            )
        self.device = _resolve_device(device)
        """Device whose saved tensors are offloaded; None when pass-through."""
        self.enabled = self.device is not None
        """False when running pass-through (nothing moved, everything recorded)."""
        if not self.enabled:
            warnings.warn(
                "OffloadActivations: no accelerator is available and device=None, so the engine "
                "runs pass-through: nothing is moved and every saved tensor is recorded in "
                "ctx.ledger with reason 'disabled'. Pass device='cpu' to offload CPU tensors "
                "into the host pool instead.",
                stacklevel=2,
            )
        self.use_pin_memory = use_pin_memory
        self.use_streams = use_streams
        self.max_fwd_stash_size = max_fwd_stash_size
        self.min_offload_size = min_offload_size
        self.max_inflight_bytes = max_inflight_bytes
        self.prefetch_bytes = prefetch_bytes
        self._max_copy_bytes = 0
        self.host_budget_bytes = host_budget_bytes
        self.on_host_budget = on_host_budget
        self.virtual_memory_safe_pct = virtual_memory_safe_pct
        self.dedupe = dedupe
        self.timing = timing
        self._model_ref = weakref.ref(model) if model is not None else None

        dev_type = self.device.type if self.device is not None else None
        self.pool = HostPool(
            pin=bool(use_pin_memory and dev_type not in (None, "cpu")),
            capacity_bytes=host_budget_bytes,
            device_type=dev_type,
            pin_allocator=pin_allocator,
        )
        """The host buffer pool (``pool.stats()`` for its counters)."""
        self.ledger = Ledger(max_records=max_records, pool_stats=self.pool.stats)
        """Every decision and per-step totals (``ledger.summary()``)."""
        self._backend = make_backend(self.device, use_streams, timing=timing) if self.enabled else None
        self._observers: OrderedDict[int, Callable[[PackEvent], None]] = OrderedDict()
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._static_ptrs: set[int] = set()
        self._excluded_depth = 0
        self._regions: list[Any] = []
        self._exit_stack: list[Any] = []
        self._stash: deque[_StashEntry] = deque()
        self._stash_bytes = 0
        self._order: list[weakref.ref] = []
        self._dedupe: dict[tuple[str, int], weakref.ref] = {}
        self._seen = policy.StorageSet()
        # Weak: a failed backward never reaches _end_of_backward, and these
        # must not keep host copies (or reloaded device bytes) alive after the
        # graph is freed.
        self._prefetched: list[weakref.ref] = []
        self._touched: list[weakref.ref] = []
        self._prefetched_bytes = 0
        self._last_graph_task = -1
        self._process = psutil.Process()
        super().__init__(self._pack, self._unpack)

    # -- context ---------------------------------------------------------------

    @property
    def backend(self) -> str:
        """"stream", "sync", or "none" (pass-through)."""
        return self._backend.name if self._backend is not None else "none"

    def __enter__(self) -> "OffloadActivations":
        modules_cm = track_modules()
        modules_cm.__enter__()
        self._exit_stack.append(modules_cm)
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            self._static_ptrs = {
                policy.storage_ptr(t) for t in itertools.chain(model.parameters(), model.buffers())
            }
        if self._last_graph_task != -1 and _torch_private.graph_task_id() == -1:
            # A backward pass began but never finished (it raised): autograd
            # skips end-of-backward callbacks then, so clean up here.
            self._end_of_backward()
        self._poll_stash()
        _engines().append(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            st = _engines()
            if st and st[-1] is self:
                st.pop()
            elif self in st:
                st.remove(self)
            if self._exit_stack:
                self._exit_stack.pop().__exit__(*exc)
            if exc and exc[0] is not None:
                # The forward died: its graph (and our handles) will be freed
                # with the traceback. Release sources now rather than at the
                # next backward that may never come.
                self._drain_stash()

    # -- regions ---------------------------------------------------------------

    def exclude(self, module: nn.Module) -> "RegionHandle":
        """Keep every tensor saved inside ``module``'s forward on the device.

        The tensors still pass through the engine and are recorded as kept
        with reason ``excluded_region`` (Rule 8). Returns a handle whose
        ``remove()`` undoes the exclusion.
        """
        from .regions import exclude_module

        return exclude_module(self, module)

    @contextmanager
    def excluded(self) -> Iterator[None]:
        """Keep every tensor saved inside this block on the device (recorded, Rule 8)."""
        self._excluded_depth += 1
        try:
            yield
        finally:
            self._excluded_depth -= 1

    def add_observer(self, fn: Callable[[PackEvent], None]) -> RemovableHandle:
        """Call ``fn(event)`` for every pack of this engine."""
        h = RemovableHandle(self._observers)
        self._observers[h.id] = fn
        return h

    # -- pack --------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        # Runs for every saved tensor on the kernel-launching thread: its CPU
        # time is step time. Each fact about ``t`` is read once; no system call.
        seq = next(self._seq)
        nbytes = t.numel() * t.element_size()
        try:
            st = t.untyped_storage()
            ptr, storage_nbytes = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            ptr, storage_nbytes = None, nbytes  # no plain storage: zero tensors, wrappers
        if not self.enabled:
            reason = policy.DISABLED
        else:
            reason = policy.classify(
                t,
                device=self.device,
                min_offload_size=self.min_offload_size,
                excluded=self._excluded_depth > 0,
                static_ptrs=self._static_ptrs,
                stack_modules=current_modules,
                nbytes=nbytes,
                ptr=ptr,
            )
        dev = policy.device_name(t.device)
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
        # Positional: a keyword call of this dataclass costs 2.5x as much.
        rec = PackRecord(seq, self.ledger.current_step, nbytes, shape, policy.dtype_name(t.dtype),
                         dev, current_module_name(), KEPT, reason, key[1], storage_nbytes)
        handle: Any = None
        if not reason:
            handle = self._offload(t, rec, key)
        if handle is None:
            handle = _Kept(t)
        counts_unique = rec.reason not in (policy.PARAMETER, policy.BUFFER, policy.UNSUPPORTED_TYPE)
        self.ledger.add(rec, counts_unique and self._seen.first_save_of(t, ident, storage_nbytes) > 0)
        if self._observers or _global_observers():
            self._notify(t, rec)
        return handle

    def _notify(self, t: torch.Tensor, rec: PackRecord) -> None:
        glob = _global_observers()
        if not self._observers and not glob:
            return
        ev = PackEvent(t, rec, self)
        for fn in list(self._observers.values()):
            fn(ev)
        for fn in list(glob.values()):
            fn(ev)

    def _shared_copy(self, t: torch.Tensor, key: tuple[str, int]) -> _HostCopy | None:
        """The host copy already holding ``t``'s bytes this step, if any (Rule 7)."""
        ref = self._dedupe.get(key)
        hc = ref() if ref is not None else None
        if hc is None:
            return None
        # Same storage only while the first saver's base is alive on it and
        # unmodified since its copy.
        b = policy.live_base(hc.base_ref, key)
        if b is None or b._version != hc.version:
            return None
        es = t.element_size()
        lo, hi = policy.span_elems(t)
        if lo * es < hc.lo or hi * es > hc.lo + hc.nbytes or (lo * es - hc.lo) % es:
            return None
        return hc

    def _offload(self, t: torch.Tensor, rec: PackRecord, key: tuple[str, int]) -> _Offloaded | None:
        base = _base_of(t)
        es = t.element_size()
        hc = self._shared_copy(t, key) if self.dedupe else None
        entry = None
        if hc is not None:
            rec.reason = policy.DUPLICATE_STORAGE
        else:
            storage = t.untyped_storage()
            whole = storage.nbytes()
            lo, hi = policy.span_elems(t)
            lo_b, hi_b = lo * es, hi * es
            if 2 * (hi_b - lo_b) >= whole:
                # Most of the storage: copy all of it so sibling views (q, k, v
                # of one qkv projection) share this copy instead of re-copying.
                lo_b, hi_b = 0, whole
            nbytes = hi_b - lo_b
            buf, note = self._host_buffer(nbytes, rec)
            if buf is None:
                rec.reason = policy.HOST_BUDGET
                return None
            if nbytes > self._max_copy_bytes:
                self._max_copy_bytes = nbytes
            hc = _HostCopy(buf, self.pool, lo_b, nbytes)
            hc.release = self._backend.release_after
            hc.version = t._version
            hc.base_ref = weakref.ref(base)
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, lo_b, (nbytes,), (1,))
            copy = self._backend.d2h(src, buf.tensor)
            rec.decision = OFFLOADED
            rec.reason = ""
            rec.copy_bytes = nbytes
            rec.pinned = buf.pinned
            rec.note = note
            self.ledger.add_copy_time(rec, "d2h", copy)
            if self._backend.name == "sync":
                self.ledger.add_stall(copy.seconds or 0.0)
                self.ledger.note_inflight(nbytes)
            else:
                entry = _StashEntry(t, copy, nbytes)
                self._stash_push(entry)
            if self.dedupe:
                self._dedupe[key] = weakref.ref(hc)
        h = _Offloaded()
        h.hc = hc
        hc.users += 1
        h.shape = t.shape
        h.stride = t.stride()
        h.offset = (t.storage_offset() * es - hc.lo) // es
        h.dtype = t.dtype
        h.device = t.device
        # Lazy conj/neg bits live on the view, not in the bytes (Rule 5).
        h.conj = t.is_conj()
        h.neg = t.is_neg()
        h.version = t._version
        h.base_ref = weakref.ref(base)
        h.rec = rec
        h.stash = entry if rec.decision == OFFLOADED else None
        with self._lock:
            h.index = len(self._order)
            self._order.append(weakref.ref(h))
        return h

    def _host_buffer(self, nbytes: int, rec: PackRecord) -> tuple[HostBuffer | None, str]:
        """A host buffer for ``nbytes`` under the budget, applying ``on_host_budget`` (Rule 9)."""
        buf = self.pool.take(nbytes) if self._ram_allows(nbytes) else None
        if buf is not None:
            note = "pin_failed" if (self.pool.pin and not buf.pinned) else ""
            return buf, note
        if self.on_host_budget == "raise":
            st = self.pool.stats()
            raise OffloadError(
                f"OffloadActivations: host budget full: a {nbytes}-byte activation from module "
                f"{rec.module or '<top level>'!r} does not fit (host_budget_bytes="
                f"{self.host_budget_bytes}, pool reserved {st['reserved_bytes']} B, in use "
                f"{st['in_use_bytes']} B; virtual_memory_safe_pct={self.virtual_memory_safe_pct}, "
                f"system RAM at {psutil.virtual_memory().percent:.1f}%). Raise host_budget_bytes, "
                "offload less (min_offload_size, ctx.exclude(module)), or set "
                "on_host_budget='keep' to leave such tensors on the device."
            )
        if self.on_host_budget == "pageable" and self._ram_allows(nbytes):
            return self.pool.overflow(nbytes), "pageable_overflow"
        return None, ""

    def _ram_allows(self, nbytes: int) -> bool:
        pct = self.virtual_memory_safe_pct
        if pct is None or pct >= 100:
            return True
        # Sampled, not read per tensor: see policy.RamCeiling for the bound.
        try:
            gauge = self._ram_ceiling
        except AttributeError:
            gauge = self._ram_ceiling = policy.RamCeiling()
        return gauge.allows(nbytes, pct)

    # -- the stash of in-flight sources (Rule 2) ----------------------------------

    def _stash_push(self, entry: _StashEntry) -> None:
        with self._lock:
            self._stash.append(entry)
            self._stash_bytes += entry.nbytes
            self.ledger.note_inflight(self._stash_bytes)
            self._poll_stash()
            while self._stash and (
                len(self._stash) > self.max_fwd_stash_size or self._stash_bytes > self.max_inflight_bytes
            ):
                self._release_oldest()

    def _release_oldest(self) -> None:
        e = self._stash.popleft()
        self._stash_bytes -= e.nbytes
        self._backend.release_after(e.copy, e.copy.stream)
        e.src = None

    def _poll_stash(self) -> None:
        with self._lock:
            while self._stash and self._stash[0].copy.query():
                self._release_oldest()

    def _drain_stash(self) -> None:
        with self._lock:
            while self._stash:
                self._release_oldest()

    # -- unpack -----------------------------------------------------------------

    def _unpack(self, handle: Any) -> torch.Tensor:
        self._begin_backward_pass()
        if isinstance(handle, _Kept):
            return handle.unpack()
        _internal_assert(isinstance(handle, _Offloaded), f"unpack got a {type(handle).__name__}")
        return handle.unpack(self)

    def _begin_backward_pass(self) -> None:
        gid = _torch_private.graph_task_id()
        if gid != self._last_graph_task:
            self._last_graph_task = gid
            if gid >= 0:
                _torch_private.queue_end_of_backward(self._end_of_backward)

    def _reload(self, h: _Offloaded) -> torch.Tensor:
        b = h.base_ref()
        if b is not None and b._version != h.version:
            raise _inplace_error(h.shape, h.dtype, b._version, h.version)
        entry = h.stash
        if entry is not None and entry.src is not None:
            # The source is still alive (its copy may be in flight): use it as is.
            h.rec.note = "reused_source"
            return entry.src
        hc = h.hc
        storage, copy = None, None
        if hc.held is not None:
            storage, copy = hc.held
        elif hc.prefetched is not None:
            dev, copy = hc.prefetched
            hc.prefetched = None
            with self._lock:
                self._prefetched_bytes -= hc.nbytes
            storage = dev.untyped_storage()
        else:
            dev, copy = self._load(hc, h.rec)
            storage = dev.untyped_storage()
        self._wait(copy)
        out = torch.empty(0, dtype=h.dtype, device=h.device).set_(storage, h.offset, h.shape, h.stride)
        if h.conj:
            out = out.conj()
        if h.neg:
            out = _torch_private.neg_view(out)
        consumer = self._backend.current_stream()
        if consumer is not None and copy.stream is not None and consumer != copy.stream:
            out.record_stream(consumer)  # Rule 4: consumed on another stream than allocated
        with self._lock:
            if hc.used == 0:
                self._touched.append(weakref.ref(hc))
            hc.used += 1
            # Keep the bytes on the device until every sibling view has been
            # unpacked once, instead of reloading the storage per view.
            hc.held = (storage, copy) if hc.used < hc.users else None
        if self.prefetch_bytes != 0:
            self._prefetch_before(h.index)
        return out

    def _load(self, hc: _HostCopy, rec: PackRecord | None) -> tuple[torch.Tensor, Copy]:
        dev, copy = self._backend.h2d(hc.buf.tensor)
        self.ledger.add_copy_time(rec, "h2d", copy, hc.nbytes)
        if self._backend.name == "sync":
            self.ledger.add_stall(copy.seconds or 0.0)
        return dev, copy

    def _wait(self, copy: Copy) -> None:
        if copy.done is None:
            return
        if self.timing and not copy.query():
            # The copy is not done when compute needs it: time the exposed wait
            # with a pair of events on the compute stream around the wait.
            stream = self._backend.current_stream()
            start = self._backend._event()
            start.record(stream)
            self._backend.wait(copy)
            end = self._backend._event()
            end.record(stream)
            self.ledger.add_copy_time(None, "stall", Copy(end, None, start, stream))
        else:
            self._backend.wait(copy)

    @property
    def prefetch_budget(self) -> int:
        """Bytes backward may load ahead of need (``prefetch_bytes`` resolved)."""
        if self.prefetch_bytes is not None:
            return self.prefetch_bytes
        return 2 * self._max_copy_bytes

    def _prefetch_before(self, index: int) -> None:
        """Load the handles packed just before ``index`` (backward order) within the budget."""
        with self._lock:
            i = index - 1
            budget = self.prefetch_budget
            lookahead = 0
            while i >= 0 and lookahead < 64 and self._prefetched_bytes < budget:
                h = self._order[i]()
                i -= 1
                if h is None:
                    continue
                lookahead += 1
                hc = h.hc
                if hc.prefetched is not None or (h.stash is not None and h.stash.src is not None):
                    continue
                if hc.held is not None or hc.used >= hc.users:
                    continue  # on the device already, or consumed in this pass
                if self._prefetched_bytes + hc.nbytes > budget:
                    break
                hc.prefetched = self._load(hc, h.rec)
                self._prefetched_bytes += hc.nbytes
                self._prefetched.append(weakref.ref(hc))

    def _end_of_backward(self) -> None:
        """Close the ledger step, release sources and unused prefetches (Rule 1, 2)."""
        with self._lock:
            self._drain_stash()
            for ref in self._prefetched:
                hc = ref()
                if hc is not None and hc.prefetched is not None:
                    # Never consumed: the block goes back to its allocation
                    # stream's pool, so order that stream after the H2D write
                    # before dropping it (Rule 4).
                    _, copy = hc.prefetched
                    self._backend.release_after(copy, copy.stream)
                    hc.prefetched = None
            self._prefetched.clear()
            self._prefetched_bytes = 0
            for ref in self._touched:
                hc = ref()
                if hc is not None:
                    hc.held = None  # consumed (waited on) by compute: safe to drop
                    hc.used = 0
            self._touched.clear()
            self._order = [r for r in self._order if r() is not None]
            for i, r in enumerate(self._order):
                r().index = i
            self._dedupe = {k: r for k, r in self._dedupe.items() if r() is not None}
            self._last_graph_task = -1
        self.close_step()

    def close_step(self) -> None:
        """Close the ledger's open step now (done automatically at the end of each backward)."""
        dev_peak = None
        if self.device is not None and self.device.type != "cpu":
            try:
                dev_peak = int(torch.accelerator.max_memory_allocated(self.device))
            except Exception:
                dev_peak = None
        self.pool.trim()
        if self._regions:
            from .regions import warn_unused_regions

            warn_unused_regions(self)
        self.ledger.close_step(
            pool=self.pool.stats(),
            host_rss_bytes=self._process.memory_info().rss,
            device_peak_allocated_bytes=dev_peak,
        )
        with self._lock:
            self._dedupe.clear()
            self._seen.clear()

    def __repr__(self) -> str:
        return (
            f"OffloadActivations(device={self.device}, backend={self.backend}, "
            f"min_offload_size={self.min_offload_size}, on_host_budget={self.on_host_budget!r})"
        )
