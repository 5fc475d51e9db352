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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import OffloadError
from .cost import OFFLOADING, CostModel, build_cost_model, measure_hardware
from .install import Installed, install
from .meter import measure_step
from .profile import StepProfile, profile_step, run_step, zero_grads_
from .solve import Choice, min_peak, solve

__all__ = ["Plan", "plan", "find_blocks"]

log = logging.getLogger("offload.planner")


def _fmt(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def find_blocks(model: nn.Module, blocks: Sequence[str | nn.Module] | None = None) -> list[tuple[str, nn.Module]]:
    """Candidate blocks as (FQN, module): the given ones, or the children of the largest ModuleList."""
    names = {id(m): n for n, m in model.named_modules()}
    if blocks is None:
        lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
        if not lists:
            raise ValueError(
                f"offload.plan: {type(model).__name__} has no nn.ModuleList, so there are no default "
                "candidate blocks; pass blocks=[...] (module names or modules)."
            )
        prefix, ml = max(lists, key=lambda nm: len(nm[1]))
        return [(f"{prefix}.{i}" if prefix else str(i), m) for i, m in enumerate(ml)]
    modules = dict(model.named_modules())
    out = []
    for b in blocks:
        if isinstance(b, str):
            if b not in modules:
                raise ValueError(f"offload.plan: blocks names {b!r}, which is not a submodule of the model.")
            out.append((b, modules[b]))
        elif isinstance(b, nn.Module) and id(b) in names:
            out.append((names[id(b)], b))
        else:
            raise ValueError(f"offload.plan: blocks entry {b!r} is not a submodule (or its name) of the model.")
    if not out:
        raise ValueError("offload.plan: blocks=[] names no candidate block.")
    if len({id(m) for _, m in out}) != len(out):
        raise ValueError("offload.plan: blocks lists the same module twice.")
    return out


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

    # -- applying ---------------------------------------------------------------

    def apply(self, model: nn.Module) -> Installed:
        """Install the decisions on ``model``; returns the handle (``.remove()``, ``.engine``).

        The engine is attached: each candidate block's forward enters the
        plan's ``OffloadActivations`` itself (see ``offload.planner.install``),
        so the training loop needs no ``with`` block; backward runs outside it.
        Call ``handle.remove()`` before applying another plan.
        """
        from ..engine import OffloadActivations

        blocks = find_blocks(model, list(self.decisions))
        engine = OffloadActivations(device=_engine_device(self.device), model=model, **self.engine_kwargs)
        return install(blocks, self.decisions, engine)

    def measure(self, model: nn.Module, step: Callable[[], torch.Tensor], *, warmup: int = 1,
                timed: int = 3) -> tuple[int, float]:
        """Apply, run ``warmup`` + 1 tracked + ``timed`` steps, remove; record and return (peak, seconds)."""
        handle = self.apply(model)
        try:
            m = measure_step(lambda: run_step(step), device=self.device, model=model,
                             pools=[handle.engine.pool], warmup=warmup, timed=timed,
                             before_each=lambda: zero_grads_(model))
        finally:
            handle.remove()
        self.measured_peak_bytes, self.measured_step_seconds = m.peak_bytes, m.step_seconds
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
                "module": b.name, "decision": d, "saved_bytes": b.saved_bytes, "retained_bytes": o.retained,
                "recompute_s": o.recompute_s, "copy_bytes": o.copy_bytes, "copy_s": o.copy_s,
                "exposed_s": o.exposed_s, "copy": copy, "seconds": o.seconds,
            })
        return rows

    def report(self) -> str:
        """Per module: decision, saved bytes, recompute cost, copy cost, hidden or exposed; totals."""
        hw = self.cost.hardware
        lines = [
            f"offload plan: budget {_fmt(self.budget_bytes)} ({self.budget_bytes} B), solver {self.solver}, "
            f"device {self.device}",
            f"link: D2H {hw.d2h_gb_s:.1f} GB/s, H2D {hw.h2d_gb_s:.1f} GB/s ({hw.source}); copies "
            + ("synchronous: their time is exposed" if hw.synchronous else "on side streams: hidden behind the next block's compute when they fit"),
            f"{'module':<24} {'decision':<18} {'saved':>11} {'retained':>11} {'recompute':>10} {'copy':>11} "
            f"{'copy time':>10} {'exposed':>10}  copy",
        ]
        for r in self._rows():
            lines.append(
                f"{r['module']:<24} {r['decision']:<18} {_fmt(r['saved_bytes']):>11} {_fmt(r['retained_bytes']):>11} "
                f"{r['recompute_s'] * 1e3:>8.2f}ms {_fmt(r['copy_bytes']):>11} {r['copy_s'] * 1e3:>8.2f}ms "
                f"{r['exposed_s'] * 1e3:>8.2f}ms  {r['copy']}"
            )
        meas_p = "not measured" if self.measured_peak_bytes is None else (
            f"measured {_fmt(self.measured_peak_bytes)} "
            f"({100 * (self.predicted_peak_bytes / self.measured_peak_bytes - 1):+.1f}% predicted vs measured)")
        meas_t = "not measured" if self.measured_step_seconds is None else (
            f"measured {self.measured_step_seconds * 1e3:.1f} ms "
            f"({100 * (self.predicted_step_seconds / self.measured_step_seconds - 1):+.1f}%)")
        lines += [
            f"peak: predicted {_fmt(self.predicted_peak_bytes)} at {self.binding}; {meas_p}",
            f"step: predicted {self.predicted_step_seconds * 1e3:.1f} ms; {meas_t}",
            f"without a plan: peak {_fmt(self.unplanned_peak_bytes)}, step {self.unplanned_step_seconds * 1e3:.1f} ms; "
            f"smallest reachable peak {_fmt(self.min_peak_bytes)}",
        ]
        return "\n".join(lines)

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
            "solver": self.solver,
            "device": self.device,
            "hardware": {"d2h_gb_s": hw.d2h_gb_s, "h2d_gb_s": hw.h2d_gb_s, "synchronous": hw.synchronous,
                         "source": hw.source},
            "base_bytes": self.cost.base,
            "modules": self._rows(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def _engine_device(device: str) -> str | None:
    return "cpu" if torch.device(device).type == "cpu" else device


def _choices(cost: CostModel, *, offloading: bool = True) -> list[list[Choice]]:
    """Solver input; with ``offloading`` every option's backward is charged the prefetch bytes."""
    ahead = cost.prefetch_bytes if offloading else 0
    out = []
    for b in cost.blocks:
        opts = []
        for d, o in b.options.items():
            if d in OFFLOADING and not offloading:
                continue
            event = max(o.fwd_event, o.bwd_event + ahead, o.head_event)
            opts.append(Choice(d, o.retained, event, o.seconds))
        out.append(opts)
    return out


def _best(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return a if (a.seconds, a.peak) <= (b.seconds, b.peak) else b


def _infeasible(budget: int, cost: CostModel, lowest: Any, model: nn.Module) -> OffloadError:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # Gradients of trainable parameters exist during the step (profiling keeps them allocated).
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    smallest = cost.base + lowest.peak
    biggest = max(cost.blocks, key=lambda b: min(o.event for o in b.options.values()))
    b_min = min(biggest.options.values(), key=lambda o: o.event)
    where = cost.where(list(lowest.decisions))
    return OffloadError(
        f"offload.plan: budget_bytes={budget} ({_fmt(budget)}) cannot be met: the smallest peak any plan "
        f"reaches is {smallest} B ({_fmt(smallest)}), at the {where}. What holds it: parameters "
        f"{_fmt(params)}, gradients {_fmt(grads)}, step base (params, grads, buffers, inputs) {_fmt(cost.base)}; "
        f"the largest single block is {biggest.name}, which needs {_fmt(b_min.event)} above the base even as "
        f"{b_min.decision!r}. Raise budget_bytes to at least {smallest}, or shrink the step "
        "(batch, sequence length), or pass blocks=[...] with finer modules."
    )


def plan(
    model: nn.Module,
    step: Callable[[], torch.Tensor],
    budget_bytes: int,
    device: torch.device | str | None = None,
    *,
    blocks: Sequence[str | nn.Module] | None = None,
    warmup: int = 1,
    timed: int = 3,
    min_offload_size: int = 1024,
    use_streams: bool = True,
    bandwidth_gb_s: tuple[float, float] | float | None = None,
    solver: str = "auto",
    engine_kwargs: dict[str, Any] | None = None,
) -> Plan:
    """Profile ``step``, then choose per block the fastest decisions whose predicted peak fits ``budget_bytes``.

    Args:
        model: the model ``step`` runs (its candidate blocks get decisions).
        step: zero-argument callable: one forward, returns the scalar loss.
        budget_bytes: the peak device memory the step may reach (parameters,
            gradients and everything else: what ``torch.cuda.max_memory_allocated``
            reports; on CPU what ``MemTracker`` counts, host buffers left out).
        device: where the model lives; None = the device of its parameters.
        blocks: candidate modules (names or modules); default the children of
            the model's largest ``nn.ModuleList``.
        warmup / timed: steps run before the tracked step / timed per decision.
        min_offload_size, use_streams, engine_kwargs: passed to the plan's
            ``OffloadActivations``.
        bandwidth_gb_s: (D2H, H2D) GB/s, or one number; None = measured with
            a 64 MB copy once per process (pinned on a GPU).
        solver: "auto" (exact Pareto DP, greedy fallback), "exact", "greedy", "brute_force".

    Raises:
        OffloadError: no plan's predicted peak fits ``budget_bytes`` (the
            message names the smallest reachable peak and what holds it).
    """
    from ..engine import OffloadActivations

    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"offload.plan: budget_bytes={budget_bytes!r} must be a positive int (bytes of device memory).")
    if not callable(step):
        raise TypeError(f"offload.plan: step must be a zero-argument callable returning the loss, got {type(step).__name__}.")
    dev = torch.device(device) if device is not None else _model_device(model)
    ekw = dict(engine_kwargs or {})
    ekw.setdefault("min_offload_size", min_offload_size)
    ekw.setdefault("use_streams", use_streams)
    synchronous = dev.type == "cpu" or not ekw["use_streams"]
    if synchronous:
        # Synchronous copies gain nothing from loading ahead, and a prefetch reaches
        # across blocks (into the previous offloaded block), which no per-block cost has.
        ekw.setdefault("prefetch_bytes", 0)
    cand = find_blocks(model, blocks)
    names = [n for n, _ in cand]
    had_none = [p for p in model.parameters() if p.grad is None]
    try:
        unplanned = measure_step(lambda: run_step(step), device=dev, model=model, warmup=warmup, timed=timed,
                                 before_each=lambda: zero_grads_(model))
        def make_engine() -> OffloadActivations:
            return OffloadActivations(device=_engine_device(str(dev)), model=model, **ekw)

        inst = install(cand, {n: "keep" for n in names}, make_engine())
        try:
            by_dec = profile_step(inst, step, model, dev, make_engine=make_engine, warmup=warmup, timed=timed)
        finally:
            inst.remove()
    finally:
        for p in had_none:
            p.grad = None
    prof = StepProfile(names=names, device=str(dev), by_decision=by_dec, unplanned_peak=unplanned.peak_bytes,
                       unplanned_step_s=unplanned.step_seconds, synchronous_copies=synchronous)
    hw = measure_hardware(dev, synchronous, bandwidth_gb_s)
    cost = build_cost_model(prof, hw, ekw)
    return plan_from_cost(cost, budget_bytes, model=model, device=str(dev), unplanned_peak=unplanned.peak_bytes,
                          unplanned_s=unplanned.step_seconds, solver=solver)


def plan_from_cost(cost: CostModel, budget_bytes: int, *, model: nn.Module, device: str, unplanned_peak: int,
                   unplanned_s: float, solver: str = "auto") -> Plan:
    """Solve an already built cost model for ``budget_bytes`` (the bench re-solves one profile per budget).

    With a prefetch charge (streams), plans that offload and plans that do not
    are solved separately and the faster feasible one wins, which keeps the
    solve exact although the charge depends on the whole plan.
    """
    choices = _choices(cost)
    plain = _choices(cost, offloading=False) if cost.prefetch_bytes else None
    lowest = min_peak(choices)
    if plain is not None:
        low2 = min_peak(plain)
        lowest = low2 if (low2.peak, low2.seconds) < (lowest.peak, lowest.seconds) else lowest
    keep = ["keep"] * len(cost.blocks)
    if budget_bytes >= unplanned_peak:
        decisions, method = keep, "none needed (budget >= peak without a plan)"
    else:
        if cost.base + lowest.peak > budget_bytes:
            raise _infeasible(budget_bytes, cost, lowest, model)
        sol = solve(choices, budget_bytes - cost.base, method=solver)
        if plain is not None:
            sol = _best(sol, solve(plain, budget_bytes - cost.base, method=solver))
        if sol is None:  # greedy found nothing: fall back to the minimum-peak plan, which fits
            sol = lowest
        decisions, method = list(sol.decisions), sol.solver
    dec = dict(zip(cost.names, decisions))
    return Plan(
        decisions=dec, budget_bytes=budget_bytes, predicted_peak_bytes=cost.peak(dec),
        predicted_step_seconds=cost.seconds(dec), cost=cost, unplanned_peak_bytes=unplanned_peak,
        unplanned_step_seconds=unplanned_s, min_peak_bytes=cost.base + lowest.peak, solver=method,
        binding=cost.where(dec), device=device, engine_kwargs=dict(cost.engine_kwargs),
    )
