"""Run strategies on one workload: warm up, time steps, read memory, check numerics.

One model and one batch are shared by every strategy (no optimizer: the
parameters never change, so every step of every strategy computes the same
loss and gradients, and each is compared bitwise with ``none``). Gradients are
allocated up front and zeroed in place, so "static" memory is parameters +
gradients and activation memory is what a step adds on top.

Order: on CPU the strategies are *interleaved* (one step of each per round),
so machine-load drift hits every strategy alike; on a GPU they run
*sequentially*, one engine (and host pool) alive at a time. Compiled
strategies always run alone.

Memory:
* GPU: ``max_memory_allocated`` / ``max_memory_reserved`` over the measured
  steps; activation bytes = peak allocated - allocated before the step.
* CPU: one extra profiled step per strategy; activation bytes = the peak of the
  running sum of CPU allocations and frees during that fwd+bwd (torch.profiler
  memory events). Host and device are one memory on CPU, so every arm's host
  copies are counted alike: ``save_on_cpu``'s fresh copies, and the engine's
  pool buffers (the pool is emptied before the profiled step, so its buffers
  are allocated inside it instead of being reused from warm-up). The bytes each
  arm's pack hook allocates (its host copies) are reported beside it, measured
  the same way for every arm (allocations inside the pack hook).

Host footprint (the pool target) is measured outside the pool's own counters:
on CPU, the bytes the pack hook allocated in that profiled step; on a GPU, the
growth of the bytes PyTorch's pinned host allocator holds from the driver
(``allocated_bytes``: blocks in use and cached, rounded block sizes;
``torch.cuda.host_memory_stats``) over the strategy's run, its cache emptied before
the run starts. Either is divided by the bytes the ledger says were offloaded (and
so held at once) in one step. Not ``active_bytes``: torch 2.11's allocator never
takes a freed block out of it (``ATen/core/CachingHostAllocator.h`` there: ``free``
without events skips the stat, and processing events decreases it by the size
argument, -1), so it grows by every block ever freed; the H200 run's 2.09x for
``offload`` was that counter (`account_only`, which pins nothing, grew it by 12).

Time: wall clock per step, and process CPU time per step (``time.process_time``),
which a descheduled process does not accumulate: on a shared CPU machine the
steadier measure of what a strategy costs.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil
import torch
from torch.profiler import record_function

from bench.model import ToyLlama, make_batch
from bench.progress import bar, note
from bench import verdict
from bench.env import gpu_trace_state
from bench.results import BenchResult, EngineStats, StrategyResult
from bench.strategies import STRATEGIES, BenchEnv, Prepared, Skip, StrategySpec
from bench.verdict import Snapshot
from bench.workloads import Workload

__all__ = ["BenchConfig", "run_bench", "fit_layers", "Progress", "CpuMemory", "cpu_memory_profile",
           "cpu_activation_peak"]

CPU_ACTIVATION_SOURCE = (
    "cpu: peak net bytes allocated during one profiled fwd+bwd (torch.profiler memory events), host copies "
    "included for every arm (host and device are one memory on CPU; the engine's pool is emptied first, "
    "so its buffers count like save_on_cpu's copies)"
)
GPU_ACTIVATION_SOURCE = "cuda: max_memory_allocated during the step - memory_allocated before it"


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    workload: Workload
    """Model shape and batch geometry."""
    strategies: tuple[str, ...]
    """Strategy names, run in this order (``none`` is moved first: its first measured step is the
    correctness reference). Interleaved rounds rotate the order by one each round."""
    device: str = "cpu"
    """``"cpu"`` or ``"cuda"``."""
    steps: int = 20
    """Measured steps per strategy."""
    warmup: int = 2
    """Unmeasured steps per strategy before measuring (pool fills, compile, allocator settles)."""
    order: str = "interleaved"
    """``"interleaved"`` (one step of each strategy per round) or ``"sequential"``."""
    seed: int = 0
    """Seed for weights and tokens."""
    progress: bool = True
    """Print progress to stderr."""
    fit_budget_frac: float = 0.85
    """For ``fit_layers`` workloads: fraction of device memory the ``none`` step may use."""
    deterministic_check: bool | None = None
    """Judge correctness on one extra step per strategy with deterministic algorithms on
    (None: on GPU only, where default kernels may accumulate with atomics)."""
    trace: tuple[str, ...] = ()
    """Strategies that get one more step under ``torch.profiler`` after their measured ones, summarised by
    ``bench.trace_summary`` into ``StrategyResult.trace``."""
    trace_dir: Path | None = None
    """Where each traced step's chrome trace goes (``trace_<run_id>_<strategy>.json.gz``); None: not kept."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"BenchConfig: steps={self.steps} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"BenchConfig: warmup={self.warmup} must be >= 0")
        if self.order not in ("interleaved", "sequential"):
            raise ValueError(f"BenchConfig: order={self.order!r}; use 'interleaved' or 'sequential'")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"BenchConfig: unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
        untraced = [s for s in self.trace if s not in self.strategies]
        if untraced:
            raise ValueError(f"BenchConfig: trace={untraced} names strategies this run does not run; run them "
                             f"(strategies={','.join(self.strategies)}) or trace one of those")


