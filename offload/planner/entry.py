"""``offload.plan``: profiled on this machine (``planning``), or predicted for a GPU it does not have
(``target=``, ``predicted``: NOTE [ Planning on a target ]).

Its own module because a target plan is made by ``offload.predict``, which itself builds on the
planner's core (``planning``, ``install``, ``profile``): the entry sits above both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import planning
from .planning import Plan

__all__ = ["plan"]

_TARGET_ONLY_UNUSED = ("warmup", "timed")
"""Arguments a target plan does not read (a prediction runs two steps and times none)."""


def plan(model: nn.Module, step: Callable[[], torch.Tensor], budget_bytes: Any, device: Any = None, *,
         target: Any = None, mixed_precision: torch.dtype | None = None, **kwargs: Any) -> Plan:
    if target is None:
        if mixed_precision is not None:
            raise ValueError(
                f"offload.plan: mixed_precision={mixed_precision} is for a plan with target= (predicted); a measured "
                "plan runs your step as written: put torch.autocast(device_type, dtype=...) in the step instead")
        return planning.plan(model, step, budget_bytes, device, **kwargs)
    if device is not None or kwargs.get("bandwidth_gb_s") is not None:
        name = "device" if device is not None else "bandwidth_gb_s"
        raise ValueError(
            f"offload.plan: {name} is given with target={target!r}; a target plan is predicted for the target's "
            "spec. Leave device and bandwidth_gb_s out (a custom link: dataclasses.replace(GPUS[name], "
            "h2d_bytes_per_s=..., d2h_bytes_per_s=...) as the target).")
    planning._check_args(model, step, budget_bytes, None, **{"warmup": 1, "timed": 3, "min_offload_size": 1024,
                                                             "use_streams": True, "bandwidth_gb_s": None,
                                                             "solver": "auto", "engine_kwargs": None,
                                                             "verify": True, **kwargs})
    from .predicted import plan_on_target

    return plan_on_target(model, step, budget_bytes, target, mixed_precision=mixed_precision,
                          **{k: v for k, v in kwargs.items() if k not in (*_TARGET_ONLY_UNUSED, "bandwidth_gb_s")})


plan.__doc__ = (planning.plan.__doc__ or "") + """
    With ``target`` (a name of ``offload.predict.GPUS`` or a ``GPUSpec``): plan for that GPU without it.
    Nothing runs on this machine's device or is timed here: every profile is a prediction (the real
    engine and model on fake tensors, replayed on the target's spec), the plan's verification is
    ``predict_step`` with the plan, a budget share is a share of ``target.usable_bytes``, and the plan's
    report says PREDICTED and names the spec (NOTE [ Planning on a target ], offload/planner/predicted.py).
    ``warmup`` and ``timed`` are not read; ``device`` and ``bandwidth_gb_s`` are refused; a budget above the
    target's usable memory is refused. ``mixed_precision`` (target plans only): the step's compute dtype, as
    in ``offload.predict.predict_step`` (state in the model's dtype).
"""
_sig = inspect.signature(planning.plan)
plan.__signature__ = _sig.replace(parameters=[  # type: ignore[attr-defined]
    *_sig.parameters.values(), inspect.Parameter("target", inspect.Parameter.KEYWORD_ONLY, default=None),
    inspect.Parameter("mixed_precision", inspect.Parameter.KEYWORD_ONLY, default=None)])
