"""The cost model: predicted peak memory and step time of a per-block plan.

Memory (all quantities measured by :mod:`offload.planner.profile`, one step
per decision with every candidate block under that decision):

* ``B``: device bytes in use when the step begins (parameters, gradients,
  buffers, inputs, and the optimizer's state: measured, or charged where the
  profiled step did not hold it, NOTE [ Optimizer in the budget ]). Profiling
  zeroes gradients in place, so they exist for the whole step, as in a loop
  using ``zero_grad(set_to_none=False)``; a loop that sets them to None peaks
  lower, so the prediction is conservative there. The optimizer's step is one
  more peak, ``B`` plus its temporaries, whatever the decisions.
* ``r_i(d)``: bytes block ``i`` leaves on the device after its forward until
  its backward, under decision ``d``: ``L - A - out + ret * in`` (level after
  minus before, minus its output, which the next block accounts for, plus its
  input if the decision keeps the input alive, as read by a weak reference).
* Every peak of the step is a prefix sum plus a block-local constant: the
  forward of block ``i`` peaks at ``B + P_i + f_i(d_i)`` and its backward at
  ``B + P_i + b_i(d_i)``, with ``P_i = sum_{j<i} r_j(d_j)``, where ``f`` and
  ``b`` are measured in profile ``d`` as ``peak - B - sum_{j<i} r_j(d)``. The
  head window (head forward, loss, head backward) peaks at
  ``B + P_{n-1} + h(d_{n-1})`` (it depends on whether the last block frees its
  input), and the embedding windows are constants. Assumption: a block's
  constants depend only on its own decision (true for a residual stream:
  neighbours interact through the prefix sum only). The exceptions are
  storages whose life several blocks' decisions decide (``lifetimes``): a
  tensor the blocks receive besides their input (a mask, position ids, a
  rotary table) is in a backward or head window while any block up to it
  holds it; a block's input that the model's forward also holds, and what a
  block returns besides its output, are in the next forwards whether the block
  keeps them or not. The solver carries the set the earlier blocks hold
  (``Option.holds``); each option says which of them its measured constants
  already count (``covered``, ``fcovered``). And the engine's loading ahead in
  backward is handled below (Time, prefetch).

Time:

* ``compute_i(keep)`` and ``compute_i(recompute)`` are the block's measured
  forward + backward seconds (recompute >= keep is enforced).
* A copy of ``x`` bytes costs ``x / BW_d2h`` in forward and ``x / BW_h2d`` in
  backward plus a per-copy engine overhead. ``BW`` comes from
  a 64 MB copy timed once per process (pinned on a GPU; memcpy on CPU) or the caller.
* CPU, or an engine without streams: copies are synchronous, so all their
  time is exposed (added to the step). The per-copy overhead is calibrated
  from the offload profile (measured slowdown minus bytes / BW).
* With side streams: the D2H of block ``i`` hides behind the forward of block
  ``i+1`` and the H2D (prefetch) behind the backward of block ``i+1``; what
  does not fit its window is exposed. Windows are disjoint, so the link is
  never promised more than one copy per window: link capacity per phase is
  respected by construction. The last block's window is taken as zero.
  This is why offloading a checkpoint's input (``recompute_offload``, a few
  bytes per FLOP) hides, while offloading all of a block's saves hides only
  a fraction at realistic widths (perf-anchors §2.3).
* Prefetch: loading ahead (prefetch) in backward reaches across blocks, into the
  previous offloaded block, so it is not a per-block cost: with streams the
  plan's engine loads ahead as far as the memory backward freed allows, plus a
  window of twice the largest copy (NOTE [ Copy schedule ] item 3), and every
  backward peak of a plan that offloads anything is charged that window
  (twice the largest single copy seen in profiling; conservative). The time
  model still hides each reload only behind the next block's backward (see
  above), which the engine's earlier reloads beat. Synchronous engines get
  ``prefetch_bytes=0``: loading ahead cannot overlap anything there.
* The same work timed at several positions (candidates of one class and parameter shapes whose calls
  move the same bytes under every decision: a transformer's layers) takes one time, the median over
  them (``pool_times``): their measured differences are noise, and the solver would otherwise pick
  which layers to recompute or offload by it, a plan differing from run to run on a loaded machine.
* Step time = measured non-block time (embedding, head, loss, optimizer
  hooks, from the keep profile) + sum over blocks of compute + exposed copy.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .lifetimes import extra, masks
from .profile import DecisionProfile, StepProfile

__all__ = ["Hardware", "Option", "BlockCost", "CostModel", "measure_hardware", "build_cost_model", "noise_band",
           "NOISE_FLOOR", "widest_spread", "same_work", "pool_times"]

log = logging.getLogger("offload.planner")

_MB = 1 << 20

OFFLOADING = ("offload", "recompute_offload")
"""Decisions that copy to the host."""

NO_BACKWARD = ("nothing it returns needs a gradient (its parameters are frozen and its input needs none), so "
               "backward never reaches it and nothing it saves outlives its forward")
"""Why a block is planned as keep with nothing to decide (``CostModel.keep_only``)."""


@dataclass(frozen=True)
class Hardware:
    """Copy bandwidth and whether copies block compute."""

    d2h_gb_s: float
    h2d_gb_s: float
    synchronous: bool
    """True on CPU (and without streams): copy time is always exposed."""
    source: str = ""
    """Where the numbers came from."""


@functools.lru_cache(maxsize=8)
def _probe(device: str) -> tuple[float, float, str]:
    """D2H and H2D GB/s of a 64 MB copy (pinned host memory on an accelerator; memcpy on CPU).

    Measured here, not by ``bench.probe``: the library never imports the repo's bench tool.
    """
    dev = torch.device(device)
    n = 64 * _MB
    accel = dev.type != "cpu"
    dev_buf = torch.ones(n, dtype=torch.uint8, device=dev)
    host_buf = torch.empty(n, dtype=torch.uint8, pin_memory=accel)

    def _gb_s(dst: torch.Tensor, src: torch.Tensor) -> float:
        dst.copy_(src)  # warm-up
        if accel:
            torch.accelerator.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(src, non_blocking=accel)
        if accel:
            torch.accelerator.synchronize(dev)
        return 4 * n / (time.perf_counter() - t0) / 1e9

    d2h = _gb_s(host_buf, dev_buf)
    h2d = _gb_s(dev_buf, host_buf)
    return d2h, h2d, ("pinned 64 MB copy" if accel else "cpu memcpy 64 MB")


def measure_hardware(device: torch.device | str, synchronous: bool,
                     bandwidth_gb_s: tuple[float, float] | float | None = None) -> Hardware:
    """Bandwidths given by the caller, or measured once per process and device."""
    if bandwidth_gb_s is not None:
        if isinstance(bandwidth_gb_s, (int, float)):
            bandwidth_gb_s = (float(bandwidth_gb_s), float(bandwidth_gb_s))
        d2h, h2d = (float(x) for x in bandwidth_gb_s)
        if d2h <= 0 or h2d <= 0:
            raise ValueError(f"offload.plan: bandwidth_gb_s={bandwidth_gb_s!r} must be positive (GB/s)")
        return Hardware(d2h, h2d, synchronous, "given")
    d2h, h2d, src = _probe(str(torch.device(device)))
    return Hardware(d2h, h2d, synchronous, src)


@dataclass
class Option:
    """One decision for one call position, as the solver sees it."""

    decision: str
    retained: int
    """``r``: bytes held from the block's forward to its backward (adds to the prefix)."""
    event: int
    """Largest peak constant of the position's own windows, above ``B + prefix``."""
    seconds: float
    """Predicted forward + backward seconds, exposed copies included."""
    compute_s: float = 0.0
    recompute_s: float = 0.0
    copy_bytes: int = 0
    copy_s: float = 0.0
    """Link time of the block's copies (D2H + H2D), hidden or not."""
    exposed_s: float = 0.0
    """Part of ``copy_s`` (plus engine overhead) added to the step."""
    host_bytes: int = 0
    """Most host bytes the block's copies can take: ``copy_bytes`` plus what it shares with an earlier
    block's copy (its own copy in a plan where that block does not offload)."""
    fwd_event: int = 0
    bwd_event: int = 0
    head_event: int = 0
    """Last position only: head forward, loss and head backward."""
    pre_event: int = 0
    """First position only: everything before the first block (the stem, an embedding)."""
    post_event: int = 0
    """First position only: everything after the first block's backward (and, when the first block's
    input needs no grad, its backward too)."""
    holds: int = 0
    """Bit ``k`` set: this position keeps outside storage ``k`` (``CostModel.outside``) on the device until
    its backward under this decision."""
    covered: int = 0
    """Bit ``k`` set: the profile this option was measured in had storage ``k`` held at this position's
    backward (by it or an earlier position), so its ``bwd_event`` and ``head_event`` include those bytes."""
    fcovered: int = 0
    """Bit ``k`` set: the profile left an earlier position's input ``k``, which the model's forward holds, out
    of this position's ``fwd_event`` (it charged it to that position): a plan holding the bit adds it."""
    hcovered: int = 0
    """The part of ``fcovered`` the head's window holds too (inputs the model's forward holds: its window
    begins there, with a final norm)."""
    fwd_s: float = 0.0
    """Forward seconds as the model charges them: the timed steps' median, one for all positions that
    do the same work (``pool_times``)."""
    fwd_s_all: list[float] = field(default_factory=list)
    bwd_s_all: list[float] = field(default_factory=list)


