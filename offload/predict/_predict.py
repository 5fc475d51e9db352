"""``predict_step`` and ``max_context``: what one training step would need on a named GPU, predicted.

A prediction captures the step on fake tensors through the real engine (``_capture``, NOTE
[ Capture ]) and replays its allocations in program order against the caching allocator's model
(``_memory``, NOTE [ Device memory model ]). Every number is a prediction for the GPU spec it names,
and the ``Prediction`` says what it assumed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._format import format_bytes
from .._totals import OFFLOADED
from ..config import OffloadConfig
from ..planner.planning import Plan
from ..policy import EXCLUDED_REGION
from ._capture import NEVER, Captured, capture
from ._errors import PredictError
from ._fsdp import check_world_size
from ._memory import DeviceMemory, replay
from ._mixed import check_mixed_precision, precision_words
from ._strategies import strategy_name
from ._timeline import Clock, TimelineResult, simulate
from ._trace import Trace
from .gpus import GPUSpec, resolve_gpu

__all__ = ["Prediction", "LongestContext", "predict_step", "max_context"]

log = logging.getLogger("offload.predict")
_GiB = 1 << 30
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


@dataclass(frozen=True, eq=False)
class Prediction:
    """A predicted training step on one GPU: peak device memory, what holds it, what the engine moves.

    Everything here is **predicted** for ``gpu`` (see ``assumptions``), not measured."""

    gpu: GPUSpec
    strategy: str
    peak_bytes: int
    """Predicted peak device memory of the step: allocated blocks plus blocks freed but held for another
    stream (NOTE [ Device memory model ] in offload/predict/_memory.py)."""
    peak_allocated_bytes: int
    """Predicted peak of allocated bytes alone (what ``torch.cuda.max_memory_allocated`` reports)."""
    breakdown_at_peak: dict[str, int]
    """Bytes by category at the peak: parameter, gradient, optimizer, activation, copy (reloaded
    activations), kv_cache (a KV cache the model returned), logits (logits-shaped tensors outside the
    model's modules: the loss's upcast and softmax, the logits' gradients in backward), other (the step's
    inputs, the gradients passed between modules in backward, the optimizer step's temporaries), and held
    (counted in its category too)."""
    activations_at_peak: dict[str, int]
    """Activation bytes live at the peak, by block (or module outside the blocks)."""
    ledger_summary: dict[str, Any] | None
    """The engine's ``ledger.summary()`` over the measured step (None for strategies without an engine)."""
    host_bytes: dict[str, int]
    """Peak host bytes per tier in the step (pool reserved, pageable in use, disk)."""
    assumptions: tuple[str, ...]
    """What the prediction assumed, one line each (kernel choice, allocator reserve, optimizer, ...)."""
    capture_seconds: float
    """Wall time this prediction took on this machine."""
    trace: Trace = field(repr=False)
    """The captured step (input to a timeline replay)."""
    timeline: TimelineResult | None = field(default=None, repr=False)
    """The step replayed on ``gpu``'s clock (``offload.predict.simulate``): time, stalls, Chrome trace."""
    world_size: int = 1
    """GPUs FSDP2 shards over; every number above is then one rank's (rank 0: NOTE [ One FSDP2 rank ])."""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """Model state this rank holds: ``parameter``, ``buffer``, ``gradient``, ``optimizer`` (all but buffers
    sharded over ``world_size``; the unsharded parameters FSDP2 all-gathers around a block are not in it)."""
    precision: str = ""
    """The precision regime predicted, in words (NOTE [ Mixed precision ] item 3 in ``_mixed.py``)."""
    head: dict[str, Any] = field(default_factory=dict)
    """The output head: ``name`` (its module; '' without one), ``offloaded_bytes`` (what the engine offloaded
    from it), ``kept_bytes`` (what the head exclusion kept on the device: the head and what runs after it)."""
    kv_cache_bytes: int = 0
    """Bytes of the KV cache the model returned (0: none; NOTE [ Capture ] item 8): counted as ``kv_cache``."""

    @property
    def step_seconds(self) -> float | None:
        """Predicted step time on ``gpu`` (the timeline's; None without one)."""
        return self.timeline.step_seconds if self.timeline is not None else None

    @property
    def exposed_copy_seconds(self) -> float | None:
        """Predicted time compute waits on copies (the timeline's; None without one)."""
        return self.timeline.exposed_copy_seconds if self.timeline is not None else None

    @property
    def link_bytes_per_s_needed(self) -> float | None:
        """Predicted host link rate at which no stream waits on a copy (the timeline's; None without one;
        ``inf`` when a copy is awaited as soon as it is issued). A search of a few dozen replays: not cheap."""
        return self.timeline.link_bytes_per_s_needed if self.timeline is not None else None

    @property
    def fits(self) -> bool:
        """The predicted peak is within the GPU's memory less its stated reserve (``gpu.usable_bytes``)."""
        return self.peak_bytes <= self.gpu.usable_bytes

    @property
    def headroom_bytes(self) -> int:
        """``gpu.usable_bytes - peak_bytes`` (negative: does not fit)."""
        return self.gpu.usable_bytes - self.peak_bytes

    @property
    def offloaded_bytes(self) -> int:
        """Bytes the engine copies to the host per step (0 without an engine)."""
        return int(self.ledger_summary["offloaded_bytes"]) if self.ledger_summary else 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, labelled as a prediction."""
        return {"kind": "predicted", "gpu": self.gpu.name, "gpu_spec": self.gpu.describe(), "strategy": self.strategy,
                "world_size": self.world_size, "state_bytes": dict(self.state_bytes),
                "peak_bytes": self.peak_bytes, "peak_allocated_bytes": self.peak_allocated_bytes,
                "usable_bytes": self.gpu.usable_bytes, "fits": self.fits,
                "breakdown_at_peak": dict(self.breakdown_at_peak),
                "activations_at_peak": dict(self.activations_at_peak),
                "offloaded_bytes": self.offloaded_bytes, "host_bytes": dict(self.host_bytes),
                "step_seconds": self.step_seconds, "exposed_copy_seconds": self.exposed_copy_seconds,
                "stall_causes": dict(self.timeline.stall_causes) if self.timeline is not None else None,
                "ledger_summary": self.ledger_summary, "assumptions": list(self.assumptions),
                "precision": self.precision, "head": dict(self.head), "kv_cache_bytes": self.kv_cache_bytes,
                "capture_seconds": round(self.capture_seconds, 3)}

    def write_trace(self, path: str) -> None:
        """Write the predicted step as a Chrome trace (``TimelineResult.write_trace``: open it in
        https://ui.perfetto.dev): the host, each stream, the stalls and a device-memory counter."""
        if self.timeline is None:
            raise PredictError("offload.predict: this Prediction has no timeline (it was not replayed on a clock), so "
                               "it has no trace to write; predict_step always replays one")
        self.timeline.write_trace(path)

    def head_share(self) -> str:
        """The output head's share of the step, in words (empty without a head or an engine)."""
        name = self.head.get("name")
        if not name or self.ledger_summary is None:
            return ""
        off, kept = self.head.get("offloaded_bytes", 0), self.head.get("kept_bytes", 0)
        if off:
            return (f"output head {name}: {format_bytes(off)} of the {format_bytes(self.offloaded_bytes)} offloaded "
                    f"({off / max(1, self.offloaded_bytes):.0%}), reloaded first in backward (its reload cannot hide); "
                    "keep it on the device with offload.regions.exclude_output_head(engine, model), as the trainer "
                    "integrations do")
        return (f"output head {name}: kept on the device with what runs after it ({format_bytes(kept)} saved "
                "there), as the trainer integrations keep it")

    def report(self) -> str:
        """A few lines for a terminal, labelled as a prediction."""
        lines = [f"PREDICTED for {self.gpu.describe()}" + self._per_rank(),
                 f"  strategy {self.strategy}: peak {self.peak_bytes / _GiB:.2f} GiB of "
                 f"{self.gpu.usable_bytes / _GiB:.2f} GiB usable -> {'fits' if self.fits else 'does NOT fit'}",
                 "  at the peak: " + ", ".join(f"{k} {v / _GiB:.2f} GiB" for k, v in self.breakdown_at_peak.items()
                                              if v),
                 f"  step {self.step_seconds * 1e3:.1f} ms, copies exposed {self.exposed_copy_seconds * 1e3:.1f} ms"
                 if self.timeline is not None else "  step time: not replayed",
                 f"  offloaded per step {self.offloaded_bytes / _GiB:.2f} GiB; host "
                 + ", ".join(f"{k} {v / _GiB:.2f} GiB" for k, v in self.host_bytes.items()),
                 f"  precision: {self.precision}"]
        if self.head_share():
            lines.append(f"  {self.head_share()}")
        if self.breakdown_at_peak.get("other") or self.breakdown_at_peak.get("logits"):
            lines.append("  (logits: logits-shaped tensors outside the model's modules, i.e. the loss and the logits' "
                         "gradients; other: the step's inputs, gradients between modules in backward, optimizer "
                         "temporaries)")
        lines += [f"  assumes: {a}" for a in self.assumptions]
        return "\n".join(lines)

    def _per_rank(self) -> str:
        return f", one rank of FSDP2 over {self.world_size} GPUs" if self.world_size > 1 else ""

    def __repr__(self) -> str:
        return (f"Prediction(PREDICTED on {self.gpu.name}{self._per_rank()}, strategy={self.strategy!r}, "
                f"peak={self.peak_bytes / _GiB:.2f} GiB, fits={self.fits}, "
                + (f"step={self.step_seconds * 1e3:.1f} ms, " if self.timeline is not None else "") +
                f"offloaded={self.offloaded_bytes / _GiB:.2f} GiB/step)")


def _by_block(acts: dict[str, int], blocks: list[str]) -> dict[str, int]:
    """Activation bytes by module name, grouped under the candidate block that contains the module."""
    out: dict[str, int] = {}
    for module, n in acts.items():
        rel = module.split(".", 1)[1] if "." in module else ""
        key = next((b for b in blocks if rel == b or rel.startswith(b + ".")), module or "<outside modules>")
        out[key] = out.get(key, 0) + n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _assumptions(gpu: GPUSpec, strategy: str, optimizer: OptimizerFactory | None, precision: str,
                 engine: bool, world_size: int = 1, cap: Captured | None = None) -> tuple[str, ...]:
    out = [f"GPU: {gpu.describe()}; usable = memory - reserve {gpu.reserve_bytes / _GiB:.2f} GiB "
           "(CUDA context, cuBLAS workspace, allocator slack)",
           "attention: shapes of CPU flash SDPA (no S x S score matrix), as flash / memory-efficient attention "
           "on the GPU; a math-kernel fallback there would need S x S per head",
           "allocator: allocated bytes in 512 B blocks; reserved segments, fragmentation, NCCL buffers and "
           "kernel workspaces are not counted",
           f"optimizer: {'given factory, state created by a first step' if optimizer else 'none (no optimizer state)'}",
           f"precision: {precision}"]
    if engine:
        out += ["host: the target's host RAM is assumed sufficient (virtual_memory_safe_pct off); host "
                "budgets in the config apply",
                "in-flight copies: the engine's polls see the modelled device (a copy is done when it would be "
                "on this GPU, at the host's pace of the replay), so sources are freed and reloads issued as on "
                "the GPU; the copy schedule's memory readings are the step's live device blocks"]
        if strategy in ("offload", "offload_ac"):
            out.append("output head: kept on the device with what runs after it (offload.regions."
                       "exclude_output_head), as OffloadCallback, the Lightning callback and "
                       "get_act_offloading_ctx_manager keep it")
    if world_size > 1:
        out += [f"FSDP2 over {world_size} GPUs, rank 0 (the largest shard): fully_shard on each block and the root "
                "with its defaults; collectives on a fake process group, so communication time and NCCL buffers "
                "are not counted"]
    if cap is not None and cap.facts.kv_cache_bytes:
        out.append(f"KV cache: the model returns one (past_key_values / cache, use_cache=True) holding "
                   f"{cap.facts.kv_cache_bytes / _GiB:.2f} GiB, counted as kv_cache: a training step never reads it; "
                   "pass use_cache=False (or set model.config.use_cache = False) to drop it")
    return tuple(out)


def _check_args(model_fn: Any, step_fn: Any, dtype: Any, mixed_precision: Any) -> torch.dtype | None:
    """Refuse what a prediction cannot run, before anything is built (each refusal names the argument and what
    to pass instead); returns ``mixed_precision`` checked."""
    if not callable(model_fn) or isinstance(model_fn, nn.Module):
        raise TypeError(f"offload.predict: model_fn must be a function that builds the model (e.g. lambda: "
                        f"MyModel(cfg)), got {type(model_fn).__name__}; an existing model: pass lambda: model")
    if not callable(step_fn):
        raise TypeError(f"offload.predict: step_fn must be a function step_fn(model) -> loss, got "
                        f"{type(step_fn).__name__}")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"offload.predict: dtype={dtype!r} must be a torch dtype (torch.bfloat16, torch.float16, "
                            "torch.float32) or None (as built)")
        if not dtype.is_floating_point:
            raise PredictError(f"offload.predict: dtype={dtype} is not a floating-point dtype; the model's parameters "
                               "are cast to it. Pass torch.bfloat16, torch.float16 or torch.float32, or None")
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        raise PredictError("offload.predict: called with gradients disabled (torch.no_grad() or "
                           "torch.inference_mode()); a training step needs autograd to save activations and run "
                           "backward. Call it outside no_grad / inference_mode.")
    return check_mixed_precision(mixed_precision, dtype)


def predict_step(model_fn: Callable[[], nn.Module], step_fn: Callable[[nn.Module], torch.Tensor], *,
                 gpu: str | GPUSpec, strategy: str | Plan = "offload", config: OffloadConfig | None = None,
                 optimizer: OptimizerFactory | None = None, dtype: torch.dtype | None = None,
                 world_size: int = 1, mixed_precision: torch.dtype | None = None) -> Prediction:
    """Predict one training step's device memory on ``gpu``, without a GPU.

    ``model_fn()`` builds the model (called under fake tensors: no weights are materialised; a model built
    before the call, ``lambda: model``, or on the meta device has its state swapped for fake twins; ``.to()``,
    ``.cuda()`` and peft's ``get_peft_model`` inside it work as on a GPU); ``step_fn(model)`` runs the forward
    and returns the loss; backward, ``optimizer(params).step()`` (when an optimizer factory is given, e.g.
    ``lambda p: torch.optim.AdamW(p)``) and zeroing the gradients are run here. ``strategy``: "none", "ac",
    "offload", "offload_ac", "long_context" or a ``Plan`` (see offload/predict/_strategies.py); ``config`` the
    ``OffloadConfig`` of the engine strategies; ``dtype`` the floating-point dtype the model's parameters are
    cast to (the whole step then runs in it); ``mixed_precision`` (torch.bfloat16 or torch.float16) the dtype
    the step computes in while parameters, gradients and optimizer state keep the model's (autocast on one GPU,
    FSDP2's MixedPrecisionPolicy over several: NOTE [ Mixed precision ] in offload/predict/_mixed.py).
    ``world_size=N > 1`` predicts one rank of FSDP2 over N GPUs (each block and the root ``fully_shard``-ed,
    on a fake process group: NOTE [ One FSDP2 rank ] in offload/predict/_fsdp.py); 1 predicts a single GPU.
    """
    mixed_precision = _check_args(model_fn, step_fn, dtype, mixed_precision)
    spec = resolve_gpu(gpu)
    world_size = check_world_size(world_size)
    t0 = time.perf_counter()
    cap = capture(model_fn, step_fn, strategy=strategy, config=config, optimizer=optimizer, dtype=dtype,
                  fake=True, lag=NEVER, world_size=world_size, clock=Clock(spec), mixed_precision=mixed_precision)
    return _prediction(cap, spec, strategy, optimizer, dtype, time.perf_counter() - t0, world_size,
                       mixed_precision=mixed_precision)


def _head(cap: Captured) -> dict[str, Any]:
    """``Prediction.head`` from the engine's records (NOTE [ Capture ] item 5)."""
    name = cap.facts.head_name
    if not name:
        return {"name": ""}
    mine = [r for r in cap.records if r[3] == name or r[3].startswith(name + ".")]
    return {"name": name, "offloaded_bytes": sum(r[0] for r in mine if r[4] == OFFLOADED),
            "kept_bytes": sum(r[0] for r in cap.records if r[5] == EXCLUDED_REGION)}


def _prediction(cap: Captured, spec: GPUSpec, strategy: str | Plan, optimizer: OptimizerFactory | None,
                dtype: torch.dtype | None, seconds: float, world_size: int = 1, *,
                mixed_precision: torch.dtype | None = None) -> Prediction:
    mem = replay(cap.trace, DeviceMemory())
    name = strategy_name(strategy)
    precision = precision_words(mixed_precision if mixed_precision is not None else cap.facts.autocast, dtype,
                                world_size if mixed_precision is not None else 1, cap.facts.state_dtype)
    return Prediction(gpu=spec, strategy=name, peak_bytes=mem.peak_bytes,
                      peak_allocated_bytes=mem.peak_allocated_bytes, breakdown_at_peak=mem.breakdown_at_peak(),
                      activations_at_peak=_by_block(mem.activations_at_peak(), cap.block_names),
                      ledger_summary=cap.ledger_summary, host_bytes=cap.host_bytes,
                      assumptions=_assumptions(spec, name, optimizer, precision, cap.ledger_summary is not None,
                                               world_size, cap),
                      capture_seconds=seconds, trace=cap.trace, timeline=simulate(cap.trace, spec),
                      world_size=world_size, state_bytes=cap.state_bytes, precision=precision, head=_head(cap),
                      kv_cache_bytes=cap.facts.kv_cache_bytes)


class LongestContext(int):
    """``max_context``'s answer: an ``int``, the longest length that fits (0: none does), that also says how it was
    found. Everything in it is predicted for the GPU the search named."""

    reason: str
    """Why the search stopped where it did, in words: the limit was reached, the state alone does not fit
    (naming what it needs), even the shortest length does not fit, or '' (bisected to ``multiple``)."""
    probes: tuple[tuple[int, bool, int], ...]
    """Every prediction made, in order: (sequence length, fits, predicted peak bytes)."""
    seconds: float
    """Wall time of the search on this machine."""

    def __new__(cls, value: int, reason: str = "", probes: tuple = (), seconds: float = 0.0) -> "LongestContext":
        out = super().__new__(cls, value)
        out.reason, out.probes, out.seconds = reason, tuple(probes), seconds
        return out


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"offload.predict.max_context: {name}={value!r} must be an int number of tokens")
    if value < 1:
        raise ValueError(f"offload.predict.max_context: {name}={value} must be >= 1")
    return value


