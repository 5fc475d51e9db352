"""Replay recorded host-pool request traces through candidate pool designs.

Runbook (from the repo root, with ``PYTHONPATH=.``):
    python -m bench.pool_replay                 # replay bench/traces/*.json.gz into ./bench_runs/<run>/pool_replay.json
    python -m bench.pool_replay --out bench/results/cpu/pool_replay.json   # the file the README cites
    python -m bench.pool_replay --record        # first re-record the traces from the toy Llama (a few minutes on CPU)
    python -m bench.pool_replay --out /tmp/replay.json

(a) Recording: the toy Llama (``bench/model.py``) trains under
``OffloadActivations(device="cpu")`` while a recorder wraps the engine's pool
(``ctx.pool.take/give/trim``) and writes the sequence of takes (sizes), gives
and step ends (trims) to ``bench/traces/<name>.json.gz``. Traces:

- ``static``: h=256, 4 layers, batch 2, length 1024 every step.
- ``varying``: h=256, 4 layers, batch 2, a random length in 64..2048 every step.
- ``varying_small``: the test-suite toy (h=32), lengths 16..128 (issue 12 item 15's first report).

(b) Replay: each trace drives each design with the same calls, on meta
tensors (no real memory; the CPU cost per take is the pool's bookkeeping plus
one view). The real memory under a design is modelled with PyTorch's
CachingHostAllocator rule for pinned memory: every block is rounded up to a
power of two, a freed block stays cached for reuse at its rounded size until
``empty_host_cache`` (``_CachingHostModel``). Designs:

- ``exact_size``: the pool before issue 12 (buffers cached by exact byte size,
  released least recently used first, trimmed to the last step's peak).
- ``caching_alloc``: no pool; one pinned ``torch.empty`` per take, freed on give
  (what torchtune does).
- ``chunked``: today's ``offload.pool.HostPool``.
- ``chunked_fine``: the same growing by 1/32 of its size instead of 1/8.
- ``chunked_no_relayout``: the same without the first-step re-layout.
- ``chunked_pageable``: today's pool on unrounded memory (pageable, as with
  ``device="cpu"``, or ``pin_allocator="exact"``): page-granular chunks.

Metrics: allocations after warm-up (pool chunk/buffer allocations, and blocks
the modelled CUDA allocator really had to create: ``cudaHostAlloc`` calls),
reuse rate (takes served without a new allocation), peak bytes in use, the
peak real footprint (modelled pinned bytes, cached blocks included) over peak
in use, over the whole run and after warm-up (the steady state), the pool's
own peak reserved over peak in use, and CPU µs per take or give call (best of
``--repeat`` replays: the machine may be shared). Warm-up is the first step for ``static`` and the first 10 steps for
the varying traces; ``alloc_steps`` lists the steps that allocated.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.env import default_run_dir

from offload.pool import HostBuffer, HostPool
from offload._format import render_table

ROOT = Path(__file__).resolve().parent
TRACE_DIR = ROOT / "traces"
DEFAULT_OUT = ROOT / "results" / "cpu" / "pool_replay.json"


# -- traces -------------------------------------------------------------------


@dataclass
class Trace:
    """Host-pool requests of a training run: ``events`` k >= 0 takes ``sizes[k]`` bytes
    (buffer k), k < 0 gives buffer ``-k - 1`` back; ``trims`` are the event counts at
    which the engine ended a step."""

    name: str
    description: str
    sizes: list[int]
    events: list[int]
    trims: list[int]

    @property
    def steps(self) -> int:
        return len(self.trims)

    def save(self, path: Path) -> None:
        data = {"name": self.name, "description": self.description, "sizes": self.sizes,
                "events": self.events, "trims": self.trims}
        with gzip.open(path, "wt") as f:
            json.dump(data, f, separators=(",", ":"))

    @classmethod
    def load(cls, path: Path) -> Trace:
        with gzip.open(path, "rt") as f:
            return cls(**json.load(f))


class _Recorder:
    """Wraps one pool's take/give/trim (instance attributes) and logs the calls."""

    def __init__(self, pool: HostPool) -> None:
        self.sizes: list[int] = []
        self.events: list[int] = []
        self.trims: list[int] = []
        self._ids: dict[int, int] = {}
        take, give, trim = pool.take, pool.give, pool.trim

        def rec_take(nbytes: int) -> HostBuffer | None:
            buf = take(nbytes)
            if buf is not None:
                k = len(self.sizes)
                self.sizes.append(nbytes)
                self.events.append(k)
                self._ids[id(buf)] = k
            return buf

        def rec_give(buf: HostBuffer) -> None:
            k = self._ids.pop(id(buf), None)
            if k is not None:
                self.events.append(-k - 1)
            give(buf)

        def rec_trim() -> int:
            self.trims.append(len(self.events))
            return trim()

        pool.take, pool.give, pool.trim = rec_take, rec_give, rec_trim


