"""MemProfiler module hooks: the state they share and the default npp/RSS hooks.

Hook state lives in a ``HookContext`` owned by one MemProfiler: nothing is
stored on modules and nothing is global. Values are kept per module (by the
engine's qualified name, e.g. ``ToyLlama.layers.0``) and, for the outermost
hooked call(s), in ``ctx.totals``: that is what the snapshot's top-level keys
show, so they are non-zero whenever any hooked module ran (the seed read the
wrapper object's own attributes, which stayed zero when only a child ran).

Semantics of the default hooks, since the last reset:
``*_pre_forward`` / ``*_post_forward`` are the latest call's bounds;
``*_diff`` is summed over calls (the seed overwrote ``npp_diff`` but summed
``rss_diff``). ``npp`` is the saved-for-backward non-parameter bytes counted
by the profiler's PackedBytesTracker; ``npp_unique`` its distinct-storage bytes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

__all__ = [
    "HookContext",
    "npp_rss_pre_forward",
    "npp_rss_post_forward",
    "reset_memory_hooks_state",
    "adapt_forward_hook",
]


class HookContext:
    """What a memory hook sees: the current module call and the profiler's counters."""

    def __init__(self, rss: Callable[[], int], npp: Callable[[], int], npp_unique: Callable[[], int],
                 mem_info: Callable[[], Any] | None = None) -> None:
        self.rss = rss
        """Host RSS now, in bytes."""
        self.mem_info_handle = mem_info
        """``psutil.Process().memory_info`` (what FTS hooks read as ``module.mem_info_handle``)."""
        self.npp = npp
        """Non-parameter saved-for-backward bytes counted so far in the collected call."""
        self.npp_unique = npp_unique
        """Distinct-storage bytes among those."""
        self.values: dict[str, dict[str, int]] = {}
        """Per-module hook values, by qualified module name."""
        self.totals: dict[str, int] = {}
        """Hook values of the outermost hooked calls: the snapshot's top-level keys."""
        self.name = ""
        """Qualified name of the module whose hook is running."""
        self.module: nn.Module | None = None
        self.model: nn.Module | None = None
        """The profiled model (what an FTS reset hook receives as ``model``)."""
        self.depth = 0
        """Nesting depth of the running call among hooked modules; 0 is outermost."""
        self.frame: dict[str, Any] = {}
        """Scratch shared by the pre and post hooks of one call (e.g. values at pre-forward)."""

    @property
    def outermost(self) -> bool:
        return self.depth == 0

    def set(self, attr: str, value: int) -> None:
        """Overwrite ``attr`` for the running module (and the totals if outermost)."""
        self.values.setdefault(self.name, {})[attr] = value
        if self.depth == 0:
            self.totals[attr] = value

    def add(self, attr: str, delta: int) -> None:
        """Accumulate ``attr`` for the running module (and the totals if outermost)."""
        mod = self.values.setdefault(self.name, {})
        mod[attr] = mod.get(attr, 0) + delta
        if self.depth == 0:
            self.totals[attr] = self.totals.get(attr, 0) + delta

    def clear(self) -> None:
        self.values.clear()
        self.totals.clear()

    def modules(self) -> Iterator[_FTSModuleView]:
        """FTS compatibility: views of the profiled modules for a reset hook written as
        ``hook(model, attrs)`` that does ``for m in model.modules(): setattr(m, attr, 0)``."""
        model = self.model
        if model is None:
            return iter(())
        from offload.modules import module_name

        return (_FTSModuleView(self, m, module_name(m), 0 if m is model else 1) for m in model.modules())


