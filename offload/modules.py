"""Which module's forward is running right now, shared by the engine and the profilers.

One pair of process-wide forward hooks (registered while any ``track_modules``
scope is open, in any thread) maintains a per-thread stack of running modules.
Names are qualified from the outermost module seen, e.g.
``ToyLlama.layers.0.attn``, so the engine's ledger and the trackers agree.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

__all__ = ["track_modules", "current_module_name", "current_modules"]

_lock = threading.Lock()
_global_users = 0
_global_handles: list = []
_tls = threading.local()
# root module -> {module: qualified name}; weak so models can be freed.
_names: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakKeyDictionary[nn.Module, str]]" = (
    weakref.WeakKeyDictionary()
)


def _thread_state() -> tuple[list[tuple[nn.Module, str]], list[int]]:
    st = getattr(_tls, "stack", None)
    if st is None:
        st = _tls.stack = []
        _tls.depth = [0]
    return st, _tls.depth


def _name_of(module: nn.Module, stack: list[tuple[nn.Module, str]]) -> str:
    if stack:
        root = stack[0][0]
        table = _names.get(root)
        if table is not None:
            name = table.get(module)
            if name is not None:
                return name
        return f"{stack[-1][1]}.{type(module).__name__}"
    table = _names.get(module)
    if table is None:
        table = weakref.WeakKeyDictionary()
        prefix = type(module).__name__
        for qual, sub in module.named_modules(remove_duplicate=False):
            table.setdefault(sub, f"{prefix}.{qual}" if qual else prefix)
        _names[module] = table
    return table[module]


def _pre_hook(module: nn.Module, args) -> None:
    # Under torch.compile tracing this is a constant no-op, so the hooks add
    # no graph breaks; saved tensors of a compiled region are packed after it
    # runs, in eager, and are attributed to the module that called it.
    if torch.compiler.is_compiling():
        return
    stack, depth = _thread_state()
    if depth[0] <= 0:
        return
    stack.append((module, _name_of(module, stack)))


def _post_hook(module: nn.Module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    stack, depth = _thread_state()
    if depth[0] <= 0:
        return
    # always_call=True: runs on exceptions too. Pop back to this module even if
    # an inner module raised before its own post hook could run.
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][0] is module:
            del stack[i:]
            return


@contextmanager
def track_modules() -> Iterator[None]:
    """Maintain the running-module stack for this thread while the scope is open."""
    global _global_users
    with _lock:
        if _global_users == 0:
            _global_handles.append(register_module_forward_pre_hook(_pre_hook))
            _global_handles.append(register_module_forward_hook(_post_hook, always_call=True))
        _global_users += 1
    stack, depth = _thread_state()
    depth[0] += 1
    try:
        yield
    finally:
        depth[0] -= 1
        if depth[0] == 0:
            stack.clear()
        with _lock:
            _global_users -= 1
            if _global_users == 0:
                for h in _global_handles:
                    h.remove()
                _global_handles.clear()


def current_module_name() -> str:
    """Qualified name of the innermost running module on this thread, "" if none."""
    stack = getattr(_tls, "stack", None)
    return stack[-1][1] if stack else ""


def current_modules() -> list[nn.Module]:
    """The running modules on this thread, outermost first."""
    stack = getattr(_tls, "stack", None)
    return [m for m, _ in stack] if stack else []
