"""torch's module-wise auto-AC ILP as an arm of ``python -m bench --plan``.

The pipeline is torch's own (``torch.distributed._tools``), fed by one profile
of the planner's step:

1. ``ModuleMemoryStats`` (MemTracker) gives every module's memory, and
   ``collect_sac_stats`` runs torch's ``SACEstimator`` over the forward to get
   each non-leaf module's selective-AC trade-off (operators, their output
   bytes and times) and fits it with ``pwlf``; ``ilp_module_info(sac=...)``
   turns both into torch's ``ModuleInfo`` (``profiling/module_stats.py``).
   On CPU the operators are timed with a CPU clock (torch's two estimators
   need CUDA; see ``offload.profiling._torch_private.CpuOpTimer``); on CUDA torch's
   "operator-level-benchmark" times them.
2. For each budget, ``sac_ilp.sac_milp(parse_module_info(info), budget_gib)``
   (``pulp``/CBC) chooses AC units and, per unit, the fraction of its
   activation memory to discard (``ac_decisions``), minimising recompute time
   under its own peak-memory model (parameters + gradients + activations at
   module boundaries); its bound on that peak is the point's prediction.
3. What the output means is applied as torch intends it: for each unit,
   ``sac_ilp.get_optimal_checkpointing_policy_per_module(stats, 1 - discard)``
   picks which of its operators to save; the unit's forward then runs under
   non-reentrant ``torch.utils.checkpoint`` with a selective policy that saves
   exactly those operators (by their index in the forward, as SACEstimator
   counted them) and recomputes the rest. ``apply_ilp`` returns a handle whose
   ``remove()`` restores the model; ``check()`` verifies every unit ran the
   operator count the policy was made for.

The arm's points are measured by the same ``measure`` callable as every other
arm of the frontier (``bench/plan.py``). The ILP needs ``pulp`` and ``pwlf``
(``pip install offload[ilp]``); without them the arm is skipped and the import
error is recorded.
"""

from __future__ import annotations

import copy
import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ILP_ARM", "IlpPoint", "IlpProfile", "IlpInfeasible", "profile_for_ilp", "solve", "op_policies",
           "apply_ilp", "AppliedIlp", "run_ilp_arm"]

ILP_ARM = "torch_ilp"
"""The arm's name in tables and JSON."""
_GiB = float(1 << 30)


@dataclass
class IlpPoint:
    """One budget of the ILP arm: torch's decisions, its predicted peak, and what was measured."""

    fraction: float
    budget_bytes: int
    decisions: dict[str, float] = field(default_factory=dict)
    """``sac_milp``'s ``ac_decisions``: AC unit fqn -> fraction of its activation memory discarded."""
    saved_ops: dict[str, str] = field(default_factory=dict)
    """Per unit, "saved/total" operators of the per-module policy applied."""
    predicted_peak_bytes: int | None = None
    """``sac_milp``'s upper bound on the peak (its memory model, not the meter's)."""
    predicted_recompute_ms: float | None = None
    """``sac_milp``'s objective: recompute time it expects, from the profiled operator times."""
    measured_peak_bytes: int | None = None
    measured_step_s: float | None = None
    status: str = "ok"
    reason: str = ""

    @property
    def peak_error(self) -> float | None:
        if not self.measured_peak_bytes or self.predicted_peak_bytes is None:
            return None
        return self.predicted_peak_bytes / self.measured_peak_bytes - 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak_error": self.peak_error}


@dataclass
class IlpProfile:
    """One profile of the step, as torch's ILP reads it."""

    module_info: dict[str, Any]
    """torch's ``ModuleInfo`` with the selective-AC fields filled."""
    sac: Any
    """torch's ``SACEstimator`` after the trade-off fit (per-module operator statistics)."""
    sac_mode: str
    baseline_peak_bytes: int
    """``ilp_utils.get_peak_memory_runtime_baseline``: torch's model of the no-AC peak."""
    candidates: list[str]
    """Modules the ILP may checkpoint (non-leaf, with SAC statistics)."""
    untimed_ops: dict[str, int]
    seconds: float


