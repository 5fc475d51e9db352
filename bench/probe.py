"""Bandwidth probe: the host<->device copy ceiling that offload numbers are judged against.

On a GPU: pinned and pageable host memory, H2D and D2H, 1 MB to 1 GB, each
measured alone and again while a bf16 matmul loop keeps the compute stream
busy (the copies then run on a side stream, as the engine's do). Copy time is
taken with CUDA events on the copying stream.

On CPU there is no pinned memory and no link: the probe reports plain memcpy
GB/s (``torch.Tensor.copy_`` between two host tensors) and says pinned is n/a.

    python -m bench.probe                  # default sizes, writes ./bench_runs/<time>_probe_<device>/probe.json
    python -m bench.probe --max-mb 64      # quicker
    python -m bench.probe --out bench/results/<device>    # where README citations live
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.env import default_run_dir, device_slug, run_metadata
from bench.progress import bar
from bench.results import Ceiling, to_jsonable
from offload._format import render_table

__all__ = ["ProbePoint", "ProbeResult", "run_probe", "measure_ceiling", "main"]

_MB = 1 << 20
DEFAULT_SIZES_MB = (1, 4, 16, 64, 256, 1024)
_TARGET_BYTES_PER_POINT = 2 << 30  # reps so that each point moves ~2 GiB (at least 2, at most 50 copies)
_MATMUL_N = 8192


@dataclass
class ProbePoint:
    direction: str
    """``"h2d"``, ``"d2h"`` or ``"memcpy"`` (CPU)."""
    memory: str
    """``"pinned"``, ``"pageable"`` or ``"host"`` (CPU memcpy)."""
    size_bytes: int
    seconds: float
    """Seconds per copy (mean over ``reps``)."""
    reps: int
    under_matmul: bool = False
    """Measured while a matmul loop ran on the compute stream."""

    @property
    def gb_s(self) -> float:
        return self.size_bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


@dataclass
class ProbeResult:
    device: str
    points: list[ProbePoint] = field(default_factory=list)
    matmul_tflops_alone: float | None = None
    matmul_tflops_during_copies: float | None = None
    notes: list[str] = field(default_factory=list)

    def best(self, direction: str, memory: str, *, under_matmul: bool = False) -> float | None:
        """Highest GB/s over sizes for one (direction, memory, contention) series."""
        xs = [p.gb_s for p in self.points
              if p.direction == direction and p.memory == memory and p.under_matmul == under_matmul]
        return max(xs) if xs else None

    @property
    def pinned_d2h_gb_s(self) -> float | None:
        return self.best("d2h", "pinned")

    @property
    def pinned_h2d_gb_s(self) -> float | None:
        return self.best("h2d", "pinned")

    def table(self) -> str:
        sizes = sorted({p.size_bytes for p in self.points})
        keys = sorted({(p.direction, p.memory, p.under_matmul) for p in self.points})
        body = []
        for d, m, u in keys:
            by = {p.size_bytes: p.gb_s for p in self.points if (p.direction, p.memory, p.under_matmul) == (d, m, u)}
            body.append([d, m, "matmul" if u else "alone", *(f"{by[s]:.2f}" if s in by else "-" for s in sizes)])
        rows = [render_table(body, ["direction", "memory", "contention", *map(_size_label, sizes)]).rstrip("\n")]
        rows.append("(GB/s, 1 GB = 1e9 bytes)")
        if self.matmul_tflops_alone is not None:
            rows.append(
                f"bf16 matmul {_MATMUL_N}^3: {self.matmul_tflops_alone:.0f} TFLOP/s alone, "
                f"{self.matmul_tflops_during_copies or float('nan'):.0f} TFLOP/s while copies ran"
            )
        rows.extend(self.notes)
        return "\n".join(rows)


def _size_label(n: int) -> str:
    return f"{n // _MB}MB" if n < 1024 * _MB else f"{n // (1024 * _MB)}GB"


def _reps(size: int) -> int:
    return max(2, min(50, _TARGET_BYTES_PER_POINT // size))


# ------------------------------------------------------------------- CPU


def _cpu_points(sizes: list[int], progress: Any) -> list[ProbePoint]:
    points = []
    for size in sizes:
        progress.set_postfix_str(f"memcpy {_size_label(size)}")
        src = torch.ones(size, dtype=torch.uint8)
        dst = torch.empty(size, dtype=torch.uint8)
        dst.copy_(src)  # fault the pages in
        reps = max(2, min(20, (256 * _MB) // size))
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        points.append(ProbePoint("memcpy", "host", size, (time.perf_counter() - t0) / reps, reps))
        progress.update(1)
    return points


# ------------------------------------------------------------------- GPU


def _gpu_copy_seconds(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream, reps: int) -> float:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)  # warm-up (first-touch, driver staging)
        start.record(stream)
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _matmul_seconds(a: torch.Tensor, b: torch.Tensor, n: int) -> float:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def _gpu_points(device: torch.device, sizes: list[int], contention: bool, result: ProbeResult,
                progress: Any) -> None:
    side = torch.cuda.Stream(device=device)
    a = b = None
    t_mm = None
    if contention:
        a = torch.randn(_MATMUL_N, _MATMUL_N, device=device, dtype=torch.bfloat16)
        b = torch.randn(_MATMUL_N, _MATMUL_N, device=device, dtype=torch.bfloat16)
        _matmul_seconds(a, b, 3)
        t_mm = _matmul_seconds(a, b, 10)
        result.matmul_tflops_alone = 2 * _MATMUL_N**3 / t_mm / 1e12
    busy_mm_seconds: list[float] = []
    for size in sizes:
        dev = torch.empty(size, dtype=torch.uint8, device=device)
        dev.fill_(1)
        torch.cuda.synchronize(device)  # the side stream below does not wait on the compute stream
        for memory in ("pinned", "pageable"):
            progress.set_postfix_str(f"{memory} {_size_label(size)}")
            host = torch.empty(size, dtype=torch.uint8, pin_memory=(memory == "pinned"))
            host.fill_(1)
            reps = _reps(size)
            for direction, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
                alone = _gpu_copy_seconds(dst, src, side, reps)
                result.points.append(ProbePoint(direction, memory, size, alone, reps))
                if not contention:
                    continue
                # Queue enough matmuls on the compute stream to outlast the copies, then copy on the side stream.
                n_mm = max(2, int(1.5 * (alone * (reps + 1)) / t_mm) + 1)
                torch.cuda.synchronize(device)
                mm_start = torch.cuda.Event(enable_timing=True)
                mm_end = torch.cuda.Event(enable_timing=True)
                mm_start.record()
                for _ in range(n_mm):
                    torch.mm(a, b)
                mm_end.record()
                busy = _gpu_copy_seconds(dst, src, side, reps)
                mm_end.synchronize()
                busy_mm_seconds.append(mm_start.elapsed_time(mm_end) / 1e3 / n_mm)
                result.points.append(ProbePoint(direction, memory, size, busy, reps, under_matmul=True))
            progress.update(1)
            del host
        del dev
    if busy_mm_seconds:
        result.matmul_tflops_during_copies = 2 * _MATMUL_N**3 / (sum(busy_mm_seconds) / len(busy_mm_seconds)) / 1e12


def run_probe(device: str | torch.device, sizes_mb: list[int] | tuple[int, ...] = DEFAULT_SIZES_MB,
              *, contention: bool = True, progress: bool = False) -> ProbeResult:
    """Measure copy bandwidth on ``device`` for each size (MB = 2**20 bytes); ``progress``: a bar on stderr."""
    dev = torch.device(device)
    sizes = [int(s * _MB) for s in sizes_mb]
    result = ProbeResult(device=str(dev))
    with bar(len(sizes) * (2 if dev.type == "cuda" else 1), "probe", enabled=progress, unit="point") as pbar:
        _probe_into(dev, sizes, contention, result, pbar)
    return result


def _probe_into(dev: torch.device, sizes: list[int], contention: bool, result: ProbeResult, pbar: Any) -> None:
    if dev.type == "cuda":
        _gpu_points(dev, sizes, contention, result, pbar)
        result.notes.append("pinned copies use cudaMemcpyAsync from page-locked memory (torch pin_memory=True)")
    else:
        result.points = _cpu_points(sizes, pbar)
        result.notes.append(
            "cpu: host and device are the same memory; this is memcpy bandwidth. "
            "pinned: n/a on CPU (no pinned-memory allocator); under-matmul: n/a on CPU."
        )


def measure_ceiling(device: str | torch.device, *, progress: bool = False) -> Ceiling:
    """A quick ceiling for ``python -m bench``: pinned D2H/H2D at 256 MB on a GPU, memcpy at 64 MB on CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        r = run_probe(dev, (256,), contention=False, progress=progress)
        return Ceiling(kind="pinned", d2h_gb_s=r.pinned_d2h_gb_s, h2d_gb_s=r.pinned_h2d_gb_s,
                       size_bytes=256 * _MB, note="pinned copy, 256 MB, side stream, alone (bench.probe)")
    r = run_probe(dev, (64,), progress=progress)
    bw = r.best("memcpy", "host")
    return Ceiling(kind="memcpy", d2h_gb_s=bw, h2d_gb_s=bw, size_bytes=64 * _MB,
                   note="cpu memcpy, 64 MB; pinned n/a on CPU")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-mb", type=int, default=None, help="largest size in MB (default 1024 on GPU, 256 on CPU)")
    p.add_argument("--no-contention", action="store_true", help="skip the under-matmul measurements")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for probe.json (default ./bench_runs/<time>_probe_<device>/; "
                        "bench/results/<device> for files the README cites)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    max_mb = args.max_mb if args.max_mb is not None else (1024 if dev.type == "cuda" else 256)
    sizes = [s for s in DEFAULT_SIZES_MB if s <= max_mb] or [max_mb]
    result = run_probe(dev, sizes, contention=not args.no_contention, progress=True)
    print(result.table())
    out_dir = args.out if args.out is not None else default_run_dir("probe", device_slug(dev))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "probe.json"
    meta = run_metadata(dev, argv)
    meta["command"] = "python -m bench.probe " + " ".join(argv if argv is not None else sys.argv[1:])
    path.write_text(json.dumps({"meta": meta, "probe": to_jsonable(result)}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