def _state_total(p: Prediction) -> int:
    return sum(p.state_bytes.get(k, 0) for k in ("parameter", "buffer", "gradient", "optimizer"))


def max_context(model_fn: Callable[[], nn.Module], step_fn: Callable[[nn.Module, int], torch.Tensor], *,
                gpu: str | GPUSpec, strategy: str | Plan = "offload", config: OffloadConfig | None = None,
                optimizer: OptimizerFactory | None = None, dtype: torch.dtype | None = None,
                start: int = 1024, multiple: int = 256, limit: int = 1 << 20, world_size: int = 1,
                mixed_precision: torch.dtype | None = None,
                start_prediction: Prediction | None = None) -> LongestContext:
    """The longest sequence length (a multiple of ``multiple``, at most ``limit``) whose step is predicted
    to fit on ``gpu``; 0 when not even ``multiple`` fits. ``step_fn(model, seq_len)`` runs the forward at
    that length. Doubling from ``start`` then bisecting: about ``2 log2(limit / multiple)`` captures, each
    logged at INFO on the ``offload.predict`` logger (a progress line per probe). When the first probe does
    not fit and the model's state alone (parameters, gradients, optimizer state) exceeds the GPU's usable
    memory, the answer is 0 at once, its ``reason`` naming what the state needs. The answer is a
    ``LongestContext`` (an int with ``reason``, ``probes`` and ``seconds``). ``world_size``, ``dtype`` and
    ``mixed_precision``: as in ``predict_step``. ``start_prediction``: the prediction of the step at
    ``start`` with these arguments, if the caller has it (it is the first probe: one capture saved)."""
    for name, value in (("start", start), ("multiple", multiple), ("limit", limit)):
        _positive_int(name, value)
    if start < multiple or limit < multiple:
        raise ValueError(f"offload.predict.max_context: need multiple <= start and multiple <= limit; got "
                         f"multiple={multiple}, start={start}, limit={limit}")
    mixed_precision = _check_args(model_fn, step_fn, dtype, mixed_precision)
    spec = resolve_gpu(gpu)
    t0 = time.perf_counter()
    probes: list[tuple[int, bool, int]] = []
    first: list[Prediction] = []

    def fits(seq: int) -> bool:
        t = time.perf_counter()
        if start_prediction is not None and seq == start and not probes:
            p = start_prediction
        else:
            p = predict_step(model_fn, lambda m: step_fn(m, seq), gpu=spec, strategy=strategy, config=config,
                             optimizer=optimizer, dtype=dtype, world_size=world_size, mixed_precision=mixed_precision)
        first[:] = first or [p]
        probes.append((seq, p.fits, p.peak_bytes))
        log.info("max_context on %s (%s): s=%d %s, predicted peak %.2f GiB of %.2f GiB usable [%.1f s]", spec.name,
                 strategy_name(strategy), seq, "fits" if p.fits else "does not fit", p.peak_bytes / _GiB,
                 spec.usable_bytes / _GiB, time.perf_counter() - t)
        return p.fits

    def answer(value: int, reason: str = "") -> LongestContext:
        return LongestContext(value, reason, tuple(probes), round(time.perf_counter() - t0, 2))

    lo, hi = _bracket(fits, start, multiple, limit)
    if lo == 0 and hi is not None:  # the start did not fit
        state = _state_total(first[0])
        if state > spec.usable_bytes:
            return answer(0, f"the state alone (parameters, gradients, optimizer state) needs {state / _GiB:.2f} GiB "
                             f"of the {spec.usable_bytes / _GiB:.2f} GiB usable on {spec.name}")
        lo, hi = _halve(fits, hi, multiple)
        if lo == 0:
            return answer(0, f"even {multiple} tokens peak at {probes[-1][2] / _GiB:.2f} GiB of the "
                             f"{spec.usable_bytes / _GiB:.2f} GiB usable on {spec.name}")
    if hi is None:
        return answer(lo, f"reached the limit ({limit})")
    while hi - lo > multiple:
        mid = (lo + hi) // 2 // multiple * multiple
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return answer(lo)


def _bracket(fits: Callable[[int], bool], start: int, multiple: int, limit: int) -> tuple[int, int | None]:
    """Doubling from ``start``: (the longest length known to fit (0: the start did not), the first that did not
    (None: the limit fits))."""
    top = limit // multiple * multiple
    lo, s = 0, min(start // multiple * multiple, top)
    while fits(s):
        lo = s
        if s >= top:
            return lo, None
        s = min(2 * s, top)
    return lo, s


def _halve(fits: Callable[[int], bool], hi: int, multiple: int) -> tuple[int, int]:
    """Halving down from ``hi`` (which does not fit) to ``multiple``: (a length that fits, or 0; the last that did
    not)."""
    while hi > multiple:
        s = max(multiple, hi // 2 // multiple * multiple)
        if fits(s):
            return s, hi
        hi = s
    return 0, hi
