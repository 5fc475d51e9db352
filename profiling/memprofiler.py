"""MemProfiler: scheduled memory snapshots around named functions, for plain PyTorch loops.

A port of the finetuning-scheduler MemProfiler without Lightning:

    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir="memprof"), model)
    for batch in data:
        with prof.profile("training_step"):
            loss = model(batch).sum(); loss.backward(); opt.step()
    prof.dump_memory_stats()

or decorate a method of an object that has a ``memprofiler`` attribute with
``@memprofilable``.

# NOTE [ MemProfiler snapshot keys ]
Keys are ``f"{rank}.{fn}.{iter}.{ctx}"``: ``iter`` counts the calls of ``fn``
(1-based, per function, not a global step) and ``ctx`` is ``start`` or
``end``. With the default schedule (``warmup_iters=1``, ``max_iter=None`` ->
2) call 1 is warm-up and call 2 is collected, giving ``0.training_step.2.start``
and ``0.training_step.2.end`` on rank 0.

Differences from the seed, each fixing a known problem:
- hook values come from the modules that actually ran (``HookContext.totals``),
  not from attributes of the wrapper object; nothing is stored on modules;
- npp excludes parameters and their views and is counted without shadowing an
  offload engine (``PackedBytesTracker``); ``npp_unique_diff`` dedupes storages;
- a user ``retain_hooks_for_funcs`` is honoured; done functions are a set;
- hook state is reset at the start of every collected call, so warm-up and
  un-profiled calls do not leak into it;
- the YAML holds plain data (``yaml.safe_load`` reads it);
- allocator history is a bounded ring started at the first collected call and
  stopped when its functions are done; CUDA peaks are reset per call;
- artifacts are rewritten at the end of every collected call (``dump_when_done``),
  by ``close()``, and at interpreter exit, so a function that never reaches
  ``max_iter`` (a ``validation_step`` never called, a short loop) loses nothing;
  FSDP reports are written as soon as their call ends;
- module hooks are on only while a collected call runs (the seed kept them
  until every ``retain_hooks_for_funcs`` function was done, i.e. forever when
  one never ran); ``retain_hooks_for_funcs`` is still accepted and validated;
- ``offload.*`` keys are the attached engine's ledger counters *for the
  collected call* (end entries); its totals since creation are under
  ``offload_cumulative.*``;
- module names are fully qualified from the profiled model
  (NOTE [ Module names ] in ``offload.modules``).
"""

from __future__ import annotations

import atexit
import io
import logging
import pickle
import weakref
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, redirect_stdout
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import psutil
import torch
from torch import nn

from offload._warn import user_stacklevel
from offload.modules import module_name, register_model

from . import _engine
from ._torch_private import cuda_dump_snapshot, cuda_record_memory_history
from ._util import flatten, get_rank, resolve_callable, to_plain
from .config import MemProfilerCfg
from .errors import ProfilingError
from .hooks import HookContext, adapt_forward_hook
from .packed import PackedBytesTracker
from .report import format_table, plot_module_bytes, plot_step_memory, write_yaml

_log = logging.getLogger("offload.profiling.memprofiler")

_live_profilers: "weakref.WeakSet[MemProfiler]" = weakref.WeakSet()


@atexit.register
def _dump_at_exit() -> None:
    """Write what every live, enabled profiler collected and has not written yet (weakly held)."""
    for prof in list(_live_profilers):
        try:
            prof.close()
        except Exception:  # never let a profiler break interpreter shutdown
            _log.exception("MemProfiler: writing artifacts at exit failed")

# Ledger counters that are not additive: a window cannot have its own value for them.
_NON_ADDITIVE = ("peak_", "pool.peak_", "pool.in_use_bytes", "pool.reserved_bytes", "pool.capacity_bytes", "steps")

__all__ = ["MemProfiler", "memprofilable"]

F = TypeVar("F", bound=Callable[..., Any])


