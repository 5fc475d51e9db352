"""(b) Offloading vs activation checkpointing on one model: memory kept, step time, same gradients.

Four ways to run the same step: keep everything (none), recompute each block
(ac), offload what is saved (offload), and offload only the checkpoint inputs
(offload+ac). Every run goes through an OffloadActivations engine, so its
ledger measures the bytes each way leaves on the device; ``none`` and ``ac``
use one with ``min_offload_size`` beyond any tensor (accounting only, nothing
moved). Gradients are compared bitwise with ``none``.

Runbook (after ``pip install -e .``, or with ``PYTHONPATH=.`` from the repo root):
    python examples/offload_vs_checkpointing.py                   # CPU, tiny
    python examples/offload_vs_checkpointing.py --dim 2048 --layers 8 --seq 4096   # on a GPU, unchanged
On CPU it runs with one intra-op thread (``--threads``), so its step times are steady on a shared
machine; they are the median of ``--steps`` steps after one warm-up step.
For the full comparison (SAC, peers, many metrics) run ``python -m bench``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is a repo tool: run from a checkout
from bench.model import ToyLlama, ToyLlamaConfig, make_batch
from offload import OffloadActivations

MiB = 2**20


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU (default 1: steady timings on a shared machine; "
                        "0 = torch's own choice); ignored on a GPU")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and args.threads:
        torch.set_num_threads(args.threads)  # steady CPU timings: no intra-op workers waiting on each other
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = ToyLlamaConfig(vocab_size=512, dim=args.dim, n_layers=args.layers,
                         n_heads=max(1, args.dim // 64), max_seq_len=args.seq)
    torch.manual_seed(0)
    model = ToyLlama(cfg).to(device=device, dtype=dtype)
    tokens, targets = make_batch(cfg, 2, args.seq, device=device)
    engine_device = None if cuda else "cpu"
    ways = {  # name: (checkpoint_blocks, min_offload_size)
        "none": (False, 1 << 62), "ac": (True, 1 << 62), "offload": (False, 1024), "offload+ac": (True, 1024),
    }
    reference = None
    print(f"{'way':<11} {'step ms':>8} {'left on device MiB':>19} {'moved to host MiB':>18}  grads == none")
    for name, (checkpoint_blocks, min_size) in ways.items():
        model.checkpoint_blocks = checkpoint_blocks
        ctx = OffloadActivations(device=engine_device, min_offload_size=min_size)
        times_ms = []
        for step in range(args.steps + 1):  # the first step warms the host pool
            ctx.ledger.reset()  # so the summary below covers the last step only
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with ctx:
                logits = model(tokens)  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
            if step:
                times_ms.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times_ms)
        t = ctx.ledger.summary()
        # Left on the device: what autograd saved, minus weights (resident anyway), minus what moved
        # to host, minus repeat saves of a moved storage (they share its host copy).
        by = t["kept_by_reason"]
        resident = (t["packed_bytes"] - t["offloaded_bytes"]
                    - sum(by.get(r, 0) for r in ("parameter", "buffer", "duplicate_storage")))
        grads = [p.grad.clone() for p in model.parameters()]
        if reference is None:
            reference, same = (loss.detach(), grads), "reference"
        else:
            same = torch.equal(loss.detach(), reference[0]) and all(map(torch.equal, grads, reference[1]))
        print(f"{name:<11} {ms:8.1f} {resident / MiB:19.2f} {t['offloaded_bytes'] / MiB:18.2f}  {same}")


if __name__ == "__main__":
    main()
