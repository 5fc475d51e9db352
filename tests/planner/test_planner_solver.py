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
