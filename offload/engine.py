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
        concurrently on different threads are merged.
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _torch_private, _verify, policy
from ._spans import SpanSet, byte_span
from ._warn import user_stacklevel
from .compat._peer_attributes import PeerAttributes
from ._foreign_hooks import warn_if_inside_foreign_hooks
from .config import OffloadConfig, keywords_checked
from .errors import OffloadError, _internal_assert
from .ledger import KEPT, OFFLOADED, Ledger, PackRecord, record_from_log
from .modules import _names as _module_names
from .modules import _tls as _module_tls
from .modules import current_module_name, current_modules, current_modules_view, register_model, track_modules
from .disk import DiskRecord, DiskStore
from .pool import HostBuffer, HostPool
from .tiers import HostTiers
from .streams import Copy, make_backend

if TYPE_CHECKING:
    from .attach import AttachHandle
    from .regions import RegionHandle

__all__ = ["OffloadActivations", "PackEvent", "add_pack_observer", "active_engine"]

_graph_task_id = _torch_private.graph_task_id_c
_profiler_enabled = _torch_private.profiler_enabled_c
_DEVICE_NAMES = policy._DEVICE_NAMES
_DTYPE_NAMES = policy._DTYPE_NAMES
_is_param = policy._is_param
_Tensor = torch.Tensor
_Parameter = nn.Parameter
# The reasons, as module globals: the pack hook compares them by identity.
_PARAMETER, _BUFFER, _OTHER_DEVICE = policy.PARAMETER, policy.BUFFER, policy.OTHER_DEVICE
_EXCLUDED_REGION, _TOO_SMALL = policy.EXCLUDED_REGION, policy.TOO_SMALL
_IN_BACKWARD, _AFTER_HEAD = policy.IN_BACKWARD, policy.AFTER_HEAD
_MiB = 1 << 20
_PLAIN_ITEMSIZE: dict[torch.dtype, int] = {}
"""dtype -> bytes per element, for the dtypes of plain (not quantized, not nested) tensors the
pack hook has seen: a hit there skips the two checks (the first tensor of a dtype decides;
a quantized dtype is never a plain tensor's). Offload candidates still check ``is_nested``."""


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


_observer_count = [0]
"""Observers registered and not removed, on every engine and thread together: while it is 0
the pack hook skips looking for observers (two lookups, one of them thread-local)."""
_observer_lock = threading.Lock()


class _ObserverHandle(RemovableHandle):
    """A ``RemovableHandle`` that keeps ``_observer_count`` (an observer dict that dies with
    observers still in it leaves the count high: packs then look, and find none)."""

    def remove(self) -> None:
        d = self.hooks_dict_ref()
        with _observer_lock:
            if d is not None and self.id in d:
                _observer_count[0] -= 1
            super().remove()


def _observe(d: "OrderedDict[int, Callable[[PackEvent], None]]", fn: Callable[[PackEvent], None]) -> RemovableHandle:
    h = _ObserverHandle(d)
    with _observer_lock:
        d[h.id] = fn
        _observer_count[0] += 1
    return h


def add_pack_observer(fn: Callable[[PackEvent], None]) -> RemovableHandle:
    """Call ``fn(event)`` for every pack of any engine active on this thread.

    This is how profilers measure an offloaded forward without installing
    their own saved-tensors hooks (only the innermost hooks run, so a
    profiler's hooks inside the engine's would silently turn offloading off).
    """
    return _observe(_global_observers(), fn)


_NO_SPAN = nullcontext()  # stateless: one instance serves every caller


def _span(name: str) -> Any:
    """A ``record_function`` range when a profiler is recording, else a no-op (cheap)."""
    if _profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return _NO_SPAN


# -- handles -----------------------------------------------------------------


def _inplace_error(shape: torch.Size, dtype: torch.dtype, now: int, expected: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{dtype} {list(shape)}] is at version {now}; expected version "
        f"{expected} instead. (Detected by offload: saved-tensor hooks bypass autograd's own "
        "check, so the engine checks the version itself. Hint: clone the tensor before "
        "modifying it in place, or do the in-place op after backward.)"
    )


def _saved_alias(t: torch.Tensor) -> torch.Tensor:
    # Rule 10: a detached alias shares storage and version counter but not the
    # autograd history, so holding it cannot close a cycle through grad_fn. A
    # leaf (a parameter, an input) has no grad_fn: holding it closes no cycle.
    return t if t.is_leaf else t.detach()


class _Kept:
    """A tensor left where it is; only its version is checked at unpack (Rule 6).

    ``NoOpManager``'s handle. The engine's own kept handle is the cheaper tuple
    ``(alias, version, step)`` (see ``_pack``); both unpack the same way.
    """

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t if t.is_leaf else t.detach()  # _saved_alias, inlined (Rule 10)
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise _inplace_error(t.shape, t.dtype, t._version, self.version)
        return t


class _Step:
    """Held by every handle packed in one ledger step (Rule 10: no ``__del__`` per handle).

    The engine holds it weakly: once it is gone, every graph of the step was
    freed, so a forward-only step can close (``_close_finished_step``).
    """

    __slots__ = ("engine", "__weakref__")

    def __init__(self, engine: "OffloadActivations") -> None:
        self.engine = engine


def _dead() -> None:
    return None