@dataclass
class BlockCost:
    """One call of a candidate block (a position of the chain); a block called twice has two."""

    name: str
    saved_bytes: int
    """Bytes the call saves for backward when kept (engine ledger)."""
    in_bytes: int
    options: dict[str, Option] = field(default_factory=dict)
    call: int = 0
    """Which call of the block this is (0 for the first)."""
    no_backward: bool = False
    """Backward never reaches this call (``BlockStats.no_backward``): nothing to decide."""


@dataclass
class CostModel:
    """Predicts peak and step time of any assignment of decisions to blocks.

    ``blocks`` are call positions in the order they run; a decision is per
    module, so every position of a block called twice takes the same one.
    """

    base: int
    rest_s: float
    blocks: list[BlockCost]
    hardware: Hardware
    copy_overhead_s: float = 0.0
    prefetch_bytes: int = 0
    """Bytes backward may load ahead (charged to every backward peak of a plan that offloads)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Settings of the engine the profile ran with; applied plans use the same."""
    no_recompute: dict[str, str] = field(default_factory=dict)
    """Blocks never recomputed, and why (a forward that mutates buffers: see ``planning``)."""
    rest_s_all: list[float] = field(default_factory=list)
    noise_s: float = 0.0
    """The timing's noise band (``noise_band``): plans predicted within it of each other are equally
    fast, and the solver breaks the tie by a rule that reads no time (``choose``)."""
    step_s_by_decision: dict[str, list[float]] = field(default_factory=dict)
    """Every timed step's seconds per profiled decision (the band is the widest of their spreads)."""
    shared_saves: list[tuple[int, list[int]]] = field(default_factory=list)
    """Storages several call positions save, none's input (``DecisionProfile.shared_saves``, from the keep
    profile): each stays on the device after forward while a position that does not offload holds it,
    so an offloading last position's head window is charged them (``_options``)."""
    outside: list[int] = field(default_factory=list)
    """Bytes of each storage whose life depends on several positions' decisions (``lifetimes``; bit ``k``
    of ``Option.holds`` is ``outside[k]``): one the positions receive as arguments besides their input
    (a mask, position ids) stays on the device after forward until the backward of the earliest position
    holding it, so a backward (and the head) window holds it when any position up to it does; an input the
    model's forward also holds is in every later forward whether its position keeps it or not."""
    optimizer: Any = None
    """The step's optimizer (``offload.planner.optimizer.OptimizerMemory``; not given: what an AdamW would
    add, charged nothing). Its ``charged_bytes`` are in ``base``; its ``step_event_bytes`` are one more peak."""

    @property
    def keep_only(self) -> dict[str, str]:
        """Blocks planned as keep with nothing to decide, and why: backward reaches none of their calls."""
        names = {b.name for b in self.blocks} - {b.name for b in self.blocks if not b.no_backward}
        return {n: NO_BACKWARD for n in self.names if n in names}

    @property
    def names(self) -> list[str]:
        """Candidate module FQNs, each once, in the order of their first call."""
        return list(dict.fromkeys(b.name for b in self.blocks))

    def per_position(self, decisions: dict[str, str] | list[str] | tuple[str, ...]) -> list[str]:
        if isinstance(decisions, dict):
            return [decisions[b.name] for b in self.blocks]
        ds = list(decisions)
        if len(ds) != len(self.blocks):
            raise ValueError(f"offload.plan: {len(ds)} decisions for {len(self.blocks)} call positions")
        return ds

    def events(self, decisions: dict[str, str] | list[str]) -> list[tuple[int, str]]:
        """Every predicted peak of the step as (bytes, where): the solver sees each of them."""
        return [(v, w) for v, w, _ in self.breakdown(decisions)]

    def breakdown(self, decisions: dict[str, str] | list[str]) -> list[tuple[int, str, int]]:
        """Every predicted peak as (bytes, where, bytes kept by earlier calls for their backward)."""
        ds = self.per_position(decisions)
        ahead = self.prefetch_bytes if any(d in OFFLOADING for d in ds) else 0
        out = []
        prefix = held = 0
        for b, d in zip(self.blocks, ds):
            o = b.options[d]
            call = f" (call {b.call + 1})" if b.call or sum(x.name == b.name for x in self.blocks) > 1 else ""
            late = prefix + extra(self.outside, held & ~o.covered)  # + what earlier positions hold of the outside
            if o.pre_event:
                out.append((self.base + o.pre_event, "stem, before the first block", 0))
            early = prefix + extra(self.outside, held & o.fcovered)  # + inputs the forward holds
            out.append((self.base + early + o.fwd_event, f"forward of {b.name}{call} ({d})", early))
            out.append((self.base + late + o.bwd_event + ahead, f"backward of {b.name}{call} ({d})", late))
            if o.head_event:
                head = late + extra(self.outside, held & o.hcovered)  # + inputs the model's forward holds
                out.append((self.base + head + o.head_event, f"head and loss (after {b.name}: {d})", head))
            if o.post_event:
                out.append((self.base + o.post_event, f"end of backward{self._profiled_step()} (after {b.name}: {d})", 0))
            prefix += o.retained
            held |= o.holds
        step = self.optimizer.step_event_bytes if self.optimizer is not None else 0
        if step:  # NOTE [ Optimizer in the budget ] item 4: whatever the decisions
            out.append((self.base + step, f"{self.optimizer.name} step (its state and temporaries, derived)", 0))
        return out

    def _profiled_step(self) -> str:
        """The end of backward's window holds the optimizer's step when the profiles ran it (a target plan)."""
        opt = self.optimizer
        return f" and the {opt.name} step" if opt is not None and opt.given and opt.profiled else ""

    def peak(self, decisions: dict[str, str] | list[str]) -> int:
        return max(v for v, _ in self.events(decisions))

    def where(self, decisions: dict[str, str] | list[str]) -> str:
        return max(self.events(decisions))[1]

    def seconds(self, decisions: dict[str, str] | list[str]) -> float:
        ds = self.per_position(decisions)
        return self.rest_s + sum(b.options[d].seconds for b, d in zip(self.blocks, ds))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _held_elsewhere(profile: StepProfile) -> list[bool]:
    """Per position: its input outlives its forward even when every block offloads (held by an op
    between blocks, e.g. a residual add's other use, or by a module that is not a candidate), so it is
    held whatever this block decides: never charged to it (it stays in the measured constants)."""
    offl = [profile.by_decision[d] for d in OFFLOADING if d in profile.by_decision]
    n = len(profile.by_decision["keep"].blocks)
    return [bool(offl) and all(p.blocks[k].retains_input for p in offl) for k in range(n)]


