"""``python -m bench --plan`` and ``--max-seq``: the planner against fixed strategies.

``--plan [--model toy|encoder|hf_llama|hf_gpt2]`` (``bench/plan_models.py``): profile
the workload once, plan it at several budgets (fractions of the no-plan
activation memory, i.e. ``base + f * (unplanned peak - base)`` where ``base``
is parameters + gradients + buffers + inputs), as ``offload.plan`` does (solve,
measure the plan, solve again with a margin if it peaked over), measure each
planned step, and measure the fixed strategies ``none``, ``ac``, ``sac``,
``offload``, ``offload_ac`` (``bench/strategies.py``, applied to any model:
checkpointing wraps each candidate block, the engine is entered around the
forward) the same way: peak device memory of one tracked step
(``offload.planner.meter``: MemTracker with host buffers left out on CPU,
``max_memory_allocated`` on a GPU) and the median of ``--steps`` (default 7)
untracked steps, the planner's profile using the same statistic. Each planned
point is compared with the fastest fixed arm whose measured peak fits its
budget: ``ok`` when faster or within the noise band (the two medians' 95%
intervals, ``bench.results.median_ci``, overlap), else ``slower``. Every arm
runs the same loss (the model's step), so peaks compare like for like. On a GPU, torch.compile's
``activation_memory_budget`` at 0.25/0.5/0.75 is added (not run on CPU).
torch's module-wise auto-AC ILP runs at the same budgets as the arm
``torch_ilp`` (``bench/ilp_arm.py``; JSON ``"ilp"``), measured by the same
meter; a budget it cannot meet is recorded as ``infeasible`` with its reason,
and without ``offload[ilp]`` (pulp, pwlf) the arm is ``skipped`` with the
import error. ``--strategies`` names the arms instead (``none,ac,offload_ac``: only
those, no compile arms, no ILP unless ``torch_ilp`` is named; the GPU run's
``plans`` phase). Writes ``plan_<run_id>.{json,md,png}``: the PNG is peak memory
vs step time, fixed strategies as points, planned points measured (filled) and
predicted (hollow), joined per budget, and the ILP's points measured (filled
diamonds) over its own peak bound (hollow).

``--max-seq``: for a fixed budget (default: the no-plan peak at ``--seq``),
the longest sequence (doubling from ``--seq``, then one bisection step) each
arm trains with a measured peak within the budget. ``--model toy|hf_llama``;
``--strategies`` picks the arms (``MAX_SEQ_ARMS``, ``long_context`` among them)
and then also checks each arm's loss and grads at its longest length against
``none``'s there. Writes ``plan_maxseq_<run_id>.{json,md}``.
"""

from __future__ import annotations

import functools
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.env import default_run_dir, run_metadata
from bench.progress import bar, note
from bench.plan_models import PlanTarget, build_target
from bench.strategies import Skip
from bench.workloads import Workload
from offload._format import format_bytes, render_table

__all__ = ["FIXED_ARMS", "MAX_SEQ_ARMS", "frontier_arms", "run_frontier", "run_max_seq", "main_plan", "main_max_seq"]

FIXED_ARMS = ("none", "ac", "sac", "offload", "offload_ac")
"""Fixed strategies the planner is compared with."""
MAX_SEQ_ARMS = (*FIXED_ARMS, "planner", "long_context")
"""Arms ``--max-seq`` can run (``--strategies``): the fixed ones, the planner, and ``long_context``
(``offload.long_context``: AC + offloaded checkpoint inputs + tiled MLP and loss)."""
DEFAULT_FRACTIONS = (0.25, 0.5, 0.75)
_MiB = float(1 << 20)


@dataclass
class ArmPoint:
    name: str
    peak_bytes: int | None = None
    step_s: float | None = None
    """Median of the timed steps."""
    status: str = "ok"
    reason: str = ""
    step_s_all: list[float] = field(default_factory=list)