class Progress:
    """The run's progress bar (``tqdm`` on stderr): one tick per step, the total shrinks when a
    strategy is skipped or fails, and the current phase is shown beside the bar."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar = bar(max(total, 0), "bench", enabled=enabled)

    @property
    def total(self) -> int:
        return int(self._bar.total or 0)

    @property
    def done(self) -> int:
        return int(self._bar.n)

    def step(self, label: str) -> None:
        """One step of strategy ``label`` done."""
        self._bar.set_postfix_str(label, refresh=False)
        self._bar.update(1)

    def phase(self, label: str) -> None:
        """Show what runs now (a phase without steps: preparing, profiling, writing)."""
        self._bar.set_postfix_str(label)

    def drop(self, steps: int) -> None:
        """``steps`` planned steps will not run (a strategy was skipped or failed)."""
        if steps > 0:
            self._bar.total = max(self.done, self.total - steps)
            self._bar.refresh()

    def note(self, text: str) -> None:
        note(text, enabled=self.enabled)

    def close(self) -> None:
        self._bar.close()


# ------------------------------------------------------------------ model


def build_model(workload: Workload, device: torch.device, seed: int, n_layers: int | None = None) -> ToyLlama:
    torch.manual_seed(seed)
    with torch.device(device):
        model = ToyLlama(workload.model_config(n_layers))
    model.to(workload.torch_dtype)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def _zero_grads(model: ToyLlama) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit_layers(workload: Workload, device: torch.device, budget_frac: float, seed: int = 0) -> int:
    """How many blocks of ``workload`` fit when ``none`` (the most memory-hungry strategy) runs.

    Measures the peak of a 1-block and a 2-block model; the difference is one block's
    cost (weights, grads, activations), the rest is the embedding/head/logits base.
    """
    if device.type != "cuda":
        return workload.n_layers
    peaks = []
    for n in (1, 2):
        model = build_model(workload, device, seed, n_layers=n)
        tokens, targets = make_batch(model.cfg, workload.batch, workload.seq_len, device=device, seed=seed)
        env = BenchEnv(model=model, tokens=tokens, targets=targets, device=device, engine_device=None)
        step = STRATEGIES["none"].prepare(env).step
        step()
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        peaks.append(torch.cuda.max_memory_allocated(device))
        del model, env, step, tokens, targets
        gc.collect()
        torch.cuda.empty_cache()
    per_layer = max(peaks[1] - peaks[0], 1)
    base = peaks[0] - per_layer
    total = torch.cuda.get_device_properties(device).total_memory
    fit = int((budget_frac * total - base) // per_layer)
    return max(1, min(workload.n_layers, fit))


# ------------------------------------------------------------------ measurement helpers


_PACK_TAG = "bench::pack_hook"


@dataclass
class CpuMemory:
    """What one profiled CPU step allocated (torch.profiler memory events)."""

    peak_bytes: int
    """Peak of the running sum of allocations minus frees."""
    pack_hook_bytes: int
    """Bytes allocated while the saved-tensor pack hook ran (an arm's host copies)."""
    net_bytes: int
    """Allocations minus frees over the whole step (what the step left allocated)."""


@contextlib.contextmanager
def _tag_pack_hook(hooks: Any) -> Any:
    """Run ``hooks``' pack hook (a ``saved_tensors_hooks`` instance) inside a profiler range."""
    if hooks is None:
        yield
        return
    original = hooks.pack_hook

    def pack(tensor: torch.Tensor) -> Any:
        with record_function(_PACK_TAG):
            return original(tensor)

    hooks.pack_hook = pack
    try:
        yield
    finally:
        hooks.pack_hook = original


@contextlib.contextmanager
def _without_kineto_usdt_lines() -> Any:
    """Kineto's C++ logger writes ``USDT: ... profiler_start`` / ``profiler_stop`` straight to file
    descriptor 2, through the progress bar, and no setting turns it off: stderr is captured for the
    profiled step and written back without those lines."""
    import tempfile

    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith("USDT:")]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def cpu_memory_profile(step: Callable[[], Any], hooks: Any = None) -> CpuMemory:
    """Profile ``step()``'s CPU allocations; with ``hooks``, also those made inside its pack hook."""
    from torch.profiler import ProfilerActivity, profile

    with _without_kineto_usdt_lines(), _tag_pack_hook(hooks), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # kineto_results carries every [memory] event with its signed size; the public
    # EventList drops some of them, which breaks the running sum.
    events = list(prof.profiler.kineto_results.events())
    mem = sorted(
        (e.start_ns(), e.nbytes(), e.start_thread_id())
        for e in events
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    ranges = [(e.start_ns(), e.end_ns(), e.start_thread_id()) for e in events if e.name() == _PACK_TAG]
    current = peak = 0
    for _, nbytes, _ in mem:
        current += nbytes
        peak = max(peak, current)
    in_hook = 0
    if ranges:
        ranges.sort()
        starts = [r[0] for r in ranges]
        for t, nbytes, tid in mem:
            if nbytes <= 0:
                continue
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= ranges[i][1] and tid == ranges[i][2]:
                in_hook += nbytes
    return CpuMemory(peak_bytes=peak, pack_hook_bytes=in_hook, net_bytes=current)


def cpu_activation_peak(step: Callable[[], Any]) -> int:
    """Peak of the running sum of CPU allocations minus frees during ``step()`` (bytes)."""
    return cpu_memory_profile(step).peak_bytes


def _ledger_summary(engine: Any) -> dict[str, Any] | None:
    if engine is None:
        return None
    try:
        return engine.ledger.summary()
    except AttributeError:
        return None


def _engine_stats(engine: Any, before: dict[str, Any], after: dict[str, Any], steps: int) -> EngineStats:
    def per_step(key: str) -> float:
        return (after.get(key, 0) - before.get(key, 0)) / steps

    kept_after = after.get("kept_by_reason", {})
    kept_before = before.get("kept_by_reason", {})
    kept = {k: (v - kept_before.get(k, 0)) / steps for k, v in kept_after.items() if v - kept_before.get(k, 0)}
    pool_a, pool_b = after.get("pool", {}), before.get("pool", {})
    return EngineStats(
        steps=steps,
        packed_bytes=per_step("packed_bytes"),
        offloaded_bytes=per_step("offloaded_bytes"),
        kept_bytes=per_step("kept_bytes"),
        kept_by_reason=kept,
        d2h_bytes=per_step("d2h_bytes"),
        d2h_seconds=per_step("d2h_seconds"),
        h2d_bytes=per_step("h2d_bytes"),
        h2d_seconds=per_step("h2d_seconds"),
        stall_seconds=per_step("stall_seconds"),
        peak_inflight_bytes=int(after.get("peak_inflight_bytes", 0)),
        pool_reserved_bytes=int(pool_a.get("reserved_bytes", 0)),
        pool_peak_reserved_bytes=int(pool_a.get("peak_reserved_bytes", 0)),
        pool_peak_in_use_bytes=int(pool_a.get("peak_in_use_bytes", 0)),
        pool_allocations_total=int(pool_a.get("allocations", 0)),
        pool_allocations_after_warmup=int(pool_a.get("allocations", 0) - pool_b.get("allocations", 0)),
        pool_pin_failures=int(pool_a.get("pin_failures", 0)),
        module_offloaded_bytes=_last_step_by_module(engine),
        held_bytes_last_step=_held_bytes_last_step(engine),
    )


def _held_bytes_last_step(engine: Any) -> int | None:
    """Bytes the ledger says were copied to host in the engine's last step (all held at once at the end
    of its forward: the forward runs inside the context, backward after it)."""
    totals = getattr(engine.ledger, "step_totals", None)
    if not totals:
        return None
    return int(totals[-1].d2h_bytes)


def _host_pinned_bytes(*, empty_cache: bool = False) -> int | None:
    """Bytes PyTorch's caching host allocator holds pinned from the driver (``allocated_bytes``: blocks in
    use and cached, rounded sizes), or None. ``empty_cache``: first hand every free block back (after a
    synchronize, so blocks freed with copies queued are free by then): a strategy's run starts from there."""
    try:
        if empty_cache:
            from offload._pinned import return_pinned_cache

            return_pinned_cache("cuda")  # synchronize, then hand the free blocks back
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except Exception:  # older torch, or no CUDA
        return None


def _last_step_by_module(engine: Any, top: int = 48) -> dict[str, int]:
    """Bytes moved to host in the engine's last recorded step, by module (largest first)."""
    records = list(getattr(engine.ledger, "records", []))
    if not records:
        return {}
    last = max(r.step for r in records)
    by: dict[str, int] = {}
    for r in records:
        if r.step == last and r.decision == "offloaded":
            by[r.module] = by.get(r.module, 0) + r.copy_bytes
    return dict(sorted(by.items(), key=lambda kv: -kv[1])[:top])


# ------------------------------------------------------------------ one strategy


@dataclass
class _Runner:
    spec: StrategySpec
    result: StrategyResult
    prepared: Prepared | None = None
    steps_done: int = 0
    peak_alloc: int = 0
    peak_reserved: int = 0
    static: int | None = None
    ledger_before: dict[str, Any] | None = None
    host_pinned_before: int | None = None
    losses: list[float] = field(default_factory=list)
    planned: int = 0
    """Steps this strategy still owes the progress bar (dropped from its total if it stops)."""
    done: bool = False
    """Its result is final (ran, skipped or failed): the results file written after it shows it as is."""

    @property
    def active(self) -> bool:
        return self.prepared is not None and self.result.status == "ok"


@dataclass
class _Reference:
    """A reference strategy's correctness step (what the others are compared with)."""

    snapshot: Snapshot
    nondeterministic_ops: list[str]
    """Kernels without a deterministic implementation in its step (empty: all deterministic)."""
    floor: Snapshot | None
    """A second run of it when some kernel is not deterministic: its difference is the noise floor."""


class _Bench:
    def __init__(self, cfg: BenchConfig, workload: Workload, progress: Progress) -> None:
        self.cfg = cfg
        self.workload = workload
        self.device = torch.device(cfg.device)
        self.progress = progress
        self.model = build_model(workload, self.device, cfg.seed)
        tokens, targets = make_batch(self.model.cfg, workload.batch, workload.seq_len, device=self.device, seed=cfg.seed)
        self.env = BenchEnv(
            model=self.model, tokens=tokens, targets=targets, device=self.device,
            engine_device="cpu" if self.device.type == "cpu" else None,
        )
        self.deterministic_check = (cfg.deterministic_check if cfg.deterministic_check is not None
                                    else self.device.type == "cuda")
        self.references: dict[str, _Reference] = {}
        self.reference_names = {spec.reference for spec in STRATEGIES.values()}
        self.process = psutil.Process()
        self.stopped: str | None = None
        """Why the strategies not yet run will not run in this process (a CUDA context left unusable by
        an error, or an interrupt); None while the run goes on."""

    # -- lifecycle

    def new_runner(self, name: str) -> _Runner:
        spec = STRATEGIES[name]
        result = StrategyResult(
            name=name, description=spec.description, status="ok",
            tokens_per_step=self.workload.tokens_per_step, flops_per_step=self.workload.flops_per_step(),
            activation_source=GPU_ACTIVATION_SOURCE if self.device.type == "cuda" else CPU_ACTIVATION_SOURCE,
        )
        return _Runner(spec=spec, result=result)

    def prepare(self, r: _Runner) -> None:
        self.progress.phase(f"preparing {r.spec.name}")
        if self.device.type == "cuda":
            r.host_pinned_before = _host_pinned_bytes(empty_cache=True)
        try:
            r.prepared = r.spec.prepare(self.env)
        except Skip as e:
            self._fail(r, "skipped", str(e))
        except Exception as e:  # a strategy that breaks must not take the others down
            raise_interrupt(e)
            self._fail(r, "error", f"prepare failed: {type(e).__name__}: {e}", tb=True)

    def _fail(self, r: _Runner, status: str, reason: str, tb: bool = False) -> None:
        r.result.status = status
        r.result.reason = reason
        if tb:
            traceback.print_exc(file=sys.stderr)
        self.progress.note(f"{r.spec.name}: {status}: {reason}")
        self.progress.drop(r.planned)
        r.planned = 0
        try:
            self.release(r)
        except Exception:  # releasing a broken strategy must not take the others down
            traceback.print_exc(file=sys.stderr)
        if status == "error" and self.stopped is None:
            broken = device_unusable(self.device)
            if broken is not None:
                self.stopped = (f"not run: the {self.device.type.upper()} context was unusable after "
                                f"{r.spec.name}'s error ({broken}); run this strategy in a fresh process")
                self.progress.note(self.stopped)

    @contextlib.contextmanager
    def guard(self, r: _Runner, what: str) -> Any:
        """Record an exception raised by ``what`` as this strategy's error (its peers run on)."""
        try:
            yield
        except Exception as e:
            raise_interrupt(e)
            if r.result.status == "ok":
                self._fail(r, "error", f"{what} failed: {type(e).__name__}: {e}", tb=True)

    def release(self, r: _Runner) -> None:
        self.progress.phase(f"releasing {r.spec.name}")
        prepared, r.prepared = r.prepared, None
        if prepared is not None and prepared.close is not None:
            try:
                prepared.close()
            except Exception:
                traceback.print_exc(file=sys.stderr)
        pool = getattr(getattr(prepared, "engine", None), "pool", None)
        if pool is not None:
            # Hand the engine's host buffers back now (pinned ones are unregistered properly)
            # rather than leaving them to garbage collection while the next strategy runs.
            pool.clear()
        del prepared
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- steps

    def step(self, r: _Runner, measure: bool) -> None:
        if not r.active or self.stopped is not None:
            return
        assert r.prepared is not None
        _zero_grads(self.model)
        _sync(self.device)
        cuda = self.device.type == "cuda"
        if cuda and measure:
            static = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        # Start each timed step with a fresh collector: several engines (and their ledgers) are alive
        # at once here, which a training process never has, and a full collection over all of them
        # would land on whichever strategy happened to trigger it. Young-generation collections
        # caused by a strategy's own allocations still count against it.
        gc.collect()
        try:
            c0, t0 = time.process_time(), time.perf_counter()
            loss = r.prepared.step()
            di = time.perf_counter() - t0
            _sync(self.device)
            dt = time.perf_counter() - t0
            dc = time.process_time() - c0
        except torch.OutOfMemoryError as e:
            self._fail(r, "oom", f"out of device memory: {str(e).splitlines()[0]}")
            return
        except Exception as e:
            raise_interrupt(e)
            self._fail(r, "error", f"step failed: {type(e).__name__}: {e}", tb=True)
            return
        r.planned -= 1
        self.progress.step(r.spec.name)
        if not measure:
            return
        r.result.times.seconds.append(dt)
        r.result.times.cpu_seconds.append(dc)
        r.result.times.issue_seconds.append(di)
        r.losses.append(float(loss))
        r.steps_done += 1
        if cuda:
            r.static = static if r.static is None else max(r.static, static)
            r.peak_alloc = max(r.peak_alloc, torch.cuda.max_memory_allocated(self.device))
            r.peak_reserved = max(r.peak_reserved, torch.cuda.max_memory_reserved(self.device))
        if not self.deterministic_check and r.spec.name in self.reference_names and r.spec.name not in self.references:
            # Every step computes the same loss and grads (no optimizer), so the first measured
            # step of `none` is the reference for every other strategy's last step.
            self.references[r.spec.name] = _Reference(
                Snapshot.take(loss, [p.grad for p in self.model.parameters()]), [], None)
        if r.steps_done == self.cfg.steps:
            with self.guard(r, "the correctness check"):
                self.after_last_step(r, loss)

    def begin_measuring(self, r: _Runner) -> None:
        if r.active:
            r.ledger_before = _ledger_summary(r.prepared.engine)

    def after_last_step(self, r: _Runner, loss: torch.Tensor) -> None:
        """Engine stats over the measured steps, then correctness against the reference strategy.

        On CPU every step is deterministic, so the measured steps are compared directly (the
        reference is its first measured step; its last step checks that it repeats). On a GPU
        some default kernels (flash-attention backward) accumulate with atomics, so correctness
        comes from one extra step per strategy with deterministic algorithms enforced, or judged
        against the reference's noise floor where a kernel cannot be deterministic
        (``bench/verdict.py``).
        """
        engine = r.prepared.engine if r.prepared is not None else None
        after = _ledger_summary(engine)
        if after is not None and r.ledger_before is not None:
            r.result.engine = _engine_stats(engine, r.ledger_before, after, r.steps_done)
            # Only when this strategy runs alone: interleaved, other engines' pools would be in the delta.
            alone = self.cfg.order == "sequential" or r.prepared.isolated
            host_now = _host_pinned_bytes() if self.device.type == "cuda" and alone else None
            if host_now is not None and r.host_pinned_before is not None:
                r.result.engine.host_bytes_measured = host_now - r.host_pinned_before
                r.result.engine.host_bytes_source = (
                    "cuda pinned host allocator: growth of allocated_bytes (pinned from the driver, cached blocks "
                    "included; the cache emptied before the run) over the strategy's run "
                    "(torch.cuda.host_memory_stats, rounded block sizes)")
        r.result.loss = float(loss)
        is_reference = r.spec.name in self.reference_names
        against = r.spec.name if is_reference else r.spec.reference
        if not self.deterministic_check:
            ref = self.references.get(against)
            if ref is not None:
                got = Snapshot.take(loss, [p.grad for p in self.model.parameters()])
                r.result.correctness = verdict.compare(ref.snapshot, got, against, tolerance=self._tolerance(r))
            return
        try:
            self.progress.phase(f"{r.spec.name}: deterministic correctness step")
            got = self._deterministic_step(r)
            if is_reference and r.spec.name not in self.references:
                again = self._deterministic_step(r)  # a second one: does the reference repeat?
                self.references[r.spec.name] = _Reference(got.snapshot, got.nondeterministic_ops,
                                                          None if got.strict else again.snapshot)
                got = again
        except Exception as e:  # OOM, or a failure the step itself did not have: no verdict
            raise_interrupt(e)
            r.result.correctness = None
            self.progress.note(f"{r.spec.name}: correctness step failed: {type(e).__name__}: {e}")
            return
        ref = self.references.get(against)
        if ref is not None:
            ops = sorted(set(ref.nondeterministic_ops) | set(got.nondeterministic_ops))
            r.result.correctness = verdict.compare(ref.snapshot, got.snapshot, against, floor=ref.floor, ops=ops,
                                                   tolerance=self._tolerance(r))

    def _tolerance(self, r: _Runner) -> float | None:
        """The relative tolerance of a strategy that reorders sums over tokens (None: judged bitwise)."""
        return verdict.reordered_tolerance(self.workload.torch_dtype) if r.spec.reorders_sums else None

    def _deterministic_step(self, r: _Runner) -> verdict.Step:
        """One step with deterministic algorithms enforced where the kernels allow (bench/verdict.py)."""
        assert r.prepared is not None

        def step() -> torch.Tensor:
            loss = r.prepared.step()
            _sync(self.device)
            return loss

        return verdict.deterministic_step(step, lambda: _zero_grads(self.model),
                                          lambda: [p.grad for p in self.model.parameters()])

    def _cpu_memory_step(self, r: _Runner) -> None:
        """One profiled step: activation peak with every arm's host copies counted alike, the bytes its
        pack hook allocated, and (ours) the host footprint measured from those allocations."""
        assert r.prepared is not None
        res = r.result
        pool = getattr(r.prepared.engine, "pool", None)
        # Steady state after the warm-up and measured steps: a static loop reuses exactly this memory.
        steady = pool.storage_bytes() if pool is not None else None
        if pool is not None:
            pool.clear()  # its buffers are then allocated in the profiled step, as save_on_cpu's copies are
        _zero_grads(self.model)
        mem = cpu_memory_profile(r.prepared.step, r.prepared.hooks)
        res.activation_bytes = mem.peak_bytes
        res.host_copy_bytes = mem.pack_hook_bytes if r.prepared.hooks is not None else 0
        eng = res.engine
        if eng is not None and r.prepared.engine is not None:
            eng.held_bytes_last_step = _held_bytes_last_step(r.prepared.engine)
            eng.host_bytes_measured = steady if steady is not None else mem.pack_hook_bytes
            eng.host_bytes_source = ("cpu: bytes of the host pool's live allocations after the measured steps "
                                     "(read from the storages themselves, not the pool's counters)")

    def _trace_step(self, r: _Runner) -> None:
        """One more step under ``torch.profiler`` (CPU, and CUDA on a GPU): the chrome trace is kept in
        ``cfg.trace_dir`` and summarised (``bench.trace_summary``) into the strategy's result."""
        import gzip
        import shutil
        import tempfile

        from torch.profiler import ProfilerActivity, profile

        from bench.trace_summary import summarize

        assert r.prepared is not None
        self.progress.phase(f"{r.spec.name}: one profiled step (trace)")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        _zero_grads(self.model)
        _sync(self.device)
        with _without_kineto_usdt_lines(), profile(activities=activities) as prof:
            r.prepared.step()
            _sync(self.device)
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            r.result.trace = summarize(raw)
            if self.cfg.trace_dir is not None:
                self.cfg.trace_dir.mkdir(parents=True, exist_ok=True)
                name = f"trace_{self.workload.run_id}_{r.spec.name}.json.gz"
                with open(raw, "rb") as src, gzip.open(self.cfg.trace_dir / name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                r.result.trace["file"] = name

    def finish(self, r: _Runner) -> None:
        """Memory numbers (and the traced step, if asked for), then release the strategy's engine and caches."""
        res = r.result
        if r.active and r.spec.name in self.cfg.trace:
            try:
                self._trace_step(r)
            except Exception as e:  # the measured steps stand: a trace that fails is recorded, not the strategy
                res.trace = {"error": f"{type(e).__name__}: {e}"}
                self.progress.note(f"{r.spec.name}: the profiled step (trace) failed: {type(e).__name__}: {e}")
        if r.active:
            if self.device.type == "cuda":
                res.static_bytes = r.static
                res.peak_allocated_bytes = r.peak_alloc
                res.peak_reserved_bytes = r.peak_reserved
                if r.static is not None:
                    res.activation_bytes = r.peak_alloc - r.static
            else:
                try:
                    self._cpu_memory_step(r)
                except Exception as e:
                    raise_interrupt(e)
                    res.activation_source = f"n/a: profiled step failed: {type(e).__name__}: {e}"
                r.planned -= 1
                self.progress.step(r.spec.name + " (memory)")
            res.rss_bytes = self.process.memory_info().rss
        self.release(r)


def device_unusable(device: torch.device) -> str | None:
    """Why ``device`` cannot run kernels any more (a sticky CUDA error), or None if it can.

    A non-sticky error left pending is consumed by the first launch's check (which raises it
    once), so the launch is tried twice: only an error that repeats means the context is lost.
    """
    if device.type != "cuda":
        return None
    error = None
    for _ in range(2):
        try:
            torch.cuda.synchronize(device)
            torch.ones(1, device=device).add_(1).item()
            return None
        except Exception as e:
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    return error


# ------------------------------------------------------------------ the run


def raise_interrupt(e: BaseException) -> None:
    """Re-raise the interrupt behind ``e``, if any: an exception whose cause or context chain holds a
    ``KeyboardInterrupt`` or ``SystemExit`` (a library that wrapped one, a worker process the same Ctrl-C
    stopped) ends the run, as the interrupt itself would; it is not a strategy's error for its peers to run on
    (issue 45 item 7: a Ctrl-C during the tests must stop them, not become a failing test)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise e
        e = e.__cause__ or e.__context__


PENDING_REASON = ("not run yet: the results file is rewritten after every strategy, and this one had not "
                  "finished when it was written (the run was still going, or was killed)")


def _ready_pack_hook(progress: bool) -> str:
    """Load (or build, ~20 s once) the engine's C++ pack hook before the first strategy, so the default
    (``native_hooks="auto"``) runs one hook in every strategy and no background build shares the timed
    steps' CPU; what the engines run: "c++", or "python (why)"."""
    try:
        from offload import _native
    except Exception:  # an engine without it (a --baseline tree): its own default
        return "python (no offload._native)"
    if _native.loaded() is None and _native.is_built() is False:
        note("building offload's C++ pack hook before the first strategy (~20 s, once per torch version)",
             enabled=progress)
    try:
        _native.load(announce=False)
    except _native.NativeUnavailable as e:
        return f"python ({e})"
    return "c++"


def run_bench(cfg: BenchConfig, meta: dict[str, Any], ceiling: Any = None,
              on_update: Callable[[BenchResult], None] | None = None) -> BenchResult:
    """Run every strategy of ``cfg`` on its workload and return the measurements.

    ``on_update(partial)`` is called once before the first strategy and again after each one
    reaches its final status (ran, skipped or failed), with every strategy not yet finished
    listed as ``pending``: a caller that writes it each time loses at most the strategy in
    flight when the process is killed. An error in one strategy is recorded as its result and
    the others run on; one that leaves the CUDA context unusable stops the run, and the
    strategies left are recorded as ``not_run`` with the reason (``meta["partial"]``).
    """
    device = torch.device(cfg.device)
    if device.type == "cuda":  # before cuBLAS starts: deterministic matmuls need it (bench/verdict.py)
        meta["cublas_workspace_config"] = verdict.set_cublas_workspace_config()
    workload = cfg.workload
    names = list(dict.fromkeys(cfg.strategies))
    if "none" in names:
        names.remove("none")
        names.insert(0, "none")
    if workload.fit_layers and device.type == "cuda":
        note(f"measuring how many {workload.name} blocks fit on the device (two short steps)", enabled=cfg.progress)
        n = fit_layers(workload, device, cfg.fit_budget_frac, cfg.seed)
        meta["fit_layers"] = {"requested": workload.n_layers, "fits": n, "budget_frac": cfg.fit_budget_frac}
        workload = workload.replace(n_layers=n)

    meta["pack_hook"] = _ready_pack_hook(cfg.progress)
    per_strategy = cfg.warmup + cfg.steps + (1 if device.type == "cpu" else 0)
    # Strategies that need CUDA are skipped before the bar starts: its total is right from the
    # first tick, and their notes do not interrupt it.
    not_here = {n: STRATEGIES[n].gpu_only for n in names if device.type != "cuda" and STRATEGIES[n].gpu_only}
    for n, why in not_here.items():
        note(f"{n}: skipped: {why}", enabled=cfg.progress)
    progress = Progress(per_strategy * (len(names) - len(not_here)), enabled=cfg.progress)
    progress.phase("building the model")
    bench = _Bench(cfg, workload, progress)
    runners = [bench.new_runner(n) for n in names]
    for r in runners:
        r.planned = per_strategy
        if r.spec.name in not_here:
            r.result.status, r.result.reason, r.planned, r.done = "skipped", not_here[r.spec.name], 0, True

    def publish(*finished: _Runner) -> None:
        for r in finished:
            r.done = True
        if on_update is not None:
            on_update(_result(cfg, workload, meta, ceiling, runners, bench.stopped))

    publish()
    try:
        _run_all(bench, runners, publish)
    except BaseException as e:  # KeyboardInterrupt, SystemExit (SIGTERM): say so in the file, then go
        bench.stopped = f"not run: the bench was interrupted ({type(e).__name__}) before this strategy finished"
        try:
            publish()
        except Exception:  # a half-finished strategy the file cannot hold must not replace the interrupt
            traceback.print_exc(file=sys.stderr)
        raise
    finally:
        progress.phase("done")
        progress.close()
    return _result(cfg, workload, meta, ceiling, runners, bench.stopped)


def _run_all(bench: _Bench, runners: list[_Runner], publish: Callable[..., None]) -> None:
    """Every runner in the configured order; ``publish`` after each one's result is final."""
    cfg = bench.cfg

    def run_alone(r: _Runner) -> None:
        if bench.stopped is not None:
            return
        with bench.guard(r, "the strategy"):
            if r.prepared is None and r.result.status == "ok":
                bench.prepare(r)
            for _ in range(cfg.warmup):
                bench.step(r, measure=False)
            bench.begin_measuring(r)
            for _ in range(cfg.steps):
                bench.step(r, measure=True)
            bench.finish(r)
        publish(r)

    if cfg.order == "sequential":
        for r in runners:
            run_alone(r)
        return
    for r in runners:
        if r.result.status == "ok":
            bench.prepare(r)
            if not r.active:
                publish(r)  # skipped or failed in prepare
    together = [r for r in runners if r.active and not r.prepared.isolated]
    alone = [r for r in runners if r.active and r.prepared.isolated]
    for _ in range(cfg.warmup):
        for r in together:
            bench.step(r, measure=False)
    for r in together:
        with bench.guard(r, "reading the ledger"):
            bench.begin_measuring(r)
    for i in range(cfg.steps):
        # Rotate who goes first each round, so no strategy always follows the same neighbour.
        # The last round keeps the given order: references (`none` first) finish before the rest.
        k = i % len(together) if together and i < cfg.steps - 1 else 0
        for r in together[k:] + together[:k]:
            bench.step(r, measure=True)
    for r in together:
        if bench.stopped is not None:  # unfinished: released, and listed as not run
            bench.release(r)
            continue
        with bench.guard(r, "the memory measurement"):
            bench.finish(r)
        publish(r)
    for r in alone:
        run_alone(r)


def _result(cfg: BenchConfig, workload: Workload, meta: dict[str, Any], ceiling: Any,
            runners: list[_Runner], stopped: str | None) -> BenchResult:
    """The results so far: finished strategies as they are, the others ``pending`` (or ``not_run``
    with the reason, once the run stopped), listed in ``meta["partial"]`` when any is missing."""
    meta = dict(meta)
    try:
        meta["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        meta["loadavg_1m_at_end"] = None
    meta["gpu_trace_at_end"] = gpu_trace_state()  # what the strategies ran with (0 callbacks: a clean timing)
    meta["order"] = cfg.order
    meta["steps"] = cfg.steps
    meta["warmup"] = cfg.warmup
    wl = {f: getattr(workload, f) for f in workload.__dataclass_fields__}
    wl.update(tokens_per_step=workload.tokens_per_step, param_count=workload.param_count(),
              flops_per_step=workload.flops_per_step(), run_id=workload.run_id)
    results = []
    for r in runners:
        if r.done:
            results.append(r.result)
        else:
            status = "pending" if stopped is None else "not_run"
            results.append(StrategyResult(name=r.spec.name, description=r.spec.description, status=status,
                                          reason=PENDING_REASON if stopped is None else stopped))
    missing = {s.name: s.reason for s in results if s.status in ("pending", "not_run")}
    if missing:
        meta["partial"] = {
            "missing": missing,
            "rerun": f"{meta.get('command', 'python -m bench')} --strategies {','.join(['none', *missing])}",
        }
    return BenchResult(meta=meta, workload=wl, ceiling=ceiling, strategies=results)