def record(name: str, *, dim: int, layers: int, batch: int, lengths: list[int], description: str) -> Trace:
    """Train the toy Llama for ``len(lengths)`` steps under a CPU engine and record its pool calls."""
    import torch.nn.functional as F

    from bench.model import ToyLlama, ToyLlamaConfig, make_batch
    from offload import OffloadActivations

    cfg = ToyLlamaConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=4, max_seq_len=max(lengths))
    torch.manual_seed(0)
    model = ToyLlama(cfg)
    ctx = OffloadActivations(device="cpu")
    rec = _Recorder(ctx.pool)
    for step, seq in enumerate(lengths):
        tokens, targets = make_batch(cfg, batch, seq, seed=step)
        with ctx:
            logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        model.zero_grad(set_to_none=True)
        del logits
    return Trace(name, description, rec.sizes, rec.events, rec.trims)


def record_all() -> list[Trace]:
    rng = random.Random(0)
    traces = [
        record("static", dim=256, layers=4, batch=2, lengths=[1024] * 8,
               description="toy Llama h=256, 4 layers, batch 2, length 1024 every step, 8 steps"),
        record("varying", dim=256, layers=4, batch=2, lengths=[rng.randint(64, 2048) for _ in range(60)],
               description="toy Llama h=256, 4 layers, batch 2, random length 64..2048 per step, 60 steps"),
        record("varying_small", dim=32, layers=2, batch=2, lengths=[rng.randint(16, 128) for _ in range(30)],
               description="toy Llama h=32, 2 layers, batch 2, random length 16..128 per step, 30 steps"),
    ]
    TRACE_DIR.mkdir(parents=True, exist_ok=True)
    for t in traces:
        t.save(TRACE_DIR / f"{t.name}.json.gz")
    return traces


def load_all() -> list[Trace]:
    return [Trace.load(p) for p in sorted(TRACE_DIR.glob("*.json.gz"))]


# -- the memory underneath ----------------------------------------------------


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class _CachingHostModel:
    """PyTorch's CachingHostAllocator for pinned memory, by its rule: blocks rounded up to a
    power of two, freed blocks cached per rounded size until ``empty_cache``."""

    def __init__(self) -> None:
        self.cached: dict[int, int] = {}
        self.bytes = 0
        self.peak = 0
        self.host_allocs = 0

    def alloc(self, nbytes: int) -> None:
        size = _pow2_ceil(nbytes)
        if self.cached.get(size):
            self.cached[size] -= 1
            return
        self.host_allocs += 1
        self.bytes += size
        self.peak = max(self.peak, self.bytes)

    def free(self, nbytes: int) -> None:
        size = _pow2_ceil(nbytes)
        self.cached[size] = self.cached.get(size, 0) + 1

    def empty_cache(self) -> None:
        for size, n in self.cached.items():
            self.bytes -= size * n
        self.cached.clear()


# -- designs --------------------------------------------------------------------


def _meta(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="meta")


class _ChunkedOnModel(HostPool):
    """Today's pool on meta tensors, its chunks made by the modelled pinned allocator."""

    def __init__(self, mem: _CachingHostModel, **kw) -> None:
        super().__init__(pin=True, device_type="cuda", **kw)
        self.mem = mem

    def _new_tensor(self, nbytes: int):
        self.mem.alloc(nbytes)
        return _meta(nbytes), True, False

    def _release_chunk(self, chunk) -> None:
        self.mem.free(chunk.nbytes)
        super()._release_chunk(chunk)

    def _released_pinned(self, chunks) -> None:
        if chunks:
            self.mem.empty_cache()

    def _host_allocator_bytes(self) -> int:
        return self.mem.bytes


