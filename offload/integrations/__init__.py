"""Framework integrations: one line to offload in a trainer you already use.

- ``offload.integrations.hf.OffloadCallback``: a ``transformers.TrainerCallback``
  (``Trainer``, TRL's ``SFTTrainer`` and other subclasses); ``pip install offload[hf]``.
- ``offload.integrations.lightning.OffloadCallback``: a ``lightning.Callback``;
  ``pip install offload[lightning]``.
- torchtitan / flame: ``offload.integrations.torchtitan`` (documentation and the
  config mapping; their ``activation_offload`` path calls torchtune's helper,
  which ``offload.get_act_offloading_ctx_manager`` replaces).

Both callbacks take the engine's settings as keywords or ``config=OffloadConfig``
and report the ledger's per-step figures to the trainer's logs: ``LOGGED_BY_DEFAULT``
(four keys a console line can hold), or with ``all_figures=True`` every figure of
``step_figures`` (keys ``FIGURE_KEYS``, then the kept bytes per reason).
Submodules are imported on demand, so importing ``offload`` never imports a
framework.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..config import OffloadConfig, check_keywords
from ..config import resolve_device
from ..engine import OffloadActivations
from ..ledger import TIERS, StepTotals

__all__ = ["step_figures", "FIGURE_KEYS", "LOGGED_BY_DEFAULT"]

_LONG_CONTEXT_KEYWORDS = ("tiled_mlp", "tiled_loss", "long_context")

FIGURE_KEYS = (
    "offload/offloaded_bytes",
    "offload/kept_bytes",
    "offload/exposed_copy_s",
    "offload/pool_reserved_bytes",
    "offload/pool_in_use_bytes",
    *(f"offload/{tier}_{what}" for tier in TIERS for what in ("bytes", "s", "wait_s")),
)
"""The per-step figures the callbacks log with ``all_figures=True``, in this order (per host tier: the
bytes copied into it, the seconds spent moving bytes into and out of it, the part of those compute
waited for)."""

LOGGED_BY_DEFAULT = (
    "offload/offloaded_bytes",
    "offload/kept_bytes",
    "offload/exposed_copy_s",
    "offload/pool_reserved_bytes",
)
"""The figures a callback logs each step by default: bytes offloaded, bytes kept, copy time compute
waited for, host memory the pool holds (``all_figures=True`` logs every one of ``step_figures``)."""


def step_figures(t: StepTotals) -> dict[str, Any]:
    """The logged figures of one closed ledger step (``exposed_copy_s`` = compute stalled on copies):
    ``FIGURE_KEYS``, then ``offload/kept_bytes/<reason>`` for each reason that kept bytes in the step."""
    figures = {
        "offload/offloaded_bytes": t.offloaded_bytes,
        "offload/kept_bytes": t.kept_bytes,
        "offload/exposed_copy_s": t.stall_seconds,
        "offload/pool_reserved_bytes": t.pool.get("reserved_bytes", 0),
        "offload/pool_in_use_bytes": t.pool.get("in_use_bytes", 0),
    }
    for tier in TIERS:
        row = t.tiers.get(tier, {})
        figures[f"offload/{tier}_bytes"] = row.get("bytes", 0)
        figures[f"offload/{tier}_s"] = row.get("seconds", 0.0)
        figures[f"offload/{tier}_wait_s"] = row.get("wait_seconds", 0.0)
    figures.update({f"offload/kept_bytes/{r}": b for r, b in t.kept_by_reason.items() if b})
    return figures


def _callback_config(owner: str, config: OffloadConfig | None, engine_kwargs: dict[str, Any]) -> OffloadConfig:
    """A callback's settings, checked when the callback is built (not at train begin): one way of
    passing them, known names (with "did you mean"), valid values, and a device this machine has."""
    if config is not None and engine_kwargs:
        raise TypeError(
            f"{owner}: pass settings as keywords or as config=, not both (got config and "
            f"{sorted(engine_kwargs)}); config.replace(name=value) changes a config."
        )
    if config is not None and not isinstance(config, OffloadConfig):
        raise TypeError(f"{owner}: config must be an OffloadConfig, got {type(config).__name__}.")
    if config is None:
        check_keywords(owner, ("config", "exclude_head", "budget_bytes", "budget", "plan_kwargs", "all_figures",
                              *_LONG_CONTEXT_KEYWORDS,
                              *OffloadConfig.field_names()), engine_kwargs)
        config = OffloadConfig(**engine_kwargs)
    try:
        resolve_device(config.device)
    except ValueError as e:
        raise ValueError(f"{owner}: {e}") from None
    return config


class _StepReporter:
    """Hands out each closed ledger step's figures once (for a trainer's per-step log): those of
    ``LOGGED_BY_DEFAULT``, or all of them with ``all_figures``. A step is known by its engine and its
    number: a re-plan's new engine numbers its steps from 0 again."""

    def __init__(self, owner: str, all_figures: bool) -> None:
        if not isinstance(all_figures, bool):
            raise TypeError(f"{owner}: all_figures={all_figures!r} must be True (log every offload/* figure "
                            f"each step) or False (only {list(LOGGED_BY_DEFAULT)}).")
        self.all_figures = all_figures
        self._reported: tuple[weakref.ref | None, int] = (None, -1)

    def new_figures(self, engine: OffloadActivations | None) -> dict[str, Any]:
        """Figures of the newest step closed since the last call, or {} when there is none."""
        if engine is None or not engine.ledger.step_totals:
            return {}
        last = engine.ledger.step_totals[-1]
        ref, step = self._reported
        if ref is not None and ref() is engine and last.step == step:
            return {}
        self._reported = (weakref.ref(engine), last.step)
        figures = step_figures(last)
        return figures if self.all_figures else {k: figures[k] for k in LOGGED_BY_DEFAULT}


class _LongContext:
    """A callback's long-context switches (``tiled_mlp``, ``tiled_loss``, ``long_context``), checked when the
    callback is built; ``install`` puts them on the model at train start, ``remove`` takes them off."""

    def __init__(self, owner: str, tiled_mlp: bool | None, tiled_loss: bool | None, long_context: bool,
                 planning: bool) -> None:
        for name, value in zip(_LONG_CONTEXT_KEYWORDS, (tiled_mlp, tiled_loss, long_context)):
            if not isinstance(value, bool) and (value is not None or name == "long_context"):
                raise TypeError(f"{owner}: {name}={value!r} must be True or False"
                                f"{'' if name == 'long_context' else ' (None: as long_context)'}.")
        if long_context and planning:
            raise ValueError(f"{owner}: long_context=True checkpoints every layer, while budget_bytes/budget plans "
                             "per layer what to keep, offload or recompute; pass one of them (tiled_mlp=True and "
                             "tiled_loss=True go with a budget).")
        self.checkpoint = long_context
        self.tiled = tuple(k for k, on in (("mlp", tiled_mlp), ("loss", tiled_loss))
                           if (long_context if on is None else on))
        """Which of the MLP and the loss are computed in tiles."""
        self._undo: list[Any] = []

    def checkpoint_layers(self, model: Any) -> None:
        """With ``long_context``: every layer checkpointed, unless the model's own checkpointing is on."""
        if self.checkpoint:
            import logging

            from .._long_context import checkpoint_model

            who, undo = checkpoint_model(model)
            self._undo.append(undo)
            logging.getLogger(__name__).info("long context: %s's layers checkpointed by %s", type(model).__name__,
                                             who)

    def tile(self, model: Any, engine: OffloadActivations | None) -> None:
        """The MLP and the loss in tiles, as asked (their figures go to ``engine``, else the one entered)."""
        from ..tiling import tile_loss, tile_mlp

        if "mlp" in self.tiled:
            self._undo.append(tile_mlp(model, engine=engine).remove)
        if "loss" in self.tiled:
            self._undo.append(tile_loss(model, engine=engine).remove)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
