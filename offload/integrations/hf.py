"""Hugging Face ``Trainer`` integration: ``Trainer(..., callbacks=[OffloadCallback()])``.

At train begin the callback builds an engine, keeps the output head's
activations on the device (see ``_exclude_tail``) and attaches the engine to
the model (``ctx.attach``): every forward the Trainer runs is offloaded, backward runs
outside. At train end it detaches. Each Trainer log gets the newest ledger
step's figures (``offload/offloaded_bytes``, ``offload/kept_bytes``,
``offload/exposed_copy_s``, ``offload/pool_reserved_bytes``; every figure with ``all_figures=True``), so whatever
``report_to`` is set (TensorBoard, W&B...) records them.

With a memory budget, ``OffloadCallback(budget_bytes=...)`` (or ``budget="80%"`` of the device)
plans instead: on the first training step it runs ``offload.plan`` with the Trainer's own
``compute_loss`` on that batch and the Trainer's own optimizer (its state and step in the budget), applies the plan (keep / offload / recompute per block), logs the
decisions and the predicted vs measured peak, and plans again when a batch is larger (longer
sequences) than the one planned for (see ``offload.integrations._plan``).

Works with Trainer subclasses (TRL's ``SFTTrainer``...), PEFT models and
``gradient_checkpointing=True`` with either ``use_reentrant``: a reentrant
checkpoint's recompute runs in backward, outside the engine.

For long context, ``OffloadCallback(long_context=True)`` checkpoints every decoder layer (unless
``gradient_checkpointing=True`` already does), so the engine offloads the checkpoint inputs, and tiles
the MLPs and the labels= loss (``offload.tiling``); ``tiled_mlp=True`` / ``tiled_loss=True`` tile one
without the other. The tiles' figures land in the engine's ledger (``summary()["tiling"]``).
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from typing import Any

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "offload.integrations.hf needs transformers, which is not installed: pip install offload[hf] "
        "(from a clone: pip install -e \".[hf]\")"
    ) from e

import torch
from torch import nn

from ..attach import AttachHandle
from ..config import OffloadConfig
from ..sizes import SizeLike
from ..engine import OffloadActivations
from ..engine import active_engine
from .._warn import user_stacklevel
from ..regions import find_backbone, find_output_head
from . import _LongContext, _StepReporter, _callback_config
from ._plan import StepPlanner

__all__ = ["OffloadCallback"]

log = logging.getLogger(__name__)


class OffloadCallback(TrainerCallback):
    """Offload activations in any ``transformers.Trainer`` and log the ledger's per-step figures.

    Args:
        config: every engine setting at once (an ``OffloadConfig``); or pass
            them as keywords (``device="cpu"``, ``min_offload_size=...``).
        exclude_head: keep the output head's activations on the device (they
            are needed first in backward, so their reload cannot be hidden).
        budget_bytes: plan under this peak device memory instead of offloading
            everything (``offload.plan`` on the first training step; the plan's
            own engine is used and ``config`` is not): as ``offload.plan``'s ``budget_bytes``,
            bytes in any form (``2e9``, ``"16GiB"``) or a share (``"80%"``).
        budget: the same as a share of the device's memory, ``"80%"`` or 0.8.
        plan_kwargs: more ``offload.plan`` keywords (``blocks``, ``timed``...).
        all_figures: log every ``offload/*`` figure each step (``offload.integrations.FIGURE_KEYS``,
            the kept bytes per reason); by default only ``LOGGED_BY_DEFAULT``: offloaded and kept
            bytes, exposed copy time, the host pool's bytes (and the plan's peaks when planning).
        tiled_mlp: compute each decoder layer's MLP in tiles along the sequence (``offload.tile_mlp``);
            None: as ``long_context``.
        tiled_loss: compute the labels= loss in tiles, never the full logits (``offload.tile_loss``;
            training outputs then carry ``logits=None``); None: as ``long_context``.
        long_context: the long-context strategy: every decoder layer checkpointed (unless the Trainer's
            ``gradient_checkpointing=True`` does it), its inputs offloaded, MLP and loss tiled
            (``offload.long_context``); the host budgets and ``disk_dir`` come from the engine's settings.
        **engine_kwargs: ``OffloadConfig`` fields.
    """

    def __init__(self, config: OffloadConfig | None = None, *, exclude_head: bool = True,
                 budget_bytes: SizeLike | None = None, budget: str | float | None = None,
                 plan_kwargs: dict[str, Any] | None = None, all_figures: bool = False,
                 tiled_mlp: bool | None = None, tiled_loss: bool | None = None, long_context: bool = False,
                 **engine_kwargs: Any) -> None:
        self.planner = (StepPlanner("OffloadCallback", budget_bytes, budget, plan_kwargs,
                                    shown="transformers.offload")
                        if budget_bytes is not None or budget is not None or plan_kwargs is not None else None)
        """With a budget: plans on the first step (``planner.plan`` is the plan in use)."""
        self._unwrap: Any = None
        self.config = _callback_config("OffloadCallback", config, engine_kwargs)
        """The engine's settings (validated when the callback is built)."""
        self.exclude_head = exclude_head
        self.engine: OffloadActivations | None = None
        """The engine, built at the first train begin (its ``ledger`` holds every decision); with a
        budget, the applied plan's engine."""
        self._attached: AttachHandle | None = None
        self._head: Any = None
        self._reporter = _StepReporter("OffloadCallback", all_figures)
        self.long_context = _LongContext("OffloadCallback", tiled_mlp, tiled_loss, long_context,
                                         self.planner is not None)
        """The long-context switches (what is tiled: ``long_context.tiled``)."""

    # -- lifecycle ---------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise ValueError("OffloadCallback: the Trainer passed no model to on_train_begin.")
        self._report_first()
        _warn_if_checkpoint_offload(model)
        trl_flag = _warn_if_trl_offloading(args)
        if self.planner is not None:
            self._wrap_compute_loss(model)
            self.long_context.tile(model, None)  # the plan's engine, entered around each block
            return
        if self.engine is None:
            self.engine = OffloadActivations.from_config(self.config, model=model)
        if trl_flag:
            self.engine._warned_foreign_hooks = True  # said once, here, with the TRL-specific fix
        self.detach()
        self.long_context.checkpoint_layers(model)
        self._attached = self.engine.attach(model)
        if self.exclude_head:
            self._head = _exclude_tail(self.engine, model, self._attached)
        self.long_context.tile(model, self.engine)
        log.info("offloading %s's activations with %r", type(model).__name__, self.engine)

    def _wrap_compute_loss(self, model: nn.Module) -> None:
        """Plan on the Trainer's first training ``compute_loss`` call, with that call as the step."""
        trainer = _find_trainer()
        if trainer is None:
            raise RuntimeError("OffloadCallback(budget_bytes=...): could not find the Trainer calling "
                               "on_train_begin; planning needs its compute_loss.")
        self.detach()
        orig = trainer.compute_loss
        planner = self.planner
        busy = []

        def compute_loss(m: nn.Module, inputs: Any, *a: Any, **k: Any) -> Any:
            if not busy and m.training and torch.is_grad_enabled():
                busy.append(True)
                try:
                    # The Trainer's own optimizer (created before training starts): its state is in the budget.
                    planner.before_step(model, lambda: _loss_of(orig(m, inputs, *a, **k)), inputs,
                                        optimizer=trainer.optimizer)
                    self.engine = planner.engine  # the applied plan's engine: its ledger records the steps
                finally:
                    busy.clear()
            return orig(m, inputs, *a, **k)

        trainer.compute_loss = compute_loss

        def unwrap() -> None:
            if trainer.__dict__.get("compute_loss") is compute_loss:
                del trainer.compute_loss

        self._unwrap = unwrap

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.detach()
        if self.engine is not None and self.engine.ledger.step_totals:
            s = self.engine.ledger.summary()
            log.info("training done: %d steps, %d bytes offloaded, %d kept; per tier %s",
                     len(self.engine.ledger.step_totals), s["offloaded_bytes"], s["kept_bytes"],
                     {k: v["bytes"] for k, v in s["tiers"].items()})
        if self.engine is not None:
            self.engine.close()  # the disk tier's files and run directory

    def detach(self) -> None:
        """Remove the engine's hooks (or the plan) from the model (done at train end; idempotent)."""
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        if self.planner is not None:
            self.planner.remove()
        if self._attached is not None:
            self._attached.remove()
            self._attached = None
        if self._head is not None:
            self._head.remove()
            self._head = None
        self.long_context.remove()

    # -- logs ----------------------------------------------------------------------

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if logs is None:
            return
        figures = self._reporter.new_figures(self.engine)
        if self.planner is not None:
            figures.update(self.planner.figures())
        if not figures:
            return
        # Trainer.log stored a copy in log_history before calling us: update it too.
        hist = getattr(state, "log_history", None)
        if hist and all(hist[-1].get(k) == v for k, v in logs.items()):
            hist[-1].update(figures)
        logs.update(figures)
        log.info("step %s: %s", getattr(state, "global_step", "?"),
                 ", ".join(f"{k.split('/', 1)[1]}={v:g}" for k, v in figures.items()))

    def _report_first(self) -> None:
        """Run before the reporting callbacks so they see the figures we add to ``logs``.

        The Trainer puts user callbacks after its own (``report_to`` ones
        included) and passes every callback the same ``logs`` dict, so figures
        added by a late callback would reach none of them. The handler calling
        us is a few frames up.
        """
        f = sys._getframe(1)
        for _ in range(6):
            if f is None:
                break
            h = f.f_locals.get("self")
            if isinstance(h, CallbackHandler) and self in h.callbacks:
                if h.callbacks[0] is not self:
                    # Safe while the handler iterates: the callbacks after us keep their indices.
                    h.callbacks.remove(self)
                    h.callbacks.insert(0, self)
                return
            f = f.f_back
        log.info("OffloadCallback: could not move ahead of the reporting callbacks; callbacks "
                 "listed before it will not see the offload/ figures")


def _loss_of(out: Any) -> Any:
    """The loss of ``compute_loss`` (a tensor, or ``(loss, outputs)`` with ``return_outputs=True``)."""
    return out[0] if isinstance(out, tuple) else out


def _find_trainer() -> Any:
    """The ``transformers.Trainer`` whose callback handler is calling us (a few frames up)."""
    from transformers import Trainer

    f = sys._getframe(1)
    for _ in range(12):
        if f is None:
            return None
        obj = f.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        f = f.f_back
    return None


def _checkpoint_offloads(model: nn.Module) -> bool:
    """Whether transformers' own checkpoint offload is on (``activation_checkpointing_enable(offload=True)``).

    transformers (>= 5) then gives each checkpointed layer a ``functools.partial``
    of a function that enters ``torch.autograd.graph.save_on_cpu`` around the checkpoint.
    """
    for m in model.modules():
        fn = m.__dict__.get("_gradient_checkpointing_func")
        if isinstance(fn, functools.partial):
            code = getattr(fn.func, "__code__", None)
            if code is not None and "save_on_cpu" in code.co_names:
                return True
    return False


def _warn_if_trl_offloading(args: Any) -> bool:
    """Warn when TRL's own offloading (``SFTConfig(activation_offloading=True)``) is on too; True if so."""
    if not getattr(args, "activation_offloading", False):
        return False
    warnings.warn(
        "OffloadCallback: SFTConfig(activation_offloading=True) is on as well. SFTTrainer then enters its own "
        "offloading context around every training step and this callback's engine runs inside it (only the "
        "innermost saved-tensor hooks run), so two engines are configured and the outer one records nothing. "
        "Use one: set activation_offloading=False and keep this callback, or keep TRL's flag, drop the "
        "callback and call offload.compat.trl.patch_sft_trainer() before building the trainer (this engine "
        "behind TRL's flag).",
        stacklevel=user_stacklevel(),
    )
    return True


def _warn_if_checkpoint_offload(model: nn.Module) -> None:
    if _checkpoint_offloads(model):
        warnings.warn(
            f"OffloadCallback: {type(model).__name__} has transformers' own checkpoint offload on "
            "(activation_checkpointing_kwargs={'offload': True}, or activation_checkpointing_enable("
            "offload=True)). It wraps each checkpointed layer in torch.autograd.graph.save_on_cpu, whose "
            "hooks run instead of this engine's inside those layers (only the innermost saved-tensor "
            "hooks run): the checkpoints' inputs are copied on the compute stream and never reach the "
            "ledger. Drop offload=True and keep activation_checkpointing=True: this engine then offloads "
            "the same inputs on a side stream, and accounts for them.",
            stacklevel=user_stacklevel(),
        )


class _TailRegion:
    """Keeps on the device what the model saves after its body returns: head, loss, fused heads.

    An HF causal LM computes the head and often the loss in its top-level
    forward, after the body; TRL's SFTTrainer even projects through
    ``lm_head.weight`` directly (a fused, tiled head), so the head module's
    forward never runs and excluding that module would exclude nothing. The
    tail is needed first in backward, so its reload could not be hidden.

    The region opens when the body returns inside an attached call of the
    root and closes when the root returns (its exit hook runs before the
    engine is left). A call of the root that begins with the region still
    open (a KeyboardInterrupt skipped the exit hooks) closes it first.
    """

    def __init__(self, engine: OffloadActivations, root: nn.Module, body: nn.Module,
                 attached: AttachHandle) -> None:
        self._engine = engine
        self._attached = attached
        self._open: list[Any] = []
        self.fired = 0
        self._hooks = [
            root.register_forward_pre_hook(self._begin),  # after attach's: the engine is entered
            body.register_forward_hook(self._start, always_call=True),
            root.register_forward_hook(self._end, always_call=True, prepend=True),  # before attach's exit
        ]

    def _outermost(self) -> bool:
        return self._attached._state.depth == 1

    def _begin(self, module: nn.Module, args: Any) -> None:
        if self._outermost():
            self._end(module, args, None)  # left open by an interrupted forward

    def _start(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._attached._state.depth >= 1 and active_engine() is self._engine and not self._open:
            cm = self._engine.excluded()
            cm.__enter__()
            self._open.append(cm)
            self.fired += 1

    def _end(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._attached._state.depth > 1:
            return  # a nested call of the root returned, not the outermost
        while self._open:
            self._open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        while self._open:
            self._open.pop().__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _exclude_tail(engine: OffloadActivations, model: nn.Module, attached: AttachHandle) -> Any:
    """Exclude the model's tail (after its body), else its output head module, else nothing (logged)."""
    body = find_backbone(model)
    if body is not None:
        log.info("keeping %s's tail (after %s) on the device", type(model).__name__, type(body).__name__)
        return _TailRegion(engine, model, body, attached)
    head = find_output_head(model)
    if head is not None:
        return engine.exclude(head)
    log.info("no output head found on %s: its activations are offloaded too", type(model).__name__)
    return None
