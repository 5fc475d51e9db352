"""Which module's forward is running right now, and its stable name; shared by the engine and the profilers.

While any ``track_modules`` scope is open (in any thread), ``nn.Module.__call__``
is wrapped (``_tracked_call``) to maintain a per-thread stack of running
modules: it pushes the module object, calls the original, and pops in a
``finally``, so an exception never leaves an entry behind. NOTE [ Wrapper
lifetime ] says when the wrapper is installed and removed. Global forward
hooks would do the same at ~8x the cost per module call, because any global
hook sends every module call through ``_call_impl``'s slow path
(``python -m bench.hook_cost``: ``module_dispatch`` vs ``modules_only``). A
name is resolved lazily, when someone asks (``current_module_name()``, i.e.
per pack, not per module call), once per module while names stay valid
(``_names``: one dict read per pack).

# NOTE [ Module names ]
A module's name is its fully qualified name in its *root model*, prefixed by
the root's class name, the way torch's ``ModTracker`` / ``MemTracker`` (and so
``ModuleMemoryStats`` and the auto-AC ILP input) name modules:
``ToyLlama`` for the root, ``ToyLlama.layers.0.attn`` below it.

- The root is the outermost model passed to ``register_model`` (the trackers
  and profilers register the model they are given; the engine registers its
  ``model=``). A submodule of a registered model keeps its full name whichever
  module the user calls, so ``model.layers[0](x)`` still packs under
  ``ToyLlama.layers.0``.
- A module of no registered model is named from the outermost module seen
  running around it (that module becomes an implicit root), as before.
- A scope opened while module calls are already running on the thread (the
  engine entered by ``ctx.attach(model)``'s forward pre-hook, or ``with ctx:``
  inside a forward) starts its stack with those calls, read from the thread's
  frames (``_running_calls``): the root counts as running, so its buffers are
  kept and its modules named as a scope opened around the call names them.
- Wrapper components are dropped, so names do not change when a model is
  wrapped: ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module`` (FSDP1 and
  ``checkpoint_wrapper``), ``_orig_mod`` (``torch.compile``), and the ``module``
  of a root ``DistributedDataParallel``. FSDP2's ``fully_shard`` swaps a
  module's class to ``FSDP<Class>``; the root's label drops that ``FSDP``
  prefix. PEFT's ``base_model.model`` path is a real part of the model and is
  kept.

# NOTE [ Wrapper lifetime ]
Assigning ``nn.Module.__call__`` modifies the type of ``nn.Module`` and of every
subclass: CPython drops their attribute-cache version tags and deoptimizes the
bytecode specialized on them, and from Python 3.13 a class that has used 1,000
version tags is never cached again (``MAX_VERSIONS_PER_CLASS``): every method
call and attribute lookup on every module is slower for the rest of the process
(CPython 3.13.0, a toy subclass: 81 -> 140 ns per call after 1,200 swaps of its
base's ``__call__``; 3.11 and 3.12 have no such limit). So the wrapper is not
installed and removed once per step:

- It is installed when a scope opens, and stays while a scope is open *or an
  owner is alive*: an owner is the object that opened a scope with
  ``track_modules(owner=...)`` (the engine, the profilers), weakly held. A
  training loop that re-enters one engine every step changes the type once.
- It is removed when the last scope closes with no owner alive, or when the last
  owner dies with no scope open (a finalizer that never blocks: if the lock is
  held at that moment, the wrapper stays until the next scope closes).
- After ``_STICKY_AFTER`` installs in one process (owners built and freed over
  and over, e.g. an engine per step) it is never removed automatically again, so
  this module changes the type at most ``2 * _STICKY_AFTER`` times.
- ``uninstall()`` removes it now (benchmarks measuring peers without it, tests);
  it refuses while a scope is open.

Installed with no scope open on the calling thread, the wrapper costs one
Python frame per module call (~0.25 us on CPython 3.11).

# NOTE [ Module tracking in C ]
Where the C++ extension is loaded (``offload._native``: the engines' pack hook, built in the background
under ``native_hooks="auto"``), the wrapper installed is its ``ModuleCall``, which does what
``_tracked_call`` does without a Python frame (``bench.hook_cost``'s ``modules_only``: 61 instructions a
module call over an unwrapped call on its chain, where ``_tracked_call`` costs 4,052). What makes it
safe:

- It is installed only in a process that never installed ``_tracked_call``: the extension is attached
  before the first scope opens (an extension already built loads when the engine is made), or this
  process keeps ``_tracked_call``. Two reasons. Its view of this thread's scope is a mirror:
  ``_tls.scope`` stays the one source, and setting it (``stack`` or ``watch``) also sets the thread
  state's entry the C wrapper reads (``set_scope``), so a scope opened before the extension was
  attached has none. And torch.profiler's Python tracer reads ``nn.Module.__call__.__code__`` once, at
  its first start, to find module calls among frames: read while ``_tracked_call`` was installed, only
  its frames count, and under the C wrapper no module would be named. The C wrapper's ``__code__`` is
  the wrapped call's, whose frames run under either wrapper and under none.
- Dynamo cannot trace C code: the switch imports ``torch._dynamo`` (once) and registers a polyfill
  for the wrapper (``substitute_in_graph``) that is the plain call, what ``_tracked_call`` is under
  Dynamo. ``_compiler._is_compiling_flag`` (AOT tracing, export) is read by the C wrapper itself.
- The wrapper is a descriptor that binds to any module like a function (and is called unbound: no
  bound method per call), and reads back from the class as itself, so code that saves and restores
  ``nn.Module.__call__`` around its own patch (``torch.fx``'s symbolic tracing) puts back the same
  object. Where the polyfill cannot be registered (an older torch), the process keeps ``_tracked_call``.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from torch import nn

from ._torch_private import top_saved_tensors_hooks_c as _top_hooks

__all__ = ["track_modules", "current_module_name", "current_modules", "current_modules_view", "register_model",
           "module_name", "uninstall", "OUTPUT_OBSERVERS"]

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_global_users = 0
"""Open ``track_modules`` scopes, all threads together."""
_owners: "weakref.WeakSet[object]" = weakref.WeakSet()
"""Live objects that opened a scope with ``owner=``: the wrapper stays while any lives."""
_installs = 0
"""How many times this process wrapped ``nn.Module.__call__`` (NOTE [ Wrapper lifetime ])."""
_STICKY_AFTER = 8
"""Installs after which the wrapper is never removed automatically (bounded type changes)."""
OUTPUT_OBSERVERS: "list[Callable[[nn.Module, object], None]]" = []
"""Called with (module, output) after each outermost module call on a thread with a scope open (the KV cache
check of ``offload._kv_cache``): the one place that sees a model's output without a hook on the model."""