def _charges(prof: DecisionProfile, elsewhere: list[bool]) -> list[tuple[int, int]]:
    """Per position of profile ``prof``: (``r``, the bytes it holds to its backward as the model charges
    them, and the bytes the earlier positions truly held when it ran).

    ``r = L - A - out - dropped + ret * in``, the input left out when it is held elsewhere (``dropped``: what
    it returned besides its output and the model let go). Sibling modules fed one
    tensor (an MLP's gate and up projections) each hold its storage: each is charged it (a plan may
    keep one and offload the other), but in this profile it was held once, so the events (measured
    above the earlier positions' true bytes) are measured above the storage counted once. A plan's
    predicted peak is then never below its real one (issue 31: finer blocks)."""
    out = []
    prefix, counted, holders = 0, 0, set()
    for k, s in enumerate(prof.blocks):
        charge_in = s.retains_input and not elsewhere[k]
        r = s.L - s.A - s.out_bytes - s.dropped + (s.in_bytes if charge_in else 0)
        out.append((r, counted))
        prefix += r
        counted += r
        if charge_in and s.in_key is not None:
            if s.in_key in holders:
                counted -= s.in_bytes  # the same storage, already held by an earlier position
            holders.add(s.in_key)
    return out


def build_cost_model(profile: StepProfile, hw: Hardware, engine_kwargs: dict[str, Any] | None = None) -> CostModel:
    """Turn per-decision profiles into per-position options (see the module docstring); positions that
    do the same work share their timings (``pool_times``)."""
    _check_same_calls(profile)
    profile = pool_times(profile, same_work(profile))
    keep = profile.by_decision["keep"]
    blocks = _block_costs(profile)
    n = len(blocks)
    compute = {d: [p.blocks[k].fwd_s + p.blocks[k].bwd_s for k in range(n)] for d, p in profile.by_decision.items()}
    overhead = _copy_overhead(profile, compute, hw)
    elsewhere = _held_elsewhere(profile)
    outside, held = masks(profile, elsewhere)
    for d, prof in profile.by_decision.items():
        for k, opt in enumerate(_options(d, prof, keep, compute, hw, overhead, elsewhere)):
            opt.holds, opt.covered, opt.fcovered, opt.hcovered = held[d][k]
            blocks[k].options[d] = opt
    rest = max(0.0, keep.step_s - sum(compute["keep"]))
    ekw = dict(engine_kwargs or {})
    ahead = _prefetch_bytes(profile, hw, ekw)
    return CostModel(base=keep.base, rest_s=rest, blocks=blocks, hardware=hw, copy_overhead_s=overhead,
                     shared_saves=[(n, list(ps)) for n, ps in keep.shared_saves], outside=outside,
                     prefetch_bytes=int(ahead), engine_kwargs=ekw, rest_s_all=list(keep.step_s_all),
                     noise_s=noise_band(profile),
                     step_s_by_decision={d: list(p.step_s_all) for d, p in profile.by_decision.items()})


