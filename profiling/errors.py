"""The profiling package's error type and its internal-assert helper."""

from __future__ import annotations

__all__ = ["ProfilingError"]

_TIP = (
    "Tip: profiling never changes what the model computes; if a profiler "
    "misbehaves, rerun with it disabled (MemProfilerCfg(enabled=False)) to confirm."
)


class ProfilingError(RuntimeError):
    """A profiler was used in a way it cannot support (missing CUDA, missing extra, bad state)."""


def _internal_assert(cond: bool, msg: str) -> None:
    """Check an invariant of this package; failing it is a bug here, not a user error."""
    if not cond:
        raise ProfilingError(
            f"profiling internal error: {msg}. This is a bug in the profiling package, "
            "please report it with the code that triggered it."
        )
