"""Offload alone, partly: the PREDICTED trade-off of offloading only the first k blocks, per stash bound.

    python -m bench.partial_offload --preset 8b --seq 4096 --gpu h200 --out bench/results/predicted

Offloading every block costs 2.83x the step at 8B width on an H200 (24 GB a step over a 55 GB/s link:
``bench/results/nvidia-h200/8b_L32_s4096_b1_bfloat16.md``), so "offload alone" is judged by its best
partial schedule instead. The blocks offloaded first are the first ones: their activations live the
longest and their reloads come last in backward, so their copies have the most compute to hide behind.
For each k the bench's ToyLlama step (the preset's width, forward, float32 cross-entropy, backward; no
optimizer, as ``python -m bench`` runs it) is predicted with ``offload.predict.predict_step`` on the
named GPU spec, with a ``Plan`` offloading blocks ``0..k-1`` and keeping the rest, under three bounds on
the copies in flight (``SETTINGS``): the engine's default (5 tensors, 1 GiB), and bounds by bytes only
(1 GiB, 4 GiB). The forward waits for a copy when a bound is reached, so the bound decides how much of
the later blocks' compute the first blocks' copies may hide behind.

Every number here is PREDICTED (uncalibrated; the H200's calibration is in
``bench/results/nvidia-h200/predicted_vs_measured.md``); peaks use the predictor's conservative copy
model (a copy is done only when the engine waits for it), so a looser bound shows less of its memory
cut than a GPU would. Writes ``partial_offload_<preset>_L<blocks>_s<seq>_<gpu>.json`` and ``.md``
(default folder: a fresh ``./bench_runs/`` run folder; ``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.env import default_run_dir
from bench.predicted_vs_measured import bench_step_fns
from bench.strategies import PART_ENGINE_KWARGS
from bench.workloads import PRESETS, Workload

__all__ = ["SETTINGS", "first_blocks_plan", "frontier", "best_within", "format_markdown", "main"]

_GiB = 1 << 30

SETTINGS: dict[str, dict[str, int]] = {
    "default (5 tensors, 1 GiB)": PART_ENGINE_KWARGS["offload_part"],
    "bytes only, 1 GiB": {"max_fwd_stash_size": 1 << 16},
    "bytes only, 4 GiB": PART_ENGINE_KWARGS["offload_part_bytes"],
}
"""Name -> ``OffloadConfig`` fields of the engine (``max_fwd_stash_size``: tensors whose copy may be in
flight; ``max_inflight_bytes``: their bytes). ``1 << 16`` tensors is no bound in practice."""


def first_blocks_plan(n_blocks: int, k: int, engine_kwargs: dict[str, int]) -> Any:
    """A ``Plan`` offloading the bench ToyLlama's blocks ``0..k-1`` and keeping the rest."""
    from offload.planner.planning import Plan

    return Plan(decisions={f"layers.{i}": "offload" if i < k else "keep" for i in range(n_blocks)},
                budget_bytes=0, predicted_peak_bytes=0, predicted_step_seconds=0.0, cost=None,
                engine_kwargs=dict(engine_kwargs))


def _row(p: Any, **fields: Any) -> dict[str, Any]:
    return {**fields, "step_seconds": p.step_seconds, "peak_allocated_bytes": p.peak_allocated_bytes,
            "offloaded_bytes": p.offloaded_bytes, "exposed_copy_seconds": p.exposed_copy_seconds,
            "exposed_at_issue_seconds": p.timeline.exposed_at_issue_seconds if p.timeline else None}


def frontier(wl: Workload, gpu: str, ks: list[int], settings: dict[str, dict[str, int]] = SETTINGS, *,
             progress: bool = True) -> dict[str, Any]:
    """``{"none": row, "rows": [row per (setting, k)]}``; each row has ``step_vs_none`` and ``peak_vs_none``."""
    from offload.predict import predict_step

    model_fn, step_fn = bench_step_fns(wl)
    bad = [k for k in ks if not 0 <= k <= wl.n_layers]
    if bad:
        raise ValueError(f"partial_offload: --ks {bad} outside 0..{wl.n_layers} (the preset's blocks)")
    t0 = time.perf_counter()
    none = _row(predict_step(model_fn, step_fn, gpu=gpu, strategy="none", dtype=wl.torch_dtype), strategy="none")
    rows = []
    for name, kwargs in settings.items():
        for k in ks:
            if progress:
                print(f"[partial_offload] {name}: blocks 0..{k - 1} offloaded", file=sys.stderr)
            p = predict_step(model_fn, step_fn, gpu=gpu, strategy=first_blocks_plan(wl.n_layers, k, kwargs), dtype=wl.torch_dtype)
            r = _row(p, setting=name, engine_kwargs=kwargs, k=k, blocks=wl.n_layers)
            r["step_vs_none"] = r["step_seconds"] / none["step_seconds"]
            r["peak_vs_none"] = r["peak_allocated_bytes"] / none["peak_allocated_bytes"]
            rows.append(r)
    return {"none": none, "rows": rows, "predict_seconds": round(time.perf_counter() - t0, 1)}


