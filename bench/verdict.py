"""Gradient verdicts that tell "this strategy changed the numbers" from "this kernel is not deterministic".

Every strategy's loss and gradients are compared with its reference's (``none``). On CPU every
kernel is deterministic and the comparison is bitwise. On a GPU some default kernels accumulate
with atomics (flash-attention's backward at long sequences, index_add, scatter), so two runs of
``none`` itself can differ. The bench therefore runs one extra correctness step per strategy:

1. with ``torch.use_deterministic_algorithms(True, warn_only=False)`` (and
   ``CUBLAS_WORKSPACE_CONFIG`` set): every kernel deterministic or an error. When that step
   runs, the verdict is bitwise (mode ``bitwise``).
2. When a kernel has no deterministic implementation (torch raises saying so), the step is run
   again with ``warn_only=True``, and the kernels torch warned about are recorded. The reference
   is then run twice that way: the per-tensor difference between its two runs is the noise
   floor, and each strategy is judged against it (mode ``noise_floor``): within
   ``NOISE_FACTOR`` x the floor for every tensor (a tensor whose floor is 0, one no
   non-deterministic kernel touched, must match bitwise) or not.

The verdict (:attr:`bench.results.Correctness.verdict`) names the mode, the kernels and the floor.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.results import Correctness

__all__ = ["NOISE_FACTOR", "CUBLAS_WORKSPACE_CONFIG", "Snapshot", "Step", "deterministic_step", "compare",
           "is_nondeterministic_alert", "set_cublas_workspace_config", "reordered_tolerance"]

NOISE_FACTOR = 4.0
"""A strategy is within the noise when each tensor's max |difference| from the reference is at most this
times the reference's own run-to-run difference. The floor comes from one pair of runs (an extreme value
of a noisy sample), so a second independent pair can exceed it by a small factor; a wrong offload
(stale or misplaced data) differs by orders of magnitude, and where the floor is 0 any difference fails."""

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS's deterministic workspace setting (NVIDIA's documented value); torch refuses deterministic
matmuls without it. It must be set before cuBLAS starts: the bench sets it first thing on CUDA."""

_ALERT = re.compile(r"(\S+) does not have a deterministic implementation")


def set_cublas_workspace_config() -> str:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` unless the user chose one; returns the value in effect."""
    return os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)


def is_nondeterministic_alert(e: BaseException) -> bool:
    """True for torch's error "X does not have a deterministic implementation, but you set ..."."""
    return isinstance(e, RuntimeError) and _ALERT.search(str(e)) is not None


def _ops(texts: list[str]) -> list[str]:
    return sorted({m.group(1) for t in texts for m in _ALERT.finditer(t)})


@dataclass
class Snapshot:
    """A step's loss and gradients, copied to the CPU."""

    loss: torch.Tensor
    grads: list[torch.Tensor]

    @classmethod
    def take(cls, loss: torch.Tensor, grads: list[torch.Tensor | None]) -> Snapshot:
        ref = [g.detach().to("cpu", copy=True) if g is not None else None for g in grads]
        return cls(loss.detach().to("cpu", copy=True), [g if g is not None else torch.zeros(0) for g in ref])

    def tensors(self) -> list[torch.Tensor]:
        return [self.loss, *self.grads]


@dataclass
class Step:
    """One correctness step: its snapshot, and the kernels that had no deterministic implementation
    (empty: the step ran with every kernel deterministic)."""

    snapshot: Snapshot
    nondeterministic_ops: list[str]

    @property
    def strict(self) -> bool:
        return not self.nondeterministic_ops


def deterministic_step(step: Callable[[], torch.Tensor], zero_grads: Callable[[], None],
                       grads: Callable[[], list[torch.Tensor | None]]) -> Step:
    """Run ``step`` with deterministic algorithms enforced (``warn_only=False``); when a kernel has no
    deterministic implementation, run it again with ``warn_only=True`` and name the kernels."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        try:
            torch.use_deterministic_algorithms(True, warn_only=False)
            zero_grads()
            loss = step()
            return Step(Snapshot.take(loss, grads()), [])
        except RuntimeError as e:
            if not is_nondeterministic_alert(e):
                raise
            first = str(e)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.use_deterministic_algorithms(True, warn_only=True)
            zero_grads()
            loss = step()
        ops = _ops([first, *(str(w.message) for w in caught)])
        return Step(Snapshot.take(loss, grads()), ops)
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if torch.equal(a, b):
        return 0.0
    d = float((a.double() - b.double()).abs().max())
    return d if math.isfinite(d) else math.inf


def reordered_tolerance(dtype: torch.dtype) -> float:
    """The relative difference (max |d| / max |reference| per tensor) a strategy that reorders sums over
    tokens may show: 64 float32 epsilons (what a sum of thousands of terms drifts by), or 4 of the
    workload's dtype when coarser (one rounding of a tile's partial sum, bf16: 3.1e-2). A wrong tile (data
    from another tile, a lost one) differs by order 1."""
    return max(64 * torch.finfo(torch.float32).eps, 4 * torch.finfo(dtype).eps)


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    d = _max_diff(a, b)
    if d in (0.0, math.inf):
        return d
    scale = float(b.double().abs().max()) if b.numel() else 0.0
    return d / scale if scale > 0 else math.inf


def compare(reference: Snapshot, got: Snapshot, against: str = "none", *, floor: Snapshot | None = None,
            ops: list[str] | None = None, tolerance: float | None = None) -> Correctness:
    """``got`` against ``reference``: bitwise, or (when ``ops`` names non-deterministic kernels) against
    the noise floor, the per-tensor difference between ``reference`` and ``floor`` (a second run of it).
    Without ``floor`` a non-bitwise result with non-deterministic kernels is inconclusive. With a
    ``tolerance`` (a strategy that reorders sums: ``reordered_tolerance``) each tensor's relative
    difference must be within it instead (``max_abs_diff`` is then the largest relative one)."""
    diffs = [_max_diff(g, r) for g, r in zip(got.tensors(), reference.tensors())]
    c = Correctness(loss_equal=diffs[0] == 0.0, grads_equal=all(d == 0.0 for d in diffs[1:]),
                    grads_compared=len(reference.grads), max_abs_diff=max(diffs), against=against)
    if tolerance is not None:
        rel = [_rel_diff(g, r) for g, r in zip(got.tensors(), reference.tensors())]
        worst = max(range(len(rel)), key=lambda i: rel[i])
        c.mode, c.tolerance, c.max_abs_diff = "tolerance", tolerance, rel[worst]
        c.within_noise = rel[worst] <= tolerance
        c.worst_tensor = "loss" if worst == 0 else f"grad {worst - 1}"
        return c
    if not ops:
        return c
    c.mode = "noise_floor"
    c.nondeterministic_ops = list(ops)
    if c.bitwise_equal:
        c.within_noise = True
        return c
    if floor is None:
        return c  # within_noise stays None: inconclusive
    floors = [_max_diff(f, r) for f, r in zip(floor.tensors(), reference.tensors())]
    c.noise_floor = max(floors)
    worst = max(range(len(diffs)), key=lambda i: diffs[i] - NOISE_FACTOR * floors[i])
    c.within_noise = all(d <= NOISE_FACTOR * f for d, f in zip(diffs, floors))
    c.worst_tensor = "loss" if worst == 0 else f"grad {worst - 1}"
    return c
