"""``offload.plan``: profile one step, choose keep / offload / recompute per block, apply, prove.

    plan = offload.plan(model, step, budget_bytes=...)
    handle = plan.apply(model)     # attaches the engine to the blocks; no `with` needed
    ...train...                    # forward + backward as usual
    handle.remove()                # the model is exactly as before
    print(plan.report())

``step`` is a zero-argument callable that runs one forward and returns the
scalar loss; the planner runs backward itself. Profiling runs the step
``(1 + warmup + timed)`` times per decision plus once without a plan; it
zeroes existing gradients in place before every run (so a loop's gradients
are overwritten: plan before training) and sets back to None the gradients
that were None when it started.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._format import format_bytes
from ..config import size_setting
from ..errors import OffloadError
from ..sizes import SizeLike, to_budget
from .blocks import find_blocks
from .choose import choose
from .cost import NO_BACKWARD, CostModel, build_cost_model, measure_hardware, widest_spread
from .host import TIER_SETTINGS, tier_bytes
from .install import DECISIONS, RECOMPUTE, Installed, caching_off, install, profile_recomputes
from .meter import StepMeasurement, measure_step
from .optimizer import OptimizerLike, adamw_memory, charged_bytes, check_optimizer, optimizer_memory, with_optimizer
from .settings import engine_settings, synchronous
from .profile import StepProfile, profile_step, run_step, work_key, zero_grads_

__all__ = ["Plan", "plan", "find_blocks", "plan_steps"]

log = logging.getLogger("offload.planner")


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


@dataclass
class Plan:
    """A per-block decision and its predicted (and, once measured, measured) cost.

    Attributes:
        decisions: ``{block FQN: "keep" | "offload" | "recompute" | "recompute_offload"}``.
        budget_bytes: the budget it was made for.
        predicted_peak_bytes: predicted peak device memory of one step.
        predicted_step_seconds: predicted seconds of one step.
        measured_peak_bytes / measured_step_seconds: set by :meth:`measure`.
    """

    decisions: dict[str, str]
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_step_seconds: float
    cost: CostModel = field(repr=False)
    unplanned_peak_bytes: int = 0
    unplanned_step_seconds: float = 0.0
    min_peak_bytes: int = 0
    solver: str = ""
    binding: str = ""
    """Where the predicted peak happens."""
    device: str = "cpu"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    measured_peak_bytes: int | None = None
    measured_step_seconds: float | None = None
    measured_step_seconds_all: list[float] = field(default_factory=list)
    host_tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per offloading block: bytes per host tier its copies land in (``offload.planner.host``)."""
    target: Any = None
    """The ``GPUSpec`` a plan made with ``target=`` is PREDICTED for (None: profiled on this machine)."""
    verified_peak_bytes: int | None = None
    """A target plan: the peak ``predict_step`` predicts for the whole planned step on ``target``."""
    verified_step_seconds: float | None = None
    """A target plan: the step time ``predict_step`` predicts for it on ``target``."""

    # -- applying ---------------------------------------------------------------

    def apply(self, model: nn.Module) -> Installed:
        """Install the decisions on ``model``; returns the handle (``.remove()``, ``.engine``).

        The engine is attached: each candidate block's forward enters the
        plan's ``OffloadActivations`` itself (see ``offload.planner.install``),
        so the training loop needs no ``with`` block; backward runs outside it.
        Call ``handle.remove()`` before applying another plan.
        """
        from ..engine import OffloadActivations

        no_recompute = self.cost.no_recompute if self.cost is not None else {}
        bad = {n: no_recompute[n] for n, d in self.decisions.items() if d in RECOMPUTE and n in no_recompute}
        if bad:
            n, why = next(iter(bad.items()))
            raise ValueError(
                f"offload.plan: decisions[{n!r}]={self.decisions[n]!r}, but {n} is never recomputed: {why}. "
                "Use 'keep' or 'offload' for it."
            )
        blocks = find_blocks(model, list(self.decisions))
        engine = OffloadActivations(device=_engine_device(self.device), model=model, **self.engine_kwargs)
        return install(blocks, self.decisions, engine, model)

    def measure(self, model: nn.Module, step: Callable[[], torch.Tensor], *, warmup: int = 1,
                timed: int = 3) -> tuple[int, float | None]:
        """Apply, run ``warmup`` + 1 tracked + ``timed`` steps, remove; record and return (peak, median
        seconds; None when ``timed=0``). The peak adds the optimizer state the plan charged because it was not
        allocated when planned (``cost.optimizer.charged_bytes``, NOTE [ Optimizer in the budget ] item 4): the
        peak of a training step with it, as the budget is meant."""
        _nonneg_int("warmup", warmup)
        _nonneg_int("timed", timed)
        handle = self.apply(model)
        try:
            # Every host tier's buffers are host memory (the disk tier stages its writes in its own pool).
            m = measure_step(lambda: run_step(step), device=self.device, model=model,
                             pools=[handle.engine.pool, handle.engine.tiers], warmup=warmup, timed=timed,
                             before_each=lambda: zero_grads_(model))
        finally:
            handle.remove()
        self.measured_peak_bytes = m.peak_bytes + charged_bytes(self.cost)
        if m.step_seconds is not None:
            self.measured_step_seconds, self.measured_step_seconds_all = m.step_seconds, m.step_seconds_all
        return m.peak_bytes, m.step_seconds

    # -- reporting --------------------------------------------------------------

    def _rows(self) -> list[dict[str, Any]]:
        rows = []
        for b in self.cost.blocks:
            d = self.decisions[b.name]
            o = b.options[d]
            if o.copy_bytes == 0:
                copy = "-"
            elif self.cost.hardware.synchronous:
                copy = "exposed (synchronous)"
            else:
                copy = "hidden" if o.exposed_s <= 1e-3 * max(o.copy_s, 1e-12) else (
                    "exposed" if o.exposed_s >= o.copy_s else "partly hidden")
            rows.append({
                "module": b.name, "call": b.call, "decision": d, "saved_bytes": b.saved_bytes,
                "retained_bytes": o.retained, "recompute_s": o.recompute_s, "copy_bytes": o.copy_bytes,
                "copy_s": o.copy_s, "exposed_s": o.exposed_s, "copy": copy, "seconds": o.seconds,
                "forward_s": _spread(b.options["keep"].fwd_s_all if "keep" in b.options else o.fwd_s_all),
                "backward_s": _spread(o.bwd_s_all),
            })
        return rows

    def report(self) -> str:
        """Per module: decision, saved bytes, recompute cost, copy cost, hidden or exposed; totals."""
        hw = self.cost.hardware
        where = (f"PREDICTED for {self.target.describe()}, not measured" if self.target is not None
                 else f"device {self.device}")
        opt = self.cost.optimizer
        lines = [
            *([opt.describe()] if opt is not None else []),  # first: issue 45 (a budget silently without it)
            f"offload plan: budget {format_bytes(self.budget_bytes)} ({self.budget_bytes} B), solver {self.solver}, "
            f"{where}",
            f"link: D2H {hw.d2h_gb_s:.1f} GB/s, H2D {hw.h2d_gb_s:.1f} GB/s ({hw.source}); copies "
            + ("synchronous: their time is exposed" if hw.synchronous else "on side streams: hidden behind the next block's compute when they fit"),
            f"{'module':<24} {'decision':<18} {'saved':>11} {'retained':>11} {'recompute':>10} {'copy':>11} "
            f"{'copy time':>10} {'exposed':>10}  copy",
        ]
        for r in self._rows():
            lines.append(
                f"{_label(r):<24} {r['decision']:<18} {format_bytes(r['saved_bytes']):>11} {format_bytes(r['retained_bytes']):>11} "
                f"{r['recompute_s'] * 1e3:>8.2f}ms {format_bytes(r['copy_bytes']):>11} {r['copy_s'] * 1e3:>8.2f}ms "
                f"{r['exposed_s'] * 1e3:>8.2f}ms  {r['copy']}"
            )
        meas_p = "not measured" if self.measured_peak_bytes is None else (
            f"measured {format_bytes(self.measured_peak_bytes)} "
            f"({100 * (self.predicted_peak_bytes / self.measured_peak_bytes - 1):+.1f}% predicted vs measured)")
        meas_t = "not timed" if not self.measured_step_seconds else (
            f"measured {self.measured_step_seconds * 1e3:.1f} ms "
            f"({100 * (self.predicted_step_seconds / self.measured_step_seconds - 1):+.1f}%)")
        if self.target is not None:
            meas_p = ("whole step not predicted" if self.verified_peak_bytes is None else
                      f"whole step predicted by predict_step {format_bytes(self.verified_peak_bytes)}")
            meas_t = ("" if self.verified_step_seconds is None else
                      f"whole step predicted by predict_step {self.verified_step_seconds * 1e3:.1f} ms")
        lines += [
            f"peak: predicted {format_bytes(self.predicted_peak_bytes)} at {self.binding}; {meas_p}",
            f"step: predicted {self.predicted_step_seconds * 1e3:.1f} ms; {meas_t}",
            f"without a plan: peak {format_bytes(self.unplanned_peak_bytes)}, step {self.unplanned_step_seconds * 1e3:.1f} ms "
            f"({'predicted' if self.target is not None else 'measured'}); smallest peak any plan reaches: "
            f"{format_bytes(self.min_peak_bytes)} (predicted)",
        ]
        lines += self._legend()
        if self.host_tiers:  # issue 25: which host tier each offloading block's copies land in
            lines.append("host tiers: " + "; ".join(
                f"{n}: " + ", ".join(f"{t} {format_bytes(b)}" for t, b in row.items()) for n, row in self.host_tiers.items()))
        for name, why in (self.cost.no_recompute if self.cost is not None else {}).items():
            lines.append(f"never recomputed: {name} ({why})")
        if self.cost is not None and self.cost.keep_only:  # frozen lower layers: not refused, not decided
            lines.append(f"keep, nothing to decide: {', '.join(self.cost.keep_only)} ({NO_BACKWARD})")
        return "\n".join(lines)

    def _legend(self) -> list[str]:
        """What each figure of the report is (issue 31: a figure that does not say what it is misleads)."""
        hw, cost = self.cost.hardware, self.cost
        exposed = ("with synchronous copies all of the copy time plus the engine's per-copy overhead "
                   f"({cost.copy_overhead_s * 1e3:.2f} ms a copy, the offload profile's slowdown beyond bytes / "
                   "bandwidth), so it can exceed the copy time" if hw.synchronous else
                   "the part of the copy time the next block's compute does not hide")
        return [
            "columns: saved = bytes the block saves for backward when kept; retained = bytes it holds on the "
            "device from its forward to its backward under its decision; recompute = seconds its forward "
            "re-runs in backward; copy = bytes copied to the host and back; copy time = those bytes over the "
            f"link (D2H + H2D); exposed = seconds the copies add to the step: {exposed}",
            ("times are the target's predicted timeline (offload.predict.simulate), one step per decision; "
             if self.target is not None else "times are medians of the timed steps; ")
            + f"plans predicted within {cost.noise_s * 1e3:.2f} ms (the noise "
            f"band: the widest spread of the timed steps{widest_spread(cost.step_s_by_decision)}, at least 2% of the step) "
            "are equally fast, and the fewest non-keep decisions, "
            "then the cheaper decision (keep, offload, recompute, recompute_offload) at the earliest block, "
            "decide",
        ]

    def to_dict(self) -> dict[str, Any]:
        hw = self.cost.hardware
        return {
            "budget_bytes": self.budget_bytes,
            "decisions": dict(self.decisions),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_seconds": self.predicted_step_seconds,
            "measured_peak_bytes": self.measured_peak_bytes,
            "measured_step_seconds": self.measured_step_seconds,
            "unplanned_peak_bytes": self.unplanned_peak_bytes,
            "unplanned_step_seconds": self.unplanned_step_seconds,
            "min_peak_bytes": self.min_peak_bytes,
            "binding": self.binding,
            "host_tiers": {n: dict(r) for n, r in self.host_tiers.items()},
            "solver": self.solver,
            "device": self.device,
            "target": None if self.target is None else {"kind": "predicted", "gpu": self.target.name,
                                                        "gpu_spec": self.target.describe()},
            "verified_peak_bytes": self.verified_peak_bytes,
            "verified_step_seconds": self.verified_step_seconds,
            "hardware": {"d2h_gb_s": hw.d2h_gb_s, "h2d_gb_s": hw.h2d_gb_s, "synchronous": hw.synchronous,
                         "source": hw.source},
            "base_bytes": self.cost.base,
            "measured_step_seconds_spread": _spread(self.measured_step_seconds_all),
            "rest_seconds": self.cost.rest_s,
            "noise_seconds": self.cost.noise_s,
            "profile_step_seconds": {d: _spread(xs) for d, xs in self.cost.step_s_by_decision.items()},
            "never_recomputed": dict(self.cost.no_recompute),
            "keep_only": dict(self.cost.keep_only),
            "optimizer": self.cost.optimizer.to_dict() if self.cost.optimizer is not None else None,
            "modules": self._rows(),
        }

    def to_json(self) -> str:
        """Strict JSON (no NaN or Infinity: a value that is not a finite number is null)."""
        return json.dumps(_finite(self.to_dict()), indent=1, allow_nan=False)


