"""``PredictError``: a step that cannot be predicted (its own module, so every stage can raise it)."""

from __future__ import annotations

from ..errors import OffloadError

__all__ = ["PredictError"]


class PredictError(OffloadError):
    """A step that cannot be predicted (an op the fake run cannot handle, a bad argument)."""
