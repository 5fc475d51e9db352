"""Result dataclasses for ``python -m bench``: raw measurements as fields, derived metrics as properties.

Everything serialises to JSON through :func:`to_jsonable` (properties included, so a
results file carries the numbers the table printed).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

try:
    import numpy as np
    from scipy.stats import binom
except ModuleNotFoundError as e:  # the bench extra's; a core install lacks them
    from bench import MissingBenchExtra

    raise MissingBenchExtra((e.name or "numpy").partition(".")[0]) from e

from offload.profiling._util import to_plain as to_jsonable  # the one JSON conversion (NaN -> None)

__all__ = [
    "median_ci",
    "StepTimes",
    "Correctness",
    "EngineStats",
    "StrategyResult",
    "Ceiling",
    "BenchResult",
    "to_jsonable",
]


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method); NaN for no data."""
    return float(np.quantile(sorted_xs, q)) if len(sorted_xs) else math.nan


def median_ci(xs: list[float], conf: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median (order statistics, binomial).

    The interval ``(x_(k), x_(n-k+1))`` of the sorted sample covers the true median with
    probability >= ``conf`` for any continuous distribution; no normality is assumed (step
    times on a shared machine have long right tails). None when ``n`` is too small for
    ``conf`` (n < 6 at 95%).
    """
    n = len(xs)
    if n == 0:
        return None
    # k = the largest k with P(Binomial(n, 1/2) <= k - 1) <= alpha / 2: how many of the cdf's values are.
    k = int(np.count_nonzero(binom.cdf(np.arange(n + 1), n, 0.5) <= (1.0 - conf) / 2))
    if k == 0:
        return None
    ys = sorted(xs)
    return ys[k - 1], ys[n - k]


@dataclass
class StepTimes:
    """Wall-clock and process CPU seconds of each measured step (after warm-up)."""

    seconds: list[float] = field(default_factory=list)
    """Wall clock (``time.perf_counter``)."""
    cpu_seconds: list[float] = field(default_factory=list)
    """Process CPU time (``time.process_time``: all threads of this process, user + system). Time
    the process spent descheduled by other load does not count, so on a shared machine this is
    the steadier measure of work done; a GPU's work is not in it."""
    issue_seconds: list[float] = field(default_factory=list)
    """Wall clock until the step's Python returned, before the device is synchronized: the host's time to
    issue the step. On a GPU, near ``seconds``: the host set the pace (or the launch queue was full), far
    below: the device did; equal on CPU, where nothing is queued."""

    @property
    def n(self) -> int:
        return len(self.seconds)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds) if self.seconds else math.nan

    @property
    def p25_s(self) -> float:
        return _quantile(sorted(self.seconds), 0.25)

    @property
    def p75_s(self) -> float:
        return _quantile(sorted(self.seconds), 0.75)

    @property
    def iqr_s(self) -> float:
        return self.p75_s - self.p25_s

    @property
    def min_s(self) -> float:
        return min(self.seconds) if self.seconds else math.nan

    @property
    def max_s(self) -> float:
        return max(self.seconds) if self.seconds else math.nan


@dataclass
class Correctness:
    """Loss and every gradient compared by ``torch.equal`` with the reference strategy's (``none``)."""

    loss_equal: bool
    grads_equal: bool
    grads_compared: int
    """Number of parameter gradients compared."""
    max_abs_diff: float
    """Largest |difference| over loss and grads (0.0 when bitwise equal)."""
    against: str = "none"
    """The strategy compared with (``compile`` for ``compile_offload``)."""
    mode: str = "bitwise"
    """``"bitwise"`` (every kernel deterministic: any difference is the strategy's), ``"noise_floor"``
    (a kernel has no deterministic implementation: judged against the reference's run-to-run
    difference; see ``bench/verdict.py``) or ``"tolerance"`` (a strategy that reorders sums over tokens,
    the tiled ones: judged by each tensor's max |difference| relative to its max |value|)."""
    tolerance: float | None = None
    """Mode ``tolerance``: the largest relative difference allowed (``bench.verdict.reordered_tolerance``)."""
    nondeterministic_ops: list[str] = field(default_factory=list)
    """The kernels torch reported as having no deterministic implementation (mode ``noise_floor``)."""
    noise_floor: float | None = None
    """Largest |difference| between two runs of the reference (mode ``noise_floor``; None: not measured)."""
    within_noise: bool | None = None
    """Mode ``noise_floor``: every tensor within the noise (True), beyond it (False), or no floor (None)."""
    worst_tensor: str = ""
    """Mode ``noise_floor``: the tensor furthest beyond (or nearest to) its floor (``loss`` or ``grad i``)."""

    @property
    def bitwise_equal(self) -> bool:
        return self.loss_equal and self.grads_equal

    @property
    def verdict(self) -> str:
        """One line: equal, changed by the strategy, within a non-deterministic kernel's noise, or
        inconclusive, naming the kernels."""
        if self.bitwise_equal:
            return "bitwise equal"
        if self.mode == "tolerance":
            return (f"{'within' if self.within_noise else 'DIFFERS beyond'} the tolerance of reordered sums: max "
                    f"relative |d| {self.max_abs_diff:.1e} (allowed {self.tolerance:.1e}"
                    f"{', worst at ' + self.worst_tensor if not self.within_noise else ''})")
        if self.mode != "noise_floor":
            return (f"DIFFERS with every kernel deterministic: the strategy changed the numbers "
                    f"(max|d| {self.max_abs_diff:.1e})")
        ops = ", ".join(self.nondeterministic_ops)
        if self.within_noise is None:
            return (f"inconclusive: not bitwise, and {ops} has no deterministic implementation while no noise "
                    f"floor was measured for {self.against} (max|d| {self.max_abs_diff:.1e})")
        if self.within_noise:
            return (f"within the noise of non-deterministic kernels ({ops}): max|d| {self.max_abs_diff:.1e}, "
                    f"{self.against}'s own run-to-run max|d| {self.noise_floor:.1e}")
        return (f"DIFFERS beyond the noise of non-deterministic kernels ({ops}): the strategy changed the numbers "
                f"(max|d| {self.max_abs_diff:.1e} vs {self.against}'s run-to-run {self.noise_floor:.1e}, "
                f"worst at {self.worst_tensor})")


