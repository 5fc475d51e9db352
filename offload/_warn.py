"""Warnings that point at the user's line, whichever offload entry point was used.

A fixed ``stacklevel`` is right for one call path only: the same warning is
raised from ``OffloadActivations(...)``, through ``from_config``, through
``get_act_offloading_ctx_manager`` or an integration callback. This walks out
of this package (and of torch, for warnings raised from autograd callbacks,
and of the trainers that call our callbacks) to the first frame that is the user's. Python 3.12's ``skip_file_prefixes``
does the same, but the project supports 3.10.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_SKIP = (
    _HERE + os.sep,
    # offload.profiling: inside this folder when installed, the repo's sibling profiling/ in a checkout
    os.path.join(os.path.dirname(_HERE), "profiling") + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)
_FRAMEWORKS = ("transformers", "trl", "accelerate", "peft", "lightning", "pytorch_lightning")
"""Trainers that call our callbacks: a warning raised in a callback points past them, at the user's
``trainer.train()`` / ``trainer.fit()`` line (only those already imported are looked up)."""


_PACKAGES = frozenset({"offload", "torch", *_FRAMEWORKS})
"""Top-level modules skipped by name too: code they generate (a dataclass's ``__init__``, file
``<string>``) runs with their module's globals."""


def _skip_prefixes() -> tuple[str, ...]:
    dirs = [os.path.dirname(os.path.abspath(m.__file__)) + os.sep
            for m in map(sys.modules.get, _FRAMEWORKS) if m is not None and getattr(m, "__file__", None)]
    return _SKIP + tuple(dirs)


def user_stacklevel() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` called by our caller) of the first user frame."""
    frame = sys._getframe(1)  # the function that will call warnings.warn: level 1
    level = 1
    skip = _skip_prefixes()
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(skip)
                                 or frame.f_globals.get("__name__", "").partition(".")[0] in _PACKAGES):
        frame = frame.f_back
        level += 1
    return level


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside offload and torch."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
