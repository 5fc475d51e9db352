"""Saved-tensor hooks nested with an engine: who sees what, and a warning exactly where something is lost.

NOTE [ Nested hooks ]
Only the innermost ``saved_tensors_hooks`` run (pytorch/pytorch#70932). So:

1. A tensor saved while an engine's hooks are innermost is packed by that
   engine, and every pack observer on the thread sees it
   (``offload.add_pack_observer``: ``PackedBytesTracker``, ``MemProfiler``),
   whatever the nesting. An observer loses nothing, inside or around an engine.
2. An engine entered inside another context's hooks leaves that context
   nothing of what is saved inside the engine. Warned once per engine at its
   outermost enter, when that context would have recorded or moved it: another
   engine (its ledger stays empty for those tensors), TRL's engine,
   ``save_on_cpu``, a tracker running user pack functions. Not warned where
   nothing is lost: ``torch.utils.checkpoint``'s hooks, ``NoOpManager`` (identity
   hooks, invisible to accounting by design: Rule 8), a ``PackedBytesTracker``
   without user functions (it observes the engine's packs: rule 1).
3. A context entered inside an engine takes the tensors saved inside it away
   from the engine: not offloaded by it and not in its ledger. Its ``__enter__``
   cannot be intercepted, so the engine watches at module calls: while it is
   entered, each module call (``offload.modules``) checks that the innermost
   hooks are still the ones it pushed (one C call and a comparison), and the
   first call under another context's hooks warns once per engine, naming that
   context and the module, unless the context is one of rule 2's expected ones.
   Hooks entered and left with no module call between them are not seen.
4. Leaving an engine checks the nesting first (``check_exit``): an exit with no
   matching enter on this thread raises ``OffloadError`` and changes nothing.
   An exit while another context's hooks are innermost (misnested: one
   entered inside the engine is still open) leaves the engine all the same:
   its per-thread state is undone (enter depth, engine stack, module
   tracking, regions) and its hooks are taken out from under that context's,
   which stay innermost and in effect until that context exits
   (``_torch_private.remove_saved_tensors_hooks``); then it raises
   ``OffloadError`` naming the context. Later uses of this engine and of
   others behave as if it had been left in order.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

from . import _native, _torch_private
from ._warn import warn_user
from .errors import OffloadError
from .modules import _tls as _module_tls

__all__ = ["warn_if_inside_foreign_hooks", "hooks_owner", "check_exit", "leave_hooks", "misnested_error",
           "hooks_removed_error", "watch_inner_hooks", "unwatch_inner_hooks"]

_EXPECTED = ("torch.utils.checkpoint", "torch.distributed.algorithms._checkpoint", "offload.")
"""Modules whose hooks lose nothing around or inside an engine (checkpointing, our own regions)."""


def hooks_owner(pack_hook: Any) -> str:
    """``module.QualName`` of what installed a pack hook (an engine entered on this thread, whose hook may be
    the C++ one, bound to a tuple; else the bound method's class, else the function)."""
    from ._observers import _engines

    engine = next((e for e in _engines() if e._owns_pack_hook(pack_hook)), None)
    owner = engine if engine is not None else getattr(pack_hook, "__self__", None)
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


def _other_engine(engine: Any, hook: Any) -> Any:
    """The engine entered on this thread (not ``engine``) that pushed ``hook``, or None."""
    from ._observers import _engines  # an engine's native_hooks=True hook is a C++ object, ours all the same

    return next((e for e in _engines() if e is not engine and e._owns_pack_hook(hook)), None)


_HARMLESS_CODE: set[Any] = set()
"""Code objects of pack hooks found to lose nothing (checkpointing's closures are new per call, their
code is not): rule 3's check of a module call under them is one set lookup."""


def _loses_nothing(hook: Any, owner: str) -> bool:
    """Rule 2's expected contexts: checkpointing, our own, an observer of the engine's packs."""
    sees = getattr(getattr(hook, "__self__", None), "sees_engine_packs", None)
    if sees is not None:  # a PackedBytesTracker: it observes the engine (rule 1), its user functions do not
        return bool(sees)
    if owner.startswith(_EXPECTED):
        code = getattr(hook, "__code__", None)
        if code is not None and len(_HARMLESS_CODE) < 256:
            _HARMLESS_CODE.add(code)
        return True
    return False


def warn_if_inside_foreign_hooks(engine: Any) -> None:
    """Rule 2: warn once per engine when the hooks around its outermost enter lose what it saves."""
    if getattr(engine, "_warned_foreign_hooks", False):
        return
    top = _torch_private.top_saved_tensors_hooks()
    if top is None:
        return
    outer = _other_engine(engine, top[0])
    if outer is not None:
        engine._warned_foreign_hooks = True
        warn_user(
            f"{type(engine).__name__}: entered inside another engine ({outer!r}). Only the innermost hooks "
            "run, so this engine offloads and records what is saved inside it and the outer engine's "
            "ledger records nothing of it. Use one engine: keep regions on the device with "
            "ctx.exclude(module) or `with ctx.excluded():`, or leave one engine before entering the other."
        )
        return
    owner = hooks_owner(top[0])
    if _loses_nothing(top[0], owner):
        return
    engine._warned_foreign_hooks = True
    warn_user(
        f"{type(engine).__name__}: entered inside another saved-tensor hooks context ({owner}). Only the "
        "innermost hooks run, so this engine offloads what is saved inside it and the outer one sees "
        f"(and records) nothing of it. {_fix(owner)}"
    )


# -- rule 3: contexts entered inside an engine, seen at module calls ---------------------------


def watch_inner_hooks(engine: Any, hook: Any) -> Any:
    """At an enter that pushed ``hook`` (``engine`` is now innermost on this thread's engine stack): watch
    module calls for other hooks inside (rule 3). Returns ``hook``, which the engine's thread state keeps
    for this entry (``_ThreadState.watches``)."""
    _watch(engine, hook)
    return hook


def unwatch_inner_hooks() -> None:
    """After an exit took its engine off the engine stack and its entry's hook off its thread state: watch
    for the innermost engine still entered. Derived from those, not restored from what the enter saw: after
    a misnested exit (rule 4) exits do not mirror enters, and a restored watch would outlive its engine (and
    warn in its name inside a later engine)."""
    from ._observers import _engines

    engines = _engines()
    if not engines:
        _module_tls.watch = None
        return
    engine = engines[-1]
    hooks = engine._thread().watches
    _watch(engine, hooks[-1] if hooks else None)


def _watch(engine: Any, hook: Any) -> None:
    """Watch module calls for hooks other than ``hook`` inside ``engine``, unless it already warned (once
    an engine)."""
    if hook is None or getattr(engine, "_warned_inner_hooks", False):
        _module_tls.watch = None
    else:
        native = _native.loaded()  # its C read of the innermost pack hook, where some engine loaded it
        _module_tls.watch = (hook, lambda top, module: _inner_hooks(engine, top, module),
                             None if native is None else native.innermost_pack_hook)


def _inner_hooks(engine: Any, top: Any, module: Any) -> None:
    """``module`` runs while ``top`` (not the hooks ``engine`` pushed) are innermost: warn once if they
    lose what is saved inside them (rule 3); None means the engine's hooks are gone (its exit says so)."""
    if top is None or getattr(top[0], "__code__", None) in _HARMLESS_CODE:
        return
    if _other_engine(engine, top[0]) is not None:
        return  # an engine entered inside this one: it warned at its enter (rule 2)
    owner = hooks_owner(top[0])
    if _loses_nothing(top[0], owner):
        return
    from .modules import module_name

    engine._warned_inner_hooks = True
    _module_tls.watch = None  # said once: no more checks until the next enter (which skips them)
    warn_user(
        f"{type(engine).__name__}: another saved-tensor hooks context ({owner}) was entered inside this "
        f"engine (seen when {module_name(module)} ran). Only the innermost hooks run, so "
        "what is saved inside it bypasses the engine: not offloaded by it and not in its ledger. "
        f"{_fix(owner)}"
    )


# -- rule 4: leaving an engine ---------------------------------------------------------------


def check_exit(engine: Any, enter_depth: int) -> str:
    """Before an engine's ``__exit__`` pops hooks: where its hooks are on this thread's stack (rule 4):
    "innermost" (pop them), "buried" under another context's (take them out from under those), or
    "removed" (none on the stack). Raises, changing nothing, when the engine is not entered on this
    thread (``enter_depth`` 0)."""
    if enter_depth == 0:
        raise OffloadError(
            f"{type(engine).__name__}: __exit__ without a matching __enter__ on this thread "
            f"({threading.current_thread().name!r}). Enter the engine with `with ctx:` (or "
            "ctx.attach(model)) and leave it on the thread that entered it, once per entry."
        )
    top = _torch_private.top_saved_tensors_hooks()
    if top is None:
        return "removed"
    return "innermost" if engine._owns_pack_hook(top[0]) else "buried"


def leave_hooks(engine: Any, where: str, pop: Callable[..., Any], exc: tuple) -> OffloadError | None:
    """Take the engine's hooks off this thread's stack where ``check_exit`` found them: ``pop(*exc)``
    ("innermost"), out from under the inner context's, which stay innermost ("buried"), or nothing
    ("removed"). Returns the error to raise once the engine's own state is undone (None: in order)."""
    if where == "innermost":
        pop(*exc)
        return None
    if where == "buried":
        inner = hooks_owner(_torch_private.top_saved_tensors_hooks()[0])
        if _torch_private.remove_saved_tensors_hooks(engine._owns_pack_hook):
            return misnested_error(engine, inner)
    return hooks_removed_error()


def misnested_error(engine: Any, inner: str) -> OffloadError:
    """Rule 4: the engine was left while ``inner``'s hooks, entered inside it, were innermost."""
    return OffloadError(
        f"{type(engine).__name__}: left while a saved-tensor hooks context entered inside it ({inner}) is "
        "still open. The engine has left (its hooks were taken out from under that context's, which stay "
        "innermost and in effect until it exits): tensors saved until then go to that context, not to "
        "this engine. Leave contexts in the reverse order of entering them (nest `with` blocks)."
    )


def hooks_removed_error() -> OffloadError:
    return OffloadError(
        "OffloadActivations: this engine's saved-tensor hooks were removed by another context while "
        "it was entered (a saved_tensors_hooks context entered around it was left before it), so "
        "tensors saved since were neither offloaded nor recorded. Leave contexts in the reverse order "
        "of entering them (nest `with` blocks)."
    )
