"""Named GPU specs for prediction: every number with its source.

``GPUS`` maps a name to a frozen :class:`GPUSpec`; ``dataclasses.replace(GPUS["h100-sxm"],
memory_bytes=...)`` makes a custom one, and every ``gpu=`` argument takes a name or a spec
(:func:`resolve_gpu`). Sources are cited per field in ``GPUSpec.sources``; a value with no
public measurement behind it says ``assumption`` there, so a reader can tell a datasheet
or a measurement from our guess. Units: bytes, bytes per second, FLOP per second (dense:
NVIDIA's "with sparsity" figures are twice these), seconds.

Main sources (short names used in ``sources``):

- ``mleng``: stas00/ml-engineering, compute/accelerator/README.md: dense peak table ("w/o
  sparsity") and the MAMF table (maximum achievable matmul FLOPS, torch 2.6-2.7).
- ``datasheet``: NVIDIA product datasheets (H100, H200, A100, L40S, GH200) and the Ada
  whitepaper (RTX 4090); dense figures (half of the "with sparsity" ones).
- ``nvsmi``: the total memory ``nvidia-smi`` reports for the board, as quoted in public
  bug reports (81559 MiB for H100 80GB, 143771 MiB for H200, ...).
- ``tt``: torchtitan's trainer comment on pinned copies: 53.1 GB/s D2H with a reused pinned
  320 MB buffer on H100, 11.2 GB/s with a fresh ``cudaHostAlloc`` per tensor, 32.3 GB/s
  reached in a real step.
- ``nvbw24``: NVIDIA/nvbandwidth issue #24 (H100 cluster): D2H 52.77 GB/s.
- ``vllm6496``: vLLM PR #6496 (GH200): H2D 342.39 GB/s, D2H 295.47 GB/s.
- ``bam54``: BaM issue #54: ~25 GB/s pinned on a PCIe Gen4 x16 A100.
- ``dask98``: dask-cuda issue #98: pageable copies about half the pinned rate.
- ``torchrec4315``: pytorch/torchrec PR #4315: same-direction copies from different streams
  serialise on one copy engine; D2H and H2D overlap.
See ``shared/research/simulators-2026-11.md`` section 6 for the survey these come from.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from ..sizes import to_bytes

__all__ = ["GPUSpec", "GPUS", "resolve_gpu"]

_MiB = 1 << 20
_GiB = 1 << 30


def _real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _positive(name: str, v: object) -> None:
    if not _real(v) or not 0 < v < math.inf:
        raise ValueError(f"GPUSpec.{name} must be a finite number > 0, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """What prediction assumes about one GPU and its host link."""

    name: str
    """Short name, the key in ``GPUS`` (a custom spec may use any name)."""
    memory_bytes: int
    """Device memory the board reports (total, before the CUDA context), bytes."""
    peak_flops: Mapping[torch.dtype, float] = field(hash=False)
    """Dense tensor-core peak per dtype, FLOP/s (matmul-class ops)."""
    matmul_efficiency: float
    """Achieved fraction of ``peak_flops`` on large GEMMs (MAMF / dense peak)."""
    hbm_bytes_per_s: float
    """Device memory bandwidth (datasheet), bytes/s."""
    hbm_efficiency: float = 0.85
    """Achieved fraction of ``hbm_bytes_per_s`` for large memory-bound kernels."""
    h2d_bytes_per_s: float
    """Host-to-device copy rate from pinned host memory, large copies, bytes/s."""
    d2h_bytes_per_s: float
    """Device-to-host copy rate into pinned host memory, large copies, bytes/s."""
    pageable_fraction: float = 0.5
    """Pageable copies run at this fraction of the pinned rate, and block the host."""
    copy_engines: int = 2
    """Copy engines: one per direction is what matters (same-direction copies serialise)."""
    launch_s: float = 4e-6
    """Fixed device time per kernel (launch and tail), seconds."""
    copy_latency_s: float = 10e-6
    """Fixed time per host<->device copy, seconds."""
    reserve_bytes: int = 1 * _GiB
    """Device memory not available to tensors: CUDA context, cuBLAS workspace, allocator slack."""
    link: str = ""
    """The host link, in words (for reports)."""
    sources: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)
    """Field name -> where its value comes from."""

    def __post_init__(self) -> None:
        """Every field checked, each refusal naming the field and the value (a bad spec would otherwise divide
        by zero in a replay, or make ``fits`` true for a step larger than the card)."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"GPUSpec.name must be a non-empty string, got {self.name!r}")
        for f in ("memory_bytes", "reserve_bytes"):  # one size parser (NOTE [ Sizes ] in offload/sizes.py)
            object.__setattr__(self, f, to_bytes(getattr(self, f), f, owner="GPUSpec", minimum=0 if f == "reserve_bytes"
                                                 else 1))
        if self.reserve_bytes >= self.memory_bytes:
            raise ValueError(f"GPUSpec.reserve_bytes={self.reserve_bytes} must be below memory_bytes={self.memory_bytes} "
                             "(usable memory = memory_bytes - reserve_bytes must be > 0); lower reserve_bytes")
        for f in ("hbm_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s"):
            _positive(f, getattr(self, f))
        for f in ("matmul_efficiency", "hbm_efficiency", "pageable_fraction"):
            v = getattr(self, f)
            if not _real(v) or not 0 < v <= 1:
                raise ValueError(f"GPUSpec.{f} must be a number in (0, 1], got {v!r}")
        for f in ("launch_s", "copy_latency_s"):
            v = getattr(self, f)
            if not _real(v) or not 0 <= v < math.inf:
                raise ValueError(f"GPUSpec.{f} must be a finite number of seconds >= 0, got {v!r}")
        if isinstance(self.copy_engines, bool) or not isinstance(self.copy_engines, int) or self.copy_engines < 1:
            raise ValueError(f"GPUSpec.copy_engines must be an int >= 1, got {self.copy_engines!r}")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise ValueError(f"GPUSpec.peak_flops must map at least one torch dtype to FLOP/s, got {self.peak_flops!r}")
        for dtype, flops in self.peak_flops.items():
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(f"GPUSpec.peak_flops: key {dtype!r} must be a floating torch dtype (torch.bfloat16, "
                                 "torch.float32, ...)")
            _positive(f"peak_flops[{dtype}]", flops)
        if not isinstance(self.link, str):
            raise ValueError(f"GPUSpec.link must be a string, got {self.link!r}")
        if not isinstance(self.sources, Mapping):
            raise ValueError(f"GPUSpec.sources must map field names to strings, got {self.sources!r}")
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    @property
    def usable_bytes(self) -> int:
        """Device memory a step may use: ``memory_bytes - reserve_bytes``."""
        return self.memory_bytes - self.reserve_bytes

    def flops_for(self, dtype: torch.dtype | None) -> float:
        """Dense peak FLOP/s for ``dtype`` (float32 matmuls use the TF32 entry when present)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == torch.float16 and torch.bfloat16 in self.peak_flops:
            return self.peak_flops[torch.bfloat16]
        return self.peak_flops.get(torch.float32, min(self.peak_flops.values()))

    def describe(self) -> str:
        """One line for a report: what this prediction assumed."""
        bf16 = self.peak_flops.get(torch.bfloat16, 0.0)
        return (f"{self.name}: {self.memory_bytes / _GiB:.1f} GiB, bf16 dense {bf16 / 1e12:.0f} TFLOP/s x "
                f"{self.matmul_efficiency:.3f} achieved, HBM {self.hbm_bytes_per_s / 1e12:.2f} TB/s, "
                f"pinned H2D {self.h2d_bytes_per_s / 1e9:.0f} / D2H {self.d2h_bytes_per_s / 1e9:.0f} GB/s"
                + (f" ({self.link})" if self.link else ""))


_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32

_PCIE5 = dict(h2d_bytes_per_s=53e9, d2h_bytes_per_s=53e9, link="PCIe Gen5 x16")
_PCIE5_SRC = {"h2d_bytes_per_s": "tt (53.1 GB/s reused pinned buffer, H100); assumed equal both ways",
              "d2h_bytes_per_s": "tt 53.1 GB/s; nvbw24 52.77 GB/s",
              "pageable_fraction": "dask98 (about half of pinned); assumption",
              "copy_engines": "torchrec4315: same-direction copies serialise",
              "launch_s": "assumption: a few microseconds per kernel (research section 8.2)",
              "copy_latency_s": "assumption",
              "reserve_bytes": "assumption: CUDA context (~0.5 GiB) + cuBLAS workspace + allocator slack",
              "hbm_efficiency": "assumption: 0.8-0.9 for large tensors (research section 8.2)"}
_PCIE4 = dict(h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, link="PCIe Gen4 x16")
_PCIE4_SRC = {**_PCIE5_SRC, "h2d_bytes_per_s": "bam54 (~25 GB/s pinned, Gen4 x16)",
              "d2h_bytes_per_s": "bam54 (~25 GB/s pinned, Gen4 x16)"}


def _spec(name: str, sources: dict[str, str], **kw) -> GPUSpec:
    return GPUSpec(name=name, sources=sources, **kw)


GPUS: Mapping[str, GPUSpec] = MappingProxyType({
    "h100-sxm": _spec(
        "h100-sxm", {**_PCIE5_SRC, "memory_bytes": "nvsmi 81559 MiB (H100 80GB HBM3)",
                     "peak_flops": "mleng/datasheet dense: bf16/fp16 989, fp32 67 TFLOP/s",
                     "matmul_efficiency": "mleng MAMF bf16 794.5 TFLOP/s = 0.803 of 989",
                     "hbm_bytes_per_s": "datasheet 3.35 TB/s"},
        memory_bytes=81559 * _MiB, peak_flops={_BF16: 989e12, _FP16: 989e12, _FP32: 67e12},
        matmul_efficiency=794.5 / 989, hbm_bytes_per_s=3.35e12, **_PCIE5),
    "h100-pcie": _spec(
        "h100-pcie", {**_PCIE5_SRC, "memory_bytes": "nvsmi 81559 MiB (H100 PCIe 80GB)",
                      "peak_flops": "datasheet dense: bf16/fp16 756, fp32 51 TFLOP/s",
                      "matmul_efficiency": "assumption: as H100 SXM (no published MAMF)",
                      "hbm_bytes_per_s": "datasheet 2.0 TB/s"},
        memory_bytes=81559 * _MiB, peak_flops={_BF16: 756e12, _FP16: 756e12, _FP32: 51e12},
        matmul_efficiency=794.5 / 989, hbm_bytes_per_s=2.0e12, **_PCIE5),
    "h200": _spec(
        "h200", {**_PCIE5_SRC, "memory_bytes": "nvsmi 143771 MiB (H200 141GB HBM3e)",
                 "peak_flops": "mleng/datasheet dense: bf16/fp16 989, fp32 67 TFLOP/s",
                 "matmul_efficiency": "mleng: MAMF 'H200 is the same' as H100 SXM (794.5)",
                 "hbm_bytes_per_s": "datasheet 4.8 TB/s"},
        memory_bytes=143771 * _MiB, peak_flops={_BF16: 989e12, _FP16: 989e12, _FP32: 67e12},
        matmul_efficiency=794.5 / 989, hbm_bytes_per_s=4.8e12, **_PCIE5),
    "gh200": _spec(
        "gh200", {**_PCIE5_SRC, "memory_bytes": "datasheet 96 GB HBM3 (94.5 GiB reported; assumption)",
                  "peak_flops": "mleng/datasheet dense: bf16/fp16 989, fp32 67 TFLOP/s",
                  "matmul_efficiency": "mleng MAMF bf16 828.6 TFLOP/s = 0.838 of 989",
                  "hbm_bytes_per_s": "datasheet 4.0 TB/s (96 GB HBM3)",
                  "h2d_bytes_per_s": "vllm6496 342.39 GB/s (NVLink-C2C)",
                  "d2h_bytes_per_s": "vllm6496 295.47 GB/s (NVLink-C2C)",
                  "pageable_fraction": "research section 6: GH200 pageable ~93 vs pinned ~97 GiB/s at 1 GiB"},
        memory_bytes=96768 * _MiB, peak_flops={_BF16: 989e12, _FP16: 989e12, _FP32: 67e12},
        matmul_efficiency=828.6 / 989, hbm_bytes_per_s=4.0e12, h2d_bytes_per_s=342e9,
        d2h_bytes_per_s=295e9, pageable_fraction=0.9, link="NVLink-C2C"),
    "a100-80gb": _spec(
        "a100-80gb", {**_PCIE4_SRC, "memory_bytes": "nvsmi 81920 MiB (A100-SXM4-80GB)",
                      "peak_flops": "mleng/datasheet dense: bf16/fp16 312, fp32 19.5 TFLOP/s",
                      "matmul_efficiency": "mleng MAMF bf16 271.2 TFLOP/s = 0.869 of 312",
                      "hbm_bytes_per_s": "datasheet 2.039 TB/s (PyTorch device_info)"},
        memory_bytes=81920 * _MiB, peak_flops={_BF16: 312e12, _FP16: 312e12, _FP32: 19.5e12},
        matmul_efficiency=271.2 / 312, hbm_bytes_per_s=2.039e12, **_PCIE4),
    "a100-40gb": _spec(
        "a100-40gb", {**_PCIE4_SRC, "memory_bytes": "nvsmi 40960 MiB (A100-SXM4-40GB)",
                      "peak_flops": "datasheet dense: bf16/fp16 312, fp32 19.5 TFLOP/s",
                      "matmul_efficiency": "mleng MAMF bf16 271.2 TFLOP/s (80 GB board) = 0.869",
                      "hbm_bytes_per_s": "datasheet 1.555 TB/s"},
        memory_bytes=40960 * _MiB, peak_flops={_BF16: 312e12, _FP16: 312e12, _FP32: 19.5e12},
        matmul_efficiency=271.2 / 312, hbm_bytes_per_s=1.555e12, **_PCIE4),
    "l40s": _spec(
        "l40s", {**_PCIE4_SRC, "memory_bytes": "nvsmi 46068 MiB (L40S 48GB GDDR6)",
                 "peak_flops": "datasheet dense (half the sparse 733): bf16/fp16 362, fp32 91.6 TFLOP/s",
                 "matmul_efficiency": "assumption: 0.7 (no published MAMF)",
                 "hbm_bytes_per_s": "datasheet 864 GB/s"},
        memory_bytes=46068 * _MiB, peak_flops={_BF16: 362e12, _FP16: 362e12, _FP32: 91.6e12},
        matmul_efficiency=0.7, hbm_bytes_per_s=864e9, **_PCIE4),
    "rtx-4090": _spec(
        "rtx-4090", {**_PCIE4_SRC, "memory_bytes": "nvsmi 24564 MiB (RTX 4090 24GB)",
                     "peak_flops": "Ada whitepaper dense, FP32 accumulate: bf16/fp16 165.2, fp32 82.6 TFLOP/s",
                     "matmul_efficiency": "assumption: 0.7 (no published MAMF)",
                     "hbm_bytes_per_s": "whitepaper 1008 GB/s GDDR6X"},
        memory_bytes=24564 * _MiB, peak_flops={_BF16: 165.2e12, _FP16: 165.2e12, _FP32: 82.6e12},
        matmul_efficiency=0.7, hbm_bytes_per_s=1008e9, reserve_bytes=_GiB // 2, **_PCIE4),
})
"""The GPUs prediction knows by name; see each spec's ``sources``."""


