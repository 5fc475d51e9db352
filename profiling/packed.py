"""PackedBytesTracker: what autograd saves for backward, per module and per step.

Three numbers per pack, because each answers a different question:

- ``packed``: everything the saved-tensor stream carried, parameters included.
  This is what an offload engine's ``ledger.summary()["packed_bytes"]`` counts.
- ``logical`` (the MemProfiler's "npp", non-parameter packed bytes): logical
  size ``numel * element_size`` of each saved tensor that is neither a
  Parameter nor a view of one (``weight.t()`` is excluded; see
  ``offload.is_static_tensor``). A tensor saved twice counts twice.
- ``unique``: the distinct bytes behind the logical saves in a step: per
  storage, the union of the byte ranges the saved views span. Repeated saves
  and overlapping views count once; a slice ``data[:4]`` counts the bytes it
  spans, not its whole storage (``offload._spans``).

Under an engine each pack also carries the engine's decision, so every figure
is split into ``offloaded_bytes`` and ``kept_by_reason`` (the engine's
``offload.REASONS``; packs seen through the tracker's own hooks, with no
engine, are kept as ``no_engine``).

# NOTE [ Tracker and engine ]
Only the innermost ``saved_tensors_hooks`` runs (pytorch/pytorch#70932), so a
tracker that installed its own hooks inside an offload engine's context would
silently turn offloading off. The rules, which the code cites as "Rule N":

1. The tracker always registers a pack observer (``offload.add_pack_observer``):
   every engine active on this thread forwards each of its packs to it.
2. On entry, the tracker installs its own hooks only if no engine is active on
   this thread. Entered inside an engine, it observes and never shadows.
3. Entered outside an engine, its own hooks are outermost: inside the engine's
   context the engine's hooks shadow them, so each pack reaches the tracker
   exactly once, either through its own hook or through the observer. No pack
   is counted twice, in either nesting order.
4. Its own hooks keep the saved tensor itself (nothing is copied) and record
   ``t._version`` at pack: hooks bypass autograd's in-place check, so unpack
   raises autograd's error itself if the tensor was modified in place.
5. A step ends when a backward pass finishes that used the tracker's own hooks
   or any engine it observed (the engine closes its ledger step then); the
   next pack opens a new step. ``step()`` ends one explicitly.
6. Trackers shadow each other the same way, so a tracker entered while
   another tracker's hooks are innermost (and no engine is active) joins
   those hooks instead of installing its own: each pack reaches every active
   tracker once. (A tracker with user pack/unpack functions installs its own
   hooks, which forward to the trackers below them.)
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from offload.modules import register_model
from torch import nn

from . import _engine
from offload._spans import SpanSet
from ._torch_private import queue_end_of_backward
from .errors import ProfilingError
from .report import format_table, plot_module_bytes, plot_step_memory, write_json

__all__ = ["PackedBytesTracker"]

_tls = threading.local()
"""Per thread: ``owner``, the tracker whose saved_tensors_hooks are innermost (Rule 6)."""

NO_ENGINE = "no_engine"
"""``kept_by_reason`` key of packs seen through the tracker's own hooks (no engine decided)."""


@dataclass(slots=True)
class _Counts:
    packed_bytes: int = 0
    packed_count: int = 0
    logical_bytes: int = 0
    logical_count: int = 0
    unique_bytes: int = 0
    unique_count: int = 0
    static_bytes: int = 0
    static_count: int = 0
    via_engine_bytes: int = 0
    via_engine_count: int = 0
    offloaded_bytes: int = 0
    offloaded_count: int = 0
    kept_by_reason: dict[str, int] = field(default_factory=dict)

    def bump(self, nbytes: int, static: bool, unique: int, via_engine: bool, reason: str | None) -> None:
        """Count one pack (``unique``: bytes it adds to the step's saved spans; ``reason`` None if offloaded)."""
        self.packed_bytes += nbytes
        self.packed_count += 1
        if via_engine:
            self.via_engine_bytes += nbytes
            self.via_engine_count += 1
        if reason is None:
            self.offloaded_bytes += nbytes
            self.offloaded_count += 1
        else:
            self.kept_by_reason[reason] = self.kept_by_reason.get(reason, 0) + nbytes
        if static:
            self.static_bytes += nbytes
            self.static_count += 1
            return
        self.logical_bytes += nbytes
        self.logical_count += 1
        if unique:
            self.unique_bytes += unique
            self.unique_count += 1

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f: getattr(self, f) for f in _COUNT_FIELDS}
        d["kept_bytes"] = self.packed_bytes - self.offloaded_bytes
        d["kept_by_reason"] = dict(self.kept_by_reason)
        return d