def best_within(rows: list[dict[str, Any]], setting: str, ratio: float = 1.03) -> dict[str, Any] | None:
    """The row of ``setting`` that offloads the most bytes at a step within ``ratio`` x ``none``'s."""
    ok = [r for r in rows if r["setting"] == setting and r["step_vs_none"] <= ratio]
    return max(ok, key=lambda r: (r["offloaded_bytes"], -r["step_vs_none"]), default=None)


def format_markdown(result: dict[str, Any]) -> str:
    none, rows = result["none"], result["rows"]
    lines = [f"### {result['title']}", "",
             f"`none`: predicted step {none['step_seconds'] * 1e3:.1f} ms, peak {none['peak_allocated_bytes'] / _GiB:.2f} GiB.",
             "", "| copies in flight bounded by | blocks offloaded | offloaded GiB/step | predicted peak GiB (conservative) "
             "| peak vs none | predicted step ms | step vs none | copies exposed ms | of which awaited at issue ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        at_issue = r["exposed_at_issue_seconds"]
        lines.append(f"| {r['setting']} | {r['k']} of {r['blocks']} | {r['offloaded_bytes'] / _GiB:.2f} | "
                     f"{r['peak_allocated_bytes'] / _GiB:.2f} | {r['peak_vs_none']:.3f} | {r['step_seconds'] * 1e3:.1f} | "
                     f"{r['step_vs_none']:.3f}x | {r['exposed_copy_seconds'] * 1e3:.1f} | "
                     f"{'n/a' if at_issue is None else f'{at_issue * 1e3:.1f}'} |")
    lines += ["", "Most bytes offloaded at a predicted step within 1.03x of `none`:", ""]
    for name in dict.fromkeys(r["setting"] for r in rows):
        b = best_within(rows, name)
        lines.append(f"- {name}: " + ("none within 1.03x" if b is None else
                                      f"blocks 0..{b['k'] - 1} ({b['offloaded_bytes'] / _GiB:.2f} GiB, "
                                      f"{b['step_vs_none']:.3f}x)" if b["k"] else "no block (k = 0)"))
    lines += ["", f"PREDICTED, not measured: {result['gpu_spec']}. Peaks use the predictor's conservative copy "
              "model (a copy is done only when the engine waits for it), so a looser bound shows less of its "
              "memory cut than a GPU would. Step times are the simulated timeline's, uncalibrated."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.partial_offload", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="8b", choices=sorted(PRESETS))
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the preset's)")
    ap.add_argument("--gpu", default="h200", help="a GPU spec of offload.predict.GPUS")
    ap.add_argument("--ks", default="0,1,2,4,8,12,16,32",
                    help="comma-separated block counts to offload (each at most the preset's blocks)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON and markdown")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    from offload.predict import resolve_gpu

    wl = PRESETS[args.preset].replace(**{k: v for k, v in (("seq_len", args.seq), ("n_layers", args.layers)) if v})
    try:
        ks = [int(x) for x in args.ks.split(",") if x.strip()]
        spec = resolve_gpu(args.gpu)
        result = frontier(wl, args.gpu, ks, progress=not args.quiet)
    except ValueError as e:
        print(f"python -m bench.partial_offload: {e}", file=sys.stderr)
        return 2
    stem = f"partial_offload_{wl.name}_L{wl.n_layers}_s{wl.seq_len}_{args.gpu}"
    cmd = "python -m bench.partial_offload " + " ".join(argv if argv is not None else sys.argv[1:])
    result.update(kind="predicted", command=cmd, gpu=args.gpu, gpu_spec=spec.describe(),
                  workload={"name": wl.name, "dim": wl.dim, "n_layers": wl.n_layers, "seq_len": wl.seq_len,
                            "batch": wl.batch, "dtype": wl.dtype},
                  title=f"PREDICTED on {args.gpu}: offloading the first k blocks, {wl.name} (h={wl.dim}, "
                        f"{wl.n_layers} blocks, s={wl.seq_len}, b={wl.batch}, {wl.dtype}), the bench's step")
    md = format_markdown(result)
    print(md)
    if not args.no_write:
        out = args.out if args.out is not None else default_run_dir("partial_offload", wl.name)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
        (out / f"{stem}.md").write_text(f"{md}\nMade by `{cmd}`.\n")
        print(f"wrote {out / (stem + '.json')}\nwrote {out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
