"""Choosing decisions for a budget from a cost model: the solver's inputs (one list of options per
call position, every plan covered by a few exactly solved variants), the plan of the lowest peak,
the fastest plan under the cap, and the error when no plan fits."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from torch import nn

from .._format import format_bytes
from ..errors import OffloadError
from .cost import OFFLOADING, CostModel
from .host import fit_host
from .install import DECISIONS, RECOMPUTE
from .solve import Choice, min_peak, solve, solve_stable

__all__ = ["choose"]

log = logging.getLogger("offload.planner")


def choose(cost: CostModel, budget_bytes: int, margin: int, *, model: nn.Module | None, unplanned_peak: int,
           solver: str, tried: Sequence[str] = ()) -> tuple[dict[str, str], str, int]:
    """The fastest decisions whose predicted peak is at most ``budget_bytes - margin`` (all "keep" when
    the budget holds the step without a plan), how they were found, and the smallest peak any plan
    reaches; :class:`OffloadError` (see ``_infeasible``) when none fits."""
    cap = budget_bytes - margin
    variants = _variants(cost)
    lowest = _lowest(cost, variants)
    min_peak_bytes = cost.peak(lowest)
    keep = {n: "keep" for n in cost.names}
    if margin == 0 and budget_bytes >= max(unplanned_peak, cost.peak(keep)):
        dec, method = keep, "none needed (budget >= peak without a plan)"
    else:
        if min_peak_bytes > cap:
            raise _infeasible(budget_bytes, cost, lowest, model, margin, tried)
        best = None
        for ch in variants:
            sol = solve(ch, cap - cost.base, method=solver, shared=cost.outside)
            if sol is not None and (best is None or (sol.seconds, sol.peak) < (best.seconds, best.peak)):
                best = sol
        if best is None:  # greedy found nothing: the minimum-peak plan fits
            dec, method = lowest, "min_peak (the heuristic found nothing)"
        else:
            dec, method = _as_dict(cost, best.decisions), best.solver
            dec, method = _stable(cost, variants, cap, best.seconds, dec, method)
    dec = fit_host(cost, dec, cap)  # issue 25: never more offload than the host tiers hold
    peak = cost.peak(dec)
    if peak > cap:  # the solver saw every event: this is a bug, never a silent over-budget plan
        raise OffloadError(
            f"offload.plan: internal error, please report: the chosen plan's predicted peak {peak} B exceeds "
            f"budget_bytes={budget_bytes} at the {cost.where(dec)}."
        )
    return dec, method, min_peak_bytes


def _stable(cost: CostModel, variants: list[list[list[Choice]]], cap: int, fastest: float,
            dec: dict[str, str], method: str) -> tuple[dict[str, str], str]:
    """The tie-break that makes a plan reproducible (issue 31): among the plans predicted within the
    noise band of the fastest (``cost.noise_s``), the fewest non-keep decisions, then the cheaper
    decision (``DECISIONS`` order: keep, offload, recompute, recompute_offload) at the earliest block.
    Timing noise then decides nothing that is within it."""
    found = None
    for ch in variants:
        got = solve_stable(ch, cap - cost.base, fastest + cost.noise_s, shared=cost.outside)
        if got is not None:
            key = (got[0][0], tuple(DECISIONS.index(d) for d in got[1].decisions))
            if found is None or key < found[0]:
                found = (key, got[1])
    if found is None:  # too many plans to search exactly: the fastest, as solved
        log.info("offload.plan: too many plans within the noise band to break ties exactly; kept the fastest")
        return dec, method
    return _as_dict(cost, found[1].decisions), (
        f"{method}; ties within the noise band ({cost.noise_s * 1e3:.2f} ms) broken by fewest non-keep "
        "decisions, then the cheaper decision at the earliest block")


def _choices(cost: CostModel, *, offloading: bool = True,
             fixed: dict[str, str] | None = None) -> list[list[Choice]] | None:
    """Solver input, one list of options per call position; every peak the cost model knows is in
    ``event`` (see ``CostModel.events``). With ``offloading`` every option's backward is charged the
    prefetch bytes; ``fixed`` pins blocks to one decision (a block called more than once). None when a
    position is left without options."""
    ahead = cost.prefetch_bytes if offloading else 0
    keep_only = cost.keep_only
    out = []
    for b in cost.blocks:
        opts = []
        for d, o in b.options.items():
            if d in OFFLOADING and not offloading:
                continue
            if fixed is not None and b.name in fixed and d != fixed[b.name]:
                continue
            if d in RECOMPUTE and b.name in cost.no_recompute:
                continue
            if d != "keep" and b.name in keep_only:
                continue
            late = max(o.bwd_event + ahead, o.head_event)
            opts.append(Choice(d, o.retained, max(o.event, late), o.seconds, late, o.holds, o.covered, o.fwd_event,
                               o.fcovered, o.head_event, o.hcovered))
        if not opts:
            return None
        out.append(opts)
    return out


_MAX_TIED = 4
"""Blocks called more than once whose decisions are enumerated jointly (4 ** 4 solves at most)."""


def _variants(cost: CostModel) -> list[list[list[Choice]]]:
    """Solver inputs whose union is every plan, each solved exactly.

    Plans that offload and plans that do not are separate (the prefetch charge depends on the whole
    plan). A block called more than once must take one decision for all its calls, which a chain
    solver cannot express: its decision is enumerated (up to ``_MAX_TIED`` such blocks; beyond, they
    share one decision).
    """
    counts: dict[str, int] = {}
    for b in cost.blocks:
        counts[b.name] = counts.get(b.name, 0) + 1
    tied = [n for n, c in counts.items() if c > 1]
    if not tied:
        fixes: list[dict[str, str] | None] = [None]
    elif len(tied) <= _MAX_TIED:
        fixes = [dict(zip(tied, combo)) for combo in itertools.product(DECISIONS, repeat=len(tied))]
    else:
        log.info("offload.plan: %d blocks run more than once per step; they get one shared decision", len(tied))
        fixes = [{n: d for n in tied} for d in DECISIONS]
    out = []
    for fixed in fixes:
        for offloading in ((True, False) if cost.prefetch_bytes else (True,)):
            ch = _choices(cost, offloading=offloading, fixed=fixed)
            if ch is not None:
                out.append(ch)
    return out


def _lowest(cost: CostModel, variants: list[list[list[Choice]]]) -> dict[str, str]:
    """The plan with the smallest predicted peak (then the least time)."""
    best = None
    for ch in variants:
        sol = min_peak(ch, cost.outside)
        dec = _as_dict(cost, sol.decisions)
        key = (cost.peak(dec), cost.seconds(dec))
        if best is None or key < best[0]:
            best = (key, dec)
    assert best is not None
    return best[1]


def _as_dict(cost: CostModel, per_position: Sequence[str]) -> dict[str, str]:
    return {b.name: d for b, d in zip(cost.blocks, per_position)}


def refusal_hint(cost: CostModel, where: str) -> str:
    """What lowers a smallest peak the cost model puts at ``where`` (a window's label), for a refusal."""
    opt = cost.optimizer if cost.optimizer is not None and cost.optimizer.given else None
    if opt is not None and (where.startswith(opt.name + " step") or f"the {opt.name} step" in where):
        return (f"lighten the optimizer: its state is {format_bytes(opt.state_bytes)} and its step allocates "
                f"{format_bytes(opt.step_bytes)} more{' (foreach)' if opt.foreach else ''}, which no decision lowers "
                "(foreach=False steps one parameter at a time; fewer trainable parameters, e.g. LoRA; a smaller "
                "state, e.g. an 8-bit or factored optimizer)")
    if where.startswith(("stem", "end of backward", "head")):
        return ("shrink the step (batch, sequence length): that peak happens outside every candidate block, so no "
                "decision lowers it (or make the module that holds it a candidate)")
    return "shrink the step (batch, sequence length), or pass blocks=[...] with more (or larger) candidates"


def _infeasible(budget: int, cost: CostModel, lowest: dict[str, str], model: nn.Module | None, margin: int = 0,
                tried: Sequence[str] = ()) -> OffloadError:
    params = sum(p.numel() * p.element_size() for p in model.parameters()) if model is not None else 0
    # Gradients of trainable parameters exist during the step (profiling keeps them allocated).
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) if model else 0
    smallest, where, prefix = max(cost.breakdown(lowest))
    own = smallest - cost.base - prefix
    opt = cost.optimizer if cost.optimizer is not None and cost.optimizer.given else None
    state = opt.state_bytes if opt is not None else 0  # in the base: measured, charged or profiled
    hint = refusal_hint(cost, where)
    measured = (f" Measured plans peaked above it ({'; '.join(tried)}), so plans need a margin of {format_bytes(margin)} "
                "below the budget, which none reaches." if tried else "")
    return OffloadError(
        f"offload.plan: budget_bytes={budget} ({format_bytes(budget)}) cannot be met: the smallest peak any plan "
        f"reaches is {smallest} B ({format_bytes(smallest)}), at the {where}.{measured} What holds it: the step's base "
        f"{format_bytes(cost.base)} (parameters {format_bytes(params)}, gradients {format_bytes(grads)}, "
        + (f"{opt.name} state {format_bytes(state)}, " if state else "")
        + f"buffers and inputs {format_bytes(max(0, cost.base - params - grads - state))}), {format_bytes(prefix)} kept by "
        "earlier blocks for their backward, "
        f"and {format_bytes(own)} in use within that window. Raise budget_bytes to at least {smallest}, or {hint}."
    )