_COUNT_FIELDS = tuple(f.name for f in fields(_Counts) if f.name != "kept_by_reason")


def _module_counts(table: dict[str, _Counts], module: str) -> _Counts:
    c = table.get(module)
    if c is None:
        c = table[module] = _Counts()
    return c


@dataclass
class _Step:
    index: int
    totals: _Counts = field(default_factory=_Counts)
    modules: dict[str, _Counts] = field(default_factory=dict)
    spans: SpanSet = field(default_factory=SpanSet)
    params_bytes: int | None = None
    grads_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.index}
        d.update(self.totals.as_dict())
        if self.params_bytes is not None:
            d["params_bytes"] = self.params_bytes
            d["grads_bytes"] = self.grads_bytes
        d["modules"] = {k: v.as_dict() for k, v in self.modules.items()}
        return d


class _Saved:
    """What the tracker's own pack hook hands autograd: the tensor and its version (Rule 4)."""

    __slots__ = ("tensor", "version", "inner")

    def __init__(self, tensor: torch.Tensor | None, version: int, inner: Any) -> None:
        self.tensor = tensor
        self.version = version
        self.inner = inner


class PackedBytesTracker:
    """Count bytes saved for backward, per module and per step, alone or under an offload engine.

    >>> with PackedBytesTracker() as t:
    ...     loss = model(x).sum()
    >>> t.summary()["logical_bytes"], t.summary()["unique_bytes"]

    Args:
        pack_hook: optional user saved-tensor pack function chained behind
            the tracker's own hook (the MemProfiler's ``saved_tensors_funcs``).
            It runs only when the tracker installs hooks, i.e. when no engine
            is active (Rule 2).
        unpack_hook: the matching unpack function (the same rule).
        auto_step: start a new step after each backward pass (Rule 5).
        max_steps_kept: per-step breakdowns kept (oldest dropped); totals never lose counts.
        model: optional; registered for module names (NOTE [ Module names ] in
            ``offload.modules``) and used for the parameter and gradient bytes of
            ``plot()``'s per-step device-memory bars.
    """

    def __init__(
        self,
        *,
        pack_hook: Callable[[torch.Tensor], Any] | None = None,
        unpack_hook: Callable[[Any], torch.Tensor] | None = None,
        auto_step: bool = True,
        max_steps_kept: int = 1000,
        model: nn.Module | None = None,
    ) -> None:
        if (pack_hook is None) != (unpack_hook is None):
            raise ValueError(
                "PackedBytesTracker: pack_hook and unpack_hook must be given together "
                f"(got pack_hook={pack_hook!r}, unpack_hook={unpack_hook!r})"
            )
        if max_steps_kept < 1:
            raise ValueError(f"PackedBytesTracker: max_steps_kept={max_steps_kept} must be >= 1")
        self.auto_step = auto_step
        self._user_pack = pack_hook
        self._user_unpack = unpack_hook
        self._stack: ExitStack | None = None
        self.own_hooks_installed = False
        """True while this tracker's own saved_tensors_hooks are installed (no engine at entry)."""
        self._engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last_engine: weakref.ref | None = None
        self._bw_epoch = 0
        self._seen_epoch = 0
        self._cb_pending = False
        self._listeners: list[PackedBytesTracker] = [self]
        self._max_steps_kept = max_steps_kept
        self.model = model
        if model is not None:
            register_model(model)
        self.reset()

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> PackedBytesTracker:
        if self._stack is not None:
            raise ProfilingError(
                "PackedBytesTracker: this tracker is already active; use one tracker per "
                "`with` block (nest two trackers if you need two views)"
            )
        stack = ExitStack()
        try:
            stack.enter_context(_engine.track_modules(owner=self))
            handle = _engine.add_pack_observer(self._on_engine_pack)  # Rule 1
            stack.callback(handle.remove)
            if _engine.active_engine() is None:  # Rule 2
                owner = getattr(_tls, "owner", None)
                if owner is not None and self._user_pack is None:  # Rule 6: share its hooks
                    owner._listeners.append(self)
                    stack.callback(owner._listeners.remove, self)
                else:
                    self._listeners = [*(owner._listeners if owner is not None else ()), self]
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
                    self.own_hooks_installed = True
                    _tls.owner = self
                    stack.callback(self._hooks_removed, owner)
        except BaseException:
            stack.close()
            raise
        # Not resetting _seen_epoch here: a backward that ended since the last
        # pack (inside the previous `with` block or after it) ends that step.
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _hooks_removed(self, previous_owner: PackedBytesTracker | None) -> None:
        self.own_hooks_installed = False
        _tls.owner = previous_owner

    @property
    def sees_engine_packs(self) -> bool:
        """True: an engine entered inside this tracker's own hooks costs it nothing, since it observes
        the engine's packs (Rule 1), so the engine does not warn; False with user pack/unpack
        functions, which do not run for what the engine packs (NOTE [ Nested hooks ] in
        offload/_foreign_hooks.py)."""
        return self._user_pack is None

    @property
    def active(self) -> bool:
        return self._stack is not None

    def reset(self) -> None:
        """Forget all counts and steps (hooks and observers stay as they are)."""
        self._totals = _Counts()
        self._modules: dict[str, _Counts] = {}
        self._closed: deque[_Step] = deque(maxlen=self._max_steps_kept)
        self._n_closed = 0
        self._cur = _Step(0)
        self._seen_epoch = self._bw_epoch
        self._engine_steps_seen = {e: _engine.engine_closed_steps(e) for e in list(self._engines)}

    # ------------------------------------------------------------------- hooks
    def _pack(self, t: torch.Tensor) -> _Saved:
        module = _engine.current_module_name()
        for tracker in self._listeners:  # this tracker, and any that share its hooks (Rule 6)
            tracker._record(t, module, via_engine=False, reason=NO_ENGINE)
        if self._user_pack is not None:
            return _Saved(None, 0, self._user_pack(t))
        return _Saved(t, t._version, None)

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        if not self._cb_pending and any(tr.auto_step for tr in self._listeners):
            try:
                listeners = list(self._listeners)
                queue_end_of_backward(lambda: [tr._on_backward_end() for tr in listeners])
                self._cb_pending = True
            except RuntimeError:  # unpacked outside backward (e.g. grad_fn._saved_*): no step end
                pass
        if saved.tensor is None:
            return self._user_unpack(saved.inner)  # type: ignore[misc]
        if saved.tensor._version != saved.version:  # Rule 4
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{saved.tensor.dtype} {tuple(saved.tensor.shape)}] is at version "
                f"{saved.tensor._version}; expected version {saved.version} instead. "
                "(Detected by PackedBytesTracker's saved-tensor hooks, which bypass autograd's own "
                "check.) Hint: the tensor was changed in place after the forward saved it."
            )
        return saved.tensor

    def _on_backward_end(self) -> None:
        self._cb_pending = False
        self._bw_epoch += 1

    def _on_engine_pack(self, event: Any) -> None:
        engine = event.engine
        if engine not in self._engines:
            self._engines[engine] = None
            self._engine_steps_seen[engine] = _engine.engine_closed_steps(engine)
        self._last_engine = weakref.ref(engine)
        rec = event.record
        self._record(event.tensor, rec.module, via_engine=True,
                     reason=None if rec.decision == "offloaded" else (rec.reason or rec.decision))

    # --------------------------------------------------------------- counting
    def _maybe_roll(self) -> None:
        """Close the open step if a backward finished since it was opened (Rule 5)."""
        if not self.auto_step:
            return
        changed = self._bw_epoch != self._seen_epoch
        for e in list(self._engines):
            n = _engine.engine_closed_steps(e)
            if n != self._engine_steps_seen.get(e, n):
                changed = True
            self._engine_steps_seen[e] = n
        self._seen_epoch = self._bw_epoch
        if changed and self._cur.totals.packed_count:
            self._close_step()

    def _record(self, t: torch.Tensor, module: str, *, via_engine: bool, reason: str | None) -> None:
        self._maybe_roll()
        nbytes = t.numel() * t.element_size()
        static = _engine.is_static_tensor(t)
        unique = 0
        if not static:
            # By live identity, not address: an engine frees offloaded sources
            # mid-forward and the allocator may reuse their addresses.
            unique = self._cur.spans.add(t)
        step = self._cur
        for c in (step.totals, self._totals, _module_counts(step.modules, module),
                  _module_counts(self._modules, module)):
            c.bump(nbytes, static, unique, via_engine, reason)

    def _close_step(self) -> None:
        cur = self._cur
        cur.spans = SpanSet()
        if self.model is not None:
            ps = [p for p in self.model.parameters()]
            cur.params_bytes = sum(p.numel() * p.element_size() for p in ps)
            cur.grads_bytes = sum(p.numel() * p.element_size() for p in ps if p.requires_grad)
        self._closed.append(cur)
        self._n_closed += 1
        self._cur = _Step(self._n_closed)

    def step(self) -> dict[str, Any]:
        """End the current step now and return its figures."""
        self._maybe_roll()
        done = self._cur
        self._close_step()
        return done.as_dict()

    # ----------------------------------------------------------------- results
    @property
    def logical_bytes(self) -> int:
        """Non-parameter packed bytes since the last reset (the "npp" number)."""
        return self._totals.logical_bytes

    @property
    def unique_bytes(self) -> int:
        return self._totals.unique_bytes

    @property
    def packed_bytes(self) -> int:
        return self._totals.packed_bytes

    @property
    def engine(self) -> Any | None:
        """The offload engine whose packs this tracker observed most recently, if any."""
        return self._last_engine() if self._last_engine is not None else None

    def steps(self) -> list[dict[str, Any]]:
        """Per-step figures (kept steps, then the open step if it saw any pack)."""
        self._maybe_roll()
        out = [s.as_dict() for s in self._closed]
        if self._cur.totals.packed_count:
            out.append(self._cur.as_dict())
        return out

    def summary(self) -> dict[str, Any]:
        """Totals since the last reset, per-module totals and per-step figures."""
        self._maybe_roll()
        d: dict[str, Any] = self._totals.as_dict()
        d["steps"] = self._n_closed + (1 if self._cur.totals.packed_count else 0)
        d["modules"] = {k: v.as_dict() for k, v in self._modules.items()}
        d["per_step"] = self.steps()
        return d

    def table(self, unit: str = "auto") -> str:
        """Per-module text table, largest logical bytes first."""
        rows = [
            {"module": name or "(outside modules)", **c.as_dict()}
            for name, c in sorted(self._modules.items(), key=lambda kv: -kv[1].logical_bytes)
        ]
        rows.append({"module": "TOTAL", **self._totals.as_dict()})
        cols = ["module", "logical_count", "logical_bytes", "unique_bytes", "static_bytes", "offloaded_bytes", "kept_bytes"]
        return format_table(
            rows,
            cols,
            title="Saved-for-backward bytes per module (logical = npp, unique = distinct spanned bytes)",
            byte_columns=[c for c in cols if c.endswith("_bytes")],
            unit=unit,
        )

    def plot(self, path: str | Path, unit: str = "MiB") -> Path:
        """PNG: per step, stacked device memory (params, grads, activations kept, and offloaded to host).

        Params and grads need ``model=`` (grads: one per trainable parameter,
        the bytes backward allocates); activations are the step's non-parameter
        saved bytes kept on the device vs offloaded by an engine.
        """
        steps = self.steps()
        return plot_step_memory(
            {
                "params": [s.get("params_bytes") or self._model_bytes()[0] for s in steps],
                "grads": [s.get("grads_bytes") or self._model_bytes()[1] for s in steps],
                "activations kept": [s["logical_bytes"] - _offloaded_logical(s) for s in steps],
                "activations offloaded (host)": [_offloaded_logical(s) for s in steps],
            },
            path, x=[s["step"] for s in steps], unit=unit,
            title="Device memory per step (hatched: moved to host)",
        )

    def plot_modules(self, path: str | Path, unit: str = "MiB", top: int = 20) -> Path:
        """PNG: per module, saved bytes offloaded vs kept on the device by reason (largest ``top``)."""
        return plot_module_bytes({k: v.as_dict() for k, v in self._modules.items()}, path, unit=unit, top=top)

    def _model_bytes(self) -> tuple[int, int]:
        if self.model is None:
            return 0, 0
        ps = list(self.model.parameters())
        return (sum(p.numel() * p.element_size() for p in ps),
                sum(p.numel() * p.element_size() for p in ps if p.requires_grad))

    def to_json(self, path: str | Path) -> Path:
        return write_json(self.summary(), path)


def _offloaded_logical(step: dict[str, Any]) -> int:
    """Offloaded bytes of a step's figures (parameters are never offloaded, so all are activations)."""
    return int(step.get("offloaded_bytes", 0))