class MemProfiler:
    """Collect host/CUDA memory, saved-tensor bytes, module-hook values, allocator history and
    FSDP2 tracker reports for scheduled calls of named functions.

    Args:
        cfg: the configuration; ``MemProfilerCfg(enabled=False)`` (the default) is a no-op.
        model: the module whose submodules get forward hooks (and that holds the FSDP root).
        optimizer: passed to the FSDP memory tracker so optimizer state is attributed.
        engine: an ``OffloadActivations`` whose ledger totals go into each snapshot; when omitted,
            the engine whose packs the profiler observed (or the active one) is used.
        rank: overrides the detected rank (process group, else ``$RANK``, ``$SLURM_PROCID`` and the
            like, else ``$LOCAL_RANK``, else 0; see ``offload.profiling._util.get_rank``).
    """

    def __init__(
        self,
        cfg: MemProfilerCfg | None = None,
        model: nn.Module | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        engine: Any | None = None,
        rank: int | None = None,
    ) -> None:
        self.cfg = cfg if cfg is not None else MemProfilerCfg()
        self.model = model
        self.optimizer = optimizer
        self.rank = get_rank() if rank is None else rank
        self.memory_stats: dict[str, dict[str, Any]] = {}
        """Snapshot entries by key (see NOTE [ MemProfiler snapshot keys ])."""
        self.fsdp_reports: dict[tuple[str, int], str] = {}
        """FSDP2 tracker report text by (function, call index)."""
        self.save_dir: Path | None = None
        self._engine = engine
        self._closed = False
        if not self.cfg.enabled:
            return
        cfg = self.cfg
        funcs = cfg.collect_funcs
        if (cfg.enable_memory_hooks or cfg.track_fsdp_mem) and model is None:
            raise ValueError(
                "MemProfiler: a model is required when MemProfilerCfg.enable_memory_hooks or "
                "track_fsdp_mem is set; pass MemProfiler(cfg, model) or disable them"
            )
        self.save_dir = self._init_save_dir(cfg.save_dir)
        if model is not None:
            register_model(model)
        self._proc = psutil.Process()
        self._snap_funcs = funcs.snapshot_funcs
        self._all_funcs = self._snap_funcs | funcs.fsdp
        self._calls: dict[str, int] = {}
        self._done: set[str] = set()
        self._hooks = cfg.memory_hooks.resolve() if cfg.enable_memory_hooks else {}
        for kind in ("pre_forward_hooks", "post_forward_hooks"):
            if kind in self._hooks:
                self._hooks[kind] = [adapt_forward_hook(h, kind) for h in self._hooks[kind]]
        self._open_windows = 0
        self._engine_base: dict[int, dict[str, Any]] = {}
        self.windows: list[dict[str, Any]] = []
        """Per collected call: label, params/grads bytes, activations kept/offloaded, per-module bytes."""
        self._hooks_on = cfg.enable_memory_hooks
        self._hook_stack: ExitStack | None = None
        self._frames: list[tuple[nn.Module, str, dict[str, Any]]] = []
        self._tracker: PackedBytesTracker | None = None
        self._ctx = HookContext(
            rss=lambda: self._proc.memory_info().rss,
            mem_info=self._proc.memory_info,
            npp=lambda: self._tracker.logical_bytes if self._tracker is not None else 0,
            npp_unique=lambda: self._tracker.unique_bytes if self._tracker is not None else 0,
        )
        self._ctx.model = model
        self._st_funcs = None
        if cfg.enable_saved_tensors_hooks and cfg.saved_tensors_funcs is not None:
            self._st_funcs = tuple(
                resolve_callable(s, f"MemProfilerCfg.saved_tensors_funcs[{i}]")
                for i, s in enumerate(cfg.saved_tensors_funcs)
            )
        self._history_on = False
        self._fsdp_root = self._find_fsdp_root() if cfg.track_fsdp_mem else None
        self._fsdp_tracker = None
        self._dirty = False
        _live_profilers.add(self)

    # ------------------------------------------------------------------ setup
    @property
    def enabled(self) -> bool:
        return self.cfg.enabled and not self._closed

    def __bool__(self) -> bool:
        return self.enabled

    def _init_save_dir(self, save_dir: str | Path | None) -> Path:
        path = Path(save_dir) if save_dir is not None else Path.cwd() / "memprofiler"
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".write_check_"):
                pass
        except OSError as e:
            raise ValueError(
                f"MemProfilerCfg.save_dir={str(path)!r} is not a writable directory ({e.strerror or e}); "
                "choose a directory you can write to"
            ) from e
        return path

    def _find_fsdp_root(self) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        fqn = self.cfg.fsdp_mem_tracker_root_module
        try:
            root = self.model.get_submodule(fqn)  # type: ignore[union-attr]
        except AttributeError as e:
            raise ValueError(
                f"MemProfilerCfg.fsdp_mem_tracker_root_module={fqn!r}: no such submodule of "
                f"{type(self.model).__name__} ({e}); give the qualified name of the fully_shard root"
            ) from e
        if not isinstance(root, FSDPModule):
            raise ValueError(
                f"MemProfilerCfg.fsdp_mem_tracker_root_module={fqn!r} names a "
                f"{type(root).__name__} without fully_shard applied; FSDP2 memory tracking needs the "
                "root FSDP module (apply fully_shard to it, or set track_fsdp_mem=False)"
            )
        return root

    def attach_engine(self, engine: Any) -> None:
        """Put ``engine``'s ledger totals (``offload.*`` keys) into every later snapshot."""
        self._engine = engine

    # ------------------------------------------------------------ the schedule
    @contextmanager
    def profile(self, fn: str, *, inputs: Any = None) -> Iterator[None]:
        """Profile one call of the function named ``fn`` (counted per name, 1-based).

        ``inputs`` (optional) are given to the FSDP memory tracker's ``track_inputs``.
        """
        if not self.enabled or fn not in self._all_funcs:
            yield
            return
        idx = self._calls[fn] = self._calls.get(fn, 0) + 1
        sched = self.cfg.schedule
        if idx <= sched.warmup_iters or idx > sched.max_iter:  # type: ignore[operator]
            yield
            return
        funcs = self.cfg.collect_funcs
        snap = fn in self._snap_funcs
        fsdp = fn in funcs.fsdp
        with ExitStack() as stack:
            if snap:
                self._begin_window(fn)
                self._snapshot(fn, idx, "start")
                if self.cfg.enable_saved_tensors_hooks:
                    stack.enter_context(self._tracker)  # type: ignore[arg-type]
            if fsdp:
                stack.enter_context(self._fsdp_scope(fn, idx, inputs))
            try:
                yield
            finally:
                stack.close()
                if snap:
                    self._snapshot(fn, idx, "end")
                    self._end_window(fn, idx)
                if idx == sched.max_iter:
                    self._finish(fn)
                if self.cfg.dump_when_done and self._dirty:
                    self.dump_memory_stats()

    def _new_tracker(self) -> PackedBytesTracker:
        pack = unpack = None
        if self._st_funcs is not None:
            if _engine.active_engine() is not None:
                warnings.warn(
                    "MemProfiler: MemProfilerCfg.saved_tensors_funcs are skipped for this call because an "
                    "offload engine is active; installing them would shadow the engine's hooks and turn "
                    "offloading off. Saved-tensor bytes are still counted through the engine.",
                    stacklevel=user_stacklevel(),
                )
            else:
                pack, unpack = self._st_funcs
        return PackedBytesTracker(pack_hook=pack, unpack_hook=unpack, auto_step=False, model=self.model)

    def _begin_window(self, fn: str) -> None:
        self._tracker = self._new_tracker()
        self._open_windows += 1
        if self._hooks_on and self._hook_stack is None:
            self._install_hooks()
        if self._hooks_on:
            self._run_reset_hooks()
        engine = self._current_engine()
        self._engine_base.clear()
        if engine is not None:
            self._engine_base[id(engine)] = flatten("", _engine.engine_totals(engine), {})
        cuda = torch.cuda.is_available()
        if cuda and self.cfg.reset_cuda_peak_stats and fn in self.cfg.collect_funcs.cuda:
            torch.cuda.reset_peak_memory_stats()
            if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
                torch.cuda.reset_peak_host_memory_stats()
        if cuda and fn in self.cfg.collect_funcs.cuda_allocator_history and not self._history_on:
            cuda_record_memory_history(self.cfg.cuda_allocator_history_max_entries)
            self._history_on = True

    def _end_window(self, fn: str, idx: int) -> None:
        self._open_windows -= 1
        if self._open_windows <= 0:
            self._open_windows = 0
            self._remove_hooks()  # hooks are on only while a collected call runs
        t = self._tracker
        if t is not None and self.cfg.enable_saved_tensors_hooks:
            s = t.summary()
            params = grads = 0
            if self.model is not None:
                ps = list(self.model.parameters())
                params = sum(p.numel() * p.element_size() for p in ps)
                grads = sum(p.numel() * p.element_size() for p in ps if p.requires_grad)
            self.windows.append({
                "label": f"{fn}.{idx}",
                "params_bytes": params,
                "grads_bytes": grads,
                "activations_kept_bytes": s["logical_bytes"] - s["offloaded_bytes"],
                "activations_offloaded_bytes": s["offloaded_bytes"],
                "modules": s["modules"],
            })

    def _finish(self, fn: str) -> None:
        self._done.add(fn)
        if self._history_on and self.cfg.collect_funcs.cuda_allocator_history <= self._done:
            cuda_record_memory_history(None)
            self._history_on = False

    @property
    def done(self) -> frozenset[str]:
        """Functions whose collection window has closed."""
        return frozenset(getattr(self, "_done", ()))

    # ---------------------------------------------------------------- hooks
    def _install_hooks(self) -> None:
        stack = ExitStack()
        stack.enter_context(_engine.track_modules(owner=self))
        root = self.model

        def pre(module: nn.Module, args: Any) -> None:
            name = module_name(module)  # the model is registered: the ledger's name for it
            frame: dict[str, Any] = {}
            self._frames.append((module, name, frame))
            self._call_hooks("pre_forward_hooks", module, name, frame, len(self._frames) - 1)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            for i in range(len(self._frames) - 1, -1, -1):
                if self._frames[i][0] is module:
                    _, name, frame = self._frames[i]
                    try:
                        self._call_hooks("post_forward_hooks", module, name, frame, i)
                    finally:
                        del self._frames[i:]
                    return

        for m in root.modules():  # type: ignore[union-attr]
            stack.callback(m.register_forward_pre_hook(pre).remove)
            stack.callback(m.register_forward_hook(post, always_call=True).remove)
        stack.callback(self._frames.clear)
        self._hook_stack = stack
        self._run_reset_hooks()

    def _call_hooks(self, kind: str, module: nn.Module, name: str, frame: dict[str, Any], depth: int) -> None:
        ctx = self._ctx
        ctx.module, ctx.name, ctx.frame, ctx.depth = module, name, frame, depth
        for hook in self._hooks[kind]:
            hook(ctx)

    def _run_reset_hooks(self) -> None:
        for hook in self._hooks.get("reset_state_hooks", ()):
            hook(self._ctx, self.cfg.save_hook_attrs)

    def _remove_hooks(self) -> None:
        stack, self._hook_stack = self._hook_stack, None
        if stack is not None:
            stack.close()

    @property
    def hooks_installed(self) -> bool:
        return getattr(self, "_hook_stack", None) is not None

    def hook_values(self) -> dict[str, dict[str, int]]:
        """Per-module hook values since the last reset."""
        return {k: dict(v) for k, v in self._ctx.values.items()}

    # ------------------------------------------------------------- snapshots
    def _current_engine(self) -> Any | None:
        if self._engine is not None:
            return self._engine
        if self._tracker is not None and self._tracker.engine is not None:
            return self._tracker.engine
        return _engine.active_engine()

    def _snapshot(self, fn: str, idx: int, where: str) -> None:
        cfg = self.cfg
        funcs = cfg.collect_funcs
        key = f"{self.rank}.{fn}.{idx}.{where}"
        entry: dict[str, Any] = {}
        if self._hooks_on:
            entry.update({a: self._ctx.totals.get(a, 0) for a in cfg.save_hook_attrs})
        if fn in funcs.cpu:
            mem = self._proc.memory_info()
            entry["rss"], entry["vms"] = mem.rss, mem.vms
        cuda = torch.cuda.is_available()
        if cuda and fn in funcs.cuda:
            entry.update(to_plain(torch.cuda.memory_stats()))
        if cfg.enable_saved_tensors_hooks and self._tracker is not None:
            t = self._tracker
            entry["packed.packed_bytes"] = t.packed_bytes
            entry["packed.logical_bytes"] = t.logical_bytes
            entry["packed.unique_bytes"] = t.unique_bytes
            entry["packed.offloaded_bytes"] = t.summary()["offloaded_bytes"]
        engine = self._current_engine() if cfg.include_engine_totals else None
        if engine is not None:
            totals = flatten("", _engine.engine_totals(engine), {})
            flatten("offload_cumulative", totals, entry)
            base = self._engine_base.get(id(engine))
            if where == "end" and base is not None:
                for k, v in totals.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith(_NON_ADDITIVE):
                        entry[f"offload.{k}"] = v - base.get(k, 0)
            elif where == "end":
                _log.info("MemProfiler: engine first seen inside %s.%s; only offload_cumulative.* recorded "
                          "(attach_engine() or MemProfiler(engine=...) gives per-call offload.* figures)", fn, idx)
        if cuda and (engine is not None or fn in funcs.cuda) and hasattr(torch.cuda, "host_memory_stats"):
            flatten("host", torch.cuda.host_memory_stats(), entry)
        if self._history_on and fn in funcs.cuda_allocator_history:
            path = self.save_dir / f"cuda_alloc_rank_{key}.pickle"  # type: ignore[operator]
            cuda_dump_snapshot(str(path))
            entry["cuda_allocator_history"] = path.name
        if where == "end" and self._hooks_on and cfg.save_module_hook_attrs:
            attrs = set(cfg.save_hook_attrs)
            entry["modules"] = {
                name: {a: v for a, v in vals.items() if a in attrs} for name, vals in self._ctx.values.items()
            }
        self.memory_stats.setdefault(key, {}).update(entry)
        self._dirty = True

    # ------------------------------------------------------------------- FSDP
    @contextmanager
    def _fsdp_scope(self, fn: str, idx: int, inputs: Any) -> Iterator[None]:
        if self._fsdp_tracker is None:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            self._fsdp_tracker = FSDPMemTracker(self._fsdp_root, self.optimizer)
        tracker = self._fsdp_tracker
        if inputs is not None:
            tracker.track_inputs(inputs if isinstance(inputs, tuple) else (inputs,))
        try:
            with tracker:
                yield
        finally:
            self._write_fsdp_report(fn, idx)
            tracker.reset_mod_stats()

    def _write_fsdp_report(self, fn: str, idx: int) -> None:
        cfg = self.cfg
        tracker = self._fsdp_tracker
        units, tab = cfg.fsdp_mem_tracker_units, cfg.fsdp_mem_tracker_tabulate
        rule = "-" * 80 + "\n"
        buf = io.StringIO()
        with redirect_stdout(buf):
            print(f"Iteration {idx} {fn} Peak FSDP memory stats (rank {self.rank}, units {units}):")
            print(rule, end="")
            tracker.display_snapshot("peak", units=units, tabulate=tab)
            print(rule, end="")
            print(f"Iteration {idx} {fn} Modulewise FSDP memory stats:")
            print(rule, end="")
            tracker.display_modulewise_snapshots(depth=cfg.fsdp_mem_track_module_depth, units=units, tabulate=tab)
            print(rule, end="")
        text = buf.getvalue()
        self.fsdp_reports[(fn, idx)] = text
        (self.save_dir / f"fsdp_mem_rank_{self.rank}_{fn}_{idx}.log").write_text(text)  # type: ignore[operator]
        peak = tracker.get_tracker_snapshot("peak")
        key = f"{self.rank}.{fn}.{idx}.end"
        target = self.memory_stats.setdefault(key, {})
        for dev, by_type in peak.items():
            for ref, nbytes in by_type.items():
                label = str(getattr(ref, "value", ref)).lower().replace(" ", "_")
                target[f"fsdp.peak.{dev}.{label}"] = int(nbytes)

    # ----------------------------------------------------------------- output
    def summary_table(self, unit: str = "auto") -> str:
        """Text table of the snapshots: host, npp, RSS and (when present) CUDA and offload columns."""
        candidates = [
            "rss", "vms", "npp_diff", "npp_unique_diff", "rss_diff",
            "allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.peak",
            "packed.offloaded_bytes", "offload.packed_bytes", "offload.offloaded_bytes", "offload.kept_bytes",
        ]
        cols = [c for c in candidates if any(c in e for e in self.memory_stats.values())]
        rows = [{"snapshot": k, **e} for k, e in self.memory_stats.items()]
        return format_table(
            rows, ["snapshot", *cols], title=f"MemProfiler snapshots, rank {self.rank}",
            byte_columns=cols, unit=unit,
        )

    def plot(self, path: str | Path | None = None) -> Path:
        """PNG: per collected call, stacked device memory (params, grads, activations kept, offloaded to host).

        Activations are the call's saved-for-backward non-parameter bytes
        (npp), split by the engine's decision; grads are one per trainable
        parameter. See also ``plot_modules``.
        """
        if path is None:
            path = self._out(f"rank_{self.rank}_memory_stats.png")
        w = self.windows
        return plot_step_memory(
            {
                "params": [x["params_bytes"] for x in w],
                "grads": [x["grads_bytes"] for x in w],
                "activations kept": [x["activations_kept_bytes"] for x in w],
                "activations offloaded (host)": [x["activations_offloaded_bytes"] for x in w],
            },
            path, x=[x["label"] for x in w], xlabel="collected call",
            title=f"Device memory per collected call, rank {self.rank} (hatched: moved to host)",
        )

    def plot_modules(self, path: str | Path | None = None, top: int = 20) -> Path:
        """PNG: the last collected call's saved bytes per module, offloaded vs kept by reason."""
        if path is None:
            path = self._out(f"rank_{self.rank}_module_bytes.png")
        mods = self.windows[-1]["modules"] if self.windows else {}
        label = self.windows[-1]["label"] if self.windows else ""
        return plot_module_bytes(
            mods, path, top=top,
            title=f"Saved-for-backward bytes per module ({label}): offloaded vs kept by reason",
        )

    def _out(self, name: str) -> Path:
        if self.save_dir is None:
            raise ProfilingError("MemProfiler: disabled (MemProfilerCfg.enabled=False), so there is no save_dir")
        return self.save_dir / name

    def dump_memory_stats(self) -> list[Path]:
        """Write the configured artifacts now; returns their paths (FSDP logs were written per call)."""
        if not self.cfg.enabled or not self.memory_stats:
            return []
        cfg, r = self.cfg, self.rank
        written: list[Path] = []
        data = to_plain(self.memory_stats)
        if cfg.dump_memorystats_pickle:
            p = self._out(f"rank_{r}_memory_stats.pickle")
            with open(p, "wb") as f:
                pickle.dump(data, f)
            written.append(p)
        if cfg.dump_memorystats_yaml:
            written.append(write_yaml(data, self._out(f"rank_{r}_memory_stats.yaml")))
        if cfg.dump_summary:
            p = self._out(f"rank_{r}_memory_summary.txt")
            p.write_text(self.summary_table())
            written.append(p)
        if cfg.dump_plot and self.windows:
            written.append(self.plot())
            written.append(self.plot_modules())
        written.extend(self._out(f"fsdp_mem_rank_{r}_{fn}_{i}.log") for fn, i in self.fsdp_reports)
        self._dirty = False
        return written

    def close(self) -> list[Path]:
        """Remove hooks, stop allocator history and write anything not yet written."""
        if not self.cfg.enabled or self._closed:
            return []
        self._remove_hooks()
        self._hooks_on = False
        if self._history_on:
            cuda_record_memory_history(None)
            self._history_on = False
        written = self.dump_memory_stats() if self._dirty else []
        self._closed = True
        _live_profilers.discard(self)
        return written

    def __enter__(self) -> MemProfiler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -------------------------------------------------------------- decorator
    @staticmethod
    def memprofilable(func: F | None = None, *, name: str | None = None) -> F:
        """Profile calls of a method through ``self.memprofiler`` (a no-op when it is None or disabled).

        ``@memprofilable`` uses the method's name; ``@memprofilable(name="step")`` overrides it.
        """

        def decorate(f: F) -> F:
            fn_name = name or f.__name__

            @wraps(f)
            def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                prof = getattr(self, "memprofiler", None)
                if prof is None or not prof:
                    return f(self, *args, **kwargs)
                with prof.profile(fn_name):
                    return f(self, *args, **kwargs)

            return wrapper  # type: ignore[return-value]

        return decorate(func) if func is not None else decorate  # type: ignore[return-value]


memprofilable = MemProfiler.memprofilable
"""Module-level alias of ``MemProfiler.memprofilable``."""