NOISE_FLOOR = 0.02
"""Smallest noise band, as a share of the step: timing on a shared machine is rarely better than 2%."""


def _spreads(by_decision: dict[str, list[float]]) -> dict[str, float]:
    """Per decision timed more than once, the spread (max - min) of its timed steps' seconds."""
    return {d: max(xs) - min(xs) for d, xs in by_decision.items() if len(xs) > 1}


def noise_band(profile: StepProfile) -> float:
    """Seconds within which two predicted step times are not told apart: the widest spread (max - min)
    of the timed steps of any profiled decision, at least ``NOISE_FLOOR`` of the step without a plan."""
    spreads = _spreads({d: p.step_s_all for d, p in profile.by_decision.items()})
    step = profile.by_decision["keep"].step_s or (profile.unplanned_step_s or 0.0)
    return max([NOISE_FLOOR * step, *spreads.values()])


def widest_spread(by_decision: dict[str, list[float]]) -> str:
    """``" (<decision>'s: min-max ms)"``: the profiled decision whose timed steps spread the most (or "")."""
    spread = _spreads(by_decision)
    if not spread:
        return ""
    d = max(spread, key=spread.get)
    xs = by_decision[d]
    return f" ({d}'s: {min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f} ms)"


def same_work(profile: StepProfile) -> list[list[int]]:
    """Call positions that do the same work, in groups of two or more: candidates of one
    ``work_key`` (``StepProfile.work``) whose calls saved, copied, took and returned the same bytes
    under every decision. Empty without work keys (a predicted profile's times are not measured)."""
    if not profile.work:
        return []
    keep = profile.by_decision["keep"]
    groups: dict[Any, list[int]] = {}
    for k, i in enumerate(keep.calls):
        seen = tuple((d, s.in_bytes, s.out_bytes, s.saved_bytes, s.copy_bytes, s.copies, s.retains_input,
                      s.no_backward) for d, p in profile.by_decision.items() for s in (p.blocks[k],))
        groups.setdefault((profile.work[i], seen), []).append(k)
    return [g for g in groups.values() if len(g) > 1]


