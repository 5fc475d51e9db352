"""Per-module memory statistics on ``torch.distributed._tools.MemTracker``, with measured times.

For every module: parameter, gradient, buffer, input and output bytes; the
activations it adds in forward; activation and activation-gradient bytes at
its backward peak; the gradients accumulated when its backward starts; its
forward and backward wall time; and the forward/backward module orders. From
those, a peak-memory baseline ``max_i(P_root + G_total_i + A_grad_i + A_total_i)``
(the no-AC, no-FSDP estimate PyTorch's auto-AC ILP starts from).

MemTracker accounts tensor storages through a dispatch mode, so it works on
CPU. Times are measured (forward/backward hooks and a clock; CUDA is
synchronised on each hook when ``sync_cuda``). Times taken inside the ``with``
block include MemTracker's own per-operator overhead (``runtime_source`` says
"measured_under_memtracker"); ``measure_times(step)`` re-times the modules
without it. PyTorch's two runtime estimators need CUDA: on a CPU build they
fail inside module hooks in a way that aborts the whole process, so
``estimate_module_runtimes`` and ``estimate_sac`` refuse to run without CUDA
before touching them. ``collect_sac_stats`` runs torch's SACEstimator itself
on CPU too, timing operators with a CPU clock instead.

Module names are the project's (NOTE [ Module names ] in ``offload.modules``):
``ToyLlama.layers.0`` as torch's ModTracker spells it, also under wrappers, so
rows join the trackers' and the engine ledger's. Frozen parameters (LoRA,
QLoRA base weights) are supported: they count as parameters, not gradients.
Bytes are reported on the model's device, with every device's activation
bytes in ``act_total_by_device`` (on a GPU, host copies of offloaded
activations show there under "cpu").

``ilp_module_info()`` / ``module_info_for_ilp(model, step)`` emit the
``ModuleInfo`` dict of ``torch.distributed._tools.ilp_utils`` so torch's own
``parse_module_info`` / ``get_peak_memory_runtime_baseline`` (and its
auto-AC ILP) can read this profile; given ``collect_sac_stats``' result (or
``sac_forward``), its selective-AC trade-off fields are filled as torch's
``aggregate_stats`` fills them, so ``sac_ilp.sac_milp`` can choose AC units.

Caveat for offloading on a CPU-only host: the engine's "host" copies live on
the same device, so MemTracker counts them as activations; it cannot show an
offload saving there. Use the engine's ledger for that.
"""

from __future__ import annotations

import importlib
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload.modules import module_name, register_model

from ._torch_private import memtracker_skip_frozen_params
from .errors import ProfilingError
from .report import format_bytes, format_table, write_json

__all__ = ["ModuleMemoryStats", "module_info_for_ilp", "collect_sac_stats", "estimate_module_runtimes",
           "estimate_sac"]

def _require_cuda(what: str, on_cpu: str | None = None) -> None:
    if not torch.cuda.is_available():
        raise ProfilingError(
            f"{what} needs CUDA: PyTorch's estimators use CUDA events and device properties, and on a "
            "CPU build they abort the process from inside module hooks. " + (on_cpu or (
                "On CPU use ModuleMemoryStats, whose fw_ms/bw_ms are measured "
                "(ModuleMemoryStats.measure_times(step) times them without MemTracker)."))
        )


def _model_device(model: nn.Module) -> torch.device:
    """The device holding most of the model's parameter bytes (CPU without parameters)."""
    by: dict[torch.device, int] = {}
    for p in model.parameters():
        by[p.device] = by.get(p.device, 0) + p.numel() * p.element_size()
    return max(by, key=by.__getitem__) if by else torch.device("cpu")