class _Local(threading.local):
    """This thread's module tracking; the class attributes are the defaults of a thread that never tracked.

    ``scope`` is the one thread-local read a module call makes (a ``threading.local`` read costs
    about as much as the rest of the push and pop): ``stack`` and ``watch`` are views of it, and
    setting either sets it.
    """

    scope: "tuple[list[nn.Module], tuple | None] | None" = None
    """(``stack``, ``watch``) while a scope is open on this thread; else None."""
    depth = 0
    """``track_modules`` scopes open on this thread."""
    _watch: "tuple[object, Callable[[object, nn.Module], None], Callable[[], object] | None] | None" = None

    @property
    def stack(self) -> "list[nn.Module] | None":
        """The running modules, outermost first, while a scope is open on this thread; else None."""
        scope = self.scope
        return None if scope is None else scope[0]

    @stack.setter
    def stack(self, stack: "list[nn.Module] | None") -> None:
        self._set_scope(None if stack is None else (stack, self._watch))

    @property
    def watch(self) -> "tuple | None":
        """(the pack hook the innermost engine entered on this thread pushed, what to call with the
        innermost hooks and the module about to run when they are not that hook, and what returns the
        innermost pack hook alone where the C++ extension is loaded, else None): set by the engine while
        entered (NOTE [ Nested hooks ] in offload/_foreign_hooks.py)."""
        return self._watch

    @watch.setter
    def watch(self, watch: "tuple | None") -> None:
        self._watch = watch
        scope = self.scope
        if scope is not None:
            self._set_scope((scope[0], watch))

    def _set_scope(self, scope: "tuple | None") -> None:
        self.scope = scope
        if _native_scope is not None:  # the C wrapper's mirror (NOTE [ Module tracking in C ])
            _native_scope(scope)


