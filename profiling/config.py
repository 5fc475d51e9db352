"""MemProfiler configuration: frozen, keyword-only dataclasses validated on construction.

Field names and defaults follow the finetuning-scheduler MemProfiler so its
configs carry over; fields marked "(new)" are additions that fix its known
problems (unbounded allocator history, peaks never reset, artifacts only at
the very end). Every validation error names the field, the value and the fix.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from offload._warn import user_stacklevel

from ._util import resolve_callable, to_plain

__all__ = ["MemProfilerHooks", "MemProfilerFuncs", "MemProfilerSchedule", "MemProfilerCfg"]

HookSpec = str | Callable[..., Any]

_UNITS = ("B", "KiB", "MiB", "GiB")

DEFAULT_SAVE_HOOK_ATTRS: tuple[str, ...] = (
    "rss_pre_forward",
    "rss_post_forward",
    "rss_diff",
    "npp_pre_forward",
    "npp_post_forward",
    "npp_diff",
    "npp_unique_diff",
)


def _as_tuple(value: Any, where: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or callable(value):
        return (value,)
    if isinstance(value, Iterable):
        return tuple(value)
    raise ValueError(f"{where}: expected a list, got {type(value).__name__} {value!r}")


def _as_names(value: Any, where: str) -> frozenset[str]:
    names = frozenset(_as_tuple(value, where))
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"{where}: function names must be non-empty strings, got {bad!r}")
    return names


@dataclass(frozen=True, kw_only=True)
class MemProfilerHooks:
    """Module-forward hooks that feed ``save_hook_attrs`` (see ``offload.profiling.hooks``).

    Each entry is a callable or a ``"package.module.function"`` path. Forward
    hooks are called as ``hook(ctx)`` with an ``offload.profiling.hooks.HookContext``;
    reset hooks as ``hook(ctx, save_hook_attrs)``.
    """

    pre_forward_hooks: tuple[HookSpec, ...] = ("offload.profiling.hooks.npp_rss_pre_forward",)
    """Run before every hooked module's forward."""
    post_forward_hooks: tuple[HookSpec, ...] = ("offload.profiling.hooks.npp_rss_post_forward",)
    """Run after every hooked module's forward (also when it raises)."""
    reset_state_hooks: tuple[HookSpec, ...] = ("offload.profiling.hooks.reset_memory_hooks_state",)
    """Run at hook installation and at the start of every collected call."""

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _as_tuple(getattr(self, f.name), f"MemProfilerHooks.{f.name}"))

    def resolve(self) -> dict[str, list[Callable[..., Any]]]:
        """The hooks as callables; unknown names raise ``ValueError`` naming the field."""
        return {
            f.name: [resolve_callable(s, f"MemProfilerCfg.memory_hooks.{f.name}") for s in getattr(self, f.name)]
            for f in fields(self)
        }


@dataclass(frozen=True, kw_only=True)
class MemProfilerFuncs:
    """Which profiled functions (names given to ``profile()`` / ``memprofilable``) collect what."""

    default: frozenset[str] = frozenset({"training_step"})
    """Merged into every set below."""
    cpu: frozenset[str] = frozenset()
    """Host memory: ``rss`` and ``vms`` (bytes) from psutil."""
    cuda: frozenset[str] = frozenset()
    """``torch.cuda.memory_stats()`` (flat allocator keys, bytes/counts); CUDA only."""
    cuda_allocator_history: frozenset[str] = frozenset()
    """Allocator-history pickles at start and end; CUDA only, needs ``cuda_allocator_history=True``."""
    fsdp: frozenset[str] = frozenset()
    """FSDP2 memory-tracker reports; needs ``track_fsdp_mem=True``."""

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _as_names(getattr(self, f.name), f"MemProfilerFuncs.{f.name}"))

    def merged(self) -> MemProfilerFuncs:
        d = self.default
        return replace(
            self,
            cpu=self.cpu | d,
            cuda=self.cuda | d,
            cuda_allocator_history=self.cuda_allocator_history | d,
            fsdp=self.fsdp | d,
        )

    @property
    def snapshot_funcs(self) -> frozenset[str]:
        """Functions that get start/end snapshot entries (cpu, cuda or allocator history)."""
        return self.cpu | self.cuda | self.cuda_allocator_history