class ModuleMemoryStats:
    """Collect per-module memory (MemTracker) and measured times over the steps run inside it.

    ```python
    stats = ModuleMemoryStats(model, optimizer)
    with stats:
        loss = model(x).sum(); loss.backward(); optimizer.step()
    stats.modules()[0]["act_total_bytes"], stats.peak_baseline()
    ```

    Figures are from the latest call of each module; ``reset()`` between
    steps drops older ones (the first step also allocates optimizer state).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, sync_cuda: bool = True) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed._tools.mod_tracker import ModTracker

        self.model = model
        self.optimizer = optimizer
        register_model(model)
        self._in_model = {id(m) for m in model.modules()}
        self.sync_cuda = sync_cuda and torch.cuda.is_available()
        self.mem_tracker = MemTracker()
        self.mem_tracker.track_external(*(x for x in (model, optimizer) if x is not None))
        self._timer = ModTracker()
        self._timer.register_user_hooks(self._pre_fw, self._post_fw, self._pre_bw, self._post_bw)
        self.runtime_source = "measured_under_memtracker"
        """Where ``fw_ms``/``bw_ms`` come from: "measured_under_memtracker" (inside the ``with``
        block: includes MemTracker's overhead), "measured" (``measure_times``, without it) or
        "estimated" (``use_runtimes``)."""
        self._estimated: dict[str, dict[str, float]] | None = None
        self.reset()

    def reset(self) -> None:
        """Drop collected figures (MemTracker module stats, times and orders)."""
        self.mem_tracker.reset_mod_stats()
        self._open: dict[tuple[str, bool], list[float]] = {}
        self._times: dict[str, dict[str, float]] = {}
        self.order: dict[str, list[str]] = {"fw_pre_order": [], "fw_post_order": [],
                                            "bw_pre_order": [], "bw_post_order": []}

    def __enter__(self) -> ModuleMemoryStats:
        self._in_model = {id(m) for m in self.model.modules()}
        self.mem_tracker.__enter__()
        try:
            memtracker_skip_frozen_params(self.mem_tracker, self.model)
            self._timer.__enter__()
        except BaseException:
            self.mem_tracker.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._timer.__exit__(*exc)
        finally:
            self.mem_tracker.__exit__(*exc)

    # ------------------------------------------------------------ timing hooks
    def _now(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _fqn(self, mod: nn.Module | None) -> str | None:
        if mod is None or id(mod) not in self._in_model:
            return None  # e.g. a loss module outside the model: not in its tree
        return module_name(mod)

    def _begin(self, mod: nn.Module | None, bw: bool) -> None:
        fqn = self._fqn(mod)
        if fqn is None:
            return
        order = self.order["bw_pre_order" if bw else "fw_pre_order"]
        if fqn not in order:
            order.append(fqn)
        self._open.setdefault((fqn, bw), []).append(self._now())

    def _end(self, mod: nn.Module | None, bw: bool) -> None:
        fqn = self._fqn(mod)
        if fqn is None:
            return
        starts = self._open.get((fqn, bw))
        if not starts:
            return
        dt_ms = (self._now() - starts.pop()) * 1e3
        t = self._times.setdefault(fqn, {"fw_ms": 0.0, "bw_ms": 0.0})
        t["bw_ms" if bw else "fw_ms"] += dt_ms
        order = self.order["bw_post_order" if bw else "fw_post_order"]
        if fqn not in order:
            order.append(fqn)

    def _pre_fw(self, mod: nn.Module, inputs: Any) -> None:
        self._begin(mod, False)

    def _post_fw(self, mod: nn.Module, inputs: Any, outputs: Any) -> None:
        self._end(mod, False)

    def _pre_bw(self, mod: nn.Module | None, grad_output: Any) -> None:
        self._begin(mod, True)

    def _post_bw(self, mod: nn.Module | None, grad_input: Any) -> None:
        self._end(mod, True)

    def measure_times(self, step: Callable[[], Any], steps: int = 1) -> None:
        """Re-time every module over ``steps`` calls of ``step()`` without MemTracker (averaged per step).

        Times taken inside the ``with`` block include MemTracker's dispatch
        overhead on every operator; these do not (only the module hooks and,
        with ``sync_cuda``, a synchronisation per hook remain).
        """
        if steps < 1:
            raise ValueError(f"ModuleMemoryStats.measure_times: steps={steps} must be >= 1")
        self._times = {}
        self._open = {}
        self._in_model = {id(m) for m in self.model.modules()}
        with self._timer:
            for _ in range(steps):
                step()
        for t in self._times.values():
            t["fw_ms"] /= steps
            t["bw_ms"] /= steps
        self._estimated = None
        self.runtime_source = "measured"

    def use_runtimes(self, runtimes: dict[str, dict[str, float]]) -> None:
        """Replace measured times with estimates from ``estimate_module_runtimes`` (same fqns)."""
        self._estimated = runtimes
        self.runtime_source = "estimated"

    # ----------------------------------------------------------------- results
    def _device(self) -> torch.device:
        return _model_device(self.model)

    def modules(self) -> list[dict[str, Any]]:
        """One dict per module that ran, in forward pre-order (bytes and milliseconds)."""
        from torch.distributed._tools.mem_tracker import _MemRefType, _ModState

        dev = self._device()
        times = self._estimated if self._estimated is not None else self._times

        def snap(stats: Any, state: Any, ref: Any) -> int:
            shots = stats.snapshots.get(state)
            if not shots:
                return 0
            return int(shots[-1].get(dev, {}).get(ref, 0))

        def by_device(stats: Any, state: Any, ref: Any) -> dict[str, int]:
            shots = stats.snapshots.get(state)
            if not shots:
                return {}
            return {str(d): int(v.get(ref, 0)) for d, v in shots[-1].items() if v.get(ref, 0)}

        rows: dict[str, dict[str, Any]] = {}
        for mod in self.model.modules():
            st = self.mem_tracker.memory_tracking.get(mod)
            if st is None:
                continue
            name = module_name(mod)
            act_pre = snap(st, _ModState.PRE_FW, _MemRefType.ACT)
            act_post = snap(st, _ModState.POST_FW, _MemRefType.ACT)
            t = times.get(name, {})
            rows[name] = {
                "fqn": name,
                "param_bytes": int(st.parameter_mem),
                # one gradient per trainable parameter: frozen (LoRA base) weights get none
                "grad_bytes": sum(p.numel() * p.element_size() for p in mod.parameters() if p.requires_grad),
                "buffer_bytes": int(st.buffer_mem),
                "input_bytes": int(st.input_mem),
                "output_bytes": int(st.output_mem),
                "act_fw_bytes": max(0, act_post - act_pre - int(st.output_mem)),
                "act_bw_bytes": max(0, snap(st, _ModState.PEAK_BW, _MemRefType.ACT)),
                "act_grad_bytes": snap(st, _ModState.PEAK_BW, _MemRefType.TEMP)
                - snap(st, _ModState.PRE_BW, _MemRefType.TEMP),
                "act_total_bytes": act_post,
                "act_total_by_device": by_device(st, _ModState.POST_FW, _MemRefType.ACT),
                "grad_total_bytes": snap(st, _ModState.PRE_BW, _MemRefType.GRAD),
                "peak_bytes": int(st.local_peak.get(dev, 0)),
                "peak_by_device": {str(d): int(v) for d, v in st.local_peak.items()},
                "fw_ms": float(t.get("fw_ms", 0.0)),
                "bw_ms": float(t.get("bw_ms", 0.0)),
                "is_leaf": not any(True for _ in mod.children()),
                "depth": name.count("."),
            }
        pre = self.order["fw_pre_order"]
        rank = {fqn: i for i, fqn in enumerate(pre)}
        return sorted(rows.values(), key=lambda r: rank.get(r["fqn"], len(pre)))

    def peak(self, device: torch.device | str | None = None) -> dict[str, int]:
        """MemTracker's peak snapshot on ``device`` (default: the model's): ``{category: bytes, "Total": bytes}``."""
        dev = torch.device(device) if device is not None else self._device()
        snap = self.mem_tracker.get_tracker_snapshot("peak").get(dev, {})
        return {getattr(k, "name", str(k)): int(v) for k, v in snap.items()}

    def peak_by_device(self) -> dict[str, dict[str, int]]:
        """MemTracker's peak snapshot on every device it saw (host copies of offloaded activations: "cpu")."""
        return {str(d): {getattr(k, "name", str(k)): int(v) for k, v in snap.items()}
                for d, snap in self.mem_tracker.get_tracker_snapshot("peak").items()}

    def ilp_module_info(self, sac: Any = None) -> dict[str, Any]:
        """This profile as torch's ``ilp_utils.ModuleInfo``: ``{"mod_order": ..., "mod_stats": [...]}``.

        Feed it to ``torch.distributed._tools.ilp_utils.parse_module_info`` and
        ``get_peak_memory_runtime_baseline`` (or the auto-AC ILP). Bytes are on
        the model's device, times in ms (``runtime_source`` says how they were
        obtained). ``sac`` is ``collect_sac_stats``' result: a module it has
        trade-off statistics for gets them (``sac_runtime``, ``sac_memory``,
        the piecewise-linear fit) and ``is_leaf=False``, i.e. it is an AC
        candidate, exactly as torch's ``aggregate_stats`` does. Without it the
        trade-off fields are empty and every module is marked ``is_leaf``, so
        the ILP treats none as an AC candidate.
        """
        tradeoff = dict(getattr(sac, "sac_mod_tradeoff_stats", {}) or {})
        rows = self.modules()
        names = {r["fqn"] for r in rows}
        order = {k: [f for f in v if f in names] for k, v in self.order.items()}
        ran = set(order["fw_pre_order"])
        stats = []
        for r in rows:
            if r["fqn"] not in ran:
                continue
            stats.append({
                "fqn": r["fqn"],
                "param_per_module": r["param_bytes"],
                "grad_per_module": r["grad_bytes"],
                "grad_total": r["grad_total_bytes"],
                "act_fw_per_module": r["act_fw_bytes"],
                "act_bw_per_module": r["act_bw_bytes"],
                "act_grad_per_module": r["act_grad_bytes"],
                "act_total": r["act_total_bytes"],
                "input_per_module": r["input_bytes"],
                "output_per_module": r["output_bytes"],
                "fw_runtime_per_module": r["fw_ms"],
                "bw_runtime_per_module": r["bw_ms"],
                **_sac_fields(tradeoff.get(r["fqn"])),
            })
        return {"mod_order": order, "mod_stats": stats}

    def peak_baseline(self) -> tuple[int, float]:
        """(peak bytes, forward + backward ms of the root) with no AC and no FSDP."""
        rows = self.modules()
        if not rows:
            raise ProfilingError("ModuleMemoryStats: no module ran inside the `with` block; nothing to estimate")
        root = rows[0]
        peak = max(root["param_bytes"] + r["grad_total_bytes"] + r["act_grad_bytes"] + r["act_total_bytes"]
                   for r in rows)
        return peak, root["fw_ms"] + root["bw_ms"]

    def summary(self) -> dict[str, Any]:
        peak, ms = self.peak_baseline()
        return {
            "modules": self.modules(),
            "order": {k: list(v) for k, v in self.order.items()},
            "peak": self.peak(),
            "baseline_peak_bytes": peak,
            "baseline_runtime_ms": ms,
            "runtime_source": self.runtime_source,
            "peak_by_device": self.peak_by_device(),
        }

    def table(self, depth: int | None = None, unit: str = "auto") -> str:
        rows = [r for r in self.modules() if depth is None or r["depth"] <= depth]
        cols = ["fqn", "param_bytes", "input_bytes", "output_bytes", "act_fw_bytes", "act_total_bytes",
                "act_grad_bytes", "grad_total_bytes", "fw_ms", "bw_ms"]
        peak, ms = self.peak_baseline() if rows else (0, 0.0)
        title = (f"Per-module memory (MemTracker) and {self.runtime_source} times; "
                 f"baseline peak {format_bytes(peak)}, runtime {ms:.2f} ms")
        return format_table(rows, cols, title=title, byte_columns=[c for c in cols if c.endswith("_bytes")],
                            unit=unit)

    def to_json(self, path: str | Path) -> Path:
        return write_json(self.summary(), path)