class _HostCopy:
    """Bytes [lo, lo + nbytes) of one storage, held in a host buffer (Rule 1).

    Shared by every handle whose tensor aliases that storage (Rule 7); goes
    back to the pool when the last handle is dropped.
    """

    __slots__ = ("buf", "pool", "lo", "nbytes", "prefetched", "held", "users", "used",
                 "version", "base_ref", "release", "synchronous", "checksum", "tier", "__weakref__")

    def __init__(self, buf: HostBuffer | DiskRecord, pool: HostTiers, lo: int, nbytes: int) -> None:
        self.buf = buf
        self.pool = pool
        self.tier = "pool"
        self.lo = lo
        self.nbytes = nbytes
        self.prefetched: tuple[torch.Tensor, Copy] | None = None
        # Reloaded device bytes (a flat uint8 base, its copy and the base's
        # version), held while other handles sharing this copy have not been
        # unpacked yet in this backward pass; they get views of the same base.
        self.held: tuple[torch.Tensor, Copy, int] | None = None
        self.users = 0
        self.used = 0
        # backend.release_after, to order a never-consumed prefetch's
        # allocation stream after its copy when this dies (Rule 4).
        self.release: Callable[[Copy, Any], None] | None = None
        self.version = 0
        self.base_ref: Callable[[], torch.Tensor | None] | None = None
        self.synchronous = False
        self.checksum: torch.Tensor | None = None  # verify=True: the span's checksum at pack (device)

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
    """Handle returned by pack for an offloaded tensor (holds its engine: Rule 10)."""

    __slots__ = ("hc", "layout", "version", "tracker", "rec", "index", "order", "stash", "engine", "step",
                 "__weakref__")
    # layout: (shape, stride, offset in elements of the host copy, dtype, device, conj, neg),
    # one tuple rather than seven slots to fill per pack.

    def unpack(self) -> torch.Tensor:
        return self.engine._reload(self)


def _unpack_kept(handle: tuple) -> torch.Tensor:
    t, version, step = handle
    step.engine._begin_backward_pass()
    if t._version != version:
        raise _inplace_error(t.shape, t.dtype, t._version, version)
    return t


def _unpack_handle(handle: Any) -> torch.Tensor:
    """The engine's unpack hook: handles know their engine (the hook holds none)."""
    if _profiler_enabled():
        with torch.autograd.profiler.record_function("offload::unpack"):
            return _unpack_any(handle)
    if type(handle) is tuple:  # _unpack_kept, inlined: once per kept tensor
        t, version, step = handle
        step.engine._begin_backward_pass()
        if t._version != version:
            raise _inplace_error(t.shape, t.dtype, t._version, version)
        return t
    return _unpack_any(handle)


def _unpack_any(handle: Any) -> torch.Tensor:
    cls = type(handle)
    if cls is tuple:
        return _unpack_kept(handle)
    if cls is _Offloaded or cls is _Kept:
        return handle.unpack()
    _internal_assert(False, f"unpack got a {cls.__name__}")
    raise AssertionError  # unreachable


def _load_native() -> Any:
    """offload._native's built extension, or an error that says why it is not there and what to do."""
    from . import _native

    try:
        return _native.load()
    except _native.NativeUnavailable as e:
        raise OffloadError(
            f"OffloadActivations: native_hooks=True, but the C++ pack hook cannot be built here ({e}). "
            "Install a C++ compiler and ninja (pip install ninja), or pass native_hooks=False: the "
            "Python hook makes the same decisions, at more CPU time per saved tensor."
        ) from e


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


class _Pass:
    """One autograd graph task's view of the engine (Rule 12).

    Queued as the graph task's end-of-backward callback: called when the pass
    finishes; released (``__del__``) with the graph task when it fails, so a
    failed backward cleans up as soon as autograd drops it.
    """

    __slots__ = ("engine", "gid", "touched", "prefetched", "prefetched_bytes", "ended", "__weakref__")

    def __init__(self, engine: "OffloadActivations", gid: int) -> None:
        self.engine = engine
        self.gid = gid
        # Weak: these must not keep host copies (or reloaded device bytes)
        # alive after the graph is freed.
        self.touched: list[weakref.ref] = []
        self.prefetched: list[weakref.ref] = []
        self.prefetched_bytes = 0
        self.ended = False

    def __call__(self) -> None:
        self.engine._end_pass(self)

    def __del__(self) -> None:
        if not self.ended:
            try:
                self.engine._end_pass(self)
            except Exception:  # interpreter shutdown
                pass


class _ThreadState:
    """One thread's forward-side state of one engine (Rule 12)."""

    __slots__ = ("excluded_depth", "region_stack", "order", "after_head", "enter_depth",
                 "modules_cms", "saved", "module_stack")

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
        self.saved: tuple[int, int] = (0, 0)
        self.module_stack: list[nn.Module] | None = None
        """offload.modules' running-module stack of this thread while the engine is entered on it
        (stable while a tracking scope is open): the pack hook reads it here, not thread-locally."""


# -- argument checks -----------------------------------------------------------


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


