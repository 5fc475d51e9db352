"""The ledger: one record per pack decision, totals per step, JSON export.

Totals reconcile by construction: every pack adds exactly one record, which is
either offloaded or kept, so ``packed = offloaded + kept`` for counts and
logical bytes, and ``kept_bytes == sum(kept_by_reason.values())``.

Two byte measures, on purpose: ``offloaded_bytes`` is logical (numel x
element size of the tensors that moved), while ``d2h_bytes`` is what was
copied, and equals what the host pool received. They differ because the
engine copies the storage span a view can touch (the whole storage when the
view covers at least half of it, so sibling views such as q, k, v of one
fused projection share one copy); later saves of that storage are kept with
reason ``duplicate_storage`` and move nothing.

NOTE [ Ledger logs ]
The pack hook runs once per saved tensor on the thread that launches kernels,
so recording a decision must cost next to nothing and take no lock. A decision
is therefore appended, not summed: its logical bytes go to one list per kept
reason (or to the offloaded list), the bytes it adds to the step's distinct
saved bytes to another, and its record to the records ring, as the tuple of
``PackRecord``'s first eleven fields when nothing will change it later (a kept
decision, its shape logged as a tuple and its dtype as the tensor's
``torch.dtype``; ``record_from_log`` builds the ``PackRecord``, dtype named, when
``records`` is read). Such a tuple holds no object the cycle collector follows, so
the collector untracks it at its first pass (the C++ hook, ``native_hooks=True``,
untracks it at once): the ring of up to ``max_records`` records never feeds the
old generation, whose growth is what triggers full collections. Synchronous copies log their seconds and bytes the same way
(``add_sync_copy``). ``list.append`` is atomic, so packs on several threads need no lock.
The per-step totals are the sums of those lists: ``close_step`` (and
``totals()``, without consuming them) adds them up, taking exactly the first
``len()`` items of each list, so an append that races a close lands whole in
the next step.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from collections.abc import Mapping
from typing import Any, Callable

from ._format import format_bytes, render_table
from .policy import REASONS, dtype_name

__all__ = ["PackRecord", "StepTotals", "Ledger", "TIERS"]

OFFLOADED = "offloaded"
KEPT = "kept"
TIERS = ("pool", "pageable", "disk")
"""The host tiers, in the order a copy tries them (NOTE [ Host tiers ] in offload.tiers)."""


def _tier_row() -> dict[str, float]:
    """One tier's figures: ``bytes`` and ``count`` of the copies made into it, ``seconds`` spent
    moving bytes into and out of it (copies; the disk tier's file writes and reads, on its
    threads), ``wait_seconds`` the compute thread waited for them (exposed)."""
    return {"bytes": 0, "count": 0, "seconds": 0.0, "wait_seconds": 0.0}


def _tier(totals: "StepTotals", name: str) -> dict[str, float]:
    row = totals.tiers.get(name)
    if row is None:
        row = totals.tiers[name] = _tier_row()
    return row


@dataclass(slots=True, eq=False)
class PackRecord:
    """One decision about one tensor saved for backward."""

    seq: int
    """Pack order within the engine (0-based, never reset)."""
    step: int
    """Index of the step the pack belongs to."""
    nbytes: int
    """Logical bytes: numel * element_size."""
    shape: tuple[int, ...]
    """Tensor shape."""
    dtype: str
    """Tensor dtype, e.g. "torch.bfloat16"."""
    device: str
    """Device the tensor lives on."""
    module: str
    """Qualified name of the innermost running module ("" outside modules)."""
    decision: str
    """"offloaded" or "kept"."""
    reason: str
    """"" when offloaded, else one of ``offload.REASONS``."""
    storage_key: int = 0
    """Data pointer of the tensor's storage (identifies aliasing saves)."""
    storage_nbytes: int = 0
    """Bytes of the tensor's whole storage."""
    copy_bytes: int = 0
    """Bytes actually moved to the host (0 if kept)."""
    pinned: bool = False
    """The host copy is page-locked."""
    note: str = ""
    """Extra detail: "pageable_overflow", "pin_failed", "reused_source"..."""
    d2h_s: float | None = None
    """Device-to-host copy time in seconds, once known."""
    h2d_s: float | None = None
    """Last host-to-device copy time in seconds, once known."""
    tier: str = ""
    """Where the host copy lives: one of ``TIERS`` ("pool", "pageable", "disk"); "" if kept
    (a ``duplicate_storage`` save names the tier of the copy it shares)."""


