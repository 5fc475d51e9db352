"""Excluded regions: modules whose saved tensors stay on the device, recorded (Rule 8).

The engine's side of ``ctx.exclude(module)``: forward hooks that open and
close an excluded region in the engine's per-thread state (Rule 12), the
``keep_after`` tail after the output head, and the warning for a region that
never ran. Head detection and torchtune's helper, which build on this, are in
``offload.regions``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._observers import _engines
from ._warn import user_stacklevel

if TYPE_CHECKING:
    from .engine import OffloadActivations

__all__ = ["RegionHandle", "exclude_module", "keep_after_module", "warn_unused_regions"]


class RegionHandle:
    """Removable handle of an excluded module (``remove()`` undoes it; idempotent)."""

    def __init__(self, handles: list[Any], name: str = "") -> None:
        self._handles = handles
        self.name = name
        """Class name of the excluded module (for messages)."""
        self.fired = 0
        """How many times the excluded module's forward has started."""
        self.warned = False
        self.optional: bool | Callable[[], bool] = False
        """True (or a callable returning True) when not running is expected: ``warn_unused_regions``
        then says nothing (another region covers it, or the model skips it by design)."""
        self._finalizer: weakref.finalize | None = None
        """Removes the hooks when the engine dies first; detached by ``remove()``."""
        self._engine_ref: Callable[[], Any] | None = None

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        """Remove the hooks and every registration made for them (nothing of it outlives the call)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        engine = self._engine_ref() if self._engine_ref is not None else None
        if engine is not None and self in engine._regions:
            engine._regions.remove(self)

    def __enter__(self) -> "RegionHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _active_engines() -> list[Any]:
    return _engines()


def exclude_module(engine: "OffloadActivations", module: nn.Module, *, keep_after: bool = False,
                   root: nn.Module | None = None) -> RegionHandle:
    """Keep tensors saved inside ``module``'s forward on the device, recorded (Rule 8).

    ``keep_after=True`` (the output head) also keeps what is saved after the
    module's forward until the next call of ``root`` (default: the engine's
    ``model``) or the next outermost entry of the engine: the loss computed
    inside or after the model is what backward needs first.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"OffloadActivations.exclude: module must be an nn.Module, got {type(module).__name__}. "
            "To exclude a code region rather than a module, use `with ctx.excluded():`."
        )

    handle = RegionHandle([], name=type(module).__name__)
    hooks = _region_hooks(weakref.ref(engine), weakref.ref(handle), module, keep_after)
    if keep_after:
        if root is None and engine._model_ref is not None:
            root = engine._model_ref()
        if root is not None and root is not module:
            hooks.append(root.register_forward_pre_hook(_new_call_hook(weakref.ref(engine))))
    handle._handles = hooks
    return _register(engine, handle)


def _region_hooks(eng_ref: Callable[[], Any], handle_ref: Callable[[], Any], module: nn.Module,
                  keep_after: bool) -> list[Any]:
    """The forward pre and post hooks that open and close ``module``'s region on the engine.

    Under a whole-model torch.compile, the engine's hooks only see the saved
    tensors after the compiled region ran, so a counter bumped while tracing
    would exclude nothing. Disabling dynamo on these hooks makes the compiler
    break the graph around the excluded module: its saved tensors are then
    packed while the region is still marked (two graph breaks, around the
    output head by default, in exchange for correct accounting). The hooks
    hold the engine weakly and are removed when it dies: a context rebuilt
    every step must not pin old engines (and their host pools). The region
    counts only on a thread where the engine is entered, and the post hook
    undoes only what its own pre hook did; the engine restores the thread's
    region state at its outermost exit, so a KeyboardInterrupt between the two
    hooks (always_call hooks do not run on it) cannot leave every later step
    excluded.
    """

    @torch._dynamo.disable
    def pre(mod: nn.Module, args: Any) -> None:
        eng = eng_ref()
        if eng is None or eng not in _active_engines():
            return
        st = eng._thread()
        st.excluded_depth += 1
        st.region_stack.append(mod)
        handle = handle_ref()
        if handle is not None:
            handle.fired += 1

    @torch._dynamo.disable
    def post(mod: nn.Module, args: Any, out: Any) -> None:
        eng = eng_ref()
        if eng is None:
            return
        st = eng._thread()
        for i in range(len(st.region_stack) - 1, -1, -1):
            if st.region_stack[i] is mod:
                del st.region_stack[i]
                st.excluded_depth -= 1
                if keep_after:
                    st.after_head = True
                return

    return [
        module.register_forward_pre_hook(pre),
        # always_call: the depth is restored even when the module's forward raises.
        module.register_forward_hook(post, always_call=True),
    ]


def _new_call_hook(eng_ref: Callable[[], Any]) -> Callable[[nn.Module, Any], None]:
    """A pre hook for the model's root: a new model call ends the tail after the head (Rule 8)."""

    @torch._dynamo.disable
    def new_call(mod: nn.Module, args: Any) -> None:
        eng = eng_ref()
        if eng is not None:
            eng._thread().after_head = False

    return new_call


def _register(engine: "OffloadActivations", handle: RegionHandle) -> RegionHandle:
    """Track ``handle`` on the engine (``warn_unused_regions``) until it is removed; its hooks go
    when the engine dies first. ``handle.remove()`` undoes both, so a region made per step leaves
    nothing behind."""
    engine._regions.append(handle)
    handle._engine_ref = weakref.ref(engine)
    handle._finalizer = weakref.finalize(engine, handle.remove)
    return handle


def keep_after_module(engine: "OffloadActivations", module: nn.Module) -> RegionHandle:
    """Keep what is saved after ``module``'s forward returns, until its next call (reason ``after_head``).

    For a model's body (``find_backbone``): whatever runs on its output (the
    head, the loss) is kept even when no head module runs, as with TRL's
    SFTTrainer, which multiplies by ``lm_head.weight`` itself (a fused,
    chunked head). The state is the one ``exclude_module(keep_after=True)``
    sets, so the engine's outermost entry resets it too.
    """
    eng_ref = weakref.ref(engine)

    @torch._dynamo.disable
    def pre(mod: nn.Module, args: Any) -> None:
        eng = eng_ref()
        if eng is not None and eng in _active_engines():
            eng._thread().after_head = False

    @torch._dynamo.disable
    def post(mod: nn.Module, args: Any, out: Any) -> None:
        eng = eng_ref()
        if eng is not None and eng in _active_engines():
            eng._thread().after_head = True
            handle.fired += 1

    hooks = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    handle = RegionHandle(hooks, name=f"after {type(module).__name__}")
    return _register(engine, handle)


def warn_unused_regions(engine: "OffloadActivations") -> None:
    """Warn once per excluded module whose forward never ran while the engine packed.

    The usual cause is a model compiled as a whole before the exclusion was
    registered: its cached graph does not run the new hooks, so the module's
    tensors are offloaded like the rest. Silence would hide exactly that.
    """
    for h in engine._regions:
        if h.active and h.fired == 0 and not h.warned and not (h.optional() if callable(h.optional) else h.optional):
            h.warned = True
            warnings.warn(
                f"OffloadActivations.exclude({h.name}): a step finished without that module's "
                "forward running under the engine, so nothing was excluded. If the model is "
                "torch.compile'd as a whole and was run before the exclusion was registered, its "
                "cached graph skips the exclusion hooks and the module's activations are offloaded. "
                "Fix: create the offload context (get_act_offloading_ctx_manager) before the first "
                "compiled call, or compile the blocks individually.",
                stacklevel=user_stacklevel(),
            )
    engine._regions = [h for h in engine._regions if h.active]
