"""The solvers on synthetic profiles: exact == brute force, known optima, greedy feasibility."""

from __future__ import annotations

import random

import pytest

from offload.planner.solve import Choice, min_peak, solve, solve_brute_force, solve_exact, solve_greedy

# keep: fast, holds a lot; offload: no hold, copy time; recompute: holds the input, +1/3 compute;
# recompute_offload: holds nothing, recompute plus a small copy.
def _block(saved: int, inp: int, t: float, copy: float, transient: int) -> list[Choice]:
    return [
        Choice("keep", saved, transient, t),
        Choice("offload", 0, transient, t + copy),
        Choice("recompute", inp, transient + saved, t * 4 / 3),
        Choice("recompute_offload", 0, transient + saved + inp, t * 4 / 3 + copy * inp / saved),
    ]


def _random_blocks(rng: random.Random, n: int) -> list[list[Choice]]:
    out = []
    for _ in range(n):
        saved = rng.randint(10, 100)
        out.append(_block(saved, rng.randint(1, 9), rng.uniform(1, 3), rng.uniform(0, 2), rng.randint(0, 30)))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_exact_equals_brute_force_on_random_profiles(seed: int) -> None:
    rng = random.Random(seed)
    blocks = _random_blocks(rng, rng.randint(1, 6))
    total = sum(b[0].retained for b in blocks) + max(b[0].event for b in blocks)
    for frac in (0.2, 0.4, 0.6, 0.8, 1.0):
        cap = int(frac * total)
        bf = solve_brute_force(blocks, cap)
        ex = solve_exact(blocks, cap)
        assert (bf is None) == (ex is None), (cap, bf, ex)
        if bf is not None:
            assert ex.seconds == pytest.approx(bf.seconds, rel=1e-12, abs=1e-12)
            assert ex.peak <= cap
            gr = solve_greedy(blocks, cap)
            if gr is not None:  # greedy is a heuristic: feasible, never better than exact
                assert gr.peak <= cap
                assert gr.seconds >= ex.seconds - 1e-12


def _shared_blocks(rng: random.Random, n: int, k: int) -> list[list[Choice]]:
    """``_random_blocks`` whose options hold some of ``k`` outside storages to their backward, with
    ``covered`` as a profile of that decision at every position measures it (every earlier position
    took the same decision), ``late`` the backward part of the event and ``fwd`` its forward part, which
    some of the storages add to (``fcovered``)."""
    blocks = _random_blocks(rng, n)
    holds = {d: [rng.randrange(1 << k) if d != "offload" else 0 for _ in range(n)]
             for d in ("keep", "offload", "recompute", "recompute_offload")}
    out = []
    for i, opts in enumerate(blocks):
        row = []
        for c in opts:
            covered = 0
            for j in range(i + 1):
                covered |= holds[c.decision][j]
            late, fwd = c.event - rng.randint(0, 5), c.event - rng.randint(0, 5)
            # (an earlier position's input the forward holds: in this forward unless its profile charged it)
            fcovered = rng.randrange(1 << k) & ~covered if i else 0
            head = late if i == n - 1 else 0  # the head's window: the last position's (it may hold them too)
            row.append(Choice(c.decision, c.retained, c.event, c.seconds, late, holds[c.decision][i], covered, fwd,
                              fcovered, head, fcovered & rng.randrange(1 << k)))
        out.append(row)
    return out


def _check_outside(seed: int) -> int:
    """``test_exact_equals_brute_force_with_outside_storages`` for one seed; returns in how many of its
    caps the optimum (or its feasibility) differs from the same blocks' without the term."""
    import dataclasses

    from offload.planner.solve import _evaluate, solve_stable

    rng = random.Random(100 + seed)
    shared = [rng.randint(5, 60) for _ in range(3)]
    blocks = _shared_blocks(rng, rng.randint(2, 5), len(shared))
    lo = min_peak(blocks, shared)
    assert solve_brute_force(blocks, lo.peak, shared) is not None
    assert solve_brute_force(blocks, lo.peak - 1, shared) is None
    total = sum(b[0].retained for b in blocks) + max(b[0].event for b in blocks) + sum(shared)
    plain = [[dataclasses.replace(c, holds=0, covered=0, fcovered=0) for c in b] for b in blocks]
    differs = 0
    for frac in (0.2, 0.4, 0.6, 0.8, 1.0):
        cap = int(frac * total)
        bf = solve_brute_force(blocks, cap, shared)
        ex = solve_exact(blocks, cap, shared=shared)
        assert (bf is None) == (ex is None), (cap, bf, ex)
        without = solve_brute_force(plain, cap)
        differs += (bf is None) != (without is None) or (bf is not None and bf.seconds != without.seconds)
        if bf is None:
            continue
        assert ex.seconds == pytest.approx(bf.seconds, rel=1e-12, abs=1e-12)
        idx = [[c.decision for c in b].index(d) for b, d in zip(blocks, ex.decisions)]
        assert _evaluate(blocks, idx, shared)[0] == ex.peak <= cap
        got = solve_stable(blocks, cap, ex.seconds + 1e-9, shared=shared)
        assert got is not None and got[1].peak <= cap and got[1].seconds <= ex.seconds + 1e-9
        gr = solve_greedy(blocks, cap, shared)
        if gr is not None:
            assert gr.peak <= cap and gr.seconds >= ex.seconds - 1e-12
    return differs


