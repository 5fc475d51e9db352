"""Lightning integration: ``lightning.Trainer(..., callbacks=[OffloadCallback()])``.

The engine is entered when a training batch starts and left just before its
backward (``on_before_backward``), so whatever ``training_step`` runs, whether
``self(x)`` or ``self.model(x)``, is offloaded and backward runs outside the
engine. The output head is excluded as ``get_act_offloading_ctx_manager``
does. After each batch the newest ledger step's figures go to
``pl_module.log_dict`` (``offload/offloaded_bytes``, ``offload/kept_bytes``,
``offload/exposed_copy_s``, ``offload/pool_reserved_bytes``; every figure with ``all_figures=True``), so every Lightning
logger records them. With a memory budget, ``OffloadCallback(budget_bytes=...)`` (or
``budget="80%"``) plans instead: on the first training batch it runs ``offload.plan`` with the
LightningModule's own ``training_step`` on that batch (``self.log`` calls are dropped while planning) and
the trainer's optimizers (their state and step in the budget),
applies the plan, logs the decisions and the predicted vs measured peak, and plans again when a batch
is larger than the one planned for (automatic optimization only). Exceptions (``KeyboardInterrupt`` included, which
Lightning reports through ``on_exception``) leave the engine.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "offload.integrations.lightning needs lightning, which is not installed: pip install offload[lightning] "
        "(from a clone: pip install -e \".[lightning]\")"
    ) from e

from torch import nn

from ..config import OffloadConfig
from ..sizes import SizeLike
from ..engine import OffloadActivations
from ..regions import RegionHandle, exclude_output_head
from . import _LongContext, _StepReporter, _callback_config
from ._plan import StepPlanner

__all__ = ["OffloadCallback"]

log = logging.getLogger(__name__)


class OffloadCallback(pl.Callback):
    """Offload activations of every training step in a ``lightning.Trainer``; log the ledger's figures.

    Args:
        config: every engine setting at once (an ``OffloadConfig``); or pass
            them as keywords (``device="cpu"``, ``min_offload_size=...``).
        exclude_head: keep the output head's activations, and the loss computed on
            its output, on the device (``offload.regions.exclude_output_head`` on
            the LightningModule's ``.model``, else on the LightningModule).
        budget_bytes: plan under this peak device memory instead of offloading
            everything (``offload.plan`` on the first training batch; the plan's
            own engine is used and ``config`` is not): as ``offload.plan``'s ``budget_bytes``,
            bytes in any form (``2e9``, ``"16GiB"``) or a share (``"80%"``).
        budget: the same as a share of the device's memory, ``"80%"`` or 0.8.
        plan_kwargs: more ``offload.plan`` keywords (``blocks``, ``timed``...).
        all_figures: log every ``offload/*`` figure each step (``offload.integrations.FIGURE_KEYS``,
            the kept bytes per reason); by default only ``LOGGED_BY_DEFAULT``: offloaded and kept
            bytes, exposed copy time, the host pool's bytes (and the plan's peaks when planning).
        tiled_mlp: compute each block's MLP in tiles along the sequence (``offload.tile_mlp``, on the
            LightningModule's ``.model``, else on the LightningModule); None: as ``long_context``.
        tiled_loss: compute a Hugging Face causal LM's labels= loss in tiles (``offload.tile_loss``); with
            your own loss, pass False and call ``offload.linear_cross_entropy`` in ``training_step``;
            None: as ``long_context``.
        long_context: every block checkpointed (its inputs then offloaded), MLP and loss tiled.
        **engine_kwargs: ``OffloadConfig`` fields.
    """

    def __init__(self, config: OffloadConfig | None = None, *, exclude_head: bool = True,
                 budget_bytes: SizeLike | None = None, budget: str | float | None = None,
                 plan_kwargs: dict[str, Any] | None = None, all_figures: bool = False,
                 tiled_mlp: bool | None = None, tiled_loss: bool | None = None, long_context: bool = False,
                 **engine_kwargs: Any) -> None:
        self.planner = (StepPlanner("OffloadCallback", budget_bytes, budget, plan_kwargs,
                                    shown="lightning.pytorch.offload")
                        if budget_bytes is not None or budget is not None or plan_kwargs is not None else None)
        """With a budget: plans on the first batch (``planner.plan`` is the plan in use)."""
        self.config = _callback_config("OffloadCallback", config, engine_kwargs)
        """The engine's settings (validated when the callback is built)."""
        self.exclude_head = exclude_head
        self.engine: OffloadActivations | None = None
        """The engine, built at the first fit (its ``ledger`` holds every decision)."""
        self._head: list[RegionHandle] = []
        self._entered = False
        self._reporter = _StepReporter("OffloadCallback", all_figures)
        self.long_context = _LongContext("OffloadCallback", tiled_mlp, tiled_loss, long_context,
                                         self.planner is not None)
        """The long-context switches (what is tiled: ``long_context.tiled``)."""

    # -- lifecycle ---------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
        if self.planner is not None:
            if not getattr(pl_module, "automatic_optimization", True):
                raise ValueError("OffloadCallback(budget_bytes=...): planning runs training_step and backward "
                                 "itself, which needs automatic optimization; with manual optimization call "
                                 "offload.plan(model, step, budget_bytes=...) yourself.")
            self.long_context.tile(_inner(pl_module), None)  # the plan's engine, entered around each block
            return
        if self.engine is None:
            self.engine = OffloadActivations.from_config(self.config, model=pl_module)
        if self.exclude_head and not self._head:
            # The head, and what runs after it until the model's next call (the loss), as
            # get_act_offloading_ctx_manager does. The wrapped .model first: its calls (one per
            # forward, even when training_step makes two) are what ends "after the head".
            for model in (getattr(pl_module, "model", None), pl_module):
                if isinstance(model, nn.Module) and not self._head:
                    self._head = exclude_output_head(self.engine, model)
            if not self._head:
                log.info("no output head found on %s: its activations are offloaded too",
                         type(pl_module).__name__)
        self.long_context.checkpoint_layers(_inner(pl_module))
        self.long_context.tile(_inner(pl_module), self.engine)
        log.info("offloading %s's training steps with %r", type(pl_module).__name__, self.engine)

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
        self._leave()
        if self.planner is not None:
            self.planner.before_step(pl_module, lambda: _planning_step(pl_module, batch, batch_idx), batch,
                                     optimizer=list(trainer.optimizers) or None)  # their state is in the budget
            self.engine = self.planner.engine  # the applied plan's engine: its ledger records the steps
            return
        if self.engine is not None:
            self.engine.__enter__()
            self._entered = True

    def on_before_backward(self, trainer: Any, pl_module: nn.Module, loss: Any) -> None:
        self._leave()

    def on_train_batch_end(self, trainer: Any, pl_module: nn.Module, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._leave()  # a step that skipped backward
        figures = self._reporter.new_figures(self.engine)
        if self.planner is not None:
            figures.update(self.planner.figures())
        if figures:
            pl_module.log_dict({k: float(v) for k, v in figures.items()}, on_step=True, on_epoch=False,
                               batch_size=1)
            log.info("step %d: %s", trainer.global_step,
                     ", ".join(f"{k.split('/', 1)[1]}={v:g}" for k, v in figures.items()))

    def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
        self._leave(exception)

    def on_train_end(self, trainer: Any, pl_module: nn.Module) -> None:
        self._leave()
        if self.planner is not None:
            self.planner.remove()
        for handle in self._head:
            handle.remove()
        self._head = []
        self.long_context.remove()
        if self.engine is not None:
            self.engine.close()  # the disk tier's files and run directory

    def _leave(self, exception: BaseException | None = None) -> None:
        if self._entered and self.engine is not None:
            self._entered = False
            if exception is None:
                self.engine.__exit__(None, None, None)
            else:
                self.engine.__exit__(type(exception), exception, exception.__traceback__)


def _inner(pl_module: nn.Module) -> nn.Module:
    """The model a LightningModule trains: its ``.model`` when that is a module, else itself."""
    inner = getattr(pl_module, "model", None)
    return inner if isinstance(inner, nn.Module) else pl_module


def _planning_step(pl_module: Any, batch: Any, batch_idx: int) -> Any:
    """``training_step`` on the batch, its loss, with ``self.log``/``log_dict`` muted (planning steps are
    not training steps)."""
    saved = {k: pl_module.__dict__.get(k) for k in ("log", "log_dict")}
    pl_module.log = lambda *a, **k: None
    pl_module.log_dict = lambda *a, **k: None
    try:
        out = pl_module.training_step(batch, batch_idx)
    finally:
        for k, v in saved.items():
            if v is None:
                del pl_module.__dict__[k]
            else:
                pl_module.__dict__[k] = v
    return out["loss"] if isinstance(out, dict) else out