class OffloadActivations(PeerAttributes, torch.autograd.graph.saved_tensors_hooks):
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
        max_fwd_stash_size: most in-flight D2H copies whose source is kept alive.
        min_offload_size: tensors with fewer bytes stay on the device.
        device: the device whose tensors are offloaded. None = the current
            accelerator (pass-through with one warning when there is none);
            "cpu" offloads CPU tensors into the host pool (exercises the whole
            path without a GPU).
        max_inflight_bytes: bound on bytes of in-flight D2H copies (sources alive).
        prefetch_bytes: how many bytes of upcoming handles backward loads ahead.
            None (default) = twice the largest single copy made so far: enough
            to keep the next copies in flight while compute uses the current
            one, without reloading the whole step at the first unpack (which
            would give the memory back); off with synchronous copies (CPU,
            ``use_streams=False``), where loading ahead overlaps nothing.
            0 turns prefetch off.
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
        native_hooks: run the pack hook's keep path in C++ (``offload._native``):
            the same decisions and records for less CPU per kept tensor. Built on
            first use (needs a C++ compiler and ninja); raises when it cannot be.
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
        max_fwd_stash_size: int = 5,
        min_offload_size: int = 1024,
        device: torch.device | str | None = None,
        max_inflight_bytes: int = 1024 * _MiB,
        prefetch_bytes: int | None = None,
        host_budget_bytes: int | None = None,
        pageable_budget_bytes: int | None = 0,
        disk_dir: str | None = None,
        disk_budget_bytes: int | None = None,
        disk_queue_bytes: int = 256 * _MiB,
        disk_readahead_bytes: int = 256 * _MiB,
        on_host_budget: str = "keep",
        virtual_memory_safe_pct: float | None = 90.0,
        model: nn.Module | None = None,
        dedupe: bool = True,
        max_records: int = 10_000,
        timing: bool = True,
        pin_allocator: str = "caching",
        native_hooks: bool = False,
        verify: bool = False,
        config: OffloadConfig | None = None,
    ) -> None:
        if positional:
            # See NOTE [ Positional peers ] in offload/compat/__init__.py.
            raise TypeError(
                f"OffloadActivations: got {len(positional) + 2} positional arguments "
                f"{(use_pin_memory, use_streams, *positional)!r}; only use_pin_memory and use_streams "
                "may be positional. torchtune's OffloadActivations takes (..., max_fwd_stash_size, "
                "min_offload_size) in that order and TRL's takes (..., min_offload_size, "
                "max_fwd_stash_size), so a positional third or fourth value would be ambiguous. Pass "
                "them by name (OffloadActivations(max_fwd_stash_size=5, min_offload_size=1024)), or "
                "import the peer's positional order from offload.compat.torchtune or offload.compat.trl."
            )
        settings = dict(
            use_pin_memory=use_pin_memory, use_streams=use_streams,
            max_fwd_stash_size=max_fwd_stash_size, min_offload_size=min_offload_size, device=device,
            max_inflight_bytes=max_inflight_bytes, prefetch_bytes=prefetch_bytes,
            host_budget_bytes=host_budget_bytes, pageable_budget_bytes=pageable_budget_bytes,
            disk_dir=disk_dir, disk_budget_bytes=disk_budget_bytes, disk_queue_bytes=disk_queue_bytes,
            disk_readahead_bytes=disk_readahead_bytes, on_host_budget=on_host_budget,
            virtual_memory_safe_pct=virtual_memory_safe_pct, dedupe=dedupe, max_records=max_records,
            timing=timing, pin_allocator=pin_allocator, native_hooks=native_hooks, verify=verify,
        )
        if config is None:
            config = OffloadConfig(**settings)  # validates every setting (type and range)
        else:
            if not isinstance(config, OffloadConfig):
                raise TypeError(
                    f"OffloadActivations: config={config!r} is not an OffloadConfig (got "
                    f"{type(config).__name__}). Build one with OffloadConfig(...) or "
                    "OffloadConfig.from_dict(d)."
                )
            defaults = OffloadConfig()
            both = sorted(k for k, v in settings.items() if v != getattr(defaults, k))
            if both:
                raise TypeError(
                    f"OffloadActivations: {both} given both as argument(s) and through config=; "
                    "pass each setting one way: config.replace(name=value) changes a config."
                )
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(
                f"OffloadActivations: model={model!r} is not an nn.Module (got {type(model).__name__}). "
                "Pass the model being trained (its parameters and buffers are never offloaded) or None."
            )
        self.config = config
        """Every setting of this engine (an OffloadConfig: ``to_dict()`` to log or save it)."""
        # The rest of __init__ reads these names: rebind them from the config.
        use_pin_memory, use_streams = config.use_pin_memory, config.use_streams
        max_fwd_stash_size, min_offload_size = config.max_fwd_stash_size, config.min_offload_size
        device, max_inflight_bytes = config.device, config.max_inflight_bytes
        prefetch_bytes, host_budget_bytes = config.prefetch_bytes, config.host_budget_bytes
        on_host_budget, virtual_memory_safe_pct = config.on_host_budget, config.virtual_memory_safe_pct
        dedupe, max_records, timing = config.dedupe, config.max_records, config.timing
        pin_allocator = config.pin_allocator
        self.device = _resolve_device(device)
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
        self._verify = config.verify
        self._model_ref = weakref.ref(model) if model is not None else None

        dev_type = self.device.type if self.device is not None else None
        self.pool = HostPool(
            pin=bool(use_pin_memory and dev_type not in (None, "cpu")),
            capacity_bytes=host_budget_bytes,
            device_type=dev_type,
            pin_allocator=pin_allocator,
            refuse_unpinned=True,
        )
        """The host buffer pool (``pool.stats()`` for its counters)."""
        self.ledger = Ledger(max_records=max_records, pool_stats=self.pool.stats)
        """Every decision and per-step totals (``ledger.summary()``)."""
        self.tiers = self._make_tiers(config, dev_type)
        """The host tiers (pool, pageable, disk: NOTE [ Host tiers ]); ``tiers.stats()``."""
        self._backend = make_backend(self.device, use_streams, timing=timing) if self.enabled else None
        self._observers: OrderedDict[int, Callable[[PackEvent], None]] = OrderedDict()
        self._seq = itertools.count()
        self._lock = threading.RLock()
        # Storage -> PARAMETER / BUFFER of the model given up front (policy.model_storages).
        self._static_ptrs: dict[int, str] = {}
        self._regions: list[Any] = []
        self._stash: deque[_StashEntry] = deque()
        self._stash_bytes = 0
        self._dedupe: dict[tuple[str, int], weakref.ref] = {}
        self._seen = SpanSet()  # unique bytes: the union of saved spans, as the profilers count
        # Per-thread forward state and per-graph-task backward state (Rule 12).
        self._tls = threading.local()
        self._orders: list[list[weakref.ref]] = []
        self._order_compact_at = 1024
        self._passes: "weakref.WeakValueDictionary[int, _Pass]" = weakref.WeakValueDictionary()
        self._last_pass: tuple[int, weakref.ref] | None = None
        # The open step's _Step, weakly (Rule 10): handles hold it, so it dies with their graphs.
        self._step_ref: Callable[[], _Step | None] = _dead
        # Running module -> storages of the parameters and buffers of it and its
        # running ancestors (buffer detection for offload candidates), per step.
        self._owner_memo: dict[tuple[int, int, int], tuple[frozenset[int], frozenset[int]]] = {}
        self._process = psutil.Process()
        self._native = _load_native() if config.native_hooks else None
        # Rule 10: the pack hook holds the engine weakly; handles hold it.
        self._weak_pack_hook = _weak_pack(self)
        super().__init__(self._weak_pack_hook, _unpack_handle)

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
                self._orders.append(st.order)
        return st

    @property
    def _excluded_depth(self) -> int:
        """How many excluded regions are open on this thread (Rule 12)."""
        return self._thread().excluded_depth

    @_excluded_depth.setter
    def _excluded_depth(self, value: int) -> None:
        self._thread().excluded_depth = value

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
                self._owner_memo = {}  # parameters may live on new storages (FSDP2 gathers)
                self._close_finished_step()
                warn_if_inside_foreign_hooks(self)
            model = self._model_ref() if self._model_ref is not None else None
            if model is not None:
                register_model(model)  # ledger module names are fully qualified from it
                self._static_ptrs = policy.model_storages(model)
            self._poll_stash()
            _engines().append(self)
            pushed = True
            hook = self.pack_hook
            if hook is self._weak_pack_hook and not _profiler_enabled():
                # The bound method itself: no wrapper frame per saved tensor. Only the
                # thread's hook stack holds it, and only until __exit__ (no cycle: Rule 10).
                # native_hooks: a builtin bound the same way, whose keep path is C++.
                hook = self._pack if self._native is None or not self.enabled else self._native.hook_for(self, st)
            torch._C._autograd._push_saved_tensors_default_hooks(hook, self.unpack_hook)
        except BaseException:
            # A failed enter (e.g. under torch.autograd.graph.disable_saved_tensors_hooks)
            # leaves nothing behind: not on the engine stack, module tracking off.
            if pushed:
                self._pop_engine()
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
        return getattr(fn, "__self__", None) is self and getattr(fn, "__func__", None) is OffloadActivations._pack

    def _pop_engine(self) -> None:
        st = _engines()
        if st and st[-1] is self:
            st.pop()
        elif self in st:
            st.remove(self)

    def __exit__(self, *exc: Any) -> None:
        st = self._thread()
        try:
            super().__exit__(*exc)
        finally:
            self._pop_engine()
            if st.enter_depth > 0:
                st.enter_depth -= 1
            if st.modules_cms:
                st.modules_cms.pop().__exit__(*exc)
            if st.enter_depth == 0:
                st.module_stack = None
                # Undo region state an interrupted forward left behind (an
                # always-called forward hook does not run on KeyboardInterrupt).
                depth, n = st.saved
                st.excluded_depth = depth
                del st.region_stack[n:]
                st.after_head = False
            if exc and exc[0] is not None:
                # The forward died: its graph (and our handles) will be freed
                # with the traceback. Release sources now rather than at the
                # next backward that may never come.
                self._drain_stash()

    def _close_finished_step(self) -> None:
        """Close the open ledger step if its graphs are all gone without a backward.

        Forward-only steps with grad enabled (evaluation, reference log-probs)
        never reach an end of backward; without this their step would never
        close, and the pool would never trim (Rule 1, item: bounded bookkeeping).
        """
        if self._step_ref() is None and not self._passes and getattr(self.ledger, "_open_used", True):
            self.close_step()

    # -- regions ---------------------------------------------------------------

    def exclude(self, module: nn.Module, *, keep_after: bool = False) -> "RegionHandle":
        """Keep every tensor saved inside ``module``'s forward on the device.

        The tensors still pass through the engine and are recorded as kept
        with reason ``excluded_region`` (Rule 8). With ``keep_after=True`` (for
        the output head) everything saved after the module's forward, until
        the model's next call, stays too (reason ``after_head``). Returns a
        handle whose ``remove()`` undoes the exclusion.
        """
        from .regions import exclude_module

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

    # -- pack --------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        # Runs for every saved tensor on the kernel-launching thread: its CPU
        # time is step time (``python -m bench.hook_cost``). A plain tensor with a
        # storage takes this path: each fact about it read once, and only where
        # the decision needs it; classification inlined (the same order as
        # policy.classify); the decision appended to the ledger's logs (NOTE
        # [ Ledger logs ]); no system call and no lock for a kept tensor.
        # Everything else (subclasses, sparse, nested, quantized, zero tensors,
        # pass-through) goes through _pack_other.
        # native_hooks=True: offload/_native/pack.cpp restates the keep path of
        # this method in C++; a change to what a kept tensor gets here is a change
        # there too (tests/offload/test_native.py compares the two, record by record).
        cls = type(t)
        if (cls is not _Tensor and cls is not _Parameter) or not self.enabled:
            return self._pack_other(t)
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            shape = t.shape  # a strided nested tensor has no single shape: it raises
        except (RuntimeError, NotImplementedError):
            return self._pack_other(t)  # no plain storage: sparse, mkldnn, efficient zeros
        dtype = t.dtype
        itemsize = _PLAIN_ITEMSIZE.get(dtype)
        if itemsize is None:  # a dtype not seen yet, or a quantized one (its quantizer is not in the bytes)
            if t.is_quantized or t.is_nested:
                return self._pack_other(t)
            itemsize = _PLAIN_ITEMSIZE[dtype] = dtype.itemsize
        try:
            ts = self._tls.state
        except AttributeError:
            ts = self._thread()
        device = t.device
        nbytes = shape.numel() * itemsize  # t.nbytes, without a tensor getter
        leaf = t.is_leaf
        base = None
        on_device = device == self.device
        dev = self._device_name if on_device else (_DEVICE_NAMES.get(device) or policy.device_name(device))
        if cls is _Parameter:
            reason = _PARAMETER  # a weight saved as is (``x * self.w``)
        elif ((base := t._base) is not None and _is_param(base)) or (leaf and getattr(t, "_is_param", False)):
            reason = _PARAMETER  # a view of a weight (``w.t()``), or a tensor flagged as one (policy._classify)
        elif not on_device:
            reason = _OTHER_DEVICE
        elif ts.excluded_depth > 0:
            reason = _EXCLUDED_REGION
        else:
            if nbytes == 0 or nbytes < self.min_offload_size:
                reason = _TOO_SMALL
            elif ptr in self._static_ptrs:
                reason = self._static_ptrs[ptr]  # PARAMETER or BUFFER
            elif leaf:  # with autograd history it is no parameter or buffer (policy._classify)
                reason = self._running_owner(ptr)
            else:
                reason = ""
            if not reason or reason is _TOO_SMALL:
                # Where it was saved decides for a tensor the policy would move or found too small.
                if _graph_task_id() >= 0:
                    reason = _IN_BACKWARD  # Rule 11
                elif ts.after_head:
                    reason = _AFTER_HEAD  # Rule 8
        ledger = self.ledger
        step = self._step_ref()  # _open_step, inlined
        if step is None:
            step = _Step(self)
            self._step_ref = weakref.ref(step)
        stack = ts.module_stack  # current_module_name, inlined: its named case is one dict read
        if stack:
            module = _module_names.get(id(stack[-1]))
            if module is None:
                module = current_module_name()
        else:
            module = ""
        if reason:
            # Kept: a tuple handle (no object, no __del__) holding the tensor, detached
            # when it has autograd history (Rule 10: a leaf closes no cycle through a
            # grad_fn), and the version to check at unpack (Rule 6). _saved_alias, inlined.
            handle: Any = (t if leaf else t.detach(), t._version, step)
            # The record as a tuple (NOTE [ Ledger logs ]); the ledger names the dtype on read.
            # tuple(shape), not the torch.Size: a tuple of ints, strings, a dtype and a tuple
            # of ints is untracked by the cycle collector at its first pass, so the records
            # ring never grows the old generation (whose growth triggers full collections).
            rec: Any = (next(self._seq), ledger.current_step, nbytes, tuple(shape), dtype, dev, module,
                        KEPT, reason, ptr, len(st))  # len: st.nbytes() without the argument parsing
            ledger.kept_log[reason].append(nbytes)  # every reason has its list (Ledger.reset)
        else:
            if t.is_nested:  # (only offload candidates pay this check: see _PLAIN_ITEMSIZE)
                return self._pack_other(t)
            rec = PackRecord(next(self._seq), ledger.current_step, nbytes, tuple(shape),
                             _DTYPE_NAMES.get(dtype) or policy.dtype_name(dtype), dev, module,
                             KEPT, reason, ptr, st.nbytes())
            handle = self._offload(t, rec, (dev, ptr), ts, step, dtype, device)
            reason = rec.reason
            if handle is None:  # no room on the host (Rule 9)
                handle = (_saved_alias(t), t._version, step)
            if rec.decision == OFFLOADED:
                ledger.offloaded_log.append(nbytes)
                ledger.d2h_log.append(rec.copy_bytes)
            else:
                ledger.log_kept(reason, nbytes)
        ledger._open_used = True
        if reason is not _PARAMETER and reason is not _BUFFER:
            # The bytes this save's span adds to the step's union of saved spans
            # (offload._spans: what the profilers count too).
            if ptr:
                lo_b = t.storage_offset() * itemsize
                hi_b = lo_b + nbytes if t.is_contiguous() else byte_span(t)[1]
                ident: Any = (dev, ptr)
                seen = self._seen.entries
                if ident not in seen and hi_b > lo_b:
                    # A storage not seen this step (most saves): SpanSet.add_span, inlined.
                    seen[ident] = (weakref.ref(t if base is None else base), lo_b, hi_b)
                    unique = hi_b - lo_b
                else:
                    unique = self._seen.add_span(t, ident, lo_b, hi_b)
            else:  # an empty storage (all at address 0): keyed by the tensor itself
                unique = self._seen.add_span(t, ("id", id(t)), 0, nbytes)
            if unique:
                ledger.unique_log.append(unique)
        if _observer_count[0] and (self._observers or _tls.__dict__.get("observers")):
            if type(rec) is tuple:
                rec = record_from_log(rec)  # the observers and the ring share one record
            ledger.records_log.append(rec)
            self._notify(t, rec)
        else:
            ledger.records_log.append(rec)
        return handle

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
        if not self.enabled:
            reason = policy.DISABLED
        else:
            reason = policy._classify(t, self.device, self.min_offload_size, ts.excluded_depth > 0,
                                      self._static_ptrs, current_modules, nbytes, ptr)
            if not reason or reason == policy.TOO_SMALL:
                # Where it was saved decides for a tensor the policy would move or found too small.
                if _graph_task_id() >= 0:
                    reason = policy.IN_BACKWARD  # Rule 11
                elif ts.after_head:
                    reason = policy.AFTER_HEAD  # Rule 8
        device = t.device
        dev = _DEVICE_NAMES.get(device) or policy.device_name(device)
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
        dtype = t.dtype
        rec = PackRecord(seq, self.ledger.current_step, nbytes, shape,
                         _DTYPE_NAMES.get(dtype) or policy.dtype_name(dtype),
                         dev, current_module_name(), KEPT, reason, key[1], storage_nbytes)
        step = self._open_step()
        handle: Any = None
        if not reason:
            handle = self._offload(t, rec, key, ts, step, dtype, device)
        if handle is None:
            handle = (_saved_alias(t), t._version, step)
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
        """The host copy already holding ``t``'s current bytes this step, if any (Rule 7)."""
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

    def _offload(self, t: torch.Tensor, rec: PackRecord, key: tuple[str, int], ts: _ThreadState,
                 step: _Step, dtype: torch.dtype, device: torch.device) -> _Offloaded | None:
        # Facts the caller read already come as arguments: rec.shape (a tuple), dtype, device.
        base = t._base
        if base is None:
            base = t
        es = dtype.itemsize
        shape = rec.shape
        version = t._version
        hc = self._shared_copy(t, key) if (self.dedupe and key in self._dedupe) else None
        entry = None
        offset = t.storage_offset()
        conj, neg = t.is_conj(), t.is_neg()
        if hc is not None:
            rec.reason = policy.DUPLICATE_STORAGE
            rec.tier = hc.tier
        else:
            whole = rec.storage_nbytes
            contiguous = t.is_contiguous()
            if contiguous:
                lo_b = offset * es
                hi_b = lo_b + rec.nbytes
            else:
                lo, hi = policy.span_elems(t)
                lo_b, hi_b = lo * es, hi * es
            # t is exactly its storage: copy it into a typed view of the buffer, no byte view of t.
            whole_t = contiguous and offset == 0 and hi_b == whole and not conj and not neg
            if 2 * (hi_b - lo_b) >= whole:
                # Most of the storage: copy all of it so sibling views (q, k, v
                # of one qkv projection) share this copy instead of re-copying.
                lo_b, hi_b = 0, whole
            nbytes = hi_b - lo_b
            buf, tier, note = self.tiers.take(nbytes, rec.module)
            if buf is None:
                rec.reason = policy.HOST_BUDGET
                rec.note = note
                return None
            if nbytes > self._max_copy_bytes:
                self._max_copy_bytes = nbytes
            hc = _HostCopy(buf, self.tiers, lo_b, nbytes)
            hc.tier = tier
            if self._verify:  # on the compute stream, after the producer (NOTE [ Verified offload ])
                hc.checksum = _verify.span_checksum(t.untyped_storage(), lo_b, nbytes, device)
            backend = self._backend
            synchronous = backend.name == "sync"
            if not synchronous:  # (a synchronous copy is never in flight when its handle dies)
                hc.release = backend.release_after
            hc.synchronous = synchronous
            hc.version = version
            try:  # policy._weak, inlined: once per offloaded tensor
                hc.base_ref = weakref.ref(base)
            except TypeError:  # a subclass that refuses weak references
                hc.base_ref = policy._weak(base)
            dst = None
            if whole_t:
                # The typed view made for this range last step comes back with it when the
                # pool replays the step (HostBuffer.cache): no view of either side to make.
                dst = buf.cache
                if dst is None or dst.dtype is not dtype or dst.shape != shape:
                    try:
                        dst = buf.tensor.view(dtype).view(shape)
                    except RuntimeError:  # a dtype view refuses
                        dst = None
                    buf.cache = dst
            if dst is not None:
                src = t
            else:
                dst = buf.tensor
                src = torch.empty(0, dtype=torch.uint8, device=device).set_(
                    t.untyped_storage(), lo_b, (nbytes,), (1,))
            if _profiler_enabled():
                with torch.autograd.profiler.record_function("offload::d2h"):
                    copy = backend.d2h_seconds(src, dst) if synchronous else backend.d2h(src, dst)
            elif synchronous:
                copy = backend.d2h_seconds(src, dst)  # its duration: no Copy object to build
            else:
                copy = backend.d2h(src, dst)
            rec.decision = OFFLOADED
            rec.reason = ""
            rec.copy_bytes = nbytes
            rec.pinned = buf.pinned
            rec.note = note
            rec.tier = tier
            self.ledger.log_tier(tier, nbytes)
            if tier == "disk":
                self.tiers.disk.submit(buf, None if synchronous else copy)
            if synchronous:
                self.ledger.add_sync_copy(rec, "d2h", copy, nbytes)
            else:
                self.ledger.add_copy_time(rec, "d2h", copy)
                entry = _StashEntry(_saved_alias(t), copy, nbytes)
                self._stash_push(entry)
            if self.dedupe:
                self._dedupe[key] = weakref.ref(hc)
        h = _Offloaded()
        h.engine = self
        h.step = step
        h.hc = hc
        hc.users += 1
        # Lazy conj/neg bits live on the view, not in the bytes (Rule 5).
        h.layout = (shape, t.stride(), (offset * es - hc.lo) // es, dtype, device, conj, neg)
        # Rule 6: an empty alias sharing t's version counter, not its storage
        # (a weak reference where the tensor refuses one).
        h.version = version
        tracker = _torch_private.version_tracker(t, device)
        h.tracker = tracker if tracker is not None else policy._weak(t)
        h.rec = rec
        h.stash = entry if rec.decision == OFFLOADED else None
        if not self.prefetch_bytes and self._backend.name == "sync" and self.tiers.disk is None:
            # Nothing loads ahead of a synchronous copy (prefetch_budget): no order to keep.
            h.index = -1
            h.order = None
            return h
        order = ts.order
        with self._lock:
            if len(order) >= self._order_compact_at:
                self._compact(order)
                self._order_compact_at = max(1024, 2 * len(order))
            h.index = len(order)
            h.order = order
            order.append(weakref.ref(h))
        return h

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

    def _make_tiers(self, config: OffloadConfig, dev_type: str | None) -> HostTiers:
        """The host tiers of NOTE [ Host tiers ] from the settings (the disk tier's run directory is
        made here: a ``disk_dir`` that is a file is refused now)."""
        pageable = config.pageable_budget_bytes
        if config.on_host_budget == "pageable" and pageable == 0:
            pageable = None  # the older spelling of "pool, then pageable"
        disk = None
        if config.disk_dir is not None and self.enabled:
            ledger = self.ledger

            def on_time(kind: str, seconds: float, nbytes: int) -> None:
                ledger.add_tier_time("disk", 0.0 if kind == "wait" else seconds,
                                     seconds if kind == "wait" else 0.0)

            disk = DiskStore(config.disk_dir, budget_bytes=config.disk_budget_bytes,
                             queue_bytes=config.disk_queue_bytes, readahead_bytes=config.disk_readahead_bytes,
                             pin=bool(config.use_pin_memory and dev_type not in (None, "cpu")), on_time=on_time)
        return HostTiers(self.pool, pageable_budget_bytes=pageable, disk=disk,
                         on_host_budget=config.on_host_budget,
                         virtual_memory_safe_pct=config.virtual_memory_safe_pct)

    def close(self) -> None:
        """Delete the disk tier's files and run directory (also done at interpreter exit and when
        the engine is freed). Graphs built before cannot be backpropagated through afterwards;
        the engine itself stays usable (later copies skip the disk tier)."""
        self.tiers.close()

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

    def _begin_backward_pass(self) -> _Pass | None:
        """This graph task's pass state, created (and its end queued) at its first unpack."""
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
                    self._passes[gid] = p
                    _torch_private.queue_end_of_backward(p)
        self._last_pass = (gid, weakref.ref(p))  # graph task ids are never reused
        return p

    def _reload(self, h: _Offloaded) -> torch.Tensor:
        p = self._begin_backward_pass()
        tracker = h.tracker
        now = tracker._version if type(tracker) is _Tensor else getattr(tracker(), "_version", h.version)
        shape, stride, offset, dtype, device, conj, neg = h.layout
        if now != h.version:
            raise _inplace_error(shape, dtype, now, h.version)
        entry = h.stash
        hc = h.hc
        if entry is not None and entry.src is not None and hc.users == 1:
            # The source is still alive (its copy may be in flight): use it as is. Not when
            # other handles share the host copy: they get views of one reloaded base, and an
            # in-place write through one must be seen by the others' checks (Rule 6).
            h.rec.note = "reused_source"
            # Allocated on the producer stream: a consumer on another stream is recorded (Rule 4).
            self._backend.record_consumer(entry.src, entry.copy)
            return entry.src
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
                raise _inplace_error(shape, dtype, base._version, version)
        elif pre is not None:
            base, copy = pre[0], pre[1]
        else:
            base, copy = self._load(hc, h.rec)
        self._wait(copy)
        if held is None and hc.checksum is not None:  # a new base: checked once (NOTE [ Verified offload ])
            rec = h.rec
            # (A disk-tier copy has no host tensor left; its file is CRC-checked by the disk tier.)
            host = hc.buf.tensor if hc.tier != "disk" else base
            _verify.check_reload(hc.checksum, base, host, copy.done, module=rec.module,
                                 shape=shape, dtype=rec.dtype, step=rec.step)
        es = dtype.itemsize
        if hc.users > 1 and hc.nbytes % es == 0:
            # Views of one base share its version counter, so an in-place
            # write through one reloaded tensor is seen by the others (Rule 6).
            out = base.view(dtype).as_strided(shape, stride, offset)
        elif offset == 0 and len(shape) == 1 and stride == (1,) and shape[0] * es == hc.nbytes:
            # The whole reloaded base as a 1-D tensor: a dtype view of it is a
            # third of the cost of set_ on a new tensor (the base has no other user).
            out = base.view(dtype)
        else:
            out = torch.empty(0, dtype=dtype, device=device).set_(base.untyped_storage(), offset, shape, stride)
        if conj:
            out = out.conj()
        if neg:
            out = _torch_private.neg_view(out)
        self._backend.record_consumer(out, copy)  # Rule 4: consumed on another stream than allocated
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
            if self.prefetch_budget != 0:
                self._prefetch_after(h, p)
            if self.tiers.disk is not None:
                self._disk_readahead(h)
        return out

    def _disk_readahead(self, h: _Offloaded) -> None:
        """Start reading the disk-tier copies packed just before ``h`` (backward order: the order
        prefetch uses) on the disk tier's reader thread, up to ``disk_readahead_bytes``."""
        order = h.order
        if order is None:
            return
        disk = self.tiers.disk
        with self._lock:
            i = min(h.index, len(order)) - 1
            seen = 0
            while i >= 0 and seen < 64:
                x = order[i]()
                i -= 1
                if x is None:
                    continue
                seen += 1
                hc = x.hc
                if hc.tier != "disk" or hc.used >= hc.users or hc.prefetched is not None:
                    continue
                if hc.buf.read is None and not disk.prefetch(hc.buf):
                    if hc.buf.state == "on_disk":
                        break  # the read-ahead budget is full

    def _load(self, hc: _HostCopy, rec: PackRecord | None) -> tuple[torch.Tensor, Copy]:
        backend = self._backend
        src = hc.buf.tensor if hc.tier != "disk" else self.tiers.disk.load(hc.buf)
        if _profiler_enabled():
            with torch.autograd.profiler.record_function("offload::h2d"):
                dev, copy = backend.h2d(src)
        else:
            dev, copy = backend.h2d(src)
        if backend.name == "sync":
            self.ledger.add_sync_copy(rec, "h2d", copy.seconds or 0.0, hc.nbytes)
        else:
            self.ledger.add_copy_time(rec, "h2d", copy, hc.nbytes)
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
            with _span("offload::stall"):
                self._backend.wait(copy)
            end = self._backend._event()
            end.record(stream)
            self.ledger.add_copy_time(None, "stall", Copy(end, None, start, stream))
        else:
            self._backend.wait(copy)

    @property
    def prefetch_budget(self) -> int:
        """Bytes backward may load ahead of need (``prefetch_bytes`` resolved).

        The default (None) is twice the largest copy on a side stream, and 0
        with synchronous copies (CPU, ``use_streams=False``): a load ahead
        cannot overlap anything there, it only holds the bytes longer.
        """
        if self.prefetch_bytes is not None:
            return self.prefetch_bytes
        if self._backend is None or self._backend.name == "sync":
            return 0
        return 2 * self._max_copy_bytes

    def _prefetch_after(self, h: _Offloaded, p: _Pass) -> None:
        """Load the handles packed just before ``h`` (backward order) within the budget."""
        order = h.order
        if order is None:
            return  # packed when nothing loaded ahead (a synchronous backend's default)
        with _span("offload::prefetch"), self._lock:
            i = min(h.index, len(order)) - 1  # read under the lock: compaction renumbers
            budget = self.prefetch_budget
            lookahead = 0
            while i >= 0 and lookahead < 64 and p.prefetched_bytes < budget:
                x = order[i]()
                i -= 1
                if x is None:
                    continue
                lookahead += 1
                hc = x.hc
                if hc.prefetched is not None or (x.stash is not None and x.stash.src is not None):
                    continue
                if hc.held is not None or hc.used >= hc.users:
                    continue  # on the device already, or consumed in this pass
                if p.prefetched_bytes + hc.nbytes > budget:
                    break
                dev, copy = self._load(hc, x.rec)
                hc.prefetched = (dev, copy, p.gid)
                p.prefetched_bytes += hc.nbytes
                p.prefetched.append(weakref.ref(hc))

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
                    self._backend.release_after(copy, copy.stream)
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
            self._drain_stash()
            for order in self._orders:
                self._compact(order)
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
        self.tiers.end_step()
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
            # The next pack starts a new _Step: a graph retained from this step
            # must not stop a later forward-only step from closing.
            self._step_ref = _dead

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

    def attach(self, model: nn.Module) -> "AttachHandle":
        """Enter this engine around every forward of ``model``; ``handle.remove()`` undoes it.

        Any training loop then offloads without a ``with`` block; backward runs
        outside the engine, as usual. See ``offload.attach``.
        """
        from .attach import attach

        return attach(self, model)