@pytest.mark.parametrize("seed", range(10))
def test_exact_equals_brute_force_with_outside_storages(seed: int) -> None:
    """Storages several positions may hold (``CostModel.outside``): a position's backward window holds
    those any position up to it holds, which the event of a profile measured with other decisions may
    not count. The exact DP (fronts per held set), the minimum-peak DP and the tie-break search agree
    with brute force over every plan, and every plan they return is feasible with that term."""
    _check_outside(seed)


def test_outside_storages_change_some_optimum() -> None:
    """The random cases above are not all decided without the term (else they would test nothing)."""
    assert sum(_check_outside(s) for s in range(10)) > 0


def test_known_optimum() -> None:
    # Three equal blocks whose own saved bytes are alive during their backward (event = 10).
    # keep holds 10 (3 s), offload holds 0 (3.9 s), recompute holds 2 (3.5 s).
    blocks = [[Choice("keep", 10, 10, 3.0), Choice("offload", 0, 0, 3.9), Choice("recompute", 2, 10, 3.5)]
              for _ in range(3)]
    # Cap 20: all keep peaks at 30; one offload anywhere fits (20), 9.9 s, and nothing cheaper does.
    sol = solve(blocks, 20)
    assert sorted(sol.decisions) == ["keep", "keep", "offload"]
    assert sol.seconds == pytest.approx(9.9)
    # Cap 12 (worked by hand): recompute + offload + keep in 10.4 s beats 2 offloads (10.8 s).
    sol = solve(blocks, 12)
    assert sorted(sol.decisions) == ["keep", "offload", "recompute"]
    assert sol.seconds == pytest.approx(10.4)
    assert sol.peak <= 12
    # Cap 9: every block's own event is 10 unless offloaded, so all three must offload.
    assert solve(blocks, 9).decisions == ("offload", "offload", "offload")
    assert solve(blocks, -1) is None


def test_min_peak_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(10):
        blocks = _random_blocks(rng, rng.randint(1, 5))
        lo = min_peak(blocks)
        # The smallest cap brute force can satisfy is lo.peak, and lo.peak - 1 is infeasible.
        assert solve_brute_force(blocks, lo.peak) is not None
        assert solve_brute_force(blocks, lo.peak - 1) is None


def test_auto_falls_back_to_greedy_when_front_explodes() -> None:
    rng = random.Random(3)
    blocks = _random_blocks(rng, 8)
    cap = int(0.5 * sum(b[0].retained for b in blocks))
    sol = solve(blocks, cap, max_states=2)
    assert sol is None or sol.solver == "greedy"
    assert solve(blocks, cap).solver == "exact"


def test_unknown_solver_is_an_error() -> None:
    with pytest.raises(ValueError, match="solver='ilp'"):
        solve([[Choice("keep", 1, 0, 1.0)]], 10, method="ilp")


def test_storages_one_block_reads_do_not_multiply_the_states() -> None:
    """What a block returns besides its output is read by the next block's forward only (one bit per
    block): a state keeping every such bit would double the fronts at every block (2^n); dropped once no
    later block reads it, the exact DP stays as small as without them, and still equals brute force."""
    from offload.planner.solve import _TooManyStates

    n = 24
    shared = [7] * n
    blocks = []
    for i in range(n):
        blocks.append([
            Choice("keep", 10, 12, 1.0, 12, 0, 0, 12, (1 << (i - 1)) if i else 0),
            Choice("offload", 1, 12, 1.5, 12, 1 << i, 0, 12, 0),
        ])
    full = (1 << n) - 1
    blocks = [[Choice(c.decision, c.retained, c.event, c.seconds, c.late, c.holds, full, c.fwd, c.fcovered)
               for c in b] for b in blocks]
    try:
        sol = solve_exact(blocks, 60, max_states=500, shared=shared)
    except _TooManyStates as e:
        raise AssertionError(f"{e} states: bits no later block reads are kept") from None
    assert sol is not None and sol.peak <= 60
    small = blocks[:6]
    bf, ex = solve_brute_force(small, 40, shared), solve_exact(small, 40, shared=shared)
    assert bf is not None and ex.seconds == pytest.approx(bf.seconds) and ex.peak == bf.peak
