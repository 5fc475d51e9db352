"""Installing per-block decisions on a model, and removing them exactly.

Each candidate block's ``forward`` is replaced by an instance attribute that
runs the original forward under the plan's decision:

* ``keep``: inside the engine with ``engine.excluded()`` (saved tensors stay on
  the device and are recorded in the ledger with reason ``excluded_region``).
* ``offload``: inside the engine (everything it saves above
  ``min_offload_size`` goes to the host pool).
* ``recompute``: ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
  inside ``engine.excluded()``: only the block's inputs are saved, on the device.
* ``recompute_offload``: the same checkpoint inside the engine: the saved
  inputs go to the host pool.

The engine is *attached*: it is entered around each candidate block's forward
only, so the user's training loop needs no ``with`` block, and nothing outside
the candidate blocks (embedding, final norm, output head, loss) is touched:
it is kept exactly as without a plan. Backward runs outside the engine, as in
torchtune. ``remove()`` deletes the instance attribute (or puts back one that
was there before), which restores the model exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["DECISIONS", "Installed", "install", "profile_recomputes"]

DECISIONS = ("keep", "offload", "recompute", "recompute_offload")
"""Per-block decisions, cheapest in time first (keep) to least memory (recompute_offload)."""

_EXCLUDED = ("keep", "recompute")
RECOMPUTE = ("recompute", "recompute_offload")
"""Decisions that re-run the block's forward in backward."""


class Installed:
    """Handle of installed decisions: ``remove()`` restores every block's forward.

    Attributes:
        engine: the attached ``OffloadActivations`` (its ledger records every
            save of the candidate blocks).
        decisions: the live decision per block FQN; changing an entry takes
            effect at the next forward (the profiler uses this).
        probe: optional observer of block boundaries (``profile.Probe``).
    """

    def __init__(self, engine: Any, decisions: dict[str, str]) -> None:
        self.engine = engine
        self.decisions = decisions
        self.probe: Any = None
        self._restore: list[Callable[[], None]] = []

    @property
    def active(self) -> bool:
        return bool(self._restore)

    def remove(self) -> None:
        """Restore every block's original forward (idempotent)."""
        while self._restore:
            self._restore.pop()()

    def __enter__(self) -> "Installed":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def caching_off(model: nn.Module, why: str) -> Callable[[], None]:
    """Turn off a Hugging Face model's KV cache (``config.use_cache``), as its own gradient checkpointing
    does: a recomputed block would append to the cache a second time. Logs one line; returns the undo."""
    import logging

    configs = []
    seen: set[int] = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen and getattr(cfg, "use_cache", False) is True:
            seen.add(id(cfg))
            configs.append(cfg)
    if not configs:
        return lambda: None
    for cfg in configs:
        cfg.use_cache = False
    logging.getLogger("offload.planner").info(
        "offload.plan: config.use_cache=False on %s %s (a recomputed block would append to the KV cache "
        "twice; Hugging Face's gradient checkpointing does the same); restored after", type(model).__name__, why)

    def undo() -> None:
        for cfg in configs:
            cfg.use_cache = True

    return undo


def _block_forward(inst: Installed, index: int, name: str, orig: Callable) -> Callable:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        decision = inst.decisions[name]
        probe = inst.probe
        if probe is not None:
            args, kwargs = probe.fwd_pre(index, args, kwargs)
        engine = inst.engine
        try:
            with engine:
                region = engine.excluded() if decision in _EXCLUDED else contextlib.nullcontext()
                with region:
                    if decision in RECOMPUTE:
                        out = checkpoint(orig, *args, use_reentrant=False, **kwargs)
                    else:
                        out = orig(*args, **kwargs)
        except BaseException:
            if probe is not None:
                probe.fwd_abort()
            raise
        if probe is not None:
            out = probe.fwd_post(index, out)
        return out

    forward.__offload_plan__ = True  # type: ignore[attr-defined]
    return forward


def install(blocks: list[tuple[str, nn.Module]], decisions: dict[str, str], engine: Any,
            model: nn.Module | None = None) -> Installed:
    """Wrap each block's forward with its decision; returns the removable handle. With ``model``, a
    Hugging Face model's KV cache is off until ``remove()`` (see :func:`caching_off`)."""
    for name, d in decisions.items():
        if d not in DECISIONS:
            raise ValueError(f"offload.plan: decision {d!r} for {name!r} is not one of {DECISIONS}")
    inst = Installed(engine, dict(decisions))
    for index, (name, mod) in enumerate(blocks):
        current = mod.__dict__.get("forward")
        if getattr(current, "__offload_plan__", False):
            inst.remove()
            raise RuntimeError(
                f"offload.plan: block {name!r} already has a plan installed; call .remove() on the "
                "previous plan's handle before applying another one."
            )
        had = "forward" in mod.__dict__
        mod.forward = _block_forward(inst, index, name, mod.forward)  # type: ignore[method-assign]

        def restore(m: nn.Module = mod, had: bool = had, old: Any = current) -> None:
            if had:
                m.forward = old  # type: ignore[method-assign]
            else:
                del m.forward

        inst._restore.append(restore)
    if model is not None:
        inst._restore.insert(0, caching_off(model, "while the plan is applied"))
    return inst


def profile_recomputes(profile: Callable[[str], Any], decisions: Sequence[str], names: list[str],
                       no_recompute: dict[str, str]) -> dict[str, Any]:
    """``profile(d)`` for each decision, the recompute ones last: when a recomputed step fails (a forward
    that reads state its first run left, such as a cache of keys), every candidate is marked never
    recomputed in ``no_recompute``, with the error as the reason, and planned without recompute (the error
    is logged), rather than the plan failing with the model's own error from inside a checkpoint."""
    import logging

    out = {d: profile(d) for d in decisions if d not in RECOMPUTE}
    try:
        for d in decisions:
            if d in RECOMPUTE:
                out[d] = profile(d)
    except Exception as e:  # (a KeyboardInterrupt is not caught)
        why = f"recomputing the blocks failed: {type(e).__name__}: {str(e)[:300]}"
        logging.getLogger("offload.planner").warning("offload.plan: %s; planning without recompute", why)
        for d in RECOMPUTE:
            out.pop(d, None)
        for n in names:
            no_recompute.setdefault(n, why)
    return out
