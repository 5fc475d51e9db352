"""Plan on a trainer's first training step, apply, re-plan when the sequence grows (both callbacks).

The callbacks hand :class:`StepPlanner` the trainer's own step (HF: ``Trainer.compute_loss`` on the
batch; Lightning: ``training_step``) and the trainer's own optimizer (HF: ``Trainer.optimizer``, created
before training starts; Lightning: ``trainer.optimizers``), whose state and step are part of the budget
(NOTE [ Optimizer in the budget ]), before the step runs for real. On the first step it calls
``offload.plan`` with that step, applies the plan, and logs when planning starts (with the number
of steps it runs) and the decisions with the predicted vs measured peak (``plan()`` measures the
plan it returns), both at WARNING on a logger under the trainer's own, which its default logging
shows (the decisions with predicted and measured peak also at INFO on ``offload.integrations``). A later batch whose sequence length (the
second dimension of its largest tensor) exceeds the planned one is planned again (the memory of a
step grows with it); shorter or equal batches keep the plan. Batch size growth is treated the same.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..config import check_keywords
from ..errors import OffloadError
from .._format import format_bytes
from ..planner import Plan, plan, plan_steps
from ..planner.planning import budget_on_device
from ..planner.install import Installed
from ..sizes import SizeLike

__all__ = ["StepPlanner", "resolve_budget", "batch_shape", "PLAN_KEYWORDS"]

log = logging.getLogger("offload.integrations")

PLAN_KEYWORDS = tuple(n for n in inspect.signature(plan).parameters if n not in ("model", "step", "budget_bytes"))
"""The ``offload.plan`` keywords ``plan_kwargs`` may hold (the callback passes the model, step and budget)."""


def resolve_budget(owner: str, budget_bytes: Any, budget: Any, device: torch.device | None) -> int:
    """``budget_bytes`` (a size or a share, NOTE [ Sizes ]) or ``budget`` (a share: "80%" or 0.8) in
    bytes on ``device`` (host RAM on CPU); ``device=None`` only checks them."""
    if (budget_bytes is None) == (budget is None):
        raise ValueError(f"{owner}: pass exactly one of budget_bytes=<size> or budget='<percent>%' "
                         f"(got budget_bytes={budget_bytes!r}, budget={budget!r}).")
    if budget_bytes is not None:
        return budget_on_device(owner, "budget_bytes", budget_bytes, device)
    return budget_on_device(owner, "budget", budget, device, shares_only=True)


def batch_shape(batch: Any) -> tuple[int, int]:
    """(batch size, sequence length) of a batch: the first two dimensions of its largest tensor."""
    best = None
    for t in tree_leaves(batch if not hasattr(batch, "items") else dict(batch.items())):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and (best is None or t.numel() > best.numel()):
            best = t
    return (0, 0) if best is None else (int(best.shape[0]), int(best.shape[1]))


class StepPlanner:
    """Plans on the first training step and again when a batch is larger than the planned one."""

    def __init__(self, owner: str, budget_bytes: SizeLike | None, budget: str | float | None,
                 plan_kwargs: dict[str, Any] | None, shown: str = "offload.integrations") -> None:
        """``shown``: the logger, under the trainer's own logger, whose WARNING lines its default logging
        shows (the ``offload`` loggers have only a NullHandler until the user configures logging)."""
        # Checked when the callback is built, not at the first step.
        resolve_budget(owner, budget_bytes, budget, None)
        self.owner = owner
        self.budget_bytes, self.budget = budget_bytes, budget
        if plan_kwargs is not None and not isinstance(plan_kwargs, dict):
            raise TypeError(f"{owner}: plan_kwargs={plan_kwargs!r} must be a dict of offload.plan keywords.")
        check_keywords(f"{owner}: plan_kwargs", PLAN_KEYWORDS, plan_kwargs or {})  # a typo: "did you mean"
        self.plan_kwargs = dict(plan_kwargs or {})
        self.shown = logging.getLogger(shown)
        self.plan: Plan | None = None
        """The plan in use (``plan.report()``, ``plan.to_json()``)."""
        self.handle: Installed | None = None
        self.planned_shape: tuple[int, int] | None = None
        self.plans = 0
        """How many times a plan was made (1 + re-plans)."""

    def before_step(self, model: nn.Module, step: Callable[[], torch.Tensor], batch: Any,
                    optimizer: Any = None) -> None:
        """Plan (first step, or a larger batch than planned) and apply, before the step runs. ``optimizer``:
        the trainer's own (its state and step are in the budget: NOTE [ Optimizer in the budget ]), unless
        ``plan_kwargs`` names one."""
        shape = batch_shape(batch)
        if self.plan is not None and self.planned_shape is not None and (
                shape[0] <= self.planned_shape[0] and shape[1] <= self.planned_shape[1]):
            return
        if self.plan is not None:
            log.info("%s: batch %s is larger than the planned %s: planning again", self.owner, shape,
                     self.planned_shape)
        self.remove()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        budget = resolve_budget(self.owner, self.budget_bytes, self.budget, device)
        # At WARNING on the trainer's logger: what its default logging shows (the HF Trainer hides INFO),
        # so the first step's wait is never silent (issue 31).
        kw = self.plan_kwargs
        if "optimizer" not in kw and optimizer is not None:
            kw = {**kw, "optimizer": optimizer}
        self.shown.warning("%s: planning activation offloading for batch %s with budget_bytes=%d (%s), %s: runs "
                           "about %d training steps", self.owner, shape, budget, format_bytes(budget),
                           "optimizer state included" if kw.get("optimizer") is not None else
                           "optimizer state NOT included (no optimizer)",
                           plan_steps(kw.get("warmup", 1), kw.get("timed", 3)))
        t0 = time.perf_counter()
        try:
            p = plan(model, step, budget_bytes=budget, **kw)
        except OffloadError as e:
            raise OffloadError(f"{self.owner}: {e}") from None
        self.plan, self.planned_shape, self.plans = p, shape, self.plans + 1
        self.handle = p.apply(model)
        measured = ("not measured" if p.measured_peak_bytes is None else f"measured {p.measured_peak_bytes} B")
        self.shown.warning("%s: plan chosen in %.1f s: %s (planner.plan.report() explains it)", self.owner,
                           time.perf_counter() - t0, p.decisions)
        log.info("%s: plan for batch %s under budget_bytes=%d: %s; peak predicted %d B, %s; step predicted "
                 "%.1f ms", self.owner, shape, budget, p.decisions, p.predicted_peak_bytes, measured,
                 p.predicted_step_seconds * 1e3)

    @property
    def engine(self) -> Any:
        return self.handle.engine if self.handle is not None else None

    def figures(self) -> dict[str, Any]:
        """The plan's figures for the trainer's logs."""
        if self.plan is None:
            return {}
        out = {"offload/plan_budget_bytes": self.plan.budget_bytes,
               "offload/plan_predicted_peak_bytes": self.plan.predicted_peak_bytes}
        if self.plan.measured_peak_bytes is not None:
            out["offload/plan_measured_peak_bytes"] = self.plan.measured_peak_bytes
        return out

    def remove(self) -> None:
        """Take the plan off the model (idempotent)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