@dataclass
class PlannedPoint:
    fraction: float
    budget_bytes: int
    decisions: dict[str, str] = field(default_factory=dict)
    predicted_peak_bytes: int | None = None
    predicted_step_s: float | None = None
    measured_peak_bytes: int | None = None
    measured_step_s: float | None = None
    solver: str = ""
    status: str = "ok"
    reason: str = ""
    report: str = ""
    measured_step_s_all: list[float] = field(default_factory=list)
    fastest_fixed: str = ""
    """The fixed arm with the least median step time whose measured peak fits this budget."""
    vs_fastest_fixed: str = ""
    """``ok`` (faster, or within the noise band: the two medians' 95% intervals overlap), ``slower``, or
    ``no fixed arm fits``."""

    @property
    def peak_error(self) -> float | None:
        if not self.measured_peak_bytes or self.predicted_peak_bytes is None:
            return None
        return self.predicted_peak_bytes / self.measured_peak_bytes - 1

    @property
    def time_error(self) -> float | None:
        if not self.measured_step_s or self.predicted_step_s is None:
            return None
        return self.predicted_step_s / self.measured_step_s - 1


def _zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def _target(workload: Workload, device: torch.device, seed: int, model: str = "toy") -> PlanTarget:
    return build_target(model, workload, device, seed)


def _checkpointed(model: torch.nn.Module, context_fn: Any) -> Callable[[], None]:
    """Every candidate block (``offload.planner.find_blocks``) under non-reentrant checkpointing, as the
    toy model's ``checkpoint_blocks`` does; returns the undo."""
    from torch.utils.checkpoint import checkpoint

    from offload.planner import find_blocks

    undo = []
    for _, block in find_blocks(model):
        orig = block.forward

        def forward(*a: Any, _orig: Callable = orig, **k: Any) -> Any:
            if not torch.is_grad_enabled():
                return _orig(*a, **k)
            kw = {"context_fn": context_fn} if context_fn is not None else {}
            return checkpoint(_orig, *a, use_reentrant=False, **kw, **k)

        block.forward = forward
        undo.append(lambda b=block: delattr(b, "forward"))
    return lambda: [u() for u in undo]


def _arm_run(name: str, t: PlanTarget) -> tuple[Callable[[], None], Any]:
    """One fixed strategy as (run, engine), on the target's own step: every arm computes the same loss.
    The strategies are those of ``bench/strategies.py`` (same engine settings, the same selective
    policy), applied to any model: checkpointing wraps each candidate block (what the planner decides
    for), the engine is entered around the whole forward."""
    import offload
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from bench.strategies import _sac_policy  # the same selective policy as the ``sac`` strategy

    ckpt = name in ("ac", "sac", "offload_ac")
    context_fn = (functools.partial(create_selective_checkpoint_contexts, _sac_policy) if name == "sac" else None)
    engine = (offload.OffloadActivations(device=t.engine_device, use_streams=True)
              if name in ("offload", "offload_ac") else None)
    if name.startswith("compile_amb_"):
        return _compile_arm(t, float(name.rsplit("_", 1)[1])), None
    if name == "long_context":
        return _long_context_arm(t)
    if name not in FIXED_ARMS:
        raise Skip(f"unknown arm {name!r}")

    def run() -> None:
        undo = _checkpointed(t.model, context_fn) if ckpt else None
        try:
            if engine is None:
                loss = t.step()
            else:
                with engine:
                    loss = t.step()
        finally:
            if undo is not None:
                undo()
        loss.backward()

    return run, engine


def _long_context_arm(t: PlanTarget) -> tuple[Callable[[], None], Any]:
    """``offload.long_context`` installed around each step (one engine: its pool persists) and kept through
    backward, whose checkpoint recompute runs the tiled forwards again. A Hugging Face model's labels= loss
    is tiled; the toy's own loss on the logits is not (its head runs)."""
    import offload

    engine = offload.OffloadActivations(device=t.engine_device, model=t.model)

    def run() -> None:
        with offload.long_context(t.model, engine=engine):
            t.step().backward()

    return run, engine


def _compile_arm(t: PlanTarget, budget: float) -> Callable[[], None]:
    """torch.compile with activation_memory_budget (GPU only; not run on CPU, so unverified here)."""
    if t.on_cpu:
        raise Skip("compile's activation_memory_budget is measured on GPU only (n/a on CPU)")
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(t.step)

    def run() -> None:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            loss = compiled()
        loss.backward()

    return run


def _measure(t: PlanTarget, run: Callable[[], None], steps: int, warmup: int, pools: list[Any] | None = None) -> Any:
    """The frontier's one meter: peak of one tracked step, median of ``steps`` timed steps (every arm)."""
    from offload.planner.meter import measure_step

    return measure_step(run, device=t.device, model=t.model, pools=pools or [], warmup=warmup, timed=steps,
                        before_each=lambda: _zero(t.model))