@dataclass(frozen=True, kw_only=True)
class MemProfilerSchedule:
    """Per-function call window: calls ``warmup_iters + 1 .. max_iter`` (1-based) are collected."""

    warmup_iters: int = 1
    """Calls of each function skipped before collecting."""
    max_iter: int | None = None
    """Last collected call (1-based, inclusive); ``None`` means ``warmup_iters + 1``."""

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_iters, int) or self.warmup_iters < 0:
            raise ValueError(
                f"MemProfilerSchedule.warmup_iters={self.warmup_iters!r}: must be an int >= 0"
            )
        if self.max_iter is None:
            object.__setattr__(self, "max_iter", self.warmup_iters + 1)
        if not isinstance(self.max_iter, int) or self.max_iter <= self.warmup_iters:
            raise ValueError(
                f"MemProfilerSchedule.max_iter={self.max_iter!r} is not above "
                f"warmup_iters={self.warmup_iters}: nothing would be collected. Set max_iter to at "
                f"least warmup_iters + 1 = {self.warmup_iters + 1} (or leave it None for that default)"
            )


@dataclass(frozen=True, kw_only=True)
class MemProfilerCfg:
    """Everything the MemProfiler does; ``enabled=False`` makes it a no-op."""

    enabled: bool = False
    """Master switch."""
    collect_funcs: MemProfilerFuncs = field(default_factory=MemProfilerFuncs)
    """Which functions collect which kinds of statistics."""
    cuda_allocator_history: bool = False
    """Record the CUDA allocator history and dump ``cuda_alloc_rank_*.pickle`` files (CUDA only)."""
    cuda_allocator_history_max_entries: int = 100_000
    """(new) Ring-buffer size of the allocator history (entries); history stops when its functions are done."""
    reset_cuda_peak_stats: bool = True
    """(new) Reset CUDA (and pinned-host) peak statistics at the start of each collected call."""
    track_fsdp_mem: bool = False
    """Run an ``FSDPMemTracker`` over collected calls of ``collect_funcs.fsdp``."""
    fsdp_mem_track_module_depth: int = 2
    """Module depth of the modulewise FSDP report."""
    fsdp_mem_tracker_tabulate: bool = False
    """Tabulated FSDP reports (needs the ``tabulate`` package)."""
    fsdp_mem_tracker_units: str = "MiB"
    """Units of both FSDP report sections: B, KiB, MiB or GiB."""
    fsdp_mem_tracker_root_module: str = ""
    """Qualified name (under the profiled model) of the ``fully_shard`` root; "" is the model itself."""
    dump_memorystats_pickle: bool = False
    """Write ``rank_{rank}_memory_stats.pickle``."""
    dump_memorystats_yaml: bool = True
    """Write ``rank_{rank}_memory_stats.yaml`` (readable by ``yaml.safe_load``)."""
    dump_summary: bool = True
    """(new) Write ``rank_{rank}_memory_summary.txt``, a text table of the snapshots."""
    dump_plot: bool = False
    """(new) Write ``rank_{rank}_memory_stats.png`` (needs matplotlib)."""
    dump_when_done: bool = True
    """(new) Write the artifacts as soon as every configured function's window has closed."""
    schedule: MemProfilerSchedule = field(default_factory=MemProfilerSchedule)
    """Which calls are collected."""
    save_dir: str | Path | None = None
    """Artifact directory; ``None`` means ``./memprofiler``. Created if missing; must be writable."""
    enable_memory_hooks: bool = True
    """Install module forward hooks and record ``save_hook_attrs`` in snapshots."""
    enable_saved_tensors_hooks: bool = True
    """Count saved-for-backward bytes (npp) during collected calls, without shadowing an offload engine."""
    memory_hooks: MemProfilerHooks = field(default_factory=MemProfilerHooks)
    """The module hooks."""
    saved_tensors_funcs: tuple[HookSpec, HookSpec] | None = None
    """Optional user (pack, unpack) functions chained behind the built-in byte counter; skipped with a
    warning while an offload engine is active (they would shadow it). ``"identity"`` is accepted."""
    save_hook_attrs: tuple[str, ...] = DEFAULT_SAVE_HOOK_ATTRS
    """Hook values copied into every snapshot entry (and zeroed by the reset hook)."""
    save_module_hook_attrs: bool = True
    """(new) Also store each module's hook values under ``modules`` in end entries."""
    retain_hooks_for_funcs: frozenset[str] | None = None
    """Hooks are removed once all these functions' windows closed; ``None``: all snapshot functions."""
    include_engine_totals: bool = True
    """(new) Add the attached (or observed) offload engine's ledger totals as ``offload.*`` keys."""

    def __post_init__(self) -> None:
        s = object.__setattr__
        if isinstance(self.collect_funcs, Mapping):
            s(self, "collect_funcs", MemProfilerFuncs(**self.collect_funcs))
        if isinstance(self.schedule, Mapping):
            s(self, "schedule", MemProfilerSchedule(**self.schedule))
        if isinstance(self.memory_hooks, Mapping):
            s(self, "memory_hooks", MemProfilerHooks(**self.memory_hooks))
        if self.fsdp_mem_tracker_units not in _UNITS:
            raise ValueError(
                f"MemProfilerCfg.fsdp_mem_tracker_units={self.fsdp_mem_tracker_units!r}: use one of {_UNITS}"
            )
        if self.fsdp_mem_track_module_depth < 0:
            raise ValueError(
                f"MemProfilerCfg.fsdp_mem_track_module_depth={self.fsdp_mem_track_module_depth}: must be >= 0"
            )
        if self.cuda_allocator_history_max_entries <= 0:
            raise ValueError(
                "MemProfilerCfg.cuda_allocator_history_max_entries="
                f"{self.cuda_allocator_history_max_entries}: must be > 0 (the history is a bounded ring)"
            )
        s(self, "save_hook_attrs", tuple(_as_tuple(self.save_hook_attrs, "MemProfilerCfg.save_hook_attrs")))
        if self.retain_hooks_for_funcs is not None:
            s(self, "retain_hooks_for_funcs",
              _as_names(self.retain_hooks_for_funcs, "MemProfilerCfg.retain_hooks_for_funcs"))
        if self.saved_tensors_funcs is not None:
            pair = _as_tuple(self.saved_tensors_funcs, "MemProfilerCfg.saved_tensors_funcs")
            if len(pair) != 2:
                raise ValueError(
                    f"MemProfilerCfg.saved_tensors_funcs={self.saved_tensors_funcs!r}: give exactly two "
                    "functions, (pack, unpack), e.g. ('mypkg.hooks.pack', 'identity')"
                )
            s(self, "saved_tensors_funcs", pair)
        if not self.enabled:
            return
        self._validate_enabled()

    def _validate_enabled(self) -> None:
        s = object.__setattr__
        user = self.collect_funcs
        funcs = user.merged()
        # Fix: the CUDA guard runs after the defaults are merged, so a CPU host
        # really ends up with no CUDA collection (the seed checked before merging).
        if not torch.cuda.is_available():
            asked = sorted(user.cuda | user.cuda_allocator_history)
            if asked or self.cuda_allocator_history:
                warnings.warn(
                    "MemProfilerCfg: CUDA is not available, so CUDA collection is off "
                    f"(collect_funcs.cuda/cuda_allocator_history={asked}, "
                    f"cuda_allocator_history={self.cuda_allocator_history}); host memory and "
                    "saved-tensor bytes are still collected.",
                    stacklevel=user_stacklevel(),
                )
            funcs = replace(funcs, cuda=frozenset(), cuda_allocator_history=frozenset())
            s(self, "cuda_allocator_history", False)
        if not self.cuda_allocator_history:
            funcs = replace(funcs, cuda_allocator_history=frozenset())
        if not self.track_fsdp_mem:
            funcs = replace(funcs, fsdp=frozenset())
        s(self, "collect_funcs", funcs)
        known = funcs.snapshot_funcs | funcs.fsdp
        if not known:
            warnings.warn(
                "MemProfilerCfg: enabled, but no function is configured for collection "
                "(collect_funcs is empty after merging 'default'); nothing will be recorded.",
                stacklevel=user_stacklevel(),
            )
        if self.retain_hooks_for_funcs is not None:
            unknown = sorted(self.retain_hooks_for_funcs - funcs.snapshot_funcs)
            if unknown:
                raise ValueError(
                    f"MemProfilerCfg.retain_hooks_for_funcs: unknown function names {unknown}; hooks can "
                    f"only wait for functions that collect snapshots: {sorted(funcs.snapshot_funcs)}. "
                    "Add them to collect_funcs (cpu/cuda/default) or drop them here."
                )
        if self.enable_memory_hooks:
            resolved = self.memory_hooks.resolve()
            if not any(resolved.values()):
                warnings.warn("MemProfilerCfg.memory_hooks: every hook list is empty", stacklevel=user_stacklevel())
        if self.saved_tensors_funcs is not None:
            for i, spec in enumerate(self.saved_tensors_funcs):
                resolve_callable(spec, f"MemProfilerCfg.saved_tensors_funcs[{i}]")
        if self.track_fsdp_mem and self.fsdp_mem_tracker_tabulate and importlib.util.find_spec("tabulate") is None:
            raise ValueError(
                "MemProfilerCfg.fsdp_mem_tracker_tabulate=True needs the 'tabulate' package, which is "
                "not installed: pip install tabulate, or set fsdp_mem_tracker_tabulate=False"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (callables as their repr) for logs and YAML."""
        return to_plain(asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemProfilerCfg:
        """Build from plain data (e.g. a YAML section); nested sections may be mappings."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"MemProfilerCfg: unknown fields {unknown}; known fields: {sorted(names)}")
        return cls(**dict(data))
