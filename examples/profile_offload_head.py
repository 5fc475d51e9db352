"""(c) Profile the output-head exclusion with the engine's ledger and every profiler in ``offload.profiling``.

The output head's activations are the first thing backward needs, so offloading
them buys a copy out and straight back for no saving at the peak; torchtune's
``get_act_offloading_ctx_manager`` excludes the head. This runs the same loop
with the head offloaded and excluded, each under a MemProfiler attached to the
engine, a PackedBytesTracker observing the engine and an RSSTracker, and
prints what the head moved or kept and where the snapshots are. Then it
traces a few offloaded steps with the TraceProfiler and feeds
ModuleMemoryStats' profile to torch's own auto-AC baseline
(``torch.distributed._tools.ilp_utils``).

Runbook (after ``pip install -e .``, or with ``PYTHONPATH=.`` from the repo root):
    python examples/profile_offload_head.py                     # CPU: tiny model, device="cpu" copies for real
    python examples/profile_offload_head.py --dim 2048 --layers 8 --seq 4096 --out /tmp/memprof   # GPU, unchanged
Per run, <out>/<run>/rank_0_memory_stats.yaml holds 0.training_step.2.start/.end with the collected call's
ledger figures (offload.*; totals since the engine was built: offload_cumulative.*), npp/RSS hook values (and
CUDA allocator stats on a GPU); rank_0_memory_summary.txt is a table; rank_0_memory_stats.png stacks device
memory per collected call and rank_0_module_bytes.png splits each module's saved bytes into offloaded and
kept-by-reason. tracker_steps.png / tracker_modules.png are the same pictures for every step of the run,
packed.json and rss.json the trackers' figures; <out>/trace/ holds the torch.profiler trace and summary, and
<out>/ilp_module_info.json the module stats torch's auto-AC ILP reads. Without --out these go to a temporary
folder of the run's own, removed at exit (pass --out DIR to keep and read them).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is a repo tool: run from a checkout
from bench.model import ToyLlama, ToyLlamaConfig, make_batch
from offload import OffloadActivations, find_output_head, get_act_offloading_ctx_manager
from offload.profiling import (
    MemProfiler,
    MemProfilerCfg,
    MemProfilerFuncs,
    PackedBytesTracker,
    RSSTracker,
    TraceProfiler,
    module_info_for_ilp,
    write_json,
)

MiB = 2**20


def build(args: argparse.Namespace) -> tuple[ToyLlama, torch.optim.Optimizer, ToyLlamaConfig, str]:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = ToyLlamaConfig(vocab_size=1024, dim=args.dim, n_layers=args.layers,
                         n_heads=max(1, args.dim // 64), max_seq_len=args.seq)
    torch.manual_seed(0)
    model = ToyLlama(cfg).to(device=device, dtype=dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg, device


def run(name: str, exclude_head: bool, args: argparse.Namespace, out: Path) -> dict[str, float]:
    cuda = torch.cuda.is_available()
    model, opt, cfg, device = build(args)
    dev = None if cuda else "cpu"  # no accelerator: offload CPU tensors into the host pool
    ctx = (get_act_offloading_ctx_manager(model, True, device=dev) if exclude_head
           else OffloadActivations(device=dev, model=model))
    funcs = MemProfilerFuncs(cuda={"training_step"}) if cuda else MemProfilerFuncs()
    prof = MemProfiler(MemProfilerCfg(enabled=True, save_dir=out / name, collect_funcs=funcs, dump_plot=True),
                       model, engine=ctx)
    tracker = PackedBytesTracker(model=model)  # observes the engine's packs: offloading stays on
    tokens, targets = make_batch(cfg, args.batch, args.seq, device=device)
    with tracker, RSSTracker(model) as rss:
        for _ in range(args.steps):  # call 1 warms up, call 2 is collected (the default schedule)
            with prof.profile("training_step"):
                with ctx:
                    logits = model(tokens)  # (B, T, V)
                F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    prof.close()
    tracker.plot(out / name / "tracker_steps.png")
    tracker.plot_modules(out / name / "tracker_modules.png")
    tracker.to_json(out / name / "packed.json")
    rss.to_json(out / name / "rss.json")
    head = f"ToyLlama.{next(n for n, m in model.named_modules() if m is find_output_head(model))}"
    step = [r for r in ctx.ledger.records if r.step == 1]  # the collected call's packs
    end = prof.memory_stats["0.training_step.2.end"]
    return {
        "head_offloaded": sum(r.nbytes for r in step if r.module == head and r.decision == "offloaded") / MiB,
        "head_kept": sum(r.nbytes for r in step if r.module == head and r.reason == "excluded_region") / MiB,
        "offloaded": ctx.ledger.step_totals[1].offloaded_bytes / MiB,
        "npp": end["npp_diff"] / MiB,
        "peak_alloc": end.get("allocated_bytes.all.peak", 0) / MiB,
    }


def trace_and_ilp(args: argparse.Namespace, out: Path) -> tuple[Path, int, float]:
    """A torch.profiler trace of offloaded steps, and torch's auto-AC baseline from ModuleMemoryStats."""
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline, parse_module_info

    model, opt, cfg, device = build(args)
    ctx = get_act_offloading_ctx_manager(model, True, device=None if torch.cuda.is_available() else "cpu")
    tokens, targets = make_batch(cfg, args.batch, args.seq, device=device)

    def step() -> None:
        with ctx:
            logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with TraceProfiler(folder=str(out / "trace"), run_name="head_excluded", wait=0, warmup=1, active=1) as tp:
        for _ in range(2):
            step()
            tp.step(samples=args.batch, tokens=args.batch * args.seq)
    info = module_info_for_ilp(model, step, optimizer=opt)
    write_json(info, out / "ilp_module_info.json")
    peak, ms = get_peak_memory_runtime_baseline(parse_module_info(info))
    return tp.saved_traces[-1][1][0], peak, ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None,
                   help="folder to keep the artifacts in (default: a temporary folder, removed at exit)")
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        out = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="memprof_")))
        _report(args, out)
        if args.out is None:
            print(f"artifacts were in {out}, now removed: pass --out DIR to keep them")


def _report(args: argparse.Namespace, out: Path) -> None:
    """Both runs, the trace and the auto-AC module stats, with artifacts under ``out``."""
    print(f"{'run':<14}{'head moved':>11}{'head kept':>10}{'moved':>9}{'npp':>9}{'peak alloc':>11}  (MiB, step 2)")
    for name, exclude in (("head_offloaded", False), ("head_excluded", True)):
        r = run(name, exclude, args, out)
        print(f"{name:<14}{r['head_offloaded']:>11.2f}{r['head_kept']:>10.2f}{r['offloaded']:>9.2f}"
              f"{r['npp']:>9.2f}{r['peak_alloc']:>11.2f}  {out / name / 'rank_0_memory_stats.yaml'}")
    trace, peak, ms = trace_and_ilp(args, out)
    print(f"trace: {trace}")
    print(f"torch auto-AC baseline (no AC, no FSDP): peak {peak / MiB:.2f} MiB, {ms:.1f} ms/step "
          f"({out / 'ilp_module_info.json'})")


if __name__ == "__main__":
    main()