class _ILPLog(logging.Handler):
    """Collects what ``sac_ilp`` logs (its only report of an infeasible or failed solve)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _capture(logger_name: str) -> tuple[logging.Logger, _ILPLog, bool]:
    log = logging.getLogger(logger_name)
    h = _ILPLog()
    log.addHandler(h)
    propagate, log.propagate = log.propagate, False
    return log, h, propagate


def profile_for_ilp(model: nn.Module, forward: Callable[[], Any], train_step: Callable[[], None], *,
                    timing_steps: int = 1) -> IlpProfile:
    """Profile ``train_step()`` (memory, module times) and ``forward()`` (SAC statistics) for torch's ILP."""
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline, parse_module_info

    from offload.profiling import ModuleMemoryStats, collect_sac_stats
    from offload.profiling._torch_private import CpuOpTimer, sac_estimator_timer

    t0 = time.perf_counter()
    train_step()  # warm-up: gradients exist, as in every measured step
    stats = ModuleMemoryStats(model)
    with stats:
        train_step()
    stats.measure_times(train_step, timing_steps)
    sac = collect_sac_stats(model, forward)
    timer = sac_estimator_timer(sac)
    info = stats.ilp_module_info(sac=sac)
    baseline, _ = get_peak_memory_runtime_baseline(parse_module_info(copy.deepcopy(info)))
    return IlpProfile(
        module_info=info, sac=sac,
        sac_mode="cpu-benchmark" if isinstance(timer, CpuOpTimer) else "operator-level-benchmark",
        baseline_peak_bytes=int(baseline),
        candidates=[m["fqn"] for m in info["mod_stats"] if not m["is_leaf"]],
        untimed_ops=dict(timer.untimed) if isinstance(timer, CpuOpTimer) else {},
        seconds=time.perf_counter() - t0)


class IlpInfeasible(Exception):
    """``sac_milp`` found no solution; the message is what it reported."""


def solve(profile: IlpProfile, budget_bytes: int) -> tuple[dict[str, float], float, int]:
    """torch's ``sac_milp`` at ``budget_bytes``: (ac_decisions, recompute ms, peak bound in bytes)."""
    from torch.distributed._tools.ilp_utils import parse_module_info
    from torch.distributed._tools.sac_ilp import sac_milp

    graph = parse_module_info(copy.deepcopy(profile.module_info))  # parse/solve mutate the dict
    log, h, propagate = _capture("torch.distributed._tools.sac_ilp")
    try:
        decisions, recompute_ms, peak = sac_milp(graph, budget_bytes / _GiB)
    finally:
        log.removeHandler(h)
        log.propagate = propagate
    if peak == -1:
        said = "; ".join(h.lines) or "no message"
        raise IlpInfeasible(
            f"torch's sac_milp found no plan at budget_bytes={budget_bytes} ({budget_bytes / 2**20:.2f} MiB): "
            f"{said}. Its model of this step puts the no-AC peak at "
            f"{profile.baseline_peak_bytes / 2**20:.2f} MiB; raise the budget to get a plan")
    return dict(decisions), float(recompute_ms), int(peak)


def op_policies(profile: IlpProfile, decisions: dict[str, float]) -> dict[str, list[int]]:
    """Per AC unit, torch's per-operator save (1) / recompute (0) choice for ``1 - discard`` of its memory."""
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

    out = {}
    log, h, propagate = _capture("torch.distributed._tools.sac_ilp")
    try:
        for fqn, discard in decisions.items():
            stats = profile.sac.sac_mod_stats[fqn]
            ops = get_optimal_checkpointing_policy_per_module(stats, min(1.0, max(0.0, 1.0 - discard)))
            if len(ops) != len(stats.func_names):
                raise RuntimeError(
                    f"torch ILP arm: the per-operator ILP for {fqn} (keep {1 - discard:.4f} of its memory) "
                    f"returned {len(ops)} decisions for {len(stats.func_names)} operators: "
                    f"{'; '.join(h.lines) or 'no message'}")
            out[fqn] = ops
    finally:
        log.removeHandler(h)
        log.propagate = propagate
    return out


class _IndexPolicy:
    """Selective-checkpoint policy: the i-th counted operator of the unit's forward is saved iff ``ops[i]``.

    Operators SACEstimator does not count (``OPS_TO_ALWAYS_SKIP``) are recomputed
    and not counted, so indices line up with ``SACStats.func_names``. torch
    calls the policy in the forward only (the recompute replays its choices).
    """

    def __init__(self, fqn: str, ops: list[int]) -> None:
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP

        self.fqn, self.ops, self.count = fqn, ops, 0
        self._skip = OPS_TO_ALWAYS_SKIP

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy

        if func in self._skip:
            return CheckpointPolicy.MUST_RECOMPUTE
        i, self.count = self.count, self.count + 1
        if i >= len(self.ops):
            raise RuntimeError(
                f"torch ILP arm: {self.fqn} ran more operators ({i + 1}) than SACEstimator counted "
                f"({len(self.ops)}) when the policy was made; its forward differs between the profile and "
                "this run (data-dependent control flow?), so the per-operator policy does not apply")
        return CheckpointPolicy.PREFER_SAVE if self.ops[i] else CheckpointPolicy.MUST_RECOMPUTE