def _squash(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def resolve_gpu(gpu: str | GPUSpec) -> GPUSpec:
    """``gpu`` as a spec: a name of ``GPUS`` (case, ``-`` and ``_`` ignored: ``"H100_SXM"``, ``"h100sxm"``) or a
    ``GPUSpec`` itself. An unknown name is refused with the names it may have meant: every known GPU whose name
    contains it (``"h100"``: ``h100-sxm``, ``h100-pcie``), else the closest spellings."""
    if isinstance(gpu, GPUSpec):
        return gpu
    if isinstance(gpu, str):
        key = _squash(gpu)
        by_key = {_squash(n): n for n in GPUS}
        if key in by_key:
            return GPUS[by_key[key]]
        close = [n for k, n in by_key.items() if key and key in k] or \
            [by_key[k] for k in difflib.get_close_matches(key, list(by_key), n=2)]
        hint = f" (did you mean {' or '.join(repr(n) for n in close)}?)" if close else ""
        raise ValueError(f"offload.predict: gpu={gpu!r} is not a known GPU{hint}. Known: {sorted(GPUS)}; "
                         "or pass a GPUSpec, e.g. dataclasses.replace(GPUS['h100-sxm'], memory_bytes=...)")
    raise TypeError(f"offload.predict: gpu must be a name of GPUS or a GPUSpec, got {type(gpu).__name__}")
