"""What each item of a trace costs on a named GPU: device seconds per kernel and copy, host seconds
per issued item. Every constant here, or the spec field it reads, names its source.

Device time of a kernel (research section 8.2, a roofline with achieved rates)::

    seconds = max(flops / (peak_flops[dtype] * matmul_efficiency),
                  bytes / (hbm_bytes_per_s * hbm_efficiency)) + launch_s

``flops`` are floating-point operations as ``torch.utils.flop_counter`` counts them (2 per
multiply-add: never halved into MACs) and ``peak_flops`` are dense peaks (never NVIDIA's "with
sparsity" figures): the two unit errors PyTorch's own estimator made (pytorch PR #182023).
Attention kernels count FLOPs by :func:`attention_flops` (flash attention: causal halves the
work, the backward is 2.5 forwards). A copy::

    seconds = copy_latency_s + nbytes / (rate[direction] * (1 if pinned else pageable_fraction))

Host time (:class:`HostCost`): a fixed cost per issued kernel or copy, per event call, and what
the trace's ``HostWork`` items carry (the engine's hooks, measured by ``bench.hook_cost``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ._trace import Copy, HostWork, Item, Kernel
from .gpus import GPUSpec

__all__ = ["kernel_seconds", "copy_seconds", "device_seconds", "attention_flops", "is_attention",
           "HostCost", "HOOK_COST", "pinned_alloc_seconds", "DeviceCost"]

DeviceCost = Callable[[Item, GPUSpec], float]
"""Device seconds of a ``Kernel`` or ``Copy`` on a spec (0 for anything else)."""

_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention",
              "flex_attention")


def is_attention(op: str) -> bool:
    """Whether the aten op name is a fused attention kernel (SDPA's flash / efficient / cuDNN, flex)."""
    return any(a in op for a in _ATTENTION)


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, *,
                    causal: bool, backward: bool) -> int:
    """FLOPs of one fused attention kernel (flash attention's accounting).

    Forward: two matmuls (Q K^T and P V), ``2 * 2 * b * h * s_q * s_kv * d`` = ``4 b h s_q s_kv d``;
    a causal mask skips half the blocks (``/ 2``). Backward: 2.5 forwards (five matmuls of that
    size, one of them the recomputed Q K^T), as the FlashAttention papers count it.
    """
    f = 4 * batch * heads * q_len * kv_len * head_dim
    if causal:
        f //= 2
    return f * 5 // 2 if backward else f


def kernel_seconds(k: Kernel, gpu: GPUSpec) -> float:
    """Device seconds of a kernel: the larger of its compute and memory time, plus a launch."""
    compute = k.flops / (gpu.flops_for(k.dtype) * gpu.matmul_efficiency) if k.flops else 0.0
    memory = k.bytes / (gpu.hbm_bytes_per_s * gpu.hbm_efficiency) if k.bytes else 0.0
    return max(compute, memory) + gpu.launch_s


def copy_seconds(c: Copy, gpu: GPUSpec) -> float:
    """Device seconds of a host<->device copy on its direction's copy engine."""
    rate = gpu.d2h_bytes_per_s if c.direction == "d2h" else gpu.h2d_bytes_per_s
    if not c.pinned:
        rate *= gpu.pageable_fraction
    return gpu.copy_latency_s + c.nbytes / rate


def device_seconds(item: Item, gpu: GPUSpec) -> float:
    """The default :data:`DeviceCost`: ``kernel_seconds`` / ``copy_seconds``, 0 for anything else."""
    if type(item) is Kernel:
        return kernel_seconds(item, gpu)
    if type(item) is Copy:
        return copy_seconds(item, gpu)
    return 0.0


# -- host side ------------------------------------------------------------------------------

_HOST_IPS = 3e9
"""Assumption: a host core retires ~3e9 instructions/s in the engine's Python hooks (~3 GHz at
~1 instruction per cycle). This project's 2-core machine measured 2.9 to 7.8 instructions/ns on the
Python keep path over four runs (bench/results/cpu/hook_cost.json at fe8c0a0, ours_keep: 32,309
instructions per pack in 4.3 us, idle; at 7b6d721: 32,251 in 4.1 us, idle; at 99b153a, shared with
other jobs: 32,084 in 4.9 us, and its "before" 31,754 in 10.9 us): the assumption is the slower end."""
_PACK_IR, _UNPACK_IR = 65_189, 35_142
"""Instructions per offloading pack / per reloading unpack of the engine's hooks:
bench/results/cpu/hook_cost.json (commit b934569, ``python -m bench.hook_cost --rounds 20``),
``instructions.variants.ours_offload`` (the Python hook, the slower end: the C++ hook's offload path,
``ours_offload_native``, the default where it builds, is 41,988 / 35,779); callgrind counts, within
~1% between runs of the same code (the ``none`` baseline each is taken from moves by up to ~50k
instructions a step)."""
HOOK_COST = {"pack hook": _PACK_IR / _HOST_IPS, "unpack hook": _UNPACK_IR / _HOST_IPS}
"""Host seconds per engine hook call (offload path), from the instruction counts above."""

_FRESH_PIN_BPS, _POOL_PIN_BPS = 11.2e9, 53.1e9
"""torchtitan's trainer comment (research section 6): a D2H into a fresh ``cudaHostAlloc`` per
tensor ran at 11.2 GB/s, into a reused pinned buffer at 53.1 GB/s (H100, 320 MB)."""


def pinned_alloc_seconds(nbytes: int) -> float:
    """Host seconds to page-lock ``nbytes`` of new host memory: the time a fresh pinned buffer
    added to a copy in torchtitan's measurement (``1/11.2 - 1/53.1`` s per GB)."""
    return nbytes * (1 / _FRESH_PIN_BPS - 1 / _POOL_PIN_BPS)


@dataclass(frozen=True, kw_only=True)
class HostCost:
    """Host seconds to issue each item of a trace (the host runs the step in program order)."""

    op_s: float = 5e-6
    """Per kernel or copy issued: eager dispatch plus ``cudaLaunchKernel`` / ``cudaMemcpyAsync``.
    Assumption: a few microseconds per op in eager PyTorch (research section 8.2, CPU side)."""
    event_s: float = 1e-6
    """Per event record, stream wait or ``record_stream``. Assumption (a driver call, no launch)."""
    alloc_s: float = 0.0
    """Per caching-allocator ``Alloc`` / ``Free`` (a cache hit: folded into ``op_s``)."""
    work_s: dict[str, float] = field(default_factory=lambda: dict(HOOK_COST))
    """Added to a ``HostWork`` item's own seconds by its ``what``: the engine's hooks
    (:data:`HOOK_COST`, measured by ``bench.hook_cost``)."""

    def __post_init__(self) -> None:
        for f in ("op_s", "event_s", "alloc_s"):
            v = getattr(self, f)
            if not v >= 0:
                raise ValueError(f"HostCost.{f} must be >= 0 seconds, got {v!r}")

    def __call__(self, item: Item) -> float:
        """Host seconds to issue ``item``."""
        t = type(item)
        if t is Kernel or t is Copy:
            return self.op_s
        if t is HostWork:
            return item.seconds + self.work_s.get(item.what, 0.0)
        if t.__name__ in ("RecordEvent", "WaitEvent", "RecordStream"):
            return self.event_s
        if t.__name__ in ("Alloc", "Free"):
            return self.alloc_s
        return 0.0
