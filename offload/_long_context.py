"""``offload.long_context(model)``: the long-context strategy in one line.

Activation checkpointing on every block, the checkpoint inputs offloaded to the host tiers (pinned pool,
then pageable memory, then disk: ``OffloadConfig``'s budgets), the MLP and the loss in tiles along the
sequence (``offload.tiling``): what Arctic Long Sequence Training and Unsloth combine to train Llama-8B
at 342K-500K tokens on one 80 GB GPU. At those lengths the checkpoint inputs alone outgrow host memory
(Llama-3.1-8B: 256 KiB a token, 86 GB at 342K tokens), so the host budget and the disk tier are part of
the answer: ``handle.report()`` says, after a step, how many bytes each tier took and what stayed on the
device because no tier had room; ``offload.predict`` (``strategy="long_context"``) says it beforehand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._format import format_bytes
from .compat.trl import _checkpointing_on
from .config import OffloadConfig
from .engine import OffloadActivations
from .planner.blocks import find_blocks
from .planner.install import caching_off
from .regions import exclude_output_head
from .tiling import TilingHandle, _causal_lm, tile_loss, tile_mlp

__all__ = ["LongContextHandle", "long_context", "checkpoint_blocks", "checkpoint_model", "is_hf_causal_lm",
           "hf_checkpointing"]

log = logging.getLogger(__name__)


def checkpoint_blocks(blocks: list[tuple[str, nn.Module]]) -> Callable[[], None]:
    """Run each block's forward under non-reentrant ``torch.utils.checkpoint`` while grad is enabled (the
    bench's and ``offload.predict``'s ``ac``); returns the undo, which puts back each block's own forward."""
    undo = []
    for _name, mod in blocks:
        orig = mod.forward
        had = "forward" in mod.__dict__

        def forward(*args: Any, _orig: Callable = orig, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _orig(*args, **kwargs)
            return checkpoint(_orig, *args, use_reentrant=False, **kwargs)

        mod.forward = forward  # type: ignore[method-assign]
        undo.append((mod, had, orig))

    def restore() -> None:
        for mod, had, orig in reversed(undo):
            if had:
                mod.forward = orig  # type: ignore[method-assign]
            else:
                del mod.forward

    return restore


def hf_checkpointing(model: nn.Module) -> bool:
    """Whether a Hugging Face model's own activation (gradient) checkpointing is on (wrappers looked through)."""
    return _checkpointing_on(_causal_lm(model))


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` (wrappers looked through) is a Hugging Face model with a ``loss_function``."""
    lm = _causal_lm(model)
    return hasattr(lm, "loss_function") and any(c.__name__ == "PreTrainedModel" for c in type(lm).__mro__)


class LongContextHandle:
    """What ``long_context`` installed: the engine, the tiles, the checkpointing; ``remove()`` undoes all."""

    def __init__(self, engine: OffloadActivations, model: nn.Module) -> None:
        self.engine = engine
        """The engine that offloads the checkpoint inputs (its ledger also counts the tiles)."""
        self.mlp: TilingHandle | None = None
        """The tiled MLP's handle (None: not tiled)."""
        self.loss: TilingHandle | None = None
        """The tiled loss's handle (None: not tiled)."""
        self.checkpointing = ""
        """Who checkpoints the blocks: "offload" (this handle), "transformers" (the model's own gradient
        checkpointing, left on) or "" (none)."""
        self._model_name = type(model).__name__
        self._undo: list[Callable[[], None]] = []

    def remove(self) -> None:
        """Detach the engine, untile, restore each block's forward (idempotent); the engine stays usable.
        Not between a forward and its backward: the checkpoints' recompute runs the blocks' forwards
        again, and must find them as the forward did."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "LongContextHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def report(self) -> str:
        """What the strategy did in the engine's latest step: bytes per host tier, bytes kept on the device
        for want of host room, what the tiles did not save; and the host settings that bound it."""
        cfg = self.engine.config
        lines = [f"long_context on {self._model_name}: blocks checkpointed by {self.checkpointing or 'nobody'}, "
                 f"checkpoint inputs offloaded; MLP {'tiled' if self.mlp else 'not tiled'}, "
                 f"loss {'tiled' if self.loss else 'not tiled'}",
                 f"  host tiers: pool budget {_size(cfg.host_budget_bytes, 'no cap')}, pageable budget "
                 f"{'off' if cfg.pageable_budget_bytes == 0 else _size(cfg.pageable_budget_bytes, 'RAM ceiling only')}, disk "
                 f"{cfg.disk_dir + ' (budget ' + _size(cfg.disk_budget_bytes, 'free space') + ')' if cfg.disk_dir else 'off'}"]
        steps = self.engine.ledger.step_totals
        if not steps:
            return "\n".join(lines + ["  no step has run yet (offload.predict(strategy='long_context') predicts one)"])
        t = steps[-1]
        tiers = ", ".join(f"{k} {format_bytes(v.get('bytes', 0))}" for k, v in t.tiers.items() if v.get("bytes"))
        lines.append(f"  step {t.step}: host memory needed {format_bytes(t.d2h_bytes)} ({tiers or 'none'})")
        short = t.kept_by_reason.get("host_budget", 0)
        if short:
            lines.append(f"  {format_bytes(short)} stayed on the device: no host tier had room (raise "
                         "host_budget_bytes / pageable_budget_bytes, or set disk_dir)")
        for kind, row in t.tiling.items():
            lines.append(f"  tiled {kind}: {row['tiles']} tiles, {format_bytes(row['bytes_not_saved'])} not saved")
        return "\n".join(lines)


def _size(value: int | None, none: str) -> str:
    return none if value is None else format_bytes(value)


def checkpoint_model(model: nn.Module, blocks: list[tuple[str, nn.Module]] | None = None
                     ) -> tuple[str, Callable[[], None]]:
    """Activation checkpointing on every block (``blocks``, default the model's largest ``nn.ModuleList``),
    unless a Hugging Face model's own is on already; a Hugging Face KV cache is off meanwhile. Returns
    (who checkpoints: "offload" or "transformers", the undo)."""
    if hf_checkpointing(model):
        return "transformers", lambda: None
    cache_undo = caching_off(model, "while its blocks are checkpointed for long context")
    blocks_undo = checkpoint_blocks(blocks if blocks is not None else find_blocks(model))

    def undo() -> None:
        blocks_undo()
        cache_undo()

    return "offload", undo


def long_context(model: nn.Module, *, tiled_mlp: bool = True, tiled_loss: bool | None = None,
                 mlp_tokens: int | None = None, loss_tokens: int | None = None, loss_impl: str = "auto",
                 blocks: list[tuple[str, nn.Module]] | None = None, config: OffloadConfig | None = None,
                 engine: OffloadActivations | None = None, exclude_head: bool = True,
                 **engine_kwargs: Any) -> LongContextHandle:
    """AC + offloaded checkpoint inputs + tiled MLP + tiled loss on ``model``, in one call (module doc).

    Every block of the model's largest ``nn.ModuleList`` (or ``blocks``) runs under non-reentrant
    checkpointing (a Hugging Face model's own gradient checkpointing is used instead when on); an
    ``OffloadActivations`` built from ``config`` or ``engine_kwargs`` (``host_budget_bytes``,
    ``pageable_budget_bytes``, ``disk_dir``...) is attached to the model with the output head kept on
    the device; ``tile_mlp`` tiles each block's MLP (``.mlp``, ``.feed_forward``...; ``mlp_tokens`` a
    tile) and ``tile_loss`` the labels= loss of a Hugging Face causal LM (``tiled_loss=None``: when the
    model is one; with your own loss, call ``offload.tiling.linear_cross_entropy`` on the head's input).
    ``engine``: an engine to use instead of building one (then pass no setting): installing and removing
    around each step keeps its pool. ``exclude_head=False`` when the head module never runs (a loss that
    only reads its weight: ``linear_cross_entropy``), else the engine warns that its exclusion did
    nothing. Returns a handle (``engine``, ``report()``, ``remove()``)."""
    if engine is not None and (config is not None or engine_kwargs):
        raise TypeError(f"offload.long_context: pass engine= or engine settings, not both (got engine and "
                        f"{'config' if config is not None else sorted(engine_kwargs)})")
    if engine is None:
        engine = OffloadActivations(model=model, config=config, **engine_kwargs)
    if tiled_loss is None:
        tiled_loss = is_hf_causal_lm(model)
        if not tiled_loss:
            log.info("long_context: %s is no Hugging Face causal LM, its loss is not tiled (call "
                     "offload.tiling.linear_cross_entropy in your loss)", type(model).__name__)
    handle = LongContextHandle(engine, model)
    try:
        handle.checkpointing, undo = checkpoint_model(model, blocks)
        handle._undo.append(undo)
        handle._undo.append(engine.attach(model).remove)
        for region in exclude_output_head(engine, model) if exclude_head else ():
            handle._undo.append(region.remove)
        if tiled_mlp:
            handle.mlp = tile_mlp(model, tokens=mlp_tokens, engine=engine)
            handle._undo.append(handle.mlp.remove)
        if tiled_loss:
            handle.loss = tile_loss(model, tokens=loss_tokens, impl=loss_impl, engine=engine)
            handle._undo.append(handle.loss.remove)
    except BaseException:
        handle.remove()
        raise
    return handle
