"""Step-time overhead of the profilers on the toy model, on CPU, against no profiling.

Runbook (from the repo root, after ``pip install -e .`` or with ``PYTHONPATH=.``):
    python -m bench.profiler_overhead              # writes ./bench_runs/<time>_profiler_overhead_cpu/profiler_overhead.json
    python -m bench.profiler_overhead --steps 60 --dim 256 --layers 4 --seq 256 --threads 2
    python -m bench.profiler_overhead --out /tmp/overhead.json --skip module_stats
    python -m bench.profiler_overhead --steps 80 --out bench/results/cpu/profiler_overhead.json   # the cited file

Every variant runs the same step (forward, cross-entropy, backward, SGD) on its
own copy of one model. Variants are interleaved, one step each per round, so
drift on a shared machine hits all of them alike; each reports the median of
``--steps`` measured steps after ``--warmup`` rounds, and its overhead against
"none" (and "engine" for the engine variants): from the medians, and paired
(median over rounds of the ratio to the baseline's step in the same round,
which cancels slow phases of a shared machine). Each step is timed in wall
clock (``time.perf_counter``) and in process CPU time (``time.process_time``,
which a descheduled process does not accumulate: the steadier number on a
shared machine); the paired CPU-time overhead comes with a 95% confidence
interval (``bench.results.median_ci``). No GPU is used. The load average is
written to the JSON: numbers from a busy machine are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.env import default_run_dir
from bench.model import ToyLlama, ToyLlamaConfig, make_batch
from bench.progress import bar
from bench.results import median_ci
from offload import OffloadActivations
from offload.profiling import (
    MemProfiler,
    MemProfilerCfg,
    MemProfilerSchedule,
    ModuleMemoryStats,
    PackedBytesTracker,
    RSSTracker,
)


def default_out() -> Path:
    """``./bench_runs/<UTC time>_profiler_overhead_cpu/profiler_overhead.json`` (never inside the package)."""
    return default_run_dir("profiler_overhead", "cpu") / "profiler_overhead.json"


@dataclass
class VariantResult:
    name: str
    description: str
    baseline: str
    """Variant this one's overhead is measured against."""
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    """Process CPU time of each measured step."""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3

    @property
    def min_ms(self) -> float:
        """Best step: the least disturbed by other load on a shared machine."""
        return min(self.seconds) * 1e3

    @property
    def p25_ms(self) -> float:
        if len(self.seconds) < 2:
            return self.median_ms
        return statistics.quantiles(self.seconds, n=4)[0] * 1e3

    @property
    def p75_ms(self) -> float:
        if len(self.seconds) < 2:
            return self.median_ms
        return statistics.quantiles(self.seconds, n=4)[2] * 1e3