def _measure_arm(name: str, t: PlanTarget, steps: int, warmup: int) -> ArmPoint:
    try:
        run, engine = _arm_run(name, t)
    except Skip as e:
        return ArmPoint(name, status="skipped", reason=str(e))
    try:
        m = _measure(t, run, steps, warmup, [engine.pool] if engine else [])
    except Exception as e:  # one broken arm must not take the others down
        return ArmPoint(name, status="error", reason=f"{type(e).__name__}: {e}")
    finally:
        if name.startswith("compile_amb_"):
            import torch._dynamo

            torch._dynamo.reset()
        gc.collect()
    return ArmPoint(name, peak_bytes=m.peak_bytes, step_s=m.step_seconds, step_s_all=list(m.step_seconds_all))


def _band(xs: list[float]) -> tuple[float, float] | None:
    """The noise band of a median: its 95% interval (``bench.results.median_ci``), else min..max."""
    from bench.results import median_ci

    if not xs:
        return None
    return median_ci(xs, 0.95) or (min(xs), max(xs))


def _compare(pt: PlannedPoint, arms: list[ArmPoint]) -> None:
    """Set ``fastest_fixed`` / ``vs_fastest_fixed``: the planned step against the fastest fixed arm that fits."""
    fits = [a for a in arms if a.status == "ok" and a.peak_bytes is not None and a.peak_bytes <= pt.budget_bytes
            and a.step_s is not None]
    if not fits:
        pt.vs_fastest_fixed = "no fixed arm fits"
        return
    best = min(fits, key=lambda a: a.step_s)
    pt.fastest_fixed = best.name
    mine, theirs = _band(pt.measured_step_s_all), _band(best.step_s_all)
    if pt.measured_step_s is None or mine is None or theirs is None:
        pt.vs_fastest_fixed = "not timed"
    else:
        pt.vs_fastest_fixed = "ok" if (pt.measured_step_s <= best.step_s or mine[0] <= theirs[1]) else "slower"


def frontier_arms(names: str, device: str) -> tuple[tuple[str, ...], bool]:
    """``(fixed arms, whether torch's ILP arm runs)`` of ``--plan --strategies NAMES``: ``all`` is every fixed
    arm (and on a GPU torch.compile's ``activation_memory_budget`` at 0.25/0.5/0.75) and the ILP; otherwise
    exactly the arms named (``torch_ilp`` for the ILP). ValueError naming an unknown one."""
    from bench.ilp_arm import ILP_ARM

    compile_arms = ("compile_amb_0.25", "compile_amb_0.5", "compile_amb_0.75")
    if names == "all":
        return FIXED_ARMS + (compile_arms if torch.device(device).type == "cuda" else ()), True
    chosen = tuple(n.strip() for n in names.split(",") if n.strip())
    unknown = [n for n in chosen if n not in (*FIXED_ARMS, ILP_ARM) and not n.startswith("compile_amb_")]
    if unknown:
        raise ValueError(f"--plan --strategies: {unknown} are not arms of the frontier; use {', '.join(FIXED_ARMS)}, "
                         f"compile_amb_<budget> (e.g. {compile_arms[1]}) or {ILP_ARM}, or 'all'")
    return tuple(n for n in chosen if n != ILP_ARM), ILP_ARM in chosen


def run_frontier(workload: Workload, device: str, *, fractions: tuple[float, ...] = DEFAULT_FRACTIONS,
                 steps: int = 7, warmup: int = 1, seed: int = 0, progress: bool = True,
                 model: str = "toy", arms: tuple[str, ...] | None = None, ilp: bool = True) -> dict[str, Any]:
    """Fixed arms and planned points for one workload and model (see the module docstring); ``arms``: the
    fixed arms to measure (default: ``frontier_arms("all", device)``'s), ``ilp``: run torch's ILP arm."""
    import offload
    from offload.planner import plan_from_cost, plan_steps

    dev = torch.device(device)
    if workload.fit_layers and dev.type == "cuda":  # 8b: as many blocks as fit when `none` runs
        from bench.harness import fit_layers

        workload = workload.replace(n_layers=fit_layers(workload, dev, 0.85, seed))
    t = _target(workload, dev, seed, model)
    arms_names = list(arms if arms is not None else frontier_arms("all", device)[0])
    pbar = bar(len(arms_names) + 1 + len(fractions), f"plan {t.name}", enabled=progress, unit="phase")

    def say(text: str) -> None:
        pbar.set_postfix_str(text.split(": ", 1)[-1][:60], refresh=True)
        note(text, enabled=progress)

    arms = []
    for name in arms_names:
        say(f"{t.name}: measuring {name}")
        arms.append(_measure_arm(name, t, steps, warmup))
        pbar.update()
    say(f"{t.name}: profiling the planner ({plan_steps(warmup, steps)} steps)")
    t0 = time.perf_counter()
    base_plan = offload.plan(t.model, t.step, budget_bytes=1 << 62, warmup=warmup, timed=steps)
    profile_s = time.perf_counter() - t0
    pbar.update()
    cost = base_plan.cost
    unplanned = base_plan.unplanned_peak_bytes
    planned = []
    for f in fractions:
        budget = cost.base + int(f * (unplanned - cost.base))
        pt = PlannedPoint(fraction=f, budget_bytes=budget)
        try:
            # As offload.plan does: solve, measure the plan, solve again with a margin if it peaked over.
            p = plan_from_cost(cost, budget, model=t.model, device=str(dev), unplanned_peak=unplanned,
                               unplanned_s=base_plan.unplanned_step_seconds, step=t.step, warmup=warmup)
        except offload.OffloadError as e:
            pt.status, pt.reason = "infeasible", str(e)
            _compare(pt, arms)
            planned.append(pt)
            pbar.update()
            continue
        say(f"[plan] {t.name} budget {f:.2f}: measuring {p.decisions}")
        p.measure(t.model, t.step, warmup=warmup, timed=steps)
        pt.decisions, pt.solver = dict(p.decisions), p.solver
        pt.predicted_peak_bytes, pt.predicted_step_s = p.predicted_peak_bytes, p.predicted_step_seconds
        pt.measured_peak_bytes, pt.measured_step_s = p.measured_peak_bytes, p.measured_step_seconds
        pt.measured_step_s_all = list(p.measured_step_seconds_all)
        pt.report = p.report()
        _compare(pt, arms)
        planned.append(pt)
        pbar.update()
    pbar.close()
    from bench.ilp_arm import ILP_ARM, run_ilp_arm

    ilp_res = (run_ilp_arm(t.model, t.step, [(p.fraction, p.budget_bytes) for p in planned],
                           measure=lambda run: _measure(t, run, steps, warmup), before_each=lambda: _zero(t.model),
                           say=say) if ilp else
               {"name": ILP_ARM, "status": "not_run", "reason": "not among the arms named (--strategies)",
                "points": []})
    return {
        "workload": {**asdict(workload), "run_id": t.run_id},
        "model": t.name,
        "device": str(dev),
        "base_bytes": cost.base,
        "unplanned_peak_bytes": unplanned,
        "profile_seconds": profile_s,
        "profile_steps": plan_steps(warmup, steps),
        "unplanned_step_seconds": base_plan.unplanned_step_seconds,
        "noise_seconds": cost.noise_s,
        "profile_step_seconds": base_plan.to_dict()["profile_step_seconds"],
        "hardware": asdict(cost.hardware),
        "arms": [asdict(a) for a in arms],
        "planned": [{**asdict(p), "peak_error": p.peak_error, "time_error": p.time_error} for p in planned],
        "ilp": ilp_res,
        "unverified": ("GPU arms (compile activation_memory_budget), the streams cost model (hidden copies) and "
                       "torch's ILP with torch's own CUDA operator timer were not run on this machine"
                       + (" (its ILP arm ran with operators timed on CPU)" if ilp else "")
                       if dev.type == "cpu" else "none: every arm ran on this device (see each arm's status)"),
    }


# -------------------------------------------------------------------- output


def _mib(x: int | None) -> str:
    """Bytes as MiB (the unit every planner table uses), through the one byte formatter."""
    return format_bytes(x, unit="MiB")


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def _fits_cell(p: dict[str, Any]) -> str:
    if p["measured_peak_bytes"] is None:
        return "—"
    return "yes" if p["measured_peak_bytes"] <= p["budget_bytes"] else "NO"


def _md(rows: list[list[Any]], headers: list[str]) -> list[str]:
    """A markdown table (the bench's one renderer), '|' in cells kept from splitting columns."""
    rows = [[str(c).replace("|", "/") for c in r] for r in rows]
    return render_table(rows, headers, fmt="github").rstrip("\n").splitlines()


