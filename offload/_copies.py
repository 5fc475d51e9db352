"""The engine's copies: device to host at pack, host to device at unpack.

Every copy goes through the engine's copy backend (``offload.streams``:
a side stream with events, or synchronous copies), so this is where the
stream ordering rules are kept (Rules 2 and 4 of NOTE [ Offload lifetime
rules ] in ``offload/engine.py``); when a copy's source is released and when
a reload starts is the copy schedule's (``offload/_schedule.py``). Host bytes
come from the engine's ``HostTiers`` (``offload/tiers.py``). A mixin of
``OffloadActivations``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from . import _torch_private, _verify
from ._handles import _HostCopy, _saved_alias, _StashEntry
from .ledger import OFFLOADED, Ledger, PackRecord
from .streams import Copy

if TYPE_CHECKING:
    from ._schedule import _Schedule
    from .tiers import HostTiers

_profiler_enabled = _torch_private.profiler_enabled_c
_NO_SPAN = nullcontext()  # stateless: one instance serves every caller
_UINT8 = torch.uint8


def _span(name: str) -> Any:
    """A ``record_function`` range when a profiler is recording, else a no-op (cheap)."""
    if _profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return _NO_SPAN


def _byte_view(t: torch.Tensor, buf: Any, lo: int, nbytes: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) of a copy of bytes ``[lo, lo + nbytes)`` of ``t``'s storage into ``buf``."""
    src = torch.empty(0, dtype=torch.uint8, device=device).set_(t.untyped_storage(), lo, (nbytes,), (1,))
    return src, buf.tensor


