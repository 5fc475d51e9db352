"""CPU cost of the saved-tensor hooks, per pack and per unpack, against peers.

On a GPU the pack and unpack hooks run on the thread that launches kernels,
so what they cost on the CPU is step time. This bench runs one chain of small
layers (each ``sin`` then ``* w``: two activations and one parameter saved per
layer, ~1,000 saves a step) under each variant below and reports the hooks'
cost as the difference to the same step with no hooks, divided by the number
of packs (forward) or unpacks (backward):

  none            no saved-tensor hooks (the baseline every delta is taken from)
  identity        ``saved_tensors_hooks(lambda t: t, lambda t: t)``
  torchtune_keep  a re-statement of what torchtune's offloading pack does for a
                  tensor it keeps: count an id, compute the byte size, test
                  device / size / Parameter, store ``(tensor, False)`` in a dict
                  under the id; unpack looks the id up and pops it
  torchtune_real  torchtune's own ``OffloadActivations`` (its installed
                  ``training/_activation_offloading.py``, 0.6.x), keeping every
                  tensor (``min_offload_size=2**40``, no streams, no pinning):
                  torchtune's real keep path, measured when torchtune is
                  installed (``pip install --no-deps torchtune==0.6.1``; the file
                  is loaded alone, with stand-ins for the three imports that
                  would pull the rest of torchtune and torchao's old NF4 path)
  trl_keep        TRL's own ``OffloadActivations`` keeping every tensor
                  (``min_offload_size=2**40``, no streams, no pinning), when TRL
                  is installed (it is in the ``test`` extra)
  save_on_cpu     ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: on a CPU
                  tensor it allocates an (unpinnable) host tensor and copies
  ours_keep       ``OffloadActivations(device="cpu", min_offload_size=2**40,
                  native_hooks=False)``: every tensor classified, recorded and
                  kept by the Python hook
  ours_keep_native  ``ours_keep`` with ``native_hooks=True``: the keep path in
                  C++ (offload/_native/pack.cpp), same decisions and records;
                  measured where the extension builds (a C++ compiler, ninja;
                  the default, ``native_hooks="auto"``, runs it wherever it builds)
  ours_keep_excluded  the whole chain excluded (``engine.exclude(model)``, what a
                  plan's ``keep`` or a head exclusion does to a block), with
                  ``min_offload_size=0`` and the Python hook: every save kept as
                  ``excluded_region``
  ours_keep_excluded_native  ``ours_keep_excluded`` with ``native_hooks=True``
  ours_offload    ``OffloadActivations(device="cpu", min_offload_size=0,
                  native_hooks=False)``: every activation copied into the host
                  pool and back, through the Python hook
  ours_offload_native  ``ours_offload`` with ``native_hooks=True`` (offload
                  candidates are handed from the C++ hook to the Python one)
  modules_only    just the engine's module tracking (``track_modules``: a
                  wrapped ``nn.Module.__call__``), no saved-tensor hooks: cost
                  per module call, not per pack
  module_dispatch module tracking with torch's global forward pre/post hooks
                  that only push and pop the module: what any global hook
                  costs per module call (``_call_impl``'s slow path), the way
                  ``track_modules`` worked before it wrapped ``__call__``
  safe_keep_floor the least a keep path must do to keep the engine's
                  guarantees: hold a tensor with autograd history through a
                  detached alias (Rule 10: no cycle through a saved output's
                  grad_fn; a leaf as it is) and the version to check at unpack
                  (Rule 6); no classification, no record (a floor for ``ours_keep``)
  engine_floor    the engine itself (module tracking on, its bound-method pack
                  hook, per-step handle bookkeeping) with a pack that does only
                  what ``safe_keep_floor`` does: the fixed cost every decision
                  of ours pays before classifying or recording anything
  facts_floor     ``engine_floor`` that also reads every fact of a saved
                  tensor the Python keep path decides and records from (its
                  storage, address and bytes, shape, dtype, device, leaf,
                  base, offset, contiguity, the thread's state), and decides
                  and records nothing: the least the Python hook can cost

Two measures, in one run:
  * CPU time on one thread (``time.process_time``, ``torch.set_num_threads(1)``),
    variants interleaved round by round, paired against ``none`` in the same
    round; median and quartiles over ``--rounds``.
  * Instruction counts (``--instructions``, on by default when valgrind and a
    C compiler are found): the same steps re-run in a child process under
    callgrind, after the same ``--warmup`` steps per variant (the engine's
    pool replays a step from the third on), collection toggled on around
    each measured forward/backward by a two-function C helper compiled at
    run time, with ``PYTHONHASHSEED=0`` and the engine's RAM gauge re-reading
    system RAM by bytes granted only (``_freeze_ram_gauge``: its timed re-reads
    follow wall time, which callgrind stretches ~50x). Deterministic (identical
    runs agree within ~0.1 %), so it is the measure to compare across machines
    and commits (files before ``warmup_steps`` was recorded used one warm-up
    step; files before ``gauge_frozen`` was recorded let the gauge re-read by
    time, which made identical runs differ by up to 5 %). For ``identity`` and the
    C++ hook's keep and offload variants, ``breakdown_per_pack_ir`` splits the
    forward by function (``callgrind_annotate``, inclusive, per pack): torch's
    own lookup of the Python hooks at every save (``torch_get_default_hooks``),
    the C++ hook (``native_pack``) and its calls into Python
    (``native_pack_python``: the offload step, ``engine._offload``).

Plus the cycle collector's share (``--gc-steps``): each keep variant runs that many
steps in a row with no forced collection (the CPU-time rounds collect before each
round, which hides it), counting the collections each generation ran and the time
they took, per pack: what long-lived objects the hooks leave behind (records, handles)
cost in full collections, whose price grows with everything else the process holds.

Plus an emulated side-stream measurement: the engine's stream backend on fake
events that complete in order, K copies behind the newest, giving the pack
cost as a function of copies in flight (it must not grow with K).

Runbook (from the repo root):
    python -m bench.hook_cost                      # writes ./bench_runs/<time>_hook_cost_cpu/hook_cost.json
    python -m bench.hook_cost --baseline bench/results/cpu/hook_cost.json --out bench/results/cpu/hook_cost.json
    python -m bench.hook_cost --no-instructions    # CPU time only (seconds)
    python -m bench.hook_cost --baseline old.json  # embed an earlier run as "before"
    python -m bench.hook_cost --layers 8 --rounds 3 --no-instructions --out /tmp/h.json   # tiny
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.env import default_run_dir
from offload import OffloadActivations, OffloadError
from offload import modules as _modules
from offload._format import render_table
from offload.modules import track_modules
from offload._packing import _PLAIN_ITEMSIZE, _plain_itemsize



def default_out() -> Path:
    """``./bench_runs/<UTC time>_hook_cost_cpu/hook_cost.json``: a plain run never modifies tracked files."""
    return default_run_dir("hook_cost", "cpu") / "hook_cost.json"


VARIANTS = ("none", "identity", "torchtune_keep", "torchtune_real", "trl_keep", "save_on_cpu", "ours_keep",
            "ours_keep_native", "ours_keep_excluded", "ours_keep_excluded_native", "ours_offload",
            "ours_offload_native", "modules_only", "module_dispatch", "safe_keep_floor", "engine_floor",
            "facts_floor")
NATIVE = ("ours_keep_native", "ours_keep_excluded_native", "ours_offload_native")
"""The variants with ``native_hooks=True``."""
OPTIONAL = ("torchtune_real", "trl_keep", *NATIVE)
"""Variants measured only where they can run: peers whose package is installed, the native hook where it
builds (the JSON says why one is missing)."""
RATIOS = {
    "ours_offload/save_on_cpu": ("ours_offload", "save_on_cpu"),
    "ours_keep/torchtune_keep": ("ours_keep", "torchtune_keep"),
    "ours_keep/torchtune_real": ("ours_keep", "torchtune_real"),
    "ours_keep_native/torchtune_real": ("ours_keep_native", "torchtune_real"),
    "ours_keep_native/torchtune_keep": ("ours_keep_native", "torchtune_keep"),
    "ours_keep_excluded/ours_keep": ("ours_keep_excluded", "ours_keep"),
    "ours_keep_excluded_native/ours_keep_native": ("ours_keep_excluded_native", "ours_keep_native"),
    "ours_offload_native/save_on_cpu": ("ours_offload_native", "save_on_cpu"),
    "ours_keep/trl_keep": ("ours_keep", "trl_keep"),
    "ours_keep/identity": ("ours_keep", "identity"),
    "safe_keep_floor/torchtune_keep": ("safe_keep_floor", "torchtune_keep"),
    "engine_floor/torchtune_keep": ("engine_floor", "torchtune_keep"),
    "ours_keep/facts_floor": ("ours_keep", "facts_floor"),
}
"""Ratio name -> (numerator, denominator) of per-pack costs; the goal is <= 2 for the first two."""
_PER_MODULE_CALL = ("modules_only", "module_dispatch")
"""Variants without saved-tensor hooks: their cost is per module call, not per pack."""
_TRACKING = ("ours_keep", "ours_keep_native", "ours_keep_excluded", "ours_keep_excluded_native", "ours_offload",
             "ours_offload_native", "modules_only", "engine_floor", "facts_floor")
"""Variants that run with ``nn.Module.__call__`` wrapped (offload.modules); the others run without it."""


class _Owner:
    """Keeps the module-tracking wrapper installed between ``modules_only`` steps, as an engine does."""


_OWNER = _Owner()


def _prepare(name: str) -> None:
    """Before a measured step, outside its window: the wrapper installed for our variants, removed for peers.

    A live engine keeps ``nn.Module.__call__`` wrapped between steps (NOTE [ Wrapper
    lifetime ] in offload/modules.py), so our steady state has it installed before
    the forward starts; a process without offload has no wrapper at all.
    """
    if name in _TRACKING:
        with track_modules(owner=_OWNER):
            pass
    else:
        _modules.uninstall()


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * self.w  # saves x, sin(x) and w


class _Chain(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _torchtune_keep_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """The keep path of torchtune's offloading hooks, re-stated (see the module docstring)."""
    tracker: dict[int, tuple[torch.Tensor, bool]] = {}
    next_id = [0]
    min_bytes = 1024

    def pack(t: torch.Tensor) -> int:
        nbytes = t.numel() * t.element_size()
        next_id[0] += 1
        tid = next_id[0]
        if t.is_cuda and nbytes >= min_bytes and not isinstance(t, nn.Parameter):
            raise AssertionError("the bench runs on CPU: the keep path only")
        tracker[tid] = (t, False)
        return tid

    def unpack(tid: int) -> torch.Tensor:
        t, _modified = tracker.pop(tid)
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@contextlib.contextmanager
def _stand_ins(modules: dict[str, Any], attrs: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """``sys.modules`` entries and attributes replaced for the block, all restored after it.

    Only the named entries are restored: unlike ``unittest.mock.patch.dict(sys.modules)``, which
    would also drop every module first imported inside the block (torchao's, here) and so make
    the next import load a second copy of it.
    """
    saved_mods = {k: sys.modules.get(k) for k in modules}
    saved_attrs = [(obj, name, getattr(obj, name)) for obj, name, _ in attrs]
    sys.modules.update(modules)
    for obj, name, value in attrs:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved_attrs:
            setattr(obj, name, value)
        for k, v in saved_mods.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _torchtune_real_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """torchtune's own OffloadActivations keeping everything (see ``torchtune_real`` in the module docstring).

    Raises ImportError (with how to install it) when torchtune is not installed.
    """
    import importlib.util
    import logging
    import types

    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torchtune is not installed (pip install --no-deps torchtune==0.6.1)")
    path = Path(next(iter(spec.submodule_search_locations)), "training", "_activation_offloading.py")
    if not path.exists():
        raise ImportError(f"torchtune has no {path.relative_to(path.parents[1])} (tested with torchtune 0.6.1)")
    # Stand-ins for what the file imports but its pack/unpack never use on a kept tensor:
    # torchtune.modules / torchtune.utils would import the rest of torchtune (omegaconf, ...),
    # and NF4Tensor moved out of torchao.dtypes in torchao 0.18.
    tt_modules = types.ModuleType("torchtune.modules")
    tt_modules.TiedLinear = type("TiedLinear", (), {})  # type: ignore[attr-defined]
    tt_utils = types.ModuleType("torchtune.utils")
    tt_utils.get_logger = lambda *a, **k: logging.getLogger("torchtune")  # type: ignore[attr-defined]
    nf4 = types.ModuleType("torchao.dtypes.nf4tensor")
    nf4.NF4Tensor = type("NF4Tensor", (torch.Tensor,), {})  # type: ignore[attr-defined]
    stand_ins: dict[str, Any] = {"torchtune": types.ModuleType("torchtune"), "torchtune.modules": tt_modules,
                                 "torchtune.utils": tt_utils, "torchao.dtypes.nf4tensor": nf4}
    if importlib.util.find_spec("torchao") is None:
        stand_ins["torchao"] = types.ModuleType("torchao")
    # Its __init__ asks for the CUDA default stream even without streams; a kept tensor never uses it.
    with _stand_ins(stand_ins, [(torch.cuda, "default_stream", lambda *a, **k: None)]):
        mod_spec = importlib.util.spec_from_file_location("_torchtune_activation_offloading", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        return mod.OffloadActivations(use_pin_memory=False, use_streams=False, min_offload_size=1 << 40)


def _trl_keep_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """TRL's own OffloadActivations keeping everything; ImportError when TRL is not installed."""
    from trl.models.activation_offloading import OffloadActivations as TrlOffload

    # TRL reads the current accelerator's type at construction; on a CPU-only machine there is none,
    # and "cpu" makes it classify our CPU tensors by size (all of them too small: kept).
    with _stand_ins({}, [(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))]):
        return TrlOffload(use_pin_memory=False, use_streams=False, min_offload_size=1 << 40)


def _ours(model: nn.Module | None) -> dict[str, Callable[[], OffloadActivations]]:
    """Our variants' engines (``_native`` ones raise OffloadError, saying why, where it cannot be built);
    the excluded ones exclude ``model`` (skipped without it)."""

    def excluded(native: bool) -> OffloadActivations:
        if model is None:
            raise ImportError("needs the model")
        engine = OffloadActivations(device="cpu", min_offload_size=0, native_hooks=native)
        engine.exclude(model)
        return engine

    return {
        "ours_keep": lambda: OffloadActivations(device="cpu", min_offload_size=1 << 40, native_hooks=False),
        "ours_keep_native": lambda: OffloadActivations(device="cpu", min_offload_size=1 << 40, native_hooks=True),
        "ours_keep_excluded": lambda: excluded(False),
        "ours_keep_excluded_native": lambda: excluded(True),
        "ours_offload": lambda: OffloadActivations(device="cpu", min_offload_size=0, native_hooks=False),
        "ours_offload_native": lambda: OffloadActivations(device="cpu", min_offload_size=0, native_hooks=True),
    }


def _optional_contexts(model: nn.Module | None = None
                       ) -> tuple[dict[str, Callable[[], contextlib.AbstractContextManager]], dict[str, str]]:
    """The installed optional peers' (and where it builds, our C++ hook's) context factories, and why
    each missing one is missing."""
    ctxs: dict[str, Callable[[], contextlib.AbstractContextManager]] = {}
    missing: dict[str, str] = {}
    ours = _ours(model)
    for name, make in (("torchtune_real", _torchtune_real_hooks), ("trl_keep", _trl_keep_hooks),
                       *((n, ours[n]) for n in NATIVE)):
        try:
            hooks = make()
        except (ImportError, OffloadError) as e:  # OffloadError: native_hooks=True cannot build here
            missing[name] = str(e)
            continue
        ctxs[name] = (lambda h: lambda: h)(hooks)
    return ctxs, missing


_dispatch_stack: list[nn.Module] = []


def _push(module: nn.Module, args: Any) -> None:
    _dispatch_stack.append(module)


def _pop(module: nn.Module, args: Any, output: Any) -> None:
    _dispatch_stack.pop()


@contextlib.contextmanager
def _module_dispatch() -> Iterator[None]:
    """Global forward hooks that only push and pop: torch's module-hook dispatch, nearly alone."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    pre, post = register_module_forward_pre_hook(_push), register_module_forward_hook(_pop)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
        _dispatch_stack.clear()


def _safe_keep_floor_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """Keep with the engine's two guarantees only: a detached alias (Rule 10) and a version check (Rule 6)."""

    def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        return (t if t.is_leaf else t.detach(), t._version)

    def unpack(h: tuple[torch.Tensor, int]) -> torch.Tensor:
        t, version = h
        if t._version != version:
            raise RuntimeError("modified by an inplace operation")
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class _FloorEngine(OffloadActivations):
    """``engine_floor``: the engine with a pack hook that keeps everything and records nothing."""

    def _pack(self, t: torch.Tensor) -> Any:
        return (t if t.is_leaf else t.detach(), t._version, self._open_step())  # Rules 10 and 6


class _FactsFloorEngine(OffloadActivations):
    """``facts_floor``: ``engine_floor``'s pack after reading what ``offload._packing._Packing._pack`` reads of
    a plain tensor, the same way (each fact once, through the same calls); nothing decided or recorded."""

    def _pack(self, t: torch.Tensor) -> Any:  # (one statement a fact: no tuple built to hold them)
        st = t.untyped_storage()
        st.data_ptr()
        shape = t.shape
        dtype = t.dtype
        itemsize = _PLAIN_ITEMSIZE.get(dtype) or _plain_itemsize(t)
        try:
            self._tls.state
        except AttributeError:
            self._thread()
        device, leaf = t.device, t.is_leaf
        device == self.device  # classify's facts
        shape.numel() * itemsize
        t._base
        t.storage_offset()  # the span's
        t.is_contiguous()
        len(st)  # the record's storage bytes
        return (t if leaf else t.detach(), t._version, self._open_step())


def _contexts(model: nn.Module) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """Variant name -> factory of the context one forward of ``model`` runs in (one object reused across
    steps)."""
    identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    tt = _torchtune_keep_hooks()
    soc = torch.autograd.graph.save_on_cpu(pin_memory=True)
    ours = _ours(model)
    keep, keep_excluded, off = ours["ours_keep"](), ours["ours_keep_excluded"](), ours["ours_offload"]()
    floor = _safe_keep_floor_hooks()
    engine_floor = _FloorEngine(device="cpu")  # (its own _pack: "auto" never pushes the C++ hook over it)
    facts_floor = _FactsFloorEngine(device="cpu")
    return {
        "none": contextlib.nullcontext,
        "identity": lambda: identity,
        "torchtune_keep": lambda: tt,
        "save_on_cpu": lambda: soc,
        "ours_keep": lambda: keep,
        "ours_keep_excluded": lambda: keep_excluded,
        "ours_offload": lambda: off,
        "modules_only": lambda: track_modules(owner=_OWNER),
        "module_dispatch": _module_dispatch,
        "safe_keep_floor": lambda: floor,
        "engine_floor": lambda: engine_floor,
        "facts_floor": lambda: facts_floor,
        **_optional_contexts(model)[0],
    }


def _count_saves(model: nn.Module, x: torch.Tensor) -> int:
    n = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    x.grad = None
    return n[0]


def _setup(layers: int, width: int) -> tuple[nn.Module, torch.Tensor, int]:
    torch.manual_seed(0)
    model = _Chain(layers, width)
    x = torch.randn(width).requires_grad_()
    return model, x, _count_saves(model, x)


def _step(model: nn.Module, x: torch.Tensor, ctx: contextlib.AbstractContextManager,
          clock: Callable[[str], None]) -> None:
    """One forward inside ``ctx`` and one backward outside it; ``clock(phase)`` brackets each."""
    clock("fwd")
    with ctx:
        out = model(x)
    clock("fwd")
    loss = out.sum()
    clock("bwd")
    loss.backward()
    clock("bwd")
    model.zero_grad(set_to_none=True)
    x.grad = None


# -- CPU time ------------------------------------------------------------------------------


def _quartiles(xs: list[float]) -> dict[str, float]:
    if len(xs) < 2:
        v = xs[0] if xs else float("nan")
        return {"median": v, "p25": v, "p75": v}
    q = statistics.quantiles(xs, n=4)
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2]}


