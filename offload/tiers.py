"""Host tiers: where the bytes of one device-to-host copy go (Rule 9).

NOTE [ Host tiers ]
A copy tries the tiers in order and lands in the first with room:

1. ``pool``: the engine's ``HostPool`` (pinned with an accelerator), capped
   by ``host_budget_bytes``. A chunk that cannot be pinned (an OS cap,
   ``vm.max_map_count``, WSL2's pinned limit) is not made pageable in the
   pool: the request moves on at once, counted in the pool's
   ``pin_failures`` and warned about once with the cause and the fix.
2. ``pageable``: one-off pageable buffers (``HostPool.overflow``), capped by
   ``pageable_budget_bytes`` (0 = no such tier, None = only the RAM ceiling;
   ``on_host_budget="pageable"`` is the older spelling of None).
3. ``disk``: ``offload.disk.DiskStore`` under ``disk_dir``, capped by
   ``disk_budget_bytes`` or the free space (NOTE [ Disk tier ]).
4. ``on_host_budget``: "keep" leaves the tensor on the device (reason
   ``host_budget``), "raise" raises ``OffloadError``.

The RAM ceiling (``virtual_memory_safe_pct``) gates what takes new host
memory: the pool's growth (``HostPool.grow_gate``), pageable buffers and the
disk tier's staging (its staging pool's growth and one-off buffers:
``DiskStore.grow_gate``; refused, the copy goes to ``on_host_budget``, counted
in the disk stats' ``ram_ceiling_refused``). A take served from memory the
pool (or the staging pool) already holds allocates nothing and asks nothing,
so a steady-state step above the ceiling still offloads into the held pool,
and the common copy reads no clock. Every copied byte is in exactly one tier:
``d2h_bytes == pool received_bytes + pool overflow_bytes + disk
received_bytes``, and the ledger counts the same bytes per tier
(``PackRecord.tier``, ``summary()["tiers"]``).
"""

from __future__ import annotations

import threading
from typing import Any

import psutil

from ._warn import warn_user
from .disk import DiskRecord, DiskStore
from .errors import OffloadError
from .policy import RamCeiling
from .pool import HostBuffer, HostPool

__all__ = ["HostTiers"]


