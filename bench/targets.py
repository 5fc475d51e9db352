"""The performance targets ``python -m bench`` judges, defined here (this file is their source).

Each :class:`Target` below states one goal of the project; :func:`evaluate_targets`
judges all of them from one bench run (strategies side by side). These are bench
numbers, never test assertions.

Verdicts do not cry wolf. A time ratio is judged from its 95% confidence interval
(the distribution-free interval of the median of per-round paired ratios, see
``bench.results.median_ci``): PASS when the whole interval meets the threshold,
FAIL when the whole interval misses it, and ``inconclusive (noise ±x%)`` when the
interval straddles it (a shared machine's noise is larger than the margin). On CPU
the time targets use process CPU time, which a descheduled process does not
accumulate, and the run uses one intra-op thread.

On CPU most targets are about PCIe copies that do not exist there and read
"n/a on CPU" (the measured ratio is still shown); the accounting-overhead target
and the host-pool target are measured for real on CPU.

Offload without AC is judged at its frontier: the most bytes the host link can hide.
The fixed "offload without AC: >= 40% less activation memory at <= 3% step-time cost"
is retired: a forward of about a third of the step cannot move 40% of the activation
bytes over the link before the step's peak (at 8B width, 4096 tokens on an H200, about
21-25% can; ``python -m bench.partial_offload`` predicts the frontier for a card,
``bench/results/predicted/partial_offload_8b_L32_s4096_h200.md``). The bench's
``offload_part`` offloads the first 3/16 of the blocks, inside that frontier on the h200 spec
(8 of 32 blocks, predicted 1.019x), and everything offloaded is judged against the time its copies need.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.results import BenchResult

__all__ = ["Target", "TARGETS", "TargetRow", "evaluate_targets", "judge_ratio", "SOURCE"]

SOURCE = "bench/targets.py"
"""Where the targets are defined (printed with every verdict table)."""

PASS, FAIL, NA_CPU, NOT_RUN, CONTEXT = "PASS", "FAIL", "n/a on CPU", "not run", "outside target shape"


@dataclass(frozen=True)
class Target:
    key: str
    statement: str
    """The target in words, as the report prints it."""
    threshold: float
    """The number the measured ratio is compared with (<= unless the statement says >=)."""


TARGETS: dict[str, Target] = {
    t.key: t
    for t in (
        Target("offload_ac", "AC + offload of checkpoint inputs: <= 1.01x AC-only step time", 1.01),
        Target("offload_frontier", "Offload without AC at the frontier (the first blocks the link can hide, "
                                   "offload_part: 3/16 of them, predicted by bench.partial_offload for the card): "
                                   "<= 1.03x no-AC step time, activation peak down by >= 85% of the bytes copied "
                                   "(h=4096, s=4096-8192, H100/H200)", 1.03),
        Target("offload_all", "Offloading everything: <= 1.10x the link-bound time (its copies' bytes over the "
                              "probe's pinned bandwidth, D2H then H2D)", 1.10),
        Target("bandwidth", "Copies reach >= 90% of the measured pinned host<->device bandwidth", 0.90),
        Target("host_footprint", "Host footprint <= 1.05x peak offloaded bytes; zero host allocations after the "
                                 "first step", 1.05),
        Target("accounting_gpu", "The engine installed, moving nothing: <= 1.02x step time on a GPU", 1.02),
        Target("accounting", "Accounting on, offloading nothing: <= 3% step-time cost on CPU", 1.03),
    )
}
"""Every target, in report order. Statements name the shape and hardware they are stated for."""

FRONTIER_CUT = 0.85
"""``offload_frontier``: the activation peak falls by at least this share of the bytes the blocks copy."""



@dataclass
class TargetRow:
    target: str
    """The target as :data:`TARGETS` states it."""
    measured: str
    """What this run measured (ratios, with the strategies they come from, and their spread)."""
    verdict: str
    """PASS, FAIL, ``inconclusive (noise ±x%)``, n/a on CPU, not run, or outside target shape."""
    note: str = ""
    source: str = SOURCE
    """The file that defines the target."""


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def judge_ratio(point: float, ci: tuple[float, float] | None, threshold: float) -> str:
    """PASS / FAIL / ``inconclusive (noise ±x%)`` for ``ratio <= threshold`` given its interval.

    Without an interval (fewer than 6 paired steps) the point estimate decides, marked as such.
    """
    if ci is None:
        return (PASS if point <= threshold else FAIL) + " (no spread: too few steps)"
    lo, hi = ci
    if hi <= threshold:
        return PASS
    if lo > threshold:
        return FAIL
    return f"inconclusive (noise ±{(hi - lo) / 2 / point:.1%})"


def _ratio_text(label: str, point: float | None, ci: tuple[float, float] | None) -> str:
    text = f"{label} = {_fmt(point)}"
    if point is not None and ci is not None:
        text += f" (95% CI {ci[0]:.3f}-{ci[1]:.3f})"
    return text


def _gpu_ratio_row(result: BenchResult, key: str, a: str, b: str, what: str, on_cpu: bool,
                   cpu_note: str) -> TargetRow:
    """The row of a GPU target judged by the step-time ratio ``a`` / ``b`` (n/a on CPU, with ``cpu_note``)."""
    t = TARGETS[key]
    r, ci = result.time_ratio(a, b), result.time_ratio_ci(a, b)
    return TargetRow(target=t.statement, measured=_ratio_text(f"{a} / {b} {what}", r, ci),
                     verdict=NA_CPU if on_cpu else (NOT_RUN if r is None else judge_ratio(r, ci, t.threshold)),
                     note=cpu_note if on_cpu else "")


def evaluate_targets(result: BenchResult) -> list[TargetRow]:
    on_cpu = str(result.meta.get("device", "cpu")).startswith("cpu")
    rows: list[TargetRow] = []

    # 1. AC + offload of checkpoint inputs <= 1.01x AC-only.
    rows.append(_gpu_ratio_row(result, "offload_ac", "offload_ac", "ac", "step time", on_cpu,
                               "CPU copies are memcpy on the compute thread; nothing can overlap"))

    # 2. Offload without AC at the frontier: offload_part <= 1.03x none, peak down by >= 85% of its copies.
    t = TARGETS["offload_frontier"]
    r, ci = result.time_ratio("offload_part", "none"), result.time_ratio_ci("offload_part", "none")
    part, none = result.get("offload_part"), result.get("none")
    copied = part.engine.d2h_bytes if part is not None and part.engine is not None else None
    cut = None
    if copied and none is not None and part.activation_bytes is not None and none.activation_bytes is not None:
        cut = (none.activation_bytes - part.activation_bytes) / copied
    wl = result.workload
    in_shape = wl.get("dim") == 4096 and 4096 <= wl.get("seq_len", 0) <= 8192
    if on_cpu:
        verdict = NA_CPU
    elif r is None or cut is None:
        verdict = NOT_RUN
    elif not in_shape:
        verdict = CONTEXT
    elif cut < FRONTIER_CUT:
        verdict = FAIL
    else:
        verdict = judge_ratio(r, ci, t.threshold)
    rows.append(TargetRow(
        target=t.statement,
        measured=f"activation peak down by {_fmt(cut, '.0%') if cut is not None else '—'} of the bytes copied, "
                 + _ratio_text("offload_part / none step time", r, ci),
        verdict=verdict,
        note="host and device are the same memory on CPU" if on_cpu else
             ("" if in_shape else f"this run: h={wl.get('dim')}, s={wl.get('seq_len')}"),
    ))

    # 2b. Offloading everything <= 1.10x the link-bound time.
    t = TARGETS["offload_all"]
    off = result.get("offload")
    ceil = result.ceiling
    link = None
    if off is not None and off.engine is not None and ceil and ceil.d2h_gb_s and ceil.h2d_gb_s:
        link = off.engine.d2h_bytes / (ceil.d2h_gb_s * 1e9) + off.engine.h2d_bytes / (ceil.h2d_gb_s * 1e9)
    step = statistics.median(off.times.seconds) if off is not None and off.times.seconds else None
    x = step / link if step and link else None
    rows.append(TargetRow(
        target=t.statement,
        measured=f"offload step {_fmt(step * 1e3 if step else None, '.1f')} ms / link-bound "
                 f"{_fmt(link * 1e3 if link else None, '.1f')} ms = {_fmt(x)}",
        verdict=NA_CPU if on_cpu else (NOT_RUN if x is None else (PASS if x <= t.threshold else FAIL)),
        note="no host link on CPU" if on_cpu else "median step over the link time at the probe's rates",
    ))

    # 3. Copies reach >= 90% of the measured pinned bandwidth.
    t = TARGETS["bandwidth"]
    off = result.get("offload")
    ceil = result.ceiling
    d2h = off.engine.d2h_gb_s if off and off.engine else None
    h2d = off.engine.h2d_gb_s if off and off.engine else None
    fd = d2h / ceil.d2h_gb_s if d2h and ceil and ceil.d2h_gb_s else None
    fh = h2d / ceil.h2d_gb_s if h2d and ceil and ceil.h2d_gb_s else None
    if on_cpu:
        verdict = NA_CPU
    elif fd is None or fh is None:
        verdict = NOT_RUN
    else:
        verdict = PASS if min(fd, fh) >= t.threshold else FAIL
    kind = ceil.kind if ceil else "ceiling"
    if on_cpu:  # no ratio: see _CPU_CEILING in bench/report.py
        measured = f"offload D2H {_fmt(d2h, '.2f')} GB/s, H2D {_fmt(h2d, '.2f')} GB/s"
    else:
        measured = (f"offload D2H {_fmt(d2h, '.2f')} GB/s = {_fmt(fd, '.0%') if fd else '—'} of {kind}; "
                    f"H2D {_fmt(h2d, '.2f')} GB/s = {_fmt(fh, '.0%') if fh else '—'}")
    rows.append(TargetRow(
        target=t.statement,
        measured=measured,
        verdict=verdict,
        note=("no pinned memory on CPU; the engine's copies are memcpys of cache-resident tensors, which a "
              "64 MB memcpy ceiling does not bound, so no ratio is given") if on_cpu else "",
    ))

    # 4. Host footprint <= 1.05x peak offloaded bytes; zero host allocations after the first step.
    t = TARGETS["host_footprint"]
    eng = off.engine if off else None
    if eng is None or eng.host_footprint_ratio is None:
        rows.append(TargetRow(target=t.statement, measured="—", verdict=NOT_RUN,
                              note="" if eng is None else "host bytes could not be measured outside the pool here"))
    else:
        ratio = eng.host_footprint_ratio
        allocs = eng.pool_allocations_after_warmup
        rows.append(TargetRow(
            target=t.statement,
            measured=f"offload: host bytes measured {eng.host_bytes_measured / 2**20:.2f} MiB / bytes held in one "
                     f"step (ledger) {eng.held_bytes_last_step / 2**20:.2f} MiB = {ratio:.3f}; "
                     f"pool allocations during measured steps = {allocs}",
            verdict=PASS if (ratio <= t.threshold and allocs == 0) else FAIL,
            note=f"host bytes: {eng.host_bytes_source}" + ("; pinning n/a on CPU" if on_cpu else ""),
        ))

    # 5a. The engine installed, moving nothing: <= 1.02x on a GPU.
    rows.append(_gpu_ratio_row(result, "accounting_gpu", "account_only", "none", "step wall time", on_cpu,
                               "stated for a GPU; the CPU's own target is the next row"))

    # 5. Accounting on, offloading nothing: <= 3% step-time cost on CPU.
    t = TARGETS["accounting"]
    clock = "cpu" if on_cpu else "wall"
    r, ci = result.time_ratio("account_only", "none", clock), result.time_ratio_ci("account_only", "none", clock)
    wall = result.time_ratio("account_only", "none") if on_cpu else None
    ao = result.get("account_only")
    moved = ao.engine.offloaded_bytes if ao and ao.engine else None
    rows.append(TargetRow(
        target=t.statement,
        measured=_ratio_text(f"account_only / none step {'CPU' if on_cpu else 'wall'} time", r, ci)
                 + (f"; wall clock {wall:.3f}" if wall is not None else "")
                 + (f" (offloaded {moved:.0f} B/step)" if moved is not None else ""),
        verdict=NOT_RUN if r is None else judge_ratio(r, ci, t.threshold),
        note="process CPU time, 1 thread, paired per round" if on_cpu
             else "target is stated for CPU; GPU ratio shown for context",
    ))
    return rows