@dataclass
class EngineStats:
    """What an offload engine's ledger and pool said over the measured steps (per step where noted)."""

    steps: int
    """Measured steps these deltas cover."""
    packed_bytes: float
    """Per step: bytes autograd handed to the pack hook."""
    offloaded_bytes: float
    """Per step: bytes moved into the host pool."""
    kept_bytes: float
    """Per step: bytes left on the device."""
    kept_by_reason: dict[str, float]
    """Per step: kept bytes by reason."""
    d2h_bytes: float
    d2h_seconds: float
    h2d_bytes: float
    h2d_seconds: float
    stall_seconds: float
    """Per step: compute time spent waiting on copies (exposed copy time)."""
    peak_inflight_bytes: int
    pool_reserved_bytes: int
    """Host bytes the pool holds at the end of the run."""
    pool_peak_reserved_bytes: int
    pool_peak_in_use_bytes: int
    """Most host bytes held at once (the peak of what was offloaded and not yet released)."""
    pool_allocations_total: int
    pool_allocations_after_warmup: int
    """New host buffers allocated during the measured steps (target: 0 for static shapes)."""
    pool_pin_failures: int
    module_offloaded_bytes: dict[str, int] = field(default_factory=dict)
    """Offloaded bytes of the last step, by module qualified name (top entries)."""
    held_bytes_last_step: int | None = None
    """Bytes the ledger says one step copied to host (``copy_bytes`` of its offloaded tensors; all are
    held at once at the end of the forward, which runs inside the context)."""
    host_bytes_measured: int | None = None
    """Host bytes the pool's buffers really took, measured outside the pool (see ``host_bytes_source``)."""
    host_bytes_source: str = ""
    """How ``host_bytes_measured`` was measured (CPU: allocator events; GPU: pinned allocator stats)."""

    @property
    def d2h_gb_s(self) -> float | None:
        return self.d2h_bytes / self.d2h_seconds / 1e9 if self.d2h_seconds > 0 else None

    @property
    def h2d_gb_s(self) -> float | None:
        return self.h2d_bytes / self.h2d_seconds / 1e9 if self.h2d_seconds > 0 else None

    @property
    def host_footprint_ratio(self) -> float | None:
        """Host bytes measured outside the pool / bytes one step holds on host (target <= 1.05).

        Numerator: ``host_bytes_measured`` (allocator events on CPU, the pinned allocator's rounded
        block sizes on a GPU), not the pool's own counters. Denominator: the ledger's bytes copied in
        one step (``copy_bytes``: a view's copy spans its storage), which is what the host must hold.
        """
        if not self.held_bytes_last_step or self.host_bytes_measured is None:
            return None
        return self.host_bytes_measured / self.held_bytes_last_step

    @property
    def pool_counter_ratio(self) -> float | None:
        """The pool's own view, for comparison: peak reserved / peak in use (its counters)."""
        if self.pool_peak_in_use_bytes <= 0:
            return None
        return self.pool_peak_reserved_bytes / self.pool_peak_in_use_bytes