class HostTiers:
    """The engine's host tiers: ``take`` a buffer for a copy, ``give`` it back (see the NOTE)."""

    def __init__(self, pool: HostPool, *, pageable_budget_bytes: int | None, disk: DiskStore | None,
                 on_host_budget: str, virtual_memory_safe_pct: float | None = None) -> None:
        self.pool = pool
        self.give_pool = pool.give
        """``pool.give``, bound once: what a pool copy's handle calls to give its buffer back."""
        self.pageable_budget_bytes = pageable_budget_bytes
        """Cap on live pageable bytes: 0 = no pageable tier, None = only the RAM ceiling."""
        self.disk = disk
        """The disk tier (None when ``disk_dir`` is None)."""
        self.final = "raise" if on_host_budget == "raise" else "keep"
        """What a copy that fits no tier gets."""
        self.virtual_memory_safe_pct = virtual_memory_safe_pct
        """System RAM use (percent) above which no tier takes new host memory (pool, pageable, disk staging)."""
        ceiling = virtual_memory_safe_pct is not None and virtual_memory_safe_pct < 100
        self._ram_gauge = RamCeiling(pct=virtual_memory_safe_pct if ceiling else 100.0)  # sampled
        pool.grow_gate = self._ram_gauge if ceiling else None  # only new memory asks (NOTE)
        if disk is not None:
            disk.grow_gate = pool.grow_gate  # so does disk staging (a held staging range never asks)
        self._lock = threading.Lock()
        self._pageable_in_use = 0
        self._pageable_peak = 0
        self._pin_failures_seen = 0
        self._pin_warned = False

    @property
    def names(self) -> tuple[str, ...]:
        """The tiers this engine has, in order."""
        out = ["pool"]
        if self.pageable_budget_bytes != 0:
            out.append("pageable")
        if self.disk is not None:
            out.append("disk")
        return tuple(out)

    def take(self, nbytes: int, module: str = "") -> tuple[HostBuffer | DiskRecord | None, str, str]:
        """``(buffer, tier, note)`` for a copy of ``nbytes``, or ``(None, "", note)`` for "keep";
        raises ``OffloadError`` under "raise". ``note`` is "pin_failed" when pinning failed."""
        pool = self.pool
        note = ""
        failures = pool._pin_failures
        buf = pool.take(nbytes)  # the RAM ceiling is asked only if the pool must grow (its grow_gate)
        if buf is not None:
            return buf, "pool", ""
        if pool._pin_failures != failures:
            note = "pin_failed"
            self._warn_pin(nbytes)
        budget = self.pageable_budget_bytes
        if budget != 0 and (pool.grow_gate is None or self._ram_gauge(nbytes)):  # new memory: asks
            with self._lock:
                fits = budget is None or self._pageable_in_use + nbytes <= budget
                if fits:
                    self._pageable_in_use += nbytes
                    self._pageable_peak = max(self._pageable_peak, self._pageable_in_use)
            if fits:
                return pool.overflow(nbytes), "pageable", note
        disk = self.disk
        if disk is not None:
            rec = disk.reserve(nbytes)
            if rec is not None:
                return rec, "disk", note
        if self.final == "raise":
            self._raise(nbytes, module)
        return None, "", note

    def give(self, buf: HostBuffer | DiskRecord) -> None:
        """The copy in ``buf`` is no longer needed (its last handle died: Rule 1)."""
        if type(buf) is DiskRecord:
            self.disk.give(buf)
        elif buf.pooled:
            self.pool.give(buf)
        else:
            with self._lock:
                self._pageable_in_use -= buf.nbytes

    def _warn_pin(self, nbytes: int) -> None:
        if self._pin_warned:
            return
        self._pin_warned = True
        nxt = [n for n in self.names if n != "pool"]
        where = nxt[0] if nxt else ("raise OffloadError" if self.final == "raise" else "keep it on the device")
        warn_user(
            f"offload: pinning host memory for a {nbytes}-byte copy failed ({self.pool.last_pin_error or '?'}); "
            f"this is a host limit, not a device out-of-memory. The copy and every later one the "
            f"pinned pool cannot hold go to the next tier ({where}), counted in "
            "ctx.pool.stats()['pin_failures']. Fix: raise the OS limit on page-locked memory (WSL2 "
            "caps it; `ulimit -l`; `sysctl vm.max_map_count`), set host_budget_bytes below what can "
            "be pinned, add a pageable tier (pageable_budget_bytes=None or a size), or pass "
            "use_pin_memory=False."
        )

    def _raise(self, nbytes: int, module: str) -> None:
        st = self.pool.stats()
        disk = ""
        if self.disk is not None:
            d = self.disk.stats()
            disk = (f"; disk tier {d['file_bytes']} B in {d['dir']!r} (disk_budget_bytes="
                    f"{d['budget_bytes']}, refused {d['refused']})")
        raise OffloadError(
            f"OffloadActivations: host budget full: a {nbytes}-byte activation from module "
            f"{module or '<top level>'!r} fits no host tier (pool: host_budget_bytes="
            f"{self.pool.capacity_bytes}, reserved {st['reserved_bytes']} B, in use {st['in_use_bytes']} B; "
            f"pageable: pageable_budget_bytes={self.pageable_budget_bytes}, in use {self._pageable_in_use} B"
            f"{disk}; virtual_memory_safe_pct={self.virtual_memory_safe_pct}, system RAM at {psutil.virtual_memory().percent:.1f}%). Raise "
            "host_budget_bytes, add a tier (pageable_budget_bytes, disk_dir), offload less "
            "(min_offload_size, ctx.exclude(module)), or set on_host_budget='keep' to leave such "
            "tensors on the device."
        )

    def end_step(self) -> None:
        if self.disk is not None:
            self.disk.end_step()

    def close(self) -> None:
        """Delete the disk tier's files and run directory (pool buffers go with their handles)."""
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict[str, Any]:
        """Per tier: the pool's ``stats()``, the pageable tier's bytes in use / peak / budget and
        received bytes, the disk tier's ``stats()`` (None without one)."""
        pool = self.pool.stats()
        with self._lock:
            pageable = {
                "received_bytes": pool["overflow_bytes"],
                "count": pool["overflow_count"],
                "in_use_bytes": self._pageable_in_use,
                "peak_in_use_bytes": self._pageable_peak,
                "budget_bytes": self.pageable_budget_bytes,
            }
        return {"pool": pool, "pageable": pageable, "disk": self.disk.stats() if self.disk is not None else None}

    def received_bytes(self) -> int:
        """Bytes copied into any tier: equals the ledger's ``d2h_bytes`` (Rule 9)."""
        st = self.stats()
        return (st["pool"]["received_bytes"] + st["pageable"]["received_bytes"]
                + (st["disk"]["received_bytes"] if st["disk"] is not None else 0))
