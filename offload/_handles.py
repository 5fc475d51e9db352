"""The handles autograd holds for saved tensors, and the engine's unpack hook.

A kept tensor's handle is the tuple ``(alias, version, step)``; an offloaded
one's is an ``_Offloaded`` that shares a ``_HostCopy`` with every other save of
its storage (Rule 7). Handles hold their engine (the hooks hold none: Rule 10),
so unpacking needs nothing but the handle. See NOTE [ Offload lifetime rules ]
in ``offload/engine.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import _torch_private, policy
from .errors import _internal_assert
from .pool import HostBuffer
from .streams import Copy

if TYPE_CHECKING:
    from .disk import DiskRecord
    from .engine import OffloadActivations

_profiler_enabled = _torch_private.profiler_enabled_c


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

    __slots__ = ("engine", "order", "__weakref__")

    def __init__(self, engine: "OffloadActivations") -> None:
        self.engine = engine
        # The pack order of the step's latest offloaded handle: what a pass whose first unpack is a kept
        # handle walks to start its reloads (NOTE [ Copy schedule ] item 3).
        self.order: list[weakref.ref] | None = None


def _dead() -> None:
    return None


class _HostCopy:
    """Bytes [lo, lo + nbytes) of one storage, held in a host buffer (Rule 1).

    Shared by every handle whose tensor aliases that storage (Rule 7); goes
    back to the pool when the last handle is dropped.
    """

    __slots__ = ("buf", "give", "lo", "nbytes", "prefetched", "held", "users", "used",
                 "version", "base_ref", "release", "synchronous", "checksum", "tier", "inflight", "gathered",
                 "typed", "__weakref__")

    def __init__(self, buf: "HostBuffer | DiskRecord", give: Callable[[Any], None], lo: int, nbytes: int,
                 tier: str, version: int, base: torch.Tensor, synchronous: bool,
                 release: Callable[[Copy, Any, str], None] | None) -> None:
        self.buf = buf
        self.give = give  # takes the buffer back: the pool's give for a pool buffer, else HostTiers.give
        self.tier = tier
        self.lo = lo
        self.nbytes = nbytes
        self.prefetched: tuple[torch.Tensor, Copy] | None = None
        # Reloaded device bytes (a flat uint8 base, its copy and the base's
        # version), held while other handles sharing this copy have not been
        # unpacked yet in this backward pass; they get views of the same base.
        self.held: tuple[torch.Tensor, Copy, int] | None = None
        self.users = 0
        self.used = 0
        # backend.release_after(copy, stream, fault site), to order a never-consumed prefetch's
        # allocation stream after its copy when this dies (Rule 4); None for a synchronous copy.
        self.release = release
        self.version = version  # of the first saver's base at the copy (Rule 7)
        try:  # that base, weakly (policy._weak, inlined: once per offloaded tensor)
            self.base_ref: Callable[[], torch.Tensor | None] = weakref.ref(base)
        except TypeError:  # a subclass that refuses weak references
            self.base_ref = policy._weak(base)
        self.synchronous = synchronous
        self.checksum: torch.Tensor | None = None  # verify=True: the span's checksum at pack (device)
        # The stash entry of the D2H that wrote these bytes (its source still alive while
        # entry.src is set): a reload issued before the compute stream waited on that D2H waits
        # on it itself (NOTE [ Ordering faults ]: h2d_waits_d2h).
        self.inflight: _StashEntry | None = None
        # A gathered copy (Rule 5's exception: a view spread over more than twice its bytes) holds only the
        # view's elements, densely, in its stride order: the stride of those bytes (the view's own size and
        # stride are its handle's layout); None for a span copy (bytes [lo, lo + nbytes)).
        self.gathered: tuple[int, ...] | None = None
        # A whole contiguous tensor's copy: the host buffer as that tensor (its dtype and shape), which a
        # reload by its only user copies into a device tensor of its own dtype and shape, so unpack
        # hands that over as it is (no view or set_ to rebuild it); None for a byte span.
        self.typed: torch.Tensor | None = None

    def __del__(self) -> None:
        try:
            if self.prefetched is not None and self.release is not None:
                copy = self.prefetched[1]
                self.release(copy, copy.stream, "dropped_prefetch_release_waits_copy")
            self.give(self.buf)
        except Exception:  # interpreter shutdown: nothing left to return to
            pass


def live_original(h: "_Offloaded") -> torch.Tensor | None:
    """The first saver's base of ``h``'s host copy when something besides the engine still holds it
    (another block's kept save, a model-level tensor: rotary tables, masks), on ``h``'s storage, of its
    dtype and unchanged since its copy (its version); else None. Its bytes are on the device anyway: a
    reload would duplicate them (NOTE [ Copy schedule ] item 6). Not for a gathered copy (a view's
    elements) or a span that starts inside an element of the dtype."""
    hc, dtype = h.hc, h.layout[3]
    if hc.gathered is not None or hc.lo % dtype.itemsize:
        return None
    b = hc.base_ref()
    if b is None or b.dtype != dtype or b._version != hc.version or policy.storage_ptr(b) != h.rec.storage_key:
        return None
    return b


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
    step.engine._kept_unpacked(step)
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
        step.engine._kept_unpacked(step)  # the pass's reloads may start here (NOTE [ Copy schedule ])
        if t._version != version:
            raise _inplace_error(t.shape, t.dtype, t._version, version)
        return t
    if type(handle) is _Offloaded:  # _Offloaded.unpack, inlined: once per offloaded tensor
        return handle.engine._reload(handle)
    return _unpack_any(handle)


def _unpack_any(handle: Any) -> torch.Tensor:
    cls = type(handle)
    if cls is tuple:
        return _unpack_kept(handle)
    if cls is _Offloaded or cls is _Kept:
        return handle.unpack()
    _internal_assert(False, f"unpack got a {cls.__name__}")
    raise AssertionError  # unreachable
