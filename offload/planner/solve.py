"""Choose one option per block: least predicted time with every predicted peak under the cap.

The problem (from :mod:`offload.planner.cost`): blocks ``i = 0..n-1`` in
forward order; option ``d`` of block ``i`` has retained bytes ``r``, a peak
constant ``e`` and seconds ``t``. A choice is feasible when, for every block,
``P_i + e_i(d_i) <= cap`` with ``P_i = sum_{j<i} r_j(d_j)``; its cost is
``sum t_i(d_i)``. One term is not a sum: a storage several positions may hold
(a mask, position ids: ``shared``, the sizes of ``CostModel.outside``) is on the
device in a backward window while any position up to it holds it, so ``e_i``
also depends on the set ``H_i`` of those the earlier positions hold (``_event``).

Exact solver: a dynamic program over blocks whose state is the prefix sum
``P`` and the set ``H``. Two partial choices with ``P' <= P``, ``T' <= T`` and
the same ``H`` leave the first dominated (every completion feasible for it is
feasible for the other, and cheaper), so keeping the Pareto front of (P, T) per
``H`` after each block is exact (there are few such storages: the fronts per
``H`` are few, and ``H`` only grows along a chain). The
front holds at most one entry per distinct prefix sum; for repeated blocks it
stays polynomial (O(n^3) with four options), which is why a DP, and not a
MILP (scipy/HiGHS would be a new dependency for a problem this structured),
is the right tool. When the front grows past ``max_states`` (many unequal
blocks), :func:`solve_greedy` takes over.

Greedy fallback: from all ``keep``, repeatedly apply the single change with
the best (peak reduction, else retained-bytes reduction) per added second
until feasible, then undo changes that are no longer needed.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from .lifetimes import extra

__all__ = ["Choice", "Solution", "solve", "solve_exact", "solve_greedy", "solve_brute_force", "solve_stable", "min_peak"]


@dataclass(frozen=True)
class Choice:
    """One option of one block for the solver (bytes are relative to the step's base)."""

    decision: str
    retained: int
    event: int
    seconds: float
    late: int = 0
    """The part of ``event`` after forward (backward, head): outside storages earlier positions hold add to it."""
    holds: int = 0
    """Outside storages (bits of the solver's ``shared`` sizes) this option holds to its backward."""
    covered: int = 0
    """Outside storages ``late`` already counts."""
    fwd: int = 0
    """The forward part of ``event``."""
    fcovered: int = 0
    """Outside storages ``fwd`` leaves out though they are in the forward when held."""
    head: int = 0
    """The head's window's part of ``late`` (0: none)."""
    hcovered: int = 0
    """Outside storages ``head`` leaves out though they are in its window when held (with those ``late`` adds)."""


def _event(c: Choice, held: int, shared: Sequence[int]) -> int:
    """``c``'s peak constant when the earlier positions hold the outside storages ``held``."""
    late, early, head = held & ~c.covered, held & c.fcovered, held & c.hcovered
    if not late and not early:
        return c.event
    event, added = c.event, extra(shared, late)
    if late:
        event = max(event, c.late + added)
    if early:
        event = max(event, c.fwd + extra(shared, early))
    if head and c.head:
        event = max(event, c.head + added + extra(shared, head))
    return event


@dataclass(frozen=True)
class Solution:
    decisions: tuple[str, ...]
    peak: int
    """Largest ``P_i + e_i`` (relative to the base)."""
    seconds: float
    solver: str


def _evaluate(blocks: Sequence[Sequence[Choice]], idx: Sequence[int], shared: Sequence[int] = ()) -> tuple[int, float]:
    prefix, held, peak, secs = 0, 0, -(1 << 62), 0.0
    for opts, k in zip(blocks, idx):
        c = opts[k]
        peak = max(peak, prefix + _event(c, held, shared))
        prefix += c.retained
        held |= c.holds
        secs += c.seconds
    return peak, secs


def _solution(blocks: Sequence[Sequence[Choice]], idx: Sequence[int], solver: str,
              shared: Sequence[int] = ()) -> Solution:
    peak, secs = _evaluate(blocks, idx, shared)
    return Solution(tuple(blocks[i][k].decision for i, k in enumerate(idx)), peak, secs, solver)


def solve_brute_force(blocks: Sequence[Sequence[Choice]], cap: int, shared: Sequence[int] = ()) -> Solution | None:
    """Every combination (tests only: |options|^n)."""
    best = None
    for idx in itertools.product(*(range(len(o)) for o in blocks)):
        peak, secs = _evaluate(blocks, idx, shared)
        if peak <= cap and (best is None or secs < best[1] - 1e-15):
            best = (idx, secs)
    return None if best is None else _solution(blocks, best[0], "brute_force", shared)


class _TooManyStates(Exception):
    pass


def _needed(blocks: Sequence[Sequence[Choice]], shared: Sequence[int]) -> list[int]:
    """Per block, the outside storages some later block's event may read: a held storage no later event
    reads is dropped from the state, so that states differing only by it are compared (a storage read by
    one block only, such as the weights a block returns, would otherwise double the fronts for good)."""
    full = (1 << len(shared)) - 1
    out = [0] * len(blocks)
    need = 0
    for i in range(len(blocks) - 1, -1, -1):
        out[i] = need
        for c in blocks[i]:
            need |= c.fcovered | (full & ~c.covered)
    return out


_State = tuple[int, float, tuple[int, ...], int]
"""(prefix bytes, seconds, option index per block, outside storages held)."""


def _pareto(states: list[_State]) -> list[_State]:
    """The Pareto front of (prefix, seconds) among the states holding the same outside storages."""
    groups: dict[int, list[_State]] = defaultdict(list)
    for s in states:
        groups[s[3]].append(s)
    front: list[_State] = []
    for group in groups.values():
        group.sort(key=lambda s: (s[0], s[1]))
        best = None
        for s in group:
            if best is None or s[1] < best - 1e-15:
                front.append(s)
                best = s[1]
    return front


def solve_exact(blocks: Sequence[Sequence[Choice]], cap: int, max_states: int = 200_000,
                shared: Sequence[int] = ()) -> Solution | None:
    """Pareto DP over (prefix bytes, seconds) per set of held outside storages; None when nothing fits
    under ``cap``."""
    states: list[_State] = [(0, 0.0, (), 0)]
    needed = _needed(blocks, shared)
    for i, opts in enumerate(blocks):
        nxt = []
        for prefix, secs, idx, held in states:
            for k, c in enumerate(opts):
                if prefix + _event(c, held, shared) <= cap:
                    nxt.append((prefix + c.retained, secs + c.seconds, idx + (k,), (held | c.holds) & needed[i]))
        if not nxt:
            return None
        states = _pareto(nxt)
        if len(states) > max_states:
            raise _TooManyStates(len(states))
    best = min(states, key=lambda s: s[1])
    return _solution(blocks, best[2], "exact", shared)


def solve_greedy(blocks: Sequence[Sequence[Choice]], cap: int, shared: Sequence[int] = ()) -> Solution | None:
    """Heuristic for large problems (see the module docstring); None when it finds nothing feasible."""
    n = len(blocks)
    idx = [min(range(len(o)), key=lambda k: o[k].seconds) for o in blocks]

    def total_retained(ix: Sequence[int]) -> int:
        return sum(blocks[i][k].retained for i, k in enumerate(ix))

    peak, secs = _evaluate(blocks, idx, shared)
    while peak > cap:
        best, best_key = None, None
        for i in range(n):
            for k in range(len(blocks[i])):
                if k == idx[i]:
                    continue
                trial = list(idx)
                trial[i] = k
                p, s = _evaluate(blocks, trial, shared)
                dt = max(s - secs, 1e-12)
                gain = peak - p
                rgain = total_retained(idx) - total_retained(trial)
                if gain <= 0 and rgain <= 0:
                    continue
                key = (gain > 0, (gain if gain > 0 else rgain) / dt)
                if best_key is None or key > best_key:
                    best, best_key = trial, key
        if best is None:
            return None
        idx = best
        peak, secs = _evaluate(blocks, idx, shared)
    # Undo what is no longer needed: cheaper options that stay feasible.
    improved = True
    while improved:
        improved = False
        for i in range(n):
            for k in sorted(range(len(blocks[i])), key=lambda k: blocks[i][k].seconds):
                if blocks[i][k].seconds >= blocks[i][idx[i]].seconds:
                    break
                trial = list(idx)
                trial[i] = k
                p, _ = _evaluate(blocks, trial, shared)
                if p <= cap:
                    idx = trial
                    improved = True
                    break
    return _solution(blocks, idx, "greedy", shared)


def solve(blocks: Sequence[Sequence[Choice]], cap: int, *, method: str = "auto",
          max_states: int = 200_000, shared: Sequence[int] = ()) -> Solution | None:
    """``method``: "auto" (exact, greedy when the front explodes), "exact", "greedy" or "brute_force";
    ``shared``: the sizes of the outside storages the options' ``holds`` name."""
    if method == "brute_force":
        return solve_brute_force(blocks, cap, shared)
    if method == "greedy":
        return solve_greedy(blocks, cap, shared)
    if method not in ("auto", "exact"):
        raise ValueError(f"offload.plan: solver={method!r} is not one of 'auto', 'exact', 'greedy', 'brute_force'")
    try:
        return solve_exact(blocks, cap, max_states=max_states if method == "auto" else 1 << 62, shared=shared)
    except _TooManyStates:
        return solve_greedy(blocks, cap, shared)


def min_peak(blocks: Sequence[Sequence[Choice]], shared: Sequence[int] = ()) -> Solution:
    """The smallest reachable peak (time ignored, then least time among equals): Pareto DP on (prefix, max)
    per set of held outside storages."""
    states: list[tuple[int, int, float, tuple[int, ...], int]] = [(0, -(1 << 62), 0.0, (), 0)]
    needed = _needed(blocks, shared)
    for i, opts in enumerate(blocks):
        groups: dict[int, list[tuple[int, int, float, tuple[int, ...], int]]] = defaultdict(list)
        for prefix, m, secs, idx, held in states:
            for k, c in enumerate(opts):
                now = (held | c.holds) & needed[i]
                groups[now].append((prefix + c.retained, max(m, prefix + _event(c, held, shared)),
                                    secs + c.seconds, idx + (k,), now))
        states = []
        for nxt in groups.values():
            nxt.sort(key=lambda s: (s[0], s[1], s[2]))
            front: list[tuple[int, int, float, tuple[int, ...], int]] = []
            for s in nxt:
                if not front or s[1] < front[-1][1]:
                    front.append(s)
            states.extend(front)
        states = states[:200_000]
    best = min(states, key=lambda s: (s[1], s[2]))
    return _solution(blocks, best[3], "min_peak", shared)


def solve_stable(blocks: Sequence[Sequence[Choice]], cap: int, limit: float, max_states: int = 200_000,
                 shared: Sequence[int] = ()) -> tuple[tuple[int, tuple[int, ...]], Solution] | None:
    """Among the plans at most ``limit`` seconds with every peak under ``cap``, the one with the fewest
    non-"keep" decisions, then the earliest option (options are listed cheapest first) at the earliest
    block: measured times never decide between plans whose times are within the noise band (the caller
    sets ``limit`` = fastest + band). The order reads no time, and prefers what is usually faster, so
    the plan it picks is rarely at the band's edge. Returns (its sort key, it); None when no plan is
    within ``limit`` or the search grows past ``max_states`` (the caller keeps the fastest plan then).

    Exact: a partial plan is dropped only when even its fastest completion exceeds ``limit``, or when
    another with the same prefix bytes, non-keep count and held outside storages is both earlier in option order and no
    slower (every completion of the dropped one is then worse or equal for the other).
    """
    rest = [0.0] * (len(blocks) + 1)
    for i in range(len(blocks) - 1, -1, -1):
        rest[i] = rest[i + 1] + min(c.seconds for c in blocks[i])
    slack = 1e-12 * max(1.0, abs(limit))
    states: dict[tuple[int, int, int], list[tuple[tuple[int, ...], float]]] = {(0, 0, 0): [((), 0.0)]}
    needed = _needed(blocks, shared)
    for i, opts in enumerate(blocks):
        nxt: dict[tuple[int, int, int], list[tuple[tuple[int, ...], float]]] = {}
        for (prefix, nk, held), entries in states.items():
            for idx, secs in entries:
                for k, c in enumerate(opts):
                    s = secs + c.seconds
                    if prefix + _event(c, held, shared) <= cap and s + rest[i + 1] <= limit + slack:
                        key = (prefix + c.retained, nk + (c.decision != "keep"), (held | c.holds) & needed[i])
                        nxt.setdefault(key, []).append((idx + (k,), s))
        count = 0
        for key, entries in nxt.items():  # per key: earlier in option order, or faster
            entries.sort()
            front = [entries[0]]
            for e in entries[1:]:
                if e[1] < front[-1][1]:
                    front.append(e)
            nxt[key] = front
            count += len(front)
        if not nxt or count > max_states:
            return None
        states = nxt
    best = min((k[1], e[0]) for k, entries in states.items() for e in entries)
    return best, _solution(blocks, best[1], "exact", shared)