def _typed_view(buf: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``buf`` as a ``dtype`` tensor of ``shape`` (None where a dtype view refuses), kept in ``buf.cache``
    as ``(dtype, shape, view)``: the pool hands it back with the range when it replays the step, and
    ``_copy_out`` uses it again while the dtype and shape are the same."""
    try:
        dst = buf.tensor.view(dtype).view(shape)
    except RuntimeError:
        dst = None
    buf.cache = (dtype, shape, dst)
    return dst


def _gathered(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A dense copy of ``t``'s elements (made on the compute stream) and its stride: what crosses the link
    for a view spread over more than twice its bytes (v of a fused qkv, a strided slice), Rule 5's
    exception; unpack scatters the elements back into a tensor of the view's size and stride."""
    source = torch.empty_like(t)
    source.copy_(_saved_alias(t))
    return source, source.stride()


class _Copies:
    """Copy-side state and methods of ``OffloadActivations`` (its ``__init__`` sets these)."""

    _backend: Any
    tiers: "HostTiers"
    _sched: "_Schedule"
    ledger: Ledger
    timing: bool
    _verify: bool

    # -- device to host (pack) ------------------------------------------------------

    def _copy_out(self, t: torch.Tensor, rec: PackRecord, dtype: torch.dtype, device: torch.device,
                  contiguous: bool, lo_b: int, hi_b: int, version: int, base: torch.Tensor,
                  lazy_bits: bool) -> tuple[_HostCopy, _StashEntry | None] | None:
        """Copy the bytes ``[lo_b, hi_b)`` of ``t``'s storage (all it can touch; ``contiguous`` as
        the caller read it) into a new host copy; None when no host buffer is granted (Rule 9).
        Fills the record's copy fields. The source stays alive in the stash until an asynchronous
        copy is done (Rule 2)."""
        whole = rec.storage_nbytes
        whole_t = contiguous and lo_b == 0 and hi_b == whole and not lazy_bits  # t is its storage
        gathered = None
        if 2 * rec.nbytes < hi_b - lo_b and not lazy_bits:  # (never whole_t: that tensor's bytes are its span)
            source, gathered = _gathered(t)
            lo_b, hi_b = 0, rec.nbytes
        else:
            source = t
            if 2 * (hi_b - lo_b) >= whole:  # most of it: copy all, so sibling views (q, k, v) share it (Rule 7)
                lo_b, hi_b = 0, whole
        nbytes = hi_b - lo_b
        tiers = self.tiers
        buf, tier, note = tiers.take(nbytes, rec.module)  # where the bytes go (Rule 9)
        if buf is None:
            rec.note = note
            return None
        backend = self._backend
        synchronous = backend.name == "sync"  # (never in flight when its handle dies: no release)
        hc = _HostCopy(buf, tiers.give_pool if tier == "pool" else tiers.give, lo_b, nbytes, tier, version,
                       base, synchronous, None if synchronous else backend.release_after)
        hc.gathered = gathered
        if self._verify:  # on the compute stream, after the producer (NOTE [ Verified offload ])
            hc.checksum = _verify.span_checksum(source.untyped_storage(), lo_b, nbytes, device)
        # A whole tensor goes into a typed view of the buffer (the one made for this range last
        # step comes back with it when the pool replays the step); anything else as bytes.
        cached = buf.cache if whole_t else None
        if cached is not None and cached[0] is dtype and cached[1] == rec.shape:
            dst = cached[2]
        else:
            dst = _typed_view(buf, dtype, rec.shape) if whole_t else None
        if dst is None:
            src, dst = _byte_view(source, buf, lo_b, nbytes, device)
        else:  # (a disk copy comes back as bytes; a uint8 one is its bytes: _rebuild tells them by dtype)
            src, hc.typed = t, (dst if tier != "disk" and dtype is not _UINT8 else None)
        if _profiler_enabled():
            with torch.autograd.profiler.record_function("offload::d2h"):
                copy = backend.d2h_seconds(src, dst) if synchronous else backend.d2h(src, dst)
        else:  # a synchronous copy's duration: no Copy object to build
            copy = backend.d2h_seconds(src, dst) if synchronous else backend.d2h(src, dst)
        rec.decision, rec.copy_bytes = OFFLOADED, nbytes  # (its reason is "": an offload candidate's)
        rec.pinned, rec.note, rec.tier = buf.pinned, note, tier
        if tier == "disk":
            tiers.disk.submit(buf, None if synchronous else copy)
        if synchronous:
            self.ledger.add_sync_copy(rec, "d2h", copy, nbytes)
            return hc, None
        self.ledger.add_copy_time(rec, "d2h", copy)
        entry = hc.inflight = _StashEntry(_saved_alias(t) if gathered is None else source, copy, nbytes)
        self._sched.push(entry)  # its source stays alive until the copy is done (NOTE [ Copy schedule ])
        return hc, entry

    # -- host to device (unpack) --------------------------------------------------------

    def _load(self, hc: _HostCopy, rec: PackRecord | None) -> tuple[torch.Tensor, Copy]:
        """Start the copy of ``hc`` back to the device (Rule 4: allocated for the compute stream): into a
        flat uint8 base, or, for a whole tensor's only user (``hc.typed``), a tensor of its dtype and shape."""
        backend = self._backend
        buf = hc.buf
        if hc.tier == "disk":
            src, pinned = self.tiers.disk.load(buf), None
        else:  # (a whole tensor's only user: reloaded as that tensor)
            src, pinned = (hc.typed if hc.typed is not None and hc.users == 1 else buf.tensor), buf.pinned
        e = hc.inflight  # its D2H not yet waited on by compute (a shared copy's other handle)
        after = e.copy if e is not None and e.src is not None else None
        if _profiler_enabled():
            with torch.autograd.profiler.record_function("offload::h2d"):
                dev, copy = backend.h2d(src, after, pinned)
        else:
            dev, copy = backend.h2d(src, after, pinned)
        if backend.name == "sync":
            self.ledger.add_sync_copy(rec, "h2d", copy.seconds or 0.0, hc.nbytes)
        else:
            self.ledger.add_copy_time(rec, "h2d", copy, hc.nbytes)
        return dev, copy

    def _wait(self, copy: Copy) -> None:
        """Make the compute stream wait for ``copy`` (Rule 4), timing the wait when it is exposed."""
        if copy.done is None:
            return
        if self.timing and not copy.query():
            # The copy is not done when compute needs it: time the exposed wait
            # with a pair of events on the compute stream around the wait.
            stream = self._backend.current_stream()
            start = self._backend._event()
            start.record(stream)
            with _span("offload::stall"):
                self._backend.wait(copy, "stall_waits_copy")
            end = self._backend._event()
            end.record(stream)
            self.ledger.add_copy_time(None, "stall", Copy(end, None, start, stream))
        else:
            self._backend.wait(copy, "compute_waits_copy")