def _sac_fields(t: Any) -> dict[str, Any]:
    """The selective-AC fields of one ``ModStats`` from a ``SACTradeOffStats`` (None: a leaf, as torch does)."""
    if t is None:
        return {"is_leaf": True, "sac_runtime": 0.0, "sac_memory": 0, "n_segments": 0, "slopes": [],
                "intercepts": [], "breakpoints": [], "tradeoff_curve": OrderedDict()}
    return {"is_leaf": False, "sac_runtime": float(t.sac_runtime), "sac_memory": int(t.sac_memory),
            "n_segments": int(t.n_segments), "slopes": list(t.slopes), "intercepts": list(t.intercepts),
            "breakpoints": list(t.fit_breaks), "tradeoff_curve": OrderedDict(t.tradeoff_curve)}


SAC_MODES = ("cpu-benchmark", "operator-level-benchmark", "operator-level-cost-model")
"""``collect_sac_stats`` modes: ours (a CPU clock around each operator), then torch's two (CUDA only)."""


def collect_sac_stats(
    model: nn.Module,
    forward: Callable[[], Any],
    *,
    mode: str | None = None,
    n_segments: int = 2,
    seed: int = 0,
) -> Any:
    """Run torch's ``SACEstimator`` over ``forward()`` and fit its trade-off curves; return the estimator.

    ``forward()`` runs the model's forward only (a loss may follow; no
    backward): it runs once under ``FakeTensorMode(allow_non_fake_inputs=True)``,
    so the model's real parameters and buffers are read as fake tensors and
    nothing real is computed or changed. The estimator's ``sac_mod_stats``
    (per non-leaf module: operators, their output bytes and times, which ones
    autograd saves), ``sac_mod_greedy_order_meta`` and, after the fit,
    ``sac_mod_tradeoff_stats`` are torch's own; pass the estimator to
    ``ModuleMemoryStats.ilp_module_info(sac=...)``.

    ``mode``: ``"cpu-benchmark"`` (default on a CPU model) times every
    operator on real CPU tensors of the same shapes with this thread's clock
    (``offload.profiling._torch_private.CpuOpTimer``; torch's benchmark mode with a
    CPU clock); ``"operator-level-benchmark"`` (default on CUDA) and
    ``"operator-level-cost-model"`` are torch's, CUDA only. The
    piecewise-linear fit (``pwlf``, differential evolution) draws from numpy's
    global generator: it is seeded with ``seed`` and restored afterwards, so
    the same profile gives the same fit.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.sac_estimator import SACEstimator

    from ._torch_private import CpuOpTimer, sac_estimator_use_timer

    dev = _model_device(model)
    if mode is None:
        mode = "operator-level-benchmark" if dev.type == "cuda" else "cpu-benchmark"
    if mode not in SAC_MODES:
        raise ValueError(f"collect_sac_stats: mode={mode!r} is not one of {SAC_MODES}")
    if mode == "cpu-benchmark" and dev.type != "cpu":
        raise ValueError(f"collect_sac_stats: mode='cpu-benchmark' times operators on CPU, but the model is on "
                         f"{dev}; use mode='operator-level-benchmark' there")
    if mode != "cpu-benchmark":
        _require_cuda(f"collect_sac_stats(mode={mode!r})",
                      "On CPU use mode='cpu-benchmark' (the default there): it times operators with a CPU clock.")
    try:
        import numpy as np
        importlib.import_module("pwlf")  # torch's trade-off fit imports it lazily; fail here, clearly
    except ImportError as e:
        raise ProfilingError(f"collect_sac_stats needs numpy and pwlf for torch's trade-off fit ({e}); "
                             "pip install pwlf (or offload[ilp])") from e
    sace = SACEstimator()
    if mode == "cpu-benchmark":
        from offload.planner.meter import host_clock

        sac_estimator_use_timer(sace, CpuOpTimer(host_clock()))
    else:
        sace(estimate_mode_type=mode)
    register_model(model)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with sace:
            forward()
    if not sace.sac_mod_stats:
        raise ProfilingError("collect_sac_stats: no module with children ran inside forward(); SACEstimator has "
                             "no module to report (is forward() calling the model?)")
    state = np.random.get_state()
    try:
        np.random.seed(seed)
        sace.pwlf_sac_tradeoff_curve(n_segments=n_segments)
    finally:
        np.random.set_state(state)
    return sace


def module_info_for_ilp(
    model: nn.Module,
    step: Callable[[], Any],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    warmup_steps: int = 1,
    timing_steps: int = 1,
    sac_forward: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Profile ``step()`` and return torch's auto-AC ``ModuleInfo`` dict (works on CPU).

    ``step()`` runs one training step of ``model`` (forward, backward and,
    if given, ``optimizer.step()``). It is called ``warmup_steps`` times
    first (so optimizer state exists), once under MemTracker for memory, then
    ``timing_steps`` times without it for the times (see
    ``ModuleMemoryStats.ilp_module_info`` for what the dict holds). With
    ``sac_forward`` (the forward alone), the selective-AC fields are filled by
    ``collect_sac_stats(model, sac_forward)`` and the ILP can choose AC units.

    >>> info = module_info_for_ilp(model, lambda: train_step(batch), optimizer=opt)
    >>> from torch.distributed._tools.ilp_utils import parse_module_info, get_peak_memory_runtime_baseline
    >>> peak_bytes, runtime_ms = get_peak_memory_runtime_baseline(parse_module_info(info))
    """
    for _ in range(warmup_steps):
        step()
    stats = ModuleMemoryStats(model, optimizer)
    with stats:
        step()
    stats.measure_times(step, timing_steps)
    sac = collect_sac_stats(model, sac_forward) if sac_forward is not None else None
    return stats.ilp_module_info(sac=sac)


