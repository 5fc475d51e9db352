"""Profile one training step per decision: memory levels, peaks and times per block.

The planner runs the user's step (forward, then backward outside the engine)
once per decision, with every candidate block set to that decision, and a
:class:`Probe` watching block boundaries:

* forward: the level just before a block runs (``A``), just after (``L``) and
  the peak in between; the block's input and output bytes; whether the
  block's input storage is still alive when its backward starts (``ret``:
  something, usually the decision, retains it), read through a weak
  reference to the storage (not to the tensor object: the engine may hold
  the bytes through another tensor, a detached alias or a view);
* backward: identity autograd markers on the block's output and input fire
  when backward reaches the block (level ``D``) and leaves it; the peak in
  between;
* the windows before the first block (embedding), between the last block's
  forward and its backward (head, loss, head backward) and after the first
  block's backward (embedding backward);
* times of the same boundaries in separate, untracked steps (on CPU this
  thread's CPU time when torch uses one thread, else wall clock; device events
  on accelerators), so that the memory tracker's dispatch
  overhead does not pollute them;
* from an engine observer: bytes saved per block, bytes and count of copies.

Warm-up steps run first, so the host pool is filled and lazy state exists.
"""

from __future__ import annotations

import contextlib
import statistics
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..policy import DUPLICATE_STORAGE, storage_ptr
from .install import DECISIONS, Installed
from .lifetimes import ArgumentWatch, shared_saves
from .meter import BoundaryClock, MemoryMeter

__all__ = ["BlockStats", "DecisionProfile", "StepProfile", "Probe", "Tracked", "tracked", "profile_step", "work_key"]


class _Marker(torch.autograd.Function):
    """Identity whose backward calls a callback (marks a block boundary in backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cb: Callable[[], None]) -> torch.Tensor:  # type: ignore[override]
        ctx.cb = cb
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.cb()
        return g, None


def _first_grad_tensor(leaves: list[Any], need_grad: bool = True) -> int:
    for i, v in enumerate(leaves):
        if isinstance(v, torch.Tensor) and v.is_floating_point() and (v.requires_grad or not need_grad):
            return i
    return -1


def _storage_ptr(t: torch.Tensor) -> int:
    """The storage's key as the engine reads it (a fake tensor's unique id stands in for its address)."""
    ptr = storage_ptr(t)
    return ptr if ptr is not None else id(t)


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


@dataclass
class BlockStats:
    """What one step showed about one block under one decision."""

    A: int = 0
    """Device bytes in use just before the block's forward."""
    L: int = 0
    """Device bytes in use just after the block's forward (its input still referenced)."""
    fwd_peak: int = 0
    """Peak device bytes during the block's forward."""
    D: int = 0
    """Device bytes in use when backward reaches the block's output."""
    bwd_peak: int = 0
    """Peak device bytes during the block's backward (recompute and reloads included)."""
    in_bytes: int = 0
    """Storage bytes of the block's input (what recompute keeps)."""
    out_bytes: int = 0
    """Storage bytes of the block's output."""
    retains_input: bool = True
    """The block's input tensor was still alive when its backward began."""
    dropped: int = 0
    """Storage bytes of what the block returned besides its output that died before the next block began
    (attention weights a layer returns and the model discards): in ``L``, but not held to backward."""
    in_key: tuple[int, int] | None = None
    """(data pointer, bytes) of the input's storage: two calls reading one storage (sibling
    modules fed the same tensor) share it, and the cost model charges it once (``cost``)."""
    inputs_alive: list[int] = field(default_factory=list)
    """Earlier positions whose input storage was alive when this one began (``offload.planner.lifetimes``)."""
    fwd_s: float = 0.0
    """Forward seconds (median of the timed steps)."""
    bwd_s: float = 0.0
    """Backward seconds (median of the timed steps; includes recompute)."""
    fwd_s_all: list[float] = field(default_factory=list)
    """Forward seconds of every timed step."""
    bwd_s_all: list[float] = field(default_factory=list)
    """Backward seconds of every timed step."""
    saved_bytes: int = 0
    """Logical bytes the block saved for backward (engine ledger)."""
    copy_bytes: int = 0
    """Bytes copied to the host for this block (engine ledger)."""
    copies: int = 0
    """Number of host copies for this block."""
    max_copy: int = 0
    """Largest single host copy of this block (sizes the engine's prefetch)."""
    shared_bytes: int = 0
    """Bytes this block saved that an earlier block had already copied (the engine copies a storage
    once per step): its own copy when that earlier block does not offload (``host``)."""
    no_backward: bool = False
    """No output of the call needs a gradient (its parameters frozen, its input needing none: frozen lower
    layers of a LoRA model): backward never reaches it and nothing it saves outlives its forward, so
    there is nothing to decide: it is planned as keep (``CostModel.keep_only``)."""