def _planning_cost(res: dict[str, Any]) -> str:
    """What planning cost: seconds, and in steps without a plan (issue 31: a stated number of steps)."""
    text = f"Planning (offload.plan: profile + measure) took {res['profile_seconds']:.1f} s"
    step = res.get("unplanned_step_seconds")
    if step:
        text += (f", {res['profile_seconds'] / step:.0f}x one step without a plan ({step * 1e3:.1f} ms; it ran "
                 f"{res.get('profile_steps', '?')} steps, the memory-tracked ones slower)")
    return text + "."


def format_frontier(res: dict[str, Any]) -> str:
    lines = [f"planner frontier: {res['workload']['run_id']} on {res['device']} "
             f"(base {_mib(res['base_bytes'])}, no-plan peak {_mib(res['unplanned_peak_bytes'])})", ""]
    lines += _md([[a["name"], _mib(a["peak_bytes"]), _ms(a["step_s"]),
                   f"{a['status']}{': ' + a['reason'] if a['reason'] else ''}"] for a in res["arms"]],
                 ["arm", "peak", "step ms (median)", "status"])
    rows = []
    for p in res["planned"]:
        dec = ", ".join(f"{k}={v}" for k, v in p["decisions"].items()) or p["reason"][:120]
        vs = f"{p.get('vs_fastest_fixed', '')}{' (' + p['fastest_fixed'] + ')' if p.get('fastest_fixed') else ''}"
        rows.append([f"{p['fraction']:.2f}", _mib(p["budget_bytes"]), _mib(p["predicted_peak_bytes"]),
                     _mib(p["measured_peak_bytes"]), _pct(p["peak_error"]), _ms(p["predicted_step_s"]),
                     _ms(p["measured_step_s"]), _pct(p["time_error"]), _fits_cell(p), vs, dec])
    lines += [""] + _md(rows, ["budget (of activation mem)", "budget", "predicted peak", "measured peak",
                               "peak err", "predicted ms", "measured ms", "time err", "fits",
                               "vs fastest fixed that fits", "decisions"])
    lines += _format_ilp(res)
    hw = res["hardware"]
    lines += ["", f"Link model: D2H {hw['d2h_gb_s']:.1f} GB/s, H2D {hw['h2d_gb_s']:.1f} GB/s ({hw['source']}), "
              f"{'synchronous copies (time exposed)' if hw['synchronous'] else 'side streams'}. "
              f"{_planning_cost(res)} Unverified: {res['unverified']}."]
    return "\n".join(lines)


def _format_ilp(res: dict[str, Any]) -> list[str]:
    """The torch auto-AC ILP arm: its own table (same budgets, same meter), or why it did not run."""
    ilp = res.get("ilp")
    if not ilp:
        return []
    if ilp["status"] != "ok":
        return ["", f"torch auto-AC ILP (`{ilp['name']}`): {ilp['status']}: {ilp['reason']}"]
    timer = ("operators timed on CPU by profiling's CpuOpTimer" if ilp["sac_mode"] == "cpu-benchmark"
             else f"torch's {ilp['sac_mode']}")
    lines = ["", f"torch auto-AC ILP (`{ilp['name']}`: MemTracker + SACEstimator with {timer}, "
             f"`sac_milp` per budget, per-unit operator policy applied as selective AC; its model puts the no-AC "
             f"peak at {_mib(ilp['baseline_peak_bytes'])}, measured {_mib(res['unplanned_peak_bytes'])}; "
             f"profile {ilp['profile_seconds']:.1f} s):", ""]
    rows = []
    for p in ilp["points"]:
        dec = ", ".join(f"{k.split('.', 1)[-1]}: {v:.2f} ({p['saved_ops'].get(k, '?')})"
                        for k, v in p["decisions"].items())
        note = dec if p["status"] == "ok" else f"{p['status']}: {p['reason']}"
        rc = "—" if p["predicted_recompute_ms"] is None else f"{p['predicted_recompute_ms']:.1f}"
        rows.append([f"{p['fraction']:.2f}", _mib(p["budget_bytes"]), _mib(p["predicted_peak_bytes"]),
                     _mib(p["measured_peak_bytes"]), _pct(p["peak_error"]), rc, _ms(p["measured_step_s"]),
                     _fits_cell(p), note])
    return lines + _md(rows, ["budget (of activation mem)", "budget", "ILP peak bound", "measured peak",
                              "peak err", "ILP recompute ms", "measured ms", "fits",
                              "AC units: discarded fraction (saved ops)"])