@dataclass
class StrategyResult:
    """One strategy's measurements on one workload."""

    name: str
    description: str
    status: str
    """``"ok"``, ``"skipped"``, ``"oom"`` or ``"error"``."""
    reason: str = ""
    """Why it was skipped or failed (empty when ok)."""
    tokens_per_step: int = 0
    flops_per_step: float = 0.0
    times: StepTimes = field(default_factory=StepTimes)
    static_bytes: int | None = None
    """Device bytes allocated before the step (params + grads); None on CPU."""
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    activation_bytes: int | None = None
    """Peak device bytes above ``static_bytes`` during a step (on CPU: see ``activation_source``)."""
    activation_source: str = ""
    host_copy_bytes: int | None = None
    """CPU: bytes this arm's saved-tensor pack hook allocated in the profiled step (its host copies),
    measured the same way for every arm; 0 for arms without a pack hook; None on a GPU."""
    rss_bytes: int | None = None
    """Process RSS after this strategy's steps (whole process; informational)."""
    engine: EngineStats | None = None
    correctness: Correctness | None = None
    loss: float | None = None
    trace: dict[str, Any] | None = None
    """``bench.trace_summary.summarize`` of one extra profiled step (``--trace``); None when not traced."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def median_s(self) -> float:
        return self.times.median_s

    @property
    def tokens_per_s(self) -> float | None:
        if not self.ok or not self.times.n or self.median_s <= 0:
            return None
        return self.tokens_per_step / self.median_s

    @property
    def achieved_tflops(self) -> float | None:
        """Model FLOPs (no recompute counted) per second: the useful work rate."""
        if not self.ok or not self.times.n or self.median_s <= 0:
            return None
        return self.flops_per_step / self.median_s / 1e12

    @property
    def host_bytes(self) -> int | None:
        """Host bytes this arm's copies took, measured outside the engine: on CPU ``host_copy_bytes``
        (every arm alike); on a GPU ours from the pinned allocator's stats (None for the peers)."""
        if self.host_copy_bytes is not None:
            return self.host_copy_bytes
        return self.engine.host_bytes_measured if self.engine else None


@dataclass
class Ceiling:
    """The copy-bandwidth ceiling achieved numbers are judged against (from ``bench.probe``)."""

    kind: str
    """``"pinned"`` on a GPU; ``"memcpy"`` on CPU (pinned memory does not exist there)."""
    d2h_gb_s: float | None
    h2d_gb_s: float | None
    size_bytes: int
    note: str = ""


@dataclass
class BenchResult:
    """Everything one ``python -m bench`` invocation measured."""

    meta: dict[str, Any]
    workload: dict[str, Any]
    ceiling: Ceiling | None
    strategies: list[StrategyResult]
    targets: list[dict[str, Any]] = field(default_factory=list)

    def get(self, name: str) -> StrategyResult | None:
        for s in self.strategies:
            if s.name == name:
                return s
        return None

    def _times(self, name: str, clock: str) -> list[float] | None:
        s = self.get(name)
        if not s or not s.ok:
            return None
        xs = s.times.cpu_seconds if clock == "cpu" else s.times.seconds
        return xs or None

    def paired_ratios(self, name: str, base: str, clock: str = "wall") -> list[float] | None:
        """Per-round step-time ratios ``name / base`` of an interleaved run (None otherwise).

        ``clock``: ``"wall"`` (perf_counter) or ``"cpu"`` (process CPU time).
        """
        a, b = self._times(name, clock), self._times(base, clock)
        if a is None or b is None or self.meta.get("order") != "interleaved" or len(a) != len(b):
            return None
        return [x / y for x, y in zip(a, b)]

    def time_ratio(self, name: str, base: str, clock: str = "wall") -> float | None:
        """Step time of ``name`` relative to ``base`` (None if either did not run).

        Interleaved runs (one step of each strategy per round) give the median of the per-round
        ratios: pairing steps taken seconds apart cancels the load drift of a shared machine.
        Sequential runs give the ratio of the medians.
        """
        paired = self.paired_ratios(name, base, clock)
        if paired is not None:
            return statistics.median(paired)
        a, b = self._times(name, clock), self._times(base, clock)
        if a is None or b is None:
            return None
        return statistics.median(a) / statistics.median(b)

    def time_ratio_ci(self, name: str, base: str, clock: str = "wall",
                      conf: float = 0.95) -> tuple[float, float] | None:
        """A ``conf`` confidence interval of :meth:`time_ratio` (:func:`median_ci` of the paired
        ratios; sequential runs: the ratio of the two medians' intervals, wider)."""
        paired = self.paired_ratios(name, base, clock)
        if paired is not None:
            return median_ci(paired, conf)
        a, b = self._times(name, clock), self._times(base, clock)
        if a is None or b is None:
            return None
        ca, cb = median_ci(a, conf), median_ci(b, conf)
        if ca is None or cb is None or cb[0] <= 0:
            return None
        return ca[0] / cb[1], ca[1] / cb[0]

    def activation_ratio(self, name: str, base: str) -> float | None:
        """Activation bytes of ``name`` / activation bytes of ``base``."""
        a, b = self.get(name), self.get(base)
        if not a or not b or a.activation_bytes is None or not b.activation_bytes:
            return None
        return a.activation_bytes / b.activation_bytes