@dataclass
class DecisionProfile:
    """One step with every candidate block under ``decision``."""

    decision: str
    blocks: list[BlockStats]
    """Per call position, in the order the calls ran."""
    calls: list[int] = field(default_factory=list)
    """Candidate index of each position (a block called twice has two positions)."""
    base: int = 0
    """Device bytes in use when the step began (parameters, gradients, buffers, inputs)."""
    pre_peak: int = 0
    """Peak before the first block (embedding forward)."""
    head_peak: int = 0
    """Peak between the last block's forward and its backward (head, loss, head backward)."""
    post_peak: int = 0
    """Peak after the first block's backward (embedding backward, end of step)."""
    shared_saves: list[tuple[int, list[int]]] = field(default_factory=list)
    """Storages saved by more than one call position that are no position's input (a model's rotary
    tables or mask, passed to every block): (bytes, the positions). Such a storage stays on the device
    after forward while any of them holds it (charged in ``cost._options``)."""
    outside: list[tuple[tuple[int, int], int, list[int]]] = field(default_factory=list)
    """Storages positions received as arguments besides their input (a mask, position ids): ``(key, bytes,
    the positions that held it on the device for backward)``, ``key`` the same in every decision's profile
    (``offload.planner.lifetimes``)."""
    held_elsewhere: list[tuple[int, int]] = field(default_factory=list)
    """Keys (as in ``outside``) of argument storages something besides the positions holds (the model)."""
    peak: int = 0
    """Measured peak of the whole step."""
    step_s: float = 0.0
    """Median step seconds (untracked steps)."""
    step_s_all: list[float] = field(default_factory=list)


@dataclass
class StepProfile:
    """Everything the cost model needs: one :class:`DecisionProfile` per decision."""

    names: list[str]
    device: str
    by_decision: dict[str, DecisionProfile] = field(default_factory=dict)
    unplanned_peak: int = 0
    """Measured peak of the step without any plan installed."""
    unplanned_step_s: float = 0.0
    param_bytes: int = 0
    grad_bytes: int = 0
    synchronous_copies: bool = True
    """Copies block compute (CPU, or an engine without streams)."""
    work: list[Any] = field(default_factory=list)
    """Per candidate, its ``work_key``: candidates with equal keys do the same work (the cost model
    pools their timings: ``cost.pool_times``). Empty: every candidate is timed on its own."""


def work_key(module: nn.Module) -> tuple[Any, ...]:
    """What decides a module's work, short of its input: its class and its parameters' and buffers'
    names, shapes, dtypes and whether they need a gradient (the layers of a transformer are equal)."""
    return (type(module).__module__, type(module).__qualname__,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()))


