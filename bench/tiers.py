"""Host tiers bench: what the disk tier costs, and how far it stretches a host budget.

Runbook::

    python -m bench --tiers                          # tiny preset on CPU, table + JSON + PNG in ./bench_runs/
    python -m bench --tiers --seq 1024 --out bench/results/cpu
    python -m bench --max-seq --host-budget 8        # longest sequence, host budget 8 MiB, with / without disk

``--tiers`` measures one step's offloaded bytes with no host budget, then times
the arms below (interleaved, median of ``--steps``) and records each step's
bytes per tier:

- ``host_only``: the pool holds everything (no budget);
- ``host_only@25`` / ``host_only@50``: a pool budget of 25 / 50 % of one step's
  copied bytes, the rest kept on the device (``on_host_budget="keep"``);
- ``disk@25`` / ``disk@50``: the same budgets with a disk tier for the rest.

Beside them it measures the disk itself (``dd``-like: a 256 MiB file written
through the page cache and with ``fsync``, then read back) and reports each
disk arm's achieved write / read bandwidth (tier bytes / tier seconds on the
writer and reader threads). Verdict: ``disk@50`` costs at most 1.25x the step
time of ``host_only`` (the issue's target).

``--max-seq --host-budget MiB``: the longest sequence (doubling, then one
bisection step) that trains under a fixed device budget (default: the no-offload
peak at ``--seq``) for ``offload`` with the pool capped at the host budget and
the rest kept on the device, vs the same plus the disk tier.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.env import default_run_dir, run_metadata
from bench.harness import build_model
from bench.model import make_batch
from bench.plan import _write
from bench.workloads import Workload
from offload._format import format_bytes, render_table

TARGET_RATIO = 1.25
"""disk@50 step time / host_only step time (issue 25's target)."""
_MiB = 1 << 20


def measure_disk(path: str, nbytes: int = 256 * _MiB) -> dict[str, float]:
    """Raw bandwidth of the disk under ``path`` in GB/s: buffered write, fsync'd write, read back."""
    os.makedirs(path, exist_ok=True)
    f = os.path.join(path, "bench_disk_probe.bin")
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
    out: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        with open(f, "wb") as fh:
            fh.write(memoryview(buf))
        out["write_buffered_gb_s"] = nbytes / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        with open(f, "wb") as fh:
            fh.write(memoryview(buf))
            fh.flush()
            os.fsync(fh.fileno())
        out["write_fsync_gb_s"] = nbytes / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        with open(f, "rb") as fh:
            fh.readinto(memoryview(buf))
        out["read_cached_gb_s"] = nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        if os.path.exists(f):
            os.unlink(f)
    return out


def _engine(device: torch.device, **kw: Any):
    import offload

    return offload.OffloadActivations(device="cpu" if device.type == "cpu" else None, **kw)


def _step(model, tokens, targets, ctx) -> None:
    with ctx:
        logits = model(tokens)  # (B, T, V)
    F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
    for p in model.parameters():
        p.grad = None


def run_tiers(workload: Workload, device: str, *, steps: int = 10, warmup: int = 2, seed: int = 0,
              disk_dir: str | None = None, progress: bool = True) -> dict[str, Any]:
    """The ``--tiers`` measurement (see the module docstring)."""
    dev = torch.device(device)
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)
    model = build_model(workload, dev, seed)
    tokens, targets = make_batch(model.cfg, workload.batch, workload.seq_len, device=dev, seed=seed)
    probe = _engine(dev)
    _step(model, tokens, targets, probe)
    step_bytes = probe.ledger.summary()["d2h_bytes"]
    del probe
    root = disk_dir or tempfile.mkdtemp(prefix="offload_bench_tiers_")
    say(f"[tiers] one step copies {step_bytes / _MiB:.1f} MiB; disk tier in {root}")
    disk = measure_disk(root)
    say(f"[tiers] disk: {disk}")
    arms: dict[str, dict[str, Any]] = {
        "host_only": {},
        "host_only@25": {"host_budget_bytes": step_bytes // 4},
        "host_only@50": {"host_budget_bytes": step_bytes // 2},
        "disk@25": {"host_budget_bytes": step_bytes // 4, "disk_dir": root},
        "disk@50": {"host_budget_bytes": step_bytes // 2, "disk_dir": root},
    }
    engines = {name: _engine(dev, **kw) for name, kw in arms.items()}
    times: dict[str, list[float]] = {n: [] for n in arms}
    for i in range(warmup + steps):
        for name, ctx in engines.items():  # interleaved: drift hits every arm alike
            gc.collect()
            t0 = time.perf_counter()
            _step(model, tokens, targets, ctx)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
        say(f"[tiers] step {i + 1}/{warmup + steps}")
    rows = []
    for name, ctx in engines.items():
        s = ctx.ledger.summary()
        st = ctx.tiers.stats()
        n = max(s["steps"], 1)
        row = {
            "arm": name,
            "settings": {k: v for k, v in arms[name].items() if k != "disk_dir"},
            "step_s_median": statistics.median(times[name]),
            "step_s_all": times[name],
            "tiers_per_step": {t: {k: v / n for k, v in row.items()} for t, row in s["tiers"].items()},
            "kept_host_budget_bytes_per_step": s["kept_by_reason"].get("host_budget", 0) / n,
            "bytes_by_step": [{t: st_.tiers.get(t, {}).get("bytes", 0) for t in ("pool", "pageable", "disk")}
                              for st_ in ctx.ledger.step_totals],
            "d2h_bytes": s["d2h_bytes"],
            "reconciled": ctx.tiers.received_bytes() == s["d2h_bytes"],
        }
        d = st["disk"]
        if d is not None:
            row["disk"] = {k: d[k] for k in ("written_bytes", "write_seconds", "read_bytes", "read_seconds",
                                              "wait_seconds", "peak_file_bytes", "peak_pending_bytes",
                                              "queue_bytes", "refused", "write_failures")}
            row["disk"]["write_gb_s"] = d["written_bytes"] / d["write_seconds"] / 1e9 if d["write_seconds"] else None
            row["disk"]["read_gb_s"] = d["read_bytes"] / d["read_seconds"] / 1e9 if d["read_seconds"] else None
        rows.append(row)
        ctx.close()
    if disk_dir is None:
        shutil.rmtree(root, ignore_errors=True)
    base = next(r for r in rows if r["arm"] == "host_only")["step_s_median"]
    for r in rows:
        r["vs_host_only"] = r["step_s_median"] / base
    d50 = next(r for r in rows if r["arm"] == "disk@50")["vs_host_only"]
    return {
        "workload": {**workload.__dict__, "run_id": workload.run_id},
        "device": str(dev),
        "step_copied_bytes": step_bytes,
        "disk_probe": disk,
        "rows": rows,
        "target": {"what": f"disk@50 step time <= {TARGET_RATIO}x host_only", "ratio": d50,
                   "met": d50 <= TARGET_RATIO},
        "method": f"{warmup} warm-up + {steps} timed steps per arm, interleaved; median; one engine per arm",
    }


def _mib(b: int | float | None) -> str:
    return format_bytes(b, unit="MiB")


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def format_tiers(res: dict[str, Any]) -> str:
    d = res["disk_probe"]
    lines = [f"host tiers: {res['workload']['run_id']} on {res['device']}; one step copies "
             f"{_mib(res['step_copied_bytes'])}", ""]
    rows = []
    for r in res["rows"]:
        t = r["tiers_per_step"]
        dk = r.get("disk") or {}
        n = max(len(r["bytes_by_step"]), 1)
        rows.append([r["arm"], f"{r['step_s_median']:.4f}", f"{r['vs_host_only']:.2f}", _mib(t["pool"]["bytes"]),
                     _mib(t["pageable"]["bytes"]), _mib(t["disk"]["bytes"]),
                     _mib(r["kept_host_budget_bytes_per_step"]), _num(dk.get("write_gb_s")),
                     _num(dk.get("read_gb_s")), _num(dk["wait_seconds"] / n) if dk else "—"])
    lines += render_table(rows, ["arm", "step s (median)", "x host_only", "pool /step", "pageable /step",
                                 "disk /step", "kept /step (logical)", "disk write GB/s", "disk read GB/s",
                                 "disk exposed wait s/step"], fmt="github").rstrip("\n").splitlines()
    tg = res["target"]
    lines += [
        "",
        f"Disk measured directly: write {d['write_buffered_gb_s']:.2f} GB/s through the page cache, "
        f"{d['write_fsync_gb_s']:.2f} GB/s with fsync; read back {d['read_cached_gb_s']:.2f} GB/s (cached).",
        f"Target {tg['what']}: {tg['ratio']:.2f}x -> {'met' if tg['met'] else 'NOT met'}.",
        f"Method: {res['method']}.",
    ]
    return "\n".join(lines)


def plot_tiers(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in res["rows"] if r["arm"] != "host_only"]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3), sharey=True)
    for ax, r in zip(axes, rows):
        steps = range(len(r["bytes_by_step"]))
        series = [[b[t] / _MiB for b in r["bytes_by_step"]] for t in ("pool", "pageable", "disk")]
        ax.stackplot(steps, *series, labels=("pool", "pageable", "disk"))
        ax.set_title(r["arm"], fontsize=9)
        ax.set_xlabel("step")
    axes[0].set_ylabel("MiB copied per step")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"bytes per host tier over steps ({res['workload']['run_id']}, {res['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- longest sequence at a fixed device and host budget -------------------------------------------


def _peak(workload: Workload, dev: torch.device, seq: int, seed: int, engine_kw: dict[str, Any] | None) -> int:
    from offload.planner.meter import measure_step

    model = build_model(workload.replace(seq_len=seq), dev, seed)
    tokens, targets = make_batch(model.cfg, workload.batch, seq, device=dev, seed=seed)
    ctx = _engine(dev, **engine_kw) if engine_kw is not None else None
    pools = []
    if ctx is not None:
        pools.append(ctx.pool)
        if ctx.tiers.disk is not None:
            pools.append(ctx.tiers.disk._staging)

    def run() -> None:
        if ctx is None:
            logits = model(tokens)
        else:
            with ctx:
                logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()

    try:
        m = measure_step(run, device=dev, model=model, pools=pools, warmup=1, timed=0,
                         before_each=lambda: model.zero_grad(set_to_none=True))
        return m.peak_bytes
    finally:
        if ctx is not None:
            ctx.close()
        model = None  # (its closures' cell too) freed before the collection
        gc.collect()


def run_max_seq_host(workload: Workload, device: str, *, host_budget_bytes: int, budget_bytes: int | None = None,
                     max_doublings: int = 4, seed: int = 0, progress: bool = True) -> dict[str, Any]:
    """Longest sequence per arm under a device budget, the pool capped at ``host_budget_bytes``."""
    dev = torch.device(device)
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)
    if budget_bytes is None:
        budget_bytes = _peak(workload, dev, workload.seq_len, seed, None)
    root = tempfile.mkdtemp(prefix="offload_bench_maxseq_")
    arms = {
        "none": None,
        "offload_host_only": {"host_budget_bytes": host_budget_bytes},
        "offload_host_disk": {"host_budget_bytes": host_budget_bytes, "disk_dir": root},
    }
    rows = []
    try:
        for name, kw in arms.items():
            seq, best, best_peak, lo_fail = workload.seq_len, None, None, None
            for _ in range(max_doublings + 1):
                peak = _peak(workload, dev, seq, seed, kw)
                say(f"[max-seq] {name} seq={seq}: {'fits' if peak <= budget_bytes else 'over'} ({peak / _MiB:.1f} MiB)")
                if peak > budget_bytes:
                    lo_fail = seq
                    break
                best, best_peak = seq, peak
                seq *= 2
            if best is not None and lo_fail is not None:
                mid = (best + lo_fail) // 2 // 8 * 8
                if best < mid < lo_fail:
                    peak = _peak(workload, dev, mid, seed, kw)
                    say(f"[max-seq] {name} seq={mid}: {'fits' if peak <= budget_bytes else 'over'}")
                    if peak <= budget_bytes:
                        best, best_peak = mid, peak
            rows.append({"arm": name, "max_seq": best, "peak_bytes": best_peak, "capped": lo_fail is None})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"workload": {**workload.__dict__, "run_id": workload.run_id}, "device": str(dev),
            "budget_bytes": budget_bytes, "host_budget_bytes": host_budget_bytes, "rows": rows,
            "method": f"doubling from seq {workload.seq_len} (at most {max_doublings} times), then one bisection "
                      "step; fits = measured device peak (offload.planner.meter; host pool and disk staging "
                      "left out) <= budget"}


def format_max_seq_host(res: dict[str, Any]) -> str:
    lines = [f"longest sequence under {_mib(res['budget_bytes'])} of device memory and "
             f"{_mib(res['host_budget_bytes'])} of host pool: {res['workload']['run_id']} on {res['device']}", ""]
    rows = [[r["arm"], "—" if r["max_seq"] is None else f"{r['max_seq']}{'+' if r['capped'] else ''}",
             _mib(r["peak_bytes"])] for r in res["rows"]]
    lines += render_table(rows, ["arm", "max seq", "peak"], fmt="github").rstrip("\n").splitlines()
    lines += ["", f"Method: {res['method']}; '+' = still fitting at the last length tried."]
    return "\n".join(lines)


# -- entry points (bench.cli) ---------------------------------------------------------------------


def main_tiers(workload: Workload, device: str, args: Any, argv: list[str] | None) -> int:
    steps = args.steps if args.steps is not None else 10
    warmup = args.warmup if args.warmup is not None else 2
    res = run_tiers(workload, device, steps=steps, warmup=warmup, seed=args.seed,
                    disk_dir=getattr(args, "disk_dir", None), progress=not args.quiet)
    text = format_tiers(res)
    print(text)
    if not args.no_write:
        meta = run_metadata(device, argv if argv is not None else sys.argv[1:])
        out = args.out if args.out is not None else default_run_dir("tiers", str(workload.run_id))
        for p in _write(f"tiers_{workload.run_id}", res, text, out, meta, None if args.no_plot else plot_tiers,
                        caption="bytes per tier over steps"):
            print(f"wrote {p}")
    return 0


def main_max_seq_host(workload: Workload, device: str, args: Any, argv: list[str] | None) -> int:
    res = run_max_seq_host(workload, device, host_budget_bytes=args.host_budget_bytes, budget_bytes=args.budget_bytes,
                           seed=args.seed, progress=not args.quiet)
    text = format_max_seq_host(res)
    print(text)
    if not args.no_write:
        meta = run_metadata(device, argv if argv is not None else sys.argv[1:])
        out = args.out if args.out is not None else default_run_dir("maxseq_host", str(workload.run_id))
        for p in _write(f"maxseq_host_{workload.run_id}", res, text, out, meta, None):
            print(f"wrote {p}")
    return 0
