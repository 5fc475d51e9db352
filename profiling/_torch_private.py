"""Every private torch API the profiling package touches, in one place, with why.

Keep this module small: each function wraps one private call so a torch
upgrade that moves it breaks here, visibly, and nowhere else.
"""

from __future__ import annotations

import torch

# Shared with the engine: one wrapper for autograd's end-of-backward callback.
from offload._torch_private import queue_end_of_backward

__all__ = ["queue_end_of_backward", "cuda_record_memory_history", "cuda_dump_snapshot",
           "memtracker_skip_frozen_params", "sac_estimator_use_timer", "sac_estimator_timer", "CpuOpTimer"]


def cuda_record_memory_history(max_entries: int | None) -> None:
    """Start (``max_entries`` > 0) or stop (``None``) the CUDA allocator history.

    Why private: ``torch.cuda.memory._record_memory_history`` is the only API
    for allocator traces; it is underscore-named but documented. On a CPU build
    it raises AttributeError, so callers gate on ``torch.cuda.is_available()``.
    """
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(enabled="all", max_entries=max_entries)


def cuda_dump_snapshot(path: str) -> None:
    """Write the allocator snapshot pickle read by ``torch.cuda._memory_viz`` / pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)


class _NoHandle:
    """A stand-in hook handle whose ``remove()`` does nothing."""

    def remove(self) -> None:
        pass


def memtracker_skip_frozen_params(mem_tracker: object, model: object) -> None:
    """Keep ``MemTracker`` from hooking parameters that cannot have a gradient.

    Why private: ``MemTracker._track_module_params_and_buffers`` registers a
    gradient hook on every parameter it meets unless one is recorded in
    ``_param_to_grad_hook_handles``; for a frozen parameter (LoRA/QLoRA base
    weights, ``requires_grad=False``) ``register_hook`` raises and the step
    dies. Recording no-op handles for them makes MemTracker skip them (they
    never receive a gradient); MemTracker clears the table on exit, so call
    this after each ``__enter__``.
    """
    handles = mem_tracker._param_to_grad_hook_handles  # type: ignore[attr-defined]
    for p in model.parameters():  # type: ignore[attr-defined]
        if not p.requires_grad and handles.get(p, None) is None:
            handles[p] = (_NoHandle(), _NoHandle())


def sac_estimator_use_timer(estimator: object, timer: object) -> None:
    """Make torch's ``SACEstimator`` time each operator with ``timer(func, args, kwargs) -> (out, ms)``.

    Why private: ``SACEstimator.__call__`` accepts only torch's two estimators,
    "operator-level-cost-model" (``RuntimeEstimator._roofline_estimate``, which
    raises "Roofline estimation needs to access CUDA capabilities" without CUDA)
    and "operator-level-benchmark" (times with ``torch.cuda.Event``: "Tried to
    instantiate dummy base class Event" on a CPU build). Everything else in
    SACEstimator is device-agnostic; the chosen estimator is kept in its
    ``_estimate_runtime`` attribute, which this sets. Checked against torch 2.13
    by ``tests/profiling`` and ``tests/bench`` (a rename fails there, not silently).
    """
    if not hasattr(estimator, "_estimate_runtime"):
        raise AttributeError("SACEstimator has no _estimate_runtime: this torch moved it; update "
                             "offload.profiling._torch_private.sac_estimator_use_timer")
    estimator._estimate_runtime = timer  # type: ignore[attr-defined]


def sac_estimator_timer(estimator: object) -> object:
    """The operator timer a ``SACEstimator`` used (see ``sac_estimator_use_timer``)."""
    return getattr(estimator, "_estimate_runtime", None)


class CpuOpTimer:
    """Time one aten operator on CPU for ``SACEstimator`` (torch's benchmark mode, with a CPU clock).

    Called inside SACEstimator's dispatch under ``FakeTensorMode``: the fake
    result comes from the fake mode below (``func(*args)``, as torch's own
    estimators do); the time comes from running ``func`` on real CPU tensors of
    the same shapes, strides and dtypes (floating: normal values; integer and
    bool: zeros, valid indices) with every dispatch mode off (``no_dispatch``,
    private), ``warmup`` times and then ``repeats`` times (mean, milliseconds).
    View-like and ignored operators (torch's ``_VIEW_OPS``/``_IGNORE_OPS``,
    private) cost 0 as in torch's estimators; an operator that cannot run on
    made-up data also costs 0 and is counted in ``untimed``.
    """

    def __init__(self, clock: object, warmup: int = 1, repeats: int = 3) -> None:
        from torch.utils._runtime_estimation import _IGNORE_OPS, _VIEW_OPS

        self.clock = clock
        self.warmup = warmup
        self.repeats = repeats
        self.untimed: dict[str, int] = {}
        """Operator name -> how many calls could not be timed (counted as 0 ms)."""
        self._free = _VIEW_OPS | _IGNORE_OPS

    @staticmethod
    def _real(x: object) -> object:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(x, FakeTensor):
            t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
            return t.normal_() if t.is_floating_point() else t.zero_()
        if isinstance(x, torch.Tensor):
            return x.detach().clone()  # a real input: never let an in-place operator touch it
        return x

    def __call__(self, func: object, args: tuple, kwargs: dict | None) -> tuple[object, float]:
        from torch.utils._mode_utils import no_dispatch
        from torch.utils._pytree import tree_map

        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # type: ignore[operator]
        if func._overloadpacket in self._free:  # type: ignore[attr-defined]
            return out, 0.0
        try:
            with no_dispatch():
                a, k = tree_map(self._real, (args, kwargs))
                for _ in range(self.warmup):
                    func(*a, **k)  # type: ignore[operator]
                t0 = self.clock()  # type: ignore[operator]
                for _ in range(self.repeats):
                    func(*a, **k)  # type: ignore[operator]
                ms = (self.clock() - t0) / self.repeats * 1e3  # type: ignore[operator]
        except Exception:  # data-dependent operators may reject made-up values
            name = str(func)
            self.untimed[name] = self.untimed.get(name, 0) + 1
            ms = 0.0
        return out, ms
