"""``verify=True``: the offloaded bytes are checked on their way back (NOTE [ Verified offload ]).

NOTE [ Verified offload ]
With ``OffloadConfig(verify=True)`` the engine takes a checksum of each offloaded byte span on the
device, on the compute stream right before the device-to-host copy is issued (so after the kernel
that produced it, in stream order, with no host synchronize), and keeps it with the host copy. When
backward first reads a reloaded span, after the compute stream waited for its copy, the checksum is
taken again on the reloaded bytes and compared (one host synchronize per reload: this is a
debugging mode; the checksum itself allocates nothing the size of the span). On a mismatch the host copy is summed too, to say which side differed: ``d2h``
(the copy off the device did not read the bytes the producer wrote) or ``h2d`` (the copy back, or
compute's wait for it, went wrong); ``OffloadVerifyError`` names the module, shape, dtype, step and
side. The checksum is the sum (mod 2**64) of the span as 64-bit words plus its last bytes: it
catches stale, uninitialised, poisoned or torn bytes, not a permutation of words.
"""

from __future__ import annotations

import torch

from .errors import DEBUG_TIP, OffloadError
from .streams import _FAULTS

__all__ = ["OffloadVerifyError", "span_checksum", "check_reload"]


class OffloadVerifyError(OffloadError):
    """``verify=True`` found reloaded bytes that differ from the bytes offloaded (see NOTE [ Verified offload ])."""

    def __init__(self, message: str, *, module: str, shape: tuple, dtype: str, step: int, side: str) -> None:
        super().__init__(message)
        self.module, self.shape, self.dtype, self.step, self.side = module, shape, dtype, step, side


def _checksum(b: torch.Tensor) -> torch.Tensor:
    """Sum (mod 2**64) of the flat uint8 span ``b`` read as 64-bit words, plus its last bytes: no
    temporary the size of the span (a dtype'd sum of narrower words would materialise one)."""
    n = b.numel()
    n8 = n - n % 8
    bulk = b[:n8]
    if bulk.storage_offset() % 8:
        bulk = bulk.clone()  # not word-aligned in memory: the same words, from an aligned copy
    s = bulk.view(torch.int64).sum()
    if n8 != n:
        s = s + b[n8:].sum(dtype=torch.int64)  # (at most 7 bytes)
    return s


def span_checksum(storage: torch.UntypedStorage, lo: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """Sum of bytes ``[lo, lo + nbytes)`` of ``storage`` as 32-bit words, a 0-dim int64 tensor on
    ``device``, computed on the current stream (no host synchronize)."""
    b = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, lo, (nbytes,), (1,))
    return _checksum(b)


def check_reload(expected: torch.Tensor, reloaded: torch.Tensor, host: torch.Tensor, done: object | None, *,
                 module: str, shape: tuple, dtype: str, step: int) -> None:
    """Compare the reloaded span (flat uint8, on the device) with ``expected``; raise naming the side.

    ``done``: the reload's copy event (None when synchronous); the host copy is read only after it,
    and only on a mismatch."""
    got = _checksum(reloaded)
    if bool((got == expected).item()):
        return
    if done is not None and not (_FAULTS and "verify_host_after_copy" in _FAULTS):  # NOTE [ Ordering faults ]
        # The host copy's D2H ran before the reload (same side stream): without this, a reload whose
        # compute wait is missing (the bug being named) may find its D2H still queued, and the side
        # would read "d2h".
        done.synchronize()
    host_sum = _checksum(host)
    want = int(expected.item())
    side = "d2h" if int(host_sum.item()) != want else "h2d"
    what = ("the host copy already differs from the device bytes at pack time: the device-to-host copy "
            "did not read what the producer wrote (its side stream did not wait for the producer, or the "
            "source was overwritten while the copy was queued)" if side == "d2h" else
            "the host copy is right but the reloaded device bytes differ: the host-to-device copy or the "
            "compute stream's wait for it went wrong (or its block was reused while the copy was queued)")
    raise OffloadVerifyError(
        f"OffloadActivations(verify=True): a {dtype} {list(shape)} activation saved in module "
        f"{module or '<top level>'!r} at step {step} came back with different bytes (checksum "
        f"{int(got.item())}, expected {want}; side: {side}): {what}. {DEBUG_TIP}",
        module=module, shape=tuple(shape), dtype=dtype, step=step, side=side,
    )