def estimate_module_runtimes(
    setup: Callable[[], Any],
    step: Callable[[Any], None],
    *,
    mode: str = "operator-level-cost-model",
) -> dict[str, dict[str, float]]:
    """Per-module fw/bw runtime estimates (ms) from PyTorch's RuntimeEstimator. CUDA only.

    ``setup()`` builds the model, optimizer and inputs under ``FakeTensorMode``
    and returns them (build on the device, ``with torch.device("cuda"):``, not with
    ``model.cuda()``: under fake mode that swaps tensors, which torch refuses while the mode holds
    weak references to them); ``step(state)`` runs one training step under the estimator.
    ``mode`` is ``"operator-level-cost-model"`` (roofline) or ``"operator-level-benchmark"``.
    """
    _require_cuda("estimate_module_runtimes")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    est = RuntimeEstimator()
    with FakeTensorMode():
        state = setup()
        with est(estimate_mode_type=mode):
            step(state)
    return {fqn: {"fw_ms": float(v["fw"]), "bw_ms": float(v["bw"])} for fqn, v in est.mod_runtimes.items()}


def estimate_sac(
    setup: Callable[[], Any],
    step: Callable[[Any], None],
    *,
    mode: str = "operator-level-cost-model",
) -> dict[str, dict[str, float]]:
    """Per-module selective-AC statistics from PyTorch's SACEstimator. CUDA only.

    Returns, per module fqn: operator count, operators whose outputs autograd
    saves, and the summed operator memory (bytes) and runtime (ms).
    """
    _require_cuda("estimate_sac")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.sac_estimator import SACEstimator

    sace = SACEstimator()
    with FakeTensorMode():
        state = setup()
        with sace(estimate_mode_type=mode):
            step(state)
    return {
        fqn: {
            "num_ops": len(s.func_names),
            "saved_ops": len(s.saved_autograd_ops),
            "memory_bytes": int(sum(s.memory)),
            "runtime_ms": float(sum(s.runtimes)),
        }
        for fqn, s in sace.sac_mod_stats.items()
    }

