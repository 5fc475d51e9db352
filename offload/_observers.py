"""Who is watching the engine: the thread's stack of entered engines and the pack observers.

The lowest layer of the engine: it imports no other part of it, so the
regions, ``attach``, the C++ pack hook and the profilers can find the active
engine and watch its packs without importing ``offload.engine``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.hooks import RemovableHandle

from .ledger import PackRecord

if TYPE_CHECKING:
    from .engine import OffloadActivations

__all__ = ["PackEvent", "active_engine", "add_pack_observer"]


@dataclass(frozen=True, slots=True)
class PackEvent:
    """What an observer sees for every tensor the engine packs."""

    tensor: torch.Tensor
    """The tensor autograd saved (do not keep a reference: it defeats offloading)."""
    record: PackRecord
    """The ledger record of the decision."""
    engine: "OffloadActivations"
    """The engine that made the decision."""


_tls = threading.local()
"""This thread's engine stack (``engines``) and global observers (``observers``)."""


def _engines() -> list["OffloadActivations"]:
    st = getattr(_tls, "engines", None)
    if st is None:
        st = _tls.engines = []
    return st


def _pop_engine(engine: "OffloadActivations") -> None:
    """Take ``engine`` off this thread's stack (innermost first)."""
    st = _engines()
    if st and st[-1] is engine:
        st.pop()
    elif engine in st:
        st.remove(engine)


def _global_observers() -> "OrderedDict[int, Callable[[PackEvent], None]]":
    # OrderedDict, not dict: RemovableHandle keeps a weak reference to it.
    d = getattr(_tls, "observers", None)
    if d is None:
        d = _tls.observers = OrderedDict()
    return d


def active_engine() -> "OffloadActivations | None":
    """The innermost OffloadActivations entered on this thread, or None."""
    st = _engines()
    return st[-1] if st else None


_observer_count = [0]
"""Observers registered and not removed, on every engine and thread together: while it is 0
the pack hook skips looking for observers (two lookups, one of them thread-local)."""
_observer_lock = threading.Lock()


class _ObserverHandle(RemovableHandle):
    """A ``RemovableHandle`` that keeps ``_observer_count`` (an observer dict that dies with
    observers still in it leaves the count high: packs then look, and find none)."""

    def remove(self) -> None:
        d = self.hooks_dict_ref()
        with _observer_lock:
            if d is not None and self.id in d:
                _observer_count[0] -= 1
            super().remove()


def _observe(d: "OrderedDict[int, Callable[[PackEvent], None]]", fn: Callable[[PackEvent], None]) -> RemovableHandle:
    h = _ObserverHandle(d)
    with _observer_lock:
        d[h.id] = fn
        _observer_count[0] += 1
    return h


def add_pack_observer(fn: Callable[[PackEvent], None]) -> RemovableHandle:
    """Call ``fn(event)`` for every pack of any engine active on this thread.

    This is how profilers measure an offloaded forward without installing
    their own saved-tensors hooks (only the innermost hooks run, so a
    profiler's hooks inside the engine's would silently turn offloading off).
    """
    return _observe(_global_observers(), fn)


def _observed(engine_observers: "OrderedDict[int, Callable[[PackEvent], None]]") -> bool:
    """Whether a pack of an engine with these observers has anyone to notify."""
    return bool(_observer_count[0] and (engine_observers or _tls.__dict__.get("observers")))


def _notify(engine: "OffloadActivations", t: torch.Tensor, rec: PackRecord) -> None:
    """Hand one pack to the engine's observers, then to the thread's."""
    glob = _global_observers()
    if not engine._observers and not glob:
        return
    ev = PackEvent(t, rec, engine)
    for fn in list(engine._observers.values()):
        fn(ev)
    for fn in list(glob.values()):
        fn(ev)