_tls = _Local()

_WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""Attribute names of wrappers that hold the real module; dropped from names."""

_roots: list[weakref.ref] = []
"""Registered root models (weakly held), outermost only."""
_implicit_roots: list[weakref.ref] = []
"""Outermost running modules of no registered model (named as before a registry existed)."""
_tables: "weakref.WeakKeyDictionary[nn.Module, dict[int, str]]" = weakref.WeakKeyDictionary()
"""Root -> {id(submodule): name}; rebuilt when a lookup misses (the model may have changed)."""
_cache: dict[int, tuple[weakref.ref, str]] = {}
"""id(module) -> (weak module, name); the hot-path lookup, cleared when roots change."""
_generation = [0]
"""Bumped whenever a ``_cache`` entry goes (roots changed, a module died)."""
_names: dict[int, str] = {}
"""id(module) -> name, for modules named in the current generation: the pack hook's lookup
(one dict read, no weak reference to call). Emptied whenever ``_generation`` is bumped, so
an entry's module is alive (its ``_cache`` entry's weak reference would have bumped it) and
its name current."""
_is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", None) or torch.compiler.is_compiling
"""True (constant-folded) while Dynamo traces; a plain ``return False`` in eager."""


class _CompilingFlag:
    """``torch.compiler``'s ``_is_compiling_flag`` for a torch that lacks the module attribute."""

    @property
    def _is_compiling_flag(self) -> bool:
        return torch.compiler.is_compiling()


_compiler: object = torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else _CompilingFlag()
"""Whose ``_is_compiling_flag`` says a compilation is running (AOT tracing after Dynamo, export)."""


def _clear_cache() -> None:
    _cache.clear()
    _names.clear()
    _generation[0] += 1


def _forget(key: int) -> None:
    _cache.pop(key, None)
    _names.clear()
    _generation[0] += 1


def _root_label(root: nn.Module) -> str:
    name = type(root).__name__
    if name.startswith("FSDP") and any(c.__name__ == "FSDPModule" for c in type(root).__mro__):
        name = name[4:]  # fully_shard's dynamic FSDP<Class>
    return name


def _build_table(root: nn.Module) -> dict[int, str]:
    label = _root_label(root)
    ddp = type(root).__name__ == "DistributedDataParallel"
    table: dict[int, str] = {}
    for qual, sub in root.named_modules(remove_duplicate=False):
        parts = qual.split(".") if qual else []
        if ddp and parts and parts[0] == "module":
            parts = parts[1:]
        parts = [p for p in parts if p not in _WRAPPER_COMPONENTS]
        # setdefault: a shared module keeps its first (shortest-path) name
        table.setdefault(id(sub), ".".join([label, *parts]))
    _tables[root] = table
    return table


def _live(refs: list[weakref.ref]) -> list[nn.Module]:
    out = [r() for r in refs]
    refs[:] = [r for r, m in zip(refs, out) if m is not None]
    return [m for m in out if m is not None]


def _contains(root: nn.Module, module: nn.Module) -> bool:
    table = _tables.get(root)
    if table is None or id(module) not in table:
        table = _build_table(root)
    return id(module) in table


