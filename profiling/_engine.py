"""The one place the profilers touch the offload engine's API (see engine contract)."""

from __future__ import annotations

from typing import Any

from offload import (
    active_engine,
    add_pack_observer,
    current_module_name,
    is_static_tensor,
    track_modules,
)

__all__ = [
    "active_engine",
    "add_pack_observer",
    "current_module_name",
    "is_static_tensor",
    "track_modules",
    "engine_closed_steps",
    "engine_totals",
]


def engine_closed_steps(engine: Any) -> int:
    """How many steps the engine's ledger has closed (one per backward that used it)."""
    return engine.ledger.steps_closed  # not len(step_totals): that ring is bounded


def engine_totals(engine: Any) -> dict[str, Any]:
    """The engine's ledger totals (``ledger.summary()``)."""
    return engine.ledger.summary()