class _PageableMemory(_CachingHostModel):
    """Pageable (or cudaHostRegister'ed) memory: nothing rounded, nothing cached."""

    def alloc(self, nbytes: int) -> None:
        self.host_allocs += 1
        self.bytes += nbytes
        self.peak = max(self.peak, self.bytes)

    def free(self, nbytes: int) -> None:
        self.bytes -= nbytes


class _PageableChunked(_ChunkedOnModel):
    """Today's pool on unpinned memory (``device="cpu"``, or the "exact" register path):
    page-granular chunks. Replayed on pageable memory regardless of the model passed."""

    def __init__(self, mem: _CachingHostModel, **kw) -> None:
        mem.__class__ = _PageableMemory
        super().__init__(mem, **kw)
        self.pin = False


class _FineChunked(_ChunkedOnModel):
    growth = 1 / 32


class _NoRelayout(_ChunkedOnModel):
    relayout_above = float("inf")


class _ExactSizeModel:
    """The pool before issue 12, by its rules: free buffers cached by exact size; when a new
    size does not fit the cap, free buffers of other sizes go least recently returned first;
    ``trim`` releases (same order) down to the peak in use since the last trim. Freed
    pinned buffers stay in the CachingHostAllocator's cache (it never emptied it)."""

    def __init__(self, mem: _CachingHostModel) -> None:
        self.mem = mem
        self.free: OrderedDict[int, list[HostBuffer]] = OrderedDict()
        self.reserved = self.in_use = self.window_peak = 0
        self.peak_reserved = self.peak_in_use = 0
        self.allocations = self.reuses = 0

    def take(self, nbytes: int) -> HostBuffer:
        bufs = self.free.get(nbytes)
        if bufs:
            buf = bufs.pop()
            if not bufs:
                del self.free[nbytes]
            self.reuses += 1
        else:
            self.mem.alloc(nbytes)
            buf = HostBuffer(_meta(nbytes), nbytes, True)
            self.allocations += 1
            self.reserved += nbytes
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.in_use += nbytes
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        self.window_peak = max(self.window_peak, self.in_use)
        return buf

    def give(self, buf: HostBuffer) -> None:
        self.in_use -= buf.nbytes
        self.free.setdefault(buf.nbytes, []).append(buf)
        self.free.move_to_end(buf.nbytes)

    def trim(self) -> None:
        limit = max(self.window_peak, self.in_use)
        while self.reserved > limit and self.free:
            size, bufs = next(iter(self.free.items()))
            bufs.pop()
            if not bufs:
                del self.free[size]
            self.reserved -= size
            self.mem.free(size)
        self.window_peak = self.in_use

    def stats(self) -> dict:
        return {"allocations": self.allocations, "reuses": self.reuses, "peak_in_use_bytes": self.peak_in_use,
                "peak_reserved_bytes": self.peak_reserved}


class _CachingAllocOnly(_ExactSizeModel):
    """No pool: every take is a pinned ``torch.empty`` (the caching allocator's own reuse only)."""

    def take(self, nbytes: int) -> HostBuffer:
        self.mem.alloc(nbytes)
        self.allocations += 1
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.in_use += nbytes
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return HostBuffer(_meta(nbytes), nbytes, True)

    def give(self, buf: HostBuffer) -> None:
        self.in_use -= buf.nbytes
        self.reserved -= buf.nbytes
        self.mem.free(buf.nbytes)

    def trim(self) -> None:
        pass


DESIGNS: dict[str, Callable[[_CachingHostModel], object]] = {
    "exact_size": _ExactSizeModel,
    "caching_alloc": _CachingAllocOnly,
    "chunked": _ChunkedOnModel,
    "chunked_fine": _FineChunked,
    "chunked_no_relayout": _NoRelayout,
    "chunked_pageable": _PageableChunked,
}


# -- replay ---------------------------------------------------------------------


