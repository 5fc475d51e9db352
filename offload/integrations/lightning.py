"""Lightning integration: ``lightning.Trainer(..., callbacks=[OffloadCallback()])``.

The engine is entered when a training batch starts and left just before its
backward (``on_before_backward``), so whatever ``training_step`` runs, whether
``self(x)`` or ``self.model(x)``, is offloaded and backward runs outside the
engine. The output head is excluded as ``get_act_offloading_ctx_manager``
does. After each batch the newest ledger step's figures go to
``pl_module.log_dict`` (``offload/offloaded_bytes``, ``offload/kept_bytes``,
``offload/exposed_copy_s``, ``offload/pool_*_bytes``), so every Lightning
logger records them. Exceptions (``KeyboardInterrupt`` included, which
Lightning reports through ``on_exception``) leave the engine.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "offload.integrations.lightning needs lightning, which is not installed: pip install offload[lightning]"
    ) from e

from torch import nn

from ..config import OffloadConfig
from ..engine import OffloadActivations
from ..regions import RegionHandle, exclude_output_head
from . import _StepReporter, _callback_config

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
        **engine_kwargs: ``OffloadConfig`` fields.
    """

    def __init__(self, config: OffloadConfig | None = None, *, exclude_head: bool = True,
                 **engine_kwargs: Any) -> None:
        self.config = _callback_config("OffloadCallback", config, engine_kwargs)
        """The engine's settings (validated when the callback is built)."""
        self.exclude_head = exclude_head
        self.engine: OffloadActivations | None = None
        """The engine, built at the first fit (its ``ledger`` holds every decision)."""
        self._head: list[RegionHandle] = []
        self._entered = False
        self._reporter = _StepReporter()

    # -- lifecycle ---------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
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
        log.info("offloading %s's training steps with %r", type(pl_module).__name__, self.engine)

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
        self._leave()
        if self.engine is not None:
            self.engine.__enter__()
            self._entered = True

    def on_before_backward(self, trainer: Any, pl_module: nn.Module, loss: Any) -> None:
        self._leave()

    def on_train_batch_end(self, trainer: Any, pl_module: nn.Module, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._leave()  # a step that skipped backward
        figures = self._reporter.new_figures(self.engine)
        if figures:
            pl_module.log_dict({k: float(v) for k, v in figures.items()}, on_step=True, on_epoch=False,
                               batch_size=1)
            log.info("step %d: %s", trainer.global_step,
                     ", ".join(f"{k.split('/', 1)[1]}={v:g}" for k, v in figures.items()))

    def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
        self._leave(exception)

    def on_train_end(self, trainer: Any, pl_module: nn.Module) -> None:
        self._leave()
        for handle in self._head:
            handle.remove()
        self._head = []

    def _leave(self, exception: BaseException | None = None) -> None:
        if self._entered and self.engine is not None:
            self._entered = False
            if exception is None:
                self.engine.__exit__(None, None, None)
            else:
                self.engine.__exit__(type(exception), exception, exception.__traceback__)
