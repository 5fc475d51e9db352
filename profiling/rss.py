"""RSSTracker: host resident memory before and after each module's forward.

RSS (``psutil.Process().memory_info().rss``) is what the OS has resident for
the process: host tensors, pinned offload buffers once touched, the Python
heap. It cannot attribute bytes to tensors, but its per-module deltas show
where host memory grows during a forward (e.g. an offload engine filling its
host pool). All state lives in the tracker: nothing is attached to the
modules and nothing is global; ``remove()`` (or leaving the ``with`` block)
takes every hook off.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
from torch import nn
from torch.utils.hooks import RemovableHandle

from offload.modules import module_name, register_model

from . import _engine
from .errors import ProfilingError
from .report import format_table, write_json

__all__ = ["RSSTracker"]

_FIELDS = ("calls", "delta_bytes", "max_delta_bytes", "rss_pre_forward", "rss_post_forward", "min_delta_bytes")


class RSSTracker:
    """Per-module host-RSS deltas across forward calls.

    ```python
    with RSSTracker(model) as r:
        model(x)
    r.summary()["ToyLlama.layers.0"]["delta_bytes"]
    ```

    For each module (named as the offload engine's ledger names it, e.g.
    ``ToyLlama.layers.0.attn``, see NOTE [ Module names ] in ``offload.modules``):
    ``calls``; ``delta_bytes``, the RSS growth inside its forwards summed over
    calls since the last reset; the largest and smallest single-call growth;
    and ``rss_pre_forward`` / ``rss_post_forward``, the RSS around the call
    that grew it most, so ``rss_post_forward - rss_pre_forward ==
    max_delta_bytes`` always holds. (They used to be the latest call's bounds,
    which for most calls are equal while the summed delta is not: RSS moves
    in pages, in a few calls.)
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"RSSTracker: model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self.handles: list[RemovableHandle] = []
        """The forward hook handles this tracker installed (empty when not active)."""
        self._proc = psutil.Process()
        self._stack: ExitStack | None = None
        self._calls: list[tuple[nn.Module, str, int]] = []
        register_model(model)
        self.reset()

    def __enter__(self) -> RSSTracker:
        if self._stack is not None:
            raise ProfilingError("RSSTracker: already active; leave the first `with` block before re-entering")
        stack = ExitStack()
        stack.enter_context(_engine.track_modules(owner=self))
        stack.callback(self.remove)
        for m in self.model.modules():
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post, always_call=True))
        self._stack = stack
        self._rss_enter = self._proc.memory_info().rss
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        self._rss_exit = self._proc.memory_info().rss

    def remove(self) -> None:
        """Take every hook this tracker installed off the model."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._calls.clear()

    def reset(self) -> None:
        """Forget the recorded figures (hooks stay installed)."""
        self._stats: dict[str, dict[str, int]] = {}
        self._rss_enter = self._rss_exit = None
        self._peak = 0

    # ------------------------------------------------------------------ hooks
    def _pre(self, module: nn.Module, args: Any) -> None:
        name = module_name(module)  # the model is registered: the ledger's name for it
        rss = self._proc.memory_info().rss
        self._peak = max(self._peak, rss)
        self._calls.append((module, name, rss))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        for i in range(len(self._calls) - 1, -1, -1):
            if self._calls[i][0] is module:
                _, name, pre = self._calls[i]
                del self._calls[i:]
                break
        else:
            return  # hooks installed mid-forward: no matching pre
        post = self._proc.memory_info().rss
        self._peak = max(self._peak, post)
        delta = post - pre
        s = self._stats.get(name)
        if s is None:
            s = self._stats[name] = {
                "calls": 0,
                "rss_pre_forward": pre,
                "rss_post_forward": post,
                "delta_bytes": 0,
                "max_delta_bytes": delta,
                "min_delta_bytes": delta,
            }
        s["calls"] += 1
        s["delta_bytes"] += delta
        if delta > s["max_delta_bytes"]:
            s["max_delta_bytes"] = delta
            s["rss_pre_forward"], s["rss_post_forward"] = pre, post
        s["min_delta_bytes"] = min(s["min_delta_bytes"], delta)

    # ---------------------------------------------------------------- results
    def summary(self) -> dict[str, dict[str, int]]:
        """``{module name: {calls, rss_pre_forward, rss_post_forward, delta_bytes, max_delta_bytes, min_delta_bytes}}``."""
        return {k: dict(v) for k, v in self._stats.items()}

    def totals(self) -> dict[str, int | None]:
        """RSS at entry and exit of the ``with`` block and the highest RSS any hook saw."""
        return {"rss_enter": self._rss_enter, "rss_exit": self._rss_exit, "peak_rss_seen": self._peak}

    def table(self, unit: str = "auto") -> str:
        rows = [{"module": k, **v} for k, v in sorted(self._stats.items(), key=lambda kv: -kv[1]["delta_bytes"])]
        return format_table(
            rows,
            ["module", *_FIELDS],
            title="Host RSS growth inside each module's forward (pre/post: around its largest-growth call)",
            byte_columns=[f for f in _FIELDS if f != "calls"],
            unit=unit,
        )

    def to_json(self, path: str | Path) -> Path:
        return write_json({"modules": self.summary(), **self.totals()}, path)
