"""The host side of a plan: what the host tiers can hold, and where each block's copies land.

A plan's engine holds every offloaded block's copies from its forward to its
backward, so at the end of forward the host holds the sum of the offloading
blocks' ``copy_bytes``. The tiers (NOTE [ Host tiers ] in ``offload.tiers``)
fill in pack order: the pool (``host_budget_bytes``), then the pageable tier
(``pageable_budget_bytes``), then the disk tier (``disk_budget_bytes``, or the
free space under ``disk_dir``). What fits no tier stays on the device
(``on_host_budget="keep"``), which the cost model does not predict, so a plan
must not offload more than the tiers hold: :func:`fit_host` turns offloading
blocks back (to the non-offloading option that keeps the peak under the cap
at the least added time per byte freed) until it does, and
:func:`tier_bytes` says which tier each block's bytes land in.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from ..errors import OffloadError
from .cost import OFFLOADING, CostModel

__all__ = ["TIER_SETTINGS", "host_capacity", "host_bytes", "fit_host", "tier_bytes"]

TIER_SETTINGS = ("host_budget_bytes", "pageable_budget_bytes", "disk_dir", "disk_budget_bytes", "on_host_budget")
"""Engine settings that bound the host side (profiling runs without them; the applied plan uses them)."""


def _caps(ekw: dict[str, Any]) -> list[tuple[str, int | None]]:
    """(tier, bytes it may hold; None = unbounded) in fill order."""
    pageable = ekw.get("pageable_budget_bytes", 0)
    if ekw.get("on_host_budget") == "pageable" and pageable == 0:
        pageable = None
    caps: list[tuple[str, int | None]] = [("pool", ekw.get("host_budget_bytes"))]
    if pageable != 0:
        caps.append(("pageable", pageable))
    if ekw.get("disk_dir"):
        disk = ekw.get("disk_budget_bytes")
        if disk is None:
            try:
                du = shutil.disk_usage(_existing(ekw["disk_dir"]))
                disk = max(0, du.free - min(1 << 30, du.total // 20))
            except OSError:
                disk = 0
        caps.append(("disk", disk))
    return caps


def _existing(path: str) -> str:
    """``path``, or its nearest existing ancestor: the engine creates a missing ``disk_dir``, whose
    files then take the free space of the file system it will be on (issue 31)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def host_capacity(ekw: dict[str, Any]) -> int | None:
    """Bytes all host tiers together may hold (None = unbounded)."""
    total = 0
    for _, cap in _caps(ekw):
        if cap is None:
            return None
        total += cap
    return total


def host_bytes(cost: CostModel, decisions: dict[str, str]) -> int:
    """Bytes the plan's copies hold on the host at the end of forward."""
    return sum(b.options[decisions[b.name]].host_bytes for b in cost.blocks if decisions[b.name] in OFFLOADING)


def fit_host(cost: CostModel, decisions: dict[str, str], cap: int) -> dict[str, str]:
    """``decisions`` changed as little as possible so its copies fit the host tiers (see module doc);
    OffloadError naming the host settings when no change keeps the device peak under ``cap``."""
    limit = host_capacity(cost.engine_kwargs)
    dec = dict(decisions)
    if limit is None:
        return dec
    while (held := host_bytes(cost, dec)) > limit:
        best = None
        for name, d in dec.items():
            if d not in OFFLOADING:
                continue
            for alt in ("keep", "recompute"):
                if all(alt in b.options for b in cost.blocks if b.name == name):
                    trial = {**dec, name: alt}
                    if cost.peak(trial) > cap:
                        continue
                    freed = held - host_bytes(cost, trial)
                    if freed <= 0:
                        continue
                    score = (cost.seconds(trial) - cost.seconds(dec)) / freed
                    if best is None or score < best[0]:
                        best = (score, trial)
        if best is None:
            raise OffloadError(
                f"offload.plan: the plan needs {held} B of host memory for its copies, the host tiers hold "
                f"{limit} B ({', '.join(f'{t}: {c}' for t, c in _caps(cost.engine_kwargs))}), and no block can "
                "stop offloading without going over budget_bytes. Raise host_budget_bytes, add a tier "
                "(pageable_budget_bytes, disk_dir), or raise budget_bytes."
            )
        dec = best[1]
    return dec


def tier_bytes(cost: CostModel, decisions: dict[str, str]) -> dict[str, dict[str, int]]:
    """Per offloading block (FQN): bytes per tier its copies land in, filling the tiers in pack order."""
    caps = [[t, c] for t, c in _caps(cost.engine_kwargs)]
    out: dict[str, dict[str, int]] = {}
    for b in cost.blocks:
        d = decisions[b.name]
        if d not in OFFLOADING:
            continue
        left = b.options[d].host_bytes
        row = out.setdefault(b.name, {})
        for tier in caps:
            if left == 0:
                break
            room = left if tier[1] is None else min(left, tier[1])
            if room:
                row[tier[0]] = row.get(tier[0], 0) + room
                left -= room
                if tier[1] is not None:
                    tier[1] -= room
        if left:
            row["device"] = row.get("device", 0) + left
    return out