def _variants(model: ToyLlama, tmp: Path) -> dict[str, tuple[str, str, Callable[[], contextlib.AbstractContextManager]]]:
    """name -> (description, baseline, factory of the per-step context) for a model copy."""
    null = contextlib.nullcontext

    def packed() -> Callable[[], contextlib.AbstractContextManager]:
        t = PackedBytesTracker()
        return lambda: t

    def rss(m: ToyLlama) -> Callable[[], contextlib.AbstractContextManager]:
        r = RSSTracker(m)
        return lambda: r

    def both(m: ToyLlama) -> Callable[[], contextlib.AbstractContextManager]:
        t, r = PackedBytesTracker(), RSSTracker(m)

        @contextlib.contextmanager
        def cm() -> Iterator[None]:
            with t, r:
                yield

        return cm

    def memprof(m: ToyLlama, name: str, max_iter: int) -> Callable[[], contextlib.AbstractContextManager]:
        cfg = MemProfilerCfg(enabled=True, save_dir=tmp / name, dump_when_done=False,
                             schedule=MemProfilerSchedule(warmup_iters=0, max_iter=max_iter))
        prof = MemProfiler(cfg, m)
        return lambda: prof.profile("training_step")

    def module_stats(m: ToyLlama) -> Callable[[], contextlib.AbstractContextManager]:
        s = ModuleMemoryStats(m)

        @contextlib.contextmanager
        def cm() -> Iterator[None]:
            s.reset()
            with s:
                yield

        return cm

    specs: dict[str, tuple[str, str, Callable[[ToyLlama], Callable[[], contextlib.AbstractContextManager]]]] = {
        "none": ("no profiling", "none", lambda m: null),
        "packed": ("PackedBytesTracker (own saved-tensor hooks)", "none", lambda m: packed()),
        "rss": ("RSSTracker (psutil RSS around every module forward)", "none", rss),
        "packed+rss": ("both trackers", "none", both),
        "memprofiler_collecting": ("MemProfiler collecting every call (hooks, npp, rss/vms, snapshots)", "none",
                                   lambda m: memprof(m, "collecting", 10**9)),
        "memprofiler_done": ("MemProfiler after its window closed (default schedule)", "none",
                             lambda m: memprof(m, "done", 1)),
        "module_stats": ("ModuleMemoryStats (MemTracker dispatch mode + timing hooks)", "none", module_stats),
        "engine": ("OffloadActivations(device='cpu') alone", "none", lambda m: null),
        "engine+packed": ("engine + PackedBytesTracker observing its pack stream", "engine", lambda m: packed()),
        "engine+memprofiler": ("engine + MemProfiler collecting every call", "engine",
                               lambda m: memprof(m, "engine", 10**9)),
    }
    return {name: (desc, base, make) for name, (desc, base, make) in specs.items()}  # type: ignore[misc]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="warm-up rounds (not measured)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads; 1 by default: on a busy 2-core machine intra-op threads stall "
                        "on each other and swamp the differences being measured (0 leaves torch's default)")
    p.add_argument("--skip", nargs="*", default=[], help="variant names to leave out")
    p.add_argument("--out", type=Path, default=None,
                   help="result file (default ./bench_runs/<time>_profiler_overhead_cpu/profiler_overhead.json; "
                        "bench/results/cpu/profiler_overhead.json is the file the README cites)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = ToyLlamaConfig(vocab_size=1024, dim=args.dim, n_layers=args.layers,
                         n_heads=max(1, args.dim // 64), max_seq_len=args.seq)
    torch.manual_seed(0)
    base_model = ToyLlama(cfg)
    tokens, targets = make_batch(cfg, args.batch, args.seq)
    with tempfile.TemporaryDirectory(prefix="profiler_overhead_") as tmp:
        return _run(args, argv, cfg, base_model, tokens, targets, Path(tmp))


def _run(args: argparse.Namespace, argv: list[str] | None, cfg: ToyLlamaConfig, base_model: ToyLlama,
         tokens: torch.Tensor, targets: torch.Tensor, tmp: Path) -> dict[str, Any]:
    load_before = os.getloadavg()

    runs: list[tuple[VariantResult, ToyLlama, torch.optim.Optimizer, Callable, OffloadActivations | None]] = []
    for name, (desc, base, make) in _variants(base_model, tmp).items():
        if name in args.skip:
            continue
        model = copy.deepcopy(base_model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        engine = OffloadActivations(device="cpu", model=model) if name.startswith("engine") else None
        runs.append((VariantResult(name, desc, base), model, opt, make(model), engine))

    def step(model: ToyLlama, opt: torch.optim.Optimizer, ctx: Callable,
             engine: OffloadActivations | None) -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        with ctx():
            with engine if engine is not None else contextlib.nullcontext():
                logits = model(tokens)  # (B, T, V)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0

    rounds = args.warmup + args.steps
    with bar(rounds * len(runs), "profiler_overhead", enabled=not args.quiet) as pbar:
        for rnd in range(rounds):
            k = rnd % len(runs)  # rotate the order so no variant always runs right after the slow one
            pbar.set_postfix_str("warm-up" if rnd < args.warmup else f"round {rnd - args.warmup + 1}/{args.steps}")
            for res, model, opt, ctx, engine in runs[k:] + runs[:k]:
                dt, dc = step(model, opt, ctx, engine)
                if rnd >= args.warmup:
                    res.seconds.append(dt)
                    res.cpu_seconds.append(dc)
                pbar.update(1)

    by_name = {r.name: r for r, *_ in runs}
    rows = []
    for r in by_name.values():
        base = by_name.get(r.baseline)
        same = base is None or r is base
        over = 0.0 if same else (r.median_ms / base.median_ms - 1) * 100
        over_min = 0.0 if same else (r.min_ms / base.min_ms - 1) * 100
        # Paired: the same round's steps, so slow phases of a shared machine cancel out.
        paired = 0.0 if same else statistics.median(
            (a / b - 1) * 100 for a, b in zip(r.seconds, base.seconds))
        cpu_ratios = [1.0] if same else [a / b for a, b in zip(r.cpu_seconds, base.cpu_seconds)]
        ci = None if same else median_ci(cpu_ratios)
        rows.append({**{k: v for k, v in asdict(r).items() if k not in ("seconds", "cpu_seconds")},
                     "cpu_median_ms": statistics.median(r.cpu_seconds) * 1e3,
                     "overhead_cpu_paired_pct": (statistics.median(cpu_ratios) - 1) * 100,
                     "overhead_cpu_paired_ci95_pct": None if ci is None else [(ci[0] - 1) * 100, (ci[1] - 1) * 100],
                     "median_ms": r.median_ms, "p25_ms": r.p25_ms, "p75_ms": r.p75_ms, "min_ms": r.min_ms,
                     "overhead_pct": over, "overhead_paired_pct": paired, "overhead_min_pct": over_min,
                     "n": len(r.seconds),
                     "seconds": r.seconds, "cpu_seconds": r.cpu_seconds})
    result = {
        "benchmark": "profiler_overhead",
        "command": "python -m bench.profiler_overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
        "env": {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": "cpu",
                "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "config": {"dim": args.dim, "layers": args.layers, "seq": args.seq, "batch": args.batch,
                   "vocab": cfg.vocab_size, "steps": args.steps, "warmup": args.warmup},
        "variants": rows,
    }
    out = args.out if args.out is not None else default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"toy model dim={args.dim} layers={args.layers} seq={args.seq} batch={args.batch}; "
          f"median of {args.steps} steps after {args.warmup} warm-up rounds, CPU")
    print(f"{'variant':<24}{'median ms':>10}{'p25':>9}{'p75':>9}{'min':>9}{'overhead':>10}{'paired':>9}"
          f"{'CPU ms':>9}{'CPU paired (95% CI)':>24}  vs")
    for row in rows:
        ci = row["overhead_cpu_paired_ci95_pct"]
        cpu = f"{row['overhead_cpu_paired_pct']:.1f}%" + (f" ({ci[0]:+.1f}..{ci[1]:+.1f})" if ci else "")
        print(f"{row['name']:<24}{row['median_ms']:>10.2f}{row['p25_ms']:>9.2f}{row['p75_ms']:>9.2f}"
              f"{row['min_ms']:>9.2f}{row['overhead_pct']:>9.1f}%{row['overhead_paired_pct']:>8.1f}%"
              f"{row['cpu_median_ms']:>9.2f}{cpu:>24}  {row['baseline']}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
