"""What one profiled step's Kineto trace says about the GPU: idle time, the copies, and where the exposed ones land.

    python -m bench.trace_summary trace.json.gz            # print the summary of a torch.profiler chrome trace

The bench's ``--trace STRATEGIES`` (``python -m bench``) runs one extra step of each named strategy under
``torch.profiler`` after its measured steps, writes the trace (``trace_<run_id>_<strategy>.json.gz``) and puts
this summary in the results (JSON ``strategies[].trace``, and a table in the markdown). From the device's own
timestamps, over the step's window (the first device activity to the last):

- ``compute_idle_ms``: no kernel running (copies may be); ``gpu_idle_ms``: nothing running at all (the host did
  not keep the device fed: launch gaps, host waits, Python between kernels);
- per direction (``d2h``, ``h2d``, ``other``): copies, bytes, time, rate, and ``exposed_ms``: time a copy ran
  while no kernel did (the copies compute did not hide, the measure HTA calls exposed communication);
- ``forward_ms`` / ``backward_ms``: split at the device start of the first work launched from inside autograd's
  backward (``autograd::engine::evaluate_function`` on the launching thread), so the exposed copies and the
  idle gaps are each placed in the forward (with the loss) or the backward, with their offset in the step and
  the kernels just before and after them (``largest_exposed``, ``largest_idle_gaps``);
- ``host_late_ms``: compute-idle time the host caused: the part of each compute-idle gap before the launch call
  of the kernel that ended it returned (the device had nothing queued: the step was host-bound there), by phase;
  ``host_lead_ms``: per phase, the median time from a kernel's launch call returning to the kernel starting (how
  far ahead of the device the host ran; near 0, any host work added there adds to the step);
- ``host``: the engine's own annotations on the host (``offload::pack``, ``offload::stall``, ...): count and ms.

A trace with no device activity (a CPU run) gives the host-side split only (``device_events`` 0, with a note).
The profiled step is not one of the measured ones (the profiler costs host time); its numbers say where time
goes, the measured steps say how much a step takes.
"""

from __future__ import annotations

import bisect
import gzip
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["summarize", "load_trace", "format_markdown", "main"]

_KERNELS = {"kernel", "gpu_memset"}
_COPIES = "gpu_memcpy"
_LAUNCHES = {"cuda_runtime", "cuda_driver"}
_BACKWARD_OP = "autograd::engine::evaluate_function"
_NAME_CHARS = 70

Intervals = list[tuple[float, float]]


def load_trace(path: str | Path) -> dict[str, Any]:
    """A chrome trace as ``torch.profiler``'s ``export_chrome_trace`` writes it (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _union(spans: Iterable[tuple[float, float]]) -> Intervals:
    out: Intervals = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _minus(a: Intervals, b: Intervals) -> Intervals:
    """``a`` less ``b`` (both merged and sorted)."""
    out: Intervals = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def _length(iv: Intervals) -> float:
    return sum(e - s for s, e in iv)


def _kind(name: str) -> str:
    return "d2h" if "DtoH" in name else "h2d" if "HtoD" in name else "other"


def _ms(us: float) -> float:
    return round(us / 1e3, 3)


def _backward_spans(cpu_ops: list[dict[str, Any]]) -> dict[Any, tuple[list[float], list[float]]]:
    """Per host thread, the sorted starts and ends of autograd's backward functions."""
    by_tid: dict[Any, list[tuple[float, float]]] = {}
    for e in cpu_ops:
        if e["name"].startswith(_BACKWARD_OP):
            by_tid.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e.get("dur", 0)))
    out = {}
    for tid, spans in by_tid.items():
        merged = _union(spans)
        out[tid] = ([s for s, _ in merged], [e for _, e in merged])
    return out


def _inside(spans: dict[Any, tuple[list[float], list[float]]], tid: Any, ts: float) -> bool:
    starts, ends = spans.get(tid, ([], []))
    i = bisect.bisect_right(starts, ts) - 1
    return i >= 0 and ts <= ends[i]


def _phase(ts: float, split: float | None) -> str:
    """The phase a device timestamp falls in (all forward when no backward was found)."""
    return "forward" if split is None or ts < split else "backward"


def _placed(iv: Intervals, t0: float, split: float | None, kernels: list[dict[str, Any]], top: int) -> list[dict]:
    """The ``top`` longest intervals of ``iv``, each with its offset in the step, phase and neighbour kernels."""
    ends = sorted((k["ts"] + k.get("dur", 0), k["name"]) for k in kernels)
    end_times = [t for t, _ in ends]
    starts = sorted((k["ts"], k["name"]) for k in kernels)
    start_times = [t for t, _ in starts]
    out = []
    for s, e in sorted(iv, key=lambda x: x[0] - x[1])[:top]:
        i = bisect.bisect_right(end_times, s) - 1
        j = bisect.bisect_left(start_times, e)
        out.append({"at_ms": _ms(s - t0), "ms": _ms(e - s),
                    "phase": _phase(s, split),
                    "after_kernel": ends[i][1][:_NAME_CHARS] if i >= 0 else None,
                    "before_kernel": starts[j][1][:_NAME_CHARS] if j < len(starts) else None})
    return out


