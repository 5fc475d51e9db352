"""Measure what activation offloading buys without turning it off.

Public API, by concern. Everything else (modules starting with ``_``, the
``HookContext`` internals beyond its documented attributes) is not public.
"""

from __future__ import annotations

if __name__ != "offload.profiling":
    # A checkout's root on sys.path also exposes this folder as a top-level `profiling`: a second copy of
    # every class, and the name of another distribution on the package index.
    raise ImportError(f"The repository's profiling/ folder is the package offload.profiling, not {__name__!r}: "
                      "import it as `offload.profiling` (e.g. `from offload.profiling import MemProfiler`).")

# Saved-for-backward bytes and host memory, per module and per step.
from .packed import PackedBytesTracker
from .rss import RSSTracker

# The MemProfiler: scheduled snapshots around named functions.
from .config import MemProfilerCfg, MemProfilerFuncs, MemProfilerHooks, MemProfilerSchedule
from .hooks import HookContext, npp_rss_post_forward, npp_rss_pre_forward, reset_memory_hooks_state
from .memprofiler import MemProfiler, memprofilable

# torch.profiler traces for plain loops.
from .trace import TraceProfiler

# Per-module memory statistics (MemTracker), selective-AC statistics for torch's auto-AC ILP
# (CPU or CUDA) and the CUDA-only estimators.
from .module_stats import (
    ModuleMemoryStats,
    collect_sac_stats,
    estimate_module_runtimes,
    estimate_sac,
    module_info_for_ilp,
)

# Readable output.
from .report import (
    format_bytes,
    format_table,
    plot_module_bytes,
    plot_series,
    plot_step_memory,
    write_json,
    write_yaml,
)

# Errors.
from .errors import ProfilingError

__all__ = [
    # trackers
    "PackedBytesTracker",
    "RSSTracker",
    # MemProfiler
    "MemProfiler",
    "MemProfilerCfg",
    "MemProfilerFuncs",
    "MemProfilerHooks",
    "MemProfilerSchedule",
    "memprofilable",
    "HookContext",
    "npp_rss_pre_forward",
    "npp_rss_post_forward",
    "reset_memory_hooks_state",
    # traces
    "TraceProfiler",
    # per-module stats
    "ModuleMemoryStats",
    "module_info_for_ilp",
    "collect_sac_stats",
    "estimate_module_runtimes",
    "estimate_sac",
    # output
    "format_bytes",
    "format_table",
    "plot_series",
    "plot_step_memory",
    "plot_module_bytes",
    "write_json",
    "write_yaml",
    # errors
    "ProfilingError",
]
