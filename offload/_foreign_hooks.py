"""Another saved-tensor hooks context around an engine: say so once, with the fix.

Only the innermost ``saved_tensors_hooks`` run. When an engine is entered
inside another offloading context (TRL's ``SFTConfig(activation_offloading=True)``
engine around each training step, ``save_on_cpu``, a second copy of torchtune's
engine), this engine does the work for the tensors saved inside it and the
outer one silently records almost nothing: two engines are configured and one
is idle, and their ledgers disagree. Activation checkpointing's own hooks
(``torch.utils.checkpoint``) and this package's own contexts are expected
there and are not reported.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

from . import _torch_private
from ._warn import warn_user
from .errors import OffloadError

__all__ = ["warn_if_inside_foreign_hooks", "hooks_owner", "check_exit", "hooks_removed_error"]

_EXPECTED = ("torch.utils.checkpoint", "torch.distributed.algorithms._checkpoint", "offload.")
"""Modules whose hooks an engine is routinely entered inside (checkpointing, our own regions)."""


def hooks_owner(pack_hook: Any) -> str:
    """``module.QualName`` of what installed a pack hook (the bound method's class, else the function)."""
    owner = getattr(pack_hook, "__self__", None)
    obj = type(owner) if owner is not None and not inspect.ismodule(owner) else pack_hook
    qualname = getattr(obj, "__qualname__", type(obj).__name__)
    # A closure made in a constructor: name its class (X.__init__.<locals>.pack -> X).
    qualname = qualname.split(".<locals>", 1)[0].removesuffix(".__init__")
    return f"{getattr(obj, '__module__', '?')}.{qualname}"


def _fix(owner: str) -> str:
    if owner.startswith("trl."):
        return ("TRL's engine (SFTConfig(activation_offloading=True)) is on as well. Use one: set "
                "activation_offloading=False and keep this engine (OffloadCallback), or keep TRL's flag and "
                "make it build this engine with offload.compat.trl.patch_sft_trainer() before the trainer "
                "is built.")
    if "save_on_cpu" in owner:
        return ("torch.autograd.graph.save_on_cpu copies on the compute stream and is not accounted; drop it "
                "and let this engine offload the same tensors.")
    return "Enter only one of them."


def warn_if_inside_foreign_hooks(engine: Any) -> None:
    """Warn once per engine when the hooks around its outermost enter belong to another offloader."""
    if getattr(engine, "_warned_foreign_hooks", False):
        return
    top = _torch_private.top_saved_tensors_hooks()
    if top is None:
        return
    owner = hooks_owner(top[0])
    if owner.startswith(_EXPECTED):
        return
    from ._observers import _engines  # an outer engine's native_hooks=True hook is a C++ object, ours all the same

    if any(e is not engine and e._owns_pack_hook(top[0]) for e in _engines()):
        return
    engine._warned_foreign_hooks = True
    warn_user(
        f"{type(engine).__name__}: entered inside another saved-tensor hooks context ({owner}). Only the "
        "innermost hooks run, so this engine offloads what is saved inside it and the outer one sees "
        f"(and records) nothing of it. {_fix(owner)}"
    )


def check_exit(engine: Any, enter_depth: int) -> bool:
    """Before an engine's ``__exit__`` pops hooks: it is entered on this thread (``enter_depth``) and
    its hooks are the innermost (else popping would remove another context's). False when its hooks
    are already gone (``hooks_removed_error`` after the engine's own bookkeeping)."""
    if enter_depth == 0:
        raise OffloadError(
            f"{type(engine).__name__}: __exit__ without a matching __enter__ on this thread "
            f"({threading.current_thread().name!r}). Enter the engine with `with ctx:` (or "
            "ctx.attach(model)) and leave it on the thread that entered it, once per entry."
        )
    top = _torch_private.top_saved_tensors_hooks()
    if top is None:
        return False
    if not engine._owns_pack_hook(top[0]):
        raise OffloadError(
            f"{type(engine).__name__}: left while the innermost saved-tensor hooks are another context's "
            f"({hooks_owner(top[0])}): one entered inside the engine is still open, or one entered around "
            "it was left first and took the engine's hooks with it. Leaving now would remove that "
            "context's hooks, so nothing is popped. Leave contexts in the reverse order of entering them "
            "(nest `with` blocks)."
        )
    return True


def hooks_removed_error() -> OffloadError:
    return OffloadError(
        "OffloadActivations: this engine's saved-tensor hooks were removed by another context while "
        "it was entered (a saved_tensors_hooks context entered around it was left before it), so "
        "tensors saved since were neither offloaded nor recorded. Leave contexts in the reverse order "
        "of entering them (nest `with` blocks)."
    )