class AppliedIlp:
    """ILP decisions installed on a model: ``remove()`` restores it, ``check()`` verifies operator counts."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._last: dict[str, _IndexPolicy] = {}
        self._expected: dict[str, int] = {}

    def check(self) -> None:
        """Raise if a unit has not run, or ran a different number of operators than its policy covers."""
        for fqn, n in self._expected.items():
            p = self._last.get(fqn)
            got = None if p is None else p.count
            if got != n:
                raise RuntimeError(f"torch ILP arm: {fqn} ran {got} counted operators in its last forward, its "
                                   f"policy covers {n}; the per-operator policy did not apply as made")

    def remove(self) -> None:
        for u in reversed(self._undo):
            u()
        self._undo.clear()


def apply_ilp(model: nn.Module, policies: dict[str, list[int]]) -> AppliedIlp:
    """Run each unit of ``policies`` (fqn as ``offload.modules.module_name`` spells it) under selective AC.

    The unit's ``forward`` is replaced on the instance (no wrapper module, so
    names and hooks stay as they were) by non-reentrant checkpointing of the
    original forward with an :class:`_IndexPolicy`.
    """
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from offload.modules import module_name, register_model

    register_model(model)
    by_name = {module_name(m): m for m in model.modules()}
    missing = sorted(set(policies) - set(by_name))
    if missing:
        raise ValueError(f"apply_ilp: policies name modules not in the model: {missing}; "
                         f"known: {sorted(by_name)[:8]}...")
    handle = AppliedIlp()
    for fqn, ops in policies.items():
        mod = by_name[fqn]
        orig = mod.forward
        handle._expected[fqn] = len(ops)

        def context_fn(_fqn: str = fqn, _ops: list[int] = ops) -> Any:
            pol = _IndexPolicy(_fqn, _ops)
            handle._last[_fqn] = pol
            return create_selective_checkpoint_contexts(pol)

        def forward(*args: Any, _orig: Callable = orig, _cf: Callable = context_fn, **kwargs: Any) -> Any:
            return checkpoint(_orig, *args, use_reentrant=False, context_fn=_cf, **kwargs)

        mod.forward = forward  # type: ignore[method-assign]
        handle._undo.append(lambda m=mod: delattr(m, "forward"))
    return handle


def run_ilp_arm(model: nn.Module, forward: Callable[[], torch.Tensor], budgets: list[tuple[float, int]],
                measure: Callable[[Callable[[], None]], Any], before_each: Callable[[], None],
                say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The ILP arm at each ``(fraction, budget_bytes)``; ``measure(run)`` is the frontier's own meter.

    ``forward()`` is the planner's step (forward and loss). Returns the arm's
    JSON section: ``status``/``reason`` for the arm as a whole (``skipped``
    when pulp or pwlf is missing, with the import error), the profile's
    summary, and one point per budget.
    """
    def train() -> None:
        before_each()
        forward().backward()

    res: dict[str, Any] = {"name": ILP_ARM, "status": "ok", "reason": "", "points": []}
    try:
        importlib.import_module("torch.distributed._tools.sac_ilp")  # imports pulp
        importlib.import_module("pwlf")
    except ImportError as e:
        res.update(status="skipped", reason=f"{type(e).__name__}: {e} (pip install offload[ilp])")
        return res
    say(f"[plan] {ILP_ARM}: profiling for torch's ILP (MemTracker + SACEstimator)")
    try:
        prof = profile_for_ilp(model, forward, train)
    except Exception as e:  # the arm must not take the frontier down
        res.update(status="error", reason=f"{type(e).__name__}: {e}")
        return res
    res.update(sac_mode=prof.sac_mode, baseline_peak_bytes=prof.baseline_peak_bytes,
               candidates=prof.candidates, untimed_ops=prof.untimed_ops, profile_seconds=prof.seconds)
    for fraction, budget in budgets:
        pt = IlpPoint(fraction=fraction, budget_bytes=budget)
        try:
            decisions, pt.predicted_recompute_ms, pt.predicted_peak_bytes = solve(prof, budget)
        except IlpInfeasible as e:
            pt.status, pt.reason = "infeasible", str(e)
            res["points"].append(pt.to_dict())
            continue
        pt.decisions = decisions
        say(f"[plan] {ILP_ARM} budget {fraction:.2f}: measuring {decisions}")
        handle = None
        try:
            policies = op_policies(prof, decisions)
            pt.saved_ops = {k: f"{sum(v)}/{len(v)}" for k, v in policies.items()}
            handle = apply_ilp(model, policies)
            m = measure(lambda: forward().backward())
            handle.check()
            pt.measured_peak_bytes, pt.measured_step_s = m.peak_bytes, m.step_seconds
        except Exception as e:
            pt.status, pt.reason = "error", f"{type(e).__name__}: {e}"
        finally:
            if handle is not None:
                handle.remove()
        res["points"].append(pt.to_dict())
    return res