def _label(row: dict[str, Any]) -> str:
    return row["module"] + (f" (call {row['call'] + 1})" if row["call"] else "")


def _spread(xs: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and count of timed samples (the timing's noise, for ``to_json``)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _engine_device(device: str) -> str | None:
    return "cpu" if torch.device(device).type == "cpu" else device


def plan(
    model: nn.Module,
    step: Callable[[], torch.Tensor],
    budget_bytes: SizeLike,
    device: torch.device | str | None = None,
    *,
    blocks: Sequence[str | nn.Module] | None = None,
    warmup: int = 1,
    timed: int = 3,
    min_offload_size: SizeLike = 1024,
    use_streams: bool = True,
    bandwidth_gb_s: tuple[float, float] | float | None = None,
    solver: str = "auto",
    engine_kwargs: dict[str, Any] | None = None,
    verify: bool = True,
    host_budget_bytes: SizeLike | None = None,
    optimizer: OptimizerLike = None,
) -> Plan:
    """Profile ``step``, then choose per block the fastest decisions whose predicted peak fits ``budget_bytes``.

    Args:
        model: the model ``step`` runs (its candidate blocks get decisions).
        step: zero-argument callable: one forward, returns the scalar loss.
        budget_bytes: the peak device memory the step may reach (parameters,
            gradients and everything else: what ``torch.cuda.max_memory_allocated``
            reports; on CPU what ``MemTracker`` counts, host buffers left out):
            bytes in any form of NOTE [ Sizes ] (``2e9``, ``"16GiB"``, ``"4.1GB"``), or a share of the
            device's total memory (host RAM on CPU): ``"80%"`` or a float in (0, 1] such as 0.8.
        device: where the model lives; None = the device of its parameters.
        blocks: candidate modules (names or modules); default the children of
            the model's largest ``nn.ModuleList``.
        warmup: steps run before the tracked step.
        timed: steps timed per decision.
        min_offload_size: passed to the plan's ``OffloadActivations`` (a size, NOTE [ Sizes ]).
        use_streams: passed to the plan's ``OffloadActivations``.
        engine_kwargs: more ``OffloadActivations`` settings for the plan's engine.
        bandwidth_gb_s: (D2H, H2D) GB/s, or one number; None = measured once per process (64 MB, pinned on a GPU).
        solver: "auto" (exact Pareto DP, greedy fallback), "exact", "greedy", "brute_force".
        host_budget_bytes: the engine's pool budget the plan may assume (with any other host tier
            in ``engine_kwargs``: ``pageable_budget_bytes``, ``disk_dir``...); the plan never offloads
            more than the tiers hold, and ``Plan.host_tiers`` says where each block's copies land.
        verify: measure the chosen plan (one tracked step) and, if its measured peak is over the
            budget, solve again with that overshoot as a margin (see :func:`plan_from_cost`).
        optimizer: the loop's optimizer (an Optimizer, a list, or a factory ``params -> Optimizer``): its state and
            step are in the budget (NOTE [ Optimizer in the budget ]); None: ``report()`` says what an AdamW adds.

    Side effects: none. Parameters, gradients, buffers (BatchNorm running stats...) and the CPU and
    device RNG states are bit-identical after ``plan()`` to before it. Hugging Face models have
    ``config.use_cache`` off while profiling (a recompute would append to the KV cache twice).

    Raises:
        OffloadError: no plan fits ``budget_bytes`` (the message names the smallest reachable peak and what holds it).
    """
    dev = _check_args(model, step, budget_bytes, device, warmup=warmup, timed=timed,
                      min_offload_size=min_offload_size, use_streams=use_streams, bandwidth_gb_s=bandwidth_gb_s,
                      solver=solver, engine_kwargs=engine_kwargs, verify=verify, optimizer=optimizer)
    budget_bytes = budget_on_device("offload.plan", "budget_bytes", budget_bytes, dev)
    ekw = engine_settings(engine_kwargs, host_budget_bytes, min_offload_size, use_streams, dev)
    return _plan_checked(model, step, find_blocks(model, blocks), budget_bytes, dev, ekw, warmup=warmup, timed=timed,
                         bandwidth_gb_s=bandwidth_gb_s, solver=solver, verify=verify, optimizer=optimizer)


def plan_steps(warmup: int = 1, timed: int = 3) -> int:
    """How many training steps ``plan(warmup=, timed=)`` runs: ``1 + warmup + timed`` without a plan and
    per decision (one of them tracked by the memory meter), and ``max(1, warmup) + 1`` to measure the
    chosen plan (more, up to three times, when a measured peak is over the budget)."""
    return (1 + warmup + timed) * (1 + len(DECISIONS)) + max(1, warmup) + 1


def _plan_checked(model: nn.Module, step: Callable[[], torch.Tensor], cand: list[tuple[str, nn.Module]],
                  budget_bytes: int, dev: torch.device, ekw: dict[str, Any], *, warmup: int, timed: int,
                  bandwidth_gb_s: tuple[float, float] | float | None, solver: str, verify: bool,
                  optimizer: OptimizerLike = None) -> Plan:
    """:func:`plan` once its arguments are checked: derive the optimizer's memory, measure the step without
    a plan, profile the candidates, solve (and verify), all of it with the model's state put back afterwards."""
    opt = optimizer_memory(optimizer, model, dev) if optimizer is not None else adamw_memory(model, dev)
    with _Preserved(model, dev) as kept:
        unplanned = measure_step(lambda: run_step(step), device=dev, model=model, warmup=warmup, timed=timed,
                                 before_each=lambda: zero_grads_(model))
        cost = _cost_model(model, step, cand, dev, ekw, kept.mutated(cand), unplanned, warmup=warmup, timed=timed,
                           bandwidth_gb_s=bandwidth_gb_s)
        with_optimizer(cost, opt)
        return plan_from_cost(cost, budget_bytes, model=model, device=str(dev),
                              unplanned_peak=max(unplanned.peak_bytes + opt.charged_bytes,
                                                 cost.base + opt.step_event_bytes),
                              unplanned_s=unplanned.step_seconds,
                              solver=solver, step=step if verify else None, warmup=max(1, warmup))


def _cost_model(model: nn.Module, step: Callable[[], torch.Tensor], cand: list[tuple[str, nn.Module]],
                dev: torch.device, ekw: dict[str, Any], no_recompute: dict[str, str], unplanned: StepMeasurement,
                *, warmup: int, timed: int, bandwidth_gb_s: tuple[float, float] | float | None) -> CostModel:
    """Profile every decision of every candidate and build the cost model the solver reads;
    ``no_recompute``: the candidates never recomputed, and why."""
    from ..engine import OffloadActivations

    names = [n for n, _ in cand]
    sync_copies = synchronous(dev, ekw)

    def make_engine() -> OffloadActivations:
        # Profiled without host bounds (they decide what stays, which the plan decides).
        return OffloadActivations(device=_engine_device(str(dev)), model=model,
                                  **{k: v for k, v in ekw.items() if k not in TIER_SETTINGS})

    inst = install(cand, {n: "keep" for n in names}, make_engine())
    try:
        by_dec = profile_recomputes(
            lambda d: profile_step(inst, step, model, dev, make_engine=make_engine, warmup=warmup, timed=timed,
                                   decisions=(d,))[d],
            [d for d in DECISIONS if not (no_recompute and d in RECOMPUTE and len(no_recompute) == len(names))],
            names, no_recompute)
    finally:
        inst.remove()
    prof = StepProfile(names=names, device=str(dev), by_decision=by_dec, unplanned_peak=unplanned.peak_bytes,
                       unplanned_step_s=unplanned.step_seconds, synchronous_copies=sync_copies,
                       work=[work_key(m) for _, m in cand])
    cost = build_cost_model(prof, measure_hardware(dev, sync_copies, bandwidth_gb_s), ekw)
    cost.no_recompute = no_recompute
    for n, why in no_recompute.items():
        log.info("offload.plan: %s is never recomputed: %s", n, why)
    for n in cost.keep_only:
        log.info("offload.plan: %s is kept, nothing to decide: %s", n, NO_BACKWARD)
    return cost


class _Preserved:
    """Everything ``plan()`` may change, put back bit for bit on exit: gradients (values, and None where
    they were None), buffers (BatchNorm running stats, counters), the CPU and device RNG states, and a
    Hugging Face model's ``config.use_cache``. Copies of gradients and buffers are kept on the host, so
    planning costs no device memory for them."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device

    def __enter__(self) -> "_Preserved":
        m = self.model
        self.grads = [(p, None if p.grad is None else p.grad.detach().to("cpu", copy=True)) for p in m.parameters()]
        self.buffers = {id(b): (b, b.detach().to("cpu", copy=True)) for b in m.buffers()}
        self.cpu_rng = torch.get_rng_state()
        self.dev_rng = None
        if self.device.type != "cpu":
            mod = torch.get_device_module(self.device.type)
            self.dev_rng = mod.get_rng_state(self.device)
        self.undo_cache = caching_off(m, "while planning")
        return self

    def mutated(self, cand: list[tuple[str, nn.Module]]) -> dict[str, str]:
        """Candidates whose forward changed one of their buffers in the steps run so far (BatchNorm's
        running stats): recomputing them would update the buffers twice per step."""
        out = {}
        for name, mod in cand:
            changed = [f"{name}.{n}" for n, b in mod.named_buffers()
                       if id(b) in self.buffers and not torch.equal(b.detach().cpu(), self.buffers[id(b)][1])]
            if changed:
                out[name] = (f"its forward updates buffer(s) {', '.join(changed[:3])}"
                             f"{' ...' if len(changed) > 3 else ''}; a recompute would update them twice")
        return out

    def __exit__(self, *exc: Any) -> None:
        self.undo_cache()
        with torch.no_grad():
            for p, g in self.grads:
                if g is None:
                    p.grad = None
                elif p.grad is not None and p.grad.shape == g.shape:
                    p.grad.copy_(g)
                else:
                    p.grad = g.to(p.device)
            for _, (b, saved) in self.buffers.items():
                b.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.dev_rng is not None:
            torch.get_device_module(self.device.type).set_rng_state(self.dev_rng, self.device)


def plan_from_cost(cost: CostModel, budget_bytes: SizeLike, *, model: nn.Module | None, device: str,
                   unplanned_peak: int, unplanned_s: float, solver: str = "auto",
                   step: Callable[[], torch.Tensor] | None = None, warmup: int = 1, rounds: int = 3,
                   check: Callable[[Plan], int] | None = None, checked_by: str = "measured") -> Plan:
    """Solve an already built cost model for ``budget_bytes`` (the bench re-solves one profile per budget).

    The promise, checked here on every plan returned: every peak the cost model knows (each block's
    forward and backward windows, the stem, the head and loss, the end of backward, the prefetch
    charge) is at most ``budget_bytes``; otherwise :class:`OffloadError` names the smallest reachable
    peak, which is the peak of a real plan (``min_peak_bytes``), and what holds it.

    With ``step`` (what :func:`plan` passes), the plan is also measured: one tracked step after
    ``warmup``. A measured peak over the budget (the cost model's assumptions do not hold for these
    candidates, e.g. modules finer than residual blocks whose savings interact) lowers the solver's cap
    by the overshoot and solves again, up to ``rounds`` times; then :class:`OffloadError`. The returned
    plan's ``measured_peak_bytes`` is then set and within the budget. ``budget_bytes`` takes what
    :func:`plan`'s does. ``check(plan) -> peak`` replaces the measurement (a target plan's peak is
    predicted: NOTE [ Planning on a target ]); ``checked_by`` says how in errors.
    """
    _check_solver(solver)
    budget_bytes = budget_on_device("offload.plan_from_cost", "budget_bytes", budget_bytes, torch.device(device))
    margin = 0
    tried: list[str] = []
    for _ in range(rounds + 1):
        p = _solve(cost, budget_bytes, margin, model=model, device=device, unplanned_peak=unplanned_peak,
                   unplanned_s=unplanned_s, solver=solver, tried=tried)
        if (check is None and (step is None or model is None)) or p.solver.startswith("none needed"):
            return p
        peak = check(p) if check is not None else p.measure(model, step, warmup=warmup, timed=0)[0]
        if peak <= budget_bytes:
            return p
        tried.append(f"{format_bytes(p.predicted_peak_bytes)} predicted, {format_bytes(peak)} {checked_by}")
        log.info("offload.plan: %s %s %d B > budget_bytes=%d (predicted %d B); solving again with a "
                 "margin", p.decisions, checked_by, peak, budget_bytes, p.predicted_peak_bytes)
        margin = max(margin + peak - budget_bytes, peak - p.predicted_peak_bytes)
    raise OffloadError(
        f"offload.plan: budget_bytes={budget_bytes} ({format_bytes(budget_bytes)}) was not met by a plan ({checked_by}) in "
        f"{rounds + 1} tries ({'; '.join(tried)}): the cost model does not describe these candidate blocks "
        "well. Pass blocks=[...] naming whole residual blocks (the children of the model's layer list), or "
        "raise budget_bytes."
    )


def _solve(cost: CostModel, budget_bytes: int, margin: int, *, model: nn.Module | None, device: str,
           unplanned_peak: int, unplanned_s: float, solver: str, tried: Sequence[str] = ()) -> Plan:
    dec, method, min_peak_bytes = choose(cost, budget_bytes, margin, model=model, unplanned_peak=unplanned_peak,
                                         solver=solver, tried=tried)
    return Plan(
        decisions=dec, budget_bytes=budget_bytes, predicted_peak_bytes=cost.peak(dec),
        predicted_step_seconds=cost.seconds(dec), cost=cost, unplanned_peak_bytes=unplanned_peak,
        unplanned_step_seconds=unplanned_s, min_peak_bytes=min_peak_bytes,
        solver=method + (f", margin {margin} B after measuring" if margin else ""),
        binding=cost.where(dec), device=device, engine_kwargs=dict(cost.engine_kwargs),
        host_tiers=tier_bytes(cost, dec),
    )


_SOLVERS = ("auto", "exact", "greedy", "brute_force")


def _nonneg_int(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"offload.plan: {name}={v!r} must be an int >= 0.")


def budget_on_device(owner: str, name: str, budget: Any, device: torch.device | None, *,
                     shares_only: bool = False) -> int:
    """A budget (NOTE [ Sizes ], rule 4) in bytes: a size as given, a share of the device's total memory
    (host RAM on CPU); with ``device=None`` only checks ``budget`` (returns 0 for a share)."""
    value = to_budget(budget, name, owner=owner, shares_only=shares_only)
    if isinstance(value, int):
        return value
    if device is None:
        return 0
    if device.type == "cpu":
        import psutil

        total = psutil.virtual_memory().total
    else:
        total = torch.get_device_module(device.type).get_device_properties(device).total_memory
    return max(1, int(value * total))


def _check_args(model: Any, step: Any, budget_bytes: Any, device: Any, *, warmup: Any, timed: Any,
                min_offload_size: Any, use_streams: Any, bandwidth_gb_s: Any, solver: Any, engine_kwargs: Any,
                verify: Any, optimizer: Any = None) -> torch.device:
    """Every argument of :func:`plan`, checked before anything runs; returns the device."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload.plan: model must be an nn.Module, got model={model!r} ({type(model).__name__}).")
    if not callable(step):
        raise TypeError(f"offload.plan: step must be a zero-argument callable returning the loss, got "
                        f"step={step!r} ({type(step).__name__}).")
    budget_on_device("offload.plan", "budget_bytes", budget_bytes, None)  # checked; a share resolved later
    _nonneg_int("warmup", warmup)
    _nonneg_int("timed", timed)
    size_setting("min_offload_size", min_offload_size, owner="offload.plan")
    for name, v in (("use_streams", use_streams), ("verify", verify)):
        if not isinstance(v, bool):
            raise TypeError(f"offload.plan: {name}={v!r} must be True or False.")
    if bandwidth_gb_s is not None:
        vals = bandwidth_gb_s if isinstance(bandwidth_gb_s, (tuple, list)) else (bandwidth_gb_s,)
        if (len(vals) not in (1, 2) or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in vals)
                or not all(math.isfinite(x) and x > 0 for x in vals)):
            raise ValueError(f"offload.plan: bandwidth_gb_s={bandwidth_gb_s!r} must be a finite positive number "
                             "of GB/s, or a (D2H, H2D) pair of them, or None to measure it.")
    _check_solver(solver)
    if engine_kwargs is not None and not isinstance(engine_kwargs, dict):
        raise TypeError(f"offload.plan: engine_kwargs={engine_kwargs!r} must be a dict of OffloadActivations "
                        "settings.")
    check_optimizer("offload.plan", optimizer)
    if device is None:
        return _model_device(model)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"offload.plan: device={device!r} is not a device ({e}).") from None
    if dev.type != "cpu":
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if acc is None or acc.type != dev.type:
            raise ValueError(
                f"offload.plan: device={device!r} is not available here (accelerator: "
                f"{acc.type if acc is not None else 'none'}); pass the device the model lives on, or None."
            )
    return dev


def _check_solver(solver: Any) -> None:
    if solver not in _SOLVERS:
        raise ValueError(f"offload.plan: solver={solver!r} is not one of {_SOLVERS}.")