@dataclass(eq=False)
class StepTotals:
    """Totals of one step (from its first pack to the end of its backward)."""

    step: int
    packed_count: int = 0
    packed_bytes: int = 0
    offloaded_count: int = 0
    offloaded_bytes: int = 0
    kept_count: int = 0
    kept_bytes: int = 0
    kept_by_reason: dict[str, int] = field(default_factory=dict)
    kept_count_by_reason: dict[str, int] = field(default_factory=dict)
    unique_bytes: int = 0
    d2h_bytes: int = 0
    d2h_seconds: float = 0.0
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0
    stall_seconds: float = 0.0
    peak_inflight_bytes: int = 0
    pool: dict[str, Any] = field(default_factory=dict)
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per host tier used in the step (``TIERS``): bytes, count, seconds, wait_seconds (see
    ``_tier_row``); ``Ledger.summary()["tiers"]`` always names all three."""
    host_rss_bytes: int | None = None
    device_peak_allocated_bytes: int | None = None

    def add(self, rec: PackRecord, unique_bytes: int | bool) -> None:
        """Count one decision, which adds ``unique_bytes`` to the step's distinct saved bytes.

        (The ledger itself logs decisions and sums them at the end of a step: NOTE [ Ledger logs ].)
        """
        nbytes = rec.nbytes
        self.packed_count += 1
        self.packed_bytes += nbytes
        if rec.decision == OFFLOADED:
            self.offloaded_count += 1
            self.offloaded_bytes += nbytes
            self.d2h_bytes += rec.copy_bytes
            if rec.copy_bytes and rec.tier:
                tier = _tier(self, rec.tier)
                tier["bytes"] += rec.copy_bytes
                tier["count"] += 1
        else:
            reason = rec.reason
            self.kept_count += 1
            self.kept_bytes += nbytes
            by_bytes, by_count = self.kept_by_reason, self.kept_count_by_reason
            by_bytes[reason] = by_bytes.get(reason, 0) + nbytes
            by_count[reason] = by_count.get(reason, 0) + 1
        if unique_bytes is True:  # the older bool form: its whole storage
            unique_bytes = rec.storage_nbytes
        self.unique_bytes += unique_bytes

    def __str__(self) -> str:
        """One readable line: ``step 3: packed ... = offloaded ... + kept ... (by reason); copies; pool``."""
        return f"step {self.step}: {one_line(asdict(self))}"

    def merge(self, other: "StepTotals") -> None:
        """Add ``other``'s counters into this one (the peak is a max, snapshots are not merged)."""
        for name in _ADDITIVE:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.peak_inflight_bytes = max(self.peak_inflight_bytes, other.peak_inflight_bytes)
        for name, theirs in other.tiers.items():
            mine = _tier(self, name)
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        for src, dst in ((other.kept_by_reason, self.kept_by_reason),
                         (other.kept_count_by_reason, self.kept_count_by_reason)):
            for k, v in src.items():
                dst[k] = dst.get(k, 0) + v


_ADDITIVE = tuple(
    f.name for f in fields(StepTotals) if f.type in ("int", "float") and f.name != "step"
    and f.name != "peak_inflight_bytes"
)
"""StepTotals counters that add up across steps."""

def _count_bytes(nbytes: int, count: int) -> str:
    return f"{format_bytes(nbytes)} ({count:,})"