def pool_times(profile: StepProfile, groups: list[list[int]]) -> StepProfile:
    """``profile`` with each group's positions (``same_work``) given the group's median forward and
    backward seconds, per decision. The same work measured at several positions differs by noise
    only; left apart, the solver would pick positions by that noise (which layers to recompute), and
    a plan would change from run to run. Every timed sample stays in ``fwd_s_all`` / ``bwd_s_all``."""
    if not groups:
        return profile
    by_decision = {}
    for d, p in profile.by_decision.items():
        blocks = list(p.blocks)
        for g in groups:
            fwd = statistics.median(p.blocks[k].fwd_s for k in g)
            bwd = statistics.median(p.blocks[k].bwd_s for k in g)
            for k in g:
                blocks[k] = dataclasses.replace(blocks[k], fwd_s=fwd, bwd_s=bwd)
        by_decision[d] = dataclasses.replace(p, blocks=blocks)
    return dataclasses.replace(profile, by_decision=by_decision)


def _check_same_calls(profile: StepProfile) -> None:
    """Every decision's profile ran the candidate blocks in the same order as "keep" did."""
    calls = profile.by_decision["keep"].calls
    for d, p in profile.by_decision.items():
        if p.calls != calls:
            raise ValueError(
                f"offload.plan: the candidate blocks ran differently under {d!r} than under 'keep' "
                f"({[profile.names[i] for i in p.calls]} vs {[profile.names[i] for i in calls]})."
            )


