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
        When sources go and reloads start, by device memory: NOTE [ Copy
        schedule ] in ``offload/_schedule.py``.
Rule 3. Streams are looked up live at pack/unpack time, never cached at
        construction: FSDP2, checkpoint recompute and custom Functions run
        backward on other streams.
Rule 4. Nothing the side stream writes is read by compute without an event
        wait. Reloaded tensors are allocated on the compute stream (never on
        the side stream); the side stream waits on compute before writing
        into them; a consumer on another stream gets ``record_stream``.
Rule 5. Unpack returns a tensor with the original size, stride, storage
        offset (relative to the bytes kept), dtype and device: the byte span
        of the storage is copied, not a compacted clone. A view spread over
        more than twice its bytes (v of a fused qkv projection, a strided
        slice) is the exception on the link only: its elements are gathered
        densely before the copy and scattered back after the reload into a
        new tensor of its size and stride (offset 0), so the link moves its
        bytes, not its span's.
Rule 6. Hooks bypass autograd's in-place check, so the engine does it: every
        handle follows its tensor's version counter through an empty tensor
        that shares the counter but not the storage (so the check works after
        the saved tensor's Python object is gone, and catches a write that
        lands while the copy is in flight), and raises autograd's error.
        Handles that share one reloaded storage get views of one reloaded
        base, so an in-place write in backward through one of them is seen by
        the others' checks, as autograd sees it.
Rule 7. Parameters, buffers and views of them are never offloaded. A storage
        saved twice in a step is offloaded once and shared, but only while
        the copy provably holds the current bytes: the first saver is alive
        on that storage at an unchanged version, and (synchronous copies) the
        bytes still compare equal, which also catches writes through aliases
        with their own version counter (``.data``, DLPack, numpy).
Rule 8. Excluded regions still pass through pack and are recorded as kept
        with reason ``excluded_region``; NoOpManager (identity hooks) is
        invisible to accounting by design. With an output head excluded with
        ``keep_after=True`` (what ``get_act_offloading_ctx_manager`` does),
        everything saved after the head's forward in the same model call (the
        loss inside the model, the user's loss after it) stays too
        (``after_head``): backward needs it first, so no prefetch can hide
        its reload.
Rule 9. Host memory is budgeted (pool cap ``host_budget_bytes`` and system
        RAM ceiling ``virtual_memory_safe_pct``) and enforced by
        ``on_host_budget`` = keep | pageable | raise, never only a warning.
Rule 10. Nothing the engine creates forms a reference cycle. Kept handles and
        in-flight sources hold a detached alias of a tensor with autograd
        history (a saved output's ``grad_fn`` would otherwise hold the handle
        that holds the output: a cycle through C++ that the garbage collector
        cannot free) and a leaf as it is (no ``grad_fn``: autograd itself saves
        leaves that way, and a detach per saved weight costs ~4k instructions
        of hook time); the hooks hold the engine
        weakly and handles hold it strongly, so a graph freed without backward
        (evaluation with grad on, skipped steps, ``autograd.grad`` over a
        subset) returns its host copies at once, and an engine that nobody
        uses is freed by reference counting.
Rule 11. Tensors saved while a backward pass runs (the forward recomputed by
        reentrant checkpointing inside a context that wraps the whole step,
        double backward) stay on the device with reason ``in_backward``: they
        are consumed at once. One outermost ``backward()`` is one ledger step:
        nested backward passes do not close it.
Rule 12. One engine may be used from several threads. Forward-side state (the
        exclusion depth, the tail after the head, the pack order that
        prefetch follows) is per thread; backward-side state is per autograd
        graph task, whose end is observed even when the pass fails (the
        end-of-backward callback is released with the graph task). Shared
        state (stash, pool, ledger) is locked. Ledger steps of passes that run
        concurrently on different threads are merged, and a step never closes
        while another thread's forward is open (closing clears the maps its
        next save reads): that forward's outermost exit closes it.
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _native, _torch_private, policy
from ._foreign_hooks import (check_exit, leave_hooks, unwatch_inner_hooks, warn_if_inside_foreign_hooks,
                             watch_inner_hooks)
from ._backward import _Backward, _Pass
from ._copies import _Copies
from ._exclusion import RegionHandle, exclude_module, warn_unused_regions
from ._handles import _dead, _Step, _unpack_handle
from ._kv_cache import install_warning as _install_kv_cache_warning
from ._observers import PackEvent, _engines, _observe, _pop_engine, active_engine, add_pack_observer
from ._packing import _owner_lookup, _Packing
from ._schedule import _Schedule
from ._spans import SpanSet
from ._warn import user_stacklevel
from .attach import AttachHandle, attach
from .compat import _positional_error
from .compat._peer_attributes import PeerAttributes
from .config import OffloadConfig, keywords_checked, resolve_device, settled_config
from .sizes import SizeLike
from .errors import _internal_assert
from .ledger import Ledger
from .modules import _tls as _module_tls
from .modules import register_model, track_modules
from .disk import DiskStore
from .pool import HostPool
from .tiers import HostTiers
from .streams import make_backend

_install_kv_cache_warning()  # a returned KV cache is warned about once per engine (offload/_kv_cache.py)

__all__ = ["OffloadActivations", "PackEvent", "add_pack_observer", "active_engine"]

_profiler_enabled = _torch_private.profiler_enabled_c
_MiB = 1 << 20


class _ThreadState:
    """One thread's forward-side state of one engine (Rule 12)."""

    __slots__ = ("excluded_depth", "region_stack", "order", "after_head", "enter_depth",
                 "modules_cms", "saved", "module_stack", "watches", "__weakref__")

    def __init__(self) -> None:
        self.excluded_depth = 0
        """Excluded regions open on this thread."""
        self.region_stack: list[nn.Module] = []
        """Excluded modules whose forward is running (innermost last)."""
        self.order: list[weakref.ref] = []
        """Offloaded handles in pack order: backward prefetches backwards along it."""
        self.after_head = False
        """The output head's forward finished in the current model call (Rule 8)."""
        self.enter_depth = 0
        self.modules_cms: list[Any] = []
        self.watches: list[Any] = []  # per entry: the pack hook it pushed (NOTE [ Nested hooks ])
        self.saved: tuple[int, int] = (0, 0)
        self.module_stack: list[nn.Module] | None = None
        """offload.modules' running-module stack of this thread while the engine is entered on it
        (stable while a tracking scope is open): the pack hook reads it here, not thread-locally."""


# -- construction helpers ------------------------------------------------------


def _weak_pack(engine: "OffloadActivations") -> Callable[[torch.Tensor], Any]:
    """The engine's pack hook, holding the engine weakly (Rule 10)."""
    ref = weakref.ref(engine)

    def pack(t: torch.Tensor) -> Any:
        eng = ref()
        if eng is None:
            _internal_assert(False, "pack hook ran for an engine that was freed")
        if _profiler_enabled():
            with torch.autograd.profiler.record_function("offload::pack"):
                return eng._pack(t)
        return eng._pack(t)

    return pack


# -- the engine ----------------------------------------------------------------


