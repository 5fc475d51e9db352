"""``predict_step`` and ``max_context``: what one training step would need on a named GPU, predicted.

A prediction captures the step on fake tensors through the real engine (``_capture``, NOTE
[ Capture ]) and replays its allocations in program order against the caching allocator's model
(``_memory``, NOTE [ Device memory model ]). Every number is a prediction for the GPU spec it names,
and the ``Prediction`` says what it assumed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import OffloadConfig
from ..planner.planning import Plan
from ._capture import NEVER, Captured, capture
from ._fsdp import check_world_size
from ._memory import DeviceMemory, replay
from ._strategies import strategy_name
from ._timeline import Clock, TimelineResult, simulate
from ._trace import Trace
from .gpus import GPUSpec, resolve_gpu

__all__ = ["Prediction", "predict_step", "max_context"]

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
    activations), other, and held (counted in its category too)."""
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
                "capture_seconds": round(self.capture_seconds, 3)}

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
                 + ", ".join(f"{k} {v / _GiB:.2f} GiB" for k, v in self.host_bytes.items())]
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


def _assumptions(gpu: GPUSpec, strategy: str, optimizer: OptimizerFactory | None, dtype: torch.dtype | None,
                 engine: bool, world_size: int = 1) -> tuple[str, ...]:
    out = [f"GPU: {gpu.describe()}; usable = memory - reserve {gpu.reserve_bytes / _GiB:.2f} GiB "
           "(CUDA context, cuBLAS workspace, allocator slack)",
           "attention: shapes of CPU flash SDPA (no S x S score matrix), as flash / memory-efficient attention "
           "on the GPU; a math-kernel fallback there would need S x S per head",
           "allocator: allocated bytes in 512 B blocks; reserved segments, fragmentation, NCCL buffers and "
           "kernel workspaces are not counted",
           f"optimizer: {'given factory, state created by a first step' if optimizer else 'none (no optimizer state)'}",
           f"dtype: {dtype if dtype is not None else 'as built'}"]
    if engine:
        out += ["host: the target's host RAM is assumed sufficient (virtual_memory_safe_pct off); host "
                "budgets in the config apply",
                "in-flight copies: the engine's polls see the modelled device (a copy is done when it would be "
                "on this GPU, at the host's pace of the replay), so sources are freed and reloads issued as on "
                "the GPU; the copy schedule's memory readings are the step's live device blocks"]
    if world_size > 1:
        out += [f"FSDP2 over {world_size} GPUs, rank 0 (the largest shard): fully_shard on each block and the root "
                "with its defaults; collectives on a fake process group, so communication time and NCCL buffers "
                "are not counted"]
    return tuple(out)


def predict_step(model_fn: Callable[[], nn.Module], step_fn: Callable[[nn.Module], torch.Tensor], *,
                 gpu: str | GPUSpec, strategy: str | Plan = "offload", config: OffloadConfig | None = None,
                 optimizer: OptimizerFactory | None = None, dtype: torch.dtype | None = None,
                 world_size: int = 1) -> Prediction:
    """Predict one training step's device memory on ``gpu``, without a GPU.

    ``model_fn()`` builds the model (called under fake tensors: no weights are materialised);
    ``step_fn(model)`` runs the forward and returns the loss; backward, ``optimizer(params).step()``
    (when an optimizer factory is given, e.g. ``lambda p: torch.optim.AdamW(p)``) and zeroing the
    gradients are run here. ``strategy``: "none", "ac", "offload", "offload_ac" or a ``Plan``
    (see offload/predict/_strategies.py); ``config`` the ``OffloadConfig`` of the engine strategies;
    ``dtype`` the floating-point dtype the model's parameters are cast to. ``world_size=N > 1`` predicts
    one rank of FSDP2 over N GPUs (each block and the root ``fully_shard``-ed, on a fake process group:
    NOTE [ One FSDP2 rank ] in offload/predict/_fsdp.py); 1 predicts a single GPU.
    """
    spec = resolve_gpu(gpu)
    world_size = check_world_size(world_size)
    t0 = time.perf_counter()
    cap = capture(model_fn, step_fn, strategy=strategy, config=config, optimizer=optimizer, dtype=dtype,
                  fake=True, lag=NEVER, world_size=world_size, clock=Clock(spec))
    return _prediction(cap, spec, strategy, optimizer, dtype, time.perf_counter() - t0, world_size)


def _prediction(cap: Captured, spec: GPUSpec, strategy: str | Plan, optimizer: OptimizerFactory | None,
                dtype: torch.dtype | None, seconds: float, world_size: int = 1) -> Prediction:
    mem = replay(cap.trace, DeviceMemory())
    return Prediction(gpu=spec, strategy=strategy_name(strategy), peak_bytes=mem.peak_bytes,
                      peak_allocated_bytes=mem.peak_allocated_bytes, breakdown_at_peak=mem.breakdown_at_peak(),
                      activations_at_peak=_by_block(mem.activations_at_peak(), cap.block_names),
                      ledger_summary=cap.ledger_summary, host_bytes=cap.host_bytes,
                      assumptions=_assumptions(spec, strategy_name(strategy), optimizer, dtype,
                                               cap.ledger_summary is not None, world_size),
                      capture_seconds=seconds, trace=cap.trace, timeline=simulate(cap.trace, spec),
                      world_size=world_size, state_bytes=cap.state_bytes)


def max_context(model_fn: Callable[[], nn.Module], step_fn: Callable[[nn.Module, int], torch.Tensor], *,
                gpu: str | GPUSpec, strategy: str | Plan = "offload", config: OffloadConfig | None = None,
                optimizer: OptimizerFactory | None = None, dtype: torch.dtype | None = None,
                start: int = 1024, multiple: int = 256, limit: int = 1 << 20, world_size: int = 1) -> int:
    """The longest sequence length (a multiple of ``multiple``, at most ``limit``) whose step is predicted
    to fit on ``gpu``; 0 when not even ``multiple`` fits. ``step_fn(model, seq_len)`` runs the forward at
    that length. Doubling from ``start`` then bisecting: about ``2 log2(limit / multiple)`` captures.
    ``world_size``: per rank of FSDP2 (``predict_step``)."""
    if multiple < 1 or start < multiple or limit < multiple:
        raise ValueError(f"offload.predict.max_context: need 1 <= multiple <= start and multiple <= limit; got "
                         f"multiple={multiple}, start={start}, limit={limit}")

    def fits(seq: int) -> bool:
        return predict_step(model_fn, lambda m: step_fn(m, seq), gpu=gpu, strategy=strategy, config=config,
                            optimizer=optimizer, dtype=dtype, world_size=world_size).fits

    lo, hi = 0, None  # lo fits (0: nothing known to fit), hi does not
    s = min(start // multiple * multiple, limit // multiple * multiple)
    while True:
        if fits(s):
            lo = s
            if s >= limit // multiple * multiple:
                return lo
            s = min(2 * s, limit // multiple * multiple)
        else:
            hi = s
            break
    if lo == 0:  # the start did not fit: halve down
        while hi > multiple:
            s = max(multiple, hi // 2 // multiple * multiple)
            if fits(s):
                lo = s
                break
            hi = s
        if lo == 0:
            return 0
    while hi - lo > multiple:
        mid = (lo + hi) // 2 // multiple * multiple
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo

