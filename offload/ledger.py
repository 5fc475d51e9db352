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
reason ``duplicate_storage`` and move nothing. A view spread over more than
twice its bytes (v alone of a fused projection) moves only its own bytes
(Rule 5 in ``offload/engine.py``).

NOTE [ Ledger logs ]
The pack hook runs once per saved tensor on the thread that launches kernels,
so recording a decision must cost next to nothing and take no lock. A decision
is therefore appended, not summed: its logical bytes go to one list per kept
reason (or to the offloaded list, and its copy's bytes to its host tier's list,
which is all the step's D2H bytes are summed from), the bytes it adds to the
step's distinct saved bytes to another, and its record to the records ring, as the tuple of
``PackRecord``'s first eleven fields when nothing will change it later (a kept
decision, its shape logged as a tuple and its dtype as the tensor's
``torch.dtype``; ``record_from_log`` builds the ``PackRecord``, dtype named, when
``records`` is read). Such a tuple holds no object the cycle collector follows (its
``torch.Size`` would be one: a Size stays tracked, and with it the record; on the bench's
chain collections went from 0.5 to 2.9 us a pack), so the collector untracks it at its
first pass (the C++ hook, ``native_hooks=True``,
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
from dataclasses import asdict
from typing import Any, Callable

from ._totals import KEPT, one_line  # importable from offload.ledger, as before the split (__all__)
from ._totals import (OFFLOADED, TIERS, TILING_KINDS, LedgerSummary, PackRecord, StepTotals, add_tiling,
                      empty_tier_row, empty_tiling_row, report_tables, tier_of)
from .policy import REASONS, dtype_name

__all__ = ["PackRecord", "StepTotals", "Ledger", "TIERS", "KEPT", "one_line"]


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
            """Bytes copied to the host by each offloaded decision of the open step that names no host
            tier (a record added by hand); a copy into a tier is counted in ``tier_log`` only, and
            ``d2h_bytes`` is the sum of both."""
            self.unique_log: list[int] = []
            """Bytes each save of the open step added to its distinct saved bytes (non-zero only)."""
            # Synchronous copies of the open step (add_sync_copy): seconds per host tier ("" for a
            # copy without one) and bytes of each. A synchronous copy's seconds are its tier's time
            # too, all of it exposed: one append serves both totals.
            self.sync_d2h_s: dict[str, list[float]] = {t: [] for t in (*TIERS, "")}
            self.sync_d2h_b: list[int] = []
            self.sync_h2d_s: dict[str, list[float]] = {t: [] for t in (*TIERS, "")}
            self.sync_h2d_b: list[int] = []
            self.tier_log: dict[str, list[int]] = {t: [] for t in TIERS}
            """Tier -> bytes of each copy made into it in the open step (``log_tier``)."""
            self.tier_time_log: dict[str, list[tuple[float, float]]] = {t: [] for t in TIERS}
            """Tier -> (seconds, exposed wait seconds) of each move into or out of it (``add_tier_time``)."""
            self.tiling_log: list[tuple[str, int, int]] = []
            """(kind, bytes not saved, tiles) of each tiled call backpropagated in the open step (``log_tiling``)."""
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
            if rec.tier:
                self.log_tier(rec.tier, rec.copy_bytes)
            elif rec.copy_bytes:
                self.d2h_log.append(rec.copy_bytes)
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

    def open_totals(self) -> StepTotals:
        """The open step's totals: a token for work that may finish after the step closes (a disk
        write or read on another thread), handed back to ``add_tier_time(owner=...)``."""
        return self._open

    def add_tier_time(self, tier: str, seconds: float, wait_seconds: float = 0.0,
                      owner: StepTotals | None = None) -> None:
        """Time spent moving bytes into or out of ``tier`` (``wait_seconds`` of it exposed to
        compute); any thread (the disk tier's writers and readers call it). ``owner``
        (``open_totals()`` when the move was asked for) is the step it belongs to: a move that
        finishes after that step closed is added to it, and opens no step of its own (None: the
        open step)."""
        with self._lock:  # (a disk move takes milliseconds: the lock costs nothing beside it)
            if owner is None or owner is self._open:
                self.tier_time_log[tier].append((seconds, wait_seconds))
                self._open_used = True
                return
            for o in (owner, self._closed):  # as _add_seconds does for a copy that resolves late
                row = tier_of(o, tier)
                row["seconds"] += seconds
                row["wait_seconds"] += wait_seconds

    def log_tiling(self, kind: str, bytes_not_saved: int, tiles: int) -> None:
        """Count one tiled call of ``kind`` (``TILING_KINDS``) in the open step: ``tiles`` tiles, and
        ``bytes_not_saved`` bytes its untiled twin would have saved for backward (``offload.tiling``)."""
        self.tiling_log.append((kind, int(bytes_not_saved), int(tiles)))
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
            if not log:  # (most reasons' lists, every step: no call; an append racing this lands next step)
                continue
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
            if not log:
                continue
            n, b = take(log)
            if n:
                into.d2h_bytes += b  # every copy into a tier is a D2H copy (d2h_log: the others)
                tier = tier_of(into, name)
                tier["bytes"] += b
                tier["count"] += n
        for name, log in self.tier_time_log.items():
            got = items(log) if log else None
            if got:
                tier = tier_of(into, name)
                seconds, waits = zip(*got)  # same order and sums as a loop, without one
                tier["seconds"] += sum(seconds)
                tier["wait_seconds"] += sum(waits)
        into.unique_bytes += take(self.unique_log)[1]
        for kind, nbytes, tiles in items(self.tiling_log) if self.tiling_log else ():
            add_tiling(into, kind, {"calls": 1, "tiles": tiles, "bytes_not_saved": nbytes})
        self._sum_sync_logs(into, items)

    def _sum_sync_logs(self, into: StepTotals, items: Callable[[list], list]) -> None:
        """``_sum_logs`` for the synchronous copies: their seconds (each tier's time too, all of it
        exposed) and bytes; ``items`` takes a log's entries (lock held)."""
        # Take each pair's seconds first: a copy racing this is then counted whole next step
        # (its bytes may land here, its seconds next time: totals over steps stay exact).
        d2h_s = h2d_s = 0.0
        for name, log in self.sync_d2h_s.items():
            h2d_log = self.sync_h2d_s[name]
            if not log and not h2d_log:
                continue
            got_d2h, got_h2d = items(log), items(h2d_log)
            if got_d2h or got_h2d:
                s_d2h, s_h2d = sum(got_d2h), sum(got_h2d)
                d2h_s += s_d2h
                h2d_s += s_h2d
                if name:
                    tier = tier_of(into, name)
                    tier["seconds"] += s_d2h + s_h2d
                    tier["wait_seconds"] += s_d2h + s_h2d
        d2h_b, h2d_b = items(self.sync_d2h_b), sum(items(self.sync_h2d_b))
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
        tier = rec.tier if rec is not None else ""
        if not self._pending:
            if kind == "d2h":
                self.sync_d2h_s[tier].append(seconds)  # its tier's time too (_sum_logs)
                self.sync_d2h_b.append(nbytes)
                if rec is not None:
                    rec.d2h_s = seconds
            else:
                self.sync_h2d_s[tier].append(seconds)
                self.sync_h2d_b.append(nbytes)
                self._open_used = True
                if rec is not None:
                    rec.h2d_s = seconds
            return
        if tier:
            self.tier_time_log[tier].append((seconds, seconds))  # a synchronous copy: all exposed
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

    def note_d2h_wait(self) -> None:
        """Compute waited on a device-to-host copy for a bound (NOTE [ Copy schedule ] item 2)."""
        with self._lock:
            self._open.d2h_waits += 1

    def _add_seconds(self, rec: PackRecord | None, kind: str, secs: float, owner: StepTotals,
                     tier: bool = True) -> None:
        attr = _SECONDS_ATTR.get(kind, "h2d_seconds")
        setattr(owner, attr, getattr(owner, attr) + secs)
        if owner is not self._open:
            setattr(self._closed, attr, getattr(self._closed, attr) + secs)
        if tier and rec is not None and rec.tier and kind in ("d2h", "h2d"):
            for o in (owner,) if owner is self._open else (owner, self._closed):
                tier_of(o, rec.tier)["seconds"] += secs
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
        out["tiers"] = {name: {**empty_tier_row(), **t.tiers.get(name, {})} for name in TIERS}
        out["tiling"] = {kind: {**empty_tiling_row(), **t.tiling.get(kind, {})}
                         for kind in (*TILING_KINDS, *t.tiling)}
        out["steps"] = self.steps_closed
        if pool is None and self._pool_stats is not None:
            pool = self._pool_stats()
        out["pool"] = dict(pool or {})
        return LedgerSummary(out)

    def report(self, fmt: str = "simple") -> str:
        """Small tables of the totals: bytes and counts by decision and kept reason (and by tier when the
        summary has a ``tiers`` mapping); ``fmt="github"`` for markdown."""
        return report_tables(self.summary(), fmt)

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
