"""The memory-budget planner: keep / offload / recompute per block, at the least predicted step time.

    plan = offload.plan(model, step, budget_bytes=...)
    handle = plan.apply(model)        # engine attached to the blocks; remove() restores the model
    print(plan.report())

Modules: ``blocks`` (the candidate blocks), ``meter`` (peak of one step, host
buffers left out), ``profile`` (one step per decision), ``cost`` (the cost
model and its assumptions), ``solve`` (exact Pareto DP, greedy fallback),
``choose`` (from a cost model to the decisions for a budget), ``host`` (the
host tiers' limits), ``install`` (applying decisions), ``settings`` (the plan's
engine settings), ``planning`` (the Plan object and the measured ``plan()``),
``predicted`` (a plan for a target GPU, from ``offload.predict``) and ``entry``
(``offload.plan``, either of the two).
"""

from .cost import CostModel, Hardware
from .install import DECISIONS, Installed
from .meter import MemoryMeter, StepMeasurement, measure_step
from .entry import plan
from .planning import Plan, find_blocks, plan_from_cost, plan_steps

__all__ = [
    "plan",
    "Plan",
    "DECISIONS",
    "Installed",
    "find_blocks",
    "plan_from_cost",
    "plan_steps",
    "CostModel",
    "Hardware",
    "MemoryMeter",
    "StepMeasurement",
    "measure_step",
]
