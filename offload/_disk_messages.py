"""What the disk tier tells the user: its warnings (one per kind per store, each saying where the bytes
go and what to change) and the error of a record whose file is gone or no longer holds what was written
(NOTE [ Disk tier ], NOTE [ Disk run life ])."""

from __future__ import annotations

import os

from ._disk_record import DiskRecord, DiskTierError

__all__ = ["warning_text", "unreadable_error"]

_FIX = "Free space there, point disk_dir at a larger or writable directory, or lower disk_budget_bytes."


def warning_text(kind: str, *, run_dir: str | None, parent: str, nbytes: int, cause: str) -> str:
    """The warning of ``kind``: "renew" (the run directory was deleted and made again), "renew_failed"
    (it could not be), "open" (``disk_dir`` cannot be written: every copy falls through until it can),
    "write" (a write failed: the bytes stay in host memory), "refuse" (a reserve fell through to the
    next tier)."""
    if kind == "renew":
        return (
            f"offload disk tier: the run directory {run_dir!r} was deleted while the engine was using it (by "
            "something else: a tmp cleaner, a cleanup script, another job); it was made again and the disk "
            "tier goes on (counted in ctx.tiers.stats()['disk']['recreated'], logged each time). Saved tensors "
            "whose files were in it are lost: a backward that needs them raises DiskTierError (copies not yet "
            "written stay in host memory). Point disk_dir at a directory nothing else deletes from.")
    if kind == "renew_failed":
        return (
            f"offload disk tier: the run directory {run_dir!r} was deleted while the engine was using it and "
            f"cannot be made again ({cause}), so a copy the pool and pageable tiers cannot hold goes to "
            "on_host_budget (keep it on the device, or raise), counted in ctx.tiers.stats()['disk']"
            "['refused_bytes']; it is tried again once per step. Point disk_dir at a writable directory "
            "nothing else deletes from.")
    if kind == "open":
        return (
            f"offload disk tier: cannot make a run directory in disk_dir={parent!r} ({cause}), so the engine "
            "has no disk tier for now: a copy the pool and pageable tiers cannot hold goes to on_host_budget "
            "(keep it on the device, or raise), counted in ctx.tiers.stats()['disk']['refused_bytes']; the "
            "directory is tried again once per step. Point disk_dir at a writable directory, or pass "
            "disk_dir=None.")
    if kind == "write":
        return (
            f"offload disk tier: writing {nbytes} bytes to {run_dir!r} failed ({cause}); those bytes are kept "
            "in host memory, still counted in the disk tier (ctx.tiers.stats()['disk']['memory_bytes']), so "
            "nothing is lost but they take host RAM until backward. Later copies still try the disk first. "
            f"{_FIX}")
    return (
        f"offload disk tier: cannot write {nbytes} bytes to {run_dir!r} ({cause}); this tensor, and any "
        "later one the disk cannot take, goes to on_host_budget instead (keep it on the device, or raise). "
        f"{_FIX} Counted in ctx.tiers.stats()['disk']['refused_bytes'].")


def unreadable_error(rec: DiskRecord, what: str, recreated: int) -> DiskTierError:
    """The error of a read of ``rec`` that failed with ``what``: its file is gone (with its run
    directory, made again ``recreated`` times, or alone) or no longer holds what was written."""
    if not os.path.exists(rec.path):
        if not os.path.isdir(os.path.dirname(rec.path)):
            how = "its run directory was deleted while in use"
        elif recreated:
            how = ("its run directory was deleted while in use and made again since "
                   f"(ctx.tiers.stats()['disk']['recreated'] == {recreated})")
        else:
            how = "it was deleted"
        return DiskTierError(
            f"offload disk tier: the file {rec.path!r} of a saved tensor ({rec.nbytes} bytes) is gone: {how}, "
            "so the gradient cannot be computed from it. Something else deletes files there (a tmp cleaner, "
            "a cleanup script, another job): point disk_dir at a directory nothing else deletes from, then "
            "rerun the step.")
    return DiskTierError(
        f"offload disk tier: the file {rec.path!r} of a saved tensor ({rec.nbytes} bytes) does not hold what "
        f"was written: {what}. Something else changed the run directory (another process, a cleanup job, a "
        "disk error); the gradient cannot be computed from it. Give every job its own disk_dir on a local "
        "disk, then rerun the step.")
