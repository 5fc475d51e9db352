"""FSDP2 (or DDP) training with activation offloading under torchrun, one ledger per rank.

Runbook, from the repo root after ``pip install -e .`` (or prefix ``PYTHONPATH=.``); the same
file runs on CPU with gloo and on GPUs with nccl, the backend follows the hardware:

    torchrun --nproc_per_node=2 examples/torchrun_fsdp2.py
    python examples/torchrun_fsdp2.py              # the same: without torchrun it launches itself on 2 processes
    torchrun --nproc_per_node=2 examples/torchrun_fsdp2.py --parallel ddp --steps 20 --out /tmp/offload_run
    torchrun --nproc_per_node=8 examples/torchrun_fsdp2.py --dim 1024 --layers 8 --seq 2048 --ac   # 8 GPUs

With ``--out DIR`` each rank writes ``DIR/ledger_rank<R>.json`` (every pack decision and per-step
totals); without it each rank writes its ledger into a temporary folder of its own, removed at exit
(concurrent runs never share a path, and nothing is left behind). Each rank prints one line:
offloaded vs kept bytes. On GPU, activations move to
pinned host memory; on CPU, ``device="cpu"`` copies them into the host pool so the
whole path runs for real. Sharded (DTensor) parameters and the unsharded weight
views FSDP2 gathers are never offloaded: they show up as kept, reason "parameter";
the output head's activations stay on the device as "excluded_region".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is a repo tool: run from a checkout
from bench.model import ToyLlama, ToyLlamaConfig, make_batch
from offload import get_act_offloading_ctx_manager


_LOCAL_PROCS = 2
"""Processes started when the script is run without torchrun."""


def _launch_locally() -> int:
    """Not under torchrun (no RANK in the environment): start torchrun's launcher with 2 local processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={_LOCAL_PROCS}",
           __file__, *sys.argv[1:]]
    print(f"no RANK in the environment (not started by torchrun): launching {_LOCAL_PROCS} local processes:\n"
          f"  torchrun --standalone --nproc_per_node={_LOCAL_PROCS} {' '.join([__file__, *sys.argv[1:]])}",
          flush=True)
    return subprocess.call(cmd)


def _check_world_fits(world: int, local_world: int) -> None:
    """On CPU, more ranks than cores (the 8-rank line) would crawl for hours: stop and say what to run."""
    cores = os.cpu_count() or 1
    if torch.cuda.is_available():
        if local_world > torch.cuda.device_count():
            raise SystemExit(f"torchrun_fsdp2.py: {local_world} processes per node but {torch.cuda.device_count()} "
                             f"GPUs; use --nproc_per_node={torch.cuda.device_count()}")
        return
    if local_world > cores:
        if int(os.environ.get("LOCAL_RANK", 0)) != 0:
            time.sleep(5)  # let rank 0 fail first, so torchrun shows its message rather than killing it
            raise SystemExit(2)
        raise SystemExit(
            f"torchrun_fsdp2.py: {local_world} processes per node need a GPU each (one rank per GPU); this machine "
            f"has no CUDA GPU and {cores} CPU cores. On CPU run 2 ranks with the default tiny shapes:\n"
            f"  torchrun --nproc_per_node=2 examples/torchrun_fsdp2.py      (or: python examples/torchrun_fsdp2.py)")


def _write_ledger(ctx: object, out: Path | None, rank: int) -> None:
    """``<out>/ledger_rank<R>.json``; without ``out`` into a temporary folder of this rank's, removed here."""
    with contextlib.ExitStack() as stack:
        folder = out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"offload_ledger_rank{rank}_")))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"ledger_rank{rank}.json"
        ctx.ledger.to_json(str(path))
        if rank == 0:
            kept = f"in {folder}" if out else "in a temporary folder, removed (--out DIR keeps them)"
            print(f"ledgers written {kept}; rank 0's: {path.stat().st_size} bytes", flush=True)


def main() -> None:
    if "RANK" not in os.environ:
        raise SystemExit(_launch_locally())
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parallel", choices=("fsdp2", "ddp"), default="fsdp2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ac", action="store_true", help="checkpoint each block: offload only block inputs")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder to keep ledger_rank<R>.json in (default: a temporary folder per rank, removed at exit)")
    args = ap.parse_args()

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    _check_world_fits(int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend, offload_device = "nccl", None  # None: offload from the current GPU to pinned host memory
    else:
        device, backend, offload_device = torch.device("cpu"), "gloo", "cpu"
    dist.init_process_group(backend)
    world = dist.get_world_size()

    torch.manual_seed(0)  # same initial weights on every rank
    cfg = ToyLlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=max(512, args.seq))
    model = ToyLlama(cfg).to(device)
    model.checkpoint_blocks = args.ac
    if args.parallel == "fsdp2":
        mesh = init_device_mesh(device.type, (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # One engine per rank, reused every step; the output head stays on the device (its activations
    # are needed first in backward). Forward inside it, backward outside (torchtune style).
    ctx = get_act_offloading_ctx_manager(model, True, device=offload_device)
    for step in range(args.steps):
        tokens, targets = make_batch(cfg, args.batch, args.seq, device=device, seed=world * step + rank)
        with ctx:
            logits = model(tokens)  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _write_ledger(ctx, args.out, rank)
    s = ctx.ledger.summary()
    print(
        f"rank {rank}/{world} {args.parallel} {backend}: loss {loss.item():.4f}, steps {s['steps']}, "
        f"offloaded {s['offloaded_bytes'] / 2**20:.2f} MiB in {s['offloaded_count']} tensors, "
        f"kept {s['kept_bytes'] / 2**20:.2f} MiB {s['kept_count_by_reason']}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
