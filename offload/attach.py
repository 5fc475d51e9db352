"""Attach an engine to a model: offload every forward of it with no change to the loop.

``ctx.attach(model)`` enters the engine in a forward pre-hook of the root
module and leaves it in an always-called forward hook, so whatever calls the
model (a Trainer, a recipe, a user loop) offloads its forward, and backward
runs outside the engine as in torchtune's usage.

NOTE [ Attach rules ]
Rule 1. One enter per outermost call: a model called inside its own forward
        (a nested call) does not enter again; the depth is per thread.
Rule 2. The exit hook is registered with ``always_call=True``, so a forward
        that raises an Exception still leaves the engine (and its module
        tracking). PyTorch skips those hooks for a BaseException that is not
        an Exception (KeyboardInterrupt, SystemExit), so the next call of the
        model, or ``handle.remove()``, repairs the state: an outer call is
        real only while its frame is still on this thread's stack.
Rule 3. If the caller already entered this engine (``with ctx:`` around the
        call), the hooks do nothing: entering twice would record twice.
Rule 4. The hooks are excluded from torch.compile (``torch._dynamo.disable``):
        compile blocks (submodules) freely; a root compiled as a whole gets a
        graph break at each hook, so the engine is still entered eagerly.
Rule 5. An attached call decides and names exactly as ``with ctx:`` around it:
        the engine enters after the root's call began, so its module tracking
        starts with the calls already running (NOTE [ Module names ] in
        offload/modules.py): the root's own buffers are kept and its modules
        get their qualified names.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._warn import warn_user
from .errors import OffloadError
from ._observers import active_engine
from .modules import OUTPUT_OBSERVERS, _running_calls

if TYPE_CHECKING:
    from .engine import OffloadActivations

__all__ = ["AttachHandle", "attach"]

log = logging.getLogger(__name__)


class _CallState(threading.local):
    """Per-thread state of the outermost call in progress (Rule 1)."""

    depth = 0
    entered = False
    outer: FrameType | None = None


def _call_frame() -> FrameType | None:
    """The frame of the module call whose pre-hook is running (live until its forward returns)."""
    calls = _running_calls(sys._getframe(2))
    return calls[0][0] if calls else None


def _on_stack(frame: FrameType | None) -> bool:
    if frame is None:
        return True  # no frame to check against (root compiled as a whole): trust the depth
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


class AttachHandle:
    """Removable handle of ``ctx.attach(model)``; ``remove()`` detaches (idempotent).

    Also a context manager: ``with ctx.attach(model): trainer.fit()``.
    """

    def __init__(self, engine: "OffloadActivations", model: nn.Module) -> None:
        self.engine: "OffloadActivations | None" = engine
        """The attached engine (held by the model's hooks until ``remove()``)."""
        self.model_name = type(model).__name__
        """Class name of the attached model (for messages)."""
        self.calls = 0
        """Outermost forward calls that entered the engine."""
        self._state = _CallState()
        self._hooks: list[Any] = []

    @property
    def active(self) -> bool:
        """True until ``remove()``."""
        return bool(self._hooks)

    def remove(self) -> None:
        """Remove the hooks, leaving the engine first if a forward was interrupted (Rule 2)."""
        self._repair_if_stale(force=True)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.engine = None

    def __enter__(self) -> "AttachHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # -- the hooks ---------------------------------------------------------------

    def _pre(self, module: nn.Module, args: Any) -> None:
        st = self._state
        if st.depth > 0:
            if _on_stack(st.outer):
                st.depth += 1  # a nested call (Rule 1)
                return
            self._repair_if_stale()
        eng = self.engine
        st.outer = _call_frame()
        st.depth = 1
        st.entered = False
        if eng is None:
            return
        if active_engine() is eng:
            return  # Rule 3
        eng.__enter__()
        st.entered = True
        self.calls += 1

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        st = self._state
        if st.depth <= 0:
            return  # attached while this forward was already running
        st.depth -= 1
        if st.depth == 0:
            exc = sys.exc_info()
            if st.entered and exc[0] is None and OUTPUT_OBSERVERS:
                # The model's output, as `with ctx:` shows it (its outermost call ran before the engine's
                # module tracking opened, so the tracked call cannot): the KV-cache warning reads it.
                for observe in OUTPUT_OBSERVERS:
                    observe(module, output)
            # Inside torch's `except Exception` when forward raised: hand the
            # exception to the engine so it releases in-flight sources now.
            self._leave(exc)

    def _leave(self, exc: tuple[Any, Any, Any]) -> None:
        st = self._state
        st.depth = 0
        st.outer = None
        if not st.entered:
            return
        st.entered = False
        eng = self.engine
        if eng is not None:
            eng.__exit__(*exc)

    def _repair_if_stale(self, force: bool = False) -> None:
        """Leave an engine a BaseException left entered (Rule 2)."""
        st = self._state
        if st.depth <= 0 or (not force and _on_stack(st.outer)):
            return
        # (force: remove() inside the model's forward leaves at once, since
        # the exit hook is about to be removed.)
        log.info("attach(%s): leaving the engine after an interrupted forward", self.model_name)
        try:
            self._leave((None, None, None))
        except OffloadError as e:
            # Other hooks were entered since: the engine has left all the same, theirs kept in place
            # (NOTE [ Nested hooks ] rule 4 in offload/_foreign_hooks.py).
            warn_user(f"OffloadActivations.attach({self.model_name}): a forward was interrupted (e.g. by "
                      f"KeyboardInterrupt) and left the engine entered; leaving it now. {e}")


def attach(engine: "OffloadActivations", model: nn.Module) -> AttachHandle:
    """Enter ``engine`` around every forward of ``model``; returns a removable handle.

    See NOTE [ Attach rules ]. Attach the model the loop calls (the root),
    not a block: the engine's ledger closes a step at the end of backward.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"OffloadActivations.attach: model must be an nn.Module, got {type(model).__name__}. "
            "Pass the module your training loop calls."
        )
    handle = AttachHandle(engine, model)
    # Dynamo must not trace into enter/exit (Rule 4).
    pre = torch._dynamo.disable(handle._pre)
    post = torch._dynamo.disable(handle._post)
    handle._hooks = [
        model.register_forward_pre_hook(pre),
        model.register_forward_hook(post, always_call=True),
    ]
    # The hooks hold the handle and the handle the engine: an attached engine
    # lives as long as the model's hooks, so `OffloadActivations().attach(m)`
    # needs no variable. remove() drops both.
    log.debug("attached %r to %s", engine, type(model).__name__)
    return handle