def one_line(t: Mapping[str, Any]) -> str:
    """A step's or a summary's figures as one line (the keys of ``StepTotals`` / ``Ledger.summary()``)."""
    reasons = sorted(t.get("kept_by_reason", {}).items(), key=lambda kv: -kv[1])
    by_reason = ", ".join(f"{r} {format_bytes(b)}" for r, b in reasons if b)
    parts = [f"packed {format_bytes(t['packed_bytes'])} ({t['packed_count']:,} tensors)"
             f" = offloaded {_count_bytes(t['offloaded_bytes'], t['offloaded_count'])}"
             f" + kept {format_bytes(t['kept_bytes'])} ({t['kept_count']:,}{': ' + by_reason if by_reason else ''})"]
    if t.get("d2h_bytes") or t.get("h2d_bytes"):
        parts.append(f"D2H {format_bytes(t['d2h_bytes'])} {t['d2h_seconds'] * 1e3:.1f} ms, "
                     f"H2D {format_bytes(t['h2d_bytes'])} {t['h2d_seconds'] * 1e3:.1f} ms, "
                     f"exposed {t['stall_seconds'] * 1e3:.1f} ms")
    pool = t.get("pool") or {}
    if "reserved_bytes" in pool:
        parts.append(f"pool {format_bytes(pool['reserved_bytes'])} reserved")
    tiers = t.get("tiers")
    used = {k: v for k, v in tiers.items() if _tier_bytes(v) != format_bytes(0)} if isinstance(tiers, Mapping) else {}
    if used:
        parts.append("tiers " + ", ".join(f"{k} {_tier_bytes(v)}" for k, v in used.items()))
    return "; ".join(parts)


def _tier_bytes(v: Any) -> str:
    """A tier's bytes: a number, or the ``bytes`` / ``*_bytes`` entry of a mapping."""
    if isinstance(v, Mapping):
        v = v.get("bytes", next((x for k, x in v.items() if k.endswith("bytes")), None))
    return format_bytes(v) if isinstance(v, (int, float)) else str(v)


class LedgerSummary(dict):
    """``Ledger.summary()``: a plain dict (JSON-ready) that prints as one readable line."""

    def __str__(self) -> str:
        return f"{self.get('steps', 0)} steps: {one_line(self)}"


class _Known:
    """A finished copy whose duration is known (what ``add_sync_copy`` queues behind pending ones)."""

    __slots__ = ("seconds",)
    done = None
    start = None

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def elapsed(self) -> float:
        return self.seconds

    def query(self) -> bool:
        return True


_SECONDS_ATTR = {"d2h": "d2h_seconds", "h2d": "h2d_seconds", "stall": "stall_seconds"}
"""Copy kind -> the StepTotals field its duration adds to."""


def record_from_log(r: tuple) -> PackRecord:
    """The ``PackRecord`` of a kept decision logged as a tuple (NOTE [ Ledger logs ]): its shape
    as a tuple (a logged ``torch.Size`` too), its dtype (a ``torch.dtype``) by name."""
    dtype = r[4]
    return PackRecord(r[0], r[1], r[2], tuple(r[3]), dtype if type(dtype) is str else dtype_name(dtype), *r[5:])