def measure_cpu_time(layers: int, width: int, rounds: int, warmup: int,
                     variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Per-pack / per-unpack (per module call for modules_only) CPU time in ns, paired against none."""
    model, x, saves = _setup(layers, width)
    ctxs = _contexts(model)
    names = [v for v in variants if v in ctxs]
    samples: dict[str, dict[str, list[float]]] = {v: {"fwd": [], "bwd": []} for v in names}
    for rnd in range(warmup + rounds):
        gc.collect()
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            marks: dict[str, float] = {}
            _prepare(name)

            def clock(phase: str) -> None:
                now = time.process_time()
                marks[phase] = now - marks[phase] if phase in marks else now

            _step(model, x, ctxs[name](), clock)
            if rnd >= warmup:
                for phase in ("fwd", "bwd"):
                    samples[name][phase].append(marks[phase])
    out: dict[str, Any] = {"saves_per_step": saves, "module_calls_per_step": layers + 1, "variants": {}}
    for name in names:
        base = samples["none"]
        per = saves if name not in _PER_MODULE_CALL else layers + 1
        row = {"fwd_step_ms": _quartiles([s * 1e3 for s in samples[name]["fwd"]]),
               "bwd_step_ms": _quartiles([s * 1e3 for s in samples[name]["bwd"]])}
        for phase, key in (("fwd", "per_pack_ns"), ("bwd", "per_unpack_ns")):
            deltas = [(a - b) * 1e9 / per for a, b in zip(samples[name][phase], base[phase])]
            row[key] = _quartiles(deltas)
        if name in _PER_MODULE_CALL:
            row["per_module_call_ns"] = row.pop("per_pack_ns")
            row.pop("per_unpack_ns")
        elif name in _TRACKING and "modules_only" in samples:
            # The engine turns on module tracking: its cost is per module call, not per pack.
            row["per_pack_net_of_module_hooks_ns"] = _quartiles(
                [(a - b) * 1e9 / saves for a, b in zip(samples[name]["fwd"], samples["modules_only"]["fwd"])])
        out["variants"][name] = row
    out["ratios_per_pack"] = _ratios({n: r.get("per_pack_ns", {}).get("median") for n, r in out["variants"].items()})
    out["ratios_per_pack_net_of_module_hooks"] = _ratios(
        {n: r.get("per_pack_net_of_module_hooks_ns", r.get("per_pack_ns", {})).get("median")
         for n, r in out["variants"].items()})
    return out


def _ratios(per_pack: dict[str, float | None]) -> dict[str, float | None]:
    res = {}
    for name, (a, b) in RATIOS.items():
        va, vb = per_pack.get(a), per_pack.get(b)
        res[name] = round(va / vb, 2) if va is not None and vb else None
    return res


# -- instruction counts (callgrind) ----------------------------------------------------------

_CG_SRC = r"""
#include <valgrind/callgrind.h>
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_dump(const char *what) { CALLGRIND_DUMP_STATS_AT(what); }
"""


def _callgrind_available() -> str | None:
    """Why instruction counts cannot be taken here, or None when they can."""
    if shutil.which("valgrind") is None:
        return "valgrind not found (apt-get install valgrind)"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler for the callgrind client-request helper"
    if not any(Path(p, "valgrind", "callgrind.h").exists() for p in ("/usr/include", "/usr/local/include")):
        return "valgrind/callgrind.h not found"
    return None


def _build_helper(tmp: Path) -> Path:
    src, lib = tmp / "cg.c", tmp / "libcg.so"
    src.write_text(_CG_SRC)
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    return lib


def _freeze_ram_gauge(ctx: Any) -> None:
    """Make an engine's RAM gauge (``policy.RamCeiling``) re-read /proc only by bytes granted, not by time.

    The gauge re-reads system RAM at most every ``max_age_s`` (50 ms) of wall time; a read
    costs ~0.1 M instructions. Under callgrind a step runs ~50x slower, so the timed reads
    come ~50x as often as in a real run and their number follows the machine's load: they
    made identical runs differ by up to 5 %. After the warm-up (which took the first
    reading) the gauge keeps its reading until ``slack_bytes`` are granted, as it does in a
    real run of steps this short. Finds the gauge on ``ctx.tiers`` or, for an engine from
    before the host tiers (a ``--baseline`` run of an older tree), on ``ctx``.
    """
    for owner in (getattr(ctx, "tiers", None), ctx):
        gauge = getattr(owner, "_ram_gauge", None)
        if gauge is not None:
            gauge.max_age_s = float("inf")
            return


def _callgrind_child(lib: Path, layers: int, width: int, steps: int, variants: tuple[str, ...],
                     warmup: int = 3) -> None:
    """Run under callgrind: collect only inside each measured forward / backward, dump per phase."""
    cg = ctypes.CDLL(str(lib))
    cg.cg_dump.argtypes = [ctypes.c_char_p]
    model, x, _ = _setup(layers, width)
    ctxs = _contexts(model)
    for name in variants:
        if name not in ctxs:  # an optional peer that is not installed
            continue
        ctx = ctxs[name]
        _prepare(name)
        for _ in range(warmup):  # as many as the CPU-time rounds: the pool's steady state (replay)
            _step(model, x, ctx(), lambda phase: None)  # starts at the third step
        _freeze_ram_gauge(ctx())
        gc.collect()
        state = {"fwd": False, "bwd": False}

        def clock(phase: str) -> None:
            cg.cg_toggle()
            state[phase] = not state[phase]
            if not state[phase]:
                cg.cg_dump(f"{name}|{phase}".encode())

        for _ in range(steps):
            _step(model, x, ctx(), clock)


_BREAKDOWN_VARIANTS = ("identity", "ours_keep_native", "ours_offload_native")
"""Variants whose forward is broken down by function (``breakdown_per_pack_ir``)."""
_BREAKDOWN = {
    "torch_get_default_hooks": "torch::autograd::SavedVariable::get_default_hooks()",
    "native_pack": "(anonymous namespace)::pack_impl(",
}
"""Functions whose inclusive instructions are reported per pack: torch's per-save lookup of the Python
hooks (a GIL acquire, an incref and a decref of each hook), and the C++ pack hook (offload/_native)."""
_PYTHON_FROM_NATIVE = "PyObject_VectorcallMethod"
"""What ``native_pack`` calls into Python through (``engine._offload``, an offload candidate's copy)."""


_ANNOTATE_LINE = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+([*>])\s+(.*)$")
"""A ``callgrind_annotate --tree=calling`` line: inclusive Ir, "(pct%)", "*" (the function) or ">" (a callee)."""


def parse_annotate(text: str) -> dict[str, int]:
    """Inclusive instructions of each ``_BREAKDOWN`` function, and of ``native_pack``'s calls into Python
    (``native_pack_python``), from ``callgrind_annotate --inclusive=yes --tree=calling`` output."""
    out = {k: 0 for k in (*_BREAKDOWN, "native_pack_python")}
    block, python = None, 0  # the function whose callee lines ("  >") follow; native_pack's calls into Python
    for line in text.splitlines():
        m = _ANNOTATE_LINE.match(line)
        if m is None:
            continue
        ir, marker, what = int(m[1].replace(",", "")), m[2], m[3]
        if marker == "*":  # a function's own line, then its callees (a function may be listed twice: the max)
            block, python = next((k for k, fn in _BREAKDOWN.items() if fn in what), None), 0
            if block is not None:
                out[block] = max(out[block], ir)
        elif block == "native_pack" and _PYTHON_FROM_NATIVE in what:
            python += ir
            out["native_pack_python"] = max(out["native_pack_python"], python)
    return out


def _breakdown(files: list[Path], steps: int, saves: int) -> dict[str, float] | None:
    """``parse_annotate`` of each forward dump in ``files``, summed, per pack; None without callgrind_annotate."""
    if shutil.which("callgrind_annotate") is None:
        return None
    total: dict[str, int] = {}
    for f in files:
        proc = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--tree=calling", "--threshold=100", str(f)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return None
        for k, v in parse_annotate(proc.stdout).items():
            total[k] = total.get(k, 0) + v
    return {k: round(v / steps / saves) for k, v in total.items()}


def measure_instructions(layers: int, width: int, steps: int,
                         variants: tuple[str, ...] = VARIANTS, warmup: int = 3) -> dict[str, Any]:
    """Per-pack / per-unpack instruction counts (Ir) from a callgrind child process."""
    why = _callgrind_available()
    if why is not None:
        return {"skipped": why}
    model, x, saves = _setup(layers, width)
    del model, x
    with tempfile.TemporaryDirectory(prefix="hook_cost_") as d:
        tmp = Path(d)
        lib = _build_helper(tmp)
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={tmp}/cg.%p",
               sys.executable, "-m", "bench.hook_cost", "--_callgrind-child", str(lib),
               "--layers", str(layers), "--width", str(width), "--cg-steps", str(steps),
               "--warmup", str(warmup), "--variants", ",".join(variants)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")  # str hashes (dict probes) fixed
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
        if proc.returncode != 0:
            return {"skipped": f"callgrind child failed: {proc.stderr[-2000:]}"}
        totals: dict[str, dict[str, int]] = {}
        forward_dumps: dict[str, list[Path]] = {}
        for f in tmp.glob("cg.*"):
            what, ir = None, None
            for line in f.read_text(errors="replace").splitlines():
                if line.startswith("desc: Trigger: Client Request: "):
                    what = line.split("Client Request: ", 1)[1].strip()
                elif line.startswith("summary:") or line.startswith("totals:"):
                    ir = int(line.split()[1])
            if what and "|" in what and ir is not None:
                v, phase = what.split("|")
                totals.setdefault(v, {"fwd": 0, "bwd": 0})[phase] += ir
                if phase == "fwd" and v in _BREAKDOWN_VARIANTS:
                    forward_dumps.setdefault(v, []).append(f)
        breakdown = {v: _breakdown(files, steps, saves) for v, files in sorted(forward_dumps.items())}
    out: dict[str, Any] = {"steps": steps, "warmup_steps": warmup, "gauge_frozen": True, "saves_per_step": saves,
                           "module_calls_per_step": layers + 1, "variants": {}}
    base = totals.get("none")
    for name, t in totals.items():
        row: dict[str, Any] = {"fwd_ir_per_step": t["fwd"] // steps, "bwd_ir_per_step": t["bwd"] // steps}
        if base is not None:
            if name in _PER_MODULE_CALL:
                row["per_module_call_ir"] = round((t["fwd"] - base["fwd"]) / steps / (layers + 1))
            else:
                row["per_pack_ir"] = round((t["fwd"] - base["fwd"]) / steps / saves)
                row["per_unpack_ir"] = round((t["bwd"] - base["bwd"]) / steps / saves)
                if name in _TRACKING and "modules_only" in totals:
                    row["per_pack_net_of_module_hooks_ir"] = round(
                        (t["fwd"] - totals["modules_only"]["fwd"]) / steps / saves)
        out["variants"][name] = row
    # Where a pack's instructions go, by function (callgrind_annotate, inclusive): torch's own lookup of the
    # hooks at every save, the C++ hook, and the part of it spent in the Python offload step it calls.
    out["breakdown_per_pack_ir"] = {v: b for v, b in breakdown.items() if b is not None}
    out["ratios_per_pack"] = _ratios({n: r.get("per_pack_ir") for n, r in out["variants"].items()})
    out["ratios_per_pack_net_of_module_hooks"] = _ratios(
        {n: r.get("per_pack_net_of_module_hooks_ir", r.get("per_pack_ir")) for n, r in out["variants"].items()})
    return out


# -- emulated side stream: copies in flight ----------------------------------------------------


class _InOrderEvent:
    """A fake device event that completes once ``lag`` later copies have been issued."""

    clock = [0]

    def __init__(self, enable_timing: bool = False, lag: int = 0) -> None:
        self.lag = lag
        self.ready_at: int | None = None

    def record(self, stream: Any) -> None:
        _InOrderEvent.clock[0] += 1
        self.ready_at = _InOrderEvent.clock[0] + 2 * self.lag  # two events (start, done) per copy

    def query(self) -> bool:
        return self.ready_at is not None and _InOrderEvent.clock[0] >= self.ready_at

    def synchronize(self) -> None:
        self.ready_at = 0

    def elapsed_time(self, other: "_InOrderEvent") -> float:
        return 0.01


class _FakeStream:
    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, ev: Any) -> None:
        pass


class _FakeDeviceModule:
    """The surface of torch.cuda that the stream backend uses."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.current = _FakeStream()

    def Stream(self, device: Any = None) -> _FakeStream:  # noqa: N802 (mirrors torch.cuda)
        return _FakeStream()

    def Event(self, enable_timing: bool = False) -> _InOrderEvent:  # noqa: N802
        return _InOrderEvent(enable_timing, self.lag)

    def current_stream(self, device: Any = None) -> _FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: _FakeStream) -> Iterator[None]:
        yield


_GC_VARIANTS = ("none", "torchtune_real", "trl_keep", "ours_keep", "ours_keep_native", "ours_offload",
                "ours_offload_native")


def measure_gc(layers: int, width: int, steps: int, variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Collections by generation, and their time per pack, over ``steps`` uncollected steps per variant."""
    model, x, saves = _setup(layers, width)
    ctxs = _contexts(model)
    names = [v for v in _GC_VARIANTS if v in variants and v in ctxs]
    current: list[str | None] = [None]
    started = [0.0]
    runs: dict[str, dict[int, list[float]]] = {n: {0: [], 1: [], 2: []} for n in names}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if current[0] is None:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            runs[current[0]][info["generation"]].append(time.perf_counter() - started[0])

    out: dict[str, Any] = {"steps": steps, "saves_per_step": saves, "tracked_objects": 0, "variants": {}}
    gc.callbacks.append(on_gc)
    try:
        for name in names:
            _prepare(name)
            for _ in range(3):  # warm-up, as everywhere else
                _step(model, x, ctxs[name](), lambda phase: None)
            gc.collect()
            out["tracked_objects"] = max(out["tracked_objects"], len(gc.get_objects()))
            current[0] = name
            for _ in range(steps):
                _step(model, x, ctxs[name](), lambda phase: None)
            current[0] = None
    finally:
        current[0] = None
        gc.callbacks.remove(on_gc)
    for name, by_gen in runs.items():
        packs = steps * saves
        out["variants"][name] = {
            "collections": {str(g): len(ts) for g, ts in by_gen.items()},
            "gc_ns_per_pack": {str(g): sum(ts) * 1e9 / packs for g, ts in by_gen.items()},
            "gc_ns_per_pack_total": sum(sum(ts) for ts in by_gen.values()) * 1e9 / packs,
        }
    return out


def measure_stream_emulated(layers: int, width: int, rounds: int, in_flight: tuple[int, ...]) -> dict[str, Any]:
    """Per-pack CPU time (ns) of the offloading engine on an emulated side stream, by copies in flight."""
    from offload.streams import StreamBackend

    model, x, saves = _setup(layers, width)
    res: dict[str, Any] = {"saves_per_step": saves, "per_pack_ns_by_in_flight": {}}
    for k in in_flight:
        ctx = OffloadActivations(device="cpu", min_offload_size=0, native_hooks=False)
        backend = StreamBackend(torch.device("cpu"))
        backend._mod = _FakeDeviceModule(k)
        ctx._backend = backend
        fwd = []
        base = []
        for rnd in range(rounds + 1):
            for which in ("none", "engine"):
                _prepare("ours_offload" if which == "engine" else "none")
                c = ctx if which == "engine" else contextlib.nullcontext()
                marks: dict[str, float] = {}

                def clock(phase: str) -> None:
                    now = time.process_time()
                    marks[phase] = now - marks[phase] if phase in marks else now

                _step(model, x, c, clock)
                if rnd:
                    (fwd if which == "engine" else base).append(marks["fwd"])
        deltas = [(a - b) * 1e9 / saves for a, b in zip(fwd, base)]
        res["per_pack_ns_by_in_flight"][str(k)] = _quartiles(deltas)
    return res


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=334, help="layers in the chain (3 saves each)")
    p.add_argument("--width", type=int, default=256, help="elements per activation (float32)")
    p.add_argument("--rounds", type=int, default=40, help="measured rounds of CPU time per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cg-steps", type=int, default=3, help="steps per variant under callgrind")
    p.add_argument("--instructions", action=argparse.BooleanOptionalAction, default=True,
                   help="also count instructions under callgrind (skipped with a reason when unavailable)")
    p.add_argument("--gc-steps", type=int, default=100,
                   help="uncollected steps per keep variant for the cycle collector's share (0 to skip)")
    p.add_argument("--stream-in-flight", default="0,64,500",
                   help="copies in flight for the emulated side-stream measurement ('' to skip)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--baseline", type=Path, default=None,
                   help="an earlier run's JSON, embedded under 'before' (e.g. the same bench on the old engine)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON to write (default: ./bench_runs/<UTC time>_hook_cost_cpu/hook_cost.json; the "
                        "committed results are made with --out bench/results/cpu/hook_cost.json)")
    p.add_argument("--_callgrind-child", dest="cg_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = default_out()
    torch.set_num_threads(1)
    variants = tuple(v for v in args.variants.split(",") if v)
    if "none" not in variants:
        variants = ("none",) + variants
    if args.cg_child:
        _callgrind_child(Path(args.cg_child), args.layers, args.width, args.cg_steps, variants, args.warmup)
        return {}

    load = os.getloadavg()
    result: dict[str, Any] = {
        "command": "python -m bench.hook_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {"layers": args.layers, "width": args.width, "dtype": "float32", "rounds": args.rounds,
                   "warmup": args.warmup, "threads": 1},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_before": load},
        "variants": {v: d.strip() for v, d in _variant_docs().items() if v in variants},
        "missing_variants": {v: why for v, why in _optional_contexts(_setup(1, 1)[0])[1].items() if v in variants},
    }
    result["cpu_time"] = measure_cpu_time(args.layers, args.width, args.rounds, args.warmup, variants)
    if args.gc_steps > 0:
        result["gc"] = measure_gc(args.layers, args.width, args.gc_steps, variants)
    ks = tuple(int(k) for k in args.stream_in_flight.split(",") if k.strip())
    if ks:
        result["stream_emulated"] = measure_stream_emulated(args.layers, args.width, max(3, args.rounds // 4), ks)
    if args.instructions:
        result["instructions"] = measure_instructions(args.layers, args.width, args.cg_steps, variants, args.warmup)
    _modules.uninstall()  # the measurements ran our variants here: leave nn.Module as it was
    result["machine"]["loadavg_after"] = os.getloadavg()
    if args.baseline is not None:
        before = json.loads(args.baseline.read_text())
        result["before"] = {k: before[k] for k in ("command", "cpu_time", "stream_emulated", "instructions",
                                                   "commit") if k in before}
    result["commit"] = _commit()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(_table(result))
    print(f"wrote {args.out}")
    return result


def _variant_docs() -> dict[str, str]:
    docs = {}
    for line in __doc__.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0] in VARIANTS and line.startswith("  ") and not line.startswith("    "):
            docs[parts[0]] = parts[1]
    return docs


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _table(result: dict[str, Any]) -> str:
    cpu = result["cpu_time"]["variants"]
    ins = result.get("instructions", {}).get("variants", {})
    nan = float("nan")
    rows = []
    for name, row in cpu.items():
        if name == "none" or name in _PER_MODULE_CALL:
            continue
        i = ins.get(name, {})
        net = row.get("per_pack_net_of_module_hooks_ns", {}).get("median", nan)
        rows.append([name, f"{row['per_pack_ns']['median']:.0f}", f"{net:.0f}", f"{row['per_unpack_ns']['median']:.0f}",
                     i.get("per_pack_ir", nan), i.get("per_pack_net_of_module_hooks_ir", nan),
                     i.get("per_unpack_ir", nan)])
    lines = [render_table(rows, ["variant", "pack ns", "(net) ns", "unpack ns", "pack Ir", "(net) Ir",
                                 "unpack Ir"]).rstrip("\n")]
    lines.append("(net) = minus the engine's module-tracking hooks, which cost per module call, not per pack")
    for name in _PER_MODULE_CALL:
        if name in cpu:
            lines.append(f"{name}: {cpu[name]['per_module_call_ns']['median']:.0f} ns per module call"
                         + (f", {ins[name]['per_module_call_ir']} Ir" if name in ins else ""))
    lines.append(f"ratios (CPU time): {result['cpu_time']['ratios_per_pack']}")
    lines.append(f"ratios (CPU time, net): {result['cpu_time']['ratios_per_pack_net_of_module_hooks']}")
    if ins:
        lines.append(f"ratios (Ir): {result['instructions']['ratios_per_pack']}")
        lines.append(f"ratios (Ir, net): {result['instructions']['ratios_per_pack_net_of_module_hooks']}")
    if "gc" in result:
        g = result["gc"]
        lines.append(f"cycle collector over {g['steps']} uncollected steps ({g['tracked_objects']} tracked objects): "
                     + ", ".join(f"{n} {v['gc_ns_per_pack_total']:.0f} ns/pack (full collections: "
                                 f"{v['collections']['2']})" for n, v in g["variants"].items()))
    if "stream_emulated" in result:
        em = result["stream_emulated"]["per_pack_ns_by_in_flight"]
        lines.append("emulated stream, ns per pack by copies in flight: "
                     + ", ".join(f"{k}: {v['median']:.0f}" for k, v in em.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
