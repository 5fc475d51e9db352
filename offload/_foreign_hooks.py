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
from typing import Any

from . import _torch_private
from ._warn import warn_user

__all__ = ["warn_if_inside_foreign_hooks", "hooks_owner"]

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