class OffloadActivations(PeerAttributes, _Packing, _Copies, _Backward, torch.autograd.graph.saved_tensors_hooks):
    """Offload activations saved for backward to host memory; bring them back for backward.

    Enter it around the forward pass; run backward outside it (torchtune's
    usage). See NOTE [ Offload lifetime rules ] in this module.

    Every argument but ``model`` is a field of ``OffloadConfig`` (validated
    there); ``config=`` passes them all at once (see ``from_config``).

    Args (the head torchtune and TRL share; only these two may be positional):
        use_pin_memory: page-lock host buffers when an accelerator is used.
        use_streams: copy on a side stream so copies overlap compute; silently
            synchronous on CPU or when the device has no streams.

    Keyword-only (torchtune and TRL take the first two positionally, in
    opposite orders: see offload.compat for their exact signatures):
        max_fwd_stash_size, max_inflight_bytes: optional caps on the device-to-host copies in flight
            (count, bytes); None (default) = none. Beyond one, compute waits on the oldest copy.
        device_budget_bytes: device bytes the step stays within (compute waits on in-flight copies
            only to keep it). None (default): every offloaded byte off the device by the forward's
            end, each wait as late as that allows (NOTE [ Copy schedule ] in offload/_schedule.py).
        prefetch_bytes: cap on the bytes backward loads ahead; None (default) = as far as device
            memory allows (off with synchronous copies, where it overlaps nothing); 0 = off.
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
        native_hooks: run the pack hook in C++ (``offload._native``): the keep path
            whole, and the offload path's decision and records (its copy stays the
            engine's): the same decisions and records for less CPU per saved tensor. "auto" (the
            default): where it is built, or once it has built in the background (a
            C++ compiler and ninja; the Python hook runs meanwhile); True: built now
            (~20 s once), raises when it cannot be; False: the Python hook.
        verify: checksum each offloaded span on the device at pack and check the
            reloaded bytes before backward reads them; ``OffloadVerifyError`` names
            the module, shape, step and side on a mismatch (NOTE [ Verified offload ]
            in offload/_verify.py). Off by default: one host sync per reload.
        config: an OffloadConfig holding every setting above but ``model``
            (then pass no other setting).
    """

    @keywords_checked
    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        *positional: Any,
        max_fwd_stash_size: int | None = None,
        min_offload_size: SizeLike = 1024,
        device: torch.device | str | None = None,
        max_inflight_bytes: SizeLike | None = None,
        device_budget_bytes: SizeLike | None = None,
        prefetch_bytes: SizeLike | None = None,
        host_budget_bytes: SizeLike | None = None,
        pageable_budget_bytes: SizeLike | None = 0,
        disk_dir: str | None = None,
        disk_budget_bytes: SizeLike | None = None,
        disk_queue_bytes: SizeLike = 256 * _MiB,
        disk_readahead_bytes: SizeLike = 256 * _MiB,
        on_host_budget: str = "keep",
        virtual_memory_safe_pct: float | None = 90.0,
        model: nn.Module | None = None,
        dedupe: bool = True,
        max_records: int = 10_000,
        timing: bool = True,
        pin_allocator: str = "caching",
        native_hooks: bool | str = "auto",
        verify: bool = False,
        config: OffloadConfig | None = None,
    ) -> None:
        if positional:
            raise _positional_error((use_pin_memory, use_streams, *positional))
        settings = dict(
            use_pin_memory=use_pin_memory, use_streams=use_streams,
            max_fwd_stash_size=max_fwd_stash_size, min_offload_size=min_offload_size, device=device,
            max_inflight_bytes=max_inflight_bytes, device_budget_bytes=device_budget_bytes,
            prefetch_bytes=prefetch_bytes,
            host_budget_bytes=host_budget_bytes, pageable_budget_bytes=pageable_budget_bytes,
            disk_dir=disk_dir, disk_budget_bytes=disk_budget_bytes, disk_queue_bytes=disk_queue_bytes,
            disk_readahead_bytes=disk_readahead_bytes, on_host_budget=on_host_budget,
            virtual_memory_safe_pct=virtual_memory_safe_pct, dedupe=dedupe, max_records=max_records,
            timing=timing, pin_allocator=pin_allocator, native_hooks=native_hooks, verify=verify,
        )
        config = settled_config(settings, config, owner=type(self).__name__)
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(
                f"OffloadActivations: model={model!r} is not an nn.Module (got {type(model).__name__}). "
                "Pass the model being trained (its parameters and buffers are never offloaded) or None."
            )
        self.config = config
        """Every setting of this engine (an OffloadConfig: ``to_dict()`` to log or save it)."""
        self._apply_settings(config)
        self._model_ref = weakref.ref(model) if model is not None else None
        self._init_state(config)
        # Rule 10: the pack hook holds the engine weakly; handles hold it.
        self._weak_pack_hook = _weak_pack(self)
        super().__init__(self._weak_pack_hook, _unpack_handle)

    def _apply_settings(self, config: OffloadConfig) -> None:
        """The settings as attributes, the device resolved (one warning when running pass-through)."""
        self.device = resolve_device(config.device)
        """Device whose saved tensors are offloaded; None when pass-through."""
        self._device_name = policy.device_name(self.device) if self.device is not None else None
        self.enabled = self.device is not None
        """False when running pass-through (nothing moved, everything recorded)."""
        if not self.enabled:
            warnings.warn(
                "OffloadActivations: no accelerator is available and device=None, so the engine "
                "runs pass-through: nothing is moved and every saved tensor is recorded in "
                "ctx.ledger with reason 'disabled'. Pass device='cpu' to offload CPU tensors "
                "into the host pool instead.",
                stacklevel=user_stacklevel(),
            )
        self.use_pin_memory = config.use_pin_memory
        self.use_streams = config.use_streams
        self.max_fwd_stash_size = config.max_fwd_stash_size
        self.min_offload_size = config.min_offload_size
        self.max_inflight_bytes = config.max_inflight_bytes
        self.prefetch_bytes = config.prefetch_bytes
        self.host_budget_bytes = config.host_budget_bytes
        self.on_host_budget = config.on_host_budget
        self.virtual_memory_safe_pct = config.virtual_memory_safe_pct
        self.dedupe = config.dedupe
        self.timing = config.timing
        self._verify = config.verify

    def _init_state(self, config: OffloadConfig) -> None:
        """The pool, ledger, copy backend and bookkeeping of a new engine."""
        dev_type = self.device.type if self.device is not None else None
        self.pool = HostPool(
            pin=bool(config.use_pin_memory and dev_type not in (None, "cpu")),
            capacity_bytes=config.host_budget_bytes,
            device_type=dev_type,
            pin_allocator=config.pin_allocator,
            refuse_unpinned=True,
        )
        """The host buffer pool (``pool.stats()`` for its counters)."""
        self.ledger = Ledger(max_records=config.max_records, pool_stats=self.pool.stats)
        """Every decision and per-step totals (``ledger.summary()``)."""
        self.tiers = self._make_tiers(config, dev_type)
        """The host tiers (pool, pageable, disk: NOTE [ Host tiers ]); ``tiers.stats()``. Where an
        offloaded tensor's host bytes go is decided by ``tiers.take`` alone (Rule 9)."""
        self._backend = make_backend(self.device, self.use_streams, timing=self.timing) if self.enabled else None
        self._observers: OrderedDict[int, Callable[[PackEvent], None]] = OrderedDict()
        self._seq = itertools.count()
        self._lock = threading.RLock()
        # Storage -> PARAMETER / BUFFER of the model given up front (policy.model_storages).
        self._static_ptrs: dict[int, str] = {}
        self._regions: list[RegionHandle] = []
        self._dedupe: dict[tuple[str, int], weakref.ref] = {}
        self._seen = SpanSet()  # unique bytes: the union of saved spans, as the profilers count
        # Per-thread forward state and per-graph-task backward state (Rule 12).
        self._tls = threading.local()
        # Thread states of live threads, weakly: a thread's state goes with the thread (Rule 12).
        self._threads: "weakref.WeakSet[_ThreadState]" = weakref.WeakSet()
        self._order_compact_at = 1024
        self._passes: "weakref.WeakValueDictionary[int, _Pass]" = weakref.WeakValueDictionary()
        self._last_pass: tuple[int, weakref.ref] | None = None
        self._close_pending = False  # a backward ended while another thread's forward was open
        # The open step's _Step, weakly (Rule 10): handles hold it, so it dies with their graphs.
        self._step_ref: Callable[[], _Step | None] = _dead
        # Running module -> storages of the parameters and buffers of it and its
        # running ancestors (buffer detection for offload candidates), per step.
        self._owner_memo: dict[tuple[int, int, int], tuple[frozenset[int], frozenset[int]]] = {}
        self._running_owner = _owner_lookup(self._owner_memo)  # policy._classify's owner(ptr)
        self._process = psutil.Process()
        self._sched = _Schedule(self._backend, self.ledger, self._lock, self.tiers,
                                max_count=config.max_fwd_stash_size, max_bytes=config.max_inflight_bytes,
                                budget=config.device_budget_bytes, prefetch_bytes=config.prefetch_bytes)
        """The copy schedule (NOTE [ Copy schedule ] in offload/_schedule.py)."""
        self._inflight = self._sched.inflight  # the hooks' cheap "any copy in flight?" test
        self._native = _native.for_engine(self)  # None: the Python hook (for now, if "auto")

    def _make_tiers(self, config: OffloadConfig, dev_type: str | None) -> HostTiers:
        """The host tiers of NOTE [ Host tiers ] from the settings (the disk tier's run directory is
        made here: a ``disk_dir`` that is a file is refused now)."""
        pageable = config.pageable_budget_bytes
        if config.on_host_budget == "pageable" and pageable == 0:
            pageable = None  # the older spelling of "pool, then pageable"
        disk = None
        if config.disk_dir is not None and self.enabled:
            ledger = self.ledger

            def on_time(kind: str, seconds: float, nbytes: int, owner: Any) -> None:
                ledger.add_tier_time("disk", 0.0 if kind == "wait" else seconds,
                                     seconds if kind == "wait" else 0.0, owner=owner)

            disk = DiskStore(config.disk_dir, budget_bytes=config.disk_budget_bytes,
                             queue_bytes=config.disk_queue_bytes, readahead_bytes=config.disk_readahead_bytes,
                             pin=bool(config.use_pin_memory and dev_type not in (None, "cpu")), on_time=on_time,
                             owner=ledger.open_totals)
        return HostTiers(self.pool, pageable_budget_bytes=pageable, disk=disk,
                         on_host_budget=config.on_host_budget,
                         virtual_memory_safe_pct=config.virtual_memory_safe_pct)

    def close(self) -> None:
        """Delete the disk tier's files and run directory (also done at interpreter exit and when
        the engine is freed). Graphs built before cannot be backpropagated through afterwards;
        the engine itself stays usable: its next copy that needs the disk opens a new run
        directory (logged; NOTE [ Disk run life ] in offload/_disk_run.py)."""
        self.tiers.close()

    # -- context ---------------------------------------------------------------

    @property
    def backend(self) -> str:
        """"stream", "sync", or "none" (pass-through)."""
        return self._backend.name if self._backend is not None else "none"

    def _thread(self) -> _ThreadState:
        """This thread's forward-side state (Rule 12)."""
        st = getattr(self._tls, "state", None)
        if st is None:
            st = self._tls.state = _ThreadState()
            with self._lock:
                self._threads.add(st)
        return st

    @property
    def _excluded_depth(self) -> int:
        """How many excluded regions are open on this thread (Rule 12)."""
        return self._thread().excluded_depth

    def __enter__(self) -> "OffloadActivations":
        st = self._thread()
        modules_cm = track_modules(owner=self)
        modules_cm.__enter__()
        pushed = False
        try:
            if st.enter_depth == 0:
                # Rule 9 of the regions (see regions.py): state a KeyboardInterrupt
                # may have left half-done is restored when the outermost exit runs.
                st.saved = (st.excluded_depth, len(st.region_stack))
                st.after_head = False
                self._owner_memo.clear()  # parameters may live on new storages (FSDP2 gathers)
                self._close_finished_step()
                warn_if_inside_foreign_hooks(self)
            model = self._model_ref() if self._model_ref is not None else None
            if model is not None:
                register_model(model)  # ledger module names are fully qualified from it
                # Rule 7, by storage: read again at every entry (parameters are replaced,
                # moved and re-gathered between steps), never kept for a model that is gone,
                # whose freed addresses new activations reuse.
                self._static_ptrs = policy.model_storages(model)
            elif self._static_ptrs:
                self._static_ptrs = {}
            if self._inflight:
                self._sched.poll()  # (NOTE [ Copy schedule ] item 1)
            _engines().append(self)
            pushed = True
            hook = self.pack_hook
            if hook is self._weak_pack_hook:
                # native_hooks: a builtin bound like a method, keep path in C++ (under a profiler too). Else the
                # bound method: no wrapper per saved tensor (held by the hook stack until __exit__, Rule 10).
                if self._native is None and self.config.native_hooks == "auto":  # built in the background since?
                    self._native = _native.for_engine(self, ready_only=True)
                if self._native is not None and self.enabled:
                    hook = self._native.hook_for(self, st, _profiler_enabled())
                elif not _profiler_enabled():
                    hook = self._pack
            torch._C._autograd._push_saved_tensors_default_hooks(hook, self.unpack_hook)
            st.watches.append(watch_inner_hooks(self, hook))
        except BaseException:
            # A failed enter (e.g. under torch.autograd.graph.disable_saved_tensors_hooks)
            # leaves nothing behind: not on the engine stack, module tracking off.
            if pushed:
                _pop_engine(self)
            modules_cm.__exit__(None, None, None)
            raise
        st.modules_cms.append(modules_cm)
        st.enter_depth += 1
        st.module_stack = _module_tls.stack
        return self

    def _owns_pack_hook(self, fn: Any) -> bool:
        """Whether ``fn`` (a pack hook on the thread's hook stack) is the one ``__enter__`` pushed."""
        if fn is self.pack_hook:
            return True
        if self._native is not None and self._native.is_hook_of(fn, self):
            return True
        # Any bound method of this engine: a subclass may override _pack (bench.hook_cost's floor engine,
        # a user's engine), and comparing with OffloadActivations._pack misread its own hooks as another's.
        return getattr(fn, "__self__", None) is self

    def __exit__(self, *exc: Any) -> None:
        st = self._thread()
        where = check_exit(self, st.enter_depth)  # raises on an unmatched exit (NOTE [ Nested hooks ] rule 4)
        try:  # a misnested exit leaves all the same, the inner context's hooks in place
            err = leave_hooks(self, where, super().__exit__, exc)
        finally:
            _pop_engine(self)
            if st.enter_depth > 0:
                st.enter_depth -= 1
            if st.modules_cms:
                st.modules_cms.pop().__exit__(*exc)
            if st.watches:
                st.watches.pop()
            unwatch_inner_hooks()
            if st.enter_depth == 0:
                st.module_stack = None
                # Undo region state an interrupted forward left behind (an
                # always-called forward hook does not run on KeyboardInterrupt).
                depth, n = st.saved
                st.excluded_depth = depth
                del st.region_stack[n:]
                st.after_head = False
                if self._close_pending:
                    self._close_deferred_step()
            if exc and exc[0] is not None:
                # The forward died: its graph (and our handles) will be freed
                # with the traceback. Release sources now rather than at the
                # next backward that may never come.
                self._sched.drain()
            elif st.enter_depth == 0:
                self._sched.exited()  # (NOTE [ Copy schedule ] items 1-3)
        if err is not None:
            raise err

    def _close_finished_step(self) -> None:
        """Close the open ledger step if its graphs are all gone without a backward.

        Forward-only steps with grad enabled (evaluation, reference log-probs)
        never reach an end of backward; without this their step would never
        close, and the pool would never trim (Rule 1, item: bounded bookkeeping).
        """
        if self._step_ref() is None and not self._passes and getattr(self.ledger, "_open_used", True):
            self.close_step()

    # -- regions ---------------------------------------------------------------

    def exclude(self, module: nn.Module, *, keep_after: bool = False) -> RegionHandle:
        """Keep every tensor saved inside ``module``'s forward on the device.

        The tensors still pass through the engine and are recorded as kept
        with reason ``excluded_region`` (Rule 8). With ``keep_after=True`` (for
        the output head) everything saved after the module's forward, until
        the model's next call, stays too (reason ``after_head``). Returns a
        handle whose ``remove()`` undoes the exclusion.
        """
        return exclude_module(self, module, keep_after=keep_after)

    @contextmanager
    def excluded(self) -> Iterator[None]:
        """Keep every tensor saved inside this block on the device (recorded, Rule 8)."""
        st = self._thread()
        st.excluded_depth += 1
        try:
            yield
        finally:
            # Never below zero: the engine's outermost exit may already have
            # undone a region an interrupted forward left open (Rule 12).
            st.excluded_depth = max(0, st.excluded_depth - 1)

    def add_observer(self, fn: Callable[[PackEvent], None]) -> RemovableHandle:
        """Call ``fn(event)`` for every pack of this engine."""
        return _observe(self._observers, fn)

    def close_step(self) -> None:
        """Close the ledger's open step now (done automatically at the end of each backward)."""
        dev_peak = None
        if self.device is not None and self.device.type != "cpu":
            try:
                dev_peak = int(torch.accelerator.max_memory_allocated(self.device))
            except Exception:
                dev_peak = None
        self.pool.trim()
        self.tiers.end_step()
        self._sched.end_step()
        if self._regions:
            warn_unused_regions(self)
        self.ledger.close_step(
            pool=self.pool.stats(),
            host_rss_bytes=self._process.memory_info().rss,
            device_peak_allocated_bytes=dev_peak,
        )
        with self._lock:
            self._close_pending = False
            self._dedupe.clear()
            self._seen.clear()
            # The next pack starts a new _Step: a graph retained from this step
            # must not stop a later forward-only step from closing.
            self._step_ref = _dead

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "OffloadActivations cannot be copied or pickled: its host buffers, disk-tier run directory, "
            "threads and hooks belong to this engine alone, and a copy would share them. Build another "
            "with OffloadActivations.from_config(ctx.config) (an OffloadConfig copies and pickles).")

    def __repr__(self) -> str:
        return (
            f"OffloadActivations(device={self.device}, backend={self.backend}, "
            f"min_offload_size={self.min_offload_size}, on_host_budget={self.on_host_budget!r})"
        )

    # -- construction from a config, attaching to a model ------------------------

    @classmethod
    def from_config(cls, config: OffloadConfig, *, model: nn.Module | None = None) -> "OffloadActivations":
        """An engine with every setting from ``config`` (``model``'s parameters are never offloaded)."""
        return cls(model=model, config=config)

    def attach(self, model: nn.Module) -> AttachHandle:
        """Enter this engine around every forward of ``model``; ``handle.remove()`` undoes it.

        Any training loop then offloads without a ``with`` block; backward runs
        outside the engine, as usual. See ``offload.attach``.
        """
        return attach(self, model)