def write_frontier_png(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for a in res["arms"]:
        if a["peak_bytes"] is None:
            continue
        x, y = a["step_s"] * 1e3, a["peak_bytes"] / _MiB
        ax.plot([x], [y], "s", color="tab:gray", ms=7)
        ax.annotate(a["name"], (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8, color="dimgray")
    pts = [p for p in res["planned"] if p["measured_peak_bytes"] is not None]
    for p in pts:
        mx, my = p["measured_step_s"] * 1e3, p["measured_peak_bytes"] / _MiB
        px, py = p["predicted_step_s"] * 1e3, p["predicted_peak_bytes"] / _MiB
        ax.plot([px, mx], [py, my], "-", color="tab:blue", alpha=0.4, lw=1)
        ax.plot([px], [py], "o", mfc="none", color="tab:blue", ms=8)
        ax.plot([mx], [my], "o", color="tab:blue", ms=6)
        ax.annotate(f"plan @{p['fraction']:.2f}", (mx, my), textcoords="offset points", xytext=(6, -10),
                    fontsize=8, color="tab:blue")
    if pts:
        s = sorted(pts, key=lambda p: p["measured_peak_bytes"])
        ax.plot([p["measured_step_s"] * 1e3 for p in s], [p["measured_peak_bytes"] / _MiB for p in s], "-",
                color="tab:blue", lw=1.5, label="planner, measured (filled) / predicted (hollow)")
    for p in res["planned"]:  # every budget, labelled, whether or not an arm reached it
        y = p["budget_bytes"] / _MiB
        ax.axhline(y, color="tab:red", lw=0.6, ls=":", alpha=0.7)
        ax.annotate(f"budget {p['fraction']:.2f}", (1, y), xycoords=("axes fraction", "data"), xytext=(-3, 2),
                    textcoords="offset points", ha="right", fontsize=7, color="tab:red")
    for p in (res.get("ilp") or {}).get("points", []):
        if p["status"] != "ok":  # say on the plot where torch's ILP has no point
            ax.annotate(f"ILP @{p['fraction']:.2f}: {p['status']}", (0, p["budget_bytes"] / _MiB),
                        xycoords=("axes fraction", "data"), xytext=(3, 2), textcoords="offset points",
                        fontsize=7, color="tab:green")
    ilp = [p for p in (res.get("ilp") or {}).get("points", []) if p["measured_peak_bytes"] is not None]
    for p in ilp:
        mx, my = p["measured_step_s"] * 1e3, p["measured_peak_bytes"] / _MiB
        py = p["predicted_peak_bytes"] / _MiB
        ax.plot([mx, mx], [py, my], "-", color="tab:green", alpha=0.4, lw=1)
        ax.plot([mx], [py], "D", mfc="none", color="tab:green", ms=7)
        ax.plot([mx], [my], "D", color="tab:green", ms=5)
        ax.annotate(f"ILP @{p['fraction']:.2f}", (mx, my), textcoords="offset points", xytext=(6, 4),
                    fontsize=8, color="tab:green")
    if ilp:
        s = sorted(ilp, key=lambda p: p["measured_peak_bytes"])
        ax.plot([p["measured_step_s"] * 1e3 for p in s], [p["measured_peak_bytes"] / _MiB for p in s], "-",
                color="tab:green", lw=1.5, label="torch auto-AC ILP, measured (filled) / its peak bound (hollow)")
    ax.axhline(res["base_bytes"] / _MiB, color="black", lw=0.8, ls="--", label="base: params + grads + inputs")
    ax.plot([], [], "s", color="tab:gray", label="fixed strategies")
    ax.plot([], [], ":", color="tab:red", label="budgets")
    ax.set_xlabel("step time, median of --steps (ms)")
    ax.set_ylabel("peak device memory (MiB)")
    ax.set_title(f"memory vs time: {res['workload']['run_id']} on {res['device']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -------------------------------------------------------------------- max-seq


def _fits(name: str, workload: Workload, device: torch.device, seq: int, budget: int, seed: int,
          steps: int, model: str = "toy") -> tuple[bool, int | None, str]:
    import offload

    wl = workload.replace(seq_len=seq)
    t = _target(wl, device, seed, model)
    try:
        if name == "planner":
            try:
                p = offload.plan(t.model, t.step, budget_bytes=budget, timed=0)
            except offload.OffloadError:
                return False, None, "infeasible (predicted)"
            peak, _ = p.measure(t.model, t.step, warmup=1, timed=0)
            return peak <= budget, peak, ",".join(sorted(set(p.decisions.values())))
        a = _measure_arm(name, t, 0, 1)
        if a.peak_bytes is None:
            return False, None, a.reason
        return a.peak_bytes <= budget, a.peak_bytes, ""
    finally:
        del t
        gc.collect()


def _grads_at(name: str, workload: Workload, device: torch.device, seed: int, model: str) -> str:
    """The arm's loss and grads at ``workload``'s length against ``none``'s on an identical model: the
    verdict (bitwise, or within the tolerance of reordered sums for ``long_context``)."""
    from bench.verdict import Snapshot, compare, reordered_tolerance

    if name == "planner":
        return "not checked (the planner's arms are the fixed ones)"
    snaps = []
    for arm in ("none", name):
        t = _target(workload, device, seed, model)
        losses: list[torch.Tensor] = []
        step = t.step
        t.step = lambda _step=step: _kept(losses, _step())
        run, _ = _arm_run(arm, t)
        _zero(t.model)
        run()
        snaps.append(Snapshot.take(losses[-1], [p.grad for p in t.model.parameters()]))
        del t, run
        gc.collect()
    tol = reordered_tolerance(workload.torch_dtype) if name == "long_context" else None
    return compare(snaps[0], snaps[1], tolerance=tol).verdict


def _kept(losses: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
    losses.append(loss.detach())
    return loss


def run_max_seq(workload: Workload, device: str, *, budget_bytes: int | None = None, arms: tuple[str, ...] = (
        "none", "ac", "offload", "offload_ac", "planner"), max_doublings: int = 4, seed: int = 0,
        progress: bool = True, model: str = "toy", check_grads: bool = False) -> dict[str, Any]:
    """Longest trainable sequence per arm under one budget (doubling, then one bisection); with
    ``check_grads`` each arm's loss and grads at its longest length are compared with ``none``'s there."""
    dev = torch.device(device)
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)
    if budget_bytes is None:
        t = _target(workload, dev, seed, model)
        budget_bytes = _measure_arm("none", t, 0, 1).peak_bytes
        del t
    rows = []
    for name in arms:
        seq, best, best_peak, note = workload.seq_len, None, None, ""
        lo_fail = None
        for _ in range(max_doublings + 1):
            ok, peak, note_ = _fits(name, workload, dev, seq, budget_bytes, seed, 0, model)
            say(f"[max-seq] {name} seq={seq}: {'fits' if ok else 'over'} ({_mib(peak)})")
            if not ok:
                lo_fail = seq
                break
            best, best_peak, note = seq, peak, note_
            seq *= 2
        if best is not None and lo_fail is not None:
            mid = (best + lo_fail) // 2
            mid -= mid % 8
            if best < mid < lo_fail:
                ok, peak, note_ = _fits(name, workload, dev, mid, budget_bytes, seed, 0, model)
                say(f"[max-seq] {name} seq={mid}: {'fits' if ok else 'over'} ({_mib(peak)})")
                if ok:
                    best, best_peak, note = mid, peak, note_
        row = {"arm": name, "max_seq": best, "peak_bytes": best_peak, "capped": lo_fail is None, "note": note}
        if check_grads and best is not None and name != "none":
            say(f"[max-seq] {name} seq={best}: loss and grads against none")
            row["grads"] = _grads_at(name, workload.replace(seq_len=best), dev, seed, model)
        rows.append(row)
    return {"workload": {**asdict(workload), "run_id": workload.run_id}, "model": model, "device": str(dev),
            "budget_bytes": budget_bytes, "rows": rows,
            "method": f"doubling from seq {workload.seq_len} (at most {max_doublings} times), then one bisection "
                      "step; fits = measured peak <= budget (MemTracker on CPU, host pools left out)"
                      + ("; grads: the arm's loss and grads at its longest length against none's there"
                         if check_grads else "")}


def format_max_seq(res: dict[str, Any]) -> str:
    model = res.get("model", "toy")
    lines = [f"longest sequence under {_mib(res['budget_bytes'])}: {res['workload']['run_id']}"
             f"{'' if model == 'toy' else ' (' + model + ')'} on {res['device']}", ""]
    grads = any("grads" in r for r in res["rows"])
    lines += _md([[r["arm"], "—" if r["max_seq"] is None else f"{r['max_seq']}{'+' if r['capped'] else ''}",
                   _mib(r["peak_bytes"]), *([r.get("grads", "reference")] if grads else []), r["note"]]
                  for r in res["rows"]], ["arm", "max seq", "peak", *(["loss & grads vs none"] if grads else []),
                                          "note"])
    lines += ["", f"Method: {res['method']}; '+' = still fitting at the last length tried."]
    return "\n".join(lines)


# -------------------------------------------------------------------- entry points


def _write(stem: str, res: dict[str, Any], text: str, out_dir: Path, meta: dict[str, Any],
           png: Callable[[dict[str, Any], Path], bool] | None, caption: str = "memory vs step time") -> list[Path]:
    """``<stem>.json`` (meta + result), ``<stem>.png`` when ``png`` draws one, and ``<stem>.md`` (command,
    table, picture): the result files of every ``bench.plan`` / ``bench.tiers`` run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    jp = out_dir / f"{stem}.json"
    jp.write_text(json.dumps({"meta": meta, **res}, indent=1, default=str) + "\n")
    paths.append(jp)
    md = [f"# {stem}", "", f"Command: `{meta.get('command', '')}`", "", text]
    if png is not None and png(res, out_dir / f"{stem}.png"):
        paths.append(out_dir / f"{stem}.png")
        md += ["", f"![{caption}]({stem}.png)"]
    mp = out_dir / f"{stem}.md"
    mp.write_text("\n".join(md) + "\n")
    paths.append(mp)
    return paths


def main_plan(workload: Workload, device: str, args: Any, argv: list[str] | None) -> int:
    fractions = tuple(float(x) for x in str(getattr(args, "budgets", "") or "0.25,0.5,0.75").split(","))
    steps = args.steps if args.steps is not None else 7  # 7: the medians' 95% intervals exist (n >= 6)
    try:
        arms, ilp = frontier_arms(getattr(args, "strategies", "all") or "all", device)
    except ValueError as e:
        print(f"python -m bench: {e}", file=sys.stderr)
        return 2
    res = run_frontier(workload, device, fractions=fractions, steps=steps,
                       warmup=args.warmup if args.warmup is not None else 1, seed=args.seed,
                       progress=not args.quiet, model=getattr(args, "model", "toy") or "toy", arms=arms, ilp=ilp)
    text = format_frontier(res)
    print(text)
    if not args.no_write:
        run_id = res["workload"]["run_id"]
        meta = run_metadata(device, argv if argv is not None else sys.argv[1:])
        meta["command"] = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
        out = args.out if args.out is not None else default_run_dir("plan", str(run_id))
        for p in _write(f"plan_{run_id}", res, text, out, meta,
                        None if args.no_plot else write_frontier_png):
            print(f"wrote {p}")
    return 0


def main_max_seq(workload: Workload, device: str, args: Any, argv: list[str] | None) -> int:
    model = getattr(args, "model", "toy") or "toy"
    if model not in ("toy", "hf_llama"):
        print("python -m bench: --max-seq runs --model toy or hf_llama", file=sys.stderr)
        return 2
    names = getattr(args, "strategies", "all") or "all"
    arms = ("none", "ac", "offload", "offload_ac", "planner") if names == "all" else \
        tuple(n.strip() for n in names.split(",") if n.strip())
    unknown = [a for a in arms if a not in MAX_SEQ_ARMS]
    if unknown:
        print(f"python -m bench: --max-seq --strategies {','.join(unknown)}: not an arm of {MAX_SEQ_ARMS}",
              file=sys.stderr)
        return 2
    res = run_max_seq(workload, device, budget_bytes=args.budget_bytes, seed=args.seed, progress=not args.quiet,
                      arms=arms, model=model, check_grads=names != "all")
    text = format_max_seq(res)
    print(text)
    if not args.no_write:
        meta = run_metadata(device, argv if argv is not None else sys.argv[1:])
        meta["command"] = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
        run_id = workload.run_id if model == "toy" else f"{model}_{workload.run_id.split('_', 1)[1]}"
        out = args.out if args.out is not None else default_run_dir("plan_maxseq", str(run_id))
        for p in _write(f"plan_maxseq_{run_id}", res, text, out, meta, None):
            print(f"wrote {p}")
    return 0