class _FTSModuleView:
    """What an FTS-style hook ``hook(module, *args)`` gets instead of the module.

    FTS hooks read ``module.mem_info_handle()`` and store their results as
    module attributes. The view serves ``mem_info_handle`` from the profiler,
    records attribute writes as the module's hook values (and in the snapshot's
    top-level totals for the outermost call), reads them back, and forwards
    every other read to the module. Nothing is written on the module.
    """

    __slots__ = ("_ctx", "_module", "_name", "_depth")

    def __init__(self, ctx: HookContext, module: nn.Module, name: str, depth: int) -> None:
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_depth", depth)

    def __getattr__(self, attr: str) -> Any:
        ctx = self._ctx
        if attr == "mem_info_handle" and ctx.mem_info_handle is not None:
            return ctx.mem_info_handle
        vals = ctx.values.get(self._name)
        if vals is not None and attr in vals:
            return vals[attr]
        return getattr(self._module, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        ctx = self._ctx
        ctx.values.setdefault(self._name, {})[attr] = value
        if self._depth == 0:
            ctx.totals[attr] = value

    def modules(self) -> Iterator[_FTSModuleView]:
        from offload.modules import module_name

        return (_FTSModuleView(self._ctx, m, module_name(m), 0 if m is self._module else 1)
                for m in self._module.modules())


def _is_module_style(hook: Callable[..., Any]) -> bool:
    """True for FTS-style ``hook(module, *args)``; False for this package's ``hook(ctx)``."""
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return False
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var = any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())
    return var or len(positional) >= 2


def adapt_forward_hook(hook: Callable[..., Any], kind: str) -> Callable[[HookContext], Any]:
    """Return ``hook`` as a ``hook(ctx)``; an FTS-style ``hook(module, *args)`` is wrapped.

    The wrapper calls it as torch calls a forward pre hook, ``hook(view, args)``,
    or forward hook, ``hook(view, args, output)`` (``kind`` says which), with
    a module view (see ``_FTSModuleView``). Differences from FTS: ``args`` and
    ``output`` are not available to the wrapper and are passed as ``()`` and
    ``None``; values land in the profiler's per-module hook values, not on the
    module; a global counter the hook keeps (FTS's ``_npp_bytes``) is its own.
    """
    if not _is_module_style(hook):
        return hook
    post = kind == "post_forward_hooks"

    def fts_adapter(ctx: HookContext) -> None:
        view = _FTSModuleView(ctx, ctx.module, ctx.name, ctx.depth)  # type: ignore[arg-type]
        if post:
            hook(view, (), None)
        else:
            hook(view, ())

    fts_adapter.__wrapped__ = hook  # type: ignore[attr-defined]
    return fts_adapter


def npp_rss_pre_forward(ctx: HookContext) -> None:
    """Record npp and RSS before the forward."""
    npp, uniq, rss = ctx.npp(), ctx.npp_unique(), ctx.rss()
    ctx.frame.update(npp=npp, npp_unique=uniq, rss=rss)
    ctx.set("npp_pre_forward", npp)
    ctx.set("rss_pre_forward", rss)


def npp_rss_post_forward(ctx: HookContext) -> None:
    """Record npp and RSS after the forward and add this call's growth to the diffs."""
    npp, uniq, rss = ctx.npp(), ctx.npp_unique(), ctx.rss()
    ctx.set("npp_post_forward", npp)
    ctx.set("rss_post_forward", rss)
    ctx.add("npp_diff", npp - ctx.frame.get("npp", npp))
    ctx.add("npp_unique_diff", uniq - ctx.frame.get("npp_unique", uniq))
    ctx.add("rss_diff", rss - ctx.frame.get("rss", rss))


_RSS_LEVELS = ("rss_pre_forward", "rss_post_forward")
_NPP_LEVELS = ("npp_pre_forward", "npp_post_forward")


def reset_memory_hooks_state(ctx: HookContext, attrs: Sequence[str]) -> None:
    """Forget every module's values; the totals restart from "now" (RSS levels, npp count, zero diffs).

    Starting levels at the current value rather than 0 keeps a ``start`` entry
    truthful: nothing has run yet, so pre == post == now and every diff is 0.
    """
    ctx.clear()
    rss, npp = ctx.rss(), ctx.npp()
    for a in attrs:
        ctx.totals[a] = rss if a in _RSS_LEVELS else npp if a in _NPP_LEVELS else 0