def _block_costs(profile: StepProfile) -> list[BlockCost]:
    """One ``BlockCost`` per call position (options still empty), numbering repeated calls of a block."""
    keep = profile.by_decision["keep"]
    seen: dict[int, int] = {}
    blocks = []
    for p, i in enumerate(keep.calls):
        blocks.append(BlockCost(profile.names[i], keep.blocks[p].saved_bytes, keep.blocks[p].in_bytes,
                                call=seen.get(i, 0), no_backward=keep.blocks[p].no_backward))
        seen[i] = seen.get(i, 0) + 1
    return blocks


def _link_s(hw: Hardware, nbytes: int) -> tuple[float, float]:
    """Seconds to copy ``nbytes`` to the host and back at the link's bandwidths."""
    return nbytes / (hw.d2h_gb_s * 1e9), nbytes / (hw.h2d_gb_s * 1e9)


def _copy_overhead(profile: StepProfile, compute: dict[str, list[float]], hw: Hardware) -> float:
    """Per-copy engine overhead (synchronous copies): the measured slowdown beyond bytes / bandwidth."""
    overheads = []
    for d, base_d in (("offload", "keep"), ("recompute_offload", "recompute")):
        if d not in profile.by_decision or base_d not in profile.by_decision:
            continue
        for k, s in enumerate(profile.by_decision[d].blocks):
            if s.copies:
                d2h, h2d = _link_s(hw, s.copy_bytes)
                extra = compute[d][k] - max(compute[base_d][k], compute["keep"][k]) - d2h - h2d
                overheads.append(max(0.0, extra) / s.copies)
    return statistics.median(overheads) if (overheads and hw.synchronous) else 0.0