def _by_phase(iv: Intervals, split: float | None) -> dict[str, float]:
    if split is None:
        return {"forward": _ms(_length(iv)), "backward": 0.0}
    fwd = _minus(iv, [(split, float("inf"))])
    return {"forward": _ms(_length(fwd)), "backward": _ms(_length(iv) - _length(fwd))}


def summarize(trace: dict[str, Any] | str | Path, *, top: int = 5) -> dict[str, Any]:
    """The summary of one profiled step (see the module docstring); ``trace``: the parsed JSON or its path."""
    data = load_trace(trace) if isinstance(trace, (str, Path)) else trace
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    kernels = [e for e in events if e.get("cat") in _KERNELS]
    copies = [e for e in events if e.get("cat") == _COPIES]
    device = kernels + copies
    backward = _backward_spans(cpu_ops)
    host: dict[str, dict[str, float]] = {}
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"].startswith("offload::"):
            h = host.setdefault(e["name"], {"count": 0, "ms": 0.0})
            h["count"] += 1
            h["ms"] = round(h["ms"] + e.get("dur", 0) / 1e3, 3)
    out: dict[str, Any] = {"source": "torch.profiler (Kineto) trace of one extra step", "device_events": len(device),
                           "kernels": len(kernels), "copies_count": len(copies), "host": host}
    if not device:
        if cpu_ops:
            t0 = min(e["ts"] for e in cpu_ops)
            t1 = max(e["ts"] + e.get("dur", 0) for e in cpu_ops)
            bwd = min((s[0][0] for s in backward.values() if s[0]), default=None)
            out["host_step_ms"] = _ms(t1 - t0)
            out["host_forward_ms"] = _ms((bwd if bwd is not None else t1) - t0)
            out["host_backward_ms"] = _ms(t1 - bwd) if bwd is not None else 0.0
        out["note"] = ("no device activity in this trace (a CPU run): the host-side split only; GPU idle time and "
                       "exposed copies need a trace taken on a GPU")
        return out
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in _LAUNCHES and "correlation" in e.get("args", {})}
    in_backward = []
    for e in device:
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is not None and _inside(backward, launch.get("tid"), launch["ts"]):
            in_backward.append(e["ts"])
    t0 = min(e["ts"] for e in device)
    t1 = max(e["ts"] + e.get("dur", 0) for e in device)
    split = min(in_backward) if in_backward else None
    busy = _union((e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels)
    anything = _union((e["ts"], e["ts"] + e.get("dur", 0)) for e in device)
    window = [(t0, t1)]
    compute_idle, gpu_idle = _minus(window, busy), _minus(window, anything)
    per_kind: dict[str, dict[str, Any]] = {}
    exposed_all: Intervals = []
    for kind in ("d2h", "h2d", "other"):
        mine = [e for e in copies if _kind(e["name"]) == kind]
        if not mine:
            continue
        spans = _union((e["ts"], e["ts"] + e.get("dur", 0)) for e in mine)
        exposed = _minus(spans, busy)
        exposed_all += exposed
        nbytes = sum(int(e.get("args", {}).get("bytes", 0) or 0) for e in mine)
        ms = _length(spans) / 1e3
        per_kind[kind] = {"count": len(mine), "bytes": nbytes, "ms": round(ms, 3),
                          "gb_s": round(nbytes / ms / 1e6, 2) if ms > 0 and nbytes else None,
                          "exposed_ms": _ms(_length(exposed)), "exposed_by_phase": _by_phase(exposed, split)}
    exposed_all = _union(exposed_all)
    late, lead = _host_bound(compute_idle, kernels, launches, split)
    out.update({
        "step_ms": _ms(t1 - t0),
        "forward_ms": _ms((split if split is not None else t1) - t0),
        "backward_ms": _ms(t1 - split) if split is not None else 0.0,
        "backward_found": split is not None,
        "kernel_busy_ms": _ms(_length(busy)),
        "compute_idle_ms": _ms(_length(compute_idle)), "compute_idle_by_phase": _by_phase(compute_idle, split),
        "gpu_idle_ms": _ms(_length(gpu_idle)), "gpu_idle_by_phase": _by_phase(gpu_idle, split),
        "copies": per_kind,
        "exposed_copy_ms": _ms(_length(exposed_all)), "exposed_by_phase": _by_phase(exposed_all, split),
        "host_late_ms": _ms(_length(late)), "host_late_by_phase": _by_phase(late, split), "host_lead_ms": lead,
        "largest_exposed": _placed(exposed_all, t0, split, kernels, top),
        "largest_idle_gaps": _placed(gpu_idle, t0, split, kernels, top),
    })
    return out


def _host_bound(idle: Intervals, kernels: list[dict[str, Any]], launches: dict[Any, dict[str, Any]],
                split: float | None) -> tuple[Intervals, dict[str, float | None]]:
    """The compute-idle time spent waiting for the host (each gap up to the return of the launch call of the kernel
    that ended it), and per phase the median lead of the host over the device (launch returned -> kernel start)."""
    done = {c: e["ts"] + e.get("dur", 0) for c, e in launches.items()}  # correlation -> launch call returned
    ordered = sorted(kernels, key=lambda e: e["ts"])
    starts = [e["ts"] for e in ordered]
    late: Intervals = []
    for g0, g1 in idle:
        i = bisect.bisect_left(starts, g1)
        if i < len(ordered) and (r := done.get(ordered[i].get("args", {}).get("correlation"))) is not None and r > g0:
            late.append((g0, min(g1, r)))
    leads: dict[str, list[float]] = {"forward": [], "backward": []}
    for e in ordered:
        r = done.get(e.get("args", {}).get("correlation"))
        if r is not None:
            leads[_phase(e["ts"], split)].append(e["ts"] - r)
    return late, {k: (_ms(sorted(v)[len(v) // 2]) if v else None) for k, v in leads.items()}


def _place(p: dict[str, Any]) -> str:
    return (f"{p['ms']:.2f} ms at {p['at_ms']:.1f} ms ({p['phase']}), after `{p['after_kernel']}`, "
            f"before `{p['before_kernel']}`")


def _lead(t: dict[str, Any]) -> str:
    lead = t.get("host_lead_ms") or {}
    return " / ".join("—" if lead.get(k) is None else f"{lead[k]:.1f}" for k in ("forward", "backward"))


def format_markdown(traces: dict[str, dict[str, Any]]) -> str:
    """A table of the traced strategies (one row each) and, per strategy, where its largest exposed copies and
    idle gaps land."""
    if not traces:
        return ""
    lines = ["## One profiled step (torch.profiler / Kineto)", ""]
    gpu = {n: t for n, t in traces.items() if t.get("device_events")}
    if gpu:
        lines += ["| strategy | step ms | forward ms | backward ms | compute idle ms (fwd / bwd) | GPU idle ms "
                  "(fwd / bwd) | waiting on the host ms (fwd / bwd) | host lead ms (fwd / bwd) | D2H GB (ms) | H2D GB (ms) | "
                  "exposed copies ms (fwd / bwd) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, t in gpu.items():
            def cp(kind: str) -> str:
                c = t["copies"].get(kind)
                return "—" if c is None else f"{c['bytes'] / 1e9:.2f} ({c['ms']:.1f})"

            def split(key: str) -> str:
                p = t[f"{key}_by_phase"]
                return f"{t[f'{key}_ms']:.1f} ({p['forward']:.1f} / {p['backward']:.1f})"

            lines.append(f"| {name} | {t['step_ms']:.1f} | {t['forward_ms']:.1f} | {t['backward_ms']:.1f} | "
                         f"{split('compute_idle')} | {split('gpu_idle')} | {split('host_late')} | {_lead(t)} | "
                         f"{cp('d2h')} | {cp('h2d')} | "
                         f"{t['exposed_copy_ms']:.1f} ({t['exposed_by_phase']['forward']:.1f} / "
                         f"{t['exposed_by_phase']['backward']:.1f}) |")
        lines.append("")
        for name, t in gpu.items():
            if t["largest_exposed"]:
                lines.append(f"- {name}, largest exposed copies: " + "; ".join(map(_place, t["largest_exposed"])))
            if t["largest_idle_gaps"]:
                lines.append(f"- {name}, largest GPU idle gaps: " + "; ".join(map(_place, t["largest_idle_gaps"])))
    for name, t in traces.items():
        if "error" in t:
            lines.append(f"- {name}: the profiled step failed: {t['error']}")
        elif not t.get("device_events"):
            lines.append(f"- {name}: {t.get('note', '')} (host: step {t.get('host_step_ms')} ms, forward "
                         f"{t.get('host_forward_ms')} ms, backward {t.get('host_backward_ms')} ms)")
    lines += ["", "One extra step per traced strategy, after its measured ones, under the profiler (which costs host "
              "time): it says where the time goes, the measured steps how much. Exposed copies: copy time with no "
              "kernel running. Waiting on the host: compute-idle time before the launch of the kernel that ended "
              "it returned; host lead: the median time from a launch returning to its kernel starting (the "
              "profiler's own host cost shortens it). The forward/backward split is the device start of the first work launched from "
              "autograd's backward. Raw traces: `trace_<run_id>_<strategy>.json.gz` beside this file "
              "(chrome://tracing, Perfetto)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.trace_summary", description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path, help="a chrome trace from torch.profiler (.json or .json.gz)")
    ap.add_argument("--top", type=int, default=5, help="how many exposed copies and idle gaps to place")
    args = ap.parse_args(argv)
    try:
        summary = summarize(args.trace, top=args.top)
    except (OSError, ValueError) as e:
        print(f"python -m bench.trace_summary: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