class Ledger:
    """Per-decision records and per-step totals, both in bounded rings; the
    running totals (``totals()``, ``summary()``) still cover every step.

    The recording methods run inside the pack hook, once per saved tensor, on
    the thread that launches kernels: they do O(1) work and no system call.
    """

    def __init__(self, max_records: int = 10_000, pool_stats: Callable[[], dict] | None = None,
                 max_steps: int = 1000) -> None:
        self.max_records = max_records
        """How many recent records ``records`` keeps; totals count every record."""
        self.max_steps = max_steps
        """How many recent closed steps ``step_totals`` keeps (each holds a pool snapshot,
        ~1 KB); ``totals()`` and ``summary()`` count every step."""
        self._pool_stats = pool_stats
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget every record and total (the engine's pool is not touched)."""
        with self._lock:
            # PackRecord objects, or tuples of a kept record's first 11 fields (NOTE [ Ledger logs ]).
            self._records: deque[PackRecord | tuple] = deque(maxlen=self.max_records)
            self._built: dict[int, tuple[tuple, PackRecord]] = {}
            self.step_totals: deque[StepTotals] = deque(maxlen=self.max_steps)
            """The last ``max_steps`` closed steps, oldest first (``step_totals[-1]`` is the latest)."""
            self.steps_closed = 0
            """Steps closed since the last reset (``summary()["steps"]``), retained or not."""
            self._closed = StepTotals(step=-1)
            self._open = StepTotals(step=0)
            self.current_step = 0
            """Index of the open step (the step a pack now belongs to)."""
            self._open_used = False
            # Copies whose duration is not known yet, in issue order.
            self._pending: deque[tuple[PackRecord | None, str, Any, StepTotals]] = deque()
            # The open step's logs (NOTE [ Ledger logs ]): appended by the pack hook.
            self.kept_log: dict[str, list[int]] = {r: [] for r in REASONS}
            """Reason -> logical bytes of each decision kept for it in the open step."""
            self.offloaded_log: list[int] = []
            """Logical bytes of each decision offloaded in the open step."""
            self.d2h_log: list[int] = []
            """Bytes copied to the host by each offloaded decision of the open step."""
            self.unique_log: list[int] = []
            """Bytes each save of the open step added to its distinct saved bytes (non-zero only)."""
            # Synchronous copies of the open step (add_sync_copy): seconds and bytes of each.
            self.sync_d2h_s: list[float] = []
            self.sync_d2h_b: list[int] = []
            self.sync_h2d_s: list[float] = []
            self.sync_h2d_b: list[int] = []
            self.tier_log: dict[str, list[int]] = {t: [] for t in TIERS}
            """Tier -> bytes of each copy made into it in the open step (``log_tier``)."""
            self.tier_time_log: dict[str, list[tuple[float, float]]] = {t: [] for t in TIERS}
            """Tier -> (seconds, exposed wait seconds) of each move into or out of it (``add_tier_time``)."""
            self.records_log = self._records
            """The records ring, for the pack hook's appends (``records`` is the read side)."""

    @property
    def records(self) -> deque[PackRecord]:
        """The last ``max_records`` decisions, oldest first (a snapshot: read it again for newer ones).

        Kept decisions are logged as tuples and built into ``PackRecord`` objects
        here, once each (NOTE [ Ledger logs ]).
        """
        snap = list(self._records)  # one atomic copy: packs may append meanwhile
        built = self._built
        out: deque[PackRecord] = deque(maxlen=self.max_records)
        fresh: dict[int, tuple[tuple, PackRecord]] = {}
        for r in snap:
            if type(r) is tuple:
                hit = built.get(id(r))
                if hit is not None and hit[0] is r:
                    rec = hit[1]
                else:
                    rec = record_from_log(r)
                fresh[id(r)] = (r, rec)
                r = rec
            out.append(r)
        self._built = fresh  # only what the ring still holds
        return out

    # -- recording (called by the engine) ------------------------------------

    def add(self, rec: PackRecord, unique_bytes: int | bool = 0, new_storage: bool | None = None) -> None:
        """Record one decision, which adds ``unique_bytes`` to the step's distinct saved bytes
        (the bytes its span adds to the union of saved spans: ``offload._spans``). ``True``
        (or the older ``new_storage=True``) counts its whole storage."""
        if new_storage is not None:
            unique_bytes = bool(new_storage)
        if unique_bytes is True:
            unique_bytes = rec.storage_nbytes
        if rec.decision == OFFLOADED:
            self.offloaded_log.append(rec.nbytes)
            self.d2h_log.append(rec.copy_bytes)
            if rec.copy_bytes and rec.tier:
                self.log_tier(rec.tier, rec.copy_bytes)
        else:
            self.log_kept(rec.reason, rec.nbytes)
        if unique_bytes:
            self.unique_log.append(unique_bytes)
        self._open_used = True
        self._records.append(rec)

    def log_kept(self, reason: str, nbytes: int) -> None:
        """Count one kept decision of ``nbytes`` for ``reason`` in the open step (no record)."""
        log = self.kept_log.get(reason)
        if log is None:
            log = self.kept_log.setdefault(reason, [])  # atomic: one list per reason
        log.append(nbytes)

    def log_tier(self, tier: str, nbytes: int) -> None:
        """Count one copy of ``nbytes`` into host tier ``tier`` in the open step (lock-free append)."""
        self.tier_log[tier].append(nbytes)

    def add_tier_time(self, tier: str, seconds: float, wait_seconds: float = 0.0) -> None:
        """Time spent moving bytes into or out of ``tier`` (``wait_seconds`` of it exposed to
        compute); any thread (the disk tier's writers and readers call it)."""
        self.tier_time_log[tier].append((seconds, wait_seconds))
        self._open_used = True

    def _sum_logs(self, into: StepTotals, consume: bool) -> None:
        """Add the open step's logs into ``into``; ``consume`` removes what was added (lock held)."""

        def items(log: list) -> list:
            n = len(log)
            if not n:
                return []
            got = log[:n]
            if consume:
                del log[:n]  # appends racing this land after index n: kept for the next step
            return got

        def take(log: list[int]) -> tuple[int, int]:
            got = items(log)
            return len(got), sum(got)

        for reason, log in self.kept_log.items():
            n, b = take(log)
            if n:
                into.kept_count += n
                into.kept_bytes += b
                into.packed_count += n
                into.packed_bytes += b
                into.kept_by_reason[reason] = into.kept_by_reason.get(reason, 0) + b
                into.kept_count_by_reason[reason] = into.kept_count_by_reason.get(reason, 0) + n
        n, b = take(self.offloaded_log)
        into.offloaded_count += n
        into.offloaded_bytes += b
        into.packed_count += n
        into.packed_bytes += b
        into.d2h_bytes += take(self.d2h_log)[1]
        for name, log in self.tier_log.items():
            n, b = take(log)
            if n:
                tier = _tier(into, name)
                tier["bytes"] += b
                tier["count"] += n
        for name, log in self.tier_time_log.items():
            got = items(log)
            if got:
                tier = _tier(into, name)
                tier["seconds"] += sum(g[0] for g in got)
                tier["wait_seconds"] += sum(g[1] for g in got)
        into.unique_bytes += take(self.unique_log)[1]
        # Take each pair's seconds first: a copy racing this is then counted whole next step
        # (its bytes may land here, its seconds next time: totals over steps stay exact).
        d2h_s, d2h_b = sum(items(self.sync_d2h_s)), items(self.sync_d2h_b)
        h2d_s, h2d_b = sum(items(self.sync_h2d_s)), sum(items(self.sync_h2d_b))
        into.d2h_seconds += d2h_s
        into.h2d_seconds += h2d_s
        into.stall_seconds += d2h_s + h2d_s
        into.h2d_bytes += h2d_b
        if d2h_b:
            into.peak_inflight_bytes = max(into.peak_inflight_bytes, max(d2h_b))

    def add_copy_time(self, rec: PackRecord | None, kind: str, copy: Any, nbytes: int = 0) -> None:
        """Account a copy's duration now if known, or when its event completes.

        Amortized O(1): pending copies are resolved in issue order and the
        scan stops at the first one still running (copies on one stream finish
        in order; a later one finished early just waits its turn), so a deep
        queue of in-flight copies is not re-polled on every new copy.
        """
        with self._lock:
            if kind == "h2d":
                self._open.h2d_bytes += nbytes
                self._open_used = True
            secs = copy.seconds
            if secs is not None and copy.done is None and not self._pending:
                self._add_seconds(rec, kind, secs, self._open)  # synchronous: known now
                return
            self._pending.append((rec, kind, copy, self._open))
            if copy.done is None or len(self._pending) > 64:
                self._resolve_locked(block=False)

    def add_sync_copy(self, rec: PackRecord | None, kind: str, seconds: float, nbytes: int) -> None:
        """A synchronous copy of ``nbytes`` that took ``seconds`` (all of it a stall), in one call.

        The same as ``add_copy_time`` (its duration known now) + ``add_stall``,
        + ``note_inflight(nbytes)`` for a D2H copy. Logged without a lock (NOTE
        [ Ledger logs ]) unless copies of unknown duration are pending, whose
        issue order it then keeps.
        """
        if rec is not None and rec.tier:
            self.tier_time_log[rec.tier].append((seconds, seconds))  # a synchronous copy: all exposed
        if not self._pending:
            if kind == "d2h":
                self.sync_d2h_s.append(seconds)
                self.sync_d2h_b.append(nbytes)
                if rec is not None:
                    rec.d2h_s = seconds
            else:
                self.sync_h2d_s.append(seconds)
                self.sync_h2d_b.append(nbytes)
                self._open_used = True
                if rec is not None:
                    rec.h2d_s = seconds
            return
        with self._lock:
            o = self._open
            if kind == "h2d":
                o.h2d_bytes += nbytes
                self._open_used = True
            if self._pending:  # keep issue order behind copies whose time is not known yet
                self._pending.append((rec, kind, _Known(seconds), o))
                self._resolve_locked(block=False)
            elif kind == "d2h":
                o.d2h_seconds += seconds
                if rec is not None:
                    rec.d2h_s = seconds
            else:
                o.h2d_seconds += seconds
                if rec is not None:
                    rec.h2d_s = seconds
            o.stall_seconds += seconds
            if kind == "d2h" and nbytes > o.peak_inflight_bytes:
                o.peak_inflight_bytes = nbytes

    def add_stall(self, seconds: float) -> None:
        with self._lock:
            self._open.stall_seconds += seconds

    def note_inflight(self, nbytes: int) -> None:
        with self._lock:
            if nbytes > self._open.peak_inflight_bytes:
                self._open.peak_inflight_bytes = nbytes

    def _add_seconds(self, rec: PackRecord | None, kind: str, secs: float, owner: StepTotals,
                     tier: bool = True) -> None:
        attr = _SECONDS_ATTR.get(kind, "h2d_seconds")
        setattr(owner, attr, getattr(owner, attr) + secs)
        if owner is not self._open:
            setattr(self._closed, attr, getattr(self._closed, attr) + secs)
        if tier and rec is not None and rec.tier and kind in ("d2h", "h2d"):
            for o in (owner,) if owner is self._open else (owner, self._closed):
                _tier(o, rec.tier)["seconds"] += secs
        if rec is not None:
            if kind == "d2h":
                rec.d2h_s = secs
            elif kind == "h2d":
                rec.h2d_s = secs

    def _resolve_locked(self, block: bool) -> None:
        # Device copies finish after the host moved on; their times are added
        # to the step they belong to whenever they resolve, so closing a step
        # never forces a host synchronize.
        pending = self._pending
        while pending:
            rec, kind, copy, owner = pending[0]
            if block and copy.done is not None:
                copy.done.synchronize()
            secs = copy.elapsed()
            if secs is None:
                if not (copy.query() and copy.start is None):
                    return  # still running: so are (or will be seen as) the ones after it
                # finished, but timing was off: nothing to add
            else:  # a synchronous copy's tier time was logged by add_sync_copy
                self._add_seconds(rec, kind, secs, owner, tier=type(copy) is not _Known)
            pending.popleft()

    def close_step(self, *, pool: dict | None = None, host_rss_bytes: int | None = None,
                   device_peak_allocated_bytes: int | None = None) -> StepTotals | None:
        """Close the open step (if anything happened in it) and start the next."""
        with self._lock:
            self._resolve_locked(block=False)
            if not self._open_used:
                return None
            done = self._open
            self._sum_logs(done, consume=True)
            done.pool = dict(pool or {})
            done.host_rss_bytes = host_rss_bytes
            done.device_peak_allocated_bytes = device_peak_allocated_bytes
            self.step_totals.append(done)
            self.steps_closed += 1
            self._closed.merge(done)
            self._open = StepTotals(step=done.step + 1)
            self.current_step = done.step + 1
            self._open_used = False
            return done

    # -- reading -------------------------------------------------------------

    def totals(self, synchronize: bool = False) -> StepTotals:
        """Totals over every closed step plus the open one.

        Copy times of device copies still in flight are not included unless
        ``synchronize`` waits for them.
        """
        with self._lock:
            self._resolve_locked(block=synchronize)
            t = StepTotals(step=-1)
            t.merge(self._closed)
            t.merge(self._open)
            self._sum_logs(t, consume=False)
            return t

    def summary(self, pool: dict | None = None, synchronize: bool = False) -> dict[str, Any]:
        """Totals since the last reset, as a plain dict (JSON-ready).

        ``synchronize=True`` first waits for in-flight device copies so their
        times are included (a host sync: call it when reporting, not per step).
        """
        t = self.totals(synchronize)
        out = asdict(t)
        del out["step"], out["host_rss_bytes"], out["device_peak_allocated_bytes"]
        out["tiers"] = {name: {**_tier_row(), **t.tiers.get(name, {})} for name in TIERS}
        out["steps"] = self.steps_closed
        if pool is None and self._pool_stats is not None:
            pool = self._pool_stats()
        out["pool"] = dict(pool or {})
        return LedgerSummary(out)

    def report(self, fmt: str = "simple") -> str:
        """Small tables of the totals: bytes and counts by decision and kept reason (and by tier when the
        summary has a ``tiers`` mapping); ``fmt="github"`` for markdown."""
        s = self.summary()
        packed = s["packed_bytes"] or 1

        def row(name: str, nbytes: int, count: int) -> list[Any]:
            return [name, format_bytes(nbytes), f"{count:,}", f"{100 * nbytes / packed:.1f}%"]

        rows = [row("offloaded", s["offloaded_bytes"], s["offloaded_count"])]
        counts = s["kept_count_by_reason"]
        rows += [row(f"kept: {r}", b, counts.get(r, 0))
                 for r, b in sorted(s["kept_by_reason"].items(), key=lambda kv: -kv[1])]
        rows.append(row("packed (total)", s["packed_bytes"], s["packed_count"]))
        out = render_table(rows, ["decision", "bytes", "tensors", "of packed"], fmt=fmt,
                           title=f"offload ledger, {s['steps']} steps")
        tiers = s.get("tiers")
        if isinstance(tiers, Mapping) and tiers:
            cols = sorted({k for v in tiers.values() if isinstance(v, Mapping) for k in v})
            def cell(c: str, x: Any) -> Any:
                if isinstance(x, (int, float)) and c.endswith("bytes"):
                    return format_bytes(x)
                if isinstance(x, float):
                    return f"{x * 1e3:.1f} ms" if c.endswith("seconds") else f"{x:.4g}"
                return x

            tier_rows = [[name] + ([cell(c, v.get(c)) for c in cols] if isinstance(v, Mapping) else [_tier_bytes(v)])
                         for name, v in tiers.items()]
            out += "\n" + render_table(tier_rows, ["tier", *(cols or ["bytes"])], fmt=fmt, title="by host tier")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "steps": [asdict(s) for s in self.step_totals],
            "records": [asdict(r) for r in self.records],
        }

    def to_json(self, path: str | None = None, *, indent: int | None = 1) -> str:
        """The summary, per-step totals and retained records as JSON; written to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text
