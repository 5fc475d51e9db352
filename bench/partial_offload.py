"""Offload alone, partly: the PREDICTED trade-off of offloading only the first k blocks, per copy schedule.

    python -m bench.partial_offload --preset 8b --seq 4096 --gpu h200 --out bench/results/predicted

Offloading every block is bound by the host link (at 8B width on an H200, ~24 GB a step each way over
~55 GB/s), so "offload alone" is judged by its best partial schedule instead: the most bytes the link can
hide. The blocks offloaded first are the first ones: their activations live the longest and their reloads
come last in backward, so their copies have the most compute to hide behind. For each k the bench's
ToyLlama step (the preset's width, forward, float32 cross-entropy, backward; no optimizer, as
``python -m bench`` runs it) is predicted with ``offload.predict.predict_step`` on the named GPU spec, with
a ``Plan`` offloading blocks ``0..k-1`` and keeping the rest, under each engine setting of ``SETTINGS``:
the engine's own copy schedule (NOTE [ Copy schedule ] in offload/_schedule.py: compute waits on a copy
only to get every offloaded byte off the device before the forward's last allocations, as late as it
can; reloads start as early as the device's memory allows), the same with no wait at all (a device
budget no step reaches: the cut is then only what finished moving by the host's polls), and the caps the
engine had before that schedule (5 copies, 1 GiB in flight: compute waits at each copy beyond them).

Every number here is PREDICTED (uncalibrated; the H200's calibration is in
``bench/results/nvidia-h200/``, one folder per run). The engine's polls see the modelled device, so
sources are freed when the copies would be done on that GPU at the host's pace of the replay, and the
peak is the caching allocator's count in the host's order, which is what a GPU needs. "cut / moved" is
the fall of the step's peak over the bytes copied to the host; "x link-bound" is the step over the time
the copies take at the spec's link rate, one direction after the other (every byte off the device by the
forward's end, back by its use). Writes ``partial_offload_<preset>_L<blocks>_s<seq>_<gpu>.json`` and
``.md`` (default folder: a fresh ``./bench_runs/`` run folder; ``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.env import default_run_dir
from bench.predicted_vs_measured import bench_step_fns, first_blocks_plan
from bench.strategies import PART_ENGINE_KWARGS
from bench.workloads import PRESETS, Workload

__all__ = ["SETTINGS", "frontier", "best_within", "format_markdown", "main"]

_GiB = 1 << 30

SCHEDULE = "the engine's schedule (default)"
NO_WAIT = "never waits (cut: what finished moving)"
OLD_CAPS = "caps of the old default (5 copies, 1 GiB)"
SETTINGS: dict[str, dict[str, int]] = {
    SCHEDULE: PART_ENGINE_KWARGS["offload_part"],
    NO_WAIT: {"device_budget_bytes": 1 << 50},
    OLD_CAPS: {"max_fwd_stash_size": 5, "max_inflight_bytes": 1 << 30},
}
"""Name -> ``OffloadConfig`` fields of the engine (``device_budget_bytes``: device bytes the step stays within,
here more than any device has; ``max_fwd_stash_size`` / ``max_inflight_bytes``: caps on the copies in flight)."""
FRONTIER_RATIO, FRONTIER_CUT = 1.03, 0.85
"""The frontier: the most bytes offloaded at a step within 1.03x ``none`` whose peak falls by >= 85% of them."""


def _row(p: Any, **fields: Any) -> dict[str, Any]:
    tl = p.timeline
    copied = int(p.ledger_summary["d2h_bytes"]) if p.ledger_summary else 0
    return {**fields, "step_seconds": p.step_seconds, "peak_allocated_bytes": p.peak_allocated_bytes,
            "peak_bytes": p.peak_bytes, "offloaded_bytes": p.offloaded_bytes, "copied_bytes": copied,
            "d2h_waits": int(p.ledger_summary.get("d2h_waits", 0)) if p.ledger_summary else 0,
            "exposed_copy_seconds": p.exposed_copy_seconds,
            "exposed_at_issue_seconds": tl.exposed_at_issue_seconds if tl else None,
            "link_bound_seconds": (tl.copy_seconds["d2h"] + tl.copy_seconds["h2d"]) if tl else None}


def frontier(wl: Workload, gpu: str, ks: list[int], settings: dict[str, dict[str, int]] = SETTINGS, *,
             progress: bool = True) -> dict[str, Any]:
    """``{"none": row, "rows": [row per (setting, k)]}``; each row has ``step_vs_none``, ``peak_vs_none``,
    ``cut_of_moved`` (the peak's fall over the bytes copied) and ``step_vs_link_bound``."""
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
            p = predict_step(model_fn, step_fn, gpu=gpu, strategy=first_blocks_plan(wl.n_layers, k, kwargs),
                             dtype=wl.torch_dtype)
            r = _row(p, setting=name, engine_kwargs=kwargs, k=k, blocks=wl.n_layers)
            r["step_vs_none"] = r["step_seconds"] / none["step_seconds"]
            r["peak_vs_none"] = r["peak_allocated_bytes"] / none["peak_allocated_bytes"]
            cut = none["peak_bytes"] - r["peak_bytes"]
            r["cut_of_moved"] = cut / r["copied_bytes"] if r["copied_bytes"] else None
            link = r["link_bound_seconds"]
            r["step_vs_link_bound"] = r["step_seconds"] / link if link else None
            rows.append(r)
    return {"none": none, "rows": rows, "predict_seconds": round(time.perf_counter() - t0, 1)}


def best_within(rows: list[dict[str, Any]], setting: str, ratio: float = FRONTIER_RATIO,
                cut: float | None = None) -> dict[str, Any] | None:
    """The row of ``setting`` that offloads the most bytes at a step within ``ratio`` x ``none``'s (and, with
    ``cut``, whose peak falls by at least that share of the bytes it copies)."""
    ok = [r for r in rows if r["setting"] == setting and r["step_vs_none"] <= ratio
          and (cut is None or not r["k"] or (r.get("cut_of_moved") or 0) >= cut)]
    return max(ok, key=lambda r: (r["offloaded_bytes"], -r["step_vs_none"]), default=None)


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def format_markdown(result: dict[str, Any]) -> str:
    none, rows = result["none"], result["rows"]
    lines = [f"### {result['title']}", "",
             f"`none`: predicted step {none['step_seconds'] * 1e3:.1f} ms, peak {none['peak_bytes'] / _GiB:.2f} GiB.",
             "", "| engine setting | blocks offloaded | copied GiB/step | predicted peak GiB | cut / moved "
             "| predicted step ms | x none | copies exposed ms | compute waits on a copy | x link-bound |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['k']} of {r['blocks']} | {r['copied_bytes'] / _GiB:.2f} | "
                     f"{r['peak_bytes'] / _GiB:.2f} | {_x(r.get('cut_of_moved'))} | {r['step_seconds'] * 1e3:.1f} | "
                     f"{r['step_vs_none']:.3f}x | {r['exposed_copy_seconds'] * 1e3:.1f} | {r.get('d2h_waits', 0)} | "
                     f"{_x(r.get('step_vs_link_bound')) if r['k'] == r['blocks'] else ''} |")
    lines += ["", f"The frontier: most bytes offloaded at a predicted step within {FRONTIER_RATIO}x of `none` whose "
              f"peak falls by at least {FRONTIER_CUT:.0%} of the bytes copied:", ""]
    for name in dict.fromkeys(r["setting"] for r in rows):
        b = best_within(rows, name, cut=FRONTIER_CUT)
        lines.append(f"- {name}: " + ("none within the bounds" if b is None else
                                      f"blocks 0..{b['k'] - 1} ({b['copied_bytes'] / _GiB:.2f} GiB copied, "
                                      f"{b['step_vs_none']:.3f}x, cut {_x(b.get('cut_of_moved'))})" if b["k"]
                                      else "no block (k = 0)"))
    lines += ["", f"PREDICTED, not measured: {result['gpu_spec']}. The engine's polls see the modelled device; "
              "peaks are the caching allocator's count in the host's order (what a GPU needs). Step times are "
              "the simulated timeline's, uncalibrated. \"x link-bound\" (offloading every block): the step over "
              "the copies' time at the spec's link rate, one direction after the other."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.partial_offload", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="8b", choices=sorted(PRESETS))
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the preset's)")
    ap.add_argument("--gpu", default="h200", help="a GPU spec of offload.predict.GPUS")
    ap.add_argument("--ks", default="0,4,6,7,8,10,32",
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