class Probe:
    """Records levels, peaks and times at block boundaries during one step.

    Stats are kept per *call* (a position in the step's chain of candidate
    calls): a block called twice per step (weight sharing) has two positions,
    each with its own levels, peaks and times. ``calls[p]`` is the candidate
    index of position ``p``, in the order the calls ran.
    """

    def __init__(self, n: int, clock: BoundaryClock, meter: MemoryMeter | None, names: list[str] | None = None) -> None:
        self.n = n
        self.names = names or [str(i) for i in range(n)]
        self.clock = clock
        self.meter = meter
        self.stats: list[BlockStats] = []
        self.calls: list[int] = []
        self.t: dict[tuple[str, int], Any] = {}
        self._inputs: list[weakref.ref | None] = []
        self.windows: dict[str, int] = {}
        self.base = 0
        self._bwd_seen: set[int] = set()
        self._has_input_marker: set[int] = set()
        self._no_backward: set[int] = set()
        self._active: int | None = None
        self._returned: list[tuple[int, Any, int]] = []  # (position, weak storage, bytes): BlockStats.dropped
        self.args = ArgumentWatch()
        """The argument storages (``DecisionProfile.outside``)."""
        self.position = -1
        """The position whose forward is running (-1 outside every candidate)."""

    def _level(self) -> int:
        return self.meter.level() if self.meter is not None else 0

    def _window(self) -> int:
        return self.meter.window() if self.meter is not None else 0

    def begin(self) -> None:
        self.base = self._level()
        self._window()
        self.t[("step", 0)] = self.clock.now()

    def fwd_pre(self, i: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._active is not None:
            outer = self.names[self.calls[self._active]]
            raise ValueError(
                f"offload.plan: candidate block {self.names[i]!r} ran inside candidate {outer!r}: candidates "
                "must be a chain of disjoint calls. Pass blocks=[...] without one of them."
            )
        pos = len(self.calls)
        self._settle(pos - 1)
        self.calls.append(i)
        self.stats.append(BlockStats())
        self._inputs.append(None)
        self.args.begin()
        self._active = self.position = pos
        s = self.stats[pos]
        w = self._window()
        if pos == 0:
            self.windows["pre"] = w
        else:
            s.fwd_peak = max(s.fwd_peak, w)  # the gap before this block (loop bookkeeping)
        s.A = self._level()
        if self.meter is not None:
            s.inputs_alive = [q for q in range(pos) if (ref := self._inputs[q]) is not None and ref() is not None]
        leaves, spec = tree_flatten((args, kwargs))
        k = _first_grad_tensor(leaves)
        # The input: the first that needs grad, else the first floating-point one (a frozen stem's
        # output still feeds a LoRA layer, which saves it for its weights' gradient).
        j = k if k >= 0 else _first_grad_tensor(leaves, need_grad=False)
        if self.meter is not None:  # a tracked step (timed steps leave it out)
            for idx, v in enumerate(leaves):
                if isinstance(v, torch.Tensor):
                    self.args.note(pos, idx, v, _storage_ptr(v), _storage_bytes(v), idx == j)
        if j >= 0:
            x = leaves[j]
            s.in_bytes = _storage_bytes(x)
            s.in_key = (_storage_ptr(x), s.in_bytes)
            # Watch the storage, not the tensor object: the engine may hold a saved
            # tensor's bytes through another tensor (a detached alias, a view).
            try:
                self._inputs[pos] = weakref.ref(x.untyped_storage())
            except (RuntimeError, TypeError, NotImplementedError):
                self._inputs[pos] = None
        if k >= 0:
            leaves[k] = _Marker.apply(leaves[k], lambda p=pos: self.bwd_end(p))
            self._has_input_marker.add(pos)
            args, kwargs = tree_unflatten(leaves, spec)
        self.t[("fwd0", pos)] = self.clock.now()
        return args, kwargs

    def fwd_post(self, i: int, out: Any) -> Any:
        pos = self._active
        self._active, self.position = None, -1
        if pos is None:  # pragma: no cover - fwd_pre raised
            return out
        self.t[("fwd1", pos)] = self.clock.now()
        s = self.stats[pos]
        s.fwd_peak = max(s.fwd_peak, self._window())
        s.L = self._level()
        leaves, spec = tree_flatten(out)
        k = _first_grad_tensor(leaves)
        if k >= 0:
            s.out_bytes = _storage_bytes(leaves[k])
            self._note_returned(pos, leaves, k)
            leaves[k] = _Marker.apply(leaves[k], lambda p=pos: self.bwd_start(p))
            out = tree_unflatten(leaves, spec)
        elif not any(isinstance(v, torch.Tensor) and v.requires_grad for v in leaves):
            # Nothing it returns needs a gradient: backward never reaches it, and nothing it saved
            # outlives its forward (autograd recorded no graph, or one nothing refers to any more).
            s.no_backward, s.retains_input = True, False
            self._no_backward.add(pos)
            j = _first_grad_tensor(leaves, need_grad=False)
            s.out_bytes = _storage_bytes(leaves[j]) if j >= 0 else 0
        return out

    def _note_returned(self, pos: int, leaves: list, k: int) -> None:
        """Watch the storages of the tensors position ``pos`` returned besides its output ``leaves[k]``."""
        seen = {_storage_ptr(leaves[k])}
        for j, v in enumerate(leaves):
            if j == k or not isinstance(v, torch.Tensor) or _storage_ptr(v) in seen:
                continue
            seen.add(_storage_ptr(v))
            try:
                self._returned.append((pos, weakref.ref(v.untyped_storage()), _storage_bytes(v)))
            except (RuntimeError, TypeError, NotImplementedError):
                continue

    def _settle(self, before: int | None = None) -> None:
        """What the positions before ``before`` (all: at backward's start) returned and the model dropped
        was never held for backward (``BlockStats.dropped``). Read a block later, not at the next block's
        start: a model's loop variable holds a block's outputs until the next block returns."""
        later = []
        for pos, ref, nbytes in self._returned:
            if before is not None and pos >= before:
                later.append((pos, ref, nbytes))
            elif ref() is None:
                self.stats[pos].dropped += nbytes
        self._returned = later

    def _last_with_backward(self) -> int:
        """The last position that backward reaches (the head's window ends at its backward)."""
        return max((p for p in range(len(self.calls)) if p not in self._no_backward), default=-1)

    def fwd_abort(self) -> None:
        """The block's forward raised: no position is active any more."""
        self._active, self.position = None, -1

    def bwd_start(self, pos: int) -> None:
        self._settle()
        self.t[("bwd0", pos)] = self.clock.now()
        w = self._window()
        if pos == self._last_with_backward():
            self.windows["head"] = w
        else:
            self.stats[pos].bwd_peak = max(self.stats[pos].bwd_peak, w)  # gap after the next call's backward
        s = self.stats[pos]
        s.D = self._level()
        ref = self._inputs[pos]
        s.retains_input = ref is None or ref() is not None
        self._bwd_seen.add(pos)

    def bwd_end(self, pos: int) -> None:
        self.t[("bwd1", pos)] = self.clock.now()
        s = self.stats[pos]
        s.bwd_peak = max(s.bwd_peak, self._window())
        if self.meter is not None:
            self.args.after_blocks()

    def end(self) -> None:
        self.t[("step", 1)] = self.clock.now()
        self.windows["post"] = self._window()

    def times(self) -> tuple[list[float], list[float], float]:
        """Forward and backward seconds per position, and the step's. A position whose input needs no
        grad (the first block of an encoder fed raw features) has no backward-end marker: its backward
        ends with the step."""
        c = self.clock
        m = len(self.calls)
        end = self.t.get(("step", 1))
        fwd = [c.seconds(self.t.get(("fwd0", p)), self.t.get(("fwd1", p))) for p in range(m)]
        bwd = [c.seconds(self.t.get(("bwd0", p)), self.t.get(("bwd1", p), end)) for p in range(m)]
        return fwd, bwd, c.seconds(self.t.get(("step", 0)), end)

    def check(self) -> None:
        """Every candidate ran, and backward reached every call that returned a tensor needing a gradient
        (errors name the blocks); a call that returned none has no backward (``BlockStats.no_backward``)."""
        never = [self.names[i] for i in range(self.n) if i not in self.calls]
        if never:
            raise ValueError(
                f"offload.plan: candidate block(s) {never[:5]} never ran during the step (a container such as "
                "an nn.ModuleList, or a module the forward does not call). Pass blocks=[...] naming modules "
                "the step calls."
            )
        missing = sorted({self.names[self.calls[p]] for p in range(len(self.calls))
                          if p not in self._bwd_seen and p not in self._no_backward})
        if missing:
            raise ValueError(
                f"offload.plan: backward never reached candidate block(s) {missing[:5]}: their outputs do not "
                "flow into the loss through a floating-point tensor that requires grad. Pass blocks=[...] "
                "naming the modules that do."
            )


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def zero_grads_(model: nn.Module) -> None:
    """Zero existing gradients in place (memory stays allocated, as in a training loop)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def run_step(step: Callable[[], torch.Tensor]) -> None:
    """One training step as the planner runs it: the user's forward, then backward."""
    loss = step()
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise TypeError(
            "offload.plan: step() must run one forward and return the scalar loss (a tensor that "
            f"requires grad); it returned {type(loss).__name__}"
            f"{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}."
        )
    loss.backward()


def _one(inst: Installed, step: Callable, model: nn.Module, device: torch.device, meter: MemoryMeter | None,
         names: list[str]) -> Probe:
    probe = Probe(len(names), BoundaryClock(device), meter, names)
    inst.probe = probe
    try:
        zero_grads_(model)
        _sync(device)
        probe.begin()
        run_step(step)
        probe.end()
        _sync(device)
    finally:
        inst.probe = None
    probe.check()
    return probe


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def profile_decision(inst: Installed, decision: str | dict[str, str], step: Callable, model: nn.Module,
                     device: torch.device, *, warmup: int, timed: int) -> DecisionProfile:
    """Run warm-up, one tracked step and ``timed`` timed steps with every block under ``decision``
    (or under the given per-block decisions)."""
    names = list(inst.decisions)
    for k in names:
        inst.decisions[k] = decision if isinstance(decision, str) else decision[k]
    for _ in range(warmup):
        zero_grads_(model)
        run_step(step)
    prof = _tracked_step(inst, step, model, device, names, decision if isinstance(decision, str) else "mixed")
    _timed_steps(inst, step, model, device, names, prof, timed)
    return prof


def _tracked_step(inst: Installed, step: Callable, model: nn.Module, device: torch.device, names: list[str],
                  decision: str) -> DecisionProfile:
    """One step with memory tracked: the peaks of every window, and per call position the bytes
    saved and copied, from the engine's own records (seconds come from :func:`_timed_steps`)."""
    with tracked(inst, model, names, decision, MemoryMeter(device, [inst.engine.pool]), BoundaryClock(device)) as out:
        run_step(step)
    return out.profile


@dataclass
class Tracked:
    """What :func:`tracked` produced: the profile (set when the step is done) and its probe."""

    probe: Probe
    profile: DecisionProfile | None = None


@contextlib.contextmanager
def tracked(inst: Installed, model: nn.Module, names: list[str], decision: str, meter: Any,
            clock: Any) -> Iterator[Tracked]:
    """Watch the step run inside the ``with`` block: ``meter`` (``level()``, ``window()``, ``peak``,
    ``tracking(model)``) gives the levels and peaks of every window, ``clock`` the boundary times, and
    the engine's own records the bytes saved and copied per call position. A measured step
    (:func:`_tracked_step`) and a predicted one (``offload.planner.predicted``) share it."""
    engine = inst.engine
    saved: dict[int, int] = defaultdict(int)
    copied: dict[int, int] = defaultdict(int)
    copies: dict[int, int] = defaultdict(int)
    biggest: dict[int, int] = defaultdict(int)
    shared: dict[int, int] = defaultdict(int)
    copier: dict[int, int] = {}  # storage data pointer -> the position that copied it
    savers: dict[int, set[int]] = defaultdict(set)  # storage data pointer -> the positions that saved it
    sizes: dict[int, int] = defaultdict(int)
    probe = Probe(len(names), clock, meter, names)
    out = Tracked(probe)

    def on_pack(ev: Any) -> None:
        p = probe.position  # which call is packing
        if p < 0:
            return
        rec = ev.record
        if rec.reason in ("parameter", "buffer"):
            return
        saved[p] += rec.nbytes
        ptr = _storage_ptr(ev.tensor)
        savers[ptr].add(p)
        sizes[ptr] = max(sizes[ptr], rec.storage_nbytes or rec.nbytes)
        probe.args.on_pack(p, ptr, rec)
        if rec.reason == DUPLICATE_STORAGE and copier.get(ptr, p) != p:
            shared[p] += rec.nbytes  # an earlier block copied this storage
        if rec.copy_bytes:
            copier.setdefault(ptr, p)
            copied[p] += rec.copy_bytes
            copies[p] += 1
            biggest[p] = max(biggest[p], rec.copy_bytes)

    obs = engine.add_observer(on_pack)
    try:
        with meter.tracking(model):
            inst.probe = probe
            try:
                zero_grads_(model)
                probe.begin()
                yield out
                probe.end()
                probe.args.after_step()
            finally:
                inst.probe = None
    finally:
        obs.remove()
    probe.check()
    prof = DecisionProfile(decision=decision, blocks=probe.stats,
                           calls=list(probe.calls), base=probe.base, pre_peak=probe.windows.get("pre", 0),
                           head_peak=probe.windows.get("head", 0), post_peak=probe.windows.get("post", 0),
                           peak=meter.peak)
    _fill(prof, (saved, copied, copies, biggest, shared), probe.args, savers, sizes,
          [inst.decisions[names[i]] for i in probe.calls])
    out.profile = prof


def _fill(prof: DecisionProfile, per_position: tuple[dict[int, int], ...], args: ArgumentWatch,
          savers: dict[int, set[int]], sizes: dict[int, int], decisions: list[str]) -> None:
    """What the engine's records showed: per position the bytes saved and copied, the copies, the largest
    and the bytes shared with an earlier copy; the storages several positions saved or received."""
    saved, copied, copies, biggest, shared = per_position
    for p, s in enumerate(prof.blocks):
        s.saved_bytes, s.copy_bytes, s.copies, s.max_copy = saved[p], copied[p], copies[p], biggest[p]
        s.shared_bytes = shared[p]
    prof.shared_saves = shared_saves(prof.blocks, {q: ps for q, ps in savers.items() if q not in args.saved_ptrs},
                                     sizes)
    prof.outside, prof.held_elsewhere = args.profile(decisions)


def _timed_steps(inst: Installed, step: Callable, model: nn.Module, device: torch.device, names: list[str],
                 prof: DecisionProfile, timed: int) -> None:
    """Time ``timed`` steps (memory untracked) into ``prof``: per position the median forward and
    backward seconds, with every sample kept (the spread is in Plan.to_json()), and the step's."""
    fwds, bwds, steps = [], [], []
    for _ in range(timed):
        t = _one(inst, step, model, device, None, names)
        if t.calls != prof.calls:
            raise ValueError(
                "offload.plan: the candidate blocks ran in a different order (or a different number of times) "
                f"in two steps: {[names[i] for i in prof.calls]} then {[names[i] for i in t.calls]}. The planner "
                "needs a step that calls the same blocks the same way every time."
            )
        _sync(device)
        f, b, st = t.times()
        fwds.append(f)
        bwds.append(b)
        steps.append(st)
    for p, s in enumerate(prof.blocks):
        s.fwd_s_all = [f[p] for f in fwds]
        s.bwd_s_all = [b[p] for b in bwds]
        s.fwd_s, s.bwd_s = _median(s.fwd_s_all), _median(s.bwd_s_all)
    prof.step_s_all = steps
    prof.step_s = _median(steps)


def profile_step(inst: Installed, step: Callable, model: nn.Module, device: torch.device, *,
                 make_engine: Callable[[], Any], warmup: int = 1, timed: int = 3,
                 decisions: tuple[str, ...] = DECISIONS) -> dict[str, DecisionProfile]:
    """Profile every decision in ``decisions`` (all blocks set to it in turn).

    Each decision gets a fresh engine from ``make_engine``: the engine sizes
    its prefetch from the largest copy it has made, so one decision's copies
    must not change another's backward.
    """
    saved = dict(inst.decisions)
    out = {}
    try:
        for d in decisions:
            inst.engine = make_engine()
            out[d] = profile_decision(inst, d, step, model, device, warmup=warmup, timed=timed)
        return out
    finally:
        inst.decisions.update(saved)
