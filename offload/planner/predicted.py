"""Planning for a GPU this machine does not have: ``offload.plan(model, step, budget_bytes=..., target="h100-sxm")``.

NOTE [ Planning on a target ]
1. Nothing is measured here. The planner profiles one step per decision kind, every candidate block
   under that decision (``profile``), but each step is a capture (``offload.predict``: the real engine
   and the real model, on fake tensors; the model's parameters and buffers are swapped for fake ones
   while it runs and put back untouched, NOTE [ Capture ] item 7).
2. Memory: the planner's ``Probe`` reads its levels and window peaks from the program-order replay of
   what the capture has recorded so far (``_TraceMeter``), the replay ``predict_step``'s peak comes
   from; so the profile's levels and the verification's peak are one model.
3. Time: the probe's boundary marks are events recorded on the running stream; the trace is replayed
   on the target's clock (``offload.predict.simulate``) and a block's forward and backward seconds are
   the time between its marks on the compute stream (as the real profiler's device events). The
   copy bandwidths the cost model charges are the target's (``GPUSpec.d2h_bytes_per_s`` / ``h2d``).
4. The solver and its tie-break are the planner's. The plan's verification is a prediction:
   ``predict_step`` with the plan on the target, whose peak must be within the budget (else the
   solver's cap drops by the overshoot, as for a measured plan).
5. The step planned for is forward and backward, gradients set to None between steps, with the user's
   optimizer when ``optimizer=`` is given (every capture steps a twin of it: its state and its step are in
   every profile and in the verification, NOTE [ Optimizer in the budget ] item 4; without one, no
   optimizer state), on the target's usable memory (``GPUSpec.usable_bytes``; a budget share is a share of it).
6. A block that updates running statistics in training (BatchNorm) is never recomputed: its buffers
   are fake here, so the measured planner's check by value cannot run; the rule is by module type.
7. The budget is the target's to meet: one above its usable memory is refused. When the cost model finds
   no plan within the budget, its lowest-peak plan is verified by ``predict_step`` before refusing: the
   model's window peaks are bounds (loose for BatchNorm blocks under offload), so that plan may fit; a
   refusal then advises that plan's predicted peak, never a budget below the one refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..engine import OffloadActivations
from ..errors import OffloadError
from ..predict._capture import NEVER, Captured, capture, fake_parameters, settled
from .._format import format_bytes
from ..predict._memory import Replay
from ..predict._mixed import check_mixed_precision
from ..predict._predict import Prediction, _prediction
from ..predict._strategies import Applied
from ..predict._timeline import Clock, TimelineResult, simulate
from ..predict._trace import RecordEvent, Trace
from ..predict.gpus import GPUSpec, resolve_gpu
from ..sizes import to_budget
from .blocks import find_blocks
from .cost import Hardware, build_cost_model
from .host import TIER_SETTINGS, tier_bytes
from .install import DECISIONS, RECOMPUTE, caching_off, install, profile_recomputes
from .optimizer import OptimizerLike, adamw_memory, optimizer_memory, twin_factory, with_optimizer
from .choose import refusal_hint
from .planning import Plan, _solve, plan_from_cost
from .settings import engine_settings
from .profile import DecisionProfile, StepProfile, tracked

__all__ = ["plan_on_target"]

log = logging.getLogger("offload.planner")


class _TraceMeter:
    """The planner's memory meter on a running capture (NOTE [ Planning on a target ] rule 2)."""

    def __init__(self, cap: Any) -> None:
        self.cap = cap
        self.replay = Replay()
        self.seen = 0
        self.peak = 0
        self._window_peak = 0

    def _catch_up(self) -> int:
        raw = self.cap.raw
        while self.seen < len(raw):
            item = settled(raw[self.seen])
            self.seen += 1
            if item is not None:
                self.replay.feed(item)
                self._window_peak = max(self._window_peak, self.replay.memory.in_use_bytes)
        self.peak = max(self.peak, self._window_peak)
        return self.replay.memory.in_use_bytes

    def level(self) -> int:
        return self._catch_up()

    def window(self) -> int:
        """Peak since the last call; starts a new window."""
        level = self._catch_up()
        w, self._window_peak = self._window_peak, level
        return max(w, level)

    def tracking(self, model: nn.Module | None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(self)


class _TraceClock:
    """The probe's clock on a capture: ``now()`` records a mark on the running stream; times are read
    once the trace is replayed on the target (``resolve``)."""

    def __init__(self, cap: Any) -> None:
        self.cap = cap
        self._next = -1  # negative: never an emulated event's id
        self.times: dict[int, float] = {}

    def now(self) -> int:
        eid, self._next = self._next, self._next - 1
        self.cap.emit(RecordEvent(self.cap.current_stream(), eid))
        return eid

    def seconds(self, a: int | None, b: int | None) -> float:
        if a is None or b is None or a not in self.times or b not in self.times:
            return 0.0
        return max(0.0, self.times[b] - self.times[a])

    def resolve(self, trace: Trace, timeline: TimelineResult) -> None:
        self.times = {it.event: timeline.item_end_seconds(i) for i, it in enumerate(trace.items)
                      if type(it) is RecordEvent and it.event < 0}


def _capture_real(model: nn.Module, step: Callable[[], torch.Tensor], strategy: Any, spec: GPUSpec,
                  measured: Callable[[Any], Any] | None = None, optimizer: Any = None,
                  mixed_precision: torch.dtype | None = None) -> Captured:
    """Capture ``step`` of the real ``model`` on fake tensors (NOTE [ Capture ] item 7), the engine's polls
    answered by ``spec``'s modelled device (item 6); ``optimizer``: a factory stepped after backward;
    ``mixed_precision`` as in ``predict_step``."""
    with contextlib.ExitStack() as stack:
        return capture(lambda: stack.enter_context(fake_parameters(model)), lambda _m: step(), strategy=strategy,
                       fake=True, lag=NEVER, real_inputs=True, measured=measured, clock=Clock(spec),
                       optimizer=optimizer, mixed_precision=mixed_precision)


def _predict(model: nn.Module, step: Callable[[], torch.Tensor], strategy: Any, spec: GPUSpec,
             optimizer: Any = None, mixed_precision: torch.dtype | None = None) -> Prediction:
    t0 = time.perf_counter()
    cap = _capture_real(model, step, strategy, spec, optimizer=optimizer, mixed_precision=mixed_precision)
    return _prediction(cap, spec, strategy, optimizer, None, time.perf_counter() - t0,
                       mixed_precision=mixed_precision)


def _profile(model: nn.Module, step: Callable[[], torch.Tensor], cand: list[tuple[str, nn.Module]], decision: str,
             spec: GPUSpec, ekw: dict[str, Any], optimizer: Any = None,
             mixed_precision: torch.dtype | None = None) -> DecisionProfile:
    """One decision kind on every candidate, predicted (NOTE [ Planning on a target ] rules 1-3)."""
    names = [n for n, _ in cand]
    got: dict[str, Any] = {}

    def strategy(m: nn.Module) -> Applied:
        # Profiled without host bounds (they decide what stays, which the plan decides), as measured.
        engine = OffloadActivations(device="cpu", model=m, virtual_memory_safe_pct=None,
                                    **{k: v for k, v in ekw.items() if k not in TIER_SETTINGS})
        got["inst"] = inst = install(cand, dict.fromkeys(names, decision), engine)
        return Applied(engine, [inst.remove])

    @contextlib.contextmanager
    def measured(cap: Any) -> Iterator[None]:
        clock = _TraceClock(cap)
        with tracked(got["inst"], model, names, decision, _TraceMeter(cap), clock) as out:
            yield
        got["out"], got["clock"] = out, clock

    cap = _capture_real(model, step, strategy, spec, measured, optimizer, mixed_precision)
    timeline = simulate(cap.trace, spec)
    got["clock"].resolve(cap.trace, timeline)
    prof = got["out"].profile
    fwd, bwd, _ = got["out"].probe.times()
    for s, f, b in zip(prof.blocks, fwd, bwd):
        s.fwd_s, s.bwd_s, s.fwd_s_all, s.bwd_s_all = f, b, [f], [b]
    prof.step_s = timeline.step_seconds
    prof.step_s_all = [prof.step_s]
    return prof


def _updates_running_stats(mod: nn.Module) -> str | None:
    """Why ``mod`` is never recomputed on a target (NOTE [ Planning on a target ] rule 6), or None."""
    for name, m in mod.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats:
            return (f"its module {name or '<itself>'} ({type(m).__name__}) updates running statistics in "
                    "training; a recompute would update them twice")
    return None


def target_budget(budget_bytes: Any, spec: GPUSpec) -> int:
    """A budget in bytes; a share (``"80%"``, 0.8) is a share of the target's usable memory. A budget above the
    usable memory is refused: a plan within it need not fit the card."""
    value = to_budget(budget_bytes, "budget_bytes", owner="offload.plan")
    if isinstance(value, int) and value > spec.usable_bytes:
        raise ValueError(
            f"offload.plan: budget_bytes={budget_bytes!r} ({format_bytes(value)}) is above {spec.name}'s usable memory "
            f"({format_bytes(spec.usable_bytes)}: {format_bytes(spec.memory_bytes)} less a reserve of "
            f"{format_bytes(spec.reserve_bytes)}), so a plan within it need not fit the card. Pass at most "
            f"{spec.usable_bytes} bytes, or a share of the card ('100%').")
    return value if isinstance(value, int) else max(1, int(value * spec.usable_bytes))


def _lowest_verified(cost: Any, budget: int, check: Callable[[Plan], int], model: nn.Module, unplanned: Prediction,
                     solver: str, spec: GPUSpec, allowed: tuple[str, ...]) -> Plan:
    """When the cost model finds no plan within ``budget``: the cost model's lowest-peak plan and the plans taking
    one ``allowed`` decision for every block, each verified by ``predict_step``; the fastest (by the cost model)
    whose predicted peak is within the budget, else an ``OffloadError`` advising the lowest predicted peak, never
    a budget below the one refused (NOTE [ Planning on a target ] rule 7)."""
    kw = dict(model=model, device="cuda", unplanned_peak=unplanned.peak_bytes, unplanned_s=unplanned.step_seconds,
              solver=solver)
    lowest = _solve(cost, _solve(cost, spec.usable_bytes, 0, **kw).min_peak_bytes, 0, **kw)
    no_recompute = getattr(cost, "no_recompute", {})
    tries = [lowest] + [_with_decisions(cost, lowest, {b.name: "offload" if d in RECOMPUTE and b.name in no_recompute
                                                       else d for b in cost.blocks}) for d in allowed if d != "keep"]
    peaks = [(check(p), p) for p in tries]
    fitting = [(cost.seconds(p.decisions), peak, p) for peak, p in peaks if peak <= budget]
    if fitting:
        _s, peak, p = min(fitting, key=lambda t: t[:2])
        return dataclasses.replace(p, budget_bytes=budget, solver=(
            f"{lowest.solver}; the cost model's bounds found none within the budget, predict_step on {spec.name} "
            f"puts this plan at {format_bytes(peak)}"))
    peak, p = min(peaks, key=lambda t: t[0])
    raise OffloadError(
        f"offload.plan: budget_bytes={budget} ({format_bytes(budget)}) cannot be met on {spec.name}: the plan with the "
        f"smallest peak ({p.decisions}) is predicted at {peak} B ({format_bytes(peak)}) by predict_step, at the "
        f"{p.binding} by the cost model (its bound: {format_bytes(p.predicted_peak_bytes)}). Raise "
        f"budget_bytes to at least {peak}, or {refusal_hint(cost, p.binding)}. "
        f"(PREDICTED for target={spec.name!r}: {spec.describe()})")


def _with_decisions(cost: Any, like: Plan, decisions: dict[str, str]) -> Plan:
    """``like`` with other ``decisions``, its cost-model figures recomputed for them."""
    return dataclasses.replace(like, decisions=decisions, predicted_peak_bytes=cost.peak(decisions),
                               predicted_step_seconds=cost.seconds(decisions), binding=cost.where(decisions),
                               host_tiers=tier_bytes(cost, decisions))


def plan_on_target(model: nn.Module, step: Callable[[], torch.Tensor], budget_bytes: Any, target: str | GPUSpec, *,
                   blocks: Any = None, min_offload_size: Any = 1024, use_streams: bool = True, solver: str = "auto",
                   engine_kwargs: dict[str, Any] | None = None, verify: bool = True,
                   host_budget_bytes: Any = None, optimizer: OptimizerLike = None,
                   mixed_precision: torch.dtype | None = None) -> Plan:
    """``offload.plan`` for ``target`` (a ``GPUS`` name or a ``GPUSpec``), predicted: see NOTE [ Planning on
    a target ]. The arguments are :func:`offload.plan`'s."""
    spec = resolve_gpu(target)
    budget = target_budget(budget_bytes, spec)
    mixed_precision = check_mixed_precision(mixed_precision, None)
    cand = find_blocks(model, blocks)
    # The plan's engine runs on the target's accelerator: side streams unless use_streams=False.
    ekw = engine_settings(engine_kwargs, host_budget_bytes, min_offload_size, use_streams, torch.device("cuda"))
    no_recompute = {n: why for n, m in cand if (why := _updates_running_stats(m)) is not None}
    # The target's optimizer runs in every capture (NOTE [ Optimizer in the budget ] item 4).
    device = torch.device("cuda")
    factory = twin_factory(optimizer, model, device.type) if optimizer is not None else None
    opt = (optimizer_memory(optimizer, model, device, profiled=True) if optimizer is not None
           else adamw_memory(model, device))
    undo = caching_off(model, "while planning")
    try:
        unplanned = _predict(model, step, "none", spec, factory, mixed_precision)
        decisions = tuple(d for d in DECISIONS if not (d in RECOMPUTE and len(no_recompute) == len(cand)))
        by_dec = profile_recomputes(lambda d: _profile(model, step, cand, d, spec, ekw, factory, mixed_precision),
                                    decisions, [n for n, _ in cand], no_recompute)
        prof = StepProfile(names=[n for n, _ in cand], device=f"{spec.name} (predicted)", by_decision=by_dec,
                           unplanned_peak=unplanned.peak_bytes, unplanned_step_s=unplanned.step_seconds,
                           synchronous_copies=not ekw["use_streams"])
        hw = Hardware(spec.d2h_bytes_per_s / 1e9, spec.h2d_bytes_per_s / 1e9, not ekw["use_streams"],
                      f"predicted for {spec.describe()}")
        cost = with_optimizer(build_cost_model(prof, hw, ekw), opt)
        cost.no_recompute = no_recompute
        verified: dict[str, Prediction] = {}

        def check(p: Plan) -> int:
            verified["p"] = _predict(model, step, p, spec, factory, mixed_precision)
            return verified["p"].peak_bytes

        try:
            p = plan_from_cost(cost, budget, model=model, device="cuda", unplanned_peak=unplanned.peak_bytes,
                               unplanned_s=unplanned.step_seconds, solver=solver, check=check if verify else None,
                               checked_by=f"predict_step on {spec.name}")
        except OffloadError as e:
            if not verify:
                raise OffloadError(f"{e} (PREDICTED for target={spec.name!r}: {spec.describe()})") from None
            p = _lowest_verified(cost, budget, check, model, unplanned, solver, spec, decisions)
    finally:
        undo()
    # "none needed" (all keep): the step without a plan is the prediction that verifies it.
    pred = verified.get("p", unplanned if p.solver.startswith("none needed") else None)
    return dataclasses.replace(p, target=spec, verified_peak_bytes=pred.peak_bytes if pred else None,
                               verified_step_seconds=pred.step_seconds if pred else None)
