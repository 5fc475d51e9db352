"""The engine's error type and its internal-invariant check."""

from __future__ import annotations

__all__ = ["OffloadError", "DEBUG_TIP"]

DEBUG_TIP = (
    "To narrow it down, rerun with OffloadActivations(use_streams=False) (synchronous "
    "copies) and then without the context: a difference between the two points at a "
    "stream-ordering problem, a difference from no offloading at all points at the policy."
)


class OffloadError(RuntimeError):
    """Raised by the offload engine: a setting's limit was hit or an input is unusable."""


def _internal_assert(cond: bool, what: str) -> None:
    """Check an invariant of the engine itself (never user input)."""
    if not cond:
        raise OffloadError(
            f"offload: internal invariant violated: {what}. This is a bug in offload, "
            f"please report it with the model and settings that triggered it. {DEBUG_TIP}"
        )