def _options(d: str, prof: DecisionProfile, keep: DecisionProfile, compute: dict[str, list[float]], hw: Hardware,
             overhead: float, elsewhere: list[bool]) -> list[Option]:
    """Decision ``d``'s option at every call position, from its profile ``prof``: its events are
    measured above the step's base and what the earlier positions truly held under ``d`` (``_charges``)."""
    n = len(prof.blocks)
    # The head's window ends where backward starts, the end of backward's begins where the earliest
    # call with a backward has its own: calls without one (frozen lower layers) have neither.
    live = [k for k, s in enumerate(prof.blocks) if not s.no_backward] or [0, n - 1]
    out = []
    for k, (s, (retained, prefix)) in enumerate(zip(prof.blocks, _charges(prof, elsewhere))):
        keep_c = compute["keep"][k]
        if d in ("keep", "offload"):
            comp = keep_c
        else:
            # A recompute re-runs the block's forward: never cheaper than keep + that forward,
            # whatever two noisy totals say.
            measured = compute[d][k] if d == "recompute" else compute.get("recompute", compute[d])[k]
            comp = max(measured, keep_c + keep.blocks[k].fwd_s)
        d2h, h2d = _link_s(hw, s.copy_bytes)
        if hw.synchronous:
            exposed = d2h + h2d + s.copies * overhead
        else:
            nxt = keep.blocks[k + 1] if k + 1 < n else None
            exposed = max(0.0, d2h - (nxt.fwd_s if nxt else 0.0)) + max(0.0, h2d - (nxt.bwd_s if nxt else 0.0))
        opt = Option(decision=d, retained=retained, event=0, seconds=comp + exposed, compute_s=keep_c,
                     recompute_s=comp - keep_c, copy_bytes=s.copy_bytes, copy_s=d2h + h2d, exposed_s=exposed,
                     host_bytes=s.copy_bytes + s.shared_bytes,
                     fwd_event=s.fwd_peak - prof.base - prefix, bwd_event=s.bwd_peak - prof.base - prefix,
                     fwd_s=s.fwd_s, fwd_s_all=list(s.fwd_s_all), bwd_s_all=list(s.bwd_s_all))
        if k == live[-1]:
            # Storages every position saves (a model's rotary tables, its mask) were freed after forward in
            # a profile where all of them offload; a plan where another position keeps them holds them
            # here. The solver's events add up per position, so the head's window is charged them
            # whenever this position offloads: never below the real peak, above it by those bytes when
            # every position offloads them (issue: a measured plan overshot its budget by the tables).
            held = sum(n for n, _ in keep.shared_saves) if d in OFFLOADING else 0
            opt.head_event = prof.head_peak - prof.base - prefix + held
        if k == 0:
            # The window before the first call: no block holds anything then.
            opt.pre_event = max(1, prof.pre_peak - prof.base)
        if k == live[0]:
            # After the earliest backward's start: the calls before it hold nothing for backward, so it
            # depends on this call's decision only.
            opt.post_event = max(1, prof.post_peak - prof.base)
        opt.event = max(opt.fwd_event, opt.bwd_event, opt.head_event, opt.pre_event, opt.post_event)
        out.append(opt)
    return out


def _prefetch_bytes(profile: StepProfile, hw: Hardware, ekw: dict[str, Any]) -> int:
    """The bytes the engine may hold loaded ahead above what backward has freed (0 for synchronous copies):
    ``prefetch_bytes`` when the plan sets it, else the window every pass may take, twice the largest copy
    (NOTE [ Copy schedule ] item 3: reloads beyond it fill only memory backward freed below the forward's
    end, so they add nothing to the peak)."""
    if hw.synchronous:
        return 0
    biggest = max((s.max_copy for p in profile.by_decision.values() for s in p.blocks), default=0)
    ahead = ekw.get("prefetch_bytes")
    return 2 * biggest if ahead is None else ahead
