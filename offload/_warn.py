"""Warnings that point at the user's line, whichever offload entry point was used.

A fixed ``stacklevel`` is right for one call path only: the same warning is
raised from ``OffloadActivations(...)``, through ``from_config``, through
``get_act_offloading_ctx_manager`` or an integration callback. This walks out
of this package (and of torch, for warnings raised from autograd callbacks)
to the first frame that is the user's. Python 3.12's ``skip_file_prefixes``
does the same, but the project supports 3.10.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

_SKIP = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def user_stacklevel() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` called by our caller) of the first user frame."""
    frame = sys._getframe(1)  # the function that will call warnings.warn: level 1
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIP):
        frame = frame.f_back
        level += 1
    return level


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside offload and torch."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