def register_model(model: nn.Module) -> None:
    """Name ``model``'s modules from ``model`` (see NOTE [ Module names ]); cheap to call again.

    Held weakly. Registering a submodule of a registered model changes
    nothing; registering a model that contains registered ones makes it their
    root.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"register_model: expected an nn.Module, got {type(model).__name__}")
    with _lock:
        roots = _live(_roots)
        if any(r is model for r in roots):
            return
        if any(_contains(r, model) for r in roots):
            return
        _build_table(model)
        _roots[:] = [weakref.ref(r) for r in roots if not _contains(model, r)]
        _roots.append(weakref.ref(model))
        _clear_cache()


def _resolve(module: nn.Module, outermost: nn.Module | None) -> str:
    for root in _live(_roots):
        table = _tables.get(root) or _build_table(root)
        name = table.get(id(module))
        if name is None:  # modules may have been added since: look again once
            name = _build_table(root).get(id(module))
        if name is not None:
            return name
    implicit = _live(_implicit_roots)
    root = outermost if outermost is not None else module
    for r in implicit:
        if _contains(r, root):
            root = r
            break
    else:  # a new implicit root; it swallows the implicit roots it contains
        table = _build_table(root)
        _implicit_roots[:] = [weakref.ref(r) for r in implicit if id(r) not in table]
        _implicit_roots.append(weakref.ref(root))
        _clear_cache()
    return (_tables.get(root) or _build_table(root)).get(id(module), _root_label(module))


def module_name(module: nn.Module, outermost: nn.Module | None = None) -> str:
    """The stable name of ``module`` (NOTE [ Module names ]); ``outermost`` is the implicit root to use
    when it belongs to no registered model (default: the module itself)."""
    hit = _cache.get(id(module))
    if hit is not None and hit[0]() is module:
        return hit[1]
    with _lock:
        name = _resolve(module, outermost)
        key = id(module)
        _cache[key] = (weakref.ref(module, lambda _r, k=key: _forget(k)), name)
    return name


_CALL_CODES = frozenset(c.__code__ for c in (getattr(nn.Module, "_wrapped_call_impl", None), nn.Module._call_impl)
                        if c is not None)
"""Code of the frames that run one module call (``__call__``, then ``_call_impl``; a root compiled as a
whole runs its ``_call_impl`` through Dynamo, so ``__call__``'s frame is the one still there)."""


def _running_calls(frame: FrameType | None = None) -> list[tuple[FrameType, nn.Module]]:
    """The module calls running on this thread at ``frame`` (default: the caller's), innermost first:
    each call's frame (alive until the call returns) and its module. One frame per call: a module's
    ``__call__`` and ``_call_impl`` frames count once."""
    f = sys._getframe(1) if frame is None else frame
    calls: list[tuple[FrameType, nn.Module]] = []
    while f is not None:
        if f.f_code in _CALL_CODES:
            module = f.f_locals.get("self")
            if isinstance(module, nn.Module):
                if calls and calls[-1][1] is module and calls[-1][0].f_back is f:
                    calls[-1] = (f, module)  # the same call's __call__ frame, right above its _call_impl
                else:
                    calls.append((f, module))
        f = f.f_back
    return calls


def _tracked_call(self: nn.Module, *args, **kwargs):
    """``nn.Module.__call__`` while any ``track_modules`` scope is open: push, call, pop.

    Module forward hooks would do the same, but any global hook sends every
    module call in the process through ``_call_impl``'s slow path (~17k
    instructions a call: ``bench.hook_cost``'s ``module_dispatch``); this is
    one Python frame. Under torch.compile (Dynamo tracing, or the rest of a
    compilation) it is the plain call (no graph breaks); saved tensors of a
    compiled region are packed after it runs, in eager, and are attributed to
    the module that called it.
    """
    # Dynamo folds the first test to True, so it never traces the thread-local read.
    if _is_dynamo_compiling() or _compiler._is_compiling_flag:
        return _call(self, *args, **kwargs)
    scope = _tls.scope
    if scope is None:  # no scope open on this thread
        return _call(self, *args, **kwargs)
    stack, watch = scope
    if watch is not None:  # an engine is entered: are its hooks still the innermost?
        innermost = watch[2]
        if innermost is None:
            top = _top_hooks()
            if top is None or top[0] is not watch[0]:
                watch[1](top, self)
        elif innermost() is not watch[0]:  # the C read: no pair of hooks copied, no tuple made
            watch[1](_top_hooks(), self)
    i = len(stack)
    if not i and id(self) not in _names:
        _name_outermost(self)
    stack.append(self)
    try:
        # (No **kwargs when there are none: unpacking an empty dict into the call costs ~40 ns.)
        out = _call(self, *args, **kwargs) if kwargs else _call(self, *args)
    finally:
        # Back to this call's entry, also when an inner call raised (or its entry
        # is gone: the scope closed meanwhile and the stack was dropped). Most
        # often this call is on top: one pop, not a slice deletion.
        n = len(stack)
        if n > i and stack[i] is self:
            if n == i + 1:
                stack.pop()
            else:
                del stack[i:]
    if not i and OUTPUT_OBSERVERS:
        for observe in OUTPUT_OBSERVERS:
            observe(self, out)
    return out


def _name_outermost(module: nn.Module) -> None:
    """Name a module about to run outermost (it may be a new implicit root, which renames the
    modules below it), so that later lookups of the modules running inside it are current."""
    gen = _generation[0]
    _remember(module, module_name(module, module), gen)


def _remember(module: nn.Module, name: str, gen: int) -> None:
    """Put ``name`` in ``_names`` unless the generation moved on since ``gen`` was read (then it
    may be stale). Under the lock, so no full clear (``_clear_cache``, always locked) slips in
    between the test and the write."""
    with _lock:
        if _generation[0] == gen:
            _names[id(module)] = name


_call = nn.Module.__call__
"""The ``__call__`` that ``_tracked_call`` wraps (set again each time tracking starts)."""
_native_call: object = None
"""The C wrapper to install (``offload._native``'s ``ModuleCall``), once the extension is attached."""
_native_ext: Any = None
_native_scope: "Callable[[tuple | None], None] | None" = None
"""The extension's ``set_scope`` once attached: the mirror of ``_tls.scope`` the C wrapper reads."""
_polyfilled = False
_python_wrapper_used = False
"""Whether this process ever installed ``_tracked_call`` (then it never installs the C wrapper)."""


def attach_native(ext: Any) -> None:
    """Called by ``offload._native`` once the extension is loaded: configure its wrapper, which later
    installs replace ``_tracked_call`` with (NOTE [ Module tracking in C ])."""
    global _native_call, _native_ext, _native_scope
    if not hasattr(torch.compiler, "_is_compiling_flag"):
        return  # (a torch without the flag: the Python wrapper, which asks torch.compiler.is_compiling())
    from ._torch_private import top_saved_tensors_hooks_c

    with _lock:
        if _native_ext is not None:
            return
        _native_call = ext.configure_tracking({
            "call": _call, "compiler_dict": vars(torch.compiler), "flag_name": "_is_compiling_flag",
            "scope_key": f"{__name__}._tls.scope", "names": _names, "name_outermost": _name_outermost,
            "observers": OUTPUT_OBSERVERS, "top_hooks": top_saved_tensors_hooks_c,
        })
        _native_ext, _native_scope = ext, ext.set_scope
        _native_scope(_tls.scope)  # (this thread's; the wrapper is installed only before any scope opened)


def _installed() -> object:
    """What ``nn.Module`` holds as ``__call__``."""
    return vars(nn.Module).get("__call__")


def _register_polyfill() -> bool:
    """Dynamo traces the plain call where the C wrapper is installed (it cannot trace C code); False
    where it cannot be registered (a torch without ``substitute_in_graph``): then ``_tracked_call``."""
    global _polyfilled, _native_call
    if _polyfilled:
        return True
    try:
        import torch._dynamo

        def _traced_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _call(self, *args, **kwargs)

        torch._dynamo.substitute_in_graph(_native_call, skip_signature_check=True)(_traced_call)
    except Exception as e:  # (an older torch's Dynamo)
        _log.info("offload.modules: module tracking stays in Python (Dynamo cannot take the C wrapper: %s)", e)
        _native_call = None
        return False
    _polyfilled = True
    return True


def _install() -> None:
    """Route ``nn.Module.__call__`` through ``_tracked_call``, or the C wrapper where the extension is
    attached and ``_tracked_call`` was never installed (lock held; NOTE [ Module tracking in C ])."""
    global _call, _installs, _python_wrapper_used
    current = _installed()
    want = _tracked_call if _native_call is None or _python_wrapper_used else _native_call
    if want is _native_call and current is not want and not _register_polyfill():
        want = _tracked_call
    if current is not want:
        if current is not _tracked_call and current is not _native_call:
            _call = nn.Module.__call__
        if want is _native_call:
            _native_ext.set_call(_call)
        else:
            _python_wrapper_used = True
        nn.Module.__call__ = want
        _installs += 1
        if _installs == _STICKY_AFTER:
            _log.info(
                "offload.modules: nn.Module.__call__ wrapped %d times in this process (module-tracking owners "
                "built and freed over and over, e.g. an engine per step); it now stays wrapped, since each "
                "wrap changes the type of every module (NOTE [ Wrapper lifetime ]). "
                "offload.modules.uninstall() removes it.", _installs)


def _uninstall() -> None:
    """Restore ``nn.Module.__call__`` unless someone replaced it since (lock held)."""
    if _installed() in (_tracked_call, _native_call):
        nn.Module.__call__ = _call


def _settle() -> None:
    """Remove the wrapper when nothing needs it any more (lock held; NOTE [ Wrapper lifetime ])."""
    if _global_users == 0 and _installs < _STICKY_AFTER and not any(True for _ in _owners):
        _uninstall()


def _owner_gone() -> None:
    # A finalizer: it may run inside a garbage collection on any thread, also on
    # one that holds the lock, so it never blocks (the next closing scope settles).
    if _lock.acquire(blocking=False):
        try:
            _settle()
        finally:
            _lock.release()


def uninstall() -> None:
    """Restore ``nn.Module.__call__`` now, whatever owners are alive (the next scope wraps it again).

    For benchmarks that measure code without the wrapper, and for tests. Raises
    RuntimeError while a ``track_modules`` scope is open on any thread.
    """
    with _lock:
        if _global_users:
            raise RuntimeError(
                f"offload.modules.uninstall: {_global_users} track_modules scope(s) are open (an engine "
                "or a profiler is entered); call it after they exit."
            )
        _uninstall()


@contextmanager
def track_modules(owner: object | None = None) -> Iterator[None]:
    """Maintain the running-module stack for this thread while the scope is open.

    ``owner`` (the engine, a profiler; weakly held) keeps ``nn.Module.__call__``
    wrapped between its scopes while it lives, so re-entering it every step does
    not change the type of every module each time (NOTE [ Wrapper lifetime ]).
    """
    global _global_users
    with _lock:
        _global_users += 1
        if owner is not None and owner not in _owners:
            _owners.add(owner)
            weakref.finalize(owner, _owner_gone)
        _install()
    if _tls.depth == 0:
        # Calls already running (NOTE [ Module names ]): outermost first.
        _tls.stack = [m for _, m in reversed(_running_calls())]
    _tls.depth += 1
    try:
        yield
    finally:
        _tls.depth -= 1
        if _tls.depth == 0:
            _tls.stack = None
        with _lock:
            _global_users -= 1
            _settle()


def current_module_name() -> str:
    """Stable name of the innermost running module on this thread (NOTE [ Module names ]), "" if none."""
    stack = _tls.stack
    if not stack:
        return ""
    name = _names.get(id(stack[-1]))
    return name if name is not None else _name_running(stack)


def _name_running(stack: list[nn.Module]) -> str:
    """``current_module_name`` for a module not named yet in this generation (once per module)."""
    gen = _generation[0]
    module = stack[-1]
    outer = stack[0]
    hit = _cache.get(id(outer))
    if hit is None or hit[0]() is not outer:  # a new outermost module may be a new implicit root
        module_name(outer, outer)
    hit = _cache.get(id(module))
    if hit is not None and hit[0]() is module:
        name = hit[1]
    else:
        name = module_name(module, outer)
    _remember(module, name, gen)  # gen as read first: a name resolved across a bump is not kept
    return name


def current_modules() -> list[nn.Module]:
    """The running modules on this thread, outermost first."""
    stack = _tls.stack
    return list(stack) if stack else []


def current_modules_view() -> list[nn.Module]:
    """``current_modules()`` without the copy: this thread's live stack (read it, never change it)."""
    return _tls.stack or []
