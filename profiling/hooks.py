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

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["HookContext", "npp_rss_pre_forward", "npp_rss_post_forward", "reset_memory_hooks_state"]


class HookContext:
    """What a memory hook sees: the current module call and the profiler's counters."""

    def __init__(self, rss: Callable[[], int], npp: Callable[[], int], npp_unique: Callable[[], int]) -> None:
        self.rss = rss
        """Host RSS now, in bytes."""
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
