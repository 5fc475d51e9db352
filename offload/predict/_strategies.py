"""The strategies a prediction runs a step under, installed on the model the way a user (and the bench) runs them.

- ``"none"``: nothing; every saved activation stays on the device.
- ``"ac"``: each candidate block (``offload.planner.find_blocks``: the blocks of the model's largest
  ``nn.ModuleList``) runs under non-reentrant ``torch.utils.checkpoint``, as the bench's ``ac`` does.
- ``"offload"``: ``OffloadActivations`` built from ``config`` and attached to the model
  (``engine.attach``: entered around the model's forward; the loss and backward run outside it, as
  torchtune recipes run it), with the output head and what runs after it kept on the device
  (``offload.regions.exclude_output_head``), as the trainer integrations (``OffloadCallback``, the
  Lightning callback) and ``get_act_offloading_ctx_manager`` keep it: the head's activations are needed
  first in backward, so their reload could not hide. The bench's ``offload_head_excluded`` runs the same;
  its plain ``offload`` offloads the head too.
- ``"offload_ac"``: both (the bench's ``offload_ac``: the engine moves the checkpoint inputs), the head
  kept likewise.
- ``"long_context"``: ``offload.long_context(model, config=...)``: ``offload_ac`` with the output head kept
  on the device, each block's MLP and (a Hugging Face causal LM's) labels= loss in tiles.
- a ``Plan``: ``plan.apply(model)``.

Engines run on the capture's stand-in device: ``device="cpu"`` under the emulated accelerator
(offload.testing), so the stream backend is the one a GPU run uses; the host RAM ceiling of *this*
machine is switched off (``virtual_memory_safe_pct=None``: the target host's RAM is not known;
``host_budget_bytes`` and the tier budgets still apply).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from torch import nn

from ..config import OffloadConfig
from ..engine import OffloadActivations
from ..planner.blocks import find_blocks
from ..planner.planning import Plan
from ..regions import exclude_output_head
from .._long_context import checkpoint_blocks as _checkpointed
from .._long_context import long_context

__all__ = ["STRATEGIES", "Applied", "apply_strategy", "strategy_name"]

STRATEGIES = ("none", "ac", "offload", "offload_ac", "long_context")
"""Strategy names ``predict_step`` takes (or a ``Plan``)."""


@dataclasses.dataclass
class Applied:
    """A strategy installed on a model: its engine (None without one) and how to undo it."""

    engine: OffloadActivations | None
    undo: list[Callable[[], None]]

    def remove(self) -> None:
        while self.undo:
            self.undo.pop()()


def strategy_name(strategy: str | Plan) -> str:
    """The name a report shows for ``strategy``."""
    if isinstance(strategy, Plan):
        return "plan"
    return strategy if isinstance(strategy, str) else getattr(strategy, "__name__", "custom")


def engine_config(config: OffloadConfig | None) -> OffloadConfig:
    """``config`` for the capture's engine: on the stand-in device, no host RAM ceiling (see above)."""
    cfg = config if config is not None else OffloadConfig()
    if cfg.disk_dir is not None:
        raise ValueError("offload.predict: config.disk_dir is set, but the disk tier cannot be predicted (a fake "
                         "tensor has no bytes to write). Leave disk_dir=None and read host_bytes['pool'] and "
                         "['pageable'] for what the host tiers would need.")
    return dataclasses.replace(cfg, device="cpu", virtual_memory_safe_pct=None)


def apply_strategy(model: nn.Module, strategy: str | Plan, config: OffloadConfig | None, *,
                   keep_head: bool = True) -> Applied:
    """Install ``strategy`` on ``model`` (see the module docstring); a callable is called with ``model``
    and returns its own ``Applied`` (the planner's per-decision profiles, ``offload.planner.predicted``).
    ``keep_head=False``: the engine strategies offload the output head too (the bench's plain ``offload``)."""
    if callable(strategy) and not isinstance(strategy, Plan):
        return strategy(model)
    if isinstance(strategy, Plan):
        plan = dataclasses.replace(strategy, device="cpu",
                                   engine_kwargs={**strategy.engine_kwargs, "virtual_memory_safe_pct": None})
        handle = plan.apply(model)
        return Applied(handle.engine, [handle.remove])
    if strategy not in STRATEGIES:
        raise ValueError(f"offload.predict: strategy={strategy!r} is not one of {STRATEGIES} or a Plan")
    if strategy == "long_context":
        handle = long_context(model, config=engine_config(config))
        return Applied(handle.engine, [handle.remove])
    applied = Applied(None, [])
    if strategy in ("ac", "offload_ac"):
        applied.undo.append(_checkpointed(find_blocks(model)))
    if strategy in ("offload", "offload_ac"):
        engine = OffloadActivations(config=engine_config(config))
        applied.engine = engine
        applied.undo.append(engine.attach(model).remove)
        for region in exclude_output_head(engine, model) if keep_head else ():  # as the integrations keep it
            applied.undo.append(region.remove)
    return applied
