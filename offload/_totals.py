"""The ledger's figures: one ``PackRecord`` per pack decision, ``StepTotals`` per step (and for
several steps merged), and how they print (one line; tables). ``offload.ledger`` records them
(NOTE [ Ledger logs ]) and re-exports every name here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ._format import format_bytes, render_table

__all__ = ["OFFLOADED", "KEPT", "TIERS", "TILING_KINDS", "PackRecord", "StepTotals", "LedgerSummary", "one_line",
           "report_tables", "empty_tier_row", "tier_of", "empty_tiling_row", "add_tiling"]

OFFLOADED = "offloaded"
KEPT = "kept"
TIERS = ("pool", "pageable", "disk")
"""The host tiers, in the order a copy tries them (NOTE [ Host tiers ] in offload.tiers)."""


def empty_tier_row() -> dict[str, float]:
    """One tier's figures: ``bytes`` and ``count`` of the copies made into it, ``seconds`` spent
    moving bytes into and out of it (copies; the disk tier's file writes and reads, on its
    threads), ``wait_seconds`` the compute thread waited for them (exposed)."""
    return {"bytes": 0, "count": 0, "seconds": 0.0, "wait_seconds": 0.0}


TILING_KINDS = ("mlp", "loss")
"""What ``offload.tiling`` computes in tiles along the sequence (``Ledger.summary()["tiling"]`` names both)."""


def empty_tiling_row() -> dict[str, int]:
    """One tiled kind's figures: ``calls`` (tiled forwards backpropagated), ``tiles`` (over those calls),
    ``bytes_not_saved``: the bytes the untiled computation would have saved for backward and the tiled one
    never held (NOTE [ Tiles ] in offload/tiling.py says how each kind counts them)."""
    return {"calls": 0, "tiles": 0, "bytes_not_saved": 0}


def add_tiling(totals: "StepTotals", kind: str, row: Mapping[str, int]) -> None:
    """Add ``row``'s figures to ``totals``' row for tiled ``kind`` (added, zero, if the step has none yet)."""
    mine = totals.tiling.get(kind)
    if mine is None:
        mine = totals.tiling[kind] = empty_tiling_row()
    for k, v in row.items():
        mine[k] = mine.get(k, 0) + v


def tier_of(totals: "StepTotals", name: str) -> dict[str, float]:
    """``totals``' row for host tier ``name``, added (zero) if the step has none yet."""
    row = totals.tiers.get(name)
    if row is None:
        row = totals.tiers[name] = empty_tier_row()
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
    """Extra detail: "pageable_overflow", "pin_failed", "reused_source", "reused_original" (unpacked as a view of
    its original, which something else kept alive: no reload)..."""
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
    d2h_waits: int = 0
    """Times compute waited on a device-to-host copy because a bound required it (``device_budget_bytes``,
    or a cap: NOTE [ Copy schedule ] item 2); each wait's time is in ``stall_seconds``."""
    pool: dict[str, Any] = field(default_factory=dict)
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per host tier used in the step (``TIERS``): bytes, count, seconds, wait_seconds (see
    ``empty_tier_row``); ``Ledger.summary()["tiers"]`` always names all three."""
    tiling: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per kind computed in tiles in the step (``TILING_KINDS``): calls, tiles, bytes_not_saved (see
    ``empty_tiling_row``); ``Ledger.summary()["tiling"]`` always names both kinds."""
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
                tier = tier_of(self, rec.tier)
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
            mine = tier_of(self, name)
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        for kind, row in other.tiling.items():
            add_tiling(self, kind, row)
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
    used = {k: v for k, v in tiers.items() if tier_bytes_text(v) != format_bytes(0)} if isinstance(tiers, Mapping) else {}
    if used:
        parts.append("tiers " + ", ".join(f"{k} {tier_bytes_text(v)}" for k, v in used.items()))
    tiling = t.get("tiling")
    tiled = {k: v for k, v in tiling.items() if v.get("calls")} if isinstance(tiling, Mapping) else {}
    if tiled:
        parts.append("not saved thanks to tiling " + ", ".join(
            f"{k} {format_bytes(v['bytes_not_saved'])} ({v['tiles']:,} tiles)" for k, v in tiled.items()))
    return "; ".join(parts)


def tier_bytes_text(v: Any) -> str:
    """A tier's bytes: a number, or the ``bytes`` / ``*_bytes`` entry of a mapping."""
    if isinstance(v, Mapping):
        v = v.get("bytes", next((x for k, x in v.items() if k.endswith("bytes")), None))
    return format_bytes(v) if isinstance(v, (int, float)) else str(v)


class LedgerSummary(dict):
    """``Ledger.summary()``: a plain dict (JSON-ready) that prints as one readable line."""

    def __str__(self) -> str:
        return f"{self.get('steps', 0)} steps: {one_line(self)}"


def report_tables(s: Mapping[str, Any], fmt: str = "simple") -> str:
    """``Ledger.report``: tables of a summary ``s`` by decision and kept reason, and by tier when it has
    a ``tiers`` mapping; ``fmt="github"`` for markdown."""
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

        tier_rows = [[name] + ([cell(c, v.get(c)) for c in cols] if isinstance(v, Mapping) else [tier_bytes_text(v)])
                     for name, v in tiers.items()]
        out += "\n" + render_table(tier_rows, ["tier", *(cols or ["bytes"])], fmt=fmt, title="by host tier")
    return out
