"""Storages whose life several blocks' decisions decide, from the profiles to the solver's state.

The cost model adds up per-block constants (``offload.planner.cost``); these storages break the sum:

* a tensor the blocks receive besides their input, made before them (a mask, position ids, a rotary
  table): after forward it lives until the backward of the earliest block holding it, and which blocks
  hold it depends on each one's decision (a kept block holds what it saved, an offloading one nothing, a
  recomputed one every tensor argument: a checkpoint keeps keyword arguments in its closure, where no
  saved-tensor hook sees them);
* a block's input that the model's forward also holds (an embedding's output kept in a local), and what
  a block returns besides its output (attention weights, held by the model's loop variable through the
  next block's forward): in those later forwards whether the block keeps them for backward or not.

:class:`ArgumentWatch` names each argument storage the same way in every decision's profile (the first
position that received it and the argument's index) and records who held it; :func:`masks` turns the
profiles into one bit per storage, which options hold it (``Option.holds``) and which windows their
profile already counted it in (``covered``, ``fcovered``); :func:`extra` is the bytes a plan adds.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..ledger import KEPT, OFFLOADED
from ..policy import DUPLICATE_STORAGE
from .install import RECOMPUTE

if TYPE_CHECKING:
    from .profile import BlockStats, StepProfile

__all__ = ["ArgumentWatch", "extra", "masks", "shared_saves"]

Key = tuple[int, int]
"""(the first position that received a storage, the argument's index in its flattened ``(args, kwargs)``)."""


class ArgumentWatch:
    """The argument storages of one tracked step: named, watched (weakly) and who held them."""

    def __init__(self) -> None:
        self._args: dict[int, tuple[Key, Any]] = {}  # storage key -> (Key, weak storage) of the live one there
        self._sizes: dict[Key, int] = {}  # (kept for a storage that died and whose address was used again)
        self.input_keys: set[Key] = set()
        """Storages some position received as its input (charged as inputs, not here)."""
        self.arguments: list[set[Key]] = []
        """Per position: the Keys of the tensor arguments it received besides its input."""
        self.packed: dict[tuple[int, Key], str] = {}
        """(position, Key) -> the engine's decision on a save of it there (kept wins)."""
        self.saved_ptrs: set[int] = set()
        """Storage keys of the saves of arguments (``DecisionProfile.shared_saves`` leaves them out)."""
        self.alive_after_blocks: set[Key] | None = None
        self.alive_at_end: set[Key] = set()

    def begin(self) -> None:
        """A position began."""
        self.arguments.append(set())

    def _key(self, ptr: int) -> Key | None:
        """The Key of the live argument storage at ``ptr`` (None: none, or it died and the address is free)."""
        got = self._args.get(ptr)
        return None if got is None or (got[1] is not None and got[1]() is None) else got[0]

    def note(self, pos: int, idx: int, v: torch.Tensor, ptr: int, nbytes: int, is_input: bool) -> None:
        """Argument ``idx`` of position ``pos``, named by where its storage was first received."""
        key = self._key(ptr)
        if key is None:  # new, or an address used again
            try:
                ref = weakref.ref(v.untyped_storage())
            except (RuntimeError, TypeError, NotImplementedError):
                ref = None
            key = (pos, idx)
            self._args[ptr], self._sizes[key] = (key, ref), nbytes
        if is_input:
            self.input_keys.add(key)
        else:
            self.arguments[pos].add(key)

    def on_pack(self, pos: int, ptr: int, rec: Any) -> None:
        """The engine decided on a save at ``pos`` of the storage at ``ptr``."""
        key = self._key(ptr)
        if key is None:
            return
        self.saved_ptrs.add(ptr)
        if self.packed.get((pos, key)) != KEPT:  # kept once: on the device until this position's backward
            # (a save sharing an earlier save's host copy is recorded as kept, and holds the host copy)
            self.packed[(pos, key)] = OFFLOADED if rec.reason == DUPLICATE_STORAGE else rec.decision

    def alive(self) -> set[Key]:
        return {key for key, ref in self._args.values() if ref is None or ref() is not None}

    def after_blocks(self) -> None:
        """A position's backward ended (the last call is the earliest position's)."""
        if self._args:
            self.alive_after_blocks = self.alive()

    def after_step(self) -> None:
        """The step's graph is gone: the argument storages still alive are the model's."""
        self.alive_at_end = self.alive()
        if self.alive_after_blocks is None:  # no position had a backward-end marker
            self.alive_after_blocks = self.alive_at_end

    def profile(self, decisions: list[str]) -> tuple[list[tuple[Key, int, list[int]]], list[Key]]:
        """``DecisionProfile.outside`` and ``held_elsewhere``, given each position's decision. A position
        holds an argument on the device to its backward when the engine kept a save of it, or when it is
        recomputed and the argument was not offloaded (positional arguments go through the saved-tensor
        hooks, which may offload them; keyword ones stay in the checkpoint's closure)."""
        held: dict[Key, set[int]] = {}
        for p, keys in enumerate(self.arguments):
            for key in keys:
                if key in self.input_keys:
                    continue
                got = self.packed.get((p, key))
                holders = held.setdefault(key, set())
                if got == KEPT or (decisions[p] in RECOMPUTE and got != OFFLOADED):
                    holders.add(p)
        elsewhere = sorted(self.alive_at_end | {k for k in (self.alive_after_blocks or ()) if not held.get(k)})
        return [(key, self._sizes[key], sorted(ps)) for key, ps in held.items()], elsewhere


def extra(sizes: Sequence[int], bits: int) -> int:
    """Bytes of the storages (``CostModel.outside``) whose bits are set: what a plan adds to a window whose
    profile did not count them."""
    total, k = 0, 0
    while bits:
        if bits & 1:
            total += sizes[k]
        bits >>= 1
        k += 1
    return total


def masks(profile: StepProfile, elsewhere: list[bool]
          ) -> tuple[list[int], dict[str, list[tuple[int, int, int, int]]]]:
    """``CostModel.outside`` and, per decision and position, ``(holds, covered, fcovered, hcovered)`` of
    ``Option``.

    An argument storage has its bit in ``holds`` where the position holds it, and in ``covered`` where its
    profile had it held at this position's backward (by it or an earlier position), unless something else
    holds it (``held_elsewhere`` in some profile: then it is in every measured window, and left out). An
    input the forward holds, or what a position returned besides its output, has its bit in ``holds`` where
    the position does *not* keep it, in ``covered`` always (it is no backward window's), and in
    ``fcovered`` of the later forwards whose profile charged it to the position that kept it (an input
    also in ``hcovered``: the head's window begins inside the model's forward, a final norm)."""
    sizes: dict[Key, int] = {}
    holders: dict[str, dict[Key, set[int]]] = {}
    for d, prof in profile.by_decision.items():
        holders[d] = {}
        for key, nbytes, held in prof.outside:
            sizes[key] = max(sizes.get(key, 0), nbytes)
            holders[d][key] = set(held)
    gone = {key for prof in profile.by_decision.values() for key in prof.held_elsewhere}
    keys = sorted(k for k, n in sizes.items() if n and k not in gone)
    frame, holder = _frame(profile, elsewhere)
    entries = sorted(frame)
    bit = {e: len(keys) + b for b, e in enumerate(entries)}
    inputs = sum(1 << bit[e] for e in entries if e[0] == "input")
    out: dict[str, list[tuple[int, int, int, int]]] = {}
    for d in profile.by_decision:
        row = []
        covered = sum(1 << b for b in bit.values())
        for i in range(len(profile.by_decision[d].blocks)):
            holds = sum(1 << b for b, key in enumerate(keys) if i in holders[d].get(key, ()))
            covered |= holds
            holds |= sum(1 << bit[e] for e in entries if e[1] == i and not holder[e[0]](d, i))
            fcovered = sum(1 << bit[e] for e in entries if e[1] < i and i in frame[e][1] and holder[e[0]](d, e[1]))
            hcovered = fcovered & inputs  # the head's window starts in the model's forward, which holds them
            row.append((holds, covered, fcovered, hcovered))
        out[d] = row
    return [sizes[k] for k in keys] + [frame[e][0] for e in entries], out


def _frame(profile: StepProfile, elsewhere: list[bool]) -> tuple[dict[tuple[str, int], tuple[int, set[int]]], dict]:
    """The storages later forwards hold whatever a position decides: ``(kind, position) -> (bytes, the
    positions whose forward holds them)``, and per kind whether a profile's position kept them."""
    keep = profile.by_decision["keep"].blocks

    def kept(d: str, j: int) -> bool:  # position j holds its input for backward in profile d (cost._charges)
        return profile.by_decision[d].blocks[j].retains_input and not elsewhere[j]

    def returned(d: str, j: int) -> bool:  # position j holds what it returned besides its output
        return not profile.by_decision[d].blocks[j].dropped

    n = len(keep)
    frame: dict[tuple[str, int], tuple[int, set[int]]] = {}
    for d, prof in profile.by_decision.items():
        for i, s in enumerate(prof.blocks):
            for j in s.inputs_alive:  # alive when i began, in a profile where j did not keep it
                if not kept(d, j) and not elsewhere[j] and keep[j].in_bytes:
                    frame.setdefault(("input", j), (keep[j].in_bytes, set()))[1].add(i)
            if s.dropped and i + 1 < n:
                got = frame.get(("returned", i), (0, {i + 1}))
                frame[("returned", i)] = (max(got[0], s.dropped), got[1])
    return frame, {"input": kept, "returned": returned}


def shared_saves(blocks: list[BlockStats], savers: dict[int, set[int]], sizes: dict[int, int]
                 ) -> list[tuple[int, list[int]]]:
    """``DecisionProfile.shared_saves``: the storages several positions saved that are no position's
    input, as (bytes, positions)."""
    inputs = {s.in_key[0] for s in blocks if s.in_key is not None}
    return [(sizes[q], sorted(ps)) for q, ps in savers.items() if len(ps) > 1 and q not in inputs]