def replay(trace: Trace, design: str, *, warmup_steps: int | None = None) -> dict:
    """Drive one design with one trace; returns the metrics (see the module docstring)."""
    if warmup_steps is None:
        warmup_steps = 1 if trace.name.startswith("static") else 10
    mem = _CachingHostModel()
    pool = DESIGNS[design](mem)
    bufs: dict[int, HostBuffer] = {}
    trims = set(trace.trims)
    step = 0
    alloc_steps: dict[int, int] = {}
    host_alloc_steps: dict[int, int] = {}
    seconds = 0.0
    takes = 0
    steady = 0
    def count(allocs: int, host_allocs: int) -> None:
        new = pool.stats()["allocations"] - allocs
        if new:
            alloc_steps[step] = alloc_steps.get(step, 0) + new
        if mem.host_allocs > host_allocs:
            host_alloc_steps[step] = host_alloc_steps.get(step, 0) + mem.host_allocs - host_allocs

    for n, ev in enumerate(trace.events + [None]):
        while n in trims:  # a step ends before event n; what its trim allocates belongs to it
            allocs, host_allocs = pool.stats()["allocations"], mem.host_allocs
            pool.trim()
            count(allocs, host_allocs)
            trims.discard(n)
            step += 1
        if ev is None:
            break
        allocs, host_allocs = pool.stats()["allocations"], mem.host_allocs
        t0 = time.perf_counter()
        if ev >= 0:
            bufs[ev] = pool.take(trace.sizes[ev])
            takes += 1
        else:
            pool.give(bufs.pop(-ev - 1))
        seconds += time.perf_counter() - t0
        count(allocs, host_allocs)
        if step >= warmup_steps:
            steady = max(steady, mem.bytes)
    st = pool.stats()
    peak = st["peak_in_use_bytes"]
    return {
        "trace": trace.name,
        "design": design,
        "steps": trace.steps,
        "takes": takes,
        "warmup_steps": warmup_steps,
        "allocations": st["allocations"],
        "allocations_after_warmup": sum(v for k, v in alloc_steps.items() if k >= warmup_steps),
        "host_allocs": mem.host_allocs,
        "host_allocs_after_warmup": sum(v for k, v in host_alloc_steps.items() if k >= warmup_steps),
        "alloc_steps": sorted(alloc_steps),
        "reuse_rate": round(1 - st["allocations"] / takes, 4) if takes else None,
        "peak_in_use_bytes": peak,
        "peak_footprint_bytes": mem.peak,
        "footprint_ratio": round(mem.peak / peak, 3) if peak else None,
        "steady_footprint_bytes": steady,
        "steady_footprint_ratio": round(steady / peak, 3) if peak else None,
        "pool_reserved_ratio": round(st["peak_reserved_bytes"] / peak, 3) if peak else None,
        "us_per_call": round(1e6 * seconds / max(len(trace.events), 1), 2),
    }


def _table(rows: list[dict]) -> str:
    head = ("trace", "design", "steps", "takes", "allocs", "after warm-up", "cudaHostAlloc after",
            "reuse", "peak in use MiB", "footprint / peak", "after warm-up", "reserved / peak", "µs/call")
    body = [[r["trace"], r["design"], r["steps"], r["takes"], r["allocations"], r["allocations_after_warmup"],
             r["host_allocs_after_warmup"], f"{r['reuse_rate']:.1%}", f"{r['peak_in_use_bytes'] / 2**20:.1f}",
             f"{r['footprint_ratio']:.2f}x", f"{r['steady_footprint_ratio']:.2f}x",
             f"{r['pool_reserved_ratio']:.2f}x", r["us_per_call"]] for r in rows]
    return render_table([[str(x) for x in b] for b in body], head, fmt="github").rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="re-record the traces from the toy Llama first")
    ap.add_argument("--repeat", type=int, default=5, help="replays per design; µs/call is the best (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON (default: a fresh run folder ./bench_runs/<time>_pool_replay_cpu/; "
                         f"the README cites {DEFAULT_OUT.relative_to(ROOT.parent)})")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    traces = record_all() if args.record else load_all()
    if not traces:
        print(f"no traces under {TRACE_DIR}; run with --record", file=sys.stderr)
        return 1
    rows = []
    for t in traces:
        for d in DESIGNS:
            runs = [replay(t, d) for _ in range(args.repeat)]  # CPU cost: best of the repeats
            runs[0]["us_per_call"] = min(r["us_per_call"] for r in runs)
            rows.append(runs[0])
    print(_table(rows))
    if args.out is None:
        args.out = default_run_dir("pool_replay", "cpu") / "pool_replay.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "pool_replay",
        "command": "python -m bench.pool_replay" + (" --record" if args.record else ""),
        "env": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()},
        "traces": {t.name: {"description": t.description, "steps": t.steps, "takes": len(t.sizes)} for t in traces},
        "pool_settings": {k: getattr(HostPool, k) for k in
                          ("min_chunk_bytes", "growth", "relayout_above", "trim_slack")},
        "results": rows,
    }, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
